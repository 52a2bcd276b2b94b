-- spec/cpu_bf16_gemm_spec.lua — the CPU backend's bf16 GEMMs (kernels/cpu/matmul.c
-- gemm_batched_bf16: the AMX tiles of gemm_amx.c or VDPBF16PS of gemm_avx512_bf16.c where the CPU
-- has them, else OpenBLAS on rounded copies) and flash attention handed bf16 tensors: in bf16
-- matmul precision, a bf16 operand is read as it is and a bf16 result (bf16 activations) is the
-- f32 result rounded once, so each gives the bits of the same op on f32 copies of its operands,
-- its result rounded after. Every case runs on each engine the CPU has and on OpenBLAS.
local uly = require 'ulysses'
local helpers = require 'helpers'

-- the engines to run on: the settings of uly.cpu_amx and uly.cpu_avx512_bf16 for each, and what
-- uly.cpu_bf16_gemm() then says ('off: ...' for OpenBLAS)
local engines = {}
if uly.cpu_amx() == 'on' then engines[#engines + 1] = { name = 'AMX', amx = true, avx = true, key = 'amx' } end
if uly.cpu_avx512_bf16(true) == 'on' then   -- wherever the CPU has it (by default only where it pays)
  engines[#engines + 1] = { name = 'AVX512-BF16', amx = false, avx = true, key = 'avx512_bf16' }
end
uly.cpu_avx512_bf16('auto')
engines[#engines + 1] = { name = 'OpenBLAS', amx = false, avx = false, key = 'off' }

-- fn() under bf16 matmul precision on the engine; settings restored even when fn fails
local function with(engine, fn)
  local prev_p = uly.matmul_precision('bf16')
  uly.cpu_amx(engine.amx)
  uly.cpu_avx512_bf16(engine.avx)
  local ok, err = pcall(function()
    assert.are.equal(engine.key, uly.cpu_bf16_gemm():match('^[%w_]+'))
    fn()
  end)
  uly.matmul_precision(prev_p)
  uly.cpu_amx(true)
  uly.cpu_avx512_bf16('auto')
  assert(ok, err)
end

-- a [rows, cols] bf16 matrix, or the transposed view of a [cols, rows] one
local function bf16_matrix(rows, cols, transposed)
  return transposed and uly.randn(cols, rows):bf16():t() or uly.randn(rows, cols):bf16()
end

describe('bf16 GEMMs on the CPU', function()
  it('read bf16 operands as they are and round a bf16 result once (the bits of f32 copies, rounded after)', function()
    -- sizes past one packed panel of K (1024) and of columns (512), partial tiles, K of 1
    local sizes = { { 1, 1, 1 }, { 5, 7, 3 }, { 33, 65, 1 }, { 31, 33, 35 }, { 70, 40, 600 }, { 40, 530, 1100 } }
    for _, engine in ipairs(engines) do
      with(engine, function()
        helpers.reseed(11)
        for _, s in ipairs(sizes) do
          local M, N, K = s[1], s[2], s[3]
          for _, tr in ipairs { { false, false }, { true, false }, { false, true }, { true, true } } do
            local a, b = bf16_matrix(M, K, tr[1]), bf16_matrix(K, N, tr[2])
            local what = ('%s %d x %d x %d%s%s'):format(engine.name, M, N, K, tr[1] and ' A^T' or '',
                                                       tr[2] and ' B^T' or '')
            local y = uly.matmul(a, b)
            assert.are.equal('bf16', y:dtype(), what)
            local ref = uly.matmul(a:float(), b:float())
            helpers.assert_close(y:float(), ref:bf16():float(), 0, 0, what .. ': bf16 result')
            -- an f32 result from bf16 operands (a weight gradient's shape: f32 weights, bf16 input)
            helpers.assert_close(uly.matmul(a:float(), b), ref, 0, 0, what .. ': f32 result, bf16 B')
          end
        end
      end)
    end
  end)

  it('take batches, broadcast batch dims and a Linear layer\'s bias, and give their gradients', function()
    for _, engine in ipairs(engines) do
      with(engine, function()
        helpers.reseed(12)
        local x = uly.randn(3, 2, 37, 45):bf16()
        local w = uly.randn(45, 21)
        local g = uly.randn(3, 2, 37, 21)
        local function run(xin)
          local xs, ws = xin:clone():requires_grad_(), w:clone():requires_grad_()
          local y = uly.matmul(xs, ws)
          y:float():backward(g)
          return y, xs.grad, ws.grad
        end
        local y16, dx16, dw16 = run(x)
        local y32, dx32, dw32 = run(x:float())
        local what = engine.name .. ' batched'
        helpers.assert_close(y16:float(), y32:bf16():float(), 0, 0, what .. ' output')
        helpers.assert_close(dx16:float(), dx32, 0, 0, what .. ' dx')
        helpers.assert_close(dw16, dw32, 0, 0, what .. ' dw')

        local lin = uly.nn.Linear(45, 70)
        uly.no_grad(function() lin.bias:copy_(uly.randn(70)) end)
        local xl, gl = uly.randn(4, 50, 45):bf16(), uly.randn(4, 50, 70)
        local function linear(xin)
          lin:zero_grad()
          local xs = xin:clone():requires_grad_()
          local y = lin(xs)
          y:float():backward(gl)
          return { y:float(), xs.grad:float(), lin.weight.grad:clone(), lin.bias.grad:clone() }
        end
        local l16, l32 = linear(xl), linear(xl:float())
        assert.are.equal('bf16', lin(xl):dtype())
        l32[1] = l32[1]:bf16():float()
        for i, name in ipairs { 'output', 'dx', 'dweight', 'dbias' } do
          helpers.assert_close(l16[i], l32[i], 0, 0, engine.name .. ' Linear ' .. name)
        end
      end)
    end
  end)

  it('do not change f32 matmul precision: bf16 operands then multiply exactly in f32', function()
    helpers.reseed(13)
    local a, b = uly.randn(20, 30):bf16(), uly.randn(30, 10):bf16()
    local prev = uly.matmul_precision('f32')
    local y = uly.matmul(a:float(), b:float())
    uly.matmul_precision(prev)
    local ok = pcall(function() helpers.assert_close(y, y:bf16():float(), 0, 0, 'f32 product') end)
    assert.is_false(ok, 'an f32 product of 30 bf16 pairs should not be bf16-exact')
  end)

  -- flash attention's operands as given: bf16 q, k, v read exactly by the CPU kernel, in bf16
  -- precision (on AMX tiles where on, else exact f32 products: AVX512-BF16 runs only the big GEMMs). A bf16 q gives a bf16 output,
  -- which backward's delta = rowsum(dO O) then reads as rounded: dq and dk agree with the f32
  -- copies' to bf16's precision there, everything else to the bit
  it('run flash attention on bf16 q, k, v: the bits of their f32 copies', function()
    local cases = {
      { 'causal, GQA, D 64', 1, 100, 4, 2, 64, { causal = true } },
      { 'not causal, D 48', 2, 77, 2, 1, 48, {} },
      { 'a sliding window, D 32', 1, 150, 2, 2, 32, { causal = true, window = 40 } },
    }
    for _, engine in ipairs(engines) do
      with(engine, function()
        for _, c in ipairs(cases) do
          local what, B, T, H, Hk, D, opts = unpack(c)
          what = engine.name .. ' ' .. what
          helpers.reseed(14)
          local q, k, v = uly.randn(B, T, H, D):bf16(), uly.randn(B, T, Hk, D):bf16(), uly.randn(B, T, Hk, D):bf16()
          local g = uly.randn(B, T, H, D)
          local function run(q0, k0, v0)
            local qs, ks, vs = q0:clone():requires_grad_(), k0:clone():requires_grad_(), v0:clone():requires_grad_()
            local o = uly.flash_attention(qs, ks, vs, opts)
            o:float():backward(g)
            return { o:float(), qs.grad:float(), ks.grad:float(), vs.grad:float() }
          end
          local r32 = run(q:float(), k:float(), v:float())
          local kv16 = run(q:float(), k, v)
          for i, name in ipairs { 'output', 'dq', 'dk', 'dv' } do
            helpers.assert_close(kv16[i], r32[i], 0, 0, what .. ' (bf16 k, v) ' .. name)
          end
          local r16 = run(q, k, v)
          helpers.assert_close(r16[1], r32[1]:bf16():float(), 0, 0, what .. ' (bf16 q, k, v) output')
          helpers.assert_close(r16[4], r32[4], 0, 0, what .. ' (bf16 q, k, v) dv')
          helpers.assert_within(r16[2], r32[2], 2e-2, what .. ' (bf16 q, k, v) dq')
          helpers.assert_within(r16[3], r32[3], 2e-2, what .. ' (bf16 q, k, v) dk')
        end
      end)
    end
  end)

  it('train a GPT step with bf16 activations to the loss and gradients of the same step in f32 activations', function()
    local GPT = require 'models.gpt'
    helpers.reseed(15)
    local ids = helpers.token_ids(2, 64, 256)
    for _, engine in ipairs(engines) do
      with(engine, function()
        local function step(act)
          local prev = uly.activation_dtype(act)
          local ok, res = pcall(function()
            uly.manual_seed(7)
            local model = GPT { preset = 'tiny', seq = 64 }
            local loss = model:loss(ids, ids)
            loss:backward()
            local out = { loss:item() }
            for _, p in ipairs(model:parameters()) do out[#out + 1] = p.grad end
            return out
          end)
          uly.activation_dtype(prev)
          assert(ok, res)
          return res
        end
        local s16, s32 = step('bf16'), step('f32')
        -- activations rounded to bf16 at every op: within bf16's precision, not to the bit
        assert(math.abs(s16[1] - s32[1]) <= 1e-2 * math.abs(s32[1]),
               ('%s: loss %.6g with bf16 activations, %.6g with f32'):format(engine.name, s16[1], s32[1]))
        for i = 2, #s32 do
          helpers.assert_within(s16[i], s32[i], 0.1, ('%s: gradient %d'):format(engine.name, i - 1))
        end
      end)
    end
  end)
end)
