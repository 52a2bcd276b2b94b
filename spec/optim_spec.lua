-- spec/optim_spec.lua — uly.optim: AdamW and SGD against float64 Lua references, the default
-- weight-decay rule, grad_norm / clip_grad_norm, thread-count invariance, LR schedules,
-- state_dict round trips, error messages and a small end-to-end fit.
local uly = require 'ulysses'
local helpers = require 'helpers'
local optim = uly.optim
local C = uly.C

local function set_grad(p, g)
  assert(C.uly_tensor_set_grad(p._h, g and g._h or nil) == 0)
end

local function randn_list(n) -- n standard normals as a flat Lua list (from the library's generator)
  return helpers.list(uly.randn(n))
end

local function same_bits(a, b, what)
  local va, n = helpers.values(a)
  local vb, m = helpers.values(b)
  assert.are.equal(n, m)
  for i = 0, n - 1 do
    if va[i] ~= vb[i] then error(string.format('%s: element %d differs: %.9g vs %.9g', what, i + 1, va[i], vb[i]), 2) end
  end
end

-- float64 AdamW (torch.optim.AdamW) over flat lists, in place
local function adamw_ref(p, m, v, g, lr, b1, b2, eps, wd, step)
  local bc1, bc2 = 1 - b1 ^ step, 1 - b2 ^ step
  for i = 1, #p do
    p[i] = p[i] * (1 - lr * wd)
    m[i] = b1 * m[i] + (1 - b1) * g[i]
    v[i] = b2 * v[i] + (1 - b2) * g[i] * g[i]
    p[i] = p[i] - (lr / bc1) * m[i] / (math.sqrt(v[i]) / math.sqrt(bc2) + eps)
  end
end

-- float64 SGD (torch.optim.SGD) over flat lists, in place; buf = nil without momentum
local function sgd_ref(p, buf, g, lr, momentum, dampening, wd, nesterov, step)
  for i = 1, #p do
    local d = g[i] + wd * p[i]
    if momentum ~= 0 then
      buf[i] = step == 1 and d or momentum * buf[i] + (1 - dampening) * d
      d = nesterov and d + momentum * buf[i] or buf[i]
    end
    p[i] = p[i] - lr * d
  end
end

describe('optim.AdamW', function()
  before_each(function() helpers.reseed(3301) end)

  it('matches a float64 AdamW over 3 steps (decayed 2-D, undecayed 1-D, a param without grad)', function()
    local w = uly.randn(7, 5, { requires_grad = true })
    local b = uly.randn(33, { requires_grad = true })
    local u = uly.randn(3, 1, { requires_grad = true })   -- never gets a grad
    local u0 = u:clone()
    local lr, b1, b2, eps, wd = 0.05, 0.8, 0.99, 1e-6, 0.2
    local opt = optim.AdamW({ w, b, u }, { lr = lr, betas = { b1, b2 }, eps = eps, weight_decay = wd })
    local ref = {
      { p = helpers.list(w), m = {}, v = {}, wd = wd, t = w, n = 35 },
      { p = helpers.list(b), m = {}, v = {}, wd = 0, t = b, n = 33 },
    }
    for _, r in ipairs(ref) do for i = 1, r.n do r.m[i], r.v[i] = 0, 0 end end
    for step = 1, 3 do
      for _, r in ipairs(ref) do
        local g = randn_list(r.n)
        set_grad(r.t, helpers.from_flat(g, r.t:shape()))
        adamw_ref(r.p, r.m, r.v, g, lr, b1, b2, eps, r.wd, step)
      end
      opt:step()
      assert.are.equal(step, opt.step_count)
    end
    local st = opt:state_dict().state
    for k, r in ipairs(ref) do
      helpers.assert_close(r.t, r.p, 1e-5, 1e-6, 'param ' .. k)
      helpers.assert_close(st.exp_avg[k], r.m, 1e-5, 1e-6, 'exp_avg ' .. k)
      helpers.assert_close(st.exp_avg_sq[k], r.v, 1e-5, 1e-7, 'exp_avg_sq ' .. k)
    end
    same_bits(u, u0, 'param without grad')
    helpers.assert_close(st.exp_avg[3], { 0, 0, 0 }, 0, 0, 'state of the param without grad')
  end)

  -- torch.optim.AdamW passes 1 - beta as a Python float (double) that the f32 kernel rounds once:
  -- float(1 - 0.999) = 0.0010000000475, where 1.0f - 0.999f = 0.00099998713 (1.3e-5 relative)
  it('rounds 1 - beta from double, as torch.optim.AdamW does: one step from zero state, exactly', function()
    local ffi = require 'ffi'
    local f32 = function(x) return tonumber(ffi.new('float[1]', x)[0]) end
    for _, betas in ipairs { { 0.9, 0.999 }, { 0.8, 0.95 }, { 0.6, 0.99 } } do
      local p = uly.zeros(4, { requires_grad = true })
      local opt = optim.AdamW({ p }, { lr = 0.1, betas = betas, weight_decay = 0 })
      set_grad(p, uly.ones(4))
      opt:step()
      local st = opt:state_dict().state
      assert.are.equal(f32(1 - betas[1]), helpers.list(st.exp_avg[1])[1], 'exp_avg, beta1 ' .. betas[1])
      assert.are.equal(f32(1 - betas[2]), helpers.list(st.exp_avg_sq[1])[1], 'exp_avg_sq, beta2 ' .. betas[2])
    end
  end)

  it('SGD rounds 1 - dampening from double, as torch.optim.SGD does: the second step\'s buffer, exactly', function()
    local ffi = require 'ffi'
    local f32 = function(x) return tonumber(ffi.new('float[1]', x)[0]) end
    for _, c in ipairs { { 0.9, 0.95 }, { 0.5, 0.33 }, { 0.99, 0.999 } } do   -- where 1.0f - dampening differs
      local p = uly.zeros(3, { requires_grad = true })
      local opt = optim.SGD({ p }, { lr = 0.1, momentum = c[1], dampening = c[2] })
      for _ = 1, 2 do   -- the first step sets the buffer to the grad (1); the second: momentum + (1 - dampening)
        set_grad(p, uly.ones(3))
        opt:step()
      end
      assert.are.equal(f32(f32(c[1]) + f32(1 - c[2])), helpers.list(opt.state.momentum_buf[1])[1],
                       'momentum ' .. c[1] .. ', dampening ' .. c[2])
    end
  end)

  it('decays only tensors with 2+ dims by default; groups override', function()
    local b = uly.randn(9, { requires_grad = true })
    local w = uly.randn(4, 6, { requires_grad = true })
    local k = uly.randn(2, 3, 5, { requires_grad = true })
    local opt = optim.AdamW({ b, w, k }, { lr = 0.1, weight_decay = 0.25 })
    assert.are.same({ 0, 0.25, 0.25 }, opt.weight_decays)
    -- zero grads: the Adam term is exactly 0, only the decay moves a parameter
    local before = { b:clone(), w:clone(), k:clone() }
    for _, p in ipairs({ b, w, k }) do set_grad(p, uly.zeros(p:shape())) end
    opt:step()
    same_bits(b, before[1], 'undecayed 1-D param')
    helpers.assert_close(w, before[2]:mul(1 - 0.1 * 0.25), 1e-7, 0, 'decayed 2-D param')
    helpers.assert_close(k, before[3]:mul(1 - 0.1 * 0.25), 1e-7, 0, 'decayed 3-D param')

    local g = optim.AdamW({ { params = { w }, weight_decay = 0 }, { params = { b } } ,
                            { params = { k }, weight_decay = 0.5 } }, { weight_decay = 0.1 })
    assert.are.same({ 0, 0, 0.5 }, g.weight_decays)
    assert.are.same({ w, b, k }, g.params)
  end)

  it('takes a module, lets lr be set between steps, and zero_grad drops or zeroes grads', function()
    local m = uly.nn.Linear(3, 2)
    local opt = optim.AdamW(m, { lr = 0.01 })
    assert.are.equal(2, #opt.params)
    assert.are.equal(m.weight, opt.params[1])
    for _, p in ipairs(opt.params) do set_grad(p, uly.ones(p:shape())) end
    opt.lr = 0   -- a zero learning rate leaves the parameters as they are
    local w0 = m.weight:clone()
    opt:step()
    same_bits(m.weight, w0, 'weight after a step with lr = 0')
    opt.lr = 0.01
    opt:step()
    local moved = 0
    for i, x in ipairs(helpers.list(m.weight)) do moved = math.max(moved, math.abs(x - helpers.list(w0)[i])) end
    assert.truthy(moved > 1e-3, 'the weight did not move: ' .. moved)
    opt:zero_grad(false)
    helpers.assert_close(m.weight.grad, uly.zeros(3, 2), 0, 0, 'zeroed grad')
    opt:zero_grad()
    assert.is_nil(m.weight.grad)
    assert.is_nil(m.bias.grad)
  end)
end)

describe('optim.SGD', function()
  before_each(function() helpers.reseed(3302) end)

  local function run(opts, steps)
    local p = uly.randn(5, 3, { requires_grad = true })
    local q = uly.randn(11, { requires_grad = true })
    local opt = optim.SGD({ p, q }, opts)
    local ref = { { t = p, p = helpers.list(p), buf = {} }, { t = q, p = helpers.list(q), buf = {} } }
    for step = 1, steps do
      for _, r in ipairs(ref) do
        local g = randn_list(#r.p)
        set_grad(r.t, helpers.from_flat(g, r.t:shape()))
        sgd_ref(r.p, r.buf, g, opts.lr, opts.momentum or 0, opts.dampening or 0, opts.weight_decay or 0,
                opts.nesterov, step)
      end
      opt:step()
    end
    for k, r in ipairs(ref) do helpers.assert_close(r.t, r.p, 1e-5, 1e-6, 'SGD param ' .. k) end
    return opt, ref
  end

  it('plain SGD with weight decay matches float64', function()
    local opt = run({ lr = 0.1, weight_decay = 0.05 }, 2)
    assert.are.same({}, opt:state_dict().state.momentum_buf)
  end)

  it('momentum with dampening and weight decay matches float64 (buffer starts as the grad)', function()
    local opt, ref = run({ lr = 0.05, momentum = 0.9, dampening = 0.3, weight_decay = 0.01 }, 3)
    local bufs = opt:state_dict().state.momentum_buf
    for k, r in ipairs(ref) do helpers.assert_close(bufs[k], r.buf, 1e-5, 1e-6, 'momentum_buf ' .. k) end
  end)

  it('nesterov momentum matches float64', function()
    run({ lr = 0.05, momentum = 0.8, nesterov = true, weight_decay = 0.02 }, 3)
  end)

  it('refuses nesterov without momentum', function()
    local p = uly.randn(3, { requires_grad = true })
    assert.has_error(function() optim.SGD({ p }, { lr = 0.1, nesterov = true }) end,
                     'SGD: nesterov momentum needs momentum > 0 and dampening = 0')
  end)
end)

describe('optim per-parameter steps', function()
  before_each(function() helpers.reseed(3308) end)

  -- w has a grad on every step, c on steps 2 and 4, b from step 3 on (each its own step count, as
  -- in torch.optim): at step 3 they take steps 3, 1 and 2, at step 4 steps 4, 2 and 2
  local has_grad = { w = { 1, 2, 3, 4 }, c = { 2, 4 }, b = { 3, 4 } }
  local function run(make, ref_update)
    local ts = { w = uly.randn(4, 3, { requires_grad = true }), c = uly.randn(2, 3, { requires_grad = true }),
                 b = uly.randn(5, { requires_grad = true }) }
    local opt = make({ ts.w, ts.c, ts.b })
    local ref = {}
    for name, t in pairs(ts) do ref[name] = { p = helpers.list(t), s1 = {}, s2 = {}, step = 0 } end
    for name, r in pairs(ref) do for i = 1, #r.p do r.s1[i], r.s2[i] = 0, 0 end end
    for step = 1, 4 do
      opt:zero_grad()
      for _, name in ipairs({ 'w', 'c', 'b' }) do
        for _, s in ipairs(has_grad[name]) do
          if s == step then
            local r = ref[name]
            local g = randn_list(#r.p)
            set_grad(ts[name], helpers.from_flat(g, ts[name]:shape()))
            r.step = r.step + 1
            ref_update(r, g, ts[name]:dim() >= 2)
          end
        end
      end
      opt:step()
    end
    for _, name in ipairs({ 'w', 'c', 'b' }) do helpers.assert_close(ts[name], ref[name].p, 1e-5, 1e-6, name) end
    assert.are.same({ 4, 2, 2 }, opt.param_steps)
    assert.are.equal(4, opt.step_count)
    return opt, ref
  end

  it('AdamW: bias correction counts the steps on which the parameter had a grad', function()
    local lr, b1, b2, eps, wd = 0.05, 0.8, 0.99, 1e-6, 0.2
    local opt, ref = run(function(ps) return optim.AdamW(ps, { lr = lr, betas = { b1, b2 }, eps = eps, weight_decay = wd }) end,
                         function(r, g, decayed) adamw_ref(r.p, r.s1, r.s2, g, lr, b1, b2, eps, decayed and wd or 0, r.step) end)
    helpers.assert_close(opt.state.exp_avg[3], ref.b.s1, 1e-5, 1e-6, 'exp_avg of b')
  end)

  it('SGD: the momentum buffer starts as the grad on the parameter\'s first update', function()
    local lr, momentum, dampening, wd = 0.1, 0.9, 0.5, 0.01
    local opt, ref = run(function(ps) return optim.SGD(ps, { lr = lr, momentum = momentum, dampening = dampening,
                                                             weight_decay = wd }) end,
                         function(r, g) sgd_ref(r.p, r.s1, g, lr, momentum, dampening, wd, false, r.step) end)
    helpers.assert_close(opt.state.momentum_buf[3], ref.b.s1, 1e-5, 1e-6, 'momentum_buf of b')
  end)

  it('state_dict keeps them; a state without them gives every parameter its step', function()
    local w, b = uly.randn(3, 2, { requires_grad = true }), uly.randn(4, { requires_grad = true })
    local opt = optim.AdamW({ w, b })
    set_grad(w, uly.randn(3, 2))
    opt:step()
    local sd = opt:state_dict()
    assert.are.same({ 1, 0 }, sd.param_steps)
    local opt2 = optim.AdamW({ w:detach(), b:detach() })
    opt2:load_state_dict(sd)
    assert.are.same({ 1, 0 }, opt2.param_steps)
    sd.param_steps = nil   -- saved before per-parameter steps, or by ZeroAdamW
    opt2:load_state_dict(sd)
    assert.are.same({ 1, 1 }, opt2.param_steps)
    sd.param_steps = { 1, 2 }
    local ok, err = pcall(opt.load_state_dict, opt, sd)
    assert.is_false(ok)
    assert.truthy(err:find('param_steps[2] must be an integer in [0, step = 1], got 2', 1, true), err)
    assert.are.same({ 1, 0 }, opt.param_steps)
    sd.param_steps = { 1 }
    ok, err = pcall(opt.load_state_dict, opt, sd)
    assert.truthy(err:find('param_steps must be a list of 2 step counts (one per parameter), got 1 entries', 1, true), err)
  end)
end)

describe('optim.grad_norm and clip_grad_norm', function()
  before_each(function() helpers.reseed(3303) end)

  local function params_with_grads()
    local ps = { uly.randn(7, 3, { requires_grad = true }), uly.randn(1, { requires_grad = true }),
                 uly.randn(40, { requires_grad = true }), uly.randn(2, 2, { requires_grad = true }) }
    for k = 1, 3 do set_grad(ps[k], uly.randn(ps[k]:shape()):mul(2)) end -- ps[4] has no grad
    return ps
  end

  local function lua_norm(ps)
    local s = 0
    for _, p in ipairs(ps) do
      local g = p.grad
      if g then for _, x in ipairs(helpers.list(g)) do s = s + x * x end end
    end
    return math.sqrt(s)
  end

  it('grad_norm is the float64 L2 norm over every grad', function()
    local ps = params_with_grads()
    local n = optim.grad_norm(ps)
    assert.is_number(n)
    assert.truthy(math.abs(n - lua_norm(ps)) <= 1e-12 * n, n .. ' vs ' .. lua_norm(ps))
    assert.are.equal(0, optim.grad_norm({ ps[4] }))
  end)

  it('clip_grad_norm scales by max_norm / (norm + 1e-6) above max_norm and returns the norm before', function()
    local ps = params_with_grads()
    local before = {}
    for k = 1, 3 do before[k] = helpers.list(ps[k].grad) end
    local total = lua_norm(ps)
    local max_norm = total / 4
    local n = optim.clip_grad_norm(ps, max_norm)
    assert.truthy(math.abs(n - total) <= 1e-12 * total)
    local c = max_norm / (total + 1e-6)
    for k = 1, 3 do
      local want = {}
      for i, x in ipairs(before[k]) do want[i] = x * c end
      helpers.assert_close(ps[k].grad, want, 1e-6, 0, 'clipped grad ' .. k)
    end
    assert.truthy(math.abs(optim.grad_norm(ps) - max_norm) <= 1e-5 * max_norm)
    -- below the threshold nothing changes
    local kept = ps[1].grad:clone()
    local n2 = optim.clip_grad_norm(ps, max_norm * 2)
    assert.truthy(math.abs(n2 - max_norm) <= 1e-5 * max_norm)
    same_bits(ps[1].grad, kept, 'grad below max_norm')
    -- as torch.nn.utils.clip_grad_norm_: a norm within 1e-6 below max_norm is scaled too
    -- (max_norm / (norm + 1e-6) < 1)
    local norm = optim.grad_norm(ps)
    local before1 = helpers.list(ps[1].grad)
    optim.clip_grad_norm(ps, norm + 4e-7)
    local c1 = (norm + 4e-7) / (norm + 1e-6)
    local after1, changed = helpers.list(ps[1].grad), 0
    for i, x in ipairs(before1) do
      assert.truthy(math.abs(after1[i] - x * c1) <= 1e-7 * math.abs(x), 'element ' .. i)
      if after1[i] ~= x then changed = changed + 1 end
    end
    assert.truthy(changed > 0, 'scaled by ' .. c1)
  end)

  it('returns a non-finite norm without scaling', function()
    local ps = params_with_grads()
    local g = ps[3].grad
    g[5] = math.huge
    local kept = ps[1].grad:clone()
    assert.are.equal(math.huge, optim.clip_grad_norm(ps, 1.0))
    same_bits(ps[1].grad, kept, 'grad after an infinite norm')
    g[5] = 0 / 0
    local n = optim.clip_grad_norm(ps, 1.0)
    assert.truthy(n ~= n, 'NaN norm expected, got ' .. tostring(n))
    same_bits(ps[1].grad, kept, 'grad after a NaN norm')
  end)

  it('an optimizer answers for its own parameters', function()
    local ps = params_with_grads()
    local opt = optim.AdamW(ps)
    assert.are.equal(optim.grad_norm(ps), opt:grad_norm())
    assert.are.equal(optim.grad_norm(ps), optim.grad_norm(opt))
  end)
end)

describe('optim thread-count invariance', function()
  after_each(function() uly.set_num_threads(0) end)

  it('AdamW, SGD, grad_norm and clipping give bit-identical results for 1, 2 and 3 threads', function()
    helpers.reseed(3304)
    local n = 100003
    local p0, g0, q0 = uly.randn(n), uly.randn(n), uly.randn(317, 316)
    local results = {}
    for _, threads in ipairs({ 1, 2, 3 }) do
      uly.set_num_threads(threads)
      local p, q = p0:clone(), q0:clone()
      set_grad(p, g0:clone()); set_grad(q, q0:mul(0.5))
      local opt = optim.AdamW({ p, q }, { lr = 1e-2 })
      opt:step(); opt:step()
      local sgd = optim.SGD({ p, q }, { lr = 1e-2, momentum = 0.9, weight_decay = 0.01 })
      sgd:step(); sgd:step()
      local norm = optim.clip_grad_norm({ p, q }, 1.0)
      results[threads] = { p = p, q = q, g = p.grad, norm = norm, m = opt.state.exp_avg_sq[1] }
    end
    for _, threads in ipairs({ 2, 3 }) do
      local a, b = results[1], results[threads]
      assert.are.equal(a.norm, b.norm)
      same_bits(a.p, b.p, threads .. ' threads: param')
      same_bits(a.q, b.q, threads .. ' threads: 2-D param')
      same_bits(a.g, b.g, threads .. ' threads: clipped grad')
      same_bits(a.m, b.m, threads .. ' threads: exp_avg_sq')
    end
  end)
end)

describe('optim.schedule', function()
  it('cosine: linear warmup, cosine decay to min_lr, then constant', function()
    local s = optim.schedule.cosine { lr = 1e-3, warmup = 10, steps = 110, min_lr = 1e-4 }
    local function near(want, got) assert.truthy(math.abs(want - got) <= 1e-15, want .. ' vs ' .. got) end
    near(1e-4, s(1))                  -- lr / warmup
    near(5e-4, s(5))
    near(1e-3, s(10))                 -- end of warmup: the peak
    near((1e-3 + 1e-4) / 2, s(60))   -- halfway through the decay
    near(1e-4 + 0.5 * 9e-4 * (1 + math.cos(math.pi * 0.25)), s(35))
    near(1e-4, s(110))
    near(1e-4, s(1000))
    local nw = optim.schedule.cosine { lr = 1, steps = 4 }
    near(0.5 * (1 + math.cos(math.pi / 4)), nw(1))
    near(0, nw(4))
    assert.has_error(function() s(0) end)
  end)

  it('constant with warmup, and from_opts', function()
    local s = optim.schedule.constant { lr = 2, warmup = 4 }
    assert.are.same({ 0.5, 1, 2, 2, 2 }, { s(1), s(2), s(4), s(5), s(10000) })
    assert.are.equal(3, optim.schedule.constant { lr = 3 }(1))
    local f = optim.schedule.from_opts { lr = 1, warmup = 2, steps = 10, min_lr = 0, batch = 8 }
    assert.are.equal(0.5, f(1))
    assert.are.equal(0, f(10))
    assert.has_error(function() optim.schedule.from_opts { lr = 1, schedule = 'linear' } end,
                     "schedule.from_opts: schedule must be 'cosine' or 'constant', got linear")
    assert.has_error(function() optim.schedule.cosine { lr = 1, warmup = 10, steps = 5 } end)
  end)
end)

describe('optim state_dict', function()
  before_each(function() helpers.reseed(3305) end)

  local function clone_sd(sd)
    local out = { kind = sd.kind, step = sd.step, hyper = sd.hyper, state = {} }
    for name, list in pairs(sd.state) do
      out.state[name] = {}
      for i, t in ipairs(list) do out.state[name][i] = t:clone() end
    end
    return out
  end

  -- two runs over the same grads: A straight through; B restarted after `cut` steps from a saved state
  local function restart_run(make, steps, cut, restore)
    local shapes = { { 6, 4 }, { 4 }, { 13 } }
    local grads = {}
    for s = 1, steps do
      grads[s] = {}
      for k, sh in ipairs(shapes) do grads[s][k] = uly.randn(sh) end
    end
    local init = {}
    for k, sh in ipairs(shapes) do init[k] = uly.randn(sh) end
    local function fresh() local ps = {} for k = 1, #shapes do ps[k] = init[k]:clone() end return ps end
    local function step(opt, s) for k, p in ipairs(opt.params) do set_grad(p, grads[s][k]) end opt:step() end
    local pa, pb = fresh(), fresh()
    local a = make(pa)
    for s = 1, steps do step(a, s) end
    local b1 = make(pb)
    for s = 1, cut do step(b1, s) end
    local saved = clone_sd(b1:state_dict())
    local b2 = make(pb)
    if restore then b2:load_state_dict(saved) end
    for s = cut + 1, steps do step(b2, s) end
    return pa, pb, a, b2
  end

  it('AdamW: a restored optimizer continues exactly like an uninterrupted one', function()
    local make = function(ps) return optim.AdamW(ps, { lr = 0.02, weight_decay = 0.1 }) end
    local pa, pb, a, b = restart_run(make, 5, 2, true)
    for k = 1, #pa do same_bits(pb[k], pa[k], 'param ' .. k) end
    assert.are.equal(5, b.step_count)
    local sd = a:state_dict()
    assert.are.equal('AdamW', sd.kind)
    assert.are.equal(5, sd.step)
    assert.are.same({ lr = 0.02, betas = { 0.9, 0.95 }, eps = 1e-8, weight_decay = 0.1 }, sd.hyper)
    assert.are.equal(3, #sd.state.exp_avg)
    assert.are.equal(a.state.exp_avg_sq[2], sd.state.exp_avg_sq[2])
    -- without the restore the runs differ (the check above can fail)
    local qa, qb = restart_run(make, 5, 2, false)
    assert.has_error(function() same_bits(qb[1], qa[1], 'param 1') end)
  end)

  it('SGD with momentum: restored runs continue exactly, lr comes back', function()
    local make = function(ps) return optim.SGD(ps, { lr = 0.1, momentum = 0.9 }) end
    local pa, pb, _, b = restart_run(make, 4, 3, true)
    for k = 1, #pa do same_bits(pb[k], pa[k], 'param ' .. k) end
    local sd = b:state_dict()
    assert.are.equal('SGD', sd.kind)
    assert.are.equal(3, #sd.state.momentum_buf)
    b.lr = 7
    b:load_state_dict(sd)
    assert.are.equal(0.1, b.lr)
  end)
end)

describe('optim errors', function()
  before_each(function() helpers.reseed(3306) end)

  it('rejects a non-f32 parameter, naming it', function()
    local ok, err = pcall(function()
      local opt = optim.AdamW({ uly.randn(2, { requires_grad = true }), uly.zeros(3, 2, { dtype = 'f64' }) })
      return opt -- not a tail call: the error must point at the line above
    end)
    assert.is_false(ok)
    assert.truthy(err:find('AdamW: parameter 2 is f64[3, 2]; optimizers update f32 tensors', 1, true), err)
    assert.truthy(err:match('^[^:]*optim_spec%.lua:%d+: '), err)   -- raised at the caller's line
  end)

  it('rejects non-leaves, duplicates, unknown options and empty lists', function()
    local p = uly.randn(2, 2, { requires_grad = true })
    assert.has_error(function() optim.AdamW({ p:mul(2) }) end)
    local ok, err = pcall(optim.AdamW, { p:mul(2) })
    assert.truthy(err:find('is not a leaf', 1, true), err)
    ok, err = pcall(optim.SGD, { p, p })
    assert.truthy(err:find('parameter 2 is the same tensor as parameter 1', 1, true), err)
    ok, err = pcall(optim.AdamW, { p }, { learning_rate = 1 })
    assert.truthy(err:find("unknown option 'learning_rate'", 1, true), err)
    ok, err = pcall(optim.AdamW, {})
    assert.truthy(err:find('empty parameter list', 1, true), err)
    ok, err = pcall(optim.AdamW, { p }, { betas = { 0.9, 1 } })
    assert.truthy(err:find('betas[2] must be a number in [0, 1)', 1, true), err)
  end)

  it('load_state_dict refuses mismatched shapes, counts and kinds, changing nothing', function()
    local w, b = uly.randn(3, 4), uly.randn(4)
    local opt = optim.AdamW({ w, b })
    local sd = opt:state_dict()
    sd.state.exp_avg = { uly.ones(3, 4), uly.ones(4, 4) }
    local ok, err = pcall(opt.load_state_dict, opt, sd)
    assert.is_false(ok)
    assert.truthy(err:find('exp_avg[2] has shape [4, 4] but parameter 2 has shape [4]', 1, true), err)
    helpers.assert_close(opt.state.exp_avg[1], uly.zeros(3, 4), 0, 0, 'exp_avg untouched')
    sd.state.exp_avg = { uly.ones(3, 4) }
    ok, err = pcall(opt.load_state_dict, opt, sd)
    assert.truthy(err:find('exp_avg has 1 tensors but this optimizer has 2', 1, true), err)
    local sgd = optim.SGD({ w, b }, { momentum = 0.5 })
    ok, err = pcall(sgd.load_state_dict, sgd, opt:state_dict())
    assert.truthy(err:find('the state is for AdamW, not SGD', 1, true), err)
  end)

  it('a non-contiguous grad fails the step in C, before any parameter moves', function()
    local w = uly.randn(7, 5, { requires_grad = true })
    local b = uly.randn(5, { requires_grad = true })
    local opt = optim.AdamW({ b, w })
    set_grad(b, uly.ones(5))
    set_grad(w, uly.randn(5, 7):transpose(1, 2))
    local b0 = b:clone()
    local ok, err = pcall(opt.step, opt)
    assert.is_false(ok)
    assert.truthy(err:find('adamw_step: parameter 2 of 2: its grad f32[7, 5] is not contiguous', 1, true), err)
    same_bits(b, b0, 'param 1 after a failed step')
    assert.are.equal(0, opt.step_count)
  end)

  it('refuses a bad lr and a freed parameter', function()
    local p = uly.randn(3, { requires_grad = true })
    local opt = optim.SGD({ p }, { lr = 0.1 })
    opt.lr = -1
    assert.has_error(function() opt:step() end, 'SGD: opt.lr must be a finite number >= 0, got -1')
    opt.lr = 0.1
    p:free()
    local ok, err = pcall(opt.step, opt)
    assert.truthy(err:find('parameter 1 was freed', 1, true), err)
  end)

  it('the C entry points check their hyperparameters', function()
    local p = uly.randn(3)
    local arr = require('ffi').new('uly_tensor *[1]', p._h)
    assert.are.equal(-1, C.uly_adamw_step(arr, arr, arr, nil, 1, 0.1, 1.0, 0.9, 1e-8, 1))
    assert.truthy(uly.C.uly_last_error() ~= nil)
    local msg = require('ffi').string(C.uly_last_error())
    assert.truthy(msg:find('adamw_step: beta1 = 1 is out of range', 1, true), msg)
    assert.are.equal(-1, C.uly_sgd_step(arr, nil, nil, 1, 0.1, 0.5, 0, 0, 0))
    msg = require('ffi').string(C.uly_last_error())
    assert.truthy(msg:find('sgd_step: step = 0', 1, true), msg)
    C.uly_clear_error()
  end)
end)

describe('optim lifetime', function()
  it('an optimizer holds no C references beyond its state tensors', function()
    collectgarbage('collect')
    local live = uly.live_tensors()
    do
      local p = uly.randn(4, 3, { requires_grad = true })
      local opt = optim.AdamW({ p })
      set_grad(p, uly.ones(4, 3))
      opt:step(); optim.clip_grad_norm(opt.params, 0.1); opt:state_dict()
      assert.are.equal(live + 4, uly.live_tensors())   -- p, its grad, exp_avg, exp_avg_sq
    end
    collectgarbage('collect')
    assert.are.equal(live, uly.live_tensors())
  end)
end)

describe('optim end to end', function()
  it('AdamW fits a linear regression in 200 steps', function()
    helpers.reseed(3307)
    local X = uly.randn(64, 5)
    local W = helpers.from_flat({ 1.5, -2, 0.5, 3, -1 }, { 5, 1 })
    local y = X:matmul(W):add(0.7)
    local model = uly.nn.Linear(5, 1)
    local opt = optim.AdamW(model, { lr = 0.05, weight_decay = 0 })
    local sched = optim.schedule.cosine { lr = 0.05, warmup = 10, steps = 200, min_lr = 0.005 }
    local function loss_fn() return model(X):sub(y):pow(2):mean() end
    local first, last
    for step = 1, 200 do
      opt:zero_grad()
      local loss = loss_fn()
      loss:backward()
      opt.lr = sched(step)
      opt:step()
      last = loss:item()
      first = first or last
    end
    assert.truthy(first > 1, 'initial loss ' .. first)
    assert.truthy(last < 1e-3, string.format('loss %.3g after 200 steps (from %.3g)', last, first))
    helpers.assert_close(model.bias, { 0.7 }, 0, 0.05, 'fitted bias')
  end)
end)
