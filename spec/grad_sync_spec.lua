-- spec/grad_sync_spec.lua — dist.grad_sync, the gradient all-reduce overlapped with backward:
-- under mpirun at P = 1, 2, 4 and DP 2 x SP 2 (#mpi) the gradients it leaves equal the
-- single-process model's (GPT with tied embeddings, Llama with GQA, activation checkpointing and
-- tiling, a tied Llama), with most buckets started during backward; the same sums as
-- dist.all_reduce_grads with gradient accumulation and a parameter that gets no gradient; on the
-- device (the emulator: NCCL on a stream of its own when every rank has its own GPU); misuse
-- fails with a message that says what to do. Plain runs check the same at a world of one.
local uly = require 'ulysses'
local helpers = require 'helpers'
local dist = uly.dist
local GPT = require 'models.gpt'
local Llama = require 'models.llama'
local sp = require 'sp_compare'
local grid, split, batch, compare = sp.grid, sp.split, sp.batch, sp.compare

local TOL = 1e-5   -- as spec/ulysses_spec.lua: the sums are those of dist.all_reduce_grads

-- every parameter's grad as a flat list of numbers
local function grads(params)
  local out = {}
  for i, p in ipairs(params) do out[i] = p.grad and helpers.list(p.grad:cpu():view(-1)) or false end
  return out
end

local function largest_difference(a, b)
  local worst = 0
  for i = 1, #a do
    assert.equal(#a[i], #b[i])
    local scale = 1e-30
    for j = 1, #b[i] do scale = math.max(scale, math.abs(b[i][j])) end
    for j = 1, #a[i] do worst = math.max(worst, math.abs(a[i][j] - b[i][j]) / scale) end
  end
  return worst
end

-- one step of `steps` micro-batches on this rank's shard; grad_sync (options) on the last one
-- only, else dist.all_reduce_grads at the end. Returns the grads and what finish returned.
local function step(Model, cfg, N, sync_opts, opts)
  opts = opts or {}
  local g = grid()
  uly.manual_seed(7)
  local m = Model(sp.copy_cfg(cfg, { sp = g.sp_size }))
  if opts.device then m:to(opts.device) end
  local params = m:parameters()
  if opts.unused then params[#params + 1] = uly.zeros(3, { requires_grad = true }) end
  local sync = sync_opts and dist.grad_sync(params, g.world_group, sync_opts)
  local lo, n = split(N, g.sp_size, g.sp_rank)
  local info
  for k = 1, opts.micro or 1 do
    local x, y = batch(2, N, 256, 20 + k)
    local last = k == (opts.micro or 1)
    local dev = opts.device or 'cpu'
    local loss = m:loss(x:narrow(2, lo + 1, n):contiguous():to(dev), y:narrow(2, lo + 1, n):contiguous():to(dev),
                        { pos = lo, seq_total = N, grad_sync = last and sync or nil })
    loss:backward()
  end
  if sync then info = sync:finish() else dist.all_reduce_grads(params, g.world_group) end
  return grads(params), info
end

local LLAMA = { preset = 'tiny', layers = 3, heads = 4, kv_heads = 2, dim = 32, hidden = 48, seq = 32 }

-- the error of fn(...) (nil if none), after checking that every rank of the group got the same one
local function same_error_everywhere(group, fn, ...)
  local ok, err = pcall(fn, ...)
  local msg = ok and '' or tostring(err):gsub('^[^:]*:%d+: ', '')
  local h = 0
  for i = 1, #msg do h = (h * 31 + msg:byte(i)) % 2147483647 end
  group:check_same('the error message', { #msg, h })
  return not ok and msg or nil
end

-- three Linear(2, 2); `skip` lists layers this rank's forward leaves out; `extra` (a parameter)
-- is added to the output on ranks where it is given. Returns the loss.
local function small_forward(m, sync, skip, extra)
  local h = uly.randn(3, 2)
  for i = 1, 3 do
    if not skip[i] then
      if sync then h = sync:mark(h, m[i]) end
      h = m[i](h)
    end
  end
  if extra then h = h + extra end
  return (h * h):sum()
end

local function small_model()
  uly.manual_seed(3)
  local nn = uly.nn
  return nn.Sequential(nn.Linear(2, 2, { std = 1 }), nn.Linear(2, 2, { std = 1 }), nn.Linear(2, 2, { std = 1 }))
end

describe('gradient all-reduce overlapped with backward (dist.grad_sync) #mpi', function()
  local cases = {
    { 'GPT with tied embeddings', GPT, { preset = 'tiny', layers = 3, heads = 4, dim = 32, seq = 16 }, 14 },
    { 'Llama with GQA, activation checkpointing and tiling', Llama, sp.copy_cfg(LLAMA, { checkpoint = true, tile = 4 }), 19 },
    { 'Llama with tied embeddings', Llama, sp.copy_cfg(LLAMA, { tied = true }), 16 },
  }
  for _, c in ipairs(cases) do
    it('leaves the single-process gradients, most buckets started during backward: ' .. c[1], function()
      local dl, dg, where, info = compare(c[2], c[3], c[4], { grad_sync = { bucket_bytes = 4096 } })
      assert.is_true(dl <= TOL, string.format('loss differs by %.3g relative', dl))
      assert.is_true(dg <= TOL, string.format('gradient of %s differs by %.3g', tostring(where), dg))
      -- every bucket but those holding what backward finishes last (embeddings) started early
      assert.is_true(info.buckets >= 4, 'too few buckets to show anything: ' .. info.buckets)
      assert.is_true(info.started_in_backward >= info.buckets / 2,
                     string.format('%d of %d buckets started during backward', info.started_in_backward, info.buckets))
      assert.is_true(info.started_in_backward < info.buckets)   -- the tied / embedding bucket waits for finish
      assert.equal(0, grid().world_group:pending())
    end)
  end

  it('sums what dist.all_reduce_grads sums, with gradient accumulation and a parameter without a gradient', function()
    local want = step(Llama, LLAMA, 20, nil, { micro = 2, unused = true })
    local got, info = step(Llama, LLAMA, 20, { bucket_bytes = 2048 }, { micro = 2, unused = true })
    assert.is_true(largest_difference(got, want) <= 1e-6)
    assert.are.same({ 0, 0, 0 }, got[#got])
    assert.is_true(info.started_in_backward > 0)
    -- one bucket for everything: nothing can start before the embeddings are in, at finish
    local one, info1 = step(Llama, LLAMA, 20, { bucket_bytes = 2 ^ 30 })
    assert.is_true(largest_difference(one, step(Llama, LLAMA, 20, nil)) <= 1e-6)
    assert.same({ buckets = 1, started_in_backward = 0 }, info1)
  end)

  it('on device cuda matches the CPU (NCCL on its own stream when every rank has its own GPU)', function()
    local real = helpers.use_test_device()
    local cfg = sp.copy_cfg(LLAMA, { checkpoint = true })
    local want = step(Llama, cfg, 18, { bucket_bytes = 4096 })
    local got, info = step(Llama, cfg, 18, { bucket_bytes = 4096 }, { device = 'cuda' })
    assert.is_true(largest_difference(got, want) <= (real and 5e-3 or 1e-6))
    assert.is_true(info.started_in_backward >= info.buckets / 2)
    if grid().world > 1 then assert.equal(helpers.expected_device_path(), grid().world_group:device_path()) end
    if not real then helpers.reset_simulated_device() end
  end)

  it('refuses ranks whose forwards marked different layers, on every rank, at any step', function()
    local g = grid()
    local w = g.world_group
    -- step 1: every rank runs every layer; step 2: rank 1 skips layer 2 (stochastic depth)
    local m = small_model()
    local sync = dist.grad_sync(m:parameters(), w)
    uly.manual_seed(10 + g.rank)
    small_forward(m, sync, {}):backward()
    sync:finish()
    local first = grads(m:parameters())
    local ref = small_model()
    uly.manual_seed(10 + g.rank)
    small_forward(ref, nil, {}):backward()
    dist.all_reduce_grads(ref:parameters(), w)
    m:zero_grad()
    local loss = small_forward(m, sync, { [2] = g.rank == 1 })
    local err = same_error_everywhere(w, loss.backward, loss)
    if not err then sync:finish() end   -- (a world of one: nothing to disagree)
    local pending = w:pending()
    -- the sync goes on once the ranks agree again
    m:zero_grad()
    uly.manual_seed(10 + g.rank)
    small_forward(m, sync, {}):backward()
    sync:finish()
    assert.is_true(largest_difference(first, grads(ref:parameters())) <= 1e-6)
    assert.is_true(largest_difference(grads(m:parameters()), grads(ref:parameters())) <= 1e-6)
    assert.equal(0, pending)
    if g.world == 1 then return assert.is_nil(err) end
    assert.is_string(err, 'no error though rank 1 skipped a layer')
    assert.matches('grad_sync: the layout of the gradient buffer', err, 1, true)
    assert.matches("forward passes marked different layers", err, 1, true)
    assert.matches('dist.all_reduce_grads', err, 1, true)
  end)

  it('sums what dist.all_reduce_grads sums when a parameter has a gradient on some ranks only', function()
    local g = grid()
    local function run(use_sync)
      local m = small_model()
      local extra = uly.zeros(3, 2, { requires_grad = true })
      local params = m:parameters()
      params[#params + 1] = extra
      local sync = use_sync and dist.grad_sync(params, g.world_group, { bucket_bytes = 16 })
      uly.manual_seed(20 + g.rank)
      small_forward(m, sync, {}, g.rank % 2 == 0 and extra or nil):backward()   -- no grad on odd ranks
      if sync then sync:finish({ scale = 0.5 }) else dist.all_reduce_grads(params, g.world_group, { scale = 0.5 }) end
      return grads(params)
    end
    local got, want = run(true), run(false)
    assert.is_true(largest_difference(got, want) <= 1e-6)
    assert.is_true(math.abs(got[#got][1]) > 0)
  end)

  it('refuses parameter lists that differ between the ranks, naming the first difference', function()
    local g = grid()
    local w, odd = g.world_group, g.rank % 2 == 1
    local nn = uly.nn
    -- the same element count, other shapes; then another dtype
    local m = odd and nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 3)) or nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 2))
    local shapes = same_error_everywhere(w, dist.grad_sync, m:parameters(), w)
    local typed = uly.zeros(2, 3, { dtype = odd and 'bf16' or 'f32', requires_grad = true })
    local dtypes = same_error_everywhere(w, dist.grad_sync, { uly.zeros(4, { requires_grad = true }), typed }, w)
    local counts = same_error_everywhere(w, dist.grad_sync, odd and { typed } or m:parameters(), w)
    if g.world == 1 then return end
    local a, b = m:parameters()[1]:shape(), { m:parameters()[1]:shape()[2], m:parameters()[1]:shape()[1] }
    if odd then a, b = b, a end
    assert.matches(string.format('grad_sync: the ranks of group world hold different parameters: parameter 1 is '
                                 .. 'f32[%d, %d] on rank 0 but f32[%d, %d] on rank 1', a[1], a[2], b[1], b[2]),
                   shapes or 'no error', 1, true)
    assert.matches('parameter 2 is f32[2, 3] on rank 0 but bf16[2, 3] on rank 1', dtypes or 'no error', 1, true)
    assert.matches('grad_sync: the number of parameters differs between the ranks', counts or 'no error', 1, true)
  end)

  it('refuses a second forward before finish, with a message that says what to do', function()
    local g = grid()
    uly.manual_seed(7)
    local m = Llama(sp.copy_cfg(LLAMA, { sp = g.sp_size }))
    local sync = dist.grad_sync(m:parameters(), g.world_group, { bucket_bytes = 4096 })
    local lo, n = split(16, g.sp_size, g.sp_rank)
    local x = batch(1, 16, 256, 3):narrow(2, lo + 1, n):contiguous()
    m:loss(x, x, { pos = lo, seq_total = 16, grad_sync = sync }):backward()
    local ok, err = pcall(m.loss, m, x, x, { pos = lo, seq_total = 16, grad_sync = sync })
    assert.is_false(ok)
    assert.matches('call finish() before the next forward', tostring(err), 1, true)
    sync:finish()
    -- the marks of an earlier forward reached first (two forwards, then the first backward)
    local l1 = m:loss(x, x, { pos = lo, seq_total = 16, grad_sync = sync })
    local l2 = m:loss(x, x, { pos = lo, seq_total = 16, grad_sync = sync })
    ok, err = pcall(l1.backward, l1)
    assert.is_false(ok)
    assert.matches('the backward of an earlier forward reached its marks', tostring(err), 1, true)
    l2:backward()
    sync:finish()
    assert.equal(0, g.world_group:pending())
  end)
end)

describe('dist.grad_sync at a world of one', function()
  it('leaves the gradients backward made and checks its arguments', function()
    local g = dist.init { sp = 1 }
    if g.world > 1 then return end   -- under mpirun the #mpi cases above run instead
    local want = step(GPT, { preset = 'tiny', layers = 2, heads = 2, dim = 16, seq = 16 }, 16, nil)
    local got, info = step(GPT, { preset = 'tiny', layers = 2, heads = 2, dim = 16, seq = 16 }, 16, { bucket_bytes = 1024 })
    assert.are.same(want, got)
    assert.is_true(info.started_in_backward > 0)
    local m = GPT { preset = 'tiny', layers = 1, heads = 2, dim = 16, seq = 16 }
    assert.matches('non%-empty list of parameters', helpers.error_of(dist.grad_sync, {}, g.world_group))
    assert.matches('must be a dist group', helpers.error_of(dist.grad_sync, m:parameters(), {}))
    assert.matches('bucket_bytes must be a number', helpers.error_of(dist.grad_sync, m:parameters(), g.world_group, { bucket_bytes = 1 }))
    local sync = dist.grad_sync({ m.ln_f.weight }, g.world_group)
    local x = uly.randn(1, 4, 16, { requires_grad = true })
    assert.matches('is not among the parameters the sync was made with', helpers.error_of(sync.mark, sync, x, m.ln_f))
    local p = m.blocks:parameters()[1]
    assert.matches('parameter 2 is parameter 1 again', helpers.error_of(dist.grad_sync, { p, p }, g.world_group))
  end)

  it('holds no gradient past finish: zero_grad frees them as without it', function()
    local g = dist.init { sp = 1 }
    if g.world > 1 then return end
    local cfg = { preset = 'tiny', layers = 2, heads = 2, dim = 64, seq = 32, vocab = 256 }
    local x = batch(2, 32, 256, 5)
    -- what stays held after zero_grad and a full collection, over a dozen steps (the JIT compiles
    -- the loops, whose stale stack slots once kept finish's table of every grad alive)
    local function held(use_sync)
      uly.manual_seed(7)
      local m = GPT(cfg)
      local sync = use_sync and dist.grad_sync(m:parameters(), g.world_group, { bucket_bytes = 4096 }) or nil
      local most = 0
      for _ = 1, 12 do
        m:zero_grad(true)
        collectgarbage('collect'); collectgarbage('collect')
        most = math.max(most, uly.memory().allocated)
        m:loss(x, x, { grad_sync = sync }):backward()
        if sync then sync:finish() end
      end
      m:zero_grad(true)
      return most
    end
    collectgarbage('collect'); collectgarbage('collect')
    local base = uly.memory().allocated
    local plain = held(false) - base
    collectgarbage('collect'); collectgarbage('collect')
    base = uly.memory().allocated
    local synced = held(true) - base
    -- with the sync: its flat buffer (the gradient's size) on top of the parameters
    local grad_bytes = 4 * GPT(cfg):num_parameters()
    assert.is_true(synced <= plain + grad_bytes + 65536,
                   string.format('held %d bytes with grad_sync, %d without (gradient %d)', synced, plain, grad_bytes))
  end)

  it('reports a gradient that changed after its mark fired', function()
    local g = dist.init { sp = 1 }
    if g.world > 1 then return end
    local w = uly.randn(4, 4, { requires_grad = true })
    local sync = dist.grad_sync({ w }, g.world_group)
    local x = uly.randn(2, 4, { requires_grad = true })
    local h = sync:mark(x:matmul(w), { w })  -- w is used again after the mark (before it in backward)
    h:matmul(w):sum():backward()
    local ok, err = pcall(sync.finish, sync)
    assert.is_false(ok)
    assert.matches('changed after its mark fired', tostring(err), 1, true)
    assert.equal(0, g.world_group:pending())
  end)
end)
