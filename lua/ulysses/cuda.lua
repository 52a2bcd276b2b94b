-- lua/ulysses/cuda.lua — uly.cuda: the CUDA library (libulysses_cuda.so, declared by
-- core/include/uly_cuda.h), loaded only when first asked, so `require 'ulysses'` and every CPU
-- run or mpirun rank never pays for the CUDA runtime. Without a library or a device every query
-- answers "none" (available() false, device_count() 0) and why() says the reason.
local ffi = require 'ffi'
local base = require 'ulysses.ffi'

local M = {}
local last_error = require('ulysses.tensor').last_error   -- the core's message, cleared

local state -- nil until first asked; then { lib = clib } or { reason = string }

-- the header without preprocessor lines or C++ guards: what ffi.cdef accepts
local header_text = require('ulysses.ffi').header_text

local function readable(path)
  local f = io.open(path, 'rb')
  if f then f:close() return true end
  return false
end

-- ULY_CUDA_LIB, else libulysses_cuda.so beside the libulysses.so in use
function M.library_path()
  local env = os.getenv('ULY_CUDA_LIB')
  if env and env ~= '' then return env end
  local dir = base.library_path:match('^(.*)/[^/]*$') or '.'
  return dir .. '/libulysses_cuda.so'
end

local function load()
  if state then return state end
  local path = M.library_path()
  if not readable(path) then
    local uly_has = base.C.uly_has_feature('cuda') ~= 0
    state = { reason = uly_has and ('no CUDA library at ' .. path .. ' (build it, or set ULY_CUDA_LIB)')
                                  or ('no CUDA library built (nvcc not found at build time, or ULY_CUDA=OFF); looked for ' .. path) }
    return state
  end
  local header = os.getenv('ULY_CUDA_HEADER') or (base.root .. '/core/include/uly_cuda.h')
  ffi.cdef(header_text(header))
  local ok, lib = pcall(ffi.load, path)
  if not ok then
    state = { reason = 'cannot load the CUDA library ' .. path .. ': ' .. tostring(lib) }
    return state
  end
  base.pin(path)   -- never unloaded: device memory and the stream outlive lua_close
  state = { lib = lib }
  return state
end

-- the loaded library (cdata namespace), or nil and the reason it is missing
function M.lib()
  local s = load()
  return s.lib, s.reason
end

function M.device_count()
  local lib = M.lib()
  if not lib then return 0 end
  return lib.uly_cuda_device_count()
end

function M.available() return M.device_count() > 0 end

-- why no device is available (nil when one is)
function M.why()
  local lib, reason = M.lib()
  if not lib then return reason end
  if lib.uly_cuda_device_count() > 0 then return nil end
  return 'no CUDA device: ' .. ffi.string(lib.uly_cuda_last_error())
end

local function check(lib, rc, what)
  if rc ~= 0 then error('uly.cuda.' .. what .. ': ' .. ffi.string(lib.uly_cuda_last_error()), 3) end
end

-- one table per device: { index, name, total_memory, free_memory (bytes), compute_capability
-- ('9.0'), multiprocessors, clock_mhz (the peak SM clock) }; {} without a device
function M.devices()
  local lib = M.lib()
  local list = {}
  if not lib then return list end
  local name = ffi.new('char[256]')
  local free_b, total_b = ffi.new('int64_t[1]'), ffi.new('int64_t[1]')
  local attr = ffi.new('int[4]')
  for dev = 0, lib.uly_cuda_device_count() - 1 do
    check(lib, lib.uly_cuda_device_name(dev, name, 256), 'devices')
    check(lib, lib.uly_cuda_device_memory(dev, free_b, total_b), 'devices')
    check(lib, lib.uly_cuda_device_attributes(dev, attr, attr + 1, attr + 2, attr + 3), 'devices')
    list[#list + 1] = { index = dev, name = ffi.string(name),
                        total_memory = tonumber(total_b[0]), free_memory = tonumber(free_b[0]),
                        compute_capability = ('%d.%d'):format(attr[0], attr[1]), multiprocessors = attr[2],
                        clock_mhz = math.floor(attr[3] / 1000 + 0.5) }
  end
  return list
end

-- the dense bf16 tensor-core peak of device `dev` (default 0) in FLOP/s and a label saying which
-- device and whether the figure is published or estimated (ulysses/gpu_peak.lua): MFU's
-- denominator on cuda. nil and why without such a device, or when its peak is not known.
function M.peak_flops(dev)
  dev = dev or 0
  if type(dev) ~= 'number' then error('uly.cuda.peak_flops: expected a device index, got ' .. type(dev), 2) end
  local lib, reason = M.lib()
  if not lib then return nil, reason end
  local info = M.devices()[dev + 1]
  if not info then return nil, ('no CUDA device %d (%d found)'):format(dev, #M.devices()) end
  return require('ulysses.gpu_peak').peak(info)
end

-- CUDA runtime / driver versions as 1000 * major + 10 * minor; 0 without the library (or driver)
function M.runtime_version()
  local lib = M.lib()
  return lib and lib.uly_cuda_runtime_version() or 0
end

function M.driver_version()
  local lib = M.lib()
  return lib and lib.uly_cuda_driver_version() or 0
end

-- the most bytes the CUDA kernels' stream-ordered temporaries (bf16 operand copies, attention
-- score chunks; outside uly.memory('cuda')) held at once since the last reset; reset = true
-- starts over. nil and the reason when the CUDA backend is not running (the simulation has none).
function M.temporaries_peak(reset)
  -- asked of the core, not of this module's state: a reloaded module (busted insulates spec
  -- files) finds the backend registered by an earlier instance
  if M.backend() ~= 'cuda' then return nil, 'the CUDA backend is not running' end
  local lib = M.lib()
  if not lib then return nil, 'the CUDA backend is not running' end
  local out = ffi.new('int64_t[1]')
  if lib.uly_cuda_temporaries_peak(out, reset and 1 or 0) ~= 0 then return nil, ffi.string(lib.uly_cuda_last_error()) end
  return tonumber(out[0])
end

-- how many times the CUDA GEMMs asked cuBLASLt's heuristic for an algorithm: once per distinct
-- problem (shape, strides, types, alignment), the answers are kept. nil when the CUDA backend is
-- not running (the simulation has none).
function M.gemm_heuristic_queries()
  if M.backend() ~= 'cuda' then return nil end
  local lib = M.lib()
  return lib and tonumber(lib.uly_cuda_gemm_heuristic_queries()) or nil
end

-- whether the fused attention kernels at head dim D run on Hopper's wgmma (sm_90a), and why:
-- 'on (...)', 'partly on: forward ...; dQ ...; dK/dV ...' (each kernel decided apart) or 'off: ...'.
-- D 64 and 128 have wgmma kernels, decided at the head dim's first call by a self-check on a
-- compute capability 9.0 GPU (ULY_CUDA_ATTN_WGMMA=0 / 1 forces it); other head dims are always
-- off. Without D: 'D 64: ...; D 128: ...'. nil when the CUDA backend is not running.
function M.wgmma_status(D)
  if D ~= nil and (type(D) ~= 'number' or D % 1 ~= 0) then
    error('uly.cuda.wgmma_status: expected a head dim (an integer; 64 and 128 have wgmma kernels) or nothing, got '
          .. type(D) .. ' ' .. tostring(D), 2)
  end
  if M.backend() ~= 'cuda' then return nil end
  local lib = M.lib()
  if not lib then return nil end
  if D then return ffi.string(lib.uly_cuda_wgmma_status(D)) end
  return ('D 64: %s; D 128: %s'):format(ffi.string(lib.uly_cuda_wgmma_status(64)), ffi.string(lib.uly_cuda_wgmma_status(128)))
end

-- f32 GEMMs (matmul, linear, the chunked attention's products) on tensor cores in TF32 (10
-- mantissa bits, f32 accumulation; the default, like PyTorch's allow_tf32), or in full f32 with
-- on = false (several times slower; agrees with the CPU to f32 rounding). Returns the previous
-- setting (true, changing nothing, without the CUDA library); uly.cuda.tf32() only reads it. bf16
-- matmuls (uly.matmul_precision) are not affected.
function M.tf32(on)
  if on ~= nil and type(on) ~= 'boolean' then
    error('uly.cuda.tf32: expected true, false or nothing, got ' .. type(on) .. ' ' .. tostring(on), 2)
  end
  local lib = M.lib()
  if not lib then return true end
  local prev = lib.uly_cuda_tf32() ~= 0
  if on ~= nil then lib.uly_cuda_set_tf32(on and 1 or 0) end
  return prev
end

-- bf16 activations (uly.activation_dtype('bf16')) through the kernels that read and write bf16
-- themselves (true, the default: norms, SwiGLU, activations, RoPE, elementwise, cross-entropy; GEMMs and attention
-- read bf16 either way) or through converting copies around the f32 kernels (false): the same
-- bits, half the memory traffic. Returns the previous setting (true without the CUDA library).
function M.bf16_kernels(on)
  if on ~= nil and type(on) ~= 'boolean' then
    error('uly.cuda.bf16_kernels: expected true, false or nothing, got ' .. type(on) .. ' ' .. tostring(on), 2)
  end
  local lib = M.lib()
  if not lib then return true end
  return lib.uly_cuda_bf16_kernels(on == nil and -1 or on and 1 or 0) ~= 0
end

-- a profiler range: ncu or nsys started with --profile-from-start off (or its equivalent) record
-- the kernels between uly.cuda.profiler(true) and uly.cuda.profiler(false) only
function M.profiler(on)
  if type(on) ~= 'boolean' then error('uly.cuda.profiler: expected true or false, got ' .. type(on), 2) end
  local lib, reason = M.lib()
  if not lib then error('uly.cuda.profiler: ' .. tostring(reason), 2) end
  if lib.uly_cuda_profiler(on and 1 or 0) ~= 0 then error('uly.cuda.profiler: ' .. ffi.string(lib.uly_cuda_last_error()), 2) end
end

-- Make device 'cuda' usable: returns true, or false and the reason. Registers the CUDA library's
-- backend table with the core on first use (one device, its stream and cuBLAS handle). With
-- ULY_CUDA_SIMULATE=1 in the environment the host-memory simulation stands in instead (runs the
-- device code paths on machines without a GPU).
function M.ensure()
  local C = base.C
  if C.uly_device_available(1) ~= 0 then return true end
  local sim = os.getenv('ULY_CUDA_SIMULATE')
  if sim and sim ~= '' and sim ~= '0' then return M.simulate() end
  local lib, reason = M.lib()
  if not lib then return false, reason end
  if lib.uly_cuda_device_count() == 0 then return false, M.why() end
  local table_ptr = lib.uly_cuda_backend()
  if table_ptr == nil then return false, 'the CUDA backend failed to start: ' .. ffi.string(lib.uly_cuda_last_error()) end
  if C.uly_device_register(1, table_ptr) ~= 0 then
    local msg = last_error()
    return false, msg
  end
  M.apply_tuned()
  return true
end

-- the tuned attention kernels (lua/ulysses/attention_tune.lua, tools/tune_attention.lua): the
-- cache's choices for this GPU and library set into the CUDA library (ULY_CUDA_TUNED=0: none);
-- on = false clears them for this process. Returns the entries in effect. A cache that cannot be
-- read or holds a name the library does not know is reported once on stderr and ignored.
local tuned_warned
function M.apply_tuned(on)
  if on ~= nil and type(on) ~= 'boolean' then
    error('uly.cuda.apply_tuned: expected true, false or nothing, got ' .. type(on) .. ' ' .. tostring(on), 2)
  end
  if M.backend() ~= 'cuda' then return {} end
  local lib = M.lib()
  local tune = require 'ulysses.attention_tune'
  if on == false then
    for _, D in ipairs(tune.DIMS) do lib.uly_cuda_attention_prefer(D, '', '', '', '') end
    return {}
  end
  local ok, applied = pcall(tune.apply, lib)
  if ok then return applied end
  pcall(function() for _, D in ipairs(tune.DIMS) do lib.uly_cuda_attention_prefer(D, '', '', '', '') end end)
  if not tuned_warned then
    tuned_warned = true
    io.stderr:write('ulysses: ignoring the tuned attention kernels: ', tostring(applied), '\n')
  end
  return {}
end

-- which fused attention kernels run at head dim D (64 or 128) in mixed precision: { fwd =, dq =,
-- dkv =, bwd = } variant names ('' the default), and from = { fwd = 'ULY_CUDA_ATTN_FWD' | 'tuned'
-- | 'default', ... }: a set variable first, then the tuned choice (tools/tune_attention.lua), then
-- the default. nil when the CUDA backend is not running. (Whether a variant can run on this GPU,
-- and wgmma_status, decide at the call: a variant that cannot runs the default, said on stderr.)
function M.attention_choice(D)
  if D ~= 64 and D ~= 128 then
    error('uly.cuda.attention_choice: expected head dim 64 or 128 (the ones with kernel variants), got ' .. tostring(D), 2)
  end
  if M.backend() ~= 'cuda' then return nil end
  local lib = M.lib()
  local tune = require 'ulysses.attention_tune'
  local choice = { from = {} }
  for i, v in ipairs(tune.VARS) do
    local env = os.getenv(tune.ENV[v])
    local pref = ffi.string(lib.uly_cuda_attention_preferred(D, i - 1))
    if env and env ~= '' then choice[v], choice.from[v] = env, tune.ENV[v]
    elseif pref ~= '' then choice[v], choice.from[v] = pref, 'tuned'
    else choice[v], choice.from[v] = '', 'default' end
  end
  return choice
end

-- attention_choice(D) in words, for a run's log: 'the built-in defaults (...)' or the variants and
-- where each came from, e.g. 'fwd=wsov (tuned), bwd=onepass (ULY_CUDA_ATTN_BWD)'; nil as attention_choice
function M.describe_attention_choice(D)
  local c = M.attention_choice(D)
  if not c then return nil end
  local parts = {}
  for _, v in ipairs(require('ulysses.attention_tune').VARS) do
    if c[v] ~= '' then parts[#parts + 1] = ('%s=%s (%s)'):format(v, c[v], c.from[v]) end
  end
  if #parts == 0 then return 'the built-in defaults (bin/ulysses tools/tune_attention.lua picks the fastest on this GPU)' end
  return table.concat(parts, ', ') .. (c.bwd == 'onepass' and '; dQ summed by atomics: its last bits vary run to run' or '')
end

-- device 'cuda' becomes the simulation (host memory behind tagged pointers that crash if the core
-- touches them directly; the CPU kernels do the arithmetic): specs of the device paths without a GPU
function M.simulate()
  local C = base.C
  if C.uly_device_simulate() ~= 0 then
    local msg = last_error()
    return false, msg
  end
  return true
end

-- device 'cuda' gets no backend again (the next use loads one); refused while it holds tensors
function M.reset()
  local C = base.C
  collectgarbage('collect')
  if C.uly_device_register(1, nil) ~= 0 then
    local msg = last_error()
    error('uly.cuda.reset: ' .. msg, 2)
  end
end

-- which backend serves device 'cuda' now: 'cuda', 'sim' or nil
function M.backend()
  local name = base.C.uly_device_backend(1)
  return name ~= nil and ffi.string(name) or nil
end

-- GPU time by kernel: runs fn(...) with every kernel launch and GEMM of the CUDA backend timed
-- on the GPU (a CUDA event before and after each), then returns a report and fn's results:
--   { wall_ms = from the start to the end on the backend's stream,
--     kernel_ms = the kernels' sum (less than wall_ms by the gaps between launches: host time,
--                 copies, NCCL),
--     kernels = { { name =, calls =, ms = }, ... } longest total first }
-- Names: the kernel's (attention and GEMMs with their shapes and paths). Profiles do not nest; an
-- error in fn stops the profile and is raised again. Events cost a few microseconds a launch, so
-- wall_ms runs a little long; compare kernels within one report.
function M.profile(fn, ...)
  if type(fn) ~= 'function' then error('uly.cuda.profile: expected a function to run, got ' .. type(fn), 2) end
  if M.backend() ~= 'cuda' then
    error('uly.cuda.profile: the CUDA backend is not running (start it: uly.device(\'cuda\') or a tensor on cuda)', 2)
  end
  local lib = M.lib()
  if lib.uly_cuda_profile_start() ~= 0 then error(ffi.string(lib.uly_cuda_last_error()), 2) end
  local results = (function(...) return { n = select('#', ...), ... } end)(pcall(fn, ...))
  local stopped = lib.uly_cuda_profile_stop() == 0
  if not results[1] then error(results[2], 0) end
  if not stopped then error(ffi.string(lib.uly_cuda_last_error()), 2) end
  local wall = ffi.new('double[1]')
  local n = lib.uly_cuda_profile_count(wall)
  local report = { wall_ms = wall[0], kernel_ms = 0, kernels = {} }
  local name, calls, ms = ffi.new('char[128]'), ffi.new('int64_t[1]'), ffi.new('double[1]')
  for i = 0, n - 1 do
    if lib.uly_cuda_profile_entry(i, name, 128, calls, ms) == 0 then
      report.kernels[#report.kernels + 1] = { name = ffi.string(name), calls = tonumber(calls[0]), ms = ms[0] }
      report.kernel_ms = report.kernel_ms + ms[0]
    end
  end
  return report, unpack(results, 2, results.n)
end

-- a profile report (uly.cuda.profile) as text: the `top` (default 20) longest kernels with their
-- share of the wall time, then the rest together and the gaps
function M.format_profile(report, top)
  if type(report) ~= 'table' or type(report.kernels) ~= 'table' then
    error('uly.cuda.format_profile: expected a report from uly.cuda.profile, got ' .. type(report), 2)
  end
  top = top or 20
  local wall = report.wall_ms > 0 and report.wall_ms or 1
  local lines = { ('%10s %6s %7s  %s'):format('GPU ms', 'share', 'calls', 'kernel') }
  local rest, rest_calls = 0, 0
  for i, k in ipairs(report.kernels) do
    if i <= top then
      lines[#lines + 1] = ('%10.3f %5.1f%% %7d  %s'):format(k.ms, 100 * k.ms / wall, k.calls, k.name)
    else
      rest, rest_calls = rest + k.ms, rest_calls + k.calls
    end
  end
  if #report.kernels > top then
    lines[#lines + 1] = ('%10.3f %5.1f%% %7d  (%d more kernels)'):format(rest, 100 * rest / wall, rest_calls,
                                                                        #report.kernels - top)
  end
  local gaps = report.wall_ms - report.kernel_ms
  lines[#lines + 1] = ('%10.3f %5.1f%%          (between kernels: host, copies, communication)'):format(
    math.max(gaps, 0), 100 * math.max(gaps, 0) / wall)
  lines[#lines + 1] = ('%10.3f %5.1f%%          wall time on the stream'):format(report.wall_ms, 100 * report.wall_ms / wall)
  return table.concat(lines, '\n')
end

-- "13.0" from 13000
function M.version_string(v) return string.format('%d.%d', math.floor(v / 1000), math.floor(v % 1000 / 10)) end

return M
