-- spec/ffi_spec.lua — the FFI surface: every function core/include/uly.h declares resolves in the
-- built library, and the library reports its build features.
local uly = require 'ulysses'
local lib = require 'ulysses.ffi'
local ffi = require 'ffi'
local helpers = require 'helpers'

describe('ffi surface', function()
  it('every declared function resolves in the library', function()
    local names = lib.declared_functions()
    assert.is_true(#names > 90, 'only ' .. #names .. ' functions found in uly.h')
    local seen, missing = {}, {}
    for _, name in ipairs(names) do
      assert.is_nil(seen[name], 'declared twice: ' .. name)
      seen[name] = true
      local ok, fn = pcall(function() return lib.C[name] end)
      if not ok or fn == nil then missing[#missing + 1] = name end
    end
    assert.are.same({}, missing)
    -- the scan really parses the header: known names are in, the typedef is not
    for _, name in ipairs({ 'uly_last_error', 'uly_tensor_empty', 'uly_backward', 'uly_attention',
                            'uly_memory_set_limit', 'uly_tensor_cat', 'uly_rng_set_state' }) do
      assert.is_true(seen[name], name .. ' not found by declared_functions()')
    end
    assert.is_nil(seen.uly_tensor)
    -- and a name that is not there fails to resolve (the check above can fail)
    assert.is_false(pcall(function() return lib.C.uly_no_such_function end))
  end)

  it('every submodule the package loads on first use is there (uly.optim, uly.pretrained, ...)', function()
    local n = 0
    for name in pairs(getmetatable(uly).lazy) do
      local ok, m = pcall(function() return uly[name] end)
      assert.is_true(ok, 'uly.' .. name .. ': ' .. tostring(m))
      assert.are.equal('table', type(m), 'uly.' .. name)
      n = n + 1
    end
    assert.is_true(n >= 9, tostring(n))
  end)

  it('file_stamp gives a file\'s size and modification time, and nil with the reason for a missing one', function()
    local dir = helpers.mkdtemp()
    helpers.write_file(dir .. '/a', 'abc')
    local size, mtime = uly.file_stamp(dir .. '/a')
    assert.are.equal(3, size)
    assert.is_true(math.abs(mtime / 1e9 - os.time()) < 3600, tostring(mtime))
    helpers.write_file(dir .. '/a', 'abcdef')
    local size2, mtime2 = uly.file_stamp(dir .. '/a')
    assert.are.equal(6, size2)
    assert.is_true(mtime2 >= mtime)
    local none, why = uly.file_stamp(dir .. '/b')
    assert.is_nil(none)
    assert.are.equal("file_stamp: cannot stat '" .. dir .. "/b': No such file or directory", why)
    helpers.rmtree(dir)
  end)

  it('declared_functions matches every prototype line of the header', function()
    local count = 0
    for line in io.lines(lib.header_path) do
      if not line:match('^%s*/?%*') and line:match('^[%w_][%w_%s%*]*[%s%*]uly_[%w_]+%s*%(') then count = count + 1 end
    end
    assert.are.equal(count, #lib.declared_functions())
  end)

  it('reports OpenMP, the BLAS core and a version', function()
    assert.is_true(uly.has('openmp'))
    assert.is_false(uly.has('no-such-feature'))
    local core = uly.blas_corename()
    assert.are.equal('string', type(core))
    assert.is_true(#core > 0)
    assert.matches('^%d+%.%d+%.%d+', uly.version)
    assert.is_true(uly.get_num_threads() >= 1)
  end)

  it('picks the OpenBLAS kernels a CPU runs best where the user has not (OPENBLAS_CORETYPE)', function()
    assert.are.equal('SkylakeX', lib.blas_coretype_for('fpu sse2 avx2 fma avx512f avx512dq avx512cd avx512bw avx512vl'))
    assert.are.equal('Haswell', lib.blas_coretype_for('fpu sse2 avx avx2 fma avx512f'))   -- AVX-512 F alone: not enough
    assert.is_nil(lib.blas_coretype_for('fpu sse2 avx'))
    local helpers = require 'helpers'
    local ulysses = lib.root .. '/bin/ulysses'
    local function corename(env)
      local out = helpers.run(env .. ' ' .. helpers.shq(ulysses) .. " -e 'print(\"core=\" .. uly.blas_corename())'")
      return out:match('core=(%S+)'), out
    end
    local want = lib.blas_coretype_for(lib.cpu_flags() or '')
    if want then
      local got, out = corename('env -u OPENBLAS_CORETYPE')
      assert.are.equal(want, got, out)
    end
    local got, out = corename('OPENBLAS_CORETYPE=Prescott')   -- the user's choice stands
    assert.are.equal('Prescott', got, out)
  end)

  -- the MFU denominator on the CPU: loose physical bounds only (never a timing threshold): more
  -- than 1 GFLOP/s a thread, and no more than 16 lanes x 2 FLOPs x 2 FMA units at 6 GHz a thread
  -- (a wrong FLOP count per round would break one bound or the other)
  it('measures the CPU FMA peak within physical bounds', function()
    for _, threads in ipairs({ 1, 2 }) do
      local peak = uly.cpu_peak_flops(threads)
      assert.is_true(peak > 1e9 * threads, ('%d threads: %g FLOP/s'):format(threads, peak))
      assert.is_true(peak < 16 * 2 * 2 * 6e9 * threads, ('%d threads: %g FLOP/s'):format(threads, peak))
    end
  end)

  -- a peak measured up to 3 times while it stays at or below `floor`: another process on the
  -- machine can only slow a measurement down, so the best of a few is the one to bound
  local function best_peak(measure, floor)
    local best = measure()
    for _ = 2, 3 do
      if best > floor then break end
      best = math.max(best, measure())
    end
    return best
  end

  -- the AMX tiles' bf16 peak: above the f32 FMA peak, below 1024 FLOP a cycle a thread at 6 GHz
  -- (one 16 x 16 x 32 tile product per 16 cycles); 0 where AMX is off
  it('measures the AMX bf16 peak within physical bounds, or 0 without AMX', function()
    if uly.cpu_amx() ~= 'on' then
      assert.are.equal(0, uly.cpu_amx_peak_flops(1))
      return
    end
    for _, threads in ipairs({ 1, 2 }) do
      local f32 = uly.cpu_peak_flops(threads)
      local peak = best_peak(function() return uly.cpu_amx_peak_flops(threads) end, f32)
      assert.is_true(peak > f32, ('%d threads: %g FLOP/s, the f32 FMA peak %g'):format(threads, peak, f32))
      assert.is_true(peak < 1024 * 6e9 * threads, ('%d threads: %g FLOP/s'):format(threads, peak))
    end
  end)

  -- VDPBF16PS's bf16 peak (16 lanes x 2 multiply-adds an instruction): above a quarter of the f32
  -- FMA peak (half of it measured on an Intel VM), below two instructions a cycle a thread at 6 GHz;
  -- 0 where the engine is off. The bf16 GEMM engine's peak: 0 where none runs.
  it('measures the AVX512-BF16 peak within physical bounds, or 0 without it', function()
    if uly.cpu_avx512_bf16() ~= 'on' then assert.are.equal(0, uly.cpu_avx512_bf16_peak_flops(1)) end
    local ok, err = pcall(function()
      if uly.cpu_avx512_bf16(true) ~= 'on' then return end   -- wherever the CPU has it
      for _, threads in ipairs({ 1, 2 }) do
        local f32 = uly.cpu_peak_flops(threads)
        local peak = best_peak(function() return uly.cpu_avx512_bf16_peak_flops(threads) end, f32 / 4)
        assert.is_true(peak > f32 / 4, ('%d threads: %g FLOP/s, the f32 FMA peak %g'):format(threads, peak, f32))
        assert.is_true(peak < 2 * 64 * 6e9 * threads, ('%d threads: %g FLOP/s'):format(threads, peak))
      end
    end)
    uly.cpu_avx512_bf16('auto')
    assert(ok, err)
    assert.are.equal(uly.cpu_bf16_gemm():match('^off') ~= nil, uly.cpu_bf16_peak_flops(1) == 0)
  end)

  it('dtype names and sizes agree with the Lua side', function()
    local C = lib.C
    local expect = { [0] = { 'f32', 4 }, { 'bf16', 2 }, { 'i32', 4 }, { 'i64', 8 }, { 'f64', 8 } }
    for code = 0, 4 do
      assert.are.equal(expect[code][1], ffi.string(C.uly_dtype_name(code)))
      assert.are.equal(expect[code][2], tonumber(C.uly_dtype_size(code)))
    end
    assert.are.equal('invalid-dtype', ffi.string(C.uly_dtype_name(99)))
  end)
end)
