-- bench/attention.lua — memory-efficient attention (uly.flash_attention) against the reference
-- kernel (uly.attention, materialised probabilities) and PyTorch's CPU attention, by N.
--
-- Prints (never asserts on time): the command, the OpenBLAS kernel family, threads; then per N
-- forward and backward wall time, the allocator's peak for forward + backward (bytes held by
-- tensors above what was live before; the inputs are not counted), achieved GFLOP/s and its
-- ratio to the machine's sgemm throughput measured in the same run (a square 2048^3 sgemm and
-- one shaped like the attention scores, [N, D] x [D, N]), for
--   dense causal   flash, reference (while its probabilities B H N^2 4 bytes stay <= 4 GB), and
--                  PyTorch (/work/shared/peers/torch_attn_bench.py, manual variant: it
--                  materialises T x T like ours) when /usr/bin/python3 can import torch;
--   sliding window flash with causal + window (512 keys back), up to longer N: linear in N;
--   with --bf16, dense causal flash in bf16 precision too (uly.matmul_precision('bf16'): its
--                  tile products on AMX tiles where the CPU has them, uly.cpu_amx()).
-- FLOPs counted: dense forward 4 N^2 D H (two N x N x D matmuls), halved for causal; a window
-- counts 4 N (w + 1) D H, minus the triangle at the start; backward 2.5x forward (5 matmuls;
-- ours recomputes 2 more for determinism, not counted).
--
-- Each time is the best of 2-3 runs: the first touch of fresh pages is slow on these machines
-- (~12 us per 4 KiB page), and the caching allocator hands the same blocks back afterwards.
--
-- Run:  bin/ulysses bench/attention.lua [--max N] [--window-max N] [--heads H] [--dim D]
--       [--window W] [--no-torch] [--bf16]
local uly = require 'ulysses'

local args = arg or {}
local opts = { max = 16384, window_max = 131072, heads = 4, dim = 64, window = 512, torch = true, bf16 = false }
do
  local i = 1
  local keys = { ['--max'] = 'max', ['--window-max'] = 'window_max', ['--heads'] = 'heads', ['--dim'] = 'dim',
                 ['--window'] = 'window' }
  while i <= #args do
    local a = args[i]
    if keys[a] then
      opts[keys[a]] = tonumber(args[i + 1]) or error('bench/attention.lua: ' .. a .. ' needs a number', 0)
      i = i + 2
    elseif a == '--no-torch' then opts.torch = false; i = i + 1
    elseif a == '--bf16' then opts.bf16 = true; i = i + 1
    elseif a == '-h' or a == '--help' then
      print('usage: bin/ulysses bench/attention.lua [--max N] [--window-max N] [--heads H] [--dim D] [--window W] [--no-torch] [--bf16]')
      return
    else error('bench/attention.lua: unknown argument ' .. tostring(a) .. ' (try --help)', 0) end
  end
end
local H, D, W = opts.heads, opts.dim, opts.window
local REF_LIMIT = 4e9 -- bytes of reference probabilities

print(string.format('command: %s bench/attention.lua %s', arg and arg[-1] or 'luajit', table.concat(args, ' ')))
print(string.format('blas core: %s   threads: %d   OPENBLAS_CORETYPE=%s   B 1, H %d, D %d', uly.blas_corename(),
                    uly.get_num_threads(), os.getenv('OPENBLAS_CORETYPE') or '(unset)', H, D))
if opts.bf16 then print('bf16 precision on AMX tiles: ' .. uly.cpu_amx()) end

---------------------------------------------------------------- sgemm throughput
local function gemm_rate(M, N, K)
  local a, b = uly.randn(M, K), uly.randn(K, N)
  local best = math.huge
  for _ = 1, 4 do
    collectgarbage()
    local t0 = uly.clock()
    local c = a:matmul(b)
    best = math.min(best, uly.clock() - t0)
    c:free()
  end
  return 2 * M * N * K / best / 1e9
end
local GEMM = gemm_rate(2048, 2048, 2048)
print(string.format('sgemm 2048^3: %.1f GFLOP/s;  scores-shaped [4096, %d] x [%d, 4096]: %.1f GFLOP/s', GEMM, D, D,
                    gemm_rate(4096, 4096, D)))

---------------------------------------------------------------- one measurement
local function run(N, fn, reps)
  local q = uly.randn(1, N, H, D):requires_grad_(true)
  local k = uly.randn(1, N, H, D):requires_grad_(true)
  local v = uly.randn(1, N, H, D):requires_grad_(true)
  local g = uly.randn(1, N, H, D)
  local best_f, best_b, peak = math.huge, math.huge, 0
  for _ = 1, reps do
    q:zero_grad(true); k:zero_grad(true); v:zero_grad(true)
    collectgarbage(); collectgarbage()
    local base = uly.memory().allocated
    uly.reset_peak_memory()
    local t0 = uly.clock()
    local ok, y = pcall(fn, q, k, v)
    if not ok then return nil, tostring(y) end
    local t1 = uly.clock()
    y:backward(g)
    local t2 = uly.clock()
    peak = math.max(peak, uly.memory().peak - base)
    best_f, best_b = math.min(best_f, t1 - t0), math.min(best_b, t2 - t1)
    y = nil
  end
  return { f = best_f, b = best_b, peak = peak }
end

local function torch_ok()
  if not opts.torch then return false end
  local p = io.popen('/usr/bin/python3 -c "import torch" 2>&1; echo rc=$?')
  local out = p:read('*a')
  p:close()
  return out:find('rc=0', 1, true) ~= nil
end
local TORCH = torch_ok()
local TORCH_SCRIPT = '/work/shared/peers/torch_attn_bench.py'
local function torch_run(N)
  local cmd = string.format(require('bench.util').peer_env() .. '/usr/bin/python3 %s %d %d manual %d %d 2>&1', TORCH_SCRIPT, N, N <= 4096 and 3 or 1, H, D)
  local p = io.popen(cmd)
  local out = p:read('*a')
  p:close()
  local ms, rss = out:match('fwd%+bwd ([%d%.]+) ms.-delta ([%d%.%-]+) MB')
  return ms and tonumber(ms) / 1e3, rss and tonumber(rss), cmd
end

local function mb(x) return x / 2 ^ 20 end
local function flops_causal(N) return 4 * N * N * D * H / 2 end
local function flops_window(N)
  local visible = 0 -- keys seen per query, summed: (w + 1) each once past the start
  visible = N * (W + 1) - (W * (W + 1)) / 2
  if N <= W then visible = N * (N + 1) / 2 end
  return 4 * visible * D * H
end

local function row(label, N, r, fl, extra)
  if not r then
    print(string.format('%-10s %7d  %s', label, N, extra or 'skipped'))
    return
  end
  local gf = 3.5 * fl / (r.f + r.b) / 1e9
  print(string.format('%-10s %7d %9.3f %9.3f %9.3f %9.1f %8.1f %6.2f%s', label, N, r.f, r.b, r.f + r.b, mb(r.peak), gf,
                      GEMM / gf, extra or ''))
end

local header = string.format('%-10s %7s %9s %9s %9s %9s %8s %6s', 'kernel', 'N', 'fwd s', 'bwd s', 'total s',
                             'peak MiB', 'GFLOP/s', 'gemm/x')

print('\n== dense causal (GFLOP/s over 3.5 * 2 N^2 D H; gemm/x = sgemm 2048^3 rate / ours) ==')
print(header)
local N = 1024
while N <= opts.max do
  local reps = N <= 4096 and 3 or 2 -- the best of reps: the first run also faults in fresh pages
  local fr = run(N, function(q, k, v) return uly.flash_attention(q, k, v, { causal = true }) end, reps)
  row('flash', N, fr, flops_causal(N))
  if opts.bf16 then
    local prev = uly.matmul_precision('bf16')
    local br = run(N, function(q, k, v) return uly.flash_attention(q, k, v, { causal = true }) end, reps)
    uly.matmul_precision(prev)
    row('flash bf16', N, br, flops_causal(N), string.format('   %.2fx the f32 flash\'s speed', (fr.f + fr.b) / (br.f + br.b)))
  end
  local rr
  if H * N * N * 4 <= REF_LIMIT then
    rr = run(N, function(q, k, v) return uly.attention(q, k, v, { causal = true }) end, reps)
    row('reference', N, rr, flops_causal(N), rr and string.format('   flash %.2fx faster, %.1fx less memory',
                                                                   (rr.f + rr.b) / (fr.f + fr.b), rr.peak / fr.peak))
  else
    row('reference', N, nil, 0, string.format('skipped: probabilities would take %.1f GB', H * N * N * 4 / 1e9))
  end
  if TORCH and H * N * N * 4 <= REF_LIMIT then
    local t, rss, cmd = torch_run(N)
    if t then
      print(string.format('%-10s %7d %29.3f %9.1f %8.1f %6.2f   flash %.2fx faster (torch: %s; peak = RSS delta)',
                          'pytorch', N, t, rss or 0, 3.5 * flops_causal(N) / t / 1e9,
                          GEMM / (3.5 * flops_causal(N) / t / 1e9), t / (fr.f + fr.b), cmd:gsub(' 2>&1', '')))
    else
      print(string.format('%-10s %7d  failed: %s', 'pytorch', N, cmd))
    end
  end
  N = N * 2
end

print(string.format('\n== sliding window, causal, %d keys back (GFLOP/s over the visible band) ==', W))
print(header .. '   time / N')
N = 1024
local first
while N <= opts.window_max do
  local fr = run(N, function(q, k, v) return uly.flash_attention(q, k, v, { causal = true, window = W }) end,
                 N <= 8192 and 3 or 2)
  local per = (fr.f + fr.b) / N * 1e6
  first = first or per
  row('flash', N, fr, flops_window(N), string.format('   %.2f us/token (x%.2f of N=1024)', per, per / first))
  N = N * 2
end

-- the machine is shared: measure sgemm again, so a ratio can be judged against both readings
print(string.format('\nsgemm 2048^3 again at the end: %.1f GFLOP/s (start: %.1f)', gemm_rate(2048, 2048, 2048), GEMM))
