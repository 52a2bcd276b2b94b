-- spec/optim_torch_bits_spec.lua — AdamW and SGD give PyTorch's bits: a step is compared
-- element for element with torch.optim's update (1.13, foreach=False, its default) written out
-- op by op in f32 below, each rounding where ATen's CPU kernels round; and, where
-- /usr/bin/python3 has torch, with torch.optim itself on the same inputs.
local ffi = require 'ffi'
local uly = require 'ulysses'
local helpers = require 'helpers'
local optim = uly.optim

ffi.cdef [[
  float fmaf(float, float, float);
  double pow(double, double);
]]
local libm = ffi.C
local f32buf = ffi.new('float[1]')
-- a double rounded to f32: one f32 operation on f32 inputs computed in double and then rounded
-- gives the f32 result (double's 53 bits >= 2 x 24 + 2: the second rounding is innocuous)
local function r(x) f32buf[0] = x; return f32buf[0] end
-- ATen's vectorised add_(alpha) / addcmul_ end in vec::fmadd: one rounding on a CPU with FMA
local fused = uly.has('fma')
local function madd(a, b, c) if fused then return libm.fmaf(a, b, c) else return r(r(a * b) + c) end end

-- torch.optim.AdamW's _single_tensor_adamw on flat lists of f32 values, in place:
--   param.mul_(1 - lr wd); exp_avg.mul_(b1).add_(grad, alpha=1-b1);
--   exp_avg_sq.mul_(b2).addcmul_(grad, grad, value=1-b2);
--   denom = (exp_avg_sq.sqrt() / sqrt(1 - b2^step)).add_(eps); param.addcdiv_(exp_avg, denom, value=-lr/(1 - b1^step))
-- the Python floats reach the kernels rounded to f32 once
local function adamw_torch(p, m, v, g, h, step)
  local bc1, bc2 = 1 - libm.pow(h.b1, step), 1 - libm.pow(h.b2, step)
  local decay, b1, a1, b2, a2 = r(1 - h.lr * h.wd), r(h.b1), r(1 - h.b1), r(h.b2), r(1 - h.b2)
  local neg_step, bc2_sqrt, eps = r(-(h.lr / bc1)), r(math.sqrt(bc2)), r(h.eps)
  for i = 1, #p do
    m[i] = madd(g[i], a1, r(m[i] * b1))
    v[i] = madd(r(a2 * g[i]), g[i], r(v[i] * b2))
    local denom = r(r(r(math.sqrt(v[i])) / bc2_sqrt) + eps)
    p[i] = r(r(p[i] * decay) + r(r(neg_step * m[i]) / denom))
  end
end

-- torch.optim.SGD's _single_tensor_sgd likewise: d_p = grad.add(param, alpha=wd) (wd != 0);
-- buf = clone(d_p) on the first step, else buf.mul_(momentum).add_(d_p, alpha=1-dampening);
-- d_p = nesterov and d_p.add(buf, alpha=momentum) or buf; param.add_(d_p, alpha=-lr)
local function sgd_torch(p, buf, g, h, first)
  local lr, wd, mom, keep = r(h.lr), r(h.wd), r(h.momentum), r(1 - h.dampening)
  for i = 1, #p do
    local d = h.wd ~= 0 and madd(p[i], wd, g[i]) or g[i]
    if buf then
      buf[i] = first and d or madd(d, keep, r(buf[i] * mom))
      d = h.nesterov and madd(buf[i], mom, d) or buf[i]
    end
    p[i] = madd(d, -lr, p[i])
  end
end

local function set_grad(p, g) assert(uly.C.uly_tensor_set_grad(p._h, g._h) == 0) end

local function same_bits(t, expected, what)
  local got, n = helpers.values(t)
  assert.are.equal(#expected, n, what .. ': element count')
  for i = 1, n do
    if got[i - 1] ~= expected[i] then
      error(string.format('%s: element %d of %d is %.9g, PyTorch\'s arithmetic gives %.9g', what, i, n,
                          got[i - 1], expected[i]), 2)
    end
  end
end

-- parameters of sizes that cover the kernels' paths: a short tail, more than one 512-element
-- pass, and enough elements (> 32768) for several threads' chunks
local SHAPES = { { 37 }, { 33, 31 }, { 200, 201 } }
-- the grads of step s: normals scaled by a power of ten that changes per step
local function grads(params, s)
  local out = {}
  for k, p in ipairs(params) do out[k] = uly.randn(p:shape()):mul(10 ^ ((s + k) % 5 - 2)) end
  return out
end

describe('optim in PyTorch\'s arithmetic', function()
  before_each(function() helpers.reseed(6151) end)

  it('AdamW: 4 steps equal torch.optim.AdamW\'s update op for op, every element of param, exp_avg, exp_avg_sq', function()
    for _, h in ipairs { { lr = 1e-3, b1 = 0.9, b2 = 0.999, eps = 1e-8, wd = 0.1 },
                         { lr = 0.05, b1 = 0.8, b2 = 0.95, eps = 1e-6, wd = 0 } } do
      local params, ref = {}, {}
      for k, shape in ipairs(SHAPES) do
        params[k] = uly.randn(shape, { requires_grad = true })
        ref[k] = { p = helpers.list(params[k]), m = {}, v = {} }
        for i = 1, #ref[k].p do ref[k].m[i], ref[k].v[i] = 0, 0 end
      end
      -- one group decaying every tensor (the 1-D one too) with h.wd
      local opt = optim.AdamW({ { params = params, weight_decay = h.wd } },
                              { lr = h.lr, betas = { h.b1, h.b2 }, eps = h.eps })
      for s = 1, 4 do
        local g = grads(params, s)
        for k, p in ipairs(params) do
          set_grad(p, g[k])
          adamw_torch(ref[k].p, ref[k].m, ref[k].v, helpers.list(g[k]), h, s)
        end
        opt:step()
        local st = opt:state_dict().state
        for k, p in ipairs(params) do
          local what = string.format('lr %g betas %g %g wd %g, step %d, param %d', h.lr, h.b1, h.b2, h.wd, s, k)
          same_bits(p, ref[k].p, what)
          same_bits(st.exp_avg[k], ref[k].m, what .. ' exp_avg')
          same_bits(st.exp_avg_sq[k], ref[k].v, what .. ' exp_avg_sq')
        end
      end
    end
  end)

  it('SGD: 3 steps equal torch.optim.SGD\'s update op for op (momentum, dampening, nesterov, weight decay, none)', function()
    for _, h in ipairs { { lr = 0.01, momentum = 0.9, dampening = 0.1, wd = 0.1, nesterov = false },
                         { lr = 0.03, momentum = 0.8, dampening = 0, wd = 0.01, nesterov = true },
                         { lr = 0.1, momentum = 0, dampening = 0, wd = 0.2, nesterov = false },
                         { lr = 0.02, momentum = 0.5, dampening = 0.3, wd = 0, nesterov = false } } do
      local params, ref = {}, {}
      for k, shape in ipairs(SHAPES) do
        params[k] = uly.randn(shape, { requires_grad = true })
        ref[k] = { p = helpers.list(params[k]), buf = h.momentum ~= 0 and {} or nil }
      end
      local opt = optim.SGD(params, { lr = h.lr, momentum = h.momentum, dampening = h.dampening,
                                      weight_decay = h.wd, nesterov = h.nesterov })
      for s = 1, 3 do
        local g = grads(params, s)
        for k, p in ipairs(params) do
          set_grad(p, g[k])
          sgd_torch(ref[k].p, ref[k].buf, helpers.list(g[k]), h, s == 1)
        end
        opt:step()
        for k, p in ipairs(params) do
          local what = string.format('lr %g momentum %g dampening %g wd %g nesterov %s, step %d, param %d', h.lr,
                                     h.momentum, h.dampening, h.wd, tostring(h.nesterov), s, k)
          same_bits(p, ref[k].p, what)
          if ref[k].buf then same_bits(opt.state.momentum_buf[k], ref[k].buf, what .. ' momentum buffer') end
        end
      end
    end
  end)

  -- the reference above, checked against PyTorch itself: the same start and grads through
  -- torch.optim.AdamW and SGD in /usr/bin/python3 (Debian's python3-torch), raw f32 files between
  local PEER = [[
import sys, numpy as np, torch
d, n, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rd = lambda k: torch.from_numpy(np.fromfile('%s/%s' % (d, k), dtype=np.float32))
torch.set_num_threads(2)
for name, make in (('adamw', lambda ps: torch.optim.AdamW(ps, lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)),
                   ('sgd', lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9, dampening=0.1, weight_decay=0.1,
                                                      nesterov=False))):
    p = torch.nn.Parameter(rd('p0').clone())
    opt = make([p])
    for s in range(1, steps + 1):
        p.grad = rd('g%d' % s)
        opt.step()
    p.detach().numpy().tofile('%s/%s_p' % (d, name))
]]

  it('AdamW and SGD: 3 steps equal torch.optim\'s bits, run by PyTorch (where /usr/bin/python3 has torch and numpy)', function()
    if not helpers.has_torch() then
      pending('no PyTorch: /usr/bin/python3 cannot import torch and numpy (Debian: python3-torch)')
      return
    end
    local dir = helpers.mkdtemp()
    local n, steps = 40200 + 37, 3
    local function dump(name, t) helpers.write_file(dir .. '/' .. name, ffi.string(t:data(), n * 4)) end
    local p0 = uly.randn(1, n)
    dump('p0', p0)
    local g = {}
    for s = 1, steps do g[s] = uly.randn(1, n):mul(10 ^ (s - 2)); dump('g' .. s, g[s]) end
    helpers.write_file(dir .. '/peer.py', PEER)
    local out, code = helpers.run(string.format('%s %s %s %d %d', helpers.torch_python, helpers.shq(dir .. '/peer.py'),
                                                helpers.shq(dir), n, steps))
    assert.are.equal(0, code, out)
    for _, name in ipairs { 'adamw', 'sgd' } do
      local p = p0:clone():requires_grad_()
      local opt = name == 'adamw' and optim.AdamW({ p }, { lr = 2e-3, betas = { 0.9, 0.999 }, eps = 1e-8, weight_decay = 0.1 })
                  or optim.SGD({ p }, { lr = 0.01, momentum = 0.9, dampening = 0.1, weight_decay = 0.1 })
      for s = 1, steps do set_grad(p, g[s]:clone()); opt:step() end
      local theirs = ffi.new('float[?]', n)
      ffi.copy(theirs, assert(helpers.read_file(dir .. '/' .. name .. '_p')), n * 4)
      local ours = p:data()
      for i = 0, n - 1 do
        if ours[i] ~= theirs[i] then
          error(string.format('%s after %d steps: element %d of %d is %.9g, torch.optim gives %.9g', name, steps, i + 1,
                              n, ours[i], theirs[i]))
        end
      end
    end
    helpers.rmtree(dir)
  end)
end)
