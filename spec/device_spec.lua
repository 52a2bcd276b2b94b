-- spec/device_spec.lua — device tensors: the same ops, gradients, models and optimizers on device
-- 'cuda' as on the CPU. Without a GPU, device 'cuda' is the simulation (host memory behind tagged
-- pointers that crash if the core touches device memory directly), so every device path of the
-- core runs here; on a GPU machine scripts/gpu-check.sh runs this file with ULY_TEST_DEVICE=cuda
-- against the real CUDA backend. The suite runs the f32 GEMMs in full f32 (uly.cuda.tf32(false)):
-- the CUDA backend must give the CPU's numbers to f32 rounding; 'TF32' below checks the default.
local uly = require 'ulysses'
local ffi = require 'ffi'
local helpers = require 'helpers'

-- ULY_TEST_DEVICE: unset = the simulation (the CPU kernels behind device pointers); 'cuda' = the
-- CUDA backend on a GPU; 'emu' = the CUDA backend's own kernels on the CPU emulator
-- (ULY_CUDA_LIB=build/libulysses_cuemu.so: its GEMMs in index order, TF32 rounding as a GPU's)
local MODE = os.getenv('ULY_TEST_DEVICE') or 'sim'
local REAL = MODE == 'cuda' or MODE == 'emu'
-- f32 everywhere: on a GPU other summation orders (cuBLAS's tiles, reductions across threads)
local RTOL = MODE == 'cuda' and 2e-4 or MODE == 'emu' and 2e-5 or 1e-6
local ATOL = MODE == 'cuda' and 2e-5 or MODE == 'emu' and 2e-6 or 1e-7

local function use_device()
  if REAL and uly.cuda.lib() then uly.cuda.tf32(false) end   -- full f32 GEMMs (see the top)
  if uly.cuda.backend() then return end
  if REAL then assert(uly.cuda.ensure()) else assert(uly.cuda.simulate()) end
end

local function release_device()
  if REAL then return end
  uly.device('cpu')
  jit.flush()   -- compiled traces can anchor objects (a model's tables) as constants
  local held   -- and checkpointed segments keep their replay closures until swept
  repeat
    held = uly.memory('cuda').allocated
    collectgarbage('collect')
    collectgarbage('collect')
    uly.nn.checkpoint_pending()
  until uly.memory('cuda').allocated == held
  uly.cuda.reset()
end

-- the same computation on both devices: fn(inputs...) -> output tensor (or list); inputs are
-- CPU leaves; compares outputs and the gradients of sum(output * w) for a fixed random w
local function same_on_device(fn, inputs, opts)
  opts = opts or {}
  local rtol, atol = opts.rtol or RTOL, opts.atol or ATOL
  local function run(device)
    local leaves = {}
    for i, x in ipairs(inputs) do
      if uly.is_tensor(x) then
        local d = x:detach():to(device)
        if x.requires_grad then d:requires_grad_(true) end
        leaves[i] = d
      else
        leaves[i] = x
      end
    end
    local out = fn(unpack(leaves, 1, #inputs))
    return out, leaves
  end
  local out_c, leaves_c = run('cpu')
  local out_d, leaves_d = run('cuda')
  assert.equal('cuda', out_d:device())
  helpers.assert_close(out_d:cpu(), out_c, rtol, atol, 'output')
  if out_c.requires_grad then
    helpers.reseed(7)
    local w = uly.randn(out_c:shape())
    local wd = w:cuda()
    out_c:mul(w):sum():backward()
    out_d:mul(wd):sum():backward()
    for i, x in ipairs(leaves_c) do
      if uly.is_tensor(x) and x.requires_grad then
        assert.equal('cuda', leaves_d[i].grad:device())
        helpers.assert_close(leaves_d[i].grad:cpu(), x.grad, rtol, atol, 'gradient of input ' .. i)
      end
    end
  end
end

-- three AdamW steps (lr 1e-2) of Model(cfg) on device, on the tokens x: the losses
local function three_step_losses(Model, cfg, x, device)
  helpers.reseed(5)
  local m = Model(cfg):to(device)
  local opt = uly.optim.AdamW(m:parameters(), { lr = 1e-2 })
  local out = {}
  for s = 1, 3 do
    opt:zero_grad()
    local loss = m:loss(x:to(device), x:to(device))
    loss:backward()
    opt:step()
    out[s] = loss:item()
  end
  return out
end

-- runs fn() with the CUDA kernels' int32_t offsets (where they fit), then with ULY_CUDA_INDEX64=1
-- (their int64_t paths, which only tensors of over 1.6 G elements would take otherwise)
pcall(ffi.cdef, 'int setenv(const char *name, const char *value, int overwrite); int unsetenv(const char *name);')
local function both_index_widths(fn)
  fn('int32')
  ffi.C.setenv('ULY_CUDA_INDEX64', '1', 1)
  local ok, err = pcall(fn, 'int64')
  ffi.C.unsetenv('ULY_CUDA_INDEX64')
  if not ok then error(err, 0) end
end

describe('device tensors', function()
  setup(use_device)
  teardown(release_device)
  before_each(function() helpers.reseed() end)

  it('are created on the device and copied back exactly, in every dtype', function()
    for _, dtype in ipairs({ 'f32', 'bf16', 'i32', 'i64', 'f64' }) do
      local h = uly.tensor({ { 1, -2, 3.5 }, { 4, 5, -6 } }, { dtype = dtype })
      local d = h:to('cuda')
      assert.equal('cuda', d:device())
      assert.equal(dtype, d:dtype())
      assert.same(h:totable(), d:totable())
      assert.same(h:totable(), d:cpu():totable())
    end
    assert.equal('cuda', uly.zeros(2, 3, { device = 'cuda' }):device())
    local r = uly.arange(5, { device = 'cuda' })
    assert.equal('cuda', r:device())
    assert.same({ 0, 1, 2, 3, 4 }, r:totable())
    local z = uly.zeros_like(uly.randn(2, 2):cuda())
    assert.equal('cuda', z:device())
    assert.equal('f32', z:dtype())
    assert.equal('cuda', uly.randn_like(z):device())
    assert.same({ { 7, 7 } }, uly.full({ 1, 2 }, 7, { device = 'cuda' }):totable())
  end)

  it('convert dtypes, copy strided views and read and write single elements on the device', function()
    local h = uly.randn(4, 6)
    local d = h:cuda()
    helpers.assert_close(d:t():contiguous():cpu(), h:t():contiguous(), 0, 0)
    helpers.assert_close(d:narrow(2, 2, 3):contiguous():cpu(), h:narrow(2, 2, 3):contiguous(), 0, 0)
    assert.same(h:bf16():totable(), d:bf16():totable())
    assert.same(h:bf16():float():totable(), d:bf16():float():totable())
    d[2][3] = 42
    assert.equal(42, d[2][3]:item())
    assert.equal(42, d:cpu()[2][3]:item())
    local e = uly.zeros(3, 4, { device = 'cuda' })
    e:narrow(1, 2, 1):fill_(5)
    assert.same({ { 0, 0, 0, 0 }, { 5, 5, 5, 5 }, { 0, 0, 0, 0 } }, e:totable())
    e:copy_(uly.tensor({ 1, 2, 3, 4 }))         -- broadcast from the host
    assert.same({ 1, 2, 3, 4 }, e[3]:totable())
  end)

  -- the backend's copy: one memcpy for contiguous tensors, vectorised f32 <-> bf16 conversions
  -- (their last n % 4 elements, misaligned starts), the strided walk over merged dims in 32-bit or
  -- 64-bit offsets: every path gives the CPU's bits and writes nothing outside the destination view
  it('copy between views of any layout and dtype pair: the CPU\'s bits, nothing written outside', function()
    local dtypes = { 'f32', 'bf16', 'i32', 'i64', 'f64' }
    local function shuffled(n)
      local p = {}
      for i = 1, n do p[i] = i end
      for i = n, 2, -1 do local j = math.random(i); p[i], p[j] = p[j], p[i] end
      return p
    end
    both_index_widths(function(width) for trial = 1, 60 do
      local st, dt = dtypes[math.random(#dtypes)], dtypes[math.random(#dtypes)]
      if trial <= 12 then st, dt = (trial % 2 == 0) and 'f32' or 'bf16', (trial % 2 == 0) and 'bf16' or 'f32' end
      local nd = math.random(4)
      local shape, n = {}, 1
      for d = 1, nd do shape[d] = ({ 1, 2, 3, 5, 8, 33 })[math.random(6)]; n = n * shape[d] end
      -- the source: a bigger tensor, sliced (a start of 1 misaligns it), permuted, or a dim broadcast
      local big = {}
      for d = 1, nd do big[d] = shape[d] + (math.random(3) == 1 and 1 or 0) end
      local vals, count = {}, 1
      for d = 1, nd do count = count * big[d] end
      local ints = st:sub(1, 1) == 'i' or dt:sub(1, 1) == 'i'
      for i = 1, count do vals[i] = ints and math.random(-300, 300) or (math.random() - 0.5) * 2 ^ math.random(-20, 20) end
      local host_src = helpers.from_flat(vals, big, { dtype = 'f64' }):to(st)
      local dev_src = host_src:cuda()
      local function view_of(t)
        for d = 1, nd do if big[d] > shape[d] then t = t:narrow(d, 2, shape[d]) end end
        return t
      end
      local hs, ds = view_of(host_src), view_of(dev_src)
      if nd > 1 and math.random(2) == 1 then
        local perm = shuffled(nd)
        hs, ds = hs:permute(unpack(perm)), ds:permute(unpack(perm))
      end
      if math.random(4) == 1 then   -- a broadcast source: its first dim of size > 1 read with stride 0
        local s = hs:shape()
        for d = 1, #s do if s[d] > 1 then
          hs, ds = hs:narrow(d, 1, 1):expand(s), ds:narrow(d, 1, 1):expand(s)
          break
        end end
      end
      -- the destination: contiguous, or a transposed window into a bigger zeroed tensor
      local s = hs:shape()
      local host_dst, dev_dst, host_whole, dev_whole
      if #s > 1 and math.random(2) == 1 then
        local rs = {}
        for d = 1, #s do rs[d] = s[#s + 1 - d] + 1 end
        host_whole, dev_whole = uly.zeros(rs, { dtype = dt }), uly.zeros(rs, { dtype = dt, device = 'cuda' })
        local function win(t)
          for d = 1, #s do t = t:narrow(d, 2, s[#s + 1 - d]) end
          local perm = {}
          for d = 1, #s do perm[d] = #s + 1 - d end
          return t:permute(unpack(perm))
        end
        host_dst, dev_dst = win(host_whole), win(dev_whole)
      else
        host_whole, dev_whole = uly.zeros(s, { dtype = dt }), uly.zeros(s, { dtype = dt, device = 'cuda' })
        host_dst, dev_dst = host_whole, dev_whole
      end
      host_dst:copy_(hs)
      dev_dst:copy_(ds)
      local what = ('trial %d (%s offsets): %s <- %s, shape [%s]'):format(trial, width, dt, st, table.concat(s, ', '))
      assert.same(helpers.list(host_whole), helpers.list(dev_whole:cpu()), what)
      -- and as a dtype conversion into a new tensor
      assert.same(helpers.list(hs:to(dt)), helpers.list(ds:to(dt):cpu()), what .. ' (:to)')
      -- fills of the destination view: zero bits (a memset where contiguous), -0, a value
      local value = ({ 0, -0.0, 2.5 })[trial % 3 + 1]
      host_dst:fill_(value)
      dev_dst:fill_(value)
      local hv, dv = helpers.values(host_whole), helpers.values(dev_whole:cpu())
      for i = 0, host_whole:numel() - 1 do
        assert.is_true(hv[i] == dv[i] and 1 / hv[i] == 1 / dv[i], what .. ' fill ' .. value .. ' at ' .. i)
      end
    end end)
  end)

  -- binary ops over merged dims: same shapes (one dim), broadcasts of every pattern, transposed
  -- operands, f32 and bf16 operands mixed: the CPU's bits, and its gradients
  it('binary ops broadcast any pattern of dims over any layout: the CPU\'s bits and gradients', function()
    local ops = { function(a, b) return a + b end, function(a, b) return a - b end,
                  function(a, b) return a * b end, function(a, b) return a / b end }
    both_index_widths(function(width) for trial = 1, 40 do
      local nd = math.random(4)
      local shape, sa, sb = {}, {}, {}
      for d = 1, nd do
        shape[d] = ({ 1, 2, 3, 7, 16 })[math.random(5)]
        local r = math.random(4)   -- both full, a broadcast, b broadcast, both full
        sa[d] = r == 2 and 1 or shape[d]
        sb[d] = r == 3 and 1 or shape[d]
      end
      local ta, tb = math.random(3) == 1 and 'bf16' or 'f32', math.random(3) == 1 and 'bf16' or 'f32'
      local ha, hb = (uly.randn(sa) + 3):to(ta), (uly.randn(sb) + 3):to(tb)
      local da, db = ha:cuda(), hb:cuda()
      if nd >= 2 and trial % 3 == 0 then   -- the same values laid out with dims 1 and 2 swapped
        ha, da = ha:transpose(1, 2):contiguous():transpose(1, 2), da:transpose(1, 2):contiguous():transpose(1, 2)
      end
      local op = ops[trial % 4 + 1]
      local what = ('trial %d (%s offsets): %s[%s] %s[%s], op %d'):format(trial, width, ta, table.concat(sa, ','), tb,
                                                                       table.concat(sb, ','), trial % 4 + 1)
      assert.same(helpers.list(op(ha, hb)), helpers.list(op(da, db):cpu()), what)
      -- and the gradients: each operand's summed over the dims it was broadcast along (sum_view,
      -- its summed and kept dims merged where they step as one)
      local w = uly.randn(shape)
      local function grads(a, b, device)
        a, b = a:detach():requires_grad_(), b:detach():requires_grad_()
        local loss = (op(a, b) * w:to(device)):sum()
        loss:backward()
        return a.grad:cpu(), b.grad:cpu()
      end
      local hga, hgb = grads(ha, hb, 'cpu')
      local dga, dgb = grads(da, db, 'cuda')
      helpers.assert_close(dga, hga, 1e-4, 1e-5, what .. ' (grad a)')
      helpers.assert_close(dgb, hgb, 1e-4, 1e-5, what .. ' (grad b)')
    end end)
  end)

  -- gradients added into views of a gradient buffer (sum_view summing nothing): contiguous (y += a
  -- x, vectorised where aligned), or a walk over the merged dims of two overlapping windows
  it('add gradients into overlapping, permuted and misaligned windows: the CPU\'s bits', function()
    both_index_widths(function(width) for trial = 1, 20 do
      local rows, cols = math.random(2, 9), math.random(2, 40)
      local vals = {}
      for i = 1, (rows + 2) * (cols + 3) do vals[i] = math.random() - 0.5 end
      local function grads(device)
        local x = helpers.from_flat(vals, { rows + 2, cols + 3 }):to(device):requires_grad_()
        local a = x:narrow(1, 1, rows):narrow(2, 1 + trial % 3, cols)   -- starts 0..2 elements in
        local b = x:narrow(1, 3, rows):narrow(2, 4, cols)
        if trial % 2 == 0 then a, b = a:t(), b:t() end
        local w = helpers.from_flat({ unpack(vals, 1, rows * cols) }, a:shape()):to(device)
        local loss = ((a - b) * w):sum()
        loss:backward()
        return helpers.list(x.grad:cpu())
      end
      assert.same(grads('cpu'), grads('cuda'), ('trial %d (%s offsets): %d x %d'):format(trial, width, rows, cols))
    end end)
  end)

  it('refuse to mix devices in one op, naming both and the fix', function()
    local a, b = uly.randn(2, 3), uly.randn(2, 3):cuda()
    for _, f in ipairs({ function() return a + b end, function() return b:matmul(a:t()) end,
                         function() return uly.cat({ a, b }, 1) end }) do
      local msg = helpers.error_of(f)
      assert.matches("is on c%a+ but '[^']+' is on c%a+", msg)
      assert.matches(":to%('cuda'%)", msg)
    end
    assert.matches('host cannot read', helpers.error_of(function() return b:data() end), 1, true)
  end)

  it('move gradients back across :to()', function()
    local x = uly.randn(3, 4, { requires_grad = true })
    local y = (x:cuda() * 2):sum()
    y:backward()
    assert.equal('cpu', x.grad:device())
    helpers.assert_close(x.grad, uly.full({ 3, 4 }, 2), 0, 0)
  end)

  describe('ops give the CPU values and gradients', function()
    local function R(...) return uly.randn(...):requires_grad_() end
    local cases = {
      { 'add (broadcast)', function(a, b) return a + b end, function() return { R(3, 4), R(4) } end },
      { 'sub', function(a, b) return a - b end, function() return { R(3, 4), R(3, 1) } end },
      { 'a bias gradient summed over 5000 rows (chunked reduction)', function(a, b) return a + b end,
        -- the CPU adds 5000 unit-scale floats in f32: its own rounding reaches ~1e-4 where they cancel
        function() return { R(5000, 3), R(3) } end, { rtol = math.max(RTOL, 1e-4), atol = math.max(ATOL, 1e-3) } },
      { 'layernorm over 300 rows (chunked parameter gradients)', function(x, w, b) return uly.layernorm(x, w, b) end,
        function() return { R(300, 5), R(5), R(5) } end },
      { 'mul', function(a, b) return a * b end, function() return { R(2, 3, 4), R(1, 3, 4) } end },
      { 'div', function(a, b) return a / b end, function() return { R(3, 4), uly.rand(3, 4):add(0.5):requires_grad_() } end },
      { 'scalars', function(a) return ((a + 1) * 3) ^ 2 end, function() return { R(5, 3) } end },
      { 'matmul', function(a, b) return a:matmul(b) end, function() return { R(5, 7), R(7, 3) } end },
      { 'batched matmul', function(a, b) return a:matmul(b) end, function() return { R(2, 4, 5, 6), R(4, 6, 3) } end },
      { 'addmm (a Linear layer)', function(a, w, b) return uly.addmm(a, w, b) end, function() return { R(2, 5, 7), R(7, 3), R(3) } end },
      { 'matmul of transposes', function(a, b) return a:t():matmul(b:t()) end, function() return { R(6, 5), R(3, 6) } end },
      { 'sum and mean', function(a) return a:sum(2) + a:mean(2) end, function() return { R(3, 5, 2) } end },
      { 'max', function(a) return (a:max(2)) end, function() return { R(4, 6) } end },
      { 'softmax', function(a) return a:softmax(-1) end, function() return { R(3, 7) } end },
      { 'log_softmax', function(a) return a:log_softmax(1) end, function() return { R(5, 3) } end },
      { 'layernorm', function(x, w, b) return uly.layernorm(x, w, b) end, function() return { R(4, 8), R(8), R(8) } end },
      { 'rmsnorm', function(x, w) return uly.rmsnorm(x, w) end, function() return { R(4, 8), R(8) } end },
      { 'gelu', function(a) return uly.gelu(a) end, function() return { R(50) } end },
      { 'silu, tanh, sigmoid', function(a) return a:silu() + a:tanh() + a:sigmoid() end, function() return { R(40) } end },
      { 'relu', function(a) return a:relu() end, function() return { R(40) } end },
      { 'exp, log, sqrt', function(a) return a:exp() + a:log() + a:sqrt() end,
        function() return { uly.rand(30):add(0.5):requires_grad_() } end },
      { 'swiglu', function(g, u) return uly.swiglu(g, u) end, function() return { R(6, 5), R(6, 5) } end },
      { 'rope', function(x) return uly.rope(x, 3) end, function() return { R(2, 5, 3, 8) } end },
      -- more pairs a row than a block has threads; heads wider than the shared angle table
      { 'rope, 6 heads of 128', function(x) return uly.rope(x, 1) end, function() return { R(1, 4, 6, 128) } end },
      { 'rope, a head of 1030', function(x) return uly.rope(x) end, function() return { R(1, 3, 1, 1030) } end },
      { 'views, permutes, narrows, expands, cat', function(a, b)
          return uly.cat({ a:permute(2, 1, 3):narrow(1, 2, 2), b:expand(2, 3, 4) }, 2)
        end, function() return { R(3, 3, 4), R(1, 1, 4) } end },
      { 'dtype round trip', function(a) return a:double():float() * 2 end, function() return { R(3, 3) } end },
    }
    for _, c in ipairs(cases) do
      it(c[1], function() same_on_device(c[2], c[3](), c[4]) end)
    end

    it('embedding (integer ids on the device too)', function()
      local idx = helpers.token_ids(2, 5, 11)
      same_on_device(function(w, i) return uly.embedding(i, w) end, { uly.randn(11, 4):requires_grad_(), idx })
    end)

    it('cross-entropy with ignored targets, each reduction', function()
      local y = helpers.token_ids(3, 4, 9)
      y[2][3] = -1
      for _, red in ipairs({ 'mean', 'sum', 'none' }) do
        same_on_device(function(l, t) return uly.cross_entropy(l, t, { ignore_index = -1, reduction = red }) end,
                       { uly.randn(3, 4, 9):requires_grad_(), y })
      end
    end)

    it('dropout draws the same mask as the CPU from the same generator state', function()
      same_on_device(function(x)
        helpers.reseed(11)
        return uly.dropout(x, 0.3, true)
      end, { uly.randn(64, 16):requires_grad_() })
    end)

    it('reference and flash attention, with causal, window and document masks', function()
      local q, k, v = uly.randn(2, 70, 4, 16), uly.randn(2, 70, 2, 16), uly.randn(2, 70, 2, 16)
      for _, x in ipairs({ q, k, v }) do x:requires_grad_() end
      same_on_device(function(a, b, c) return uly.attention(a, b, c, { causal = true }) end, { q, k, v })
      local docs = uly.tensor({ 0, 0, 0, 1, 1, 2 }, { dtype = 'i32' }):view(1, 6):expand(2, 6):contiguous()
      docs = uly.cat({ docs, uly.full({ 2, 64 }, 3, { dtype = 'i32' }) }, 2)
      same_on_device(function(a, b, c, d)
        return uly.flash_attention(a, b, c, { causal = true, window = 9, q_doc = d, k_doc = d })
      end, { q, k, v, docs })
    end)

    it('flash attention: block-sparse layout, two-sided window, fewer queries than keys, strided q/k/v', function()
      -- q/k/v are narrows of one fused [B, T, H + 2 Hkv, D] buffer (the Ulysses receive layout)
      local fused = uly.randn(1, 45, 6 + 2 * 2, 8):requires_grad_()
      local layout = uly.attention_layouts.from_function(2, 3, function(r, c) return c == 0 or c == r + 1 end)
      same_on_device(function(f, lay)
        local q = f:narrow(3, 1, 6):narrow(2, 15, 31)       -- 31 queries, the last ones
        local k, v = f:narrow(3, 7, 2), f:narrow(3, 9, 2)   -- 45 keys
        local a = uly.flash_attention(q, k, v, { window = { 9, 3 } })
        local b = uly.flash_attention(q, k, v, { block_layout = lay, block_size = 16, causal = true })
        return a + b
      end, { fused, layout })
    end)

    it('refuse bad input exactly as on the CPU (embedding ids, targets out of range)', function()
      local w = uly.randn(5, 3):cuda()
      local msg = helpers.error_of(function() return uly.embedding(uly.tensor({ 1, 7 }, { dtype = 'i32' }):cuda(), w) end)
      assert.matches('index 7 at [2] of i32[2]@cuda', msg, 1, true)   -- 1-based, as Lua indexes
      msg = helpers.error_of(function()
        return uly.cross_entropy(uly.randn(2, 4):cuda(), uly.tensor({ 1, 4 }, { dtype = 'i32' }):cuda())
      end)
      assert.matches('target 4 at [2] of i32[2]@cuda is out of range for 4 classes', msg, 1, true)
    end)
  end)

  describe('optimizers and models', function()
    local GPT = require 'models.gpt'
    local Llama = require 'models.llama'

    -- n AdamW steps of a model on a device; the losses and the final parameters (on the host)
    local function train(Model, cfg, device, x, y, steps)
      helpers.reseed(3)
      local m = Model(cfg):to(device)
      local opt = uly.optim.AdamW(m:parameters(), { lr = 1e-2, weight_decay = 0.1 })
      local losses, grads = {}, {}
      for s = 1, steps do
        opt:zero_grad()
        local loss = m:loss(x:to(device), y:to(device))
        loss:backward()
        if s == 1 then for name, p in m:named_parameters() do grads[name] = p.grad:cpu():clone() end end
        uly.optim.clip_grad_norm(m:parameters(), 1.0)
        opt:step()
        losses[s] = loss:item()
      end
      local params = {}
      for name, p in m:named_parameters() do params[name] = p:cpu() end
      return losses, params, m, grads
    end

    -- the update itself has the CPU's bits (torch.optim's ops rounded as ATen's CPU kernels round:
    -- kernels/cpu/optim.c), for one parameter and for many in one launch (adamw_multi)
    it('AdamW and SGD: the CPU\'s bits for the same parameters and grads, one tensor or many', function()
      local shapes = { { 37 }, { 33, 31 }, { 70, 90 } }
      local function run(device, make)
        helpers.reseed(17)
        local params, grads = {}, {}
        for k, shape in ipairs(shapes) do params[k] = uly.randn(shape):to(device):requires_grad_() end
        local opt = make(params)
        for s = 1, 3 do
          for k, p in ipairs(params) do
            local g = uly.randn(shapes[k]):mul(10 ^ ((s + k) % 5 - 2)):to(device)
            assert(uly.C.uly_tensor_set_grad(p._h, g._h) == 0)
          end
          opt:step()
        end
        for k, p in ipairs(params) do params[k] = p:cpu() end
        return params
      end
      for name, make in pairs {
        AdamW = function(ps) return uly.optim.AdamW({ { params = ps, weight_decay = 0.1 } }, { lr = 1e-2, eps = 1e-8 }) end,
        ['AdamW, one tensor'] = function(ps) return uly.optim.AdamW({ ps[3] }, { lr = 1e-2, weight_decay = 0.1 }) end,
        SGD = function(ps) return uly.optim.SGD(ps, { lr = 0.05, momentum = 0.9, dampening = 0.1, weight_decay = 0.1 }) end,
        ['SGD nesterov'] = function(ps) return uly.optim.SGD(ps, { lr = 0.05, momentum = 0.8, nesterov = true }) end,
      } do
        local pc, pd = run('cpu', make), run('cuda', make)
        for k = 1, #shapes do helpers.assert_close(pd[k], pc[k], 0, 0, name .. ': parameter ' .. k) end
      end
    end)

    for _, case in ipairs({ { 'GPT', GPT, { preset = 'tiny', dropout = 0.1 } },
                            { 'Llama (GQA)', Llama, { preset = 'tiny', kv_heads = 2 } },
                            { 'Llama with activation checkpointing, tiled MLP and loss, a window', Llama,
                              { preset = 'tiny', kv_heads = 2, checkpoint = true, tile = 6, window = 5 } },
                            { 'GPT checkpointed except attention (backward without its forward)', GPT,
                              { preset = 'tiny', checkpoint = 'except_attention', window = 9 } },
                            { 'GPT with the reference attention kernel', GPT, { preset = 'tiny', attention = 'reference' } } }) do
      it(case[1] .. ': three training steps match the CPU, loss by loss and parameter by parameter', function()
        local x, y = helpers.token_ids(2, 16, 256), helpers.token_ids(2, 16, 256)
        local lc, pc, _, gc = train(case[2], case[3], 'cpu', x, y, 3)
        local ld, pd, m, gd = train(case[2], case[3], 'cuda', x, y, 3)
        for s = 1, 3 do assert.is_true(math.abs(lc[s] - ld[s]) <= 10 * RTOL * math.abs(lc[s]), ('step %d: %g vs %g'):format(s, lc[s], ld[s])) end
        -- the first step's gradients closely; the parameters after 3 AdamW steps within a small
        -- fraction of one step (lr 1e-2): m / sqrt(v) turns tiny gradient differences into O(lr) ones
        for name, g in pairs(gc) do
          local scale = 0
          local v, n = helpers.values(g)
          for i = 0, n - 1 do scale = math.max(scale, math.abs(v[i])) end
          helpers.assert_close(gd[name], g, 10 * RTOL, 10 * RTOL * scale + 1e-12, 'gradient of ' .. name)
        end
        -- (an element whose gradient is ~0 can move by up to lr per step either way: allow 20 % of
        -- the 3 steps of lr 1e-2 beyond the simulation, which runs the CPU's own kernels)
        local patol = MODE == 'sim' and 10 * ATOL or 0.2 * 3 * 1e-2
        for name, p in pairs(pc) do helpers.assert_close(pd[name], p, 10 * RTOL, patol, name) end
        for _, p in ipairs(m:parameters()) do assert.equal('cuda', p:device()) end
      end)
    end

    it('Module:to keeps the parameter objects and refuses optimizer state left on the other device', function()
      local m = GPT { preset = 'tiny' }
      local p1 = m:parameters()[1]
      local opt = uly.optim.AdamW(m:parameters(), { lr = 1e-3 })
      m:to('cuda')
      assert.equal(p1, m:parameters()[1])
      assert.equal('cuda', p1:device())
      assert.is_true(p1.requires_grad and p1:is_leaf())
      local x = helpers.token_ids(1, 8, 256)
      m:loss(x:cuda(), x:cuda()):backward()
      opt:zero_grad(false)
      local msg = helpers.error_of(function()
        m:loss(x:cuda(), x:cuda()):backward()
        opt:step()
      end)
      assert.matches('on cpu but the parameter is on cuda', msg, 1, true)
    end)

    it('uly.device makes new tensors and models land on the device by default', function()
      local prev = uly.device('cuda')
      local ok, err = pcall(function()
        assert.equal('cuda', uly.zeros(2):device())
        assert.equal('cuda', uly.randn(2, 2):device())
        local m = Llama({ preset = 'tiny', kv_heads = 2 })
        for name, p in m:named_parameters() do assert.equal('cuda', p:device(), name) end
        local x = helpers.token_ids(1, 8, 256):cuda()
        assert.equal('cuda', m:loss(x, x):device())
        assert.equal(12, #m:generate(x:narrow(2, 1, 4), { max_new_tokens = 12 }))
      end)
      uly.device(prev)
      assert(ok, err)
      assert.equal('cpu', uly.zeros(2):device())
    end)

    it('checkpoints a model on the device and restores it exactly', function()
      if not uly.has('hdf5') then return end   -- a GPU image without HDF5 (scripts/gpu-check.sh)
      local dir = helpers.mkdtemp()
      local m = Llama({ preset = 'tiny' }):to('cuda')
      local opt = uly.optim.AdamW(m:parameters(), { lr = 1e-3 })
      local x = helpers.token_ids(1, 8, 256)
      m:loss(x:cuda(), x:cuda()):backward()
      opt:step()
      uly.checkpoint.save(dir .. '/c.h5', { model = m, optim = opt, step = 1 })
      local m2 = Llama({ preset = 'tiny' }):to('cuda')
      local opt2 = uly.optim.AdamW(m2:parameters(), { lr = 1e-3 })
      uly.checkpoint.load(dir .. '/c.h5', { model = m2, optim = opt2 })
      for name, p in m:named_parameters() do
        local q = nil
        for n2, p2 in m2:named_parameters() do if n2 == name then q = p2 end end
        assert.equal('cuda', q:device())
        helpers.assert_close(q:cpu(), p:cpu(), 0, 0, name)
      end
      helpers.rmtree(dir)
    end)

    it('saves a model on the device as safetensors and loads it into one on either device', function()
      local dir = helpers.mkdtemp()
      local m = Llama({ preset = 'tiny' }):to('cuda')
      uly.safetensors.save(dir .. '/w.safetensors', m)
      local on_host = Llama({ preset = 'tiny', tied = true })   -- no output layer: strict refuses, lax loads
      assert.matches('1 tensors in it are not parameters of the model: "output.weight"',
                     helpers.error_of(uly.safetensors.load_into, on_host, dir .. '/w.safetensors'), 1, true)
      local r = uly.safetensors.load_into(on_host, dir .. '/w.safetensors', { strict = false })
      assert.are.same({ 'output.weight' }, r.unexpected)
      helpers.reseed(9)
      local on_device = Llama({ preset = 'tiny' }):to('cuda')
      uly.safetensors.load_into(on_device, dir .. '/w.safetensors')
      local host, dev = {}, {}
      for name, p in on_host:named_parameters() do host[name] = p end
      for name, p in on_device:named_parameters() do dev[name] = p end
      for name, p in m:named_parameters() do
        assert.equal('cuda', dev[name]:device())
        helpers.assert_close(dev[name]:cpu(), p:cpu(), 0, 0, name)
        if host[name] then helpers.assert_close(host[name], p:cpu(), 0, 0, name .. ' (host)') end
      end
      helpers.rmtree(dir)
    end)

    it('uly.pretrained.load puts a saved model on the device: the CPU\'s losses, and its greedy tokens past the context', function()
      local dir = helpers.mkdtemp()
      local m = Llama({ preset = 'tiny', seq = 8 })
      uly.safetensors.save(dir .. '/w.safetensors', m, { metadata = {
        ulysses_config = uly.checkpoint.serialize(require('models.common').plain_config(m.config), 'config') } })
      local dev, info = uly.pretrained.load(dir .. '/w.safetensors', { device = 'cuda' })
      assert.are.same({ 'cuda', 'text' }, { dev:parameters()[1]:device(), info.kind })
      local x = helpers.token_ids(2, 8, 256)
      local y = helpers.token_ids(2, 8, 256)
      local want = uly.no_grad(function() return m:loss(x, y, { reduction = 'none' }) end)
      local got = uly.no_grad(function() return dev:loss(x:cuda(), y:cuda(), { reduction = 'none' }) end)
      helpers.assert_within(got:cpu(), want, 1e-4, 'per-token losses')
      local prompt = x:narrow(2, 1, 3):narrow(1, 1, 1):contiguous()
      local a = m:generate(prompt, { max_new_tokens = 12, temperature = 0, slide = true })
      local b = dev:generate(prompt:cuda(), { max_new_tokens = 12, temperature = 0, slide = true })
      assert.are.same(a, b)
      helpers.rmtree(dir)
    end)
  end)

  describe('the caching pool', function()
    it('makes no device allocation once a training step is warm, and counts peak and reserved', function()
      local m = require('models.gpt')({ preset = 'tiny' }):to('cuda')
      local opt = uly.optim.AdamW(m:parameters(), { lr = 1e-3 })
      local x = helpers.token_ids(2, 16, 256):cuda()
      local function step()
        opt:zero_grad()
        m:loss(x, x):backward()
        opt:step()
        collectgarbage('collect')
      end
      step()
      step()
      local before = uly.memory('cuda')
      step()
      local after = uly.memory('cuda')
      assert.equal(before.raw_allocs, after.raw_allocs)
      assert.is_true(after.peak >= after.allocated and after.reserved >= after.allocated)
      assert.is_true(after.allocated > 0)
    end)

    it('fails cleanly beyond its limit, naming the device, and stays usable', function()
      local limit = uly.memory('cuda').limit
      uly.memory_limit(uly.memory('cuda').allocated + (1 * 2^20), 'cuda')
      local msg = helpers.error_of(function() return uly.empty({ 4 * 2^20 }, { device = 'cuda' }) end)
      uly.memory_limit(limit, 'cuda')
      assert.matches('out of memory on the cuda device', msg, 1, true)
      assert.equal(3, uly.full({ 2 }, 3, { device = 'cuda' })[1]:item())
    end)

    if not REAL then
      it('gives its cache back and retries once when the device runs out', function()
        collectgarbage('collect')
        uly.empty_cache('cuda')
        local base_alloc = uly.memory('cuda').allocated
        pcall(ffi.cdef, 'int setenv(const char *name, const char *value, int overwrite);')
        pcall(ffi.cdef, 'int unsetenv(const char *name);')
        ffi.C.setenv('ULY_SIM_MEMORY', tostring(base_alloc + (48 * 2^20)), 1)
        local ok, err = pcall(function()
          local a = uly.empty({ 8 * 2^20 }, { device = 'cuda' })   -- 32 MiB
          a = nil
          collectgarbage('collect')                               -- cached, not freed
          assert.is_true(uly.memory('cuda').reserved >= base_alloc + (32 * 2^20))
          local frees = uly.memory('cuda').raw_frees
          local b = uly.empty({ 9 * 2^20 }, { device = 'cuda' })   -- 36 MiB fits only without the cache
          assert.equal(9 * 2^20, b:numel())
          assert.is_true(uly.memory('cuda').raw_frees > frees)
          local msg = helpers.error_of(function() return uly.empty({ 16 * 2^20 }, { device = 'cuda' }) end)
          assert.matches('simulated out of memory', msg, 1, true)
        end)
        ffi.C.unsetenv('ULY_SIM_MEMORY')
        assert(ok, err)
      end)
    end
  end)
end)

-- TF32, the default for f32 GEMMs on a GPU (and on the emulator, which rounds the same way):
-- within TF32's rounding of the CPU, and different from full f32 (the setting reaches cuBLAS)
describe('TF32 GEMMs', function()
  setup(use_device)
  teardown(function() if REAL then uly.cuda.tf32(false) end release_device() end)

  it('is the default; uly.cuda.tf32 switches it and refuses anything but a boolean', function()
    if not REAL then return end
    local prev = uly.cuda.tf32(true)
    assert.is_false(prev)   -- the suite's setting
    assert.is_true(uly.cuda.tf32())
    local ok, err = pcall(uly.cuda.tf32, 'on')
    assert.is_false(ok)
    assert.matches("uly.cuda.tf32: expected true, false or nothing, got string on", err, 1, true)
    -- a fresh process starts in TF32
    local cmd = table.concat({ 'ULY_CUDA_LIB=' .. helpers.shq(os.getenv('ULY_CUDA_LIB') or ''),
      "LUA_PATH='lua/?.lua;lua/?/init.lua;;' luajit -e", helpers.shq("print('tf32 ' .. tostring(require('ulysses').cuda.tf32()))"),
      '2>&1' }, ' ')
    local p = assert(io.popen(cmd))
    local out = p:read('*a')
    p:close()
    assert.matches('tf32 true', out, 1, true)
  end)

  it('matmul, addmm and bmm: within TF32 rounding of the CPU, and not full f32', function()
    if not REAL then return end
    helpers.reseed(51)
    local a, b, bias = uly.randn(96, 300), uly.randn(300, 70), uly.randn(70)
    local a3, b3 = uly.randn(3, 40, 200), uly.randn(3, 200, 24)
    local function err(got, want)   -- the largest difference over the largest value
      local g, w = helpers.values(got:cpu():contiguous())
      local x, n = helpers.values(want:contiguous())
      local worst, big = 0, 0
      for i = 0, n - 1 do worst = math.max(worst, math.abs(g[i] - x[i])); big = math.max(big, math.abs(x[i])) end
      return worst / big
    end
    for _, c in ipairs({ { 'matmul', function(x, y) return x:matmul(y) end, { a, b } },
                         { 'addmm', function(x, y, z) return uly.addmm(x, y, z) end, { a, b, bias } },
                         { 'bmm', function(x, y) return x:matmul(y) end, { a3, b3 } } }) do
      local cpu = c[2](unpack(c[3]))
      local dev = {}
      for i, x in ipairs(c[3]) do dev[i] = x:cuda() end
      uly.cuda.tf32(true)
      local e32 = err(c[2](unpack(dev)), cpu)
      uly.cuda.tf32(false)
      local full = err(c[2](unpack(dev)), cpu)
      -- TF32 keeps 10 of f32's 23 mantissa bits (2^-11 relative per operand, both rounded)
      assert.is_true(e32 < 4e-3, ('%s in TF32: error %.3g of the largest value'):format(c[1], e32))
      assert.is_true(e32 > 1e-5, ('%s in TF32: error %.3g, as full f32 (is TF32 on?)'):format(c[1], e32))
      assert.is_true(full < 1e-5, ('%s in full f32: error %.3g of the largest value'):format(c[1], full))
    end
  end)
end)

describe('mixed precision (matmul in bf16)', function()
  local function rounded(t) return t:bf16():float() end
  after_each(function() uly.matmul_precision('f32') end)

  -- the f32 operands are rounded to bf16 four at a time where aligned, one at a time elsewhere
  -- (a view 13 floats into its buffer) and for the tail (counts not a multiple of 4)
  it('rounds operands of any alignment and length: the CPU\'s bf16 product', function()
    use_device()
    helpers.reseed(52)
    local whole, b = uly.randn(9, 13), uly.randn(13, 5)
    local a = whole:narrow(1, 2, 7)   -- 7 x 13, starting 13 floats (52 bytes) in
    local big_a, big_b = uly.randn(64, 95), uly.randn(95, 33)   -- aligned; 6080 and 3135 elements (a tail of 3)
    uly.matmul_precision('bf16')
    local function on_device(x, y, row0, rows) return x:cuda():narrow(1, row0, rows):matmul(y:cuda()):cpu() end
    local rtol, atol = math.max(RTOL, 1e-5), math.max(ATOL, 1e-6)   -- the same bf16 products, summed in another order
    helpers.assert_close(on_device(whole, b, 2, 7), a:matmul(b), rtol, atol, 'bf16 matmul of a view')
    helpers.assert_close(on_device(big_a, big_b, 1, 64), big_a:matmul(big_b), rtol, atol, 'aligned bf16 matmul')
    release_device()
  end)

  it('rounds both operands and the output gradient to bf16 and accumulates in f32', function()
    helpers.reseed()
    local a, b = uly.randn(2, 5, 7):requires_grad_(), uly.randn(7, 3):requires_grad_()
    local w = uly.randn(2, 5, 3)
    assert.equal('f32', uly.matmul_precision('bf16'))
    local out = a:matmul(b)
    out:mul(w):sum():backward()
    assert.equal('bf16', uly.matmul_precision('f32'))
    local ra, rb = rounded(a:detach()):requires_grad_(), rounded(b:detach()):requires_grad_()
    local ref = ra:matmul(rb)
    helpers.assert_close(out, ref, 1e-6, 1e-6, 'output')
    -- backward: dA = round(dC) round(B)^T, dB = round(A)^T round(dC) with dC = w
    local ga = rounded(w):matmul(rounded(b:detach()):t())
    local gb = rounded(a:detach()):view(10, 7):t():matmul(rounded(w):view(10, 3))
    helpers.assert_close(a.grad, ga, 1e-6, 1e-6, 'grad a')
    helpers.assert_close(b.grad, gb, 1e-6, 1e-6, 'grad b')
    -- and it differs from full f32 (the flag does something)
    local full = a:detach():matmul(b:detach())
    assert.is_true(helpers.values(full)[0] ~= helpers.values(out)[0] or helpers.values(full)[1] ~= helpers.values(out)[1])
  end)

  -- the compact bf16 operands of the chunked path: rows of 4 moved at once where D, the strides and
  -- the pointers allow, one element at a time where not (D 6; q, k and v windows of one buffer)
  it('gives the bf16 attention GEMMs their operands from any layout: close to f32', function()
    if MODE == 'sim' then return end
    use_device()
    helpers.reseed(10)
    both_index_widths(function() for _, D in ipairs({ 6, 8 }) do
      local fused = uly.randn(2, 24, 7, D):bf16():float()   -- bf16 values: the rounding is exact
      local function qkv(t)   -- 2 heads each, from head 1 on: D 6 starts them off 4-element bounds
        return t:narrow(3, 2, 2), t:narrow(3, 4, 2), t:narrow(3, 6, 2)
      end
      local function run(precision)
        uly.matmul_precision(precision)
        local q, k, v = qkv(fused:cuda():requires_grad_())
        local o = uly.flash_attention(q, k, v, { causal = true })
        local w = uly.randn(o:shape())
        local loss = (o * w:cuda()):sum()
        loss:backward()
        uly.matmul_precision('f32')
        return o:detach():cpu()
      end
      helpers.reseed(11)
      local o32 = run('f32')
      helpers.reseed(11)
      local o16 = run('bf16')
      helpers.assert_close(o16, o32, 2e-2, 2e-2, 'D ' .. D)
    end end)
    release_device()
  end)

  it('runs the attention GEMMs in bf16 too (the CPU kernel where AMX tiles run it, else f32), close to f32', function()
    use_device()
    helpers.reseed(9)
    local q, k, v = uly.randn(1, 40, 4, 16), uly.randn(1, 40, 2, 16), uly.randn(1, 40, 2, 16)
    local function run(precision)
      uly.matmul_precision(precision)
      local qd, kd, vd = q:cuda():requires_grad_(), k:cuda():requires_grad_(), v:cuda():requires_grad_()
      local o = uly.flash_attention(qd, kd, vd, { causal = true })
      o:sum():backward()
      uly.matmul_precision('f32')
      return o:detach():cpu(), qd.grad:cpu(), vd.grad:cpu()   -- detached: o's graph holds the device leaves
    end
    local o32, gq32, gv32 = run('f32')
    local o16, gq16, gv16 = run('bf16')
    helpers.assert_close(o16, o32, 3e-2, 3e-2, 'output')
    helpers.assert_close(gq16, gq32, 5e-2, 5e-2, 'dq')
    helpers.assert_close(gv16, gv32, 3e-2, 3e-2, 'dv')
    local same = helpers.values(o16)[0] == helpers.values(o32)[0] and helpers.values(o16)[5] == helpers.values(o32)[5]
    if MODE == 'sim' and uly.cpu_amx() ~= 'on' then assert.is_true(same, 'the CPU kernel without AMX ignores the flag')
    else assert.is_false(same, 'bf16 attention GEMMs round their operands') end
    release_device()
  end)

  -- bf16 activations on the device: the GEMMs read bf16 activations as they are (no rounded copy),
  -- the fused attention its bf16 q, k, v; each op's result is rounded once, as on the CPU
  it('bf16 activations: the ops give the CPU\'s numbers, and a Llama step the CPU\'s losses', function()
    use_device()
    helpers.reseed(61)
    local function B(...) return uly.randn(...):bf16():requires_grad_() end
    local function F(...) return uly.randn(...):requires_grad_() end
    uly.matmul_precision('bf16')
    uly.activation_dtype('bf16')
    local ok, err = pcall(function()
      -- one rounding of the result, at most a bf16 step apart where the f32 sums' orders differ
      local tol = { rtol = 1e-2, atol = 1e-2 }
      same_on_device(function(a, w) return a:matmul(w) end, { B(2, 5, 16), F(16, 8) }, tol)
      same_on_device(function(a, w, b) return uly.addmm(a, w, b) end, { B(2, 5, 16), F(16, 8), F(8) }, tol)
      same_on_device(function(x, w) return uly.rmsnorm(x, w) end, { B(3, 32), F(32) }, tol)
      same_on_device(function(x, w, b) return uly.layernorm(x, w, b) end, { B(3, 32), F(32), F(32) }, tol)
      same_on_device(function(g, u) return uly.swiglu(g, u) end, { B(4, 8), B(4, 8) }, tol)
      same_on_device(function(x) return x:rope(2) + x:gelu() end, { B(1, 6, 2, 8) }, tol)
      same_on_device(function(a, b) return (a * b):softmax(2) end, { B(4, 9), F(9) }, tol)
      local targets = uly.tensor({ 1, 4, 0, 2 }, { dtype = 'i32' })
      same_on_device(function(l) return uly.cross_entropy(l, targets:to(l:device())) end, { B(4, 5) }, tol)
      -- the fused kernels (D 32) read bf16 q, k, v; the CPU's kernel rounds P and dS only on AMX
      same_on_device(function(q, k, v) return uly.flash_attention(q, k, v, { causal = true }) end,
                     { B(1, 40, 4, 32), B(1, 40, 2, 32), B(1, 40, 2, 32) }, { rtol = 3e-2, atol = 3e-2 })
      local Llama = require 'models.llama'
      local x = helpers.token_ids(2, 32, 256)
      local function losses(device)
        return three_step_losses(Llama, { preset = 'tiny', heads = 4, kv_heads = 2, dim = 64, hidden = 96, seq = 32,
                                          attention = 'flash', checkpoint = 'except_attention', tile = 8 }, x, device)
      end
      local cpu, dev = losses('cpu'), losses('cuda')
      for s = 1, 3 do
        local t = MODE == 'sim' and 10 * RTOL or (s == 1 and 5e-3 or 2e-2)
        assert.is_true(math.abs(cpu[s] - dev[s]) <= t * cpu[s], ('step %d: %g vs %g'):format(s, cpu[s], dev[s]))
      end
    end)
    uly.activation_dtype('f32')
    assert(ok, err)
    release_device()
  end)

  -- the kernels that read and write bf16 (norms, SwiGLU, elementwise, cross-entropy) against the
  -- converting copies around the f32 kernels: the same bits, and they do run (by kernel name)
  it('bf16 activations: the bf16 kernels give the bits of converting copies around the f32 kernels', function()
    if not REAL then
      assert.is_true(uly.cuda.bf16_kernels())   -- without the CUDA library: true, changing nothing
      return
    end
    use_device()
    local ok, err = pcall(function()
      uly.matmul_precision('bf16')
      uly.activation_dtype('bf16')
      local x = helpers.token_ids(2, 24, 256):cuda()
      local function step(Model, cfg, native)
        local prev = uly.cuda.bf16_kernels(native)
        helpers.reseed(8)
        local m = Model(cfg):to('cuda')
        local loss
        local report = uly.cuda.profile(function()
          loss = m:loss(x, x)
          loss:backward()
        end)
        uly.cuda.bf16_kernels(prev)
        local names = {}
        for _, kern in ipairs(report.kernels) do names[kern.name] = true end
        local grads = {}
        for i, p in ipairs(m:parameters()) do grads[i] = p.grad:cpu() end
        return loss:item(), grads, names
      end
      local GPT, Llama = require 'models.gpt', require 'models.llama'
      for _, c in ipairs({ { GPT, { preset = 'tiny', seq = 24, tile = 8 }, 'norm_fw bf16' },
                           { Llama, { preset = 'tiny', heads = 4, kv_heads = 2, dim = 32, hidden = 48, seq = 24,
                                      checkpoint = 'except_attention', tile = 8 }, 'swiglu_fw bf16' } }) do
        local l1, g1, n1 = step(c[1], c[2], true)
        local l0, g0, n0 = step(c[1], c[2], false)
        -- the same arithmetic in both instantiations of each kernel; on a GPU nvcc might still
        -- contract one of them into an FMA differently, a last bit that backward may grow: 1e-4 there
        local tol = MODE == 'cuda' and 1e-4 or 0
        assert.is_true(math.abs(l0 - l1) <= tol * math.abs(l0), ('loss %.9g vs %.9g'):format(l1, l0))
        for i = 1, #g0 do helpers.assert_close(g1[i], g0[i], tol, tol, 'gradient of parameter ' .. i) end
        assert.truthy(n1[c[3]], c[3] .. ' did not run')
        assert.is_nil(n0[c[3]], c[3] .. ' ran with the bf16 kernels off')
      end
      assert.has_error(function() uly.cuda.bf16_kernels('yes') end)
    end)
    uly.activation_dtype('f32')
    uly.matmul_precision('f32')
    assert(ok, err)
    release_device()
  end)

  -- cuBLASLt's heuristic is asked once per distinct GEMM problem: a decoding step's small GEMMs
  -- would pay tens of microseconds each time otherwise
  it('asks cuBLASLt for an algorithm once per distinct GEMM, in either precision', function()
    if not REAL then return end   -- the simulation has no cuBLASLt
    use_device()
    local a, b = uly.randn(37, 53):cuda(), uly.randn(53, 29):cuda()
    for _, precision in ipairs({ 'f32', 'bf16' }) do
      uly.matmul_precision(precision)
      local before = uly.cuda.gemm_heuristic_queries()
      local first = a:matmul(b):cpu()
      assert.equal(before + 1, uly.cuda.gemm_heuristic_queries())
      local again = a:matmul(b):cpu()
      assert.equal(before + 1, uly.cuda.gemm_heuristic_queries())   -- the kept answer
      helpers.assert_close(again, first, 0, 0, 'the same algorithm, the same bits')
      a:narrow(1, 1, 36):matmul(b)                                    -- another problem
      assert.equal(before + 2, uly.cuda.gemm_heuristic_queries())
      -- ULY_CUDA_GEMM=cublas (bench/gpu.lua's comparison): cuBLAS's GemmEx, cuBLASLt never asked,
      -- the same product within rounding of the summation order
      ffi.C.setenv('ULY_CUDA_GEMM', 'cublas', 1)
      local ex = a:matmul(b:narrow(2, 1, 28)):cpu()
      assert.equal(before + 2, uly.cuda.gemm_heuristic_queries())
      ffi.C.setenv('ULY_CUDA_GEMM', '', 1)
      helpers.assert_close(ex, first:narrow(2, 1, 28), 1e-5, 1e-5, 'GemmEx vs cuBLASLt, ' .. precision)
    end
    uly.matmul_precision('f32')
    release_device()
  end)

  it('refuses other precisions', function()
    assert.matches("expected 'bf16' or 'f32'", helpers.error_of(function() uly.matmul_precision('fp8') end), 1, true)
  end)

  it('gives the same numbers on the device as on the CPU, and trains GPT close to f32', function()
    use_device()
    local GPT = require 'models.gpt'
    local x = helpers.token_ids(2, 16, 256)
    local function losses(device, precision)
      uly.matmul_precision(precision)
      return three_step_losses(GPT, { preset = 'tiny' }, x, device)
    end
    local cpu16, dev16, cpu32 = losses('cpu', 'bf16'), losses('cuda', 'bf16'), losses('cpu', 'f32')
    -- the CUDA backend also runs the attention GEMMs in bf16 (the CPU kernel only on AMX), and AdamW
    -- at lr 1e-2 amplifies what differs: the first loss closely, the later ones like bf16 vs f32
    for s = 1, 3 do
      local tol16 = MODE == 'sim' and 10 * RTOL or (s == 1 and 5e-3 or 2e-2)
      assert.is_true(math.abs(cpu16[s] - dev16[s]) <= tol16 * cpu16[s], ('step %d: %g vs %g'):format(s, cpu16[s], dev16[s]))
      assert.is_true(math.abs(cpu16[s] - cpu32[s]) <= 2e-2 * cpu32[s], ('step %d: bf16 %g vs f32 %g'):format(s, cpu16[s], cpu32[s]))
    end
    assert.is_true(cpu16[3] ~= cpu32[3])
    release_device()
  end)
end)

-- attention in mixed precision runs kernels/cuda/attention_fused.cu (head dims 32, 64, 128):
-- tensor-core tiles of 64 queries x 64 (forward) or 32 (backward) keys, with every mask; the
-- reference is the CPU's f32 kernel on the same bf16-rounded q, k, v (what the fused kernels add
-- is P, dO and dS rounded to bf16: within 1 % of the largest value, where a wrong fragment or
-- tile gives O(1))

-- Whether the fused kernels' named variants (ULY_CUDA_ATTN_FWD/DQ/DKV/BWD) run kernels of their
-- own at head dim D: they all run on wgmma, and where it is off for D (the emulator's default
-- compute capability 8.0, unforced) each runs the default kernels again, so a spec looping over
-- variants needs only one of them there (the variant loops were a third of the sanitizer stage).
-- Always true on the simulation (no status); decided for D by its first fused forward (a small
-- one here, where nothing has decided yet).
local function variants_differ(D)
  use_device()
  local status = uly.cuda.wgmma_status(D)
  if status and status:match('^not decided') then
    local precision = uly.matmul_precision('bf16')
    local x = uly.randn(1, 64, 1, D):cuda()
    uly.no_grad(uly.flash_attention, x, x, x, { causal = true })
    uly.matmul_precision(precision)
    status = uly.cuda.wgmma_status(D)
  end
  return not (status and status:match('^off'))
end

-- the fused kernels' variants back to their defaults
local function clear_attention_variants()
  for _, name in ipairs({ 'ULY_CUDA_ATTN_FWD', 'ULY_CUDA_ATTN_DQ', 'ULY_CUDA_ATTN_DKV' }) do ffi.C.setenv(name, '', 1) end
end

-- The output and the gradients of sum(out * out) through the fused kernels: wg '1' forces wgmma,
-- '0' mma.sync, '' leaves each kernel to its head dim's self-check; fwd names a forward variant
-- (ULY_CUDA_ATTN_FWD; 'rows128' also sets the 128-row dQ and the 128-key dK/dV), dkv and dq
-- the backward kernels' (ULY_CUDA_ATTN_DKV, ULY_CUDA_ATTN_DQ, when not set by fwd).
-- the largest |element| of a tensor
local function max_abs(t)
  local vals, n = helpers.values(t)
  local big = 0
  for e = 0, n - 1 do big = math.max(big, math.abs(vals[e])) end
  return big
end

local function fused_outputs(wg, q, k, v, opts, fwd, dkv, dq)
  ffi.C.setenv('ULY_CUDA_ATTN_WGMMA', wg, 1)
  ffi.C.setenv('ULY_CUDA_ATTN_FWD', fwd or '', 1)
  ffi.C.setenv('ULY_CUDA_ATTN_DQ', fwd == 'rows128' and fwd or dq or '', 1)
  ffi.C.setenv('ULY_CUDA_ATTN_DKV', fwd == 'rows128' and fwd or dkv or '', 1)
  local qq, kk, vv = q:detach():requires_grad_(), k:detach():requires_grad_(), v:detach():requires_grad_()
  local o = uly.flash_attention(qq, kk, vv, opts)
  ;(o * o):sum():backward()
  uly.synchronize('cuda')
  local parts = { o:detach() }
  for _, x in ipairs({ qq, kk, vv }) do parts[#parts + 1] = x.grad end
  for i, x in ipairs(parts) do parts[i] = x:cpu():view(-1) end
  return uly.cat(parts, 1)
end

-- Hopper's wgmma in the fused kernels (kernels/cuda/mma.cuh; on the emulator its deferred model, B read
-- through the 128-byte-swizzled descriptor at the wait) and the forward variants built on it
-- (variants: { ULY_CUDA_ATTN_FWD value, label[, ULY_CUDA_ATTN_DKV value, ULY_CUDA_ATTN_DQ value] }):
-- the mma.sync kernels' bits on the emulator (the
-- same sums in the same order), for D = 64 and 128, grouped and not, masked and split. On a GPU:
-- within bf16 rounding wherever the self-check turned wgmma on for that head dim (what runs
-- unforced must be right); where it disagrees, the self-check must have said off (an H200 at
-- D = 64, 2026-12-04)
local function check_wgmma_variants(variants, more_cases)
  use_device()
  uly.matmul_precision('bf16')
  helpers.reseed(40)
  local cases = {
    { { 1, 130, 4, 64 }, { 1, 130, 2, 64 }, { causal = true } },
    { { 2, 70, 2, 128 }, { 2, 150, 1, 128 }, { window = { 60, 9 } } },
    { { 1, 3, 8, 64 }, { 1, 260, 2, 64 }, { causal = true } },      -- packed group, split keys
    { { 1, 64, 1, 128 }, { 1, 64, 1, 128 }, {} },
  }
  for _, c in ipairs(more_cases or {}) do cases[#cases + 1] = c end
  for i, c in ipairs(cases) do
    local q, k, v = uly.randn(unpack(c[1])):cuda(), uly.randn(unpack(c[2])):cuda(), uly.randn(unpack(c[2])):cuda()
    local a = fused_outputs('0', q, k, v, c[3])
    local got = { { 'wgmma', fused_outputs('1', q, k, v, c[3]) } }
    for _, var in ipairs(variants) do   -- var.tolerance: by head dim, where its tiles differ from mma.sync's
      got[#got + 1] = { var[2], fused_outputs('1', q, k, v, c[3], var[1], var[3], var[4]),
                        var.tolerance and var.tolerance[c[1][4]] }
    end
    local status, D = MODE == 'cuda' and uly.cuda.wgmma_status(c[1][4]), c[1][4]
    if MODE == 'cuda' then
      -- unforced, each kernel as its head dim's self-check decided: what users run is right
      local u = fused_outputs('', q, k, v, c[3])
      helpers.assert_close(u, a, 2e-3, 2e-3, 'unforced vs mma.sync, case ' .. i .. ' (D ' .. D .. ': ' .. status .. ')')
      if not status:match('^on') then
        assert.truthy(status:match('^off') or status:match('^partly on'), status)
        print(('\n(case %d, D %d: wgmma %s)'):format(i, D, status))
      end
    end
    for _, g in ipairs(got) do
      local checked = MODE ~= 'cuda' or status:match('^on')
      if g[3] and checked then   -- other tiles, other roundings: each part within g[3] of its largest value
        local sizes = { q:numel(), q:numel(), k:numel(), k:numel() }
        local at = 1
        for p, name in ipairs({ 'output', 'grad q', 'grad k', 'grad v' }) do
          local want, have = a:narrow(1, at, sizes[p]), g[2]:narrow(1, at, sizes[p])
          helpers.assert_close(have, want, g[3], g[3] * max_abs(want), ('%s vs mma.sync, %s, case %d (D %d)'):format(g[1], name, i, D))
          at = at + sizes[p]
        end
      elseif MODE ~= 'cuda' then   -- the same sums in the same order: the same bits
        helpers.assert_close(g[2], a, 0, 0, g[1] .. ' vs mma.sync, case ' .. i)
      elseif status:match('^on') then
        helpers.assert_close(g[2], a, 2e-3, 2e-3, g[1] .. ' vs mma.sync, case ' .. i .. ' (D ' .. D .. ': ' .. status .. ')')
      end
    end
  end
  clear_attention_variants()
  ffi.C.setenv('ULY_CUDA_ATTN_WGMMA', os.getenv('ULY_TEST_WGMMA') or '', 1)
  uly.matmul_precision('f32')
  release_device()
end

-- the fused kernels against the CPU's f32 kernel (used by the describes below)
local function rounded(t) return t:bf16():float() end
local function set_path(path) ffi.C.setenv('ULY_CUDA_ATTN', path, 1) end

-- fn(q, k, v) -> attention output; returns the output and the gradients of sum(out * w)
local function run(device, precision, fn, inputs, w)
  uly.matmul_precision(precision)
  local leaves = {}
  for i, x in ipairs(inputs) do
    leaves[i] = x:detach():to(device)
    if x:dtype() == 'f32' then leaves[i]:requires_grad_() end
  end
  local out = fn(unpack(leaves))
  ;(out * w:to(device)):sum():backward()
  uly.matmul_precision('f32')
  local got = { out:detach():cpu() }
  for i, x in ipairs(leaves) do if x:dtype() == 'f32' then got[i + 1] = x.grad:cpu() end end
  return got
end

-- opts.fused_only: only the fused path against the CPU (no one-pass, chunked or rerun), each
-- result through opts.part(name, tensor) when given (nil: not compared), within
-- opts.tolerance(name) (relative, and of the largest value) when given, else 1e-2
local function against_cpu(fn, inputs, opts)
  opts = opts or {}
  use_device()
  for i, x in ipairs(inputs) do if x:dtype() == 'f32' then inputs[i] = rounded(x) end end
  local w = uly.randn(unpack(fn(unpack(inputs)):shape()))
  local want = run('cpu', 'f32', fn, inputs, w)
  set_path('fused')
  local fused = run('cuda', 'bf16', fn, inputs, w)
  if opts.fused_only then
    local names = { 'output', 'grad q', 'grad k', 'grad v' }
    local part = opts.part or function(_, t) return t end
    for i = 1, #want do
      local name = names[i] or tostring(i)
      local got, expect = part(name, fused[i]), part(name, want[i])
      if expect then
        local tol = opts.tolerance and opts.tolerance(name) or 1e-2
        helpers.assert_close(got, expect, tol, tol * max_abs(expect), 'fused ' .. name)
      end
    end
    release_device()
    return
  end
  local again = run('cuda', 'bf16', fn, inputs, w)
  for i = 1, #fused do   -- no atomics: the same bits run to run
    local a, n = helpers.values(fused[i])
    local b = helpers.values(again[i])
    for e = 0, n - 1 do assert(a[e] == b[e] or (a[e] ~= a[e] and b[e] ~= b[e]), 'fused attention is not deterministic') end
  end
  -- the one-pass backward (D 32, 64): dQ from the dK/dV kernel's dS, added with atomics
  ffi.C.setenv('ULY_CUDA_ATTN_BWD', 'onepass', 1)
  local onepass = run('cuda', 'bf16', fn, inputs, w)
  ffi.C.setenv('ULY_CUDA_ATTN_BWD', '', 1)
  set_path('chunked')
  local chunked = run('cuda', 'bf16', fn, inputs, w)
  local names = { 'output', 'grad q', 'grad k', 'grad v' }
  for i = 1, #want do   -- absolute slack: 1 % of the largest value (dO in bf16 against an f32 delta)
    local big = max_abs(want[i])
    helpers.assert_close(fused[i], want[i], 1e-2, 1e-2 * big, 'fused ' .. (names[i] or i))
    helpers.assert_close(onepass[i], want[i], 1e-2, 1e-2 * big, 'one-pass ' .. (names[i] or i))
    helpers.assert_close(chunked[i], want[i], 1e-2, 1e-2 * big, 'chunked ' .. (names[i] or i))
  end
  if #inputs == 3 then   -- the output, dK and dV are the two-pass kernels' own numbers
    for _, i in ipairs({ 1, 3, 4 }) do
      helpers.assert_close(onepass[i], fused[i], 0, MODE == 'cuda' and 1e-6 or 0, 'one-pass vs two-pass ' .. names[i])
    end
  end
  if REAL then   -- two different kernels ran: the bits differ somewhere
    local a, n = helpers.values(fused[1])
    local b = helpers.values(chunked[1])
    local differ = false
    for e = 0, n - 1 do differ = differ or a[e] ~= b[e] end
    assert.is_true(differ, 'the fused and the chunked path gave the same bits')
  end
  release_device()
end

-- the backward's cases at D = 64 against the CPU: GQA, a window, block-sparse, documents (the
-- 64-wide tiles' spec, and the warp-specialised dK/dV's at the end of this file)
local function wide_backward_cases()
  helpers.reseed(38)
  local lay = uly.attention_layouts.from_function(5, 5, function(r, c) return c == 0 or c == r or (r + c) % 3 == 0 end)
  local docs = {}
  for t = 1, 130 do docs[t] = t <= 45 and 0 or (t <= 100 and 1 or 2) end
  local d = uly.tensor(docs, { dtype = 'i32' }):view(1, 130)
  against_cpu(function(q, k, v) return uly.flash_attention(q, k, v, { causal = true }) end,
    { uly.randn(2, 150, 4, 64), uly.randn(2, 150, 2, 64), uly.randn(2, 150, 2, 64) }, { fused_only = true })
  against_cpu(function(q, k, v) return uly.flash_attention(q, k, v, { window = { 70, 9 } }) end,
    { uly.randn(1, 97, 2, 64), uly.randn(1, 160, 1, 64), uly.randn(1, 160, 1, 64) }, { fused_only = true })
  against_cpu(function(q, k, v) return uly.flash_attention(q, k, v, { block_layout = lay, block_size = 32, causal = true }) end,
    { uly.randn(1, 150, 2, 64), uly.randn(1, 150, 2, 64), uly.randn(1, 150, 2, 64) }, { fused_only = true })
  against_cpu(function(q, k, v, a, b) return uly.flash_attention(q, k, v, { causal = true, q_doc = a, k_doc = b }) end,
    { uly.randn(1, 130, 2, 64), uly.randn(1, 130, 1, 64), uly.randn(1, 130, 1, 64), d, d }, { fused_only = true })
end

describe('fused tensor-core attention (mixed precision)', function()
  after_each(function() set_path('fused'); ffi.C.setenv('ULY_CUDA_ATTN_BWD', '', 1); uly.matmul_precision('f32') end)

  it('causal, GQA, sequences that end inside a tile (D = 64)', function()
    helpers.reseed(31)
    against_cpu(function(q, k, v) return uly.flash_attention(q, k, v, { causal = true }) end,
      { uly.randn(2, 100, 4, 64), uly.randn(2, 100, 2, 64), uly.randn(2, 100, 2, 64) })
  end)

  it('two-sided window, fewer queries than keys, strided q/k/v from one fused buffer (D = 32)', function()
    helpers.reseed(32)
    against_cpu(function(f)
      local q = f:narrow(3, 1, 4):narrow(2, 61, 70)       -- the last 70 of 130 positions
      local k, v = f:narrow(3, 5, 2), f:narrow(3, 7, 2)
      return uly.flash_attention(q, k, v, { window = { 40, 7 } })
    end, { uly.randn(1, 130, 4 + 2 * 2, 32) })
  end)

  it('block-sparse layouts: blocks smaller than, equal to and larger than a tile (D = 32)', function()
    helpers.reseed(33)
    local T = 150
    against_cpu(function(q, k, v)
      local out
      for _, bs in ipairs({ 4, 16, 64, 100 }) do
        local n = math.ceil(T / bs)
        local lay = uly.attention_layouts.from_function(n, n, function(r, c) return c == 0 or c == r or (r + c) % 3 == 0 end)
        local o = uly.flash_attention(q, k, v, { block_layout = lay, block_size = bs, causal = bs ~= 64 })
        out = out and out + o or o
      end
      return out
    end, { uly.randn(1, T, 2, 32), uly.randn(1, T, 2, 32), uly.randn(1, T, 2, 32) })
  end)

  it('one query against a long cache, GQA 4:1, large logits (D = 64)', function()
    helpers.reseed(35)
    -- decoding: Tq = 1 sits at the end of 200 keys (causal sees them all); q scaled by 16 (exact
    -- in bf16) makes the online softmax rescale by large factors from tile to tile
    against_cpu(function(q, k, v) return uly.flash_attention(q * 16, k, v, { causal = true }) end,
      { uly.randn(2, 1, 8, 64), uly.randn(2, 200, 2, 64), uly.randn(2, 200, 2, 64) })
  end)

  -- a few queries against a long cache split the key band over blocks, whose partial rows a
  -- second kernel merges (flash-decoding); ULY_CUDA_ATTN_SPLITS forces the number of splits,
  -- including splits whose keys some rows (window, documents) do not see at all
  it('splits a long key band over blocks for a few queries, every split count and mask (D = 64)', function()
    helpers.reseed(36)
    local kd = uly.tensor({}, { dtype = 'i32' })
    local docs = {}
    for j = 1, 300 do docs[j] = j <= 120 and 0 or (j <= 250 and 1 or 2) end
    kd = uly.tensor(docs, { dtype = 'i32' }):view(1, 300)
    local qd = uly.tensor({ 1, 1, 2, 2, 5 }, { dtype = 'i32' }):view(1, 5)   -- document 5: no keys
    for _, splits in ipairs({ '1', '3', '7' }) do
      ffi.C.setenv('ULY_CUDA_ATTN_SPLITS', splits, 1)
      local ok, err = pcall(against_cpu, function(q, k, v, a, b)
        local full = uly.flash_attention(q, k, v, { causal = true })
        local windowed = uly.flash_attention(q * 8, k, v, { causal = true, window = 90 })
        return full + windowed + uly.flash_attention(q, k, v, { causal = true, q_doc = a, k_doc = b })
      end, { uly.randn(1, 5, 4, 64), uly.randn(1, 300, 2, 64), uly.randn(1, 300, 2, 64), qd, kd })
      ffi.C.setenv('ULY_CUDA_ATTN_SPLITS', '0', 1)
      assert(ok, err)
    end
  end)

  -- The forward's row sum adds P as rounded to bf16, the weights P V multiplies, so O stays a
  -- weighted mean of V's rows. A row whose weight sits on one key: key 0 scores 0 (the first
  -- tile's max, P = 1), key 100 scores 3, less than the slack that moves the max, so P = e^3 =
  -- 20.0855, 20.125 in bf16; the other keys score -30. Summing the unrounded P put O off by
  -- (20.125 - 20.0855) / 21.0855, 1.9e-3 of V; the consistent sum by the weights' shift alone,
  -- under 1e-4 of |V[100] - V[0]|.
  it('normalises a row by the bf16 weights its P V multiplies (one key dominating, D = 64)', function()
    helpers.reseed(37)
    local D, Tk = 64, 128
    local qv, kv = {}, {}
    for d = 1, D do qv[d] = d == 1 and 8 or 0 end   -- scale 1/8: key j scores k_j[0]
    for j = 0, Tk - 1 do
      for d = 1, D do kv[j * D + d] = d > 1 and 0 or (j == 0 and 0 or (j == 100 and 3 or -30)) end
    end
    local q, k = helpers.from_flat(qv, { 1, 1, 1, D }), helpers.from_flat(kv, { 1, Tk, 1, D })
    local v = rounded(uly.randn(1, Tk, 1, D))
    local fn = function(a, b, c) return uly.flash_attention(a, b, c) end
    local w = uly.ones(1, 1, 1, D)
    use_device()
    local want = run('cpu', 'f32', fn, { q, k, v }, w)[1]
    set_path('fused')
    local got = run('cuda', 'bf16', fn, { q, k, v }, w)[1]
    set_path('')
    release_device()
    helpers.assert_close(got, want, 0, 3e-4 * max_abs(v), 'fused output of the dominated row')
  end)

  -- every query of a GQA group in one tile (Tq x group <= 64: here exactly 64 rows, with a window
  -- and documents): K and V read once per group, the same bits as a tile per query head
  it('packs a GQA group\'s query heads into one tile for short queries, the same bits as unpacked (D = 32)', function()
    helpers.reseed(39)
    local qd = uly.tensor({ { 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3 } }, { dtype = 'i32' })
    local kd = {}
    for j = 1, 150 do kd[j] = j <= 40 and 0 or (j <= 90 and 1 or (j <= 140 and 2 or 3)) end
    kd = uly.tensor({ kd }, { dtype = 'i32' })
    local function fn(q, k, v, a, b)
      return uly.flash_attention(q, k, v, { causal = true, window = 70 })
        + uly.flash_attention(q, k, v, { causal = true, q_doc = a, k_doc = b })
    end
    local inputs = { uly.randn(1, 16, 8, 32), uly.randn(1, 150, 2, 32), uly.randn(1, 150, 2, 32), qd, kd }
    against_cpu(fn, inputs)   -- packed (the default at these shapes), against the CPU
    if not REAL then return end
    use_device()
    local w = uly.randn(1, 16, 8, 32)
    uly.matmul_precision('bf16')
    local packed = run('cuda', 'bf16', fn, inputs, w)
    ffi.C.setenv('ULY_CUDA_ATTN_GROUPED', '0', 1)
    local unpacked = run('cuda', 'bf16', fn, inputs, w)
    ffi.C.setenv('ULY_CUDA_ATTN_GROUPED', '1', 1)
    helpers.assert_close(packed[1], unpacked[1], 0, 0, 'output, packed vs a tile per head')
    release_device()
  end)

  -- decoding from a bf16 KV cache: the kernels round K and V to bf16 anyway, so a bf16 cache gives
  -- the f32 cache's bits, and it is read in place (only q is copied)
  it('reads a bf16 KV cache in place with the f32 cache\'s numbers, and generate uses one', function()
    use_device()
    helpers.reseed(37)
    local q, k, v = uly.randn(1, 1, 8, 64), rounded(uly.randn(1, 200, 2, 64)), rounded(uly.randn(1, 200, 2, 64))
    uly.matmul_precision('bf16')
    ffi.C.setenv('ULY_CUDA_ATTN_SPLITS', '1', 1)
    local function decode(kk, vv)
      if REAL then assert(uly.cuda.temporaries_peak(true)) end
      local o = uly.no_grad(uly.flash_attention, q:cuda(), kk:cuda(), vv:cuda(), { causal = true })
      uly.synchronize('cuda')
      return o:cpu(), REAL and uly.cuda.temporaries_peak() or 0
    end
    local o32, t32 = decode(k, v)
    local o16, t16 = decode(k:bf16(), v:bf16())
    ffi.C.setenv('ULY_CUDA_ATTN_SPLITS', '0', 1)
    helpers.assert_close(o16, o32, 0, 0, 'bf16 cache vs f32 cache')
    if MODE == 'emu' then   -- the operand copies: q, k and v; from a bf16 cache q alone
      assert.equal((8 * 64 + 2 * 200 * 2 * 64) * 2, t32)
      assert.equal(8 * 64 * 2, t16)
    end
    -- generate: bf16 caches by default in bf16 precision on the device, the same tokens
    local Llama = require 'models.llama'
    helpers.reseed(38)
    local m = Llama({ preset = 'tiny', attention = 'flash', heads = 4, kv_heads = 2, dim = 64, hidden = 64 }):to('cuda')
    local prompt = helpers.token_ids(1, 6, 256)
    local a = m:generate(prompt, { max_new_tokens = 8, temperature = 0 })
    local b = m:generate(prompt, { max_new_tokens = 8, temperature = 0, cache_dtype = 'f32' })
    uly.matmul_precision('f32')
    if REAL then assert.are.same(b, a) end   -- the simulation's CPU kernel reads f32 values: they may differ
    assert.equal(8, #a)
    m = nil
    release_device()
  end)

  -- wgmma and its variants against mma.sync (check_wgmma_variants, above); the TMA kernels are
  -- checked last in this file (a fault there leaves a GPU's context unusable for what follows)
  it('the wgmma forward, dQ and dK/dV give the mma.sync kernels\' numbers (D = 64, 128; packed, split, masked)', function()
    if not REAL then return end   -- the simulation has no fused kernels
    -- the pipelined forward: the next tile's S issued before this tile's softmax (K double-buffered);
    -- the 128-row forward: two warpgroups sharing K and V (the packed and split case keeps the 64-row one),
    -- with the 128-row dQ and the 128-key dK/dV
    check_wgmma_variants({ { 'pipelined', 'pipelined wgmma' }, { 'rows128', '128-row wgmma forward and backward' } })
  end)

  -- a variant variable with a value no kernel knows, or a variant that cannot run here, runs the
  -- default kernels and says so, once a variable and value (bench/gpu.lua labels its rows by
  -- these: a typo must not time the default under a variant's name)
  it('names an unknown or unrunnable attention variant on stderr once, and runs the default kernels', function()
    if not REAL then return end   -- the simulation has no fused kernels
    local code = "local uly = require 'ulysses'; assert(uly.cuda.ensure()); uly.matmul_precision('bf16'); "
      .. "uly.manual_seed(3); local q = uly.randn(1, 70, 2, 64):cuda(); local s = 0; "
      .. "for i = 1, 3 do local x = q:detach():requires_grad_(); local o = uly.flash_attention(x, x, x, { causal = true }); "
      .. "(o * o):sum():backward(); s = s + x.grad:sum():item() end; print(('sum %.6g'):format(s))"
    local function run(env)
      local p = assert(io.popen(table.concat({ 'env', env, 'ULY_CUDA_LIB=' .. helpers.shq(os.getenv('ULY_CUDA_LIB') or ''),
        "LUA_PATH='lua/?.lua;lua/?/init.lua;;'", 'luajit -e', helpers.shq(code), '2>&1' }, ' ')))
      local out = p:read('*a')
      p:close()
      return out
    end
    local plain = run('-u ULY_CUDA_ATTN_DKV -u ULY_CUDA_ATTN_FWD -u ULY_CUDA_ATTN')
    local odd = run('ULY_CUDA_ATTN_DKV=wss ULY_CUDA_ATTN_FWD=fast ULY_CUDA_ATTN=chunkd')
    local _, n = odd:gsub('ulysses: ULY_CUDA_ATTN_DKV=wss: unknown %(known: 64, rows128, ws%); running the default kernels', '')
    assert.equal(1, n, odd)
    _, n = odd:gsub('ulysses: ULY_CUDA_ATTN_FWD=fast: unknown %(known: pipelined, rows128, tma, ws, wspp, wsov, wsppov%)', '')
    assert.equal(1, n, odd)
    _, n = odd:gsub('ulysses: ULY_CUDA_ATTN=chunkd: unknown %(known: fused, chunked%)', '')
    assert.equal(1, n, odd)
    -- a known variant where the wgmma kernels are off runs the default too, and says so
    local off = run('ULY_CUDA_ATTN_WGMMA=0 ULY_CUDA_ATTN_DKV=ws')
    _, n = off:gsub('ulysses: ULY_CUDA_ATTN_DKV=ws: needs the wgmma kernels, off here %(uly.cuda.wgmma_status says why%)', '')
    assert.equal(1, n, off)
    assert.truthy(plain:match('sum [-%d.e+]+'), plain)
    assert.equal(plain:match('sum [-%d.e+]+'), odd:match('sum [-%d.e+]+'))   -- the default kernels' numbers
    assert.falsy(plain:find('ulysses:', 1, true), plain)
  end)

  -- without ULY_CUDA_ATTN_WGMMA the forward decides at its first call: off below compute
  -- capability 9.0; at 9.0 after its self-check (both kernels on a small problem) passes
  it('decides on wgmma at the first forward of each head dim: a self-check on compute capability 9.0', function()
    if MODE ~= 'emu' then return end
    local function status(cc, env)
      local cmd = table.concat({ 'env -u ULY_CUDA_ATTN_WGMMA ULY_EMU_CC=' .. cc, env or '',
        'ULY_CUDA_LIB=' .. helpers.shq(os.getenv('ULY_CUDA_LIB')), "LUA_PATH='lua/?.lua;lua/?/init.lua;;'",
        'luajit -e', helpers.shq("local uly = require 'ulysses'; assert(uly.cuda.ensure()); uly.matmul_precision('bf16'); "
          .. "local q = uly.randn(1, 70, 2, 64):cuda(); "
          .. "local before = uly.cuda.wgmma_status(64); "
          .. "local r = uly.randn(1, 70, 2, 128):cuda(); uly.no_grad(uly.flash_attention, r, r, r, { causal = true }); "
          .. "print('128 first, D 64: ' .. before .. ', then ' .. uly.cuda.wgmma_status(64)); "
          .. "uly.no_grad(uly.flash_attention, q, q, q, { causal = true }); print('status: ' .. uly.cuda.wgmma_status(64)); "
          .. "print('both: ' .. uly.cuda.wgmma_status()); "
          -- forward and backward as decided (some kernels on wgmma, some not) against all on mma.sync
          .. "local function grads(wg) local ffi = require 'ffi'; ffi.cdef 'int setenv(const char *, const char *, int);'; "
          .. "  if wg then ffi.C.setenv('ULY_CUDA_ATTN_WGMMA', wg, 1) end; "
          .. "  local x = q:detach():requires_grad_(); local o = uly.flash_attention(x, x, x, { causal = true }); "
          .. "  (o * o):sum():backward(); return uly.cat({ o:detach():cpu():view(-1), x.grad:cpu():view(-1) }, 1) end; "
          .. "local d = grads(nil); local m = grads('0'); "
          .. "print('same as mma.sync: ' .. tostring(((d - m) * (d - m)):max():item() == 0))"),
        '2>&1' }, ' ')
      local p = assert(io.popen(cmd))
      local out = p:read('*a')
      p:close()
      return out
    end
    assert.matches('status: off: compute capability 8.0 %(wgmma needs 9.0%)', status('8.0'))
    local on = status('9.0')
    assert.matches('status: on %(self%-check: forward within 0, dQ within 0, dK/dV within 0 of mma.sync%)', on)
    -- each head dim decides apart: a D = 128 forward leaves D = 64 undecided (the H200's D = 64
    -- kernels fail the self-check that D = 128's pass)
    assert.matches('128 first, D 64: not decided yet %(decided at the first fused attention with D = 64%), then not decided yet', on)
    assert.matches('both: D 64: on %(self%-check[^;]*; D 128: on %(self%-check', on)
    -- a kernel that fails its self-check stays on mma.sync without taking the others along (the
    -- emulator's kernels all agree: ULY_EMU_WGMMA_FAULT makes the forward disagree), and the
    -- results stay right
    local partly = status('9.0', 'ULY_EMU_WGMMA_FAULT=forward')
    assert.matches('status: partly on: forward off %(the self%-check\'s differs from mma.sync by 1, largest value [%d.e+-]+%); '
                   .. 'dQ on %(within 0%); dK/dV on %(within 0%)', partly)
    assert.matches('status: off: forward off .*; dQ off .*; dK/dV off', status('9.0', 'ULY_EMU_WGMMA_FAULT=forward,dq,dkv'))
    assert.matches('status: partly on: forward on %(within 0%); dQ off .*; dK/dV on', status('9.0', 'ULY_EMU_WGMMA_FAULT=dq'))
    assert.matches('same as mma.sync: true', partly)
    assert.matches('same as mma.sync: true', on)
  end)

  it('documents, a sliding window and rows that see nothing (D = 128)', function()
    helpers.reseed(34)
    -- query document 9 appears among no keys: those rows give 0 and pass no gradient
    local qd = uly.tensor({ 0, 0, 0, 1, 1, 9, 2, 2, 2, 2, 2, 2, 9, 3, 3, 3, 3, 3, 3, 3 }, { dtype = 'i32' }):view(1, 20)
    local kd = uly.tensor({ 0, 0, 0, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3 }, { dtype = 'i32' }):view(1, 20)
    qd = uly.cat({ qd, uly.full({ 1, 60 }, 4, { dtype = 'i32' }) }, 2)
    kd = uly.cat({ kd, uly.full({ 1, 60 }, 4, { dtype = 'i32' }) }, 2)
    against_cpu(function(q, k, v, a, b)
      return uly.flash_attention(q, k, v, { causal = true, window = 50, q_doc = a, k_doc = b })
    end, { uly.randn(1, 80, 2, 128), uly.randn(1, 80, 1, 128), uly.randn(1, 80, 1, 128), qd, kd })
  end)

  -- Which tiles a block walks and which it takes as wholly visible (no per-element mask) is
  -- worked out from the band's ends; a tile taken as whole one key too early lets one key through.
  -- With random scores one extra key among a hundred moves a row by less than the tolerance, so
  -- here the scores rise (or fall) steeply along the keys: component 0 of every query is 8, of key
  -- j it is j (or -j), 1.4 apart after the scale, so each row's output is nearly the value of its
  -- last (first) visible key, and a key let through past the band's end replaces it: in O (the
  -- forward's key walk), dV (dK/dV's query walk) and dQ (dQ's key walk). dQ and dK are sums of
  -- dS = P (dP - delta), which nearly cancel when P is nearly one-hot, of bf16-rounded terms: dQ
  -- is compared within 5 % (a key let through moves it by far more) and without its component 0
  -- (keys' j times dS, sum(dS) = 0), dK not at all (the specs above check both). The offsets
  -- Tk - Tq (62, 30, 31, 1, 0) and windows put the band's ends at many places within a 64- and a
  -- 32-key tile, for the forward's and dQ's key walk and dK/dV's query walk (and at a 64-row
  -- warpgroup's first and last row against a tile's last and first key, for the 128-row forward).
  it('mask edges at many alignments: scores rising and falling along the keys (D = 32, 64, 128)', function()
    helpers.reseed(37)
    local ran_default = {}   -- per D: whether its default kernels ran (see variants_differ)
    local function variants_run(D, run)
      local named = run[2] ~= '' or run[3] ~= '' or run[4] ~= '' or (run[5] or '') ~= ''
      if named and variants_differ(D) then return true end
      if ran_default[D] then return false end
      ran_default[D] = true
      return true
    end
    local function steep(T, H, D, first)   -- [1, T, H, D]: component 0 first(t), the rest small noise
      local pos, keep, n = {}, {}, 0
      for t = 0, T - 1 do
        for _ = 1, H do
          for d = 0, D - 1 do
            n = n + 1
            pos[n], keep[n] = d == 0 and first(t) or 0, d == 0 and 0 or 1
          end
        end
      end
      local shape = { 1, T, H, D }
      return uly.randn(unpack(shape)) * 0.1 * uly.tensor(keep):view(unpack(shape)) + uly.tensor(pos):view(unpack(shape))
    end
    local cases = {
      { 70, 132, { causal = true } },
      { 97, 127, { causal = true } },
      { 180, 211, { causal = true, window = 131 } },
      { 250, 250, { window = { 140, 3 } } },
      { 200, 200, { causal = true, window = 126 } },
      { 150, 150, { causal = true }, docs = 70 },   -- documents [0, 70) and [70, 150)
      { 100, 101, { causal = true } },               -- row 63's band ends at key 64, a tile's first
      { 140, 140, { window = { 1, 0 } } },           -- row 64's starts at key 63, a tile's last
    }
    -- D, then ULY_CUDA_ATTN_DKV, _DQ, _FWD: the backward's 64-query dK/dV and 64-key dQ tiles, and
    -- rows128: the forward's and dQ's 128-row blocks and dK/dV's 128-key ones (wgmma only; the
    -- band's ends now also fall between the two warpgroups' rows, or keys); tma / ws: the forward's
    -- tiles by TMA (the last tile's rows past the end zeros from the tensor map's bounds), and
    -- warp-specialised (a consumer skipping a tile still gives its stage back), with the
    -- warp-specialised dK/dV (DKV ws: 64-query tiles) and dQ (DQ ws: 128
    -- rows, 64-key tiles); on the emulator
    -- only (on a GPU they are checked at the end of this file, where a fault harms nothing after)
    for _, run in ipairs({ { 32, '', '', '' }, { 64, '', '', '' }, { 64, '64', '64', '' },
                           { 64, 'rows128', 'rows128', 'rows128' }, { 128, '', 'rows128', 'rows128' },
                           { 128, 'rows128', '', '' }, MODE == 'emu' and { 64, '', '', 'tma' } or nil,
                           MODE == 'emu' and { 64, 'ws', 'ws', 'ws' } or nil, MODE == 'emu' and { 128, 'ws', 'ws', 'wspp' } or nil,
                           MODE == 'emu' and { 64, 'ws', '', '', 'onepass' } or nil,
                           MODE == 'emu' and { 64, '', '', 'wsov' } or nil, MODE == 'emu' and { 128, '', '', 'wsppov' } or nil,
                           MODE == 'emu' and { 128, 'ws', '', '', 'onepass' } or nil }) do
      local D = run[1]
      if not variants_run(D, run) then goto next_run end
      ffi.C.setenv('ULY_CUDA_ATTN_BWD', run[5] or '', 1)
      ffi.C.setenv('ULY_CUDA_ATTN_DKV', run[2], 1)
      ffi.C.setenv('ULY_CUDA_ATTN_DQ', run[3], 1)
      ffi.C.setenv('ULY_CUDA_ATTN_FWD', run[4], 1)
      for _, c in ipairs(cases) do
        for _, dir in ipairs({ 1, -1 }) do
          local Tq, Tk, opts = c[1], c[2], c[3]
          local q = steep(Tq, 2, D, function() return 8 end)
          local k = steep(Tk, 1, D, function(j) return dir * j end)
          local inputs = { q, k, uly.randn(1, Tk, 1, D) }
          if c.docs then
            local ids = {}
            for t = 1, Tk do ids[t] = t <= c.docs and 0 or 1 end
            inputs[4] = uly.tensor(ids, { dtype = 'i32' }):view(1, Tk)
            inputs[5] = inputs[4]
          end
          local ok, err = pcall(against_cpu, function(a, b, v, qd, kd)
              local o = { q_doc = qd, k_doc = kd }
              for key, val in pairs(opts) do o[key] = val end
              return uly.flash_attention(a, b, v, o)
            end, inputs,
            { fused_only = true,
              part = function(name, t)
                if name == 'grad q' then return t:narrow(4, 2, D - 1) end
                if name ~= 'grad k' then return t end
              end,
              tolerance = function(name) return name == 'grad q' and 0.05 or 1e-2 end })
          if not ok then
            clear_attention_variants()
            ffi.C.setenv('ULY_CUDA_ATTN_BWD', '', 1)
          end
          assert(ok, ('D %d (ULY_CUDA_ATTN_DKV=%s DQ=%s FWD=%s BWD=%s), Tq %d, Tk %d, %s keys: %s'):format(D, run[2], run[3],
                 run[4], run[5] or '', Tq, Tk, dir > 0 and 'rising' or 'falling', tostring(err)))
        end
      end
      ::next_run::
    end
    clear_attention_variants()
    ffi.C.setenv('ULY_CUDA_ATTN_BWD', '', 1)
  end)

  -- ULY_CUDA_ATTN_DKV=64 / ULY_CUDA_ATTN_DQ=64: the backward kernels' wgmma variants with 64-query
  -- dK/dV tiles and 64-key dQ tiles (D = 64): their own walks (tile classification at 64),
  -- buffers, stats and 64 x 64 products; each alone and both; dQ's 128-row blocks
  -- (ULY_CUDA_ATTN_DQ=rows128: two warpgroups sharing K and V) and dK/dV's 128-key ones
  -- (ULY_CUDA_ATTN_DKV=rows128: two warpgroups sharing Q and dO)
  it('the backward with 64-wide tiles gives the CPU\'s gradients (D = 64: GQA, masks, documents)', function()
    if not REAL then return end   -- the simulation has no fused kernels
    local envs = { { '64', '' }, { '', '64' }, { '64', '64' }, { '64', 'rows128' }, { 'rows128', '' } }
    if not variants_differ(64) then envs = { { '', '' } } end   -- each would run the defaults: once
    for _, env in ipairs(envs) do
      ffi.C.setenv('ULY_CUDA_ATTN_DKV', env[1], 1)
      ffi.C.setenv('ULY_CUDA_ATTN_DQ', env[2], 1)
      local ok, err = pcall(wide_backward_cases)
      clear_attention_variants()
      assert(ok, ('ULY_CUDA_ATTN_DKV=%s ULY_CUDA_ATTN_DQ=%s: %s'):format(env[1], env[2], tostring(err)))
    end
  end)
end)

-- the memory planner's GPU mode (tools/plan.lua --device cuda) against the CUDA kernels: the
-- device pool's peak of one step, and the high-water mark of the kernels' stream-ordered
-- temporaries (bf16 operand copies, attention score chunks) that it reports as untracked.
-- #release_only: numbers, checked once (scripts/test.sh leaves it out of the sanitizer pass, where
-- the six whole training steps took a minute for kernels the other device specs run there)
describe('memory planner on the CUDA kernels #release_only', function()
  it('predicts the pool peak within 10 % and the kernels\' temporaries', function()
    if not REAL then return end   -- the simulation runs the CPU kernels: spec/plan_spec.lua covers it
    use_device()
    local pm, plan = require 'plan_measure', require 'tools.plan'
    local limit = uly.memory('cuda').limit
    uly.memory_limit(2 ^ 30, 'cuda')
    local base = { model = 'llama', preset = 'small', dim = 128, heads = 4, kv_heads = 4, hidden = 256, layers = 2,
                   seq = 256, attention = 'flash', device = 'cuda', kernels = 'cuda' }
    for _, extra in ipairs { { precision = 'bf16' }, { precision = 'f32' },
                             { precision = 'bf16', checkpoint = true, tile = 64 },
                             { precision = 'bf16', checkpoint = 'except_attention', tile = 64 },
                             { precision = 'bf16', checkpoint = 'except_attention', tile = 64, activations = 'bf16' },
                             { precision = 'f32', activations = 'bf16' } } do
      local pc = {}
      for k, v in pairs(base) do pc[k] = v end
      for k, v in pairs(extra) do pc[k] = v end
      local what = ('%s%s%s'):format(pc.precision, pc.checkpoint and (', checkpoint ' .. tostring(pc.checkpoint) .. ' + tile') or '',
                                     pc.activations and ', bf16 activations' or '')
      helpers.reseed(44)
      local peak, est, temporaries = pm.measure(pc)
      local ratio = est.total / peak
      assert(ratio > 0.9 and ratio < 1.1, ('%s: pool: planner %s vs measured %s'):format(what,
             plan.format_bytes(est.total), plan.format_bytes(peak)))
      -- the emulator allocates exactly what is asked; a GPU's pool may round each block up
      local slack = MODE == 'emu' and 0 or math.max(0.1 * est.untracked, 4 * 2 ^ 20)
      assert(temporaries >= est.untracked - slack and temporaries <= est.untracked + slack,
             ('%s: temporaries: planner %d vs measured %d bytes'):format(what, est.untracked, temporaries))
    end
    uly.memory_limit(limit, 'cuda')
    release_device()
  end)

  it('knows what each attention path takes outside the pool (fused, chunked bf16, chunked f32)', function()
    if not REAL then return end
    use_device()
    local plan = require 'tools.plan'
    for _, case in ipairs { { 'bf16', 32, 'fused' }, { 'bf16', 16, 'chunked' }, { 'f32', 32, 'chunked' } } do
      local precision, D, path = case[1], case[2], case[3]
      local a = { B = 2, Tq = 90, Tk = 90, H = 4, Hkv = 2, D = D }
      local q = uly.randn(a.B, a.Tq, a.H, D, { device = 'cuda' }):requires_grad_()
      local k = uly.randn(a.B, a.Tk, a.Hkv, D, { device = 'cuda' }):requires_grad_()
      local v = uly.randn(a.B, a.Tk, a.Hkv, D, { device = 'cuda' }):requires_grad_()
      uly.matmul_precision(precision)
      uly.synchronize('cuda')
      assert(uly.cuda.temporaries_peak(true))
      uly.flash_attention(q, k, v, { causal = true }):sum():backward()
      local measured = assert(uly.cuda.temporaries_peak())
      uly.matmul_precision('f32')
      local want = math.max(plan.cuda_flash_temporaries(a, precision, false), plan.cuda_flash_temporaries(a, precision, true))
      local slack = MODE == 'emu' and 0 or 4 * 2 ^ 20
      assert(math.abs(measured - want) <= slack, ('%s %s: planner %d vs measured %d bytes'):format(precision, path, want, measured))
    end
    release_device()
  end)
end)

describe('scripts/gpu-profile.lua and uly.cuda.profiler', function()
  it('runs each workload (small) inside a profiler range, and refuses unknown ones', function()
    if not REAL then return end   -- the simulation has no CUDA library to open a range in
    local env = 'ULY_CUDA_LIB=' .. helpers.shq(os.getenv('ULY_CUDA_LIB') or '')
    for _, w in ipairs({ 'attention 64', 'attention 128', 'gemm f32', 'gemm bf16' }) do
      local p = assert(io.popen(env .. ' luajit scripts/gpu-profile.lua ' .. w .. ' --small 2>&1; echo "exit=$?"'))
      local out = p:read('*a')
      p:close()
      assert.truthy(out:match('exit=0%s*$'), out)
      assert.truthy(out:find('the second profiled', 1, true), out)
    end
    local p = assert(io.popen(env .. ' luajit scripts/gpu-profile.lua attention 96 2>&1; echo "exit=$?"'))
    local out = p:read('*a')
    p:close()
    assert.truthy(out:find('attention takes head dim 64 or 128, got 96', 1, true), out)
    assert.truthy(out:match('exit=2%s*$'), out)
    use_device()
    uly.cuda.profiler(true)
    uly.cuda.profiler(false)
    assert.matches('uly.cuda.profiler: expected true or false, got string', helpers.error_of(uly.cuda.profiler, 'on'))
  end)
end)

describe('uly.cuda.profile', function()
  it('times each kernel and GEMM by name, longest first, and refuses misuse', function()
    if not REAL then
      -- the simulation has no CUDA backend to time
      assert.matches('the CUDA backend is not running', helpers.error_of(uly.cuda.profile, function() end))
      return
    end
    use_device()
    uly.matmul_precision('bf16')
    local a, b = uly.randn(64, 48):cuda(), uly.randn(48, 32):cuda()
    local q, k, v = uly.randn(1, 70, 2, 64):cuda(), uly.randn(1, 70, 2, 64):cuda(), uly.randn(1, 70, 2, 64):cuda()
    local report, got = uly.cuda.profile(function(x)
      local c = uly.matmul(x, b)
      c = uly.matmul(x, b) + c
      uly.flash_attention(q, k, v, { causal = true })
      return c
    end, a)
    uly.matmul_precision('f32')
    assert.same({ 64, 32 }, got:shape())   -- fn's results come back after the report
    local by = {}
    for i, kern in ipairs(report.kernels) do
      by[kern.name] = kern
      assert(kern.ms >= 0 and kern.calls >= 1, kern.name)
      if i > 1 then assert(kern.ms <= report.kernels[i - 1].ms, 'not longest first') end
    end
    assert.equal(2, by['matmul bf16 64 x 32 x 48'].calls, 'two matmuls of one shape: one line, two calls')
    assert.truthy(by['attention forward D 64 wgmma'] or by['attention forward D 64'], 'the fused forward is named')
    local names = {}
    for _, kern in ipairs(report.kernels) do names[#names + 1] = kern.name end
    local sum = 0
    for _, kern in ipairs(report.kernels) do sum = sum + kern.ms end
    assert.near(sum, report.kernel_ms, 1e-9)
    assert(report.wall_ms >= 0)
    local text = uly.cuda.format_profile(report, 2)
    assert.truthy(text:find('matmul bf16 64 x 32 x 48', 1, true) or text:find('more kernels', 1, true), text)
    assert.truthy(text:find('wall time on the stream', 1, true), text)
    -- off again: nothing is recorded outside a profile, and the next one starts empty
    uly.matmul(a, b)
    local again = uly.cuda.profile(function() end)
    assert.equal(0, #again.kernels, table.concat(names, ', '))
    -- an error inside stops the profile (the next starts) and comes out unchanged
    assert.matches('boom', helpers.error_of(uly.cuda.profile, function() error('boom') end))
    assert.matches('profiles do not nest', helpers.error_of(uly.cuda.profile, function()
      uly.cuda.profile(function() end)
    end))
    assert.matches('expected a function', helpers.error_of(uly.cuda.profile, 'x'))
    assert.matches('expected a report', helpers.error_of(uly.cuda.format_profile, 3))
    release_device()
  end)
end)

-- #release_only: scripts/test.sh leaves it out of the sanitizer pass (a whole benchmark process on
-- the emulated kernels under AddressSanitizer: minutes, for paths the other device specs run there)
describe('bench/gpu.lua #release_only', function()
  it('runs its whole code path on the simulation or the emulator (--quick), printing every table', function()
    if MODE == 'cuda' then return end   -- scripts/gpu-check.sh runs the real benchmark
    local env = MODE == 'emu' and ('ULY_CUDA_LIB=' .. helpers.shq(os.getenv('ULY_CUDA_LIB') or '')) or 'ULY_CUDA_SIMULATE=1'
    local p = assert(io.popen(env .. ' bin/ulysses bench/gpu.lua --quick 2>&1; echo "exit=$?"'))
    local out = p:read('*a')
    p:close()
    assert.truthy(out:match('exit=0%s*$'), out)
    local wants = { '== GEMM', '64 x 48 x 32             f32', '64 x 48 x 32             bf16    ',
                    '64 x 48 x 32             bf16 in', '== the step\'s glue on [64, 32]',
                    'clone, f32 (cudaMemcpyAsync)', 'f32 -> bf16', '[T, H, D] -> [H, T, D] contiguous', 'RoPE, f32 [1, T, H, D]',
                    '== flash attention',
                    '== decoding', '200      auto', '== training step: Llama tiny', 'checkpoint (except attention)', 'tokens/s',
                    'one step: forward ', 'ULY_CUDA_ATTN_DQ=rows128 ULY_CUDA_ATTN_DKV=64: ',
                    "N 128: fastest fused forward + backward '", "x the default 'bf16 fused'",
                    'ULY_CUDA_ATTN_DQ=rows128 ULY_CUDA_ATTN_DKV=rows128: ', '== the TMA kernels', 'fused tma', 'fused ws', 'fused wspp', 'fused wsov', 'fused wsppov', 'fused ws+dkvws', 'fused all ws', 'fused ws 1-pass',
                    'fused all ws ov', 'fused ov 1-pass', 'fused 128+dkvws',
                    'step with ULY_CUDA_ATTN_FWD=wsov ULY_CUDA_ATTN_DQ=ws ULY_CUDA_ATTN_DKV=ws: ',
                    'step with ULY_CUDA_ATTN_FWD=wsov ULY_CUDA_ATTN_DKV=ws ULY_CUDA_ATTN_BWD=onepass: ',
                    'attention at the step\'s shape', 'step with bf16 activations (bf16 kernels): ',
                    'step with bf16 activations (converting copies around the f32 kernels): ' }
    -- MFU's peak: the emulator's estimated from its attributes (132 SMs at 1830 MHz), the simulation's assumed
    wants[#wants + 1] = MODE == 'emu' and '(ulysses CUDA emulator bf16 dense peak (estimated: 132 SMs x 1830 MHz x '
                        or 'MFU against 989 TFLOP/s (989 TFLOP/s assumed: '
    if MODE == 'emu' then   -- and raw cuBLAS ran (no n/a), and the profiled step
      for _, w in ipairs({ 'ulysses CUDA emulator', 'GPU time by kernel in one step', 'wall time on the stream' }) do
        wants[#wants + 1] = w
      end
    end
    for _, want in ipairs(wants) do
      assert.truthy(out:find(want, 1, true), 'missing ' .. want .. ' in:\n' .. out)
    end
  end)
end)

-- the emulator's own promise about streams (kernels/cuda/emu/streams.cpp), which the specs of the
-- communication stream rely on: work runs at once, or with ULY_EMU_STREAMS=lazy only when waited
-- for (scripts/test.sh runs both), and cudaStreamWaitEvent's order holds either way
describe('the CUDA emulator', function()
  it('runs stream work at once, or lazily when asked, and keeps the order of an event wait', function()
    if MODE ~= 'emu' then return end
    pcall(ffi.cdef, 'int uly_emu_streams_selftest(void);')
    local lib = ffi.load(assert(os.getenv('ULY_CUDA_LIB')))
    assert.equal(os.getenv('ULY_EMU_STREAMS') == 'lazy' and 1 or 0, lib.uly_emu_streams_selftest())
  end)
end)

-- two ranks, each with its own emulated GPU: NCCL (the emulator's, over MPI) on its own stream,
-- stream work deferred until waited for. run_ranks(cmd) -> output, or nil and why it cannot run
-- launch_ranks(cmd, env) -> output and exit status (124: killed by `timeout`), or nil and why not;
-- env: extra variables ({ NAME = value }) passed to every rank
local function launch_ranks(cmd, env)
  -- (not under the sanitizer build: Open MPI's own allocations trip LeakSanitizer in every rank)
  if os.execute('command -v mpirun >/dev/null 2>&1') ~= 0 or not uly.has('mpi')
     or (os.getenv('LD_PRELOAD') or ''):find('asan', 1, true) then
    return nil, 'no mpirun, a library without MPI, or the sanitizer build'
  end
  local vars = 'OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 '
    .. 'ULY_EMU_GPUS=own ULY_EMU_STREAMS=lazy ULY_CUDA_LIB=' .. helpers.shq(os.getenv('ULY_CUDA_LIB') or '') .. ' '
  local pass = '-x ULY_EMU_GPUS -x ULY_EMU_STREAMS -x ULY_CUDA_LIB '
  for k, v in pairs(env or {}) do
    vars = vars .. k .. '=' .. helpers.shq(tostring(v)) .. ' '
    pass = pass .. '-x ' .. k .. ' '
  end
  local p = assert(io.popen(vars .. 'timeout 300 mpirun --bind-to none --mca mpi_yield_when_idle 1 ' .. pass
                            .. '-np 2 ' .. cmd .. ' 2>&1; echo "exit=$?"'))
  local out = p:read('*a')
  p:close()
  return out, tonumber(out:match('exit=(%d+)%s*$'))
end

local function run_ranks(cmd)
  local out, rc = launch_ranks(cmd)
  if not out then return nil, rc end
  assert.equal(0, rc, out)
  return out
end

-- train.lua end to end: the gradient all-reduce overlapped with backward, bf16 exchanges; the
-- losses follow one CPU process in bf16 precision
describe('train.lua on device cuda under mpirun', function()
  it('follows the single-process CPU run with 2 sequence-parallel ranks over NCCL (the emulator)', function()
    if MODE ~= 'emu' then return end   -- one GPU (gpu-check) stages through the host: spec/train_spec.lua's path
    local args = '--data embedded --model llama --preset tiny --heads 4 --kv_heads 2 --seq 32 --batch 2 --steps 3 '
      .. '--warmup 1 --lr 3e-3 --eval_every 0 --eval_batches 0 --sample 0 --threads 1 --precision bf16 '
    local function losses(dir)
      local rows = uly.log.read_csv(dir .. '/log.csv')
      local out = {}
      for i, r in ipairs(rows) do out[i] = r.loss end
      return out
    end
    local ref_dir, dir = helpers.mkdtemp(), helpers.mkdtemp()
    local p = assert(io.popen('bin/ulysses train.lua ' .. args .. '--out ' .. ref_dir .. ' 2>&1; echo "exit=$?"'))
    local out = p:read('*a')
    p:close()
    assert.truthy(out:match('exit=0%s*$'), out)
    local why
    out, why = run_ranks('bin/ulysses train.lua ' .. args .. '--device cuda --sp 2 --out ' .. dir)
    if not out then pending(why) return end
    assert.truthy(out:find('dp 1 x sp 2', 1, true), out)
    -- MFU against both ranks' GPUs, each's peak estimated from the emulator's attributes
    assert.truthy(out:find('bf16 dense peak %(estimated: 132 SMs x 1830 MHz x %d+, %d+ TFLOP/s%) x 2 ranks%)'), out)
    local want, got = losses(ref_dir), losses(dir)
    assert.equal(3, #got)
    for i = 1, 3 do   -- bf16 attention on the GPU rounds more than the CPU's f32 kernel
      assert.is_true(math.abs(got[i] - want[i]) <= 2e-2 * want[i], ('step %d: %g vs %g'):format(i, got[i], want[i]))
    end
    helpers.rmtree(ref_dir)
    helpers.rmtree(dir)
  end)
end)

-- bench/ulysses.lua's device mode: the exchanges over NCCL send exactly the formula's bytes in bf16
describe('bench/ulysses.lua on device cuda under mpirun', function()
  it('runs every table over NCCL (the emulator), bf16 bytes exactly the formula\'s', function()
    if MODE ~= 'emu' then return end
    local out, why = run_ranks('bin/ulysses bench/ulysses.lua --exchange-n 256 --layer-n 128 --models llama --reps 1 '
                               .. '--layer-reps 1 --device cuda --precision bf16')
    if not out then pending(why) return end
    for _, want in ipairs({ 'device cuda, precision bf16', 'ES = 2 bytes an element', 'the device exchanges went over NCCL',
                            '2. a whole layer', '4. bytes sent per rank' }) do
      assert.truthy(out:find(want, 1, true), 'missing ' .. want .. ' in:\n' .. out)
    end
    -- table 1: measured / exact = 1.00 forward and backward, on every rank
    assert.truthy(out:match('llama%s+256%s+2%s[^\n]*%s1%.00%s[^\n]*%s1%.00%s+yes'), out)
  end)
end)

-- the NCCL watchdog (kernels/cuda/comm.cu): when a rank's GPU stalls inside a collective (the
-- emulator's uly_emu_nccl_stall: it posts nothing and never finishes, so its peer waits too), or
-- NCCL reports an asynchronous error (a peer's death), every rank's wait ends with a message naming
-- what was in flight, instead of the job hanging; the group cannot be used after it, and the job
-- ends instead of hanging in MPI's shutdown
describe('the NCCL watchdog under mpirun', function()
  local script = [[
    local uly = require 'ulysses'
    local ffi = require 'ffi'
    ffi.cdef 'int uly_emu_nccl_stall(int on); void uly_emu_nccl_async_error(int code);'
    local emu = ffi.load(os.getenv('ULY_CUDA_LIB'))
    uly.dist.run(function()
      local w = uly.dist.init({ sp = 2 }).world_group
      local t = uly.ones(1024, { device = 'cuda' })
      w:all_reduce_(t)   -- a healthy one first, over NCCL
      assert(w:device_path() == 'device' and t:sum():item() == 2048)
      if os.getenv('WATCHDOG_CASE') == 'async' then
        if w:rank() == 0 then emu.uly_emu_nccl_async_error(6) else assert(emu.uly_emu_nccl_stall(1) == 0) end
        t = t:bf16()
        w:all_reduce_start_(t)
        w:wait_all()          -- orders later device work after it: no host wait yet
        print(t:float():sum():item()) -- waits, and fails there
      else
        if w:rank() == 1 then assert(emu.uly_emu_nccl_stall(1) == 0) end
        print('first: ' .. select(2, pcall(w.all_reduce_, w, t)))
        print('after: ' .. select(2, pcall(w.all_reduce_, w, t)))
      end
    end)
  ]]
  local function job(case, timeout)
    local file = os.tmpname()
    local f = assert(io.open(file, 'w'))
    f:write(script)
    f:close()
    local out, rc = launch_ranks('bin/ulysses ' .. file, { WATCHDOG_CASE = case, ULY_COMM_TIMEOUT = timeout })
    os.remove(file)
    return out, rc
  end

  it('times out the collective a stalled peer never finishes; the group is unusable after it', function()
    if MODE ~= 'emu' then return end   -- a real GPU cannot be made to stall on purpose
    local out, rc = job('stall', 2)
    if not out then pending(rc) return end
    helpers.assert_failed_not_hung(rc, out)
    assert.matches('first: all_reduce on group world %(call 2%): the device collective failed: synchronize: NCCL '
                   .. 'watchdog: timed out after 2 s waiting for the device collectives in flight %(the last queued: '
                   .. 'all%-reduce of 1024 f32 elements over 2 ranks%): a rank died, stalled or skipped one; its '
                   .. 'communicators are aborted', out)
    assert.matches('after: all_reduce on group world: an earlier collective on this group timed out or its device '
                   .. 'communicator was aborted', out)
    assert.matches('ulysses: rank %d: a collective timed out or failed on the device earlier, so MPI cannot shut down', out)
  end)

  it('reports NCCL\'s asynchronous error at once, at the host\'s next wait', function()
    if MODE ~= 'emu' then return end
    local out, rc = job('async', 100)   -- not the timeout: rank 0 reports the error and ends the job
    if not out then pending(rc) return end
    helpers.assert_failed_not_hung(rc, out)
    assert.matches('ulysses: rank 0: [^\n]*copy from the device: NCCL watchdog: NCCL reported an error %(remote process '
                   .. 'exited or there was a network error%) with device collectives in flight %(the last queued: '
                   .. 'all%-reduce of 1024 bf16', out)
    assert.is_nil(out:find('timed out', 1, true), out)
  end)
end)

-- scripts/gpu-sanitize.lua, which scripts/gpu-check.sh runs under compute-sanitizer on a GPU:
-- here on the emulator as compute capability 9.0 (so the wgmma, two-warpgroup and TMA variants
-- it lists run), once (not in the warps-one-at-a-time passes)
describe('scripts/gpu-sanitize.lua', function()
  it('runs every path it lists against the CPU on the emulator', function()
    if MODE ~= 'emu' or os.getenv('ULY_EMU_ORDER') then return end
    local p = assert(io.popen('env -u ULY_CUDA_ATTN_WGMMA ULY_EMU_CC=9.0 ULY_CUDA_LIB='
      .. helpers.shq(os.getenv('ULY_CUDA_LIB') or '') .. ' luajit scripts/gpu-sanitize.lua 2>&1; echo "exit=$?"'))
    local out = p:read('*a')
    p:close()
    assert.truthy(out:match('gpu%-sanitize: ok%s+exit=0%s*$'), out)
    for _, want in ipairs({ 'D 128 documents fused-wspp', 'D  64 causal    fused-ws ', 'D  32 layout    fused-128',
                            'D  64 documents fused-ws1p', 'D 128 causal    fused-ws1p', 'D  64 layout    fused-wsppov',
                            'D 128: on (self-check' }) do
      assert.truthy(out:find(want, 1, true), 'missing ' .. want .. ' in:\n' .. out)
    end
    assert.falsy(out:find('ulysses:', 1, true), out)   -- no variant fell back to the default
  end)
end)

-- fn() with the wgmma kernels forced on the emulator (every pass of scripts/test.sh then runs the
-- TMA kernels, the sanitizer one included, not only the wgmma pass); on a GPU as its self-check
-- decided
local function on_wgmma_if_emulated(fn)
  if MODE == 'emu' then ffi.C.setenv('ULY_CUDA_ATTN_WGMMA', '1', 1) end
  local ok, err = pcall(fn)
  ffi.C.setenv('ULY_CUDA_ATTN_WGMMA', os.getenv('ULY_TEST_WGMMA') or '', 1)
  if not ok then error(err, 0) end
end

-- Last in this file: on a GPU a fault in these kernels (an mbarrier wait that traps) leaves the
-- context unusable, and every later spec would fail with it.
describe('fused attention on TMA (mixed precision)', function()
  -- the forward with TMA loads and mbarriers, and warp-specialised (a TMA producer warp, two
  -- consumer warpgroups; with ping-pong: the two take turns at the tensor cores); the packed and
  -- split case keeps cp.async
  it('give the mma.sync kernels\' numbers (D = 64, 128; packed, split, masked)', function()
    if not REAL then return end   -- the simulation has no fused kernels
    check_wgmma_variants({ { 'tma', 'TMA wgmma forward' },
                           { 'ws', 'warp-specialised wgmma forward, dK/dV and dQ', 'ws', 'ws' },
                           { 'wspp', 'warp-specialised wgmma forward with ping-pong' },
                           -- 128-key tiles: a row's running max moves at other keys, so other roundings
                           { 'wsov', 'warp-specialised wgmma forward, P V overlapping the next softmax', tolerance = { [64] = 1e-2, [128] = 1e-2 } },
                           { 'wsppov', 'warp-specialised wgmma forward, ping-pong and overlap', tolerance = { [64] = 1e-2, [128] = 1e-2 } } },
                         -- more key tiles than the ring has stages (every stage given back and refilled;
                         -- 64-key tiles, and 128-key ones: wsov, wsppov), rows for both consumer warpgroups
                         { { { 1, 100, 2, 64 }, { 1, 260, 1, 64 }, {} }, { { 1, 130, 1, 128 }, { 1, 520, 1, 128 }, { causal = true } },
                           { { 1, 130, 1, 64 }, { 1, 520, 1, 64 }, { causal = true } } })
  end)

  -- the warp-specialised backward (ULY_CUDA_ATTN_DKV=ws: 128 keys a block, Q, dO and the
  -- statistics by TMA; ULY_CUDA_ATTN_DQ=ws: 128 rows a block, K and V by TMA) with GQA, a window,
  -- a block-sparse layout and documents; the masks' edges at D = 64 and 128 in the mask-edge
  -- spec (emulator)
  it('the warp-specialised backward gives the CPU\'s gradients (D = 64: GQA, masks, documents)', function()
    if not REAL then return end   -- the simulation has no fused kernels
    ffi.C.setenv('ULY_CUDA_ATTN_DKV', 'ws', 1)
    ffi.C.setenv('ULY_CUDA_ATTN_DQ', 'ws', 1)
    local ok, err = pcall(on_wgmma_if_emulated, wide_backward_cases)
    clear_attention_variants()
    assert(ok, 'ULY_CUDA_ATTN_DKV=ws ULY_CUDA_ATTN_DQ=ws: ' .. tostring(err))
  end)

  -- the one-pass backward on the warp-specialised dK/dV (ULY_CUDA_ATTN_BWD=onepass with
  -- ULY_CUDA_ATTN_DKV=ws): at D = 64 each consumer warpgroup adds its keys' share of dQ = dS K with
  -- atomics, from a dS^T tile in shared memory (MN-major A); at D = 128 each adds one half of D of
  -- dQ^T = K^T dS^T over both warpgroups' keys (a query tile seen by one warpgroup's keys only:
  -- the other gives zeros)
  it('the warp-specialised one-pass backward gives the CPU\'s gradients (D = 64, 128: GQA, masks, documents)', function()
    if not REAL then return end   -- the simulation has no fused kernels
    ffi.C.setenv('ULY_CUDA_ATTN_DKV', 'ws', 1)
    ffi.C.setenv('ULY_CUDA_ATTN_BWD', 'onepass', 1)
    local ok, err = pcall(on_wgmma_if_emulated, function()
      wide_backward_cases()
      helpers.reseed(39)
      local docs = {}
      for t = 1, 150 do docs[t] = t <= 70 and 0 or 1 end
      local d = uly.tensor(docs, { dtype = 'i32' }):view(1, 150)
      against_cpu(function(q, k, v) return uly.flash_attention(q, k, v, { causal = true }) end,
        { uly.randn(2, 150, 4, 128), uly.randn(2, 150, 2, 128), uly.randn(2, 150, 2, 128) }, { fused_only = true })
      against_cpu(function(q, k, v) return uly.flash_attention(q, k, v, { window = { 40, 5 } }) end,
        { uly.randn(1, 97, 2, 128), uly.randn(1, 160, 1, 128), uly.randn(1, 160, 1, 128) }, { fused_only = true })
      against_cpu(function(q, k, v, a, b) return uly.flash_attention(q, k, v, { causal = true, q_doc = a, k_doc = b }) end,
        { uly.randn(1, 150, 2, 128), uly.randn(1, 150, 1, 128), uly.randn(1, 150, 1, 128), d, d }, { fused_only = true })
    end)
    clear_attention_variants()
    ffi.C.setenv('ULY_CUDA_ATTN_BWD', '', 1)
    assert(ok, 'ULY_CUDA_ATTN_DKV=ws ULY_CUDA_ATTN_BWD=onepass: ' .. tostring(err))
  end)
end)
