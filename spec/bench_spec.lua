-- spec/bench_spec.lua — bench/train.lua, the training-step benchmark the README's tables come
-- from (and bench/attention.lua's rows, briefly): it runs a shape and prints its row (step time,
-- tokens/s, GFLOP/s, MFU, with f32 or bf16 activations and matmuls), bad flags give a
-- clear message and exit 2, and --torch_alloc jemalloc runs the PyTorch peer on jemalloc (where
-- /usr/bin/python3 has torch, libjemalloc2 is installed and ../shared/peers holds the peer's
-- script; a clean clone in CI has none of them). Never on time.
local uly = require 'ulysses'
local helpers = require 'helpers'

local function run(args) return helpers.run('bin/ulysses bench/train.lua ' .. args) end

local function has_torch() return select(2, helpers.run('/usr/bin/python3 -c "import torch"')) == 0 end

-- the row of shape TxB: tokens/s, GFLOP/s, MFU %
local function row(out, shape)
  local tps, gf, mfu = out:match('\n' .. shape .. '%s+%d+%s+[%d.]+%s+[%d.]+%s+[%d.]+%s+[%d.]+%s+([%d.]+)%s+([%d.]+)%s+([%d.]+)%%')
  return tonumber(tps), tonumber(gf), tonumber(mfu)
end

describe('bench/train.lua', function()
  it('times a shape and prints its row, with f32 and bf16 activations', function()
    local out, code = run('--shapes 32x2 --steps 1 --warmup 0 --preset tiny --activations f32,bf16')
    assert.equals(0, code, out)
    local tps, gf, mfu = row(out, '32x2')
    assert.truthy(tps, 'no row for 32x2 in:\n' .. out)
    assert.is_true(tps > 0 and gf > 0 and mfu > 0, out)
    local f32_peak, bf16_peak = out:match('\n32x2 .- ([%d.]+)%s+f32%s+f32\n32x2 .- ([%d.]+)%s+bf16%s+f32\n')
    assert.truthy(f32_peak and bf16_peak, 'no f32 and bf16 rows in:\n' .. out)
  end)

  it('times a shape with f32 and with bf16 matmuls, saying which engine runs the bf16 ones', function()
    local out, code = run('--shapes 32x2 --steps 1 --warmup 0 --preset tiny --precision f32,bf16')
    assert.equals(0, code, out)
    local engine = uly.cpu_bf16_gemm()
    assert.truthy(out:find('\nbf16 GEMM engine: ' .. engine .. (engine == 'amx' and '; MFU of bf16 rows vs ' or ''), 1, true),
                  out)
    local f32_tps, bf16_tps = out:match('\n32x2 .- ([%d.]+) .-%s+f32%s+f32\n32x2 .- ([%d.]+) .-%s+f32%s+bf16\n')
    assert.truthy(f32_tps and bf16_tps, 'no f32 and bf16 precision rows in:\n' .. out)
  end)

  it('refuses what it does not know, saying what it knows', function()
    local out, code = run('--torch_alloc tcmalloc')
    assert.equals(2, code, out)
    assert.truthy(out:find('--torch_alloc tcmalloc: unknown (known: jemalloc)', 1, true), out)
    out, code = run('--shapes 32by2')
    assert.equals(2, code, out)
    assert.truthy(out:find('bad shape 32by2', 1, true), out)
    out, code = run('--activations f16')
    assert.equals(2, code, out)
    assert.truthy(out:find('bad --activations f16 (want f32 or bf16)', 1, true), out)
  end)

  it('runs the PyTorch peer on jemalloc with --torch_alloc jemalloc', function()
    local jemalloc = '/usr/lib/x86_64-linux-gnu/libjemalloc.so.2'
    if not helpers.exists(jemalloc) then
      local out, code = run('--shapes 32x2 --steps 1 --warmup 0 --preset tiny --torch_alloc jemalloc')
      assert.equals(2, code, out)
      assert.truthy(out:find('apt-get install libjemalloc2', 1, true), out)
      return
    end
    -- the peer: Debian's python3-torch running ../shared/peers/torch_gpt_bench.py
    local script = require('ulysses.ffi').root .. '/../shared/peers/torch_gpt_bench.py'
    if not (has_torch() and helpers.exists(script)) then return end
    local out, code = run('--shapes 32x2 --steps 1 --warmup 0 --preset tiny --torch_alloc jemalloc')
    assert.equals(0, code, out)
    local ours, theirs = out:match('\n32x2%s+(%d+)%s+(%d+)%s+[%d.]+x[^\n]*, jemalloc%)')
    assert.truthy(ours and tonumber(theirs) > 0, 'no jemalloc peer row in:\n' .. out)
  end)
end)

describe('bench/train.lua --precision bf16 --torch', function()
  it('runs the PyTorch peer under autocast in bf16 (where torch and the peer script are)', function()
    local script = require('ulysses.ffi').root .. '/../shared/peers/torch_gpt_bench.py'
    if not (has_torch() and helpers.exists(script)) then return end
    local out, code = run('--shapes 32x2 --steps 1 --warmup 0 --preset tiny --precision bf16 --torch')
    assert.equals(0, code, out)
    assert.truthy(out:match('\n32x2%s+%d+%s+%d+%s+[%d.]+x[^\n]*, autocast bf16%)'), 'no autocast peer row in:\n' .. out)
  end)
end)

describe('bench/attention.lua', function()
  it('prints flash, reference and (with --bf16) bf16 flash rows, and sliding-window rows', function()
    local out, code = helpers.run('bin/ulysses bench/attention.lua --max 1024 --window-max 1024 --no-torch --bf16')
    assert.equals(0, code, out)
    assert.truthy(out:find('\nbf16 precision on AMX tiles: ' .. uly.cpu_amx() .. '\n', 1, true), out)
    for _, label in ipairs { 'flash', 'reference', 'flash bf16' } do
      assert.truthy(out:find('\n' .. label .. '%s+1024%s+[%d.]+%s+[%d.]+%s+[%d.]+%s+[%d.]+%s+[%d.]+'), label .. ' row missing:\n' .. out)
    end
    assert.truthy(out:find("flash bf16 .- [%d.]+x the f32 flash's speed"), out)
    assert.truthy(out:find('== sliding window', 1, true) and out:find('us/token', 1, true), out)
  end)
end)

describe('bench/matmul.lua', function()
  it('prints the bf16 table (--only bf16): f32 and bf16 operands within bf16\'s precision of the f32 product', function()
    local out, code = helpers.run('bin/ulysses bench/matmul.lua --only bf16 --seconds 0.01')
    assert.equals(0, code, out)
    assert.truthy(out:find('bf16 GEMM engine: ' .. uly.cpu_bf16_gemm(), 1, true), out)
    local rows = 0
    for e32, e16 in out:gmatch('\n  [^\n]-|%s+[%d.]+%s+[%d.]+%s+[%d.]+ |%s+[%d.]+%s+[%d.]+ |%s+(%S+)%s+(%S+)') do
      rows = rows + 1
      -- operands rounded to 8 bits (and a bf16 result): a few 2^-9 of the largest value; a wrong
      -- product is O(1), an f32 one below 1e-5
      for _, e in ipairs { tonumber(e32), tonumber(e16) } do assert.is_true(e > 1e-5 and e < 2e-2, out) end
    end
    assert.equals(4, rows, out)
    assert.is_nil(out:find('per-op overhead', 1, true), '--only bf16 printed the other tables:\n' .. out)
    local _, bad = helpers.run('bin/ulysses bench/matmul.lua --only f16')
    assert.equals(1, bad)
  end)
end)
