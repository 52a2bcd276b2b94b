-- spec/cpu_bf16_kernels_spec.lua — the CPU's bf16-activation kernels (kernels/cpu/bf16_twins.c,
-- switched by uly.cpu_bf16_kernels): each op on bf16 activations gives the same bits with them
-- on as with them off (the f32 kernels between converting copies), its output and the gradients
-- of its inputs and weights, at odd sizes (rows and lengths that are no multiple of a vector, a
-- block or a chunk; sizes that run on several threads), broadcast and non-contiguous operands,
-- mixed f32 and bf16 ones; with the kernels on they run (uly.cpu_bf16_kernel_calls rises), with
-- them off they do not. Then a GPT and a Llama training step in bf16 precision (loss and every
-- parameter gradient), and the switch's argument check.
local uly = require 'ulysses'
local helpers = require 'helpers'

local function R(...) return uly.randn(...) end
local function P(...) return uly.rand(...):add(0.5) end   -- positive, for log and sqrt

-- inputs: { t = f32 values, bf16 = true (a bf16 copy), grad = false (no gradient asked) }
local function B(t) return { t = t, bf16 = true } end
local function F(t) return { t = t } end
local function N(t, bf16) return { t = t, bf16 = bf16, grad = false } end

-- fn on fresh leaves made from inputs, with the CPU bf16 kernels switched `on`, then backward of
-- sum(out * w); w is drawn on the first run (pass it back for the second). Restores the switch.
local function run(on, fn, inputs, w)
  local prev = uly.cpu_bf16_kernels(on)
  local ok, res = pcall(function()
    local leaves = {}
    for i, x in ipairs(inputs) do
      local t = x.bf16 and x.t:bf16() or x.t:float()
      if x.grad ~= false then t:requires_grad_() end
      leaves[i] = t
    end
    local before = uly.cpu_bf16_kernel_calls()
    local out = fn(unpack(leaves))
    w = w or R(out:shape())
    out:float():mul(w):sum():backward()
    local grads = {}
    for i, l in ipairs(leaves) do grads[i] = l.grad or false end
    return { out = out, grads = grads, w = w, calls = uly.cpu_bf16_kernel_calls() - before }
  end)
  uly.cpu_bf16_kernels(prev)
  assert(ok, res)
  return res
end

-- the kernels on against off: the same dtype and bits out, the same gradients; the kernels ran
-- (unless `uses` is false: an op that has no bf16 kernel for these inputs) only when on
local function same_bits(what, fn, inputs, uses)
  local on = run(true, fn, inputs)
  local off = run(false, fn, inputs, on.w)
  assert.equal(off.out:dtype(), on.out:dtype(), what .. ': output dtype')
  helpers.assert_close(on.out:float(), off.out:float(), 0, 0, what .. ': output')
  for i, g in ipairs(off.grads) do
    if g then
      assert.equal('f32', on.grads[i]:dtype(), what .. ': gradient dtype')
      helpers.assert_close(on.grads[i], g, 0, 0, what .. ': gradient of input ' .. i)
    end
  end
  assert.equal(0, off.calls, what .. ': a bf16 kernel ran while switched off')
  if uses ~= false then assert.is_true(on.calls > 0, what .. ': no bf16 kernel ran') end
end

describe('CPU bf16 kernels', function()
  local act
  before_each(function()
    helpers.reseed()
    act = uly.activation_dtype('bf16')
  end)
  after_each(function() uly.activation_dtype(act) end)

  it('are on by default', function()
    assert.is_true(uly.cpu_bf16_kernels())
  end)

  -- rows x C: one row, a vector's worth and a bit, many rows (several threads, many row chunks)
  local norm_shapes = { { 1, 1 }, { 5, 7 }, { 3, 33 }, { 37, 1000 }, { 300, 77 }, { 2, 1037 } }

  it('layernorm: with an f32 weight and bias, with neither, over a non-contiguous input', function()
    for _, s in ipairs(norm_shapes) do
      local what = ('layernorm %dx%d'):format(s[1], s[2])
      same_bits(what, function(x, w, b) return uly.layernorm(x, w, b) end, { B(R(s[1], s[2])), F(R(s[2])), F(R(s[2])) })
      same_bits(what .. ' without weights', function(x) return uly.layernorm(x) end, { B(R(s[1], s[2]):mul(3)) })
    end
    same_bits('layernorm of a transposed input', function(x, w) return uly.layernorm(x:transpose(1, 2), w) end,
              { B(R(40, 9)), F(R(40)) })
  end)

  it('rmsnorm: with an f32 weight, without, over a non-contiguous input', function()
    for _, s in ipairs(norm_shapes) do
      local what = ('rmsnorm %dx%d'):format(s[1], s[2])
      same_bits(what, function(x, w) return uly.rmsnorm(x, w) end, { B(R(s[1], s[2])), F(R(s[2])) })
      same_bits(what .. ' without a weight', function(x) return uly.rmsnorm(x) end, { B(R(s[1], s[2])) })
    end
    same_bits('rmsnorm of a narrowed input', function(x, w) return uly.rmsnorm(x:narrow(2, 2, 31), w) end,
              { B(R(6, 40)), F(R(31)) })
  end)

  -- lengths: one, a vector's worth and a bit, one past a block, several threads with a partial block
  local lengths = { 1, 7, 4097, 40003 }
  local unary = {
    { 'gelu', function(x) return x:gelu() end },
    { 'gelu tanh', function(x) return x:gelu('tanh') end },
    { 'silu', function(x) return x:silu() end },
    { 'relu', function(x) return x:relu() end },
    { 'tanh', function(x) return x:tanh() end },
    { 'sigmoid', function(x) return x:sigmoid() end },
    { 'exp', function(x) return x:exp() end },
    { 'log', function(x) return x:log() end, P },
    { 'sqrt', function(x) return x:sqrt() end, P },
  }
  for _, u in ipairs(unary) do
    it('unary ' .. u[1] .. ': forward and its gradient, contiguous and not', function()
      local draw = u[3] or function(...) return R(...):mul(3) end
      for _, n in ipairs(lengths) do same_bits(u[1] .. ' of ' .. n, u[2], { B(draw(n)) }) end
      same_bits(u[1] .. ' of a transposed input', function(x) return u[2](x:transpose(1, 2)) end, { B(draw(33, 70)) })
    end)
  end

  it('swiglu: forward and both gradients; a mixed f32 / bf16 pair takes the copies', function()
    for _, n in ipairs(lengths) do
      same_bits('swiglu of ' .. n, function(g, u) return uly.swiglu(g, u) end, { B(R(n):mul(3)), B(R(n)) })
    end
    same_bits('swiglu, gate without a gradient', function(g, u) return uly.swiglu(g, u) end,
              { N(R(5000), true), B(R(5000)) })
    same_bits('swiglu of transposed inputs', function(g, u) return uly.swiglu(g:transpose(1, 2), u:transpose(1, 2)) end,
              { B(R(9, 33)), B(R(9, 33)) })
    same_bits('swiglu of f32 gate and bf16 up', function(g, u) return uly.swiglu(g, u) end, { F(R(77)), B(R(77)) }, false)
  end)

  it('rope: odd sequence lengths and heads, head dims up to past a chunk of pairs, offsets', function()
    for _, c in ipairs({ { { 1, 1, 1, 2 }, 0 }, { { 2, 7, 3, 10 }, 5 }, { { 2, 40, 4, 64 }, 0 }, { { 1, 3, 2, 600 }, 1000 },
                         { { 3, 33, 5, 18 }, 123456 } }) do
      local s = c[1]
      same_bits(('rope %s offset %d'):format(table.concat(s, 'x'), c[2]), function(x) return x:rope(c[2]) end,
                { B(R(s[1], s[2], s[3], s[4])) })
    end
    same_bits('rope of a transposed input', function(x) return x:transpose(2, 3):rope(2, 500) end, { B(R(2, 3, 9, 8)) })
  end)

  it('cross_entropy: i32 and i64 targets, an ignore index, each reduction, odd class counts', function()
    for _, c in ipairs({ { 3, 1 }, { 5, 7 }, { 9, 33 }, { 40, 1000 }, { 7, 5003 } }) do
      local rows, V = c[1], c[2]
      local ids = {}
      for r = 1, rows do ids[r] = r % 3 == 2 and -100 or math.random(0, V - 1) end
      for _, dtype in ipairs({ 'i32', 'i64' }) do
        local targets = uly.tensor(ids, { dtype = dtype })
        for _, red in ipairs({ 'mean', 'sum', 'none' }) do
          same_bits(('cross_entropy %dx%d %s %s'):format(rows, V, dtype, red),
                    function(l) return uly.cross_entropy(l, targets, { reduction = red }) end, { B(R(rows, V):mul(4)) })
        end
      end
      -- a class of its own as the ignore index
      local classes = {}
      for r = 1, rows do classes[r] = math.max(ids[r], 0) end
      local targets = uly.tensor(classes, { dtype = 'i64' })
      same_bits(('cross_entropy %dx%d ignoring class 0'):format(rows, V),
                function(l) return uly.cross_entropy(l, targets, { ignore_index = 0 }) end, { B(R(rows, V)) })
    end
  end)

  describe('binary ops', function()
    local ops = {
      add = function(a, b) return a + b end, sub = function(a, b) return a - b end,
      mul = function(a, b) return a * b end, div = function(a, b) return a / b end,
    }
    -- { name, a shape, b shape, a and b transformed (views) }
    local layouts = {
      { 'same shape', { 7, 33 }, { 7, 33 } },
      { 'long, several threads', { 3, 40001 }, { 3, 40001 } },
      { 'a bias over rows', { 5, 9, 1037 }, { 1037 } },
      { 'a column against a row', { 37, 1 }, { 1, 70 } },
      { 'a scalar tensor', { 300, 200 }, { 1 } },
      { 'a transposed a', { 33, 40 }, { 33, 40 }, function(a, b) return a:transpose(1, 2), b:transpose(1, 2) end },
      { 'a narrowed b', { 2, 5000 }, { 2, 6000 }, function(a, b) return a, b:narrow(2, 1000, 5000) end },
      { 'a one-element a against long rows', { 1 }, { 3, 5000 } },
      { 'a transposed a, long rows', { 4100, 3 }, { 3, 4100 }, function(a, b) return a:transpose(1, 2), b end },
    }
    for _, name in ipairs({ 'add', 'sub', 'mul', 'div' }) do
      it(name .. ': bf16 and f32 operands mixed, broadcast and strided, bf16 and f32 activations', function()
        for _, l in ipairs(layouts) do
          local view = l[4] or function(a, b) return a, b end
          local fn = function(a, b) return ops[name](view(a, b)) end
          local function b_values(shape) return name == 'div' and P(shape) or R(shape) end
          for _, kinds in ipairs({ { B, B }, { B, F }, { F, B } }) do
            for _, a16 in ipairs({ 'bf16', 'f32' }) do
              uly.activation_dtype(a16)
              local what = ('%s, %s, %s activations'):format(name, l[1], a16)
              same_bits(what, fn, { kinds[1](R(l[2])), kinds[2](b_values(l[3])) })
            end
          end
        end
      end)
    end
  end)

  -- a training step of each model in bf16 precision with bf16 activations: the loss and every
  -- parameter gradient the same with the kernels on and off
  it('a GPT and a Llama training step: the same loss and gradients, bit for bit', function()
    local prec = uly.matmul_precision('bf16')
    local ok, err = pcall(function()
      local x = helpers.token_ids(2, 24, 256)
      local function step(Model, cfg, on)
        local prev = uly.cpu_bf16_kernels(on)
        local before = uly.cpu_bf16_kernel_calls()
        helpers.reseed(8)
        local m = Model(cfg)
        local loss = m:loss(x, x)
        loss:backward()
        local calls = uly.cpu_bf16_kernel_calls() - before
        uly.cpu_bf16_kernels(prev)
        local grads = {}
        for i, p in ipairs(m:parameters()) do grads[i] = p.grad end
        return loss:item(), grads, calls
      end
      local GPT, Llama = require 'models.gpt', require 'models.llama'
      for _, c in ipairs({ { 'gpt', GPT, { preset = 'tiny', seq = 24, tile = 8 } },
                           { 'llama', Llama, { preset = 'tiny', heads = 4, kv_heads = 2, dim = 32, hidden = 48, seq = 24,
                                               checkpoint = 'except_attention', tile = 8 } } }) do
        local l1, g1, n1 = step(c[2], c[3], true)
        local l0, g0, n0 = step(c[2], c[3], false)
        assert.equal(l0, l1, c[1] .. ': loss')
        assert.equal(#g0, #g1)
        for i = 1, #g0 do helpers.assert_close(g1[i], g0[i], 0, 0, c[1] .. ': gradient of parameter ' .. i) end
        assert.is_true(n1 > 0, c[1] .. ': no bf16 kernel ran')
        assert.equal(0, n0, c[1] .. ': a bf16 kernel ran while switched off')
      end
    end)
    uly.matmul_precision(prec)
    uly.cpu_bf16_kernels(true)
    assert(ok, err)
  end)

  -- a row kernel that cannot have its row buffers (ULY_TEST_ROW_BUFFER_LIMIT: a request of more
  -- floats fails, as a full memory would) writes nothing and the op fails with the reason, forward
  -- and backward; the process lives on, and with memory again the same op gives the same bits
  it('say so when their row buffers cannot be had, instead of ending the process', function()
    local ffi = require 'ffi'
    pcall(ffi.cdef, 'int setenv(const char *, const char *, int); int unsetenv(const char *);')
    local x, w, b = R(6, 300):bf16(), R(300), R(300)
    local q = R(2, 5, 3, 64):bf16()
    local logits, targets = R(6, 300):bf16(), uly.tensor({ 1, 2, 3, 4, 5, 6 }, { dtype = 'i64' })
    local ops = {
      { 'layernorm', function() return uly.layernorm(x, w, b) end },
      { 'rmsnorm', function() return uly.rmsnorm(x, w) end },
      { 'rope', function() return q:rope(3) end },
      { 'cross_entropy', function() return uly.cross_entropy(logits, targets) end },
    }
    local function limited(fn)
      ffi.C.setenv('ULY_TEST_ROW_BUFFER_LIMIT', '64', 1)
      local ok, err = pcall(fn)
      ffi.C.unsetenv('ULY_TEST_ROW_BUFFER_LIMIT')
      return ok, err
    end
    for _, op in ipairs(ops) do
      local before = op[2]():float()
      local ok, err = limited(op[2])
      assert.is_false(ok, op[1] .. ' ran without its row buffers')
      assert.matches(op[1] .. ': the bf16 kernel found no memory for its row buffers', tostring(err), 1, true)
      assert.matches('uly.cpu_bf16_kernels(false)', tostring(err), 1, true)
      helpers.assert_close(op[2]():float(), before, 0, 0, op[1] .. ' after the failure')
    end
    -- backward: the forward ran with memory, the backward has none
    for _, c in ipairs({ { 'layernorm', function(t) return uly.layernorm(t, w, b) end },
                         { 'rmsnorm', function(t) return uly.rmsnorm(t, w) end },
                         { 'cross_entropy', function(t) return uly.cross_entropy(t, targets) end } }) do
      local t = logits:clone():requires_grad_()
      local out = c[2](t)
      local loss = out:float():sum()
      local ok, err = limited(function() loss:backward() end)
      assert.is_false(ok, c[1] .. ' backward ran without its row buffers')
      assert.matches(c[1] .. ' backward: the bf16 kernel found no memory for its row buffers', tostring(err), 1, true)
      local again = logits:clone():requires_grad_()
      c[2](again):float():sum():backward()
      assert.is_true(again.grad ~= nil, c[1] .. ': no gradient once memory is back')
    end
  end)

  it('the switch takes true, false or nothing, and returns the previous setting', function()
    assert.is_true(uly.cpu_bf16_kernels(false))
    assert.is_false(uly.cpu_bf16_kernels())
    assert.is_false(uly.cpu_bf16_kernels(true))
    assert.is_true(uly.cpu_bf16_kernels())
    local msg = helpers.error_of(uly.cpu_bf16_kernels, 'yes')
    assert.matches('uly.cpu_bf16_kernels: expected true, false or nothing, got string yes', msg, 1, true)
    assert.matches('expected true, false or nothing, got number 1', helpers.error_of(uly.cpu_bf16_kernels, 1), 1, true)
    assert.is_true(uly.cpu_bf16_kernels())
  end)
end)
