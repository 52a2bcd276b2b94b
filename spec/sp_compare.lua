-- spec/sp_compare.lua — shared by the #mpi specs of sequence parallelism (ulysses_spec,
-- grad_sync_spec): the grid from ULY_TEST_SP, the split rule written out independently of the C
-- code, a random batch, and the comparison of a sequence-parallel model's loss and gradients with
-- the single-process model's on the same batch.
local uly = require 'ulysses'
local helpers = require 'helpers'
local dist = uly.dist
local common = require 'models.common'

local M = {}

-- the grid every #mpi spec file uses: ULY_TEST_SP (set by scripts/test.sh), else SP over all
-- ranks, or 2 x 2 with 4 ranks
function M.grid()
  local world = tonumber(os.getenv('OMPI_COMM_WORLD_SIZE') or '1')
  return dist.init { sp = tonumber(os.getenv('ULY_TEST_SP') or '') or (world == 4 and 2 or world) }
end

-- the split rule, written out independently of the C code: first n % P parts get one more
function M.split(n, P, j)
  local base, extra = math.floor(n / P), n % P
  local len = base + (j < extra and 1 or 0)
  return j * base + math.min(j, extra), len
end

function M.batch(B, N, V, seed)
  math.randomseed(seed)
  local xt, yt = {}, {}
  for b = 1, B do
    xt[b], yt[b] = {}, {}
    for t = 1, N do
      xt[b][t] = math.random(0, V - 1)
      yt[b][t] = (t % 5 == 0) and -1 or math.random(0, V - 1)   -- some targets ignored
    end
  end
  return uly.tensor(xt, { dtype = 'i32' }), uly.tensor(yt, { dtype = 'i32' })
end

function M.copy_cfg(cfg, extra)
  local out = {}
  for k, v in pairs(cfg) do out[k] = v end
  for k, v in pairs(extra or {}) do out[k] = v end
  return out
end

-- the single-process model vs the sequence-parallel one on the same batch: returns the loss
-- difference, the largest gradient difference relative to each tensor's largest entry, where it
-- is, and what grad_sync:finish returned. opts: mask_last_shard (every target of the last rank's
-- shard ignored), docs (three packed documents), device, grad_sync (options of a dist.grad_sync
-- that reduces the gradients during backward, in place of dist.all_reduce_grads)
function M.compare(Model, cfg, N, opts)
  opts = opts or {}
  local mask_last_shard, with_docs, device = opts.mask_last_shard, opts.docs, opts.device
  local grid, split, batch, copy_cfg = M.grid, M.split, M.batch, M.copy_cfg
  local g = grid()
  local P, r = g.sp_size, g.sp_rank
  local x, y = batch(2, N, cfg.vocab or 256, 11)
  if mask_last_shard then -- every target of the last rank's shard ignored (the reference too)
    local lo_last, n_last = split(N, P, P - 1)
    for b = 1, 2 do for t = lo_last + 1, lo_last + n_last do y[b][t] = -1 end end
  end
  uly.manual_seed(7)
  local ref = Model(cfg)
  uly.manual_seed(7)
  local m = Model(copy_cfg(cfg, { sp = P }))
  if device then m:to(device) end
  local doc
  if with_docs then -- three packed documents; every rank gets the whole window's ids
    local d = {}
    for b = 1, 2 do d[b] = {} for t = 1, N do d[b][t] = t <= N / 3 and 0 or (t <= N / 2 + b and 1 or 2) end end
    doc = uly.tensor(d, { dtype = 'i32' })
  end
  local ref_loss = ref:loss(x, y, { doc = doc })
  ref_loss:backward()
  local lo, n = split(N, P, r)
  local sync = opts.grad_sync and dist.grad_sync(m:parameters(), g.world_group, opts.grad_sync)
  local loss = m:loss(x:narrow(2, lo + 1, n):contiguous():to(device or 'cpu'),
                      y:narrow(2, lo + 1, n):contiguous():to(device or 'cpu'),
                      { pos = lo, seq_total = N, doc = doc, grad_sync = sync })
  loss:backward()
  local info
  if sync then info = sync:finish() else dist.all_reduce_grads(m:parameters(), g.world_group) end
  local global = common.global_loss(m, loss)
  assert(loss:item() == loss:item() and global == global, 'NaN loss')
  local worst, where = 0, nil
  local rp = ref:parameters()
  local k = 0
  for name, p in m:named_parameters() do
    k = k + 1
    local a, na = helpers.values(p.grad)
    local b = helpers.values(rp[k].grad)
    local scale = 0
    for i = 0, na - 1 do scale = math.max(scale, math.abs(b[i])) end
    for i = 0, na - 1 do
      local e = math.abs(a[i] - b[i]) / math.max(scale, 1e-30)
      if e > worst then worst, where = e, name end
    end
  end
  return math.abs(global - ref_loss:item()) / math.max(math.abs(ref_loss:item()), 1e-12), worst, where, info
end

return M
