-- spec/zero_spec.lua — dist.ZeroAdamW, AdamW with its state sharded over the ranks (ZeRO stage
-- 1): under mpirun at 1, 2, 4 ranks and DP 2 x SP 2 (#mpi) three clipped steps leave the
-- parameters that optim.AdamW leaves after dist.all_reduce_grads on the same grid, and those the
-- single-process model reaches with plain AdamW (P-invariance); its state_dict is AdamW's, so a
-- checkpoint moves between the two at any group size; each rank keeps its share of the state
-- only; on the device (the emulator) it follows the CPU. Plain runs check the same at a world of
-- one, with buckets small enough to cut parameters into pieces, and the misuse errors.
local uly = require 'ulysses'
local helpers = require 'helpers'
local dist = uly.dist
local GPT = require 'models.gpt'
local Llama = require 'models.llama'
local sp = require 'sp_compare'
local grid, split, batch = sp.grid, sp.split, sp.batch

local LLAMA = { preset = 'tiny', layers = 2, heads = 4, kv_heads = 2, dim = 32, hidden = 48, seq = 32 }
local GPT_CFG = { preset = 'tiny', layers = 2, heads = 4, dim = 32, seq = 16 }
local N = 16
local LR = 1e-2

local function flat_params(m)
  local out = {}
  for _, p in ipairs(m:parameters()) do
    for _, v in ipairs(helpers.list(p:cpu():view(-1))) do out[#out + 1] = v end
  end
  return out
end

-- the largest |a - b| over every parameter element, in units of the learning rate (one AdamW
-- step moves an element by about lr)
local function param_difference(a, b)
  assert.equal(#a, #b)
  local worst = 0
  for i = 1, #a do worst = math.max(worst, math.abs(a[i] - b[i])) end
  return worst / LR
end

-- `steps` optimizer steps on this rank's shard of the same batches. how: 'zero' (ZeroAdamW over
-- the world group), 'adamw' (dist.all_reduce_grads then optim.AdamW), 'single' (the whole
-- sequence in one process, plain AdamW). Returns the losses, the norms, the model and the optimizer.
local function train(Model, cfg, how, opts)
  opts = opts or {}
  local g = how ~= 'single' and grid() or nil
  local P, r = g and g.sp_size or 1, g and g.sp_rank or 0
  uly.manual_seed(7)
  local m = Model(sp.copy_cfg(cfg, g and { sp = P } or nil))
  local device = opts.device or 'cpu'
  if opts.device then m:to(device) end
  local hyper = { lr = LR, betas = { 0.9, 0.95 }, weight_decay = 0.1 }
  local opt
  if how == 'zero' then
    hyper.bucket_bytes = opts.bucket_bytes or 1024
    opt = dist.ZeroAdamW(m:parameters(), g.world_group, hyper)
  else
    opt = uly.optim.AdamW(m:parameters(), hyper)
  end
  if opts.load then opt:load_state_dict(opts.load) end
  local lo, n = split(N, P, r)
  local losses, norms, infos = {}, {}, {}
  local sync = opts.overlap and opt:grad_sync()
  for k = 1, opts.steps or 3 do
    local x, y = batch(2, N, cfg.vocab or 256, 40 + k + (opts.seed or 0))
    opt:zero_grad()
    local loss = m:loss(x:narrow(2, lo + 1, n):contiguous():to(device), y:narrow(2, lo + 1, n):contiguous():to(device),
                        { pos = lo, seq_total = N, grad_sync = sync })
    loss:backward()
    if sync then infos[k] = sync:finish() end
    losses[k] = require('models.common').global_loss(m, loss)
    if how == 'zero' then
      norms[k] = opt:clip_grad_norm(0.5)
    else
      if g then dist.all_reduce_grads(m:parameters(), g.world_group) end
      norms[k] = uly.optim.clip_grad_norm(opt, 0.5)
    end
    opt:step()
  end
  return losses, norms, m, opt, infos
end

local function assert_close_lists(a, b, tol, what)
  assert.equal(#a, #b)
  for i = 1, #a do
    local d = math.abs(a[i] - b[i]) / math.max(math.abs(b[i]), 1e-12)
    assert.is_true(d <= tol, string.format('%s %d: %.9g vs %.9g (%.3g relative)', what, i, a[i], b[i], d))
  end
end

describe('dist.ZeroAdamW: AdamW with its state sharded over the ranks #mpi', function()
  local cases = {
    { 'GPT with tied embeddings', GPT, GPT_CFG },
    { 'Llama with GQA and activation checkpointing', Llama, sp.copy_cfg(LLAMA, { checkpoint = true }) },
  }
  for _, c in ipairs(cases) do
    it('takes the steps of AdamW after all_reduce_grads, and of the single process: ' .. c[1], function()
      local zl, zn, zm, zopt = train(c[2], c[3], 'zero')
      local al, an, am = train(c[2], c[3], 'adamw')
      local sl, sn, sm = train(c[2], c[3], 'single')
      -- the same grid: only the order of the sum over ranks may differ
      assert_close_lists(zl, al, 1e-6, 'loss at step')
      assert_close_lists(zn, an, 1e-5, 'gradient norm at step')
      local d = param_difference(flat_params(zm), flat_params(am))
      assert.is_true(d <= 1e-3, string.format('parameters differ from AdamW by %.3g lr', d))
      -- P-invariance: the single-process model on the whole sequence
      assert_close_lists(zl, sl, 1e-5, 'loss at step (vs one process)')
      assert_close_lists(zn, sn, 1e-4, 'gradient norm at step (vs one process)')
      -- (AdamW moves an element whose gradient is nearly zero by up to lr either way, so float
      -- rounding that differs between the grid and one process shows here as a few % of lr; a
      -- wrong shard or a missing reduction moves elements by about lr)
      d = param_difference(flat_params(zm), flat_params(sm))
      assert.is_true(d <= 0.1, string.format('parameters differ from one process by %.3g lr', d))
      assert.is_true(zn[1] > 0.5, 'the clip never acted: ' .. zn[1])
      -- each rank keeps its share of the state: the shares add up to the padded whole
      local info = zopt:shard_info()
      local G = grid().world
      local t = uly.tensor({ info.owned }, { dtype = 'f64' })
      grid().world_group:all_reduce_(t, 'sum')
      assert.equal(info.padded, t:item())
      assert.is_true(info.owned <= info.total / G + info.buckets * G)
      assert.is_true(info.buckets >= 4)
    end)
  end

  it('reduces during backward with opt:grad_sync(): the same steps, most buckets started early', function()
    local cfg = sp.copy_cfg(LLAMA, { checkpoint = true })
    local zl, zn, zm = train(Llama, cfg, 'zero')
    local ol, on, om, _, infos = train(Llama, cfg, 'zero', { overlap = true })
    assert_close_lists(ol, zl, 1e-6, 'loss at step')
    assert_close_lists(on, zn, 1e-6, 'gradient norm at step')
    assert.is_true(param_difference(flat_params(om), flat_params(zm)) <= 1e-4)
    for k, info in ipairs(infos) do
      assert.is_true(info.buckets >= 4, 'too few buckets to show anything: ' .. info.buckets)
      assert.is_true(info.started_in_backward >= info.buckets / 2,
                     string.format('step %d: %d of %d buckets started during backward', k, info.started_in_backward,
                                   info.buckets))
    end
    assert.equal(0, grid().world_group:pending())
    -- the optimizer refuses to use a shard still being reduced
    local g = grid()
    uly.manual_seed(7)
    local m = Llama(sp.copy_cfg(LLAMA, { sp = g.sp_size }))
    local opt = dist.ZeroAdamW(m:parameters(), g.world_group, { bucket_bytes = 1024 })
    local sync = opt:grad_sync()
    local lo, n = split(N, g.sp_size, g.sp_rank)
    local x = batch(1, N, 256, 3):narrow(2, lo + 1, n):contiguous()
    m:loss(x, x, { pos = lo, seq_total = N, grad_sync = sync }):backward()
    local ok, err = pcall(opt.step, opt)
    assert.is_false(ok)
    assert.matches('call sync:finish() after backward', tostring(err), 1, true)
    assert.matches('give the scale as its grad_scale', helpers.error_of(sync.finish, sync, { scale = 0.5 }))
    sync:finish()
    opt:step()
    assert.equal(0, g.world_group:pending())
  end)

  it('gives optim.AdamW\'s state_dict, which moves both ways between ZeroAdamW and AdamW', function()
    -- two steps, then the state continues a third step in the other optimizer
    local _, _, zm, zopt = train(Llama, LLAMA, 'zero', { steps = 2 })
    local _, _, am, aopt = train(Llama, LLAMA, 'adamw', { steps = 2 })
    local zsd, asd = zopt:state_dict(), aopt:state_dict()
    assert.equal('AdamW', zsd.kind)
    assert.equal(2, zsd.step)
    for _, name in ipairs({ 'exp_avg', 'exp_avg_sq' }) do
      for i = 1, #asd.state[name] do
        local a, b = helpers.list(zsd.state[name][i]:view(-1)), helpers.list(asd.state[name][i]:view(-1))
        local scale = 1e-30
        for j = 1, #b do scale = math.max(scale, math.abs(b[j])) end
        for j = 1, #a do
          assert.is_true(math.abs(a[j] - b[j]) <= 1e-5 * scale, string.format("%s %d element %d: %.9g vs %.9g (AdamW), largest %.9g", name, i, j, a[j], b[j], scale))
        end
      end
    end
    -- AdamW's state (taken at step 2) into a fresh ZeroAdamW over the trained weights, and back
    local function continue(how, state, weights)
      local g = grid()
      uly.manual_seed(7)
      local m = Llama(sp.copy_cfg(LLAMA, { sp = g.sp_size }))
      for i, p in ipairs(m:parameters()) do p:detach():copy_(weights[i]) end
      local hyper = { lr = LR, betas = { 0.9, 0.95 }, weight_decay = 0.1 }
      local opt = how == 'zero' and dist.ZeroAdamW(m:parameters(), g.world_group, sp.copy_cfg(hyper, { bucket_bytes = 512 }))
        or uly.optim.AdamW(m:parameters(), hyper)
      opt:load_state_dict(state)
      assert.equal(2, opt.step_count)
      local lo, n = split(N, g.sp_size, g.sp_rank)
      local x, y = batch(2, N, 256, 99)
      opt:zero_grad()
      m:loss(x:narrow(2, lo + 1, n):contiguous(), y:narrow(2, lo + 1, n):contiguous(), { pos = lo, seq_total = N }):backward()
      if how == 'zero' then opt:clip_grad_norm(0.5) else
        dist.all_reduce_grads(m:parameters(), g.world_group)
        uly.optim.clip_grad_norm(opt, 0.5)
      end
      opt:step()
      return flat_params(m)
    end
    local weights = {}
    for i, p in ipairs(am:parameters()) do weights[i] = p:detach():clone() end
    local want = continue('adamw', asd, weights)
    local d1 = param_difference(continue('zero', asd, weights), want)
    local d2 = param_difference(continue('adamw', zsd, weights), want)
    assert.is_true(d1 <= 1e-3, string.format('ZeroAdamW from AdamW\'s state: %.3g lr off', d1))
    assert.is_true(d2 <= 1e-3, string.format('AdamW from ZeroAdamW\'s state: %.3g lr off', d2))
    -- and the trained ZeRO model itself matched AdamW's after two steps
    assert.is_true(param_difference(flat_params(zm), flat_params(am)) <= 1e-3)
  end)

  it('writes a checkpoint from one rank that loads at any group size (consolidated)', function()
    local g = grid()
    local _, _, zm, zopt = train(Llama, LLAMA, 'zero', { steps = 2 })
    local full = zopt:consolidated()   -- every rank
    -- a directory named by rank 0, sent to every rank
    local t = uly.tensor({ g.rank == 0 and math.floor((uly.clock() * 1e6) % 2 ^ 30) or 0 }, { dtype = 'f64' })
    g.world_group:broadcast_(t, 0)
    local dir = string.format('%s/uly-zero-spec-%d', os.getenv('TMPDIR') or '/tmp', t:item())
    if g.rank == 0 then os.execute('mkdir -p ' .. helpers.shq(dir)) end
    local path = dir .. '/zero.h5'
    if g.rank == 0 then uly.checkpoint.save(path, { model = zm, optim = full, step = 2 }) end
    g.world_group:barrier()
    -- a fresh model and ZeroAdamW load it on every rank, and a plain AdamW in one process
    uly.manual_seed(99)
    local m2 = Llama(sp.copy_cfg(LLAMA, { sp = g.sp_size }))
    local o2 = dist.ZeroAdamW(m2:parameters(), g.world_group, { lr = LR, bucket_bytes = 768 })
    local info = uly.checkpoint.load(path, { model = m2, optim = o2 })
    assert.equal(2, info.step)
    assert.equal(2, o2.step_count)
    assert.equal(0, param_difference(flat_params(m2), flat_params(zm)))
    local again = o2:state_dict()
    local before = zopt:state_dict()
    for i = 1, #before.state.exp_avg do
      assert.same(helpers.list(before.state.exp_avg_sq[i]:view(-1)), helpers.list(again.state.exp_avg_sq[i]:view(-1)))
    end
    uly.manual_seed(5)
    local m3 = Llama(LLAMA)
    local o3 = uly.optim.AdamW(m3:parameters(), { lr = LR })
    uly.checkpoint.load(path, { model = m3, optim = o3 })
    assert.same(helpers.list(before.state.exp_avg[1]:view(-1)), helpers.list(o3.state.exp_avg[1]:view(-1)))
    g.world_group:barrier()
    if g.rank == 0 then helpers.rmtree(dir) end
  end)

  it('refuses parameter lists that differ between the ranks, on every rank, before changing any', function()
    local g = grid()
    local w, odd = g.world_group, g.rank % 2 == 1
    local nn = uly.nn
    uly.manual_seed(5 + g.rank)
    -- the same element count, other shapes (rank 0's weights would be broadcast over the others')
    local m = odd and nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 3)) or nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 2))
    local before = flat_params(m)
    local function error_of(list)
      local ok, err = pcall(dist.ZeroAdamW, list, w, { lr = LR })
      local msg = ok and '' or tostring(err):gsub('^[^:]*:%d+: ', '')
      local h = 0
      for i = 1, #msg do h = (h * 31 + msg:byte(i)) % 2147483647 end
      w:check_same('the error message', { #msg, h })   -- every rank raised the same
      return msg
    end
    local shapes = error_of(m:parameters())
    local counts = error_of(odd and { m:parameters()[1] } or m:parameters())
    assert.are.same(before, flat_params(m))
    if g.world == 1 then return end
    local a = m:parameters()[1]:shape()
    if odd then a = { a[2], a[1] } end
    assert.matches(string.format('ZeroAdamW: the ranks of group world hold different parameters: parameter 1 is '
                                 .. 'f32[%d, %d] on rank 0 but f32[%d, %d] on rank 1', a[1], a[2], a[2], a[1]),
                   shapes, 1, true)
    assert.matches('ZeroAdamW: the number of parameters differs between the ranks', counts, 1, true)
  end)

  it('on device cuda follows the CPU', function()
    local real = helpers.use_test_device()
    local cfg = sp.copy_cfg(LLAMA, { checkpoint = true })
    local cl, cn, cm = train(Llama, cfg, 'zero', { steps = 2 })
    local dl, dn, dm = train(Llama, cfg, 'zero', { steps = 2, device = 'cuda', overlap = true })
    assert_close_lists(dl, cl, real and 1e-3 or 1e-6, 'loss at step')
    assert_close_lists(dn, cn, real and 1e-2 or 1e-5, 'gradient norm at step')
    local d = param_difference(flat_params(dm), flat_params(cm))
    assert.is_true(d <= (real and 0.2 or 1e-3), string.format('device parameters differ by %.3g lr', d))
    if grid().world > 1 then  -- NCCL's all-gather / reduce-scatter when every rank has its own GPU
      assert.equal(helpers.expected_device_path(), grid().world_group:device_path())
    end
    dm = nil   -- the device tensors go with the model and the optimizer
    if not real then helpers.reset_simulated_device() end
  end)
end)

describe('dist.ZeroAdamW at a world of one', function()
  local function one()
    return dist.init({ sp = 1 }).world_group
  end

  it('is AdamW, with parameters cut into pieces by small buckets', function()
    local group = one()
    local x, y = batch(2, N, 256, 3)
    local function run(how)
      uly.manual_seed(3)
      local m = Llama(LLAMA)
      local hyper = { lr = LR, weight_decay = 0.1 }
      local zero = how ~= 'adamw'
      local opt = zero and dist.ZeroAdamW(m:parameters(), group, sp.copy_cfg(hyper, { bucket_bytes = 100,
                                                                                   stage = how == 'zero_stage1' and 1 or nil }))
        or uly.optim.AdamW(m:parameters(), hyper)
      local sync = how == 'zero_sync' and opt:grad_sync() or nil
      for _ = 1, 2 do
        opt:zero_grad()
        m:loss(x, y, { grad_sync = sync }):backward()
        if sync then sync:finish() end
        if zero then opt:clip_grad_norm(0.3) else uly.optim.clip_grad_norm(opt, 0.3) end
        opt:step()
      end
      return flat_params(m), opt
    end
    local want = run('adamw')
    local got, opt = run('zero')
    assert.equal(0, param_difference(got, want))
    assert.equal(0, param_difference(run('zero_sync'), want))
    -- stage 2 (the default) freed every grad once the reduction took it; stage 1 keeps them
    for _, p in ipairs(opt.params) do assert.is_nil(p.grad) end
    local got1, opt1 = run('zero_stage1')
    assert.equal(0, param_difference(got1, want))
    for _, p in ipairs(opt1.params) do assert.is_not_nil(p.grad) end
    local info = opt:shard_info()
    assert.equal(info.total, info.owned)
    assert.is_true(info.pieces > #opt.params, 'no parameter was cut by a bucket edge')
  end)

  it('says what went wrong', function()
    local group = one()
    local m = Llama(LLAMA)
    local function err(f, ...) local ok, e = pcall(f, ...) assert.is_false(ok) return tostring(e) end
    assert.matches('must be a dist group', err(dist.ZeroAdamW, m:parameters(), {}))
    assert.matches("unknown option 'momentum'", err(dist.ZeroAdamW, m:parameters(), group, { momentum = 0.9 }))
    assert.matches('bucket_bytes must be a number', err(dist.ZeroAdamW, m:parameters(), group, { bucket_bytes = 0 }))
    assert.matches('stage must be 1', err(dist.ZeroAdamW, m:parameters(), group, { stage = 3 }))
    assert.matches('f32', err(dist.ZeroAdamW, { uly.zeros(3, { dtype = 'f64', requires_grad = true }) }, group))
    local opt = dist.ZeroAdamW(m:parameters(), group)
    assert.matches('opt:clip_grad_norm', err(uly.optim.clip_grad_norm, opt, 1.0))
    assert.matches('opt:grad_norm', err(uly.optim.grad_norm, opt))
    assert.matches('max_norm must be a number', err(opt.clip_grad_norm, opt, -1))
    opt.lr = -1
    assert.matches('opt.lr must be a finite number', err(opt.step, opt))
    opt.lr = LR
    assert.matches('has 1 tensors but this optimizer has', err(opt.load_state_dict, opt,
      { kind = 'AdamW', step = 1, state = { exp_avg = { uly.zeros(2) }, exp_avg_sq = { uly.zeros(2) } } }))
    assert.matches('not AdamW', err(opt.load_state_dict, opt, { kind = 'SGD', step = 1, state = {} }))
    -- stage 2 drops a grad when its mark fires: a contribution after that is caught at finish
    local w = uly.randn(4, 4, { requires_grad = true })
    local wopt = dist.ZeroAdamW({ w }, group)
    local sync = wopt:grad_sync()
    local x = uly.randn(2, 4, { requires_grad = true })
    sync:mark(x:matmul(w), { w }):matmul(w):sum():backward()   -- w used again after its mark
    assert.matches('changed after its mark fired', err(sync.finish, sync))
    -- a parameter moved after the optimizer was made would lose its updates
    local p = m:parameters()[1]
    p._h = p:clone()._h
    assert.matches('moved or replaced', err(opt.step, opt))
    -- an all-gather whose input overlaps the output elsewhere than at this rank's block
    local buf = uly.zeros(8)
    assert.matches('overlaps the output', err(group.all_gather_into, group, buf:narrow(1, 2, 4), buf:narrow(1, 1, 4)))
  end)
end)
