-- bench/train.lua — training-step throughput of the models, side by side with PyTorch.
--
-- For each shape (T x B) it builds the model, runs `warmup` steps, then times `steps` steps of
-- forward (model:loss), backward and AdamW, and prints the median step with its split, tokens/s,
-- achieved model GFLOP/s (FLOPs per token = 6 N_matmul + 12 L C T, attention counted over the full
-- T x T as in ../shared/ENVIRONMENT.md), MFU against the FMA peak (measured at start by
-- uly.cpu_peak_flops: ~217 GFLOP/s per thread on an AVX-512 core) and the allocator's peak
-- memory. With --torch it then runs the PyTorch peer
-- (../shared/peers/torch_gpt_bench.py, same model, shapes and thread count) and prints the ratio
-- from this one run; --torch_alloc jemalloc runs it on jemalloc keeping freed memory (LD_PRELOAD,
-- package libjemalloc2: the "tuned PyTorch" of ../shared/ENVIRONMENT.md, whose glibc malloc
-- otherwise gives large blocks back and faults them in again every step). --checkpoint 0,1,2
-- times each shape once per activation-checkpointing mode (0 none, 1 every block recomputed in
-- backward, 2 all but attention; with --tile R the MLP and loss tiled), side by side from one
-- run. --activations f32,bf16 times each shape with f32 and with bf16 activations
-- (uly.activation_dtype; its column 'act'), side by side likewise; --precision f32,bf16 with f32
-- and with bf16 matmuls (uly.matmul_precision: on the CPU's AMX tiles or with AVX512-BF16 where
-- it has them, uly.cpu_bf16_gemm(); column 'prec'); with bf16 first, --torch runs the peer under torch.autocast in
-- bf16 (bench/peers/torch_autocast.py). It never asserts on time.
--
-- Run:  OPENBLAS_CORETYPE=SkylakeX bin/ulysses bench/train.lua [--shapes 256x32,1024x8,4096x2]
--         [--model gpt|llama] [--preset small] [--steps 10] [--warmup 3] [--threads 2] [--torch]
--         [--torch_alloc jemalloc] [--checkpoint 0[,1,2]] [--tile R] [--activations f32[,bf16]]
--         [--precision f32[,bf16]]
local uly = require 'ulysses'

local opts = { shapes = '256x32,1024x8,4096x2', model = 'gpt', preset = 'small', steps = 10, warmup = 3,
               threads = 2, torch = false, torch_alloc = '', corpus = '', checkpoint = '0', tile = 0, activations = 'f32',
               precision = 'f32' }
do
  local i = 1
  while i <= #arg do
    local k = arg[i]:match('^%-%-([%w_]+)$')
    if k == 'torch' then opts.torch = true; i = i + 1
    elseif k and opts[k] ~= nil then
      opts[k] = type(opts[k]) == 'number' and tonumber(arg[i + 1]) or arg[i + 1]; i = i + 2
    else
      io.stderr:write('usage: bin/ulysses bench/train.lua [--shapes TxB,...] [--model gpt|llama] [--preset P] '
                      .. '[--steps N] [--warmup N] [--threads N] [--torch] [--torch_alloc jemalloc] [--corpus FILE] '
                      .. '[--checkpoint 0,1,2] [--tile R] [--activations f32,bf16] [--precision f32,bf16]\n')
      os.exit(2, true)
    end
  end
end
-- a bad value: what was wrong, on stderr, exit 2 (before any work)
local function fail(msg)
  io.stderr:write('bench/train.lua: ', msg, '\n')
  os.exit(2, true)
end
local shapes = {}   -- { T, B, 'TxB' }
for shape in opts.shapes:gmatch('[^,]+') do
  local T, B = shape:match('^(%d+)x(%d+)$')
  if not T then fail('bad shape ' .. shape .. ' (want TxB)') end
  shapes[#shapes + 1] = { tonumber(T), tonumber(B), shape }
end
local CHECKPOINT = { ['0'] = false, ['1'] = true, ['2'] = 'except_attention' }
local acts = {}
for a in tostring(opts.activations):gmatch('[^,]+') do
  if a ~= 'f32' and a ~= 'bf16' then fail('bad --activations ' .. a .. ' (want f32 or bf16)') end
  acts[#acts + 1] = a
end
local precs = {}
for p in tostring(opts.precision):gmatch('[^,]+') do
  if p ~= 'f32' and p ~= 'bf16' then fail('bad --precision ' .. p .. ' (want f32 or bf16)') end
  precs[#precs + 1] = p
end
local modes = {}
for m in tostring(opts.checkpoint):gmatch('[^,]+') do
  if CHECKPOINT[m] == nil then fail('bad --checkpoint ' .. m .. ' (want 0, 1 or 2)') end
  modes[#modes + 1] = m
end
-- --torch_alloc jemalloc: the peer's environment prefix (and --torch implied)
local JEMALLOC = '/usr/lib/x86_64-linux-gnu/libjemalloc.so.2'
local peer_alloc = ''
if opts.torch_alloc ~= '' then
  if opts.torch_alloc ~= 'jemalloc' then fail('--torch_alloc ' .. tostring(opts.torch_alloc) .. ': unknown (known: jemalloc)') end
  local f = io.open(JEMALLOC, 'rb')
  if not f then fail('--torch_alloc jemalloc: ' .. JEMALLOC .. ' not found (apt-get install libjemalloc2)') end
  f:close()
  peer_alloc = 'LD_PRELOAD=' .. JEMALLOC .. ' MALLOC_CONF=dirty_decay_ms:-1,muzzy_decay_ms:-1 '
  opts.torch = true
end
uly.set_num_threads(opts.threads)
local Model = require('models.' .. opts.model)

local median = require('bench.util').median

local function random_tokens(B, T, V)
  local t = uly.empty(B, T, { dtype = 'i32' })
  local p = t:data()
  for i = 0, B * T - 1 do p[i] = math.random(0, V - 1) end
  return t
end

local peak = uly.cpu_peak_flops(opts.threads)   -- measured: this CPU's f32 FMA peak over the threads
-- bf16 rows: MFU against the bf16 GEMM engine's peak (AMX tiles or AVX512-BF16), measured likewise,
-- or the f32 peak where that is higher (VDPBF16PS measured half of it on an Intel VM) or none runs
local bf16_peak = math.max(uly.cpu_bf16_peak_flops(opts.threads), peak)

local function bench_shape(T, B, mode, act, prec)
  uly.activation_dtype(act)
  uly.matmul_precision(prec)
  uly.manual_seed(0)
  math.randomseed(0)
  local model = Model { preset = opts.preset, seq = T, checkpoint = CHECKPOINT[mode],
                        tile = opts.tile > 0 and opts.tile or nil }
  local opt = uly.optim.AdamW(model:parameters(), { lr = 3e-4, betas = { 0.9, 0.95 }, weight_decay = 0.1 })
  local V = model.config.vocab
  uly.reset_peak_memory()
  local tt, tf, tb, to = {}, {}, {}, {}
  for i = 1, opts.warmup + opts.steps do
    local x, y = random_tokens(B, T, V), random_tokens(B, T, V)
    local t0 = uly.clock()
    local loss = model:loss(x, y)
    loss:item()
    local t1 = uly.clock()
    opt:zero_grad()
    loss:backward()
    local t2 = uly.clock()
    opt:step()
    local t3 = uly.clock()
    loss = nil
    if i > opts.warmup then
      tt[#tt + 1], tf[#tf + 1], tb[#tb + 1], to[#to + 1] = t3 - t0, t1 - t0, t2 - t1, t3 - t2
    end
  end
  uly.activation_dtype('f32')
  uly.matmul_precision('f32')
  local med = median(tt)
  local fpt = model:flops_per_token(T)
  local tps = B * T / med
  return { T = T, B = B, step_ms = med * 1e3, fwd_ms = median(tf) * 1e3, bwd_ms = median(tb) * 1e3,
           opt_ms = median(to) * 1e3, tps = tps, gflops = fpt * tps / 1e9,
           mfu = fpt * tps / (prec == 'bf16' and bf16_peak or peak), peak_mib = uly.memory().peak / 2 ^ 20,
           params = model:num_parameters(), fpt = fpt }
end

local model_cfg = Model { preset = opts.preset, seq = 8 }.config

local function run_torch(T, B)
  local script = (require 'ulysses.ffi').root .. '/../shared/peers/torch_gpt_bench.py'
  local f = io.open(script, 'rb')
  if not f then   -- the peers' scripts sit beside the repository, not in it
    return nil, 'no PyTorch peer: ' .. script .. ' is not there (--torch runs the peer script of ../shared/peers/, '
      .. 'a checkout beside this repository)'
  end
  f:close()
  local corpus = opts.corpus
  if corpus == '' then
    for _, c in ipairs({ 'data/raw/kjv.txt', '/usr/share/common-licenses/GPL-3' }) do
      local f = io.open(c, 'rb')
      if f then f:close(); corpus = c; break end
    end
  end
  local c = model_cfg
  -- bf16 matmuls first in --precision: the peer under torch.autocast (bench/peers/torch_autocast.py)
  if precs[1] == 'bf16' then
    script = (require 'ulysses.ffi').root .. '/bench/peers/torch_autocast.py ' .. script
  end
  local cmd = string.format(require('bench.util').peer_env() .. peer_alloc .. 'CORPUS=%s /usr/bin/python3 %s %d %d %d %d %d %d %d %d 2>&1', corpus, script, T, B,
                            opts.steps, opts.warmup, c.layers, c.heads, c.dim, c.vocab)
  local p = io.popen(cmd)
  local out = p:read('*a')
  p:close()
  local line = out:match('RESULT[^\n]*')
  if not line then return nil, out:sub(-400) end
  return { tps = tonumber(line:match('tokens/s=([%d%.]+)')), gflops = tonumber(line:match('GFLOP/s=([%d%.]+)')),
           step_ms = tonumber(line:match('median_step_ms=([%d%.]+)')), rss = tonumber(line:match('peak_rss_MB=(%d+)')),
           version = line:match('torch=(%S+)'), autocast = out:find('autocast: cpu bfloat16', 1, true) ~= nil }
end

local c = model_cfg
print(string.format('bench/train.lua: %s preset %s (L%d H%d C%d V%d), %d threads, BLAS %s, %d warm-up + %d timed steps, AdamW',
                    opts.model, opts.preset, c.layers, c.heads, c.dim, c.vocab, opts.threads, uly.blas_corename(),
                    opts.warmup, opts.steps))
print('command: OPENBLAS_CORETYPE=' .. (os.getenv('OPENBLAS_CORETYPE') or '(unset)') .. ' bin/ulysses bench/train.lua '
      .. table.concat(arg, ' '))
if precs[#precs] == 'bf16' or precs[1] == 'bf16' then
  print('bf16 GEMM engine: ' .. uly.cpu_bf16_gemm() .. (bf16_peak > peak and
        string.format('; MFU of bf16 rows vs %.0f GFLOP/s (its bf16 peak of %d threads, measured at start)',
                      bf16_peak / 1e9, opts.threads) or ''))
end
print('FLOPs/token = 6 N_matmul + 12 L C T (attention over the full T x T); MFU vs '
      .. string.format('%.0f GFLOP/s (the f32 FMA peak of %d threads, measured at start)', peak / 1e9, opts.threads))
print()
print(string.format('%-11s %5s %10s %9s %9s %9s %10s %9s %6s %10s %5s %5s', 'T x B', 'ckpt', 'step ms', 'fwd ms', 'bwd ms',
                    'opt ms', 'tok/s', 'GFLOP/s', 'MFU', 'peak MiB', 'act', 'prec'))
local rows = {}
for _, s in ipairs(shapes) do
  local T, B, shape = unpack(s)
  for _, mode in ipairs(modes) do
    for _, act in ipairs(acts) do
      for _, prec in ipairs(precs) do
        local r = bench_shape(T, B, mode, act, prec)
        if mode == modes[1] and act == acts[1] and prec == precs[1] then rows[#rows + 1] = r end   -- vs PyTorch: the first
        print(string.format('%-11s %5s %10.1f %9.1f %9.1f %9.1f %10.0f %9.1f %5.1f%% %10.0f %5s %5s', shape, mode,
                            r.step_ms, r.fwd_ms, r.bwd_ms, r.opt_ms, r.tps, r.gflops, 100 * r.mfu, r.peak_mib, act, prec))
        io.stdout:flush()
        collectgarbage()
        uly.empty_cache()
      end
    end
  end
end

if opts.torch then
  print()
  print(string.format('%-11s %12s %12s %10s %12s %8s', 'T x B', 'ours tok/s', 'torch tok/s', 'ratio', 'torch GF/s', 'RSS MB'))
  for _, r in ipairs(rows) do
    local t, err = run_torch(r.T, r.B)
    if not t then
      print(string.format('%dx%d: PyTorch run failed: %s', r.T, r.B, err))
    else
      print(string.format('%-11s %12.0f %12.0f %9.2fx %12.1f %8d  (torch %s%s)', r.T .. 'x' .. r.B, r.tps, t.tps,
                          r.tps / t.tps, t.gflops, t.rss or 0, t.version, (peer_alloc ~= '' and ', jemalloc' or '')
                          .. (t.autocast and ', autocast bf16' or '')))
    end
    io.stdout:flush()
  end
end
