-- bench/matmul.lua — what matmul and tiny ops cost through ulysses, next to the raw calls.
--
-- Measures (and prints as tables; it never asserts on time):
--  1. which OpenBLAS kernel family runs (uly.blas_corename()), the thread count and the command;
--  2. matmul GFLOP/s of our op (a:matmul(b), and forward+backward through autograd with a
--     preallocated output gradient: out:backward(g)) against cblas_sgemm called directly through
--     the LuaJIT FFI on the data pointers of the same tensors, for the shapes of a small GPT
--     (C = 256, 8192 tokens), squares 512/1024/2048 and transposed operands (views, no copies);
--     forward counts 2*M*N*K flops, forward+backward 3x that (backward is two GEMMs);
--  3. bf16 precision (uly.matmul_precision('bf16'): on the AMX tiles or with AVX512-BF16 where
--     the CPU has them, uly.cpu_bf16_gemm(), else OpenBLAS on rounded copies) at the GPT shapes, forward: f32 operands
--     with an f32 result, and bf16 operands with a bf16 result (bf16 activations), next to our
--     f32 matmul (OpenBLAS, over our threads), with the largest difference from the f32 product
--     relative to its largest value (bf16 operands: ~2^-8);
--  4. per-call overhead in microseconds of tiny ops (a + b, matmul, sum, view) from Lua and as
--     raw C calls through the FFI, with and without requires_grad, and the memory peak.
-- Each number is the median of several timed repetitions (after warm-up) sized to ~0.3 s per
-- measurement; ours and raw repetitions alternate so drift affects both alike.
--
-- Run:  bin/ulysses bench/matmul.lua [--threads N] [--seconds S] [--only bf16]
--       OPENBLAS_CORETYPE=Haswell  bin/ulysses bench/matmul.lua     (AVX2 kernels)
--       OPENBLAS_CORETYPE=SkylakeX bin/ulysses bench/matmul.lua     (AVX-512 kernels)
local ffi = require 'ffi'
local uly = require 'ulysses'
local C = uly.C

---------------------------------------------------------------- options
local args = arg or {}
local opts = { threads = nil, seconds = 0.3, only = nil }
do
  local i = 1
  while i <= #args do
    local a = args[i]
    if a == '--threads' then opts.threads = tonumber(args[i + 1]); i = i + 2
    elseif a == '--seconds' then opts.seconds = tonumber(args[i + 1]); i = i + 2
    elseif a == '--only' then
      opts.only = args[i + 1]; i = i + 2
      if opts.only ~= 'bf16' then error('bench/matmul.lua: --only takes bf16 (the bf16 table alone)', 0) end
    elseif a == '-h' or a == '--help' then
      print('usage: bin/ulysses bench/matmul.lua [--threads N] [--seconds S per measurement, default 0.3] [--only bf16]')
      return
    else error('bench/matmul.lua: unknown argument ' .. tostring(a) .. ' (try --help)', 0) end
    if (a == '--threads' or a == '--seconds') and not opts[a:sub(3)] then
      error('bench/matmul.lua: ' .. a .. ' needs a number', 0)
    end
  end
end
if opts.threads then uly.set_num_threads(opts.threads) end

---------------------------------------------------------------- FFI: clock and raw BLAS
pcall(ffi.cdef, 'struct timespec { long tv_sec; long tv_nsec; };')
pcall(ffi.cdef, 'int clock_gettime(int, struct timespec *);')
local clock_gettime = ffi.C.clock_gettime
if not pcall(clock_gettime, 1, ffi.new('struct timespec')) then
  -- already declared with another struct (lua/ulysses/init.lua declares its own, and a second
  -- cdef does not replace it): bind the same libc symbol under a name of our own
  ffi.cdef 'int uly_bench_clock_gettime(int, struct timespec *) __asm__("clock_gettime");'
  clock_gettime = ffi.C.uly_bench_clock_gettime
end
pcall(ffi.cdef, [[
  void cblas_sgemm(int, int, int, int, int, int, float, const float*, int, const float*, int, float, float*, int);
]])
local CLOCK_MONOTONIC = 1
local RowMajor, NoTrans, Trans = 101, 111, 112

local ts = ffi.new('struct timespec')
local function now()
  clock_gettime(CLOCK_MONOTONIC, ts)
  return tonumber(ts.tv_sec) + tonumber(ts.tv_nsec) * 1e-9
end

-- cblas_sgemm from libulysses's own symbol namespace (dlsym searches its dependencies), so it is
-- the very OpenBLAS instance (kernel, thread count) that our op uses; libopenblas.so.0 otherwise
local blas, blas_from = nil, nil
if pcall(function() return C.cblas_sgemm end) then blas, blas_from = C, 'libulysses namespace'
else
  for _, name in ipairs({ 'libopenblas.so.0', 'openblas' }) do
    local ok, lib = pcall(ffi.load, name)
    if ok and pcall(function() return lib.cblas_sgemm end) then blas, blas_from = lib, name break end
  end
end
if not blas then error('bench/matmul.lua: cblas_sgemm not found in libulysses or libopenblas', 0) end
local sgemm = blas.cblas_sgemm

local function fptr(t) return ffi.cast('float *', t:data_ptr()) end

---------------------------------------------------------------- timing
local median = require('bench.util').median

local REPS_MIN, REPS_MAX = 3, 15

-- fns: list of functions f(n) that each run their operation n times. Warms each up, sizes the
-- inner count so one measurement takes ~opts.seconds, then alternates timed repetitions between
-- them; returns the median seconds per call of each, and the repetitions used.
local function measure(fns)
  local est, reps = {}, REPS_MIN
  for k, f in ipairs(fns) do
    f(1) -- cold call (first-touch pages, BLAS buffers, traces)
    local n, t0, spent = 1, now(), 0
    f(1)
    local calls = 1
    spent = now() - t0
    while spent < 0.02 do -- more warm-up until 20 ms, doubling
      n = n * 2
      t0 = now(); f(n); spent = spent + (now() - t0)
      calls = calls + n
    end
    est[k] = spent / calls
  end
  local inner = {}
  for k = 1, #fns do
    local t = est[k]
    if t * REPS_MAX >= opts.seconds then
      inner[k] = 1
      reps = math.max(reps, math.min(REPS_MAX, math.ceil(opts.seconds / t)))
    else
      inner[k] = math.ceil(opts.seconds / (REPS_MAX * t))
      reps = REPS_MAX
    end
  end
  local samples = {}
  for k = 1, #fns do samples[k] = {} end
  for r = 1, reps do
    for k, f in ipairs(fns) do
      local n = inner[k]
      local t0 = now()
      f(n)
      samples[k][r] = (now() - t0) / n
    end
  end
  local out = {}
  for k = 1, #fns do out[k] = median(samples[k]) end
  return out, reps
end

---------------------------------------------------------------- header
local read_file = require('ulysses.paths').read_file

local function command_line()
  local parts = {}
  for _, v in ipairs({ 'OPENBLAS_CORETYPE', 'OPENBLAS_NUM_THREADS', 'OMP_NUM_THREADS' }) do
    local x = os.getenv(v)
    if x then parts[#parts + 1] = v .. '=' .. x end
  end
  parts[#parts + 1] = 'bin/ulysses'
  parts[#parts + 1] = args[0] or 'bench/matmul.lua'
  for i = 1, #args do parts[#parts + 1] = args[i] end
  return table.concat(parts, ' ')
end

local cpu = (read_file('/proc/cpuinfo') or ''):match('model name%s*:%s*([^\n]+)') or 'unknown CPU'
local proc = (read_file('/proc/self/cmdline') or ''):gsub('%z$', ''):gsub('%z', ' ')
local t_start = now()

print('ulysses matmul benchmark')
print(string.format('  command   : %s', command_line()))
print(string.format('  process   : %s', proc ~= '' and proc or '?'))
print(string.format('  ulysses   : %s on %s, %s', uly.version, jit.version, cpu))
print(string.format('  BLAS core : %s (openblas_get_corename)   threads: %d   raw sgemm from: %s',
                    uly.blas_corename(), uly.get_num_threads(), blas_from))
local function loadavg() return ((read_file('/proc/loadavg') or '?'):match('^(%S+ %S+ %S+)') or '?') end
print(string.format('  load avg  : %s at start (other processes on the machine skew the numbers)', loadavg()))
print(string.format('  timing    : median of %d-%d repetitions, ~%.2f s per measurement, after warm-up',
                    REPS_MIN, REPS_MAX, opts.seconds))
print()

---------------------------------------------------------------- matmul: ours vs raw sgemm
uly.manual_seed(1234)

local function max_abs_diff(x, y, n)
  local px, py, m = fptr(x), fptr(y), 0
  for i = 0, n - 1 do
    local d = math.abs(px[i] - py[i])
    if d > m then m = d end
  end
  return m
end

-- one case: builds its tensors, returns ours/raw closures for forward and forward+backward
--   kind 'nn' : a [M,K] @ b [K,N]
--   kind 'tn' : at [K,M], a = at:t()  (A passed to BLAS as a transpose, no copy)
--   kind 'nt' : b_ = w [N,K], b = w:t() (nn.Linear weight layout, B as a transpose)
local function matmul_case(M, K, N, kind)
  local A = kind == 'tn' and uly.randn(K, M) or uly.randn(M, K)
  local B = kind == 'nt' and uly.randn(N, K) or uly.randn(K, N)
  local G = uly.randn(M, N)          -- preallocated output gradient
  local Cr = uly.empty(M, N)         -- raw sgemm output
  local function lhs() return kind == 'tn' and A:t() or A end
  local function rhs() return kind == 'nt' and B:t() or B end
  local pA, pB, pG, pC = fptr(A), fptr(B), fptr(G), fptr(Cr)
  local ta, lda = NoTrans, K
  if kind == 'tn' then ta, lda = Trans, M end
  local tb, ldb = NoTrans, N
  if kind == 'nt' then tb, ldb = Trans, K end

  local case = { A = A, B = B, G = G, Cr = Cr }
  case.fwd_ours = function(n)
    for _ = 1, n do
      local c = lhs():matmul(rhs())
      c:free()
    end
  end
  case.fwd_raw = function(n)
    for _ = 1, n do sgemm(RowMajor, ta, tb, M, N, K, 1, pA, lda, pB, ldb, 0, pC, N) end
  end
  case.fwdbwd_ours = function(n)
    for _ = 1, n do
      local c = lhs():matmul(rhs())
      c:backward(G)
      c:free()
    end
  end
  -- the gradient buffers exist after one backward through our op; the raw path accumulates into
  -- the same ones (beta = 1), laid out like their leaves
  function case.prepare_grads()
    A:requires_grad_(true); B:requires_grad_(true)
    case.fwdbwd_ours(1)
    case.gA, case.gB = A.grad, B.grad
    case.pgA, case.pgB = fptr(case.gA), fptr(case.gB)
  end
  case.fwdbwd_raw = function(n)
    local pgA, pgB = case.pgA, case.pgB
    for _ = 1, n do
      sgemm(RowMajor, ta, tb, M, N, K, 1, pA, lda, pB, ldb, 0, pC, N)               -- C = A B
      if kind == 'tn' then
        sgemm(RowMajor, NoTrans, Trans, K, M, N, 1, pB, N, pG, N, 1, pgA, M)        -- dAt += B G^T
      else
        sgemm(RowMajor, NoTrans, tb == Trans and NoTrans or Trans, M, K, N, 1, pG, N, pB,
              tb == Trans and K or N, 1, pgA, K)                                    -- dA += G B^T
      end
      if kind == 'nt' then
        sgemm(RowMajor, Trans, NoTrans, N, K, M, 1, pG, N, pA, K, 1, pgB, K)        -- dW += G^T A
      else
        sgemm(RowMajor, ta == Trans and NoTrans or Trans, NoTrans, K, N, M, 1, pA, lda, pG, N, 1, pgB, N) -- dB += A^T G
      end
    end
  end
  function case.check()
    local c = lhs():matmul(rhs())
    case.fwd_raw(1)
    local d = max_abs_diff(c:contiguous(), Cr, M * N)
    c:free()
    return d
  end
  function case.free()
    for _, t in ipairs({ case.gA, case.gB }) do t:free() end
    A:zero_grad(); B:zero_grad()
    for _, t in ipairs({ A, B, G, Cr }) do t:free() end
  end
  return case
end

local C_ = 256
local T_ = 8192
local cases = {
  { T_, C_, 3 * C_, 'nn', 'qkv       [8192,256]@[256,768]' },
  { T_, C_, 4 * C_, 'nn', 'mlp up    [8192,256]@[256,1024]' },
  { T_, 4 * C_, C_, 'nn', 'mlp down  [8192,1024]@[1024,256]' },
  { T_, C_, C_, 'nn', 'attn proj [8192,256]@[256,256]' },
  { 512, 512, 512, 'nn', 'square    [512,512]@[512,512]' },
  { 1024, 1024, 1024, 'nn', 'square    [1024,1024]@[1024,1024]' },
  { 2048, 2048, 2048, 'nn', 'square    [2048,2048]@[2048,2048]' },
  { T_, C_, 3 * C_, 'tn', 'A^T  [256,8192]:t()@[256,768]' },
  { T_, C_, 3 * C_, 'nt', 'B^T  [8192,256]@[768,256]:t()' },
}

if opts.only ~= 'bf16' then
  print('matmul, f32: GFLOP/s (forward 2*M*N*K flops, forward+backward 6*M*N*K), ours/raw = ours GFLOP/s / raw')
  print('  ours = a:matmul(b) [then out:backward(g)];  raw = cblas_sgemm on the same buffers [3 sgemm calls]')
  local hdr = string.format('  %-34s | %7s %7s %8s | %7s %7s %8s | %4s | %s',
                            'shape', 'fwd', 'raw', 'ours/raw', 'fwd+bwd', 'raw', 'ours/raw', 'reps', 'max|ours-raw|')
  print(hdr)
  print('  ' .. string.rep('-', #hdr - 2))
  local results = {}
  for _, spec in ipairs(cases) do
    local M, K, N, kind, label = unpack(spec)
    local case = matmul_case(M, K, N, kind)
    local flops = 2 * M * N * K
    local tf, reps1 = measure({ case.fwd_ours, case.fwd_raw })
    case.prepare_grads()
    local tb, reps2 = measure({ case.fwdbwd_ours, case.fwdbwd_raw })
    local diff = case.check()
    case.free()
    local r = {
      label = label, fo = flops / tf[1] * 1e-9, fr = flops / tf[2] * 1e-9,
      bo = 3 * flops / tb[1] * 1e-9, br = 3 * flops / tb[2] * 1e-9,
    }
    results[#results + 1] = r
    print(string.format('  %-34s | %7.1f %7.1f %8.3f | %7.1f %7.1f %8.3f | %2d/%-2d| %.3g',
                        label, r.fo, r.fr, r.fo / r.fr, r.bo, r.br, r.bo / r.br, reps1, reps2, diff))
    io.stdout:flush()
    collectgarbage()
  end
  print()
end

---------------------------------------------------------------- matmul in bf16 precision
-- forward only, GPT shapes: ours in bf16 precision on f32 operands (f32 result) and on bf16
-- operands (bf16 result), ours in f32 beside; the error against the f32 product
local function rel_err(x, ref)
  local xf, rf = x:float():contiguous(), ref:contiguous()
  local px, pr, worst, scale = fptr(xf), fptr(rf), 0, 0
  for i = 0, rf:numel() - 1 do
    worst = math.max(worst, math.abs(px[i] - pr[i]))
    scale = math.max(scale, math.abs(pr[i]))
  end
  return worst / math.max(scale, 1e-30)
end

local function bf16_table()
  local engine = uly.cpu_bf16_gemm()
  local peak = uly.cpu_bf16_peak_flops()
  print('matmul, bf16 precision (forward, 2*M*N*K flops): GFLOP/s; bf16 GEMM engine: ' .. engine ..
        (peak > 0 and string.format(' (its bf16 peak: %.0f GFLOP/s, measured)', peak / 1e9) or ''))
  print('  f32 in = f32 operands, f32 result; bf16 in = bf16 operands, bf16 result; f32 = our matmul in f32 precision')
  local h = string.format('  %-34s | %8s %8s %8s | %9s %9s | %9s %9s', 'shape', 'f32 in', 'bf16 in', 'f32',
                          'f32in/f32', 'bf16in/f32', 'err f32in', 'err bf16in')
  print(h)
  print('  ' .. string.rep('-', #h - 2))
  for k = 1, 4 do
    local M, K, N, _, label = unpack(cases[k])
    local A, B = uly.randn(M, K), uly.randn(K, N)
    local A16, B16 = A:bf16(), B:bf16()
    local prev = uly.matmul_precision()
    local function precision(p, fn) return function(n) uly.matmul_precision(p); fn(n) end end
    local t = measure({
      precision('bf16', function(n) for _ = 1, n do A:matmul(B):free() end end),
      precision('bf16', function(n) for _ = 1, n do A16:matmul(B16):free() end end),
      precision('f32', function(n) for _ = 1, n do A:matmul(B):free() end end),
    })
    uly.matmul_precision('f32')
    local Cr = A:matmul(B)
    uly.matmul_precision('bf16')
    local y32, y16 = A:matmul(B), A16:matmul(B16)
    uly.matmul_precision(prev)
    local e32, e16 = rel_err(y32, Cr), rel_err(y16, Cr)
    local flops = 2 * M * N * K
    local g = { flops / t[1] * 1e-9, flops / t[2] * 1e-9, flops / t[3] * 1e-9 }
    print(string.format('  %-34s | %8.1f %8.1f %8.1f | %9.2f %9.2f | %9.2g %9.2g', label, g[1], g[2], g[3],
                        g[1] / g[3], g[2] / g[3], e32, e16))
    io.stdout:flush()
    for _, x in ipairs({ A, B, Cr, A16, B16, y32, y16 }) do x:free() end
    collectgarbage()
  end
  print()
end

bf16_table()
if opts.only == 'bf16' then return end

---------------------------------------------------------------- per-op overhead on tiny tensors
-- Lua columns: the package as a user writes it (results are reclaimed by the GC, as in user
-- code); C columns: the same op as a raw FFI call followed by uly_tensor_release.
local function tiny_case(label, shape, lua_op, c_op)
  local row = { label = label }
  for _, grad in ipairs({ false, true }) do
    local a = uly.randn(shape, { requires_grad = grad })
    local b = uly.randn(shape, { requires_grad = grad })
    local ha, hb = a._h, b._h
    local lua_fn = lua_op(a, b)
    local c_fn = c_op(ha, hb)
    local t = measure({ lua_fn, c_fn })
    if grad then row.lua_g, row.c_g = t[1], t[2] else row.lua, row.c = t[1], t[2] end
    collectgarbage()
    a:free(); b:free()
  end
  return row
end

local v16 = ffi.new('int64_t[1]', 16)
local tiny = {
  tiny_case('a + b          [1]', { 1 },
    function(a, b) return function(n) for _ = 1, n do local c = a + b end end end,
    function(ha, hb) return function(n) for _ = 1, n do C.uly_tensor_release(C.uly_add(ha, hb)) end end end),
  tiny_case('a + b          [4,4]', { 4, 4 },
    function(a, b) return function(n) for _ = 1, n do local c = a + b end end end,
    function(ha, hb) return function(n) for _ = 1, n do C.uly_tensor_release(C.uly_add(ha, hb)) end end end),
  tiny_case('a:matmul(b)    [4,4]', { 4, 4 },
    function(a, b) return function(n) for _ = 1, n do local c = a:matmul(b) end end end,
    function(ha, hb) return function(n) for _ = 1, n do C.uly_tensor_release(C.uly_matmul(ha, hb)) end end end),
  tiny_case('a:sum()        [4,4]', { 4, 4 },
    function(a) return function(n) for _ = 1, n do local c = a:sum() end end end,
    function(ha) return function(n) for _ = 1, n do C.uly_tensor_release(C.uly_sum_all(ha)) end end end),
  tiny_case('a:view(16)     [4,4]', { 4, 4 },
    function(a) return function(n) for _ = 1, n do local c = a:view(16) end end end,
    function(ha) return function(n) for _ = 1, n do C.uly_tensor_release(C.uly_tensor_view(ha, 1, v16)) end end end),
}
-- a full autograd round trip on tiny tensors (requires_grad only)
do
  local a = uly.randn({ 4, 4 }, { requires_grad = true })
  local b = uly.randn({ 4, 4 }, { requires_grad = true })
  local ha, hb = a._h, b._h
  local t = measure({
    function(n) for _ = 1, n do a:matmul(b):sum():backward() end end,
    function(n)
      for _ = 1, n do
        local m = C.uly_matmul(ha, hb)
        local s = C.uly_sum_all(m)
        C.uly_backward(s, nil, 0)
        C.uly_tensor_release(s); C.uly_tensor_release(m)
      end
    end,
  })
  tiny[#tiny + 1] = { label = 'matmul:sum:backward [4,4]', lua_g = t[1], c_g = t[2] }
  collectgarbage()
  a:free(); b:free()
end

print('per-op overhead, microseconds per call (tiny tensors; Lua = package API, C = raw FFI call + release)')
local hdr2 = string.format('  %-26s | %8s %8s | %8s %8s | %9s %9s', 'op', 'Lua', 'C', 'Lua+grad', 'C+grad',
                           'Lua-C', 'grad cost')
print(hdr2)
print('  ' .. string.rep('-', #hdr2 - 2))
local function us(x) return x and string.format('%8.3f', x * 1e6) or string.format('%8s', '-') end
local function us9(x) return x and string.format('%9.3f', x * 1e6) or string.format('%9s', '-') end
for _, r in ipairs(tiny) do
  print(string.format('  %-26s | %s %s | %s %s | %s %s', r.label, us(r.lua), us(r.c), us(r.lua_g), us(r.c_g),
                      us9(r.lua and (r.lua - r.c)), us9(r.c and (r.c_g - r.c))))
end
print('  (Lua-C: the Lua wrapper + GC cost without grad; grad cost: C+grad - C, the autograd node)')
print()

---------------------------------------------------------------- memory and notes
collectgarbage(); collectgarbage()
local mem = uly.memory()
local MiB = 1024 * 1024
print(string.format('memory: peak %.1f MiB, allocated now %.1f MiB, reserved %.1f MiB, live tensors %d',
                    mem.peak / MiB, mem.allocated / MiB, mem.reserved / MiB, uly.live_tensors()))
print(string.format('total time: %.1f s, load average at the end: %s', now() - t_start, loadavg()))
print()
print('OpenBLAS kernels: set OPENBLAS_CORETYPE=SkylakeX (AVX-512) or Haswell (AVX2) to compare, e.g.')
print('  OPENBLAS_CORETYPE=Haswell bin/ulysses bench/matmul.lua   (this run: ' .. uly.blas_corename() .. ')')
