-- bench/zero.lua — what ZeRO (dist.ZeroAdamW, stages 1 and 2) saves and costs against AdamW after an
-- all-reduce, data parallel over the P ranks this process runs with (sp = 1: each rank its own
-- batch). For each way of reducing and stepping, rank 0 prints (it never asserts on time):
--   state MiB   the optimizer state each rank holds (exp_avg + exp_avg_sq: 8 bytes a parameter,
--               over P with ZeRO), and the ZeRO paper's figure for it: K * params / P, K = 8 here
--               (f32 weights are the master copy; mixed-precision Adam keeps K = 12)
--   peak MiB    the allocator's high-water mark from building the model to the last step, less
--               what was held before (largest rank); a full collection before each step, so it is
--               the live set of a step, not the collector's timing
--   step ms     a whole step (forward, backward, reduction, clip, optimizer), median over reps
--   after ms    the part after backward: the reduction left to wait for, the norm, the update and
--               (ZeRO) the all-gather; median
--   MiB sent    bytes each rank sent per step (uly.dist.stats(); the ring all-reduce moves
--               2 (P-1)/P of the gradient, reduce-scatter + all-gather the same)
-- Ways: adamw (dist.all_reduce_grads after backward), adamw+overlap (dist.grad_sync), zero
-- (ZeroAdamW reduce-scatters after backward), zero+overlap (opt:grad_sync()).
--
-- Run bench/zero.sh (each way in a process of its own: when the package's collector runs depends
-- on what the process did before, so peaks are comparable only between fresh processes), or
--   mpirun --oversubscribe --bind-to none --mca mpi_yield_when_idle 1 -np P \
--     bin/ulysses bench/zero.lua [--ways adamw,zero] [--model gpt|llama] [--layers 6] [--dim 384]
--     [--seq 128] [--batch 2] [--reps 5] [--threads T] [--device cpu|cuda] [--header 0]
local uly = require 'ulysses'
local util = require 'bench.util'
local dist = uly.dist

local cfg = { model = 'gpt', layers = 6, dim = 384, seq = 128, batch = 2, reps = 5, threads = 0, device = 'cpu',
              vocab = 8192, ways = 'adamw,adamw+overlap,zero,zero+overlap', header = 1 }
local i = 1
while i <= #arg do
  local k = arg[i]:match('^%-%-(.+)$')
  if not k or cfg[k] == nil or arg[i + 1] == nil then
    error('usage: bench/zero.lua [--ways adamw,adamw+overlap,zero,zero+overlap] [--model gpt|llama] [--layers N] '
          .. '[--dim N] [--seq N] [--batch N] [--reps N] [--threads N] [--device cpu|cuda] [--vocab N] [--header 0|1]; '
          .. 'got ' .. tostring(arg[i]), 0)
  end
  cfg[k] = type(cfg[k]) == 'number' and assert(tonumber(arg[i + 1]), k .. ' must be a number') or arg[i + 1]
  i = i + 2
end

local g = dist.init { sp = 1 }
local P = g.world
if cfg.threads > 0 then uly.set_num_threads(cfg.threads) elseif P > 1 then uly.set_num_threads(1) end
local Model = require('models.' .. cfg.model)
local function mib(b) return b / 2 ^ 20 end

local function build()
  uly.manual_seed(1)
  local m = Model { preset = 'tiny', layers = cfg.layers, dim = cfg.dim, heads = math.max(1, math.floor(cfg.dim / 64)),
                    hidden = cfg.model == 'llama' and math.floor(8 * cfg.dim / 3) or nil, seq = cfg.seq, vocab = cfg.vocab }
  if cfg.device ~= 'cpu' then m:to(cfg.device) end
  return m
end

local function batch(step)
  math.randomseed(1000 * g.rank + step)
  local x, y = {}, {}
  for b = 1, cfg.batch do
    x[b], y[b] = {}, {}
    for t = 1, cfg.seq do x[b][t] = math.random(0, cfg.vocab - 1); y[b][t] = math.random(0, cfg.vocab - 1) end
  end
  return uly.tensor(x, { dtype = 'i32' }):to(cfg.device), uly.tensor(y, { dtype = 'i32' }):to(cfg.device)
end

local function sent_bytes()
  local total = 0
  for _, s in pairs(dist.stats()) do total = total + s.sent end
  return total
end

local function slowest(x)   -- the largest value over the ranks
  local t = uly.tensor({ x }, { dtype = 'f64' })
  g.world_group:all_reduce_(t, 'max')
  return t:item()
end

local function run(way)
  -- what earlier ways left (compiled traces, replay closures) freed, and not counted
  jit.flush()
  local held
  repeat
    held = uly.memory(cfg.device).allocated
    collectgarbage('collect'); collectgarbage('collect')
  until uly.memory(cfg.device).allocated == held
  local base = held
  uly.reset_peak_memory(cfg.device)
  local m = build()
  local params = m:parameters()
  local hyper = { lr = 1e-4, weight_decay = 0.1 }
  local zero = way:find('zero', 1, true) ~= nil
  local overlap = way:find('overlap', 1, true) ~= nil
  local opt = zero and dist.ZeroAdamW(params, g.world_group, hyper) or uly.optim.AdamW(params, hyper)
  local sync = overlap and (zero and opt:grad_sync() or dist.grad_sync(params, g.world_group)) or nil
  local steps, afters, bytes = {}, {}, {}
  for step = 0, cfg.reps do   -- step 0 warms up (first-touch pages, plans)
    local x, y = batch(step)
    collectgarbage('collect')   -- the last step's dead tensors go now, not when the collector decides
    g.world_group:barrier()
    local b0 = sent_bytes()
    local t0 = uly.clock()
    opt:zero_grad()
    m:loss(x, y, { grad_sync = sync }):backward()
    local t1 = uly.clock()
    if sync then sync:finish() elseif not zero then dist.all_reduce_grads(params, g.world_group) end
    if zero then opt:clip_grad_norm(1.0) else uly.optim.clip_grad_norm(opt, 1.0) end
    opt:step()
    uly.synchronize(cfg.device)
    local t2 = uly.clock()
    if step > 0 then
      steps[#steps + 1] = slowest(t2 - t0)
      afters[#afters + 1] = slowest(t2 - t1)
      bytes[#bytes + 1] = sent_bytes() - b0
    end
  end
  local n = 0
  for _, p in ipairs(params) do n = n + p:numel() end
  local state = zero and opt:shard_info().state_bytes or 8 * n
  local peak = slowest(uly.memory(cfg.device).peak - base)
  return { n = n, state = slowest(state), peak = peak, step = util.median(steps), after = util.median(afters),
           sent = util.median(bytes) }
end

local ways = {}
for w in cfg.ways:gmatch('[^,]+') do
  if w ~= 'adamw' and w ~= 'adamw+overlap' and w ~= 'zero' and w ~= 'zero+overlap' then
    error("--ways: each of adamw, adamw+overlap, zero, zero+overlap; got '" .. w .. "'", 0)
  end
  ways[#ways + 1] = w
end
local rows = {}
for _, w in ipairs(ways) do rows[w] = run(w) end
if g.rank == 0 then
  local n = rows[ways[1]].n
  if cfg.header ~= 0 then
    print(string.format('bench/zero.lua: %s, %d layers, dim %d, vocab %d: %.2f M parameters; batch %d x seq %d per rank; '
                        .. '%d ranks (data parallel), %d threads each, device %s; %d reps', cfg.model, cfg.layers,
                        cfg.dim, cfg.vocab, n / 1e6, cfg.batch, cfg.seq, P, uly.get_num_threads(), cfg.device, cfg.reps))
    print(string.format('all-reduce formula: 2 (P-1)/P x %.2f MiB of f32 gradient = %.2f MiB sent per rank per step',
                        mib(4 * n), mib(2 * (P - 1) / P * 4 * n)))
    print(string.format('%-14s %10s %12s %10s %9s %9s %9s', 'way', 'state MiB', 'paper MiB', 'peak MiB', 'step ms',
                        'after ms', 'MiB sent'))
  end
  for _, w in ipairs(ways) do
    local r = rows[w]
    local paper = w:find('zero', 1, true) and 8 * n / P or 8 * n
    print(string.format('%-14s %10.2f %12.2f %10.1f %9.1f %9.1f %9.2f', w, mib(r.state), mib(paper), mib(r.peak),
                        1e3 * r.step, 1e3 * r.after, mib(r.sent)))
  end
end
