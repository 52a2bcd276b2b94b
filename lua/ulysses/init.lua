-- lua/ulysses/init.lua — the package: `local uly = require 'ulysses'`. Tensor constructors,
-- functional ops, autograd mode, random seed, memory and thread settings. No globals.
local ffi = require 'ffi'
local lib = require 'ulysses.ffi'
local T = require 'ulysses.tensor'
local C = lib.C

local uly = {
  C = C,
  Tensor = T.Tensor,
  is_tensor = T.is_tensor,
  library_path = lib.library_path,
}
local H, wrap, check, raise = T.handle, T.wrap, T.check, T.raise
local options = require 'ulysses.options'
local attention_keep = require 'ulysses.attention_keep'
local TENSOR_OPTIONS = { 'dtype', 'device', 'requires_grad' }
local ARANGE_OPTIONS = { 'dtype', 'device' }
local FROM_PTR_OPTIONS = { 'dtype', 'device', 'requires_grad', 'src_dtype' }
local CROSS_ENTROPY_OPTIONS = { 'ignore_index', 'reduction' }
local ATTENTION_OPTIONS = { 'causal', 'scale' }
local FLASH_OPTIONS = { 'causal', 'scale', 'window', 'block_layout', 'block_size', 'q_doc', 'k_doc', 'doc' }

uly.version = ffi.string(C.uly_version())

-- split trailing options off constructor arguments: zeros(2, 3, {dtype = 'i32'})
local function shape_and_opts(what, ...)
  local n = select('#', ...)
  local args = { ... }
  local opts = {}
  while n > 0 and args[n] == nil do n = n - 1 end  -- zeros({2, 3}, nil): a nil opts is no size
  if n > 0 and type(args[n]) == 'table' and #args[n] == 0 and next(args[n]) ~= nil then
    opts = options.check(what, args[n], TENSOR_OPTIONS)
    args[n] = nil
    n = n - 1
  end
  return T.shape_list(what, unpack(args, 1, n)), opts
end

function uly.tensor(data, opts) return T.from_table(data, opts) end
-- a new tensor holding a copy of raw memory: from_ptr(ptr, {2, 3}, {dtype = 'f32', src_dtype = 'f64'})
function uly.from_ptr(ptr, shape, opts)
  opts = options.check('from_ptr', opts, FROM_PTR_OPTIONS)
  if type(shape) ~= 'table' then raise('from_ptr: shape must be a table such as {2, 3}') end
  if ptr == nil then raise('from_ptr: pointer is NULL') end
  local t = T.empty(shape, { dtype = opts.dtype, device = opts.device })
  check(C.uly_tensor_copy_from(t._h, ptr, T.dtype_code(opts.src_dtype or opts.dtype), t:numel()))
  if opts.requires_grad then t:requires_grad_(true) end
  return t
end

function uly.empty(...) local s, o = shape_and_opts('empty', ...) return T.empty(s, o) end

local function filled(value, shape, opts)
  local t = T.empty(shape, { dtype = opts.dtype, device = opts.device })
  t:fill_(value)
  if opts.requires_grad then t:requires_grad_(true) end
  return t
end
function uly.zeros(...) local s, o = shape_and_opts('zeros', ...) return filled(0, s, o) end
function uly.ones(...) local s, o = shape_and_opts('ones', ...) return filled(1, s, o) end
function uly.full(shape, value, opts)
  if type(shape) ~= 'table' then raise('full: shape must be a table such as {2, 3}') end
  return filled(value, shape, options.check('full', opts, TENSOR_OPTIONS))
end

local function random(what, fill, ...)
  local s, o = shape_and_opts(what, ...)
  local t = T.empty(s, { dtype = o.dtype, device = o.device })
  fill(t)
  if o.requires_grad then t:requires_grad_(true) end
  return t
end
function uly.randn(...) return random('randn', function(t) t:normal_(0, 1) end, ...) end
function uly.rand(...) return random('rand', function(t) t:uniform_(0, 1) end, ...) end

-- arange(stop) or arange(start, stop[, step][, opts]); i64 by default like PyTorch for integers
function uly.arange(a, b, c, d)
  local opts = {}
  local args = { a, b, c, d }
  for i = 4, 1, -1 do
    if type(args[i]) == 'table' then opts = options.check('arange', args[i], ARANGE_OPTIONS); args[i] = nil; break end
  end
  local start, stop, step = args[1], args[2], args[3]
  if stop == nil then start, stop = 0, start end
  step = step or 1
  local integral = start == math.floor(start) and stop == math.floor(stop) and step == math.floor(step)
  local dtype = T.dtype_code(opts.dtype or (integral and 'i64' or 'f32'))
  local t = wrap(C.uly_tensor_arange(start, stop, step, dtype))   -- made on the host
  local device = opts.device or T.default_device
  if device ~= 'cpu' then t = t:to(device) end
  return t
end

-- a new tensor of t's shape, dtype and device (opts override)
local function like(t, opts)
  local o = { dtype = t:dtype(), device = t:device() }
  for k, v in pairs(options.check('zeros_like / ones_like / randn_like', opts, TENSOR_OPTIONS)) do o[k] = v end
  return o
end
function uly.zeros_like(t, opts) return uly.zeros(t:shape(), like(t, opts)) end
function uly.ones_like(t, opts) return uly.ones(t:shape(), like(t, opts)) end
function uly.randn_like(t, opts) return uly.randn(t:shape(), like(t, opts)) end

---------------------------------------------------------------- functional ops
function uly.matmul(a, b) return a:matmul(b) end
-- a [..., K] @ w [K, N] + bias [N] in one op (a Linear layer: the bias seeds the output, one GEMM
-- adds into it; the same values and gradients as a:matmul(w) + bias)
function uly.addmm(a, w, bias)
  return wrap(C.uly_addmm(H(a, 'addmm'), H(w, 'addmm weight'), H(bias, 'addmm bias')))
end
function uly.softmax(x, d) return x:softmax(d) end
function uly.log_softmax(x, d) return x:log_softmax(d) end
function uly.gelu(x, approximate) return x:gelu(approximate) end
function uly.silu(x) return x:silu() end
function uly.swiglu(gate, up) return gate:swiglu(up) end
function uly.rope(x, offset, theta) return x:rope(offset, theta) end
function uly.dropout(x, p, training) return x:dropout(p, training) end

function uly.layernorm(x, weight, bias, eps)
  return wrap(C.uly_layernorm(H(x, 'layernorm'), weight and H(weight, 'layernorm weight') or nil,
                              bias and H(bias, 'layernorm bias') or nil, eps or 1e-5))
end

function uly.rmsnorm(x, weight, eps)
  return wrap(C.uly_rmsnorm(H(x, 'rmsnorm'), weight and H(weight, 'rmsnorm weight') or nil, eps or 1e-6))
end

function uly.embedding(indices, weight)
  return wrap(C.uly_embedding(H(indices, 'embedding indices'), H(weight, 'embedding weight')))
end

local REDUCTIONS = { mean = 0, sum = 1, none = 2 }
-- cross_entropy(logits [..., V], targets [...] i32/i64, {ignore_index = -100, reduction = 'mean'})
function uly.cross_entropy(logits, targets, opts)
  opts = options.check('cross_entropy', opts, CROSS_ENTROPY_OPTIONS)
  local red = REDUCTIONS[opts.reduction or 'mean']
  if not red then raise("cross_entropy: reduction must be 'mean', 'sum' or 'none', got " .. tostring(opts.reduction)) end
  return wrap(C.uly_cross_entropy(H(logits, 'cross_entropy logits'), H(targets, 'cross_entropy targets'),
                                  opts.ignore_index or -100, red))
end

-- the scores' scale as the C calls take it: 0 for the default 1/sqrt(D)
local function scale_of(op, s)
  if s == nil then return 0 end
  if type(s) ~= 'number' or not (s > 0) or s == math.huge then
    raise(string.format('%s: scale must be a finite number > 0, got %s; leave it out for 1/sqrt(head_dim)', op,
                        tostring(s)))
  end
  return s
end

-- attention(q [B, Tq, H, D], k, v [B, Tk, Hkv, D], {causal = false, scale = 1/sqrt(D)})
function uly.attention(q, k, v, opts)
  opts = options.check('attention', opts, ATTENTION_OPTIONS)
  return wrap(C.uly_attention(H(q, 'attention q'), H(k, 'attention k'), H(v, 'attention v'), scale_of('attention', opts.scale),
                              opts.causal and 1 or 0))
end

-- flash_attention(q [B, Tq, H, D], k, v [B, Tk, Hkv, D], opts): memory-efficient attention (O(N D)
-- memory) with masks that combine: {causal = false, scale = 1/sqrt(D), window = w (left width w;
-- right width 0 when causal, w otherwise) or {left, right} (nil or -1: unbounded),
-- block_layout = i32 [ceil(Tq/bs), ceil(Tk/bs)] 0/1 tensor, block_size = bs,
-- q_doc = ids [B, Tq], k_doc = ids [B, Tk] (doc = ids: the same for both)}
local function window_widths(w, causal)
  if w == nil then return -1, -1 end
  local l, r
  if type(w) == 'number' then l, r = w, causal and 0 or w
  elseif type(w) == 'table' then l, r = w[1] or w.left or -1, w[2] or w.right or -1
  else raise('flash_attention: window must be a number or {left, right}, got ' .. type(w)) end
  for _, x in ipairs({ l, r }) do
    if type(x) ~= 'number' or x ~= math.floor(x) or x < -1 then
      raise('flash_attention: window widths must be integers >= 0 (or -1 for unbounded), got ' .. tostring(x))
    end
  end
  return l, r
end
function uly.flash_attention(q, k, v, opts)
  opts = options.check('flash_attention', opts, FLASH_OPTIONS)
  local scale = scale_of('flash_attention', opts.scale)
  local m = ffi.new('uly_attn_mask')
  m.causal = opts.causal and 1 or 0
  m.window_left, m.window_right = window_widths(opts.window, opts.causal)
  if opts.block_layout ~= nil then
    m.block_layout = H(opts.block_layout, 'flash_attention block_layout')
    m.block_size = opts.block_size or raise('flash_attention: block_layout needs block_size (tokens per block)')
  end
  local qd, kd = opts.q_doc or opts.doc, opts.k_doc or opts.doc
  if qd ~= nil then m.q_doc = H(qd, 'flash_attention q_doc') end
  if kd ~= nil then m.k_doc = H(kd, 'flash_attention k_doc') end
  local qh, kh, vh = H(q, 'flash_attention q'), H(k, 'flash_attention k'), H(v, 'flash_attention v')
  if attention_keep.recording or attention_keep.replaying then   -- inside nn.checkpoint_except_attention
    return attention_keep.call(C, T, q, k, v, scale, m)
  end
  return wrap(C.uly_flash_attention(qh, kh, vh, scale, m))
end
uly.flash_attention_tiles = function() return tonumber(C.uly_flash_attention_tiles()) end
uly.flash_attention_reset_tiles = function() C.uly_flash_attention_reset_tiles() end

-- block layouts and document ids for flash_attention's masks
uly.attention_layouts = {}
local function layout_from(nr, nc, visible)
  local buf = ffi.new('int32_t[?]', math.max(nr * nc, 1))
  for r = 0, nr - 1 do
    for c = 0, nc - 1 do buf[r * nc + c] = visible(r, c) and 1 or 0 end
  end
  return uly.from_ptr(buf, { nr, nc }, { dtype = 'i32' })
end
-- local_strided(T, block, local_blocks, stride, global_blocks): [ceil(T/block)]^2 layout where
-- block row r sees block c when |r - c| < local_blocks (the band), when r - c is a multiple of
-- stride (the strided pattern of Sparse Transformers; stride nil or 0: none), or when r or c is
-- below global_blocks (global blocks, as in Longformer/BigBird); combine with causal = true for
-- the lower triangle. Square: Tq = Tk = T.
function uly.attention_layouts.local_strided(T, block, local_blocks, stride, global_blocks)
  for name, x in pairs({ T = T, block = block, local_blocks = local_blocks or 1 }) do
    if type(x) ~= 'number' or x < 1 or x ~= math.floor(x) then
      raise('attention_layouts.local_strided: ' .. name .. ' must be a positive integer, got ' .. tostring(x))
    end
  end
  local n, lb, s, gb = math.ceil(T / block), local_blocks or 1, stride or 0, global_blocks or 0
  return layout_from(n, n, function(r, c)
    return math.abs(r - c) < lb or (s > 0 and (r - c) % s == 0) or r < gb or c < gb
  end)
end
-- from_function(nr, nc, fn): layout with fn(r, c) (0-based block indices) -> true when visible
function uly.attention_layouts.from_function(nr, nc, fn) return layout_from(nr, nc, fn) end
-- doc_ids(lengths, B = 1): i32 [B, sum(lengths)] ids 0, 1, ... of packed documents of those lengths
function uly.attention_layouts.doc_ids(lengths, B)
  B = B or 1
  local T = 0
  for _, n in ipairs(lengths) do T = T + n end
  local buf = ffi.new('int32_t[?]', math.max(B * T, 1))
  for b = 0, B - 1 do
    local t = 0
    for d, n in ipairs(lengths) do
      for _ = 1, n do buf[b * T + t] = d - 1; t = t + 1 end
    end
  end
  return uly.from_ptr(buf, { B, T }, { dtype = 'i32' })
end

-- cat({a, b, ...}, dim)
function uly.cat(list, d)
  if type(list) ~= 'table' or #list == 0 then raise('cat: expects a non-empty list of tensors') end
  d = d or 1
  local nd = list[1]:dim()
  local cd = d < 0 and nd + d or d - 1
  if cd < 0 or cd >= nd then raise(string.format('cat: dimension %d out of range for %d dimensions', d, nd)) end
  local acc = nil
  local i = 1
  while i <= #list do
    local group = ffi.new('uly_tensor*[4]')
    local n = 0
    if acc then group[0] = acc._h; n = 1 end
    while n < 4 and i <= #list do group[n] = H(list[i], 'cat'); n = n + 1; i = i + 1 end
    acc = wrap(C.uly_tensor_cat(n, group, cd))
  end
  return acc
end

---------------------------------------------------------------- autograd mode
local function run_with_grad_mode(enabled, fn, ...)
  local prev = C.uly_set_grad_enabled(enabled)
  local res = { pcall(fn, ...) }
  C.uly_set_grad_enabled(prev)
  if not res[1] then error(res[2], 0) end
  return unpack(res, 2, table.maxn(res))
end
function uly.no_grad(fn, ...) return run_with_grad_mode(0, fn, ...) end
function uly.enable_grad(fn, ...) return run_with_grad_mode(1, fn, ...) end
function uly.is_grad_enabled() return C.uly_grad_enabled() ~= 0 end

---------------------------------------------------------------- library settings
function uly.manual_seed(seed)
  if type(seed) ~= 'number' or seed < 0 or seed ~= math.floor(seed) then
    raise('manual_seed: seed must be a non-negative integer, got ' .. tostring(seed))
  end
  C.uly_manual_seed(seed)
end
function uly.rng_state() return { seed = C.uly_rng_seed(), offset = C.uly_rng_offset() } end
function uly.set_rng_state(s)
  if type(s) ~= 'table' or not tonumber(s.seed) or not tonumber(s.offset) then   -- numbers or uint64 cdata
    raise('set_rng_state: expects the table uly.rng_state() returns, {seed = n, offset = n}, got '
          .. (type(s) == 'table' and ('seed ' .. tostring(s.seed) .. ', offset ' .. tostring(s.offset)) or type(s)))
  end
  C.uly_rng_set_state(s.seed, s.offset)
end

-- the caching pool of a device ('cpu' by default): bytes allocated to tensors, their high-water
-- mark, reserved (allocated + cached), the limit, and how often the pool called the OS / device
-- allocator (raw_allocs stays flat once a training loop is warm)
-- prints as {allocated = 1.50 MiB, peak = ..., ...} (the fields stay numbers of bytes)
local MEMORY_FIELDS = { 'allocated', 'peak', 'reserved', 'limit', 'raw_allocs', 'raw_frees' }
local memory_mt = { __tostring = function(m)
  local parts = {}
  for i, k in ipairs(MEMORY_FIELDS) do
    local v = m[k]
    parts[#parts + 1] = k .. ' = ' .. (i <= 4 and v >= 0 and require('ulysses.log').format_bytes(v) or tostring(v))
  end
  return '{' .. table.concat(parts, ', ') .. '}'
end }
function uly.memory(device)
  local code = T.device_code(device or 'cpu')
  local s = ffi.new('int64_t[6]')
  check(C.uly_device_memory_stats(code, s))
  return setmetatable({ allocated = tonumber(s[0]), peak = tonumber(s[1]), reserved = tonumber(s[2]),
                        limit = tonumber(s[3]), raw_allocs = tonumber(s[4]), raw_frees = tonumber(s[5]) }, memory_mt)
end
function uly.reset_peak_memory(device) check(C.uly_device_memory_reset_peak(T.device_code(device or 'cpu'))) end
function uly.empty_cache(device) check(C.uly_device_empty_cache(T.device_code(device or 'cpu'))) end
function uly.memory_limit(nbytes, device)
  local code = T.device_code(device or 'cpu')
  if nbytes then check(C.uly_device_set_memory_limit(code, nbytes)) end
  return uly.memory(device).limit
end

-- mixed precision: uly.matmul_precision('bf16') makes every matmul (forward and backward) round
-- its f32 operands to bf16 and accumulate in f32 (tensor cores at the bf16 rate on a GPU); 'f32'
-- (the default) keeps full f32 (TF32 on a GPU). Weights, optimizer state and every other op stay
-- f32 (activations too, unless uly.activation_dtype('bf16'), below). Returns the previous setting;
-- uly.matmul_precision() only reads it.
function uly.matmul_precision(p)
  local prev = C.uly_matmul_bf16() ~= 0 and 'bf16' or 'f32'
  if p ~= nil then
    if p ~= 'bf16' and p ~= 'f32' then
      raise("matmul_precision: expected 'bf16' or 'f32' (TF32 on a GPU, exact f32 on the CPU), got " .. tostring(p))
    end
    C.uly_set_matmul_bf16(p == 'bf16' and 1 or 0)
  end
  return prev
end

-- bf16 activations: uly.activation_dtype('bf16') makes embeddings give bf16 tensors, and every op
-- keeps bf16 inputs bf16 (a matmul's result takes its left operand's dtype; cross-entropy's loss
-- stays f32): each op computes in f32 and rounds its result once, ops save bf16 inputs as bf16 for
-- backward (half the activation memory), and every gradient is f32, so weights, gradients and
-- optimizer state stay f32. With matmul_precision('bf16') it is Megatron-style mixed precision;
-- on a GPU the GEMMs and attention then read the bf16 activations as they are. 'f32' (the
-- default) turns it off. Returns the previous setting; uly.activation_dtype() only reads it.
function uly.activation_dtype(dt)
  local prev = C.uly_activation_bf16() ~= 0 and 'bf16' or 'f32'
  if dt ~= nil then
    if dt ~= 'bf16' and dt ~= 'f32' then
      raise("activation_dtype: expected 'bf16' or 'f32', got " .. tostring(dt))
    end
    C.uly_set_activation_bf16(dt == 'bf16' and 1 or 0)
  end
  return prev
end

-- uly.device('cuda'): where tensors are created when no device is given; returns the previous
-- default (uly.device() only reads it). The same script then runs on either device.
function uly.device(name)
  local prev = T.default_device
  if name ~= nil then
    T.device_code(name)   -- validates, and loads the CUDA backend when asked for
    T.default_device = name
  end
  return prev
end
-- wait for every queued kernel of a device (timings; errors of asynchronous kernels surface here)
function uly.synchronize(device) check(C.uly_device_synchronize(T.device_code(device or T.default_device))) end
function uly.live_tensors() return tonumber(C.uly_tensor_live_count()) end

function uly.set_num_threads(n) C.uly_set_num_threads(n or 0) end
function uly.get_num_threads() return C.uly_get_num_threads() end
function uly.blas_corename() return ffi.string(C.uly_blas_corename()) end
-- this CPU's f32 FMA peak in FLOP/s over `threads` threads (default: the current count), measured
-- by running vector FMAs for ~15 ms: the denominator of MFU on the CPU
function uly.cpu_peak_flops(threads) return C.uly_cpu_peak_flops(threads or uly.get_num_threads()) end
-- bf16 matmuls on the CPU (uly.matmul_precision('bf16')) run on its AMX tiles where it has them:
-- "on", or "off: " and why; uly.cpu_amx(false) switches them to OpenBLAS (the rounded operands in
-- f32, the same products), uly.cpu_amx(true) back; returns the status after the switch
function uly.cpu_amx(on)
  if on ~= nil then C.uly_set_cpu_amx(on and 1 or 0) end
  return ffi.string(C.uly_cpu_amx_status())
end
-- the AMX tiles' bf16 peak in FLOP/s over `threads` threads (default: the current count),
-- measured (~10 ms): the denominator of MFU for bf16 matmuls on them; 0 where AMX is off
function uly.cpu_amx_peak_flops(threads) return C.uly_cpu_amx_peak_flops(threads or uly.get_num_threads()) end
-- where AMX is off (no tiles, or uly.cpu_amx(false)), bf16 matmuls run with AVX512-BF16's VDPBF16PS
-- where the CPU has it (AMD Zen 4 and 5, Intel Cooper Lake) and it pays (measured at start at
-- 1.25x the f32 FMA rate or more; else OpenBLAS on rounded copies is as fast): "on" (it runs while
-- AMX is off), or "off: " and why. uly.cpu_avx512_bf16(false) switches it off (OpenBLAS on rounded
-- copies: the same products), (true) on wherever the CPU has it, ('auto') back to where it pays;
-- ULY_CPU_AVX512_BF16=0 / 1 set off / on at start. Returns the status after the switch
function uly.cpu_avx512_bf16(on)
  if on ~= nil then
    if on ~= true and on ~= false and on ~= 'auto' then
      raise("cpu_avx512_bf16: expected true, false or 'auto', got " .. tostring(on))
    end
    C.uly_set_cpu_avx512_bf16(on == 'auto' and -1 or on and 1 or 0)
  end
  return ffi.string(C.uly_cpu_avx512_bf16_status())
end
-- its bf16 peak in FLOP/s over `threads` threads (default: the current count), measured (~10 ms); 0 where off
function uly.cpu_avx512_bf16_peak_flops(threads)
  return C.uly_cpu_avx512_bf16_peak_flops(threads or uly.get_num_threads())
end
-- which engine runs bf16 matmuls on the CPU: 'amx', 'avx512_bf16', or 'off: ' and why (OpenBLAS on
-- rounded copies then)
function uly.cpu_bf16_gemm() return ffi.string(C.uly_cpu_bf16_gemm()) end
-- that engine's bf16 peak in FLOP/s over `threads` threads (default: the current count), measured:
-- the denominator of MFU for bf16 matmuls on the CPU; 0 where none runs
function uly.cpu_bf16_peak_flops(threads) return C.uly_cpu_bf16_peak_flops(threads or uly.get_num_threads()) end
-- bf16 activations (uly.activation_dtype('bf16')) on the CPU: norms, SwiGLU, activations, RoPE,
-- elementwise ops and cross-entropy read and write bf16 themselves (true, the default) or run the
-- f32 kernels between converting copies (false): the same bits, half the bytes moved. Returns the
-- previous setting (nothing given: only reads it).
function uly.cpu_bf16_kernels(on)
  if on ~= nil and type(on) ~= 'boolean' then
    raise('uly.cpu_bf16_kernels: expected true, false or nothing, got ' .. type(on) .. ' ' .. tostring(on))
  end
  return C.uly_cpu_bf16_kernels(on == nil and -1 or on and 1 or 0) ~= 0
end
-- how many times a CPU bf16 kernel (uly.cpu_bf16_kernels) has run in this process
function uly.cpu_bf16_kernel_calls() return tonumber(C.uly_cpu_bf16_kernel_calls()) end
-- whether the library was built with a feature: 'mpi', 'hdf5', 'cuda', 'openmp', 'fma' (CPU
-- kernels with fused multiply-adds: the optimizers then round as PyTorch's do on such CPUs)
function uly.has(feature) return C.uly_has_feature(feature) ~= 0 end

-- uly.file_stamp(path) -> size (bytes), mtime (ns since the epoch, a double: exact to ~0.25 us);
-- nil and the reason where the file cannot be read
local stamp_size, stamp_mtime = ffi.new('int64_t[1]'), ffi.new('int64_t[1]')
function uly.file_stamp(path)
  if type(path) ~= 'string' then raise('file_stamp: path must be a string, got ' .. type(path)) end
  if C.uly_file_stamp(path, stamp_size, stamp_mtime) ~= 0 then return nil, ffi.string(C.uly_last_error()) end
  return tonumber(stamp_size[0]), tonumber(stamp_mtime[0])
end

-- wall-clock seconds from a monotonic clock (for progress lines and benchmarks)
ffi.cdef [[
  struct uly_timespec { long tv_sec; long tv_nsec; };
  int clock_gettime(int clk_id, struct uly_timespec *tp);
]]
local ts = ffi.new('struct uly_timespec')
function uly.clock()
  ffi.C.clock_gettime(1, ts) -- CLOCK_MONOTONIC
  return tonumber(ts.tv_sec) + tonumber(ts.tv_nsec) * 1e-9
end

-- uly.profile_backward(fn, ...) runs fn with the backward profiler on and returns a list of
-- { op = 'MatmulBackward', calls = n, seconds = s }, slowest first, then fn's results
function uly.profile_backward(fn, ...)
  C.uly_profile_reset()
  C.uly_profile_enable(1)
  local res = { pcall(fn, ...) }
  C.uly_profile_enable(0)
  if not res[1] then error(res[2], 2) end
  local n = tonumber(C.uly_profile_report(nil, 0))
  local buf = ffi.new('char[?]', n)
  C.uly_profile_report(buf, n)
  local rows = {}
  for op, calls, secs in ffi.string(buf):gmatch('(%S+) (%d+) (%S+)\n') do
    rows[#rows + 1] = { op = op, calls = tonumber(calls), seconds = tonumber(secs) }
  end
  table.sort(rows, function(a, b) return a.seconds > b.seconds end)
  return rows, unpack(res, 2)
end

uly.nn = require 'ulysses.nn'

-- submodules loaded on first use (uly.optim, uly.data, ...), so `require 'ulysses'` stays cheap
local lazy = { optim = true, data = true, checkpoint = true, safetensors = true, h5 = true, log = true, pretrained = true, dist = true, cuda = true }
setmetatable(uly, { lazy = lazy, __index = function(t, k)   -- (lazy: the REPL completes these names too)
  if lazy[k] then
    local m = require('ulysses.' .. k)
    rawset(t, k, m)
    return m
  end
end })
return uly
