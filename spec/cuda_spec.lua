-- spec/cuda_spec.lua — uly.cuda: the CUDA library is loaded lazily (never by `require 'ulysses'`),
-- answers "no device" cleanly with the CUDA error as its reason, and checks its arguments; the
-- #gpu blocks (scripts/gpu-check.sh on a GPU machine) check devices, buffers and the fill kernel.
local uly = require 'ulysses'
local ffi = require 'ffi'
local helpers = require 'helpers'

local function readable(path)
  local f = io.open(path, 'rb')
  if f then f:close() return true end
  return false
end

-- run a Lua chunk in a fresh luajit with this environment; its output
local function child(code)
  local p = assert(io.popen("LUA_PATH='lua/?.lua;lua/?/init.lua;;' luajit -e '" .. code .. "' 2>&1"))
  local out = p:read('*a')
  p:close()
  return out
end

describe('uly.cuda loading', function()
  it('is not loaded by require "ulysses", only when first asked', function()
    local out = child([[
      local function mapped()
        local f = io.open("/proc/self/maps") local s = f:read("*a") f:close()
        return (s:match("libulysses_cuda") or s:match("libcudart") or s:match("libcublas")) and "yes" or "no"
      end
      local uly = require "ulysses"
      io.write("after require: ", mapped(), "\n")
      local n = uly.cuda.device_count()
      io.write("after asking: ", mapped(), " ", n, "\n")]])
    assert.matches('after require: no\n', out, 1, true)
    local lib_present = readable(uly.cuda.library_path())
    assert.matches('after asking: ' .. (lib_present and 'yes' or 'no') .. ' %d+\n', out)
  end)

  it('has a library exactly when libulysses reports the cuda feature', function()
    local lib, reason = uly.cuda.lib()
    assert.equal(uly.has('cuda'), readable(uly.cuda.library_path()))
    assert.equal(uly.has('cuda'), lib ~= nil)
    if not lib then
      assert.matches('no CUDA library built', reason, 1, true)
      assert.equal(0, uly.cuda.runtime_version())
    else
      assert.is_nil(reason)
      assert.is_true(uly.cuda.runtime_version() >= 11000)
    end
  end)

  it('is built wherever nvcc is installed, unless the build chose ULY_CUDA=OFF', function()
    -- the build's own choice, from the CMake cache beside the libulysses.so in use
    local dir = require('ulysses.ffi').library_path:match('^(.*)/[^/]*$') or '.'
    local f = io.open(dir .. '/CMakeCache.txt')
    if not f then return end -- an installed library: no build to compare with
    local choice = f:read('*a'):match('\nULY_CUDA:STRING=(%w+)')
    f:close()
    if choice == 'OFF' then
      assert.is_false(uly.has('cuda'))
      assert.matches('no CUDA library built', uly.cuda.why(), 1, true)
    elseif readable('/usr/local/cuda/bin/nvcc') then
      assert.is_true(uly.has('cuda'))
      assert.is_true(readable(uly.cuda.library_path()))
    end
  end)

  -- ptxas can silently make a kernel's wgmmas wait for each other (its C7520 note: several times
  -- slower, as the backward kernels were); scripts/sass-check.sh compiles the fused attention
  -- for sm_90a and fails on it, so this is caught without a GPU (about 30 s). #release_only: it
  -- checks the compiler's output, not our library, so scripts/test.sh runs it once, not again in
  -- the sanitizer pass
  it('compiles the fused attention for Hopper with no wgmma serialised by ptxas #release_only', function()
    if not readable('/usr/local/cuda/bin/nvcc') then
      pending('no nvcc here')
      return
    end
    -- without a sanitizer's LD_PRELOAD (run by hand under one): bash under LeakSanitizer exits 1
    -- on its own leaks
    local p = assert(io.popen('env -u LD_PRELOAD scripts/sass-check.sh --quiet 2>&1; echo "exit $?"'))
    local out = p:read('*a')
    p:close()
    assert.matches('sass%-check: ok', out)
    assert.matches('exit 0\n$', out)
  end)
end)

describe('uly.cuda without a device', function()
  it('answers "none" with the reason, and does not crash', function()
    local n = uly.cuda.device_count()
    assert.equal(n > 0, uly.cuda.available())
    if n > 0 then
      assert.is_nil(uly.cuda.why())
      assert.equal(n, #uly.cuda.devices())
      return
    end
    assert.same({}, uly.cuda.devices())
    assert.equal(0, uly.cuda.driver_version())
    local why = uly.cuda.why()
    assert.is_string(why)
    if uly.cuda.lib() then
      assert.matches('^no CUDA device: cudaGetDeviceCount: cuda error %d+ %(cuda%w+: .+%)$', why)
    end
    -- asking again gives the same answer (the error was cleared, not left sticky)
    assert.equal(0, uly.cuda.device_count())
    assert.equal(why, uly.cuda.why())
  end)

  it('refuses bad arguments with messages naming the call', function()
    local lib = uly.cuda.lib()
    if not lib then return end
    local msg = function() return ffi.string(lib.uly_cuda_last_error()) end
    local name = ffi.new('char[64]')
    assert.equal(-1, lib.uly_cuda_device_name(99, name, 64))
    assert.matches('uly_cuda_device_name: device 99 does not exist', msg(), 1, true)
    local f, t = ffi.new('int64_t[1]'), ffi.new('int64_t[1]')
    assert.equal(-1, lib.uly_cuda_device_memory(-1, f, t))
    assert.matches('device -1 does not exist', msg(), 1, true)
    assert.is_true(lib.uly_cuda_malloc(0) == nil)
    assert.matches('uly_cuda_malloc: needs a positive byte count', msg(), 1, true)
    assert.equal(-1, lib.uly_cuda_fill_f32(nil, 10, 1))
    assert.matches('uly_cuda_fill_f32: needs a device buffer', msg(), 1, true)
    assert.equal(-1, lib.uly_cuda_memcpy_h2d(nil, nil, -1))
    assert.matches('uly_cuda_memcpy_h2d', msg(), 1, true)
    if uly.cuda.device_count() == 0 then
      assert.is_true(lib.uly_cuda_malloc(16) == nil)
      assert.matches('^cudaMalloc of 16 bytes: cuda error %d+', msg())
    end
  end)

  it('knows the dense bf16 peaks of data-centre GPUs by name, estimates others, and says when it cannot', function()
    local peak = require('ulysses.gpu_peak').peak
    for name, tflops in pairs({ ['NVIDIA H100 80GB HBM3'] = 989, ['NVIDIA H100 PCIe'] = 756, ['NVIDIA H100 NVL'] = 835,
                                ['NVIDIA H200'] = 989, ['NVIDIA GH200 480GB'] = 989, ['NVIDIA A100-SXM4-80GB'] = 312,
                                ['NVIDIA A100 80GB PCIe'] = 312, ['NVIDIA L40S'] = 362, ['NVIDIA L4'] = 121, ['NVIDIA B200'] = 2250 }) do
      -- the name decides, whatever the attributes say
      local flops, label = peak({ name = name, compute_capability = '7.0', multiprocessors = 1, clock_mhz = 1 })
      assert.equal(tflops * 1e12, flops, name)
      assert.truthy(label:find(name .. ' bf16 dense peak (published, ' .. tflops .. ' TFLOP/s)', 1, true), label)
    end
    -- unknown names: multiprocessors x clock x the architecture's dense bf16 FLOPs per clock
    local flops, label = peak({ name = 'Some H-class GPU', compute_capability = '9.0', multiprocessors = 132, clock_mhz = 1830 })
    assert.equal(132 * 1830e6 * 4096, flops)
    assert.truthy(label:find('estimated: 132 SMs x 1830 MHz x 4096', 1, true), label)
    assert.equal(108 * 1410e6 * 2048, (peak({ name = 'x', compute_capability = '8.0', multiprocessors = 108, clock_mhz = 1410 })))
    -- a name that only contains a known one as part of a word is not that GPU ('GH200' is not 'H20')
    assert.equal(989e12, (peak({ name = 'NVIDIA GH200 480GB' })))
    flops, label = peak({ name = 'Old GPU', compute_capability = '7.5', multiprocessors = 40, clock_mhz = 1590 })
    assert.is_nil(flops)
    assert.truthy(label:find('no bf16 peak known for Old GPU (compute capability 7.5)', 1, true), label)
    assert.has_error(function() peak('H100') end, 'gpu_peak.peak: expected a device table (uly.cuda.devices()), got string')
    assert.has_error(function() uly.cuda.peak_flops('0') end, 'uly.cuda.peak_flops: expected a device index, got string')
    if uly.cuda.device_count() == 0 then assert.is_nil((uly.cuda.peak_flops())) end
  end)

  it('formats versions', function()
    assert.equal('13.0', uly.cuda.version_string(13000))
    assert.equal('12.4', uly.cuda.version_string(12040))
  end)
end)

describe('uly.cuda on a device #gpu', function()
  local lib
  setup(function()
    lib = uly.cuda.lib()
    assert(uly.cuda.available(), uly.cuda.why())
  end)
  local function msg() return ffi.string(lib.uly_cuda_last_error()) end

  it('lists devices with names, memory and versions', function()
    assert.is_true(uly.cuda.device_count() >= 1)
    local devs = uly.cuda.devices()
    assert.equal(uly.cuda.device_count(), #devs)
    for _, d in ipairs(devs) do
      assert.is_true(#d.name > 0)
      assert.is_true(d.total_memory > 2 ^ 30)
      assert.is_true(d.free_memory > 0 and d.free_memory <= d.total_memory)
      assert.matches('^%d+%.%d$', d.compute_capability)
      assert.is_true(d.multiprocessors >= 1 and d.clock_mhz >= 100, d.multiprocessors .. ' SMs at ' .. d.clock_mhz .. ' MHz')
    end
    local flops, label = uly.cuda.peak_flops()
    assert.truthy(flops and flops > 1e13, label)
    assert.is_true(uly.cuda.driver_version() >= uly.cuda.runtime_version())
    assert.is_nil(uly.cuda.why())
  end)

  for _, n in ipairs({ 1, 1000, 10 ^ 7 }) do
    it(('fills %d floats'):format(n) .. ' on the device and reads them back', function()
      local d = ffi.cast('float *', lib.uly_cuda_malloc(4 * n))
      assert(d ~= nil, msg())
      local host = ffi.new('float[?]', n + 1)
      host[n] = 42 -- a guard past the copied range
      assert.equal(0, lib.uly_cuda_fill_f32(d, n, -2.5), msg())
      assert.equal(0, lib.uly_cuda_memcpy_d2h(host, d, 4 * n), msg())
      local bad = 0
      for i = 0, n - 1 do if host[i] ~= -2.5 then bad = bad + 1 end end
      assert.equal(0, bad)
      assert.equal(42, host[n])
      -- a fill of the first half only leaves the rest alone
      local half = math.floor(n / 2)
      assert.equal(0, lib.uly_cuda_fill_f32(d, half, 7), msg())
      assert.equal(0, lib.uly_cuda_memcpy_d2h(host, d, 4 * n), msg())
      assert.equal(half > 0 and 7 or -2.5, host[0])
      assert.equal(-2.5, host[n - 1])
      assert.equal(0, lib.uly_cuda_free(d), msg())
    end)
  end

  it('copies random bytes host -> device -> host unchanged', function()
    helpers.reseed(61)
    local n = 3 * 2 ^ 20 + 7
    local src, back = ffi.new('uint8_t[?]', n), ffi.new('uint8_t[?]', n)
    for i = 0, n - 1 do src[i] = math.random(0, 255) end
    local d = lib.uly_cuda_malloc(n)
    assert(d ~= nil, msg())
    assert.equal(0, lib.uly_cuda_memcpy_h2d(d, src, n), msg())
    assert.equal(0, lib.uly_cuda_memcpy_d2h(back, d, n), msg())
    local diff = 0
    for i = 0, n - 1 do if src[i] ~= back[i] then diff = diff + 1 end end
    assert.equal(0, diff)
    assert.equal(0, lib.uly_cuda_free(d), msg())
  end)

  it('frees memory back to the device', function()
    local before = uly.cuda.devices()[1].free_memory
    local bytes = 2 ^ 30
    local d = lib.uly_cuda_malloc(bytes)
    assert(d ~= nil, msg())
    local during = uly.cuda.devices()[1].free_memory
    assert.is_true(before - during >= bytes)
    assert.equal(0, lib.uly_cuda_free(d), msg())
    assert.is_true(uly.cuda.devices()[1].free_memory - during >= bytes)
  end)

  it('fails a huge allocation with a message, and keeps working after it', function()
    local d = lib.uly_cuda_malloc(2 ^ 50)
    assert.is_true(d == nil)
    assert.matches('^cudaMalloc of %d+ bytes: cuda error %d+ %(cudaErrorMemoryAllocation', msg())
    local ok = lib.uly_cuda_malloc(1024)
    assert(ok ~= nil, msg())
    assert.equal(0, lib.uly_cuda_free(ok), msg())
  end)
end)
