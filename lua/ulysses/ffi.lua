-- lua/ulysses/ffi.lua — loads libulysses.so and declares its API to the FFI from
-- core/include/uly.h itself (the one source of truth), once per process.
local ffi = require 'ffi'

local M = {}

-- the repository root, found from this file's own path (lua/ulysses/ffi.lua)
local here = debug.getinfo(1, 'S').source:match('^@(.*)/[^/]*$') or '.'
M.package_dir = here
M.root = here:gsub('/lua/ulysses$', '')
if M.root == here then M.root = here .. '/../..' end

local function readable(path)
  local f = io.open(path, 'rb')
  if f then f:close() return true end
  return false
end

local function first_existing(env_name, default)
  local from_env = os.getenv(env_name)
  if from_env and from_env ~= '' then return readable(from_env) and from_env or nil end
  return readable(default) and default or nil
end

-- the header with preprocessor lines and C++ guards removed: what ffi.cdef accepts
local function header_text(path)
  local out, skip = {}, false
  for line in io.lines(path) do
    if line:match('^#%s*ifdef%s+__cplusplus') then skip = true
    elseif skip and line:match('^#%s*endif') then skip = false
    elseif not skip and not line:match('^%s*#') then out[#out + 1] = line end
  end
  return table.concat(out, '\n')
end
M.header_text = header_text   -- also used for core/include/uly_cuda.h (lua/ulysses/cuda.lua)

M.header_path = first_existing('ULY_HEADER', M.root .. '/core/include/uly.h')
if not M.header_path then
  error('ulysses: cannot find core/include/uly.h (looked under ' .. M.root .. '); set ULY_HEADER', 2)
end
M.library_path = first_existing('ULY_LIB', M.root .. '/build/libulysses.so')
if not M.library_path then
  error('ulysses: cannot find build/libulysses.so under ' .. M.root ..
        '; build it first (scripts/setup.sh, or cmake -S . -B build && cmake --build build) or set ULY_LIB', 2)
end

M.header = header_text(M.header_path)

-- OpenMP worker threads that spin after each parallel region steal the cores from OpenBLAS's
-- own threads (measured: a training step 23x slower on 2 cores). Let idle workers sleep unless
-- the user chose a policy; libgomp reads this when it is loaded, just below.
-- OpenBLAS runs single-threaded: the library splits large GEMMs over its own OpenMP threads
-- (kernels/cpu/matmul.c), and OpenBLAS's pthread pool would only spin beside them.
-- M.env_set names what was set here, so benchmarks can launch their peers without it.
M.env_set = {}
if ffi.os ~= 'Windows' then
  ffi.cdef 'int setenv(const char *name, const char *value, int overwrite);'
  for name, value in pairs({ OMP_WAIT_POLICY = 'passive', OPENBLAS_NUM_THREADS = '1' }) do
    if not os.getenv(name) then
      ffi.C.setenv(name, value, 0)
      M.env_set[#M.env_set + 1] = name
    end
  end
end

-- The OpenBLAS kernel family for a CPU's flags (/proc/cpuinfo), or nil: the widest it runs.
-- OpenBLAS 0.3.21 (Debian 12) picks old kernels on CPUs newer than itself: Prescott (SSE3) on
-- Sapphire / Emerald Rapids, a third of SkylakeX's sgemm rate there; Haswell-class ones on Zen 4
-- and 5, about half. Set before the library loads (OpenBLAS reads it then), only where the user
-- has not chosen; kept for child processes, so a peer benchmark runs on the same kernels.
function M.blas_coretype_for(flags)
  local has = {}
  for f in tostring(flags):gmatch('%S+') do has[f] = true end
  if has.avx512f and has.avx512bw and has.avx512dq and has.avx512vl and has.avx512cd then return 'SkylakeX' end
  if has.avx2 and has.fma then return 'Haswell' end
  return nil
end
function M.cpu_flags()
  local f = io.open('/proc/cpuinfo', 'r')
  if not f then return nil end
  local flags
  for line in f:lines() do
    flags = line:match('^flags%s*:%s*(.*)$')
    if flags then break end
  end
  f:close()
  return flags
end
M.blas_coretype_chosen = nil   -- what was set here, if anything
if ffi.os == 'Linux' and (os.getenv('OPENBLAS_CORETYPE') or '') == '' then
  local core = M.blas_coretype_for(M.cpu_flags() or '')
  if core then
    ffi.C.setenv('OPENBLAS_CORETYPE', core, 1)
    M.blas_coretype_chosen = core
  end
end

ffi.cdef(M.header)
M.C = ffi.load(M.library_path)
-- Pin the library (and so libgomp/OpenBLAS) for the life of the process: lua_close would
-- otherwise dlclose it while OpenMP/BLAS worker threads are still parked in that code, and the
-- process crashes on exit. RTLD_NOLOAD | RTLD_NODELETE | RTLD_LAZY, glibc values.
function M.pin(path)
  if ffi.os ~= 'Linux' then return end
  pcall(function()
    pcall(ffi.cdef, 'void *dlopen(const char *filename, int flags);')
    ffi.C.dlopen(path, 0x00004 + 0x01000 + 0x00001)
  end)
end
M.pin(M.library_path)

-- every function name the header declares (the FFI-surface spec checks they all resolve)
function M.declared_functions()
  local names = {}
  local code = M.header:gsub('/%*.-%*/', ' '):gsub('//[^\n]*', ' ')  -- not names mentioned in comments
  for name in code:gmatch('[%w_%*%s]+[%s%*](uly_[%w_]+)%s*%(') do names[#names + 1] = name end
  return names
end

return M
