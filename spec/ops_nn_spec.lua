-- spec/ops_nn_spec.lua — the neural-network ops: layernorm, rmsnorm, activations (gelu exact
-- and tanh, silu, relu, tanh, sigmoid, exp, log, sqrt), swiglu, embedding, rope, dropout and
-- cross_entropy. Values against plain-Lua float64 references, gradients by finite differences.
local uly = require 'ulysses'
local helpers = require 'helpers'
local R = require 'reference'

---------------------------------------------------------------- float64 reference helpers
local function filled(n, v)
  local out = {}
  for i = 1, n do out[i] = v end
  return out
end

local SQRT_PI = math.sqrt(math.pi)

-- erfc for z >= 2 by its continued fraction, erf for |z| < 2 by its Maclaurin series
local function erfc_cf(z)
  local f = z
  for k = 80, 1, -1 do f = z + (k / 2) / f end
  return math.exp(-z * z) / SQRT_PI / f
end
local function erf(x)
  local z = math.abs(x)
  local r
  if z < 2 then
    local term, s, n = z, z, 0
    repeat
      n = n + 1
      term = -term * z * z / n
      local add = term / (2 * n + 1)
      s = s + add
    until math.abs(add) <= 1e-17 * math.abs(s)
    r = 2 / SQRT_PI * s
  else
    r = 1 - erfc_cf(z)
  end
  return x < 0 and -r or r
end
-- 1 + erf(x), without cancellation for x << 0
local function one_plus_erf(x)
  if x <= -2 then return erfc_cf(-x) end
  return 1 + erf(x)
end

local function sigmoid(x) return 1 / (1 + math.exp(-x)) end

local REF = {
  gelu = function(x) return 0.5 * x * one_plus_erf(x / math.sqrt(2)) end,
  gelu_tanh = function(x)
    local u = math.sqrt(2 / math.pi) * (x + 0.044715 * x * x * x)
    return x * sigmoid(2 * u) -- = 0.5 x (1 + tanh u), without cancellation
  end,
  silu = function(x) return x * sigmoid(x) end,
  relu = function(x) return x > 0 and x or 0 end,
  tanh = math.tanh,
  sigmoid = sigmoid,
  exp = math.exp,
  log = math.log,
  sqrt = math.sqrt,
}

-- |values| in [0.1, 1.6] with random signs: no relu kink within a finite-difference step
local function away_from_zero(...)
  local t = uly.rand(...)
  local v = helpers.list(t)
  for i = 1, #v do v[i] = (v[i] * 1.5 + 0.1) * (math.random() < 0.5 and -1 or 1) end
  return helpers.from_flat(v, t:shape())
end

local function assert_all_finite(t, what)
  for i, v in ipairs(helpers.list(t)) do
    assert(v == v and math.abs(v) < math.huge, string.format('%s: element %d is %s', what, i, tostring(v)))
  end
end

local function assert_error(fn, ...)
  local ok, err = pcall(fn)
  assert.is_false(ok, 'expected an error')
  for _, frag in ipairs({ ... }) do assert.matches(frag, tostring(err), 1, true) end
  return tostring(err)
end

---------------------------------------------------------------- layernorm / rmsnorm
local function ref_layernorm(lx, rows, C, lw, lb, eps)
  local out = {}
  for r = 0, rows - 1 do
    local m = 0
    for c = 1, C do m = m + lx[r * C + c] end
    m = m / C
    local v = 0
    for c = 1, C do v = v + (lx[r * C + c] - m) ^ 2 end
    v = v / C
    local rs = 1 / math.sqrt(v + eps)
    for c = 1, C do
      out[r * C + c] = (lx[r * C + c] - m) * rs * (lw and lw[c] or 1) + (lb and lb[c] or 0)
    end
  end
  return out
end

local function ref_rmsnorm(lx, rows, C, lw, eps)
  local out = {}
  for r = 0, rows - 1 do
    local s = 0
    for c = 1, C do s = s + lx[r * C + c] ^ 2 end
    local rs = 1 / math.sqrt(s / C + eps)
    for c = 1, C do out[r * C + c] = lx[r * C + c] * rs * (lw and lw[c] or 1) end
  end
  return out
end

-- normalised outputs are O(1); f32 rounding of (x - mean) * rstd * w + b is a few 1e-7
local NORM_RTOL, NORM_ATOL = 1e-5, 1e-5

describe('layernorm', function()
  it('matches the float64 reference with and without weight and bias', function()
    helpers.reseed(10)
    local x = uly.randn(3, 7, 33) * 2 + 0.5
    local w, b = uly.randn(33), uly.randn(33)
    local lx, lw, lb = helpers.list(x), helpers.list(w), helpers.list(b)
    local cases = {
      { 'weight and bias', w, b, lw, lb },
      { 'weight only', w, nil, lw, nil },
      { 'bias only', nil, b, nil, lb },
      { 'neither', nil, nil, nil, nil },
    }
    for _, c in ipairs(cases) do
      local y = uly.layernorm(x, c[2], c[3])
      assert.are.same({ 3, 7, 33 }, y:shape())
      helpers.assert_close(y, ref_layernorm(lx, 21, 33, c[4], c[5], 1e-5), NORM_RTOL, NORM_ATOL, c[1])
    end
  end)

  it('uses the eps it is given, on 1-D and [1, C] inputs', function()
    helpers.reseed(11)
    local x = uly.randn(7) * 0.1
    local lx = helpers.list(x)
    helpers.assert_close(uly.layernorm(x, nil, nil, 0.5), ref_layernorm(lx, 1, 7, nil, nil, 0.5), NORM_RTOL,
                         NORM_ATOL, 'eps 0.5')
    helpers.assert_close(uly.layernorm(x:view(1, 7), nil, nil, 1e-3), ref_layernorm(lx, 1, 7, nil, nil, 1e-3),
                         NORM_RTOL, NORM_ATOL, 'eps 1e-3')
  end)

  it('a constant row gives the bias (no NaN)', function()
    helpers.reseed(12)
    local x = uly.full({ 2, 5 }, 3.25)
    local b = uly.randn(5)
    local lb = helpers.list(b)
    local y = uly.layernorm(x, uly.randn(5), b)
    local ref = {}
    for i = 1, 10 do ref[i] = lb[(i - 1) % 5 + 1] end
    helpers.assert_close(y, ref, 0, 1e-6, 'constant rows')
  end)

  it('works on a non-contiguous input', function()
    helpers.reseed(13)
    local base = uly.randn(7, 3, 5)
    local x = base:transpose(1, 2)
    assert.is_false(x:is_contiguous())
    local lx = R.permute_list(helpers.list(base), { 7, 3, 5 }, { 2, 1, 3 })
    local w, b = uly.randn(5), uly.randn(5)
    helpers.assert_close(uly.layernorm(x, w, b), ref_layernorm(lx, 21, 5, helpers.list(w), helpers.list(b), 1e-5),
                         NORM_RTOL, NORM_ATOL, 'transposed input')
  end)

  it('gradcheck of x, weight and bias (and each subset)', function()
    helpers.reseed(14)
    local x, w, b = R.leaf(uly.randn(3, 7)), R.leaf(uly.randn(7)), R.leaf(uly.randn(7))
    helpers.gradcheck(function(a, c, d) return uly.layernorm(a, c, d) end, { x, w, b })
    helpers.gradcheck(function(a, c) return uly.layernorm(a, c, nil) end, { x, w })
    helpers.gradcheck(function(a, d) return uly.layernorm(a, nil, d) end, { x, b })
    helpers.gradcheck(function(a) return uly.layernorm(a) end, { x })
    -- non-contiguous x ([7, 3] transposed), weight and bias (narrowed from 9 elements)
    local xb, wb, bb = R.leaf(uly.randn(7, 3)), R.leaf(uly.randn(9)), R.leaf(uly.randn(9))
    helpers.gradcheck(function(a, c, d) return uly.layernorm(a:t(), c:narrow(1, 2, 7), d:narrow(1, 3, 7)) end,
                      { xb, wb, bb })
  end)

  it('rejects a weight of the wrong size', function()
    assert_error(function() return uly.layernorm(uly.randn(2, 5), uly.randn(4)) end, 'layernorm', 'weight')
    assert_error(function() return uly.layernorm(uly.randn(2, 5), nil, uly.randn(6)) end, 'layernorm', 'bias')
  end)
end)

describe('rmsnorm', function()
  it('matches the float64 reference with and without weight', function()
    helpers.reseed(20)
    local x = uly.randn(3, 7, 33) + 0.3
    local w = uly.randn(33)
    local lx, lw = helpers.list(x), helpers.list(w)
    helpers.assert_close(uly.rmsnorm(x, w), ref_rmsnorm(lx, 21, 33, lw, 1e-6), NORM_RTOL, NORM_ATOL, 'weight')
    helpers.assert_close(uly.rmsnorm(x), ref_rmsnorm(lx, 21, 33, nil, 1e-6), NORM_RTOL, NORM_ATOL, 'no weight')
    helpers.assert_close(uly.rmsnorm(x * 0.01, nil, 0.25), ref_rmsnorm(R.map(lx, function(v) return v * 0.01 end),
                         21, 33, nil, 0.25), NORM_RTOL, NORM_ATOL, 'eps 0.25')
  end)

  it('works on a non-contiguous input and a zero row', function()
    helpers.reseed(21)
    local base = uly.randn(5, 7)
    local lx = R.permute_list(helpers.list(base), { 5, 7 }, { 2, 1 })
    helpers.assert_close(uly.rmsnorm(base:t()), ref_rmsnorm(lx, 7, 5, nil, 1e-6), NORM_RTOL, NORM_ATOL, 'transposed')
    local z = uly.rmsnorm(uly.zeros(2, 3), uly.randn(3))
    helpers.assert_close(z, filled(6, 0), 0, 0, 'zero rows')
  end)

  it('gradcheck of x and weight, and of x alone', function()
    helpers.reseed(22)
    local x, w = R.leaf(uly.randn(3, 7)), R.leaf(uly.randn(7))
    helpers.gradcheck(function(a, c) return uly.rmsnorm(a, c) end, { x, w })
    helpers.gradcheck(function(a) return uly.rmsnorm(a) end, { x })
    helpers.gradcheck(function(a, c) return uly.rmsnorm(a:t(), c:narrow(1, 2, 7)) end,
                      { R.leaf(uly.randn(7, 3)), R.leaf(uly.randn(9)) })
  end)

  it('rejects a weight of the wrong size', function()
    assert_error(function() return uly.rmsnorm(uly.randn(2, 5), uly.randn(2, 5)) end, 'rmsnorm', 'weight')
  end)
end)

---------------------------------------------------------------- activations
local ACTS = {
  { 'gelu', function(x) return x:gelu() end, REF.gelu },
  { 'gelu none', function(x) return x:gelu('none') end, REF.gelu },
  { 'gelu tanh', function(x) return x:gelu('tanh') end, REF.gelu_tanh },
  { 'silu', function(x) return x:silu() end, REF.silu },
  { 'relu', function(x) return x:relu() end, REF.relu },
  { 'tanh', function(x) return x:tanh() end, REF.tanh },
  { 'sigmoid', function(x) return x:sigmoid() end, REF.sigmoid },
  { 'exp', function(x) return x:exp() end, REF.exp },
}
local EDGES = { -80, -20, -8.5, -3, -1, -1e-3, 0, 1e-3, 0.5, 3, 8.5, 20, 80 }

-- f32 libm / polynomial expf are within a few ulp; gelu's 1 + erf(x) cancels for x << 0, so
-- its absolute error there is ~1e-7 |x|: hence the absolute floor
local ACT_RTOL, ACT_ATOL = 1e-5, 1e-6

describe('activations', function()
  for k, a in ipairs(ACTS) do
    it(a[1] .. ' matches the float64 reference (random and edge values, non-contiguous)', function()
      helpers.reseed(30 + k)
      local x = uly.randn(7, 33) * 3
      helpers.assert_close(a[2](x), R.map(helpers.list(x), a[3]), ACT_RTOL, ACT_ATOL, a[1])
      local e = helpers.from_flat(EDGES, { #EDGES })
      helpers.assert_close(a[2](e), R.map(helpers.list(e), a[3]), ACT_RTOL, ACT_ATOL, a[1] .. ' edges')
      local xt = x:t()
      helpers.assert_close(a[2](xt), R.map(R.permute_list(helpers.list(x), { 7, 33 }, { 2, 1 }), a[3]), ACT_RTOL,
                           ACT_ATOL, a[1] .. ' transposed')
    end)
  end

  it('gelu exact and gelu tanh differ (by < 1e-3) and the functional form works', function()
    helpers.reseed(40)
    local x = uly.tensor({ -2, -1, 1, 2 })
    local d = helpers.list(x:gelu() - x:gelu('tanh'))
    local any = false
    for _, v in ipairs(d) do
      assert(math.abs(v) < 1e-3)
      if math.abs(v) > 1e-5 then any = true end
    end
    assert.is_true(any, 'gelu() must be the exact (erf) form, not the tanh approximation')
    helpers.assert_close(uly.gelu(x, 'tanh'), x:gelu('tanh'), 0, 0, 'uly.gelu')
    helpers.assert_close(uly.silu(x), x:silu(), 0, 0, 'uly.silu')
    assert_error(function() return x:gelu('fast') end, 'approximate')
  end)

  it('log and sqrt on positive inputs; log(0) = -inf, sqrt(0) = 0, exp overflow/underflow', function()
    helpers.reseed(41)
    local x = (uly.rand(7, 33) + 1e-3) * 50
    local lx = helpers.list(x)
    helpers.assert_close(x:log(), R.map(lx, math.log), ACT_RTOL, ACT_ATOL, 'log')
    helpers.assert_close(x:sqrt(), R.map(lx, math.sqrt), ACT_RTOL, ACT_ATOL, 'sqrt')
    helpers.assert_close(x:t():log(), R.map(R.permute_list(lx, { 7, 33 }, { 2, 1 }), math.log), ACT_RTOL, ACT_ATOL,
                         'log^T')
    local tiny = uly.tensor({ 1e-30, 1e30 })
    helpers.assert_close(tiny:log(), R.map(helpers.list(tiny), math.log), ACT_RTOL, 0, 'log tiny/huge')
    helpers.assert_close(tiny:sqrt(), R.map(helpers.list(tiny), math.sqrt), ACT_RTOL, 0, 'sqrt tiny/huge')
    local z = uly.tensor({ 0 })
    assert.are.equal(-math.huge, z:log():item())
    assert.are.equal(0, z:sqrt():item())
    local big = helpers.list(uly.tensor({ 89, 200, -105, -1000 }):exp())
    assert.are.same({ math.huge, math.huge, 0, 0 }, big)
    local sg = helpers.list(uly.tensor({ -200, 200 }):sigmoid())
    assert.are.same({ 0, 1 }, sg)
  end)

  local GRADS = {
    { 'gelu', function(x) return x:gelu() end, away_from_zero },
    { 'gelu tanh', function(x) return x:gelu('tanh') end, away_from_zero },
    { 'silu', function(x) return x:silu() end, away_from_zero },
    { 'relu', function(x) return x:relu() end, away_from_zero },
    { 'tanh', function(x) return x:tanh() end, away_from_zero },
    { 'sigmoid', function(x) return x:sigmoid() end, away_from_zero },
    { 'exp', function(x) return x:exp() end, away_from_zero },
    { 'log', function(x) return x:log() end, function(...) return uly.rand(...) + 0.5 end },
    { 'sqrt', function(x) return x:sqrt() end, function(...) return uly.rand(...) + 0.5 end },
  }
  for k, g in ipairs(GRADS) do
    it('gradcheck ' .. g[1] .. ' (contiguous and transposed)', function()
      helpers.reseed(50 + k)
      local x = R.leaf(g[3](3, 7))
      helpers.gradcheck(g[2], { x })
      helpers.gradcheck(function(t) return g[2](t:t()) end, { x })
    end)
  end

  it('gradients at large |x| are finite (gelu, silu, sigmoid, tanh)', function()
    helpers.reseed(60)
    for _, name in ipairs({ 'gelu', 'silu', 'sigmoid', 'tanh' }) do
      local x = R.leaf(uly.tensor({ -200, -90, -30, 30, 90, 200 }))
      x[name](x):sum():backward()
      assert_all_finite(x.grad, name .. ' grad')
      local gl = helpers.list(x.grad)
      assert(math.abs(gl[1]) < 1e-6 and math.abs(gl[2]) < 1e-6, name .. ': gradient at -inf side must vanish')
    end
    -- +-1e20: x^3 overflows, the slope term is 0 * inf, which the backward must drop
    local x = R.leaf(uly.tensor({ -200, -90, -30, 30, 90, 200, -1e20, 1e20 }))
    x:gelu('tanh'):sum():backward()
    assert_all_finite(x.grad, 'gelu tanh grad')
    helpers.assert_close(x.grad, { 0, 0, 0, 1, 1, 1, 0, 1 }, 1e-6, 1e-6, 'gelu tanh saturated grad')
  end)
end)

describe('swiglu', function()
  it('equals silu(gate) * up, also for non-contiguous operands', function()
    helpers.reseed(70)
    local g, u = uly.randn(7, 33) * 3, uly.randn(7, 33)
    local lg, lu = helpers.list(g), helpers.list(u)
    local ref = {}
    for i = 1, #lg do ref[i] = REF.silu(lg[i]) * lu[i] end
    helpers.assert_close(g:swiglu(u), ref, 1e-5, 1e-6, 'swiglu')
    helpers.assert_close(uly.swiglu(g, u), ref, 1e-5, 1e-6, 'uly.swiglu')
    local gt, ut = g:t(), u:t()
    local lgt, lut = R.permute_list(lg, { 7, 33 }, { 2, 1 }), R.permute_list(lu, { 7, 33 }, { 2, 1 })
    local reft = {}
    for i = 1, #lgt do reft[i] = REF.silu(lgt[i]) * lut[i] end
    helpers.assert_close(gt:swiglu(ut), reft, 1e-5, 1e-6, 'swiglu transposed')
  end)

  it('gradcheck of gate and up, and of each alone', function()
    helpers.reseed(71)
    local g, u = R.leaf(uly.randn(3, 7) * 2), R.leaf(uly.randn(3, 7))
    helpers.gradcheck(function(a, b) return a:swiglu(b) end, { g, u })
    helpers.gradcheck(function(a) return a:swiglu(u:detach()) end, { g })
    helpers.gradcheck(function(b) return g:detach():swiglu(b) end, { u })
    helpers.gradcheck(function(a, b) return a:t():swiglu(b:narrow(2, 2, 3)) end, { R.leaf(uly.randn(3, 7)),
      R.leaf(uly.randn(7, 5)) })
  end)

  it('rejects operands of different shapes', function()
    assert_error(function() return uly.randn(3, 4):swiglu(uly.randn(4, 3)) end, 'swiglu', 'same shape')
  end)
end)

---------------------------------------------------------------- embedding
describe('embedding', function()
  for _, dt in ipairs({ 'i32', 'i64' }) do
    it('looks up rows with ' .. dt .. ' ids, and accumulates gradients of repeated ids', function()
      helpers.reseed(80)
      local V, C = 11, 5
      local ids_l = { { 1, 2, 1 }, { 10, 0, 1 } }
      local ids = uly.tensor(ids_l, { dtype = dt })
      assert.are.equal(dt, ids:dtype())
      local w = R.leaf(uly.randn(V, C))
      local lw = helpers.list(w)
      local y = uly.embedding(ids, w)
      assert.are.same({ 2, 3, C }, y:shape())
      local flat = { 1, 2, 1, 10, 0, 1 }
      local ref = {}
      for i, id in ipairs(flat) do for c = 1, C do ref[(i - 1) * C + c] = lw[id * C + c] end end
      helpers.assert_close(y, ref, 0, 0, 'lookup')
      local g = uly.randn(2, 3, C)
      local lg = helpers.list(g)
      y:backward(g)
      local dref = filled(V * C, 0)
      for i, id in ipairs(flat) do
        for c = 1, C do dref[id * C + c] = dref[id * C + c] + lg[(i - 1) * C + c] end
      end
      helpers.assert_close(w.grad, dref, 1e-6, 1e-7, 'weight grad')
      -- id 1 appears three times: its row is the sum of three gradient rows
      local r1 = {}
      for c = 1, C do r1[c] = lg[c] + lg[2 * C + c] + lg[5 * C + c] end
      helpers.assert_close(w.grad:select(1, 2), r1, 1e-6, 1e-7, 'row of id 1')
    end)

    it('an out-of-range ' .. dt .. ' id is an error naming the index', function()
      local w = uly.randn(11, 5)
      local err = assert_error(function() return uly.embedding(uly.tensor({ 3, 11, 2 }, { dtype = dt }), w) end,
        'embedding', 'index 11', 'out of range')
      assert.matches('at [2] of ' .. dt .. '[3]', err, 1, true)   -- 1-based, as Lua indexes it
      assert_error(function() return uly.embedding(uly.tensor({ { 0, 1 }, { -1, 4 } }, { dtype = dt }), w) end,
        'index -1 at [2, 1]', 'out of range')
    end)
  end

  it('non-contiguous ids and weight', function()
    helpers.reseed(81)
    local idsb = uly.tensor({ { 4, 0 }, { 2, 2 }, { 1, 4 } }, { dtype = 'i64' })
    local ids = idsb:t() -- [[4, 2, 1], [0, 2, 4]]
    local wb = uly.randn(3, 5)
    local w = wb:t() -- [5, 3]
    local lw = R.permute_list(helpers.list(wb), { 3, 5 }, { 2, 1 })
    local ref = {}
    for i, id in ipairs({ 4, 2, 1, 0, 2, 4 }) do for c = 1, 3 do ref[(i - 1) * 3 + c] = lw[id * 3 + c] end end
    helpers.assert_close(uly.embedding(ids, w), ref, 0, 0, 'non-contiguous lookup')
  end)

  it('gradcheck of the weight', function()
    helpers.reseed(82)
    local ids = uly.tensor({ { 0, 5, 0 }, { 3, 3, 5 } }, { dtype = 'i32' })
    local w = R.leaf(uly.randn(6, 4))
    helpers.gradcheck(function(t) return uly.embedding(ids, t) end, { w })
  end)

  it('float ids and a 1-D weight are rejected', function()
    assert_error(function() return uly.embedding(uly.tensor({ 1, 2 }), uly.randn(4, 3)) end, 'integer')
    assert_error(function() return uly.embedding(uly.tensor({ 1, 2 }, { dtype = 'i64' }), uly.randn(4)) end,
      'weight')
  end)
end)

---------------------------------------------------------------- rope
-- interleaved pairs (x[2i], x[2i+1]) rotated by (offset + t) * theta^(-2i/D)
local function ref_rope(lx, B, T, H, D, offset, theta)
  local out = {}
  for b = 0, B - 1 do
    for t = 0, T - 1 do
      for h = 0, H - 1 do
        local base = ((b * T + t) * H + h) * D
        for i = 0, D / 2 - 1 do
          local ang = (offset + t) * theta ^ (-2 * i / D)
          local c, s = math.cos(ang), math.sin(ang)
          local x0, x1 = lx[base + 2 * i + 1], lx[base + 2 * i + 2]
          out[base + 2 * i + 1] = x0 * c - x1 * s
          out[base + 2 * i + 2] = x0 * s + x1 * c
        end
      end
    end
  end
  return out
end

describe('rope', function()
  local CASES = {
    { 2, 7, 3, 8, 0, nil }, { 2, 7, 3, 8, 5, 500 }, { 1, 33, 1, 2, 3, 10000 }, { 3, 1, 2, 6, 0, 10000 },
    { 1, 5, 2, 4, 100000, 10000 }, { 1, 4, 1, 64, 17, 10000 },
  }
  for k, c in ipairs(CASES) do
    local B, T, H, D, off, theta = unpack(c, 1, 6)
    it(string.format('matches the float64 reference: [%d, %d, %d, %d], offset %d, theta %s', B, T, H, D, off,
                     tostring(theta or 'default')), function()
      helpers.reseed(90 + k)
      local x = uly.randn(B, T, H, D)
      local y = x:rope(off, theta)
      assert.are.same({ B, T, H, D }, y:shape())
      -- angles up to 1e5 rad are reduced in double by the kernel; only f32 rounding remains
      helpers.assert_close(y, ref_rope(helpers.list(x), B, T, H, D, off, theta or 10000), 1e-5, 2e-6, 'rope')
    end)
  end

  it('position 0 is the identity and every pair keeps its norm', function()
    helpers.reseed(100)
    local x = uly.randn(2, 3, 2, 6)
    local y = x:rope(0)
    helpers.assert_close(y:narrow(2, 1, 1), x:narrow(2, 1, 1), 0, 0, 'identity at position 0')
    local lx, ly = helpers.list(x), helpers.list(y)
    for p = 1, #lx, 2 do
      local nx, ny = lx[p] ^ 2 + lx[p + 1] ^ 2, ly[p] ^ 2 + ly[p + 1] ^ 2
      assert(math.abs(nx - ny) <= 1e-5 * nx + 1e-7, 'pair norm changed at ' .. p)
    end
  end)

  it('an offset shifts positions: rope(x[:, k:], o + k) == rope(x, o)[:, k:]', function()
    helpers.reseed(101)
    local x = uly.randn(2, 9, 3, 8)
    for _, o in ipairs({ 0, 4 }) do
      local full = x:rope(o)
      for _, k in ipairs({ 1, 2, 5 }) do
        local part = x:narrow(2, k + 1, 9 - k):rope(o + k)
        helpers.assert_close(part, full:narrow(2, k + 1, 9 - k), 1e-6, 1e-7, string.format('offset %d shift %d', o, k))
      end
    end
    -- and a different offset really changes the result
    assert(R.max_abs(helpers.list(x:rope(1) - x:rope(0))) > 1e-2, 'offset had no effect')
  end)

  -- the (cos, sin) of a call of >= 65536 (position, pair)s are kept for the next calls the same
  -- range covers (q and k of every layer, forward, recomputation and backward)
  it('reuses the kept cos/sin of a large call: the bits of computing them per call, forward and backward', function()
    helpers.reseed(104)
    local x, g = uly.randn(1, 4096, 2, 32), uly.randn(1, 4096, 2, 32)
    -- 64 positions x 16 pairs a piece: too few to keep a table, so each piece computes its own
    local function pieces(t, off, theta)
      local parts = {}
      for s = 0, 4095, 64 do parts[#parts + 1] = t:narrow(2, s + 1, 64):rope(off + s, theta) end
      return uly.cat(parts, 2)
    end
    local function grad_of(fn)
      local leaf = R.leaf(x:clone())
      fn(leaf):backward(g)
      return leaf.grad
    end
    for _, c in ipairs({ { 0 }, { 1000 }, { 0, 500 }, { 1000 } }) do
      local off, theta = c[1], c[2]
      local ref = pieces(x, off, theta)
      helpers.assert_close(x:rope(off, theta), ref, 0, 0, 'whole, offset ' .. off)        -- makes or reuses the table
      helpers.assert_close(x:narrow(2, 101, 300):rope(off + 100, theta), ref:narrow(2, 101, 300), 0, 0,
                           'a range inside it, offset ' .. off)
      helpers.assert_close(grad_of(function(t) return t:rope(off, theta) end),
                           grad_of(function(t) return pieces(t, off, theta) end), 0, 0, 'backward, offset ' .. off)
    end
    helpers.assert_close(x:rope(7), ref_rope(helpers.list(x), 1, 4096, 2, 32, 7, 10000), 1e-5, 2e-6, 'reference')
  end)

  it('works on a non-contiguous input', function()
    helpers.reseed(102)
    local base = uly.randn(2, 3, 7, 4) -- [B, H, T, D]
    local x = base:transpose(2, 3)
    local lx = R.permute_list(helpers.list(base), { 2, 3, 7, 4 }, { 1, 3, 2, 4 })
    helpers.assert_close(x:rope(2), ref_rope(lx, 2, 7, 3, 4, 2, 10000), 1e-5, 2e-6, 'transposed')
    helpers.assert_close(uly.rope(x, 2, 10000), x:rope(2), 0, 0, 'uly.rope')
  end)

  it('gradcheck (contiguous and transposed), and the gradient is the inverse rotation', function()
    helpers.reseed(103)
    local x = R.leaf(uly.randn(1, 3, 2, 4))
    helpers.gradcheck(function(t) return t:rope(3, 100) end, { x })
    helpers.gradcheck(function(t) return t:transpose(2, 3):rope(1) end, { R.leaf(uly.randn(1, 2, 3, 4)) })
    -- rope is orthogonal: backward of rope(x) with gradient rope(g) returns g
    local g = uly.randn(1, 3, 2, 4)
    x:zero_grad()
    x:rope(7, 50):backward(g:rope(7, 50))
    helpers.assert_close(x.grad, g, 1e-5, 1e-6, 'inverse rotation')
  end)

  it('rejects odd head_dim, wrong rank and a negative offset', function()
    assert_error(function() return uly.randn(1, 2, 3, 5):rope(0) end, 'rope', 'even')
    assert_error(function() return uly.randn(2, 3, 4):rope(0) end, 'rope')
    assert_error(function() return uly.randn(1, 2, 1, 4):rope(-1) end, 'rope', 'negative')
  end)
end)

---------------------------------------------------------------- dropout
describe('dropout', function()
  it('p = 0 and eval mode are the identity (values and gradient)', function()
    helpers.reseed(110)
    local x = R.leaf(uly.randn(7, 33))
    helpers.assert_close(x:dropout(0), x, 0, 0, 'p = 0')
    helpers.assert_close(x:dropout(0.5, false), x, 0, 0, 'eval')
    helpers.assert_close(uly.dropout(x, 0.9, false), x, 0, 0, 'uly.dropout eval')
    x:dropout(0.5, false):sum():backward()
    helpers.assert_close(x.grad, filled(7 * 33, 1), 0, 0, 'eval grad')
    x:zero_grad()
    ;(x:dropout(0) * 2):sum():backward()
    helpers.assert_close(x.grad, filled(7 * 33, 2), 0, 0, 'p = 0 grad')
  end)

  for _, p in ipairs({ 0.1, 0.5, 0.9 }) do
    it(string.format('p = %.1f drops about p of 10^5 elements and scales the rest by 1/(1-p)', p), function()
      helpers.reseed(111)
      local n = 100000
      local x = uly.randn(n)
      local lx = helpers.list(x)
      local ly = helpers.list(x:dropout(p))
      -- the kernel forms 1/(1-p) from p rounded to f32: a few ulp from the exact scale
      local scale = 1 / (1 - p)
      local dropped = 0
      for i = 1, n do
        if ly[i] == 0 then dropped = dropped + 1
        else
          local want = lx[i] * scale
          assert(math.abs(ly[i] - want) <= 1e-6 * math.abs(want),
                 string.format('kept element %d is %.9g, expected %.9g', i, ly[i], want))
        end
      end
      -- binomial: 6 standard deviations
      local sd = math.sqrt(p * (1 - p) / n)
      assert(math.abs(dropped / n - p) < 6 * sd,
             string.format('dropped fraction %.5f for p = %.1f', dropped / n, p))
    end)
  end

  it('p = 1 drops everything with a zero (not NaN) gradient; p outside [0, 1] is an error', function()
    helpers.reseed(112)
    local x = R.leaf(uly.randn(5, 7))
    local y = x:dropout(1)
    helpers.assert_close(y, filled(35, 0), 0, 0, 'p = 1')
    y:sum():backward()
    helpers.assert_close(x.grad, filled(35, 0), 0, 0, 'p = 1 grad')
    assert_error(function() return x:dropout(1.5) end, 'dropout')
    assert_error(function() return x:dropout(-0.1) end, 'dropout')
  end)

  it('the same seed gives the same mask; the next call a different one', function()
    helpers.reseed(113)
    local x = uly.ones(1000)
    helpers.reseed(114)
    local a = helpers.list(x:dropout(0.5))
    local a2 = helpers.list(x:dropout(0.5))
    helpers.reseed(114)
    local b = helpers.list(x:dropout(0.5))
    local differ = 0
    for i = 1, 1000 do
      assert(a[i] == b[i], 'same seed, different mask at ' .. i)
      if a[i] ~= a2[i] then differ = differ + 1 end
    end
    assert(differ > 300, 'consecutive calls reused the mask (' .. differ .. ' of 1000 differ)')
    helpers.reseed(115)
    local c = helpers.list(x:dropout(0.5))
    differ = 0
    for i = 1, 1000 do if a[i] ~= c[i] then differ = differ + 1 end end
    assert(differ > 300, 'another seed gave the same mask')
  end)

  it('the mask does not depend on the number of threads', function()
    finally(function() uly.set_num_threads(0) end)
    local x = uly.ones(100003)
    uly.set_num_threads(1)
    helpers.reseed(116)
    local a = x:dropout(0.3)
    uly.set_num_threads(2)
    helpers.reseed(116)
    local b = x:dropout(0.3)
    helpers.assert_close(a, b, 0, 0, '1 thread vs 2 threads')
  end)

  it('the gradient uses the forward mask: grad == mask / (1 - p)', function()
    helpers.reseed(117)
    local p = 0.4
    -- nonzero inputs (so y == 0 exactly where dropped), above the kernel's threading threshold
    local x = R.leaf(uly.rand(70001) + 0.5)
    local y = x:dropout(p)
    local g = uly.randn(70001)
    y:backward(g)
    local ly, lg, gx = helpers.list(y), helpers.list(g), helpers.list(x.grad)
    local scale = 1 / (1 - p)
    local kept = 0
    for i = 1, #ly do
      local keep = ly[i] ~= 0
      local want = keep and lg[i] * scale or 0
      assert(math.abs(gx[i] - want) <= 1e-6 * math.abs(want) and (gx[i] == 0) == (want == 0),
             string.format('grad element %d is %.9g, expected %.9g', i, gx[i], want))
      if keep then kept = kept + 1 end
    end
    assert(kept > 0 and kept < #ly)
  end)
end)

---------------------------------------------------------------- cross-entropy
-- per-row losses (0 for ignored rows), the number of counted rows
local function ref_ce_rows(ll, rows, V, targets, ignore)
  local loss, count = {}, 0
  for r = 0, rows - 1 do
    local t = targets[r + 1]
    if t == ignore then loss[r + 1] = 0
    else
      local m = -math.huge
      for j = 1, V do m = math.max(m, ll[r * V + j]) end
      local s = 0
      for j = 1, V do s = s + math.exp(ll[r * V + j] - m) end
      loss[r + 1] = m + math.log(s) - ll[r * V + t + 1]
      count = count + 1
    end
  end
  return loss, count
end

describe('cross_entropy', function()
  for _, dt in ipairs({ 'i32', 'i64' }) do
    it('mean, sum and none match the float64 reference with ' .. dt .. ' targets and ignored rows', function()
      helpers.reseed(120)
      local rows, V = 7, 5
      local logits = uly.randn(rows, V) * 2
      local ll = helpers.list(logits)
      local tl = { 3, 0, -100, 4, 1, -100, 2 }
      local targets = uly.tensor(tl, { dtype = dt })
      local per, count = ref_ce_rows(ll, rows, V, tl, -100)
      assert.are.equal(5, count)
      local mean = uly.cross_entropy(logits, targets)
      assert.are.equal(0, mean:dim())
      helpers.assert_close(mean, { R.lsum(per) / count }, 1e-5, 1e-6, 'mean')
      helpers.assert_close(uly.cross_entropy(logits, targets, { reduction = 'mean' }), { R.lsum(per) / count }, 1e-5,
                           1e-6, 'explicit mean')
      helpers.assert_close(uly.cross_entropy(logits, targets, { reduction = 'sum' }), { R.lsum(per) }, 1e-5, 1e-6,
                           'sum')
      local none = uly.cross_entropy(logits, targets, { reduction = 'none' })
      assert.are.same({ rows }, none:shape())
      helpers.assert_close(none, per, 1e-5, 1e-6, 'none')
    end)
  end

  it('3-D logits [2, 3, 5] with [2, 3] targets and a custom ignore_index', function()
    helpers.reseed(121)
    local logits = uly.randn(2, 3, 5)
    local ll = helpers.list(logits)
    local tl = { 2, 4, 2, 0, 1, 3 }
    local targets = uly.tensor({ { 2, 4, 2 }, { 0, 1, 3 } }, { dtype = 'i64' })
    local per, count = ref_ce_rows(ll, 6, 5, tl, 2)
    assert.are.equal(4, count)
    helpers.assert_close(uly.cross_entropy(logits, targets, { ignore_index = 2 }), { R.lsum(per) / 4 }, 1e-5, 1e-6,
                         'ignore 2')
    local none = uly.cross_entropy(logits, targets, { ignore_index = 2, reduction = 'none' })
    assert.are.same({ 2, 3 }, none:shape())
    helpers.assert_close(none, per, 1e-5, 1e-6, 'none, ignore 2')
    -- nothing is ignored with the default ignore_index
    local perall = ref_ce_rows(ll, 6, 5, tl, -100)
    helpers.assert_close(uly.cross_entropy(logits, targets), { R.lsum(perall) / 6 }, 1e-5, 1e-6, 'default ignore')
  end)

  it('non-contiguous logits', function()
    helpers.reseed(122)
    local base = uly.randn(5, 4)
    local logits = base:t() -- [4, 5]
    local ll = R.permute_list(helpers.list(base), { 5, 4 }, { 2, 1 })
    local tl = { 4, 0, 2, 2 }
    local per = ref_ce_rows(ll, 4, 5, tl, -100)
    helpers.assert_close(uly.cross_entropy(logits, uly.tensor(tl, { dtype = 'i64' }), { reduction = 'none' }), per,
                         1e-5, 1e-6, 'transposed logits')
  end)

  it('all rows ignored: loss 0 and zero gradient, not NaN', function()
    helpers.reseed(123)
    local logits = R.leaf(uly.randn(3, 5))
    local targets = uly.tensor({ -100, -100, -100 }, { dtype = 'i64' })
    for _, red in ipairs({ 'mean', 'sum' }) do
      logits:zero_grad()
      local loss = uly.cross_entropy(logits, targets, { reduction = red })
      assert.are.equal(0, loss:item(), red)
      loss:backward()
      helpers.assert_close(logits.grad, filled(15, 0), 0, 0, red .. ' grad')
    end
    logits:zero_grad()
    local none = uly.cross_entropy(logits, targets, { reduction = 'none' })
    helpers.assert_close(none, { 0, 0, 0 }, 0, 0, 'none')
    none:backward(uly.ones(3))
    helpers.assert_close(logits.grad, filled(15, 0), 0, 0, 'none grad')
  end)

  it('the gradient is (softmax - onehot) / count, zero on ignored rows', function()
    helpers.reseed(124)
    local logits = R.leaf(uly.randn(4, 5))
    local ll = helpers.list(logits)
    local tl = { 1, -100, 4, 0 }
    uly.cross_entropy(logits, uly.tensor(tl, { dtype = 'i32' })):backward()
    local ref = {}
    for r = 0, 3 do
      local s = 0
      for j = 1, 5 do s = s + math.exp(ll[r * 5 + j]) end
      for j = 1, 5 do
        if tl[r + 1] == -100 then ref[r * 5 + j] = 0
        else ref[r * 5 + j] = (math.exp(ll[r * 5 + j]) / s - (j - 1 == tl[r + 1] and 1 or 0)) / 3 end
      end
    end
    helpers.assert_close(logits.grad, ref, 1e-5, 1e-6, 'closed-form grad')
  end)

  it('gradcheck of the logits for mean, sum and none, with ignored rows', function()
    helpers.reseed(125)
    local logits = R.leaf(uly.randn(4, 5))
    local t32 = uly.tensor({ 2, -100, 0, 4 }, { dtype = 'i32' })
    local t64 = uly.tensor({ 2, 3, 0, 4 }, { dtype = 'i64' })
    for _, red in ipairs({ 'mean', 'sum', 'none' }) do
      helpers.gradcheck(function(l) return uly.cross_entropy(l, t32, { reduction = red }) end, { logits })
      helpers.gradcheck(function(l) return uly.cross_entropy(l, t64, { reduction = red }) end, { logits })
    end
    helpers.gradcheck(function(l) return uly.cross_entropy(l:t(), t64) end, { R.leaf(uly.randn(5, 4)) })
  end)

  it('large logits (1e4) give a finite loss and gradient', function()
    helpers.reseed(126)
    local logits = R.leaf(uly.randn(3, 7) * 1e4)
    local ll = helpers.list(logits)
    local tl = { 0, 6, 3 }
    local loss = uly.cross_entropy(logits, uly.tensor(tl, { dtype = 'i64' }), { reduction = 'none' })
    assert_all_finite(loss, 'loss')
    -- losses reach ~1e4: f32 keeps ~1e-3 absolute there
    helpers.assert_close(loss, (ref_ce_rows(ll, 3, 7, tl, -100)), 1e-6, 1e-2, 'large logits')
    loss:sum():backward()
    assert_all_finite(logits.grad, 'grad')
  end)

  it('rejects out-of-range targets, float targets, mismatched shapes and unknown reductions', function()
    local logits = uly.randn(3, 5)
    assert_error(function() return uly.cross_entropy(logits, uly.tensor({ 0, 5, 1 }, { dtype = 'i64' })) end,
      'target 5', 'out of range')
    assert_error(function() return uly.cross_entropy(logits, uly.tensor({ 0, -1, 1 }, { dtype = 'i32' })) end,
      'target -1', 'out of range')
    assert_error(function() return uly.cross_entropy(logits, uly.tensor({ 0, 1, 1 })) end, 'integer')
    assert_error(function() return uly.cross_entropy(logits, uly.tensor({ 0, 1 }, { dtype = 'i64' })) end,
      'do not match')
    assert_error(function()
      return uly.cross_entropy(logits, uly.tensor({ 0, 1, 2 }, { dtype = 'i64' }), { reduction = 'avg' })
    end, 'reduction')
  end)
end)
