-- spec/plan_measure.lua — one real training step measured against the memory planner's replay
-- of it (tools/plan.lua), for spec/plan_spec.lua (CPU, the simulated device, #mpi ranks) and
-- spec/device_spec.lua (the CUDA kernels, on the emulator or a GPU):
--   measure(pc, grid) -> measured pool peak (bytes, counted from before the model existed),
--                        the planner's estimate, and the CUDA kernels' temporaries peak (or nil)
--   collect(device)     frees what earlier specs left (dropped tensors, replay closures)
local uly = require 'ulysses'
local helpers = require 'helpers'
local plan = require 'tools.plan'
local T = require 'ulysses.tensor'

local ids = helpers.token_ids
local M = {}

local function upvalue(f, name)
  for i = 1, 200 do
    local n, v = debug.getupvalue(f, i)
    if not n then return nil end
    if n == name then return v end
  end
end

-- the collector threshold of lua/ulysses/tensor.lua's wrap (the planner replays it)
local function gc_next()
  local f = upvalue(T.wrap, 'collect_if_grown')
  local v = f and upvalue(f, 'gc_next')
  assert(type(v) == 'number', 'plan_spec: cannot read the collector threshold of ulysses.tensor wrap')
  return v
end

-- free what earlier specs left: dropped tensors, and the replay closures of checkpointed or
-- tiled segments whose graphs are gone (they hold their inputs until swept)
local function held_bytes(dev)
  return uly.memory().allocated + ((dev and dev ~= 'cpu') and uly.memory(dev).allocated or 0)
end
local function collect(dev)
  local held
  repeat
    held = held_bytes(dev)
    collectgarbage(); collectgarbage()
    uly.nn.checkpoint_pending()
  until held_bytes(dev) == held
end

-- build the model and AdamW (pc.zero: dist.ZeroAdamW over the world), then one step (pc.steps)
-- as train.lua runs it (pc.overlap: the reduction during backward, as its --overlap 1); returns
-- the measured peak and the
-- planner's estimate, both counted from the bytes held before the model existed
-- pc.device = 'cuda': the model, its step and the measured pool are the device's (the simulation
-- here: device pools, the CPU's kernels); the collector still counts host and device bytes
local function measure(pc, grid)
  local dev = pc.device or 'cpu'
  collect(dev)
  local base = uly.memory(dev).allocated
  local Model = require(pc.model == 'gpt' and 'models.gpt' or 'models.llama')
  local mc = { preset = pc.preset, seq = pc.seq, checkpoint = pc.checkpoint, tile = pc.tile, window = pc.window,
               attention = pc.attention, sp = grid and pc.sp or nil, dim = pc.dim, heads = pc.heads,
               kv_heads = pc.kv_heads, hidden = pc.hidden, layers = pc.layers, vocab = pc.vocab }
  local m = Model(mc):to(dev)
  local opt = pc.zero and uly.dist.ZeroAdamW(m:parameters(), grid.world_group) or uly.optim.AdamW(m:parameters())
  local B, N, P = pc.batch or 1, pc.seq, pc.sp or 1
  collect(dev)
  local threshold = gc_next()
  local outside = held_bytes(dev) - uly.memory(dev).allocated + base   -- held, but not the step's pool
  -- Two things free dropped tensors earlier than the package's growth trigger, by amounts that
  -- vary run to run: LuaJIT's incremental collector (paced by unrelated Lua allocations, e.g.
  -- busted's timing strings) and compiled traces, which decide whether a dead local still holds
  -- a tensor (LuaJIT seeds its trace penalties randomly). Either can only lower the real peak
  -- (the one place a trace kept temporaries alive, nn.checkpoint's wrappers around their
  -- collections, always runs interpreted: spec/recompute_spec.lua).
  -- Measure the step with both out of the way, so exactly what the planner models happens (its
  -- estimate is the upper bound; the explicit full collections still run).
  collectgarbage('stop')
  jit.flush()
  jit.off()
  uly.reset_peak_memory(dev)
  if pc.precision then uly.matmul_precision(pc.precision) end
  if pc.activations then uly.activation_dtype(pc.activations) end
  local cuda_kernels = pc.kernels == 'cuda'
  if cuda_kernels then uly.synchronize(dev); assert(uly.cuda.temporaries_peak(true)) end
  local lo, n = 0, N
  if grid then lo, n = uly.dist.split(N, P, grid.sp_group:rank()) end
  local x, y = ids(B, n, m.config.vocab):to(dev), ids(B, n, m.config.vocab):to(dev)
  local loss
  local sync = pc.overlap and (pc.zero and opt:grad_sync() or uly.dist.grad_sync(m:parameters(), grid.world_group))
  for _ = 1, pc.steps or 1 do
    opt:zero_grad()
    loss = m:loss(x, y, { pos = lo, seq_total = N, grad_sync = sync or nil })
    loss:backward()
    if sync then sync:finish()
    elseif pc.zero then opt:reduce_grads()
    elseif grid then uly.dist.all_reduce_grads(m:parameters(), grid.world_group) end
    opt:step()
  end
  uly.matmul_precision('f32')
  uly.activation_dtype('f32')
  local temporaries = cuda_kernels and assert(uly.cuda.temporaries_peak()) or nil
  local peak = uly.memory(dev).peak - base
  jit.on()
  collectgarbage('restart')
  local cfg = {}
  for k, v in pairs(pc) do cfg[k] = v end
  cfg.gc_next = threshold - outside
  cfg.world = grid and grid.world or 1
  if dev ~= 'cpu' then cfg.device_memory = uly.memory(dev).limit end
  local est = plan.estimate(cfg)
  loss, x, y, m, opt, sync = nil, nil, nil, nil, nil, nil
  collect(dev)
  return peak, est, temporaries
end
M.measure = measure
M.collect = collect

return M
