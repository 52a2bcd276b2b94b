-- spec/ops_elementwise_spec.lua — add/sub/mul/div with broadcasting, tensor-scalar ops and
-- unary minus: values against plain-Lua float64 references, gradients by finite differences.
local uly = require 'ulysses'
local helpers = require 'helpers'
local R = require 'reference'

---------------------------------------------------------------- float64 reference helpers
-- broadcast f over two row-major lists; returns the flat result and the output shape
local function ref_binary(la, sa, lb, sb, f)
  local shape, oa, ob = R.broadcast(sa, sb)
  local out = {}
  for p = 1, #oa do out[p] = f(la[oa[p] + 1], lb[ob[p] + 1]) end
  return out, shape
end

local OPS = {
  { name = 'add', f = function(x, y) return x + y end, t = function(a, b) return a + b end },
  { name = 'sub', f = function(x, y) return x - y end, t = function(a, b) return a - b end },
  { name = 'mul', f = function(x, y) return x * y end, t = function(a, b) return a * b end },
  { name = 'div', f = function(x, y) return x / y end, t = function(a, b) return a / b end },
}

-- a divisor-friendly random tensor: |values| in [0.5, 1.5] with random signs
local function away_from_zero(...)
  local t = uly.rand(...)
  local n = t:numel()
  local v = helpers.list(t)
  for i = 1, n do v[i] = (v[i] + 0.5) * (math.random() < 0.5 and -1 or 1) end
  return helpers.from_flat(v, t:shape())
end

local function same_shape(t, shape)
  local s = t:shape()
  assert.are.same(shape, s)
end

-- f32 results of one f32 op on f32 inputs: the float64 reference differs by rounding only
local RTOL, ATOL = 1e-6, 1e-6

describe('elementwise binary ops: values', function()
  for k, op in ipairs(OPS) do
    it(op.name .. ' same shape [7, 33]', function()
      helpers.reseed(100 + k)
      local a, b = uly.randn(7, 33), away_from_zero(7, 33)
      local y = op.t(a, b)
      same_shape(y, { 7, 33 })
      local ref = ref_binary(helpers.list(a), { 7, 33 }, helpers.list(b), { 7, 33 }, op.f)
      helpers.assert_close(y, ref, RTOL, ATOL, op.name)
    end)

    it(op.name .. ' broadcasts [3, 1, 5] with [4, 1] both ways', function()
      helpers.reseed(110 + k)
      local a, b = away_from_zero(3, 1, 5), away_from_zero(4, 1)
      local la, lb = helpers.list(a), helpers.list(b)
      local y = op.t(a, b)
      same_shape(y, { 3, 4, 5 })
      helpers.assert_close(y, (ref_binary(la, { 3, 1, 5 }, lb, { 4, 1 }, op.f)), RTOL, ATOL, op.name .. ' a,b')
      local z = op.t(b, a)
      same_shape(z, { 3, 4, 5 })
      helpers.assert_close(z, (ref_binary(lb, { 4, 1 }, la, { 3, 1, 5 }, op.f)), RTOL, ATOL, op.name .. ' b,a')
    end)

    it(op.name .. ' with a 0-d tensor and with a [1] tensor', function()
      helpers.reseed(120 + k)
      local a = away_from_zero(7, 3)
      local s0 = uly.tensor(-1.75)
      assert.are.equal(0, s0:dim())
      local s1 = uly.tensor({ 0.625 })
      local la = helpers.list(a)
      helpers.assert_close(op.t(a, s0), (ref_binary(la, { 7, 3 }, { -1.75 }, {}, op.f)), RTOL, ATOL, 'a op 0-d')
      helpers.assert_close(op.t(s0, a), (ref_binary({ -1.75 }, {}, la, { 7, 3 }, op.f)), RTOL, ATOL, '0-d op a')
      helpers.assert_close(op.t(a, s1), (ref_binary(la, { 7, 3 }, { 0.625 }, { 1 }, op.f)), RTOL, ATOL, 'a op [1]')
      local y = op.t(s0, s1)
      same_shape(y, { 1 })
      helpers.assert_close(y, { op.f(-1.75, 0.625) }, RTOL, ATOL, '0-d op [1]')
    end)

    it(op.name .. ' on non-contiguous operands (transpose, narrow, permute)', function()
      helpers.reseed(130 + k)
      -- a: [5, 7] transposed to [7, 5]; b: [7, 9] narrowed to columns 3..7
      local abase, bbase = away_from_zero(5, 7), away_from_zero(7, 9)
      local a, b = abase:t(), bbase:narrow(2, 3, 5)
      assert.is_false(a:is_contiguous())
      assert.is_false(b:is_contiguous())
      local la = R.permute_list(helpers.list(abase), { 5, 7 }, { 2, 1 })
      local lb = R.narrow_list(helpers.list(bbase), { 7, 9 }, 2, 3, 5)
      helpers.assert_close(op.t(a, b), (ref_binary(la, { 7, 5 }, lb, { 7, 5 }, op.f)), RTOL, ATOL, 'transposed, narrowed')
      -- 3-D permuted [3, 5, 4] (from [4, 3, 5]) with a broadcast narrowed [5, 1] (from [5, 3])
      local cbase, dbase = away_from_zero(4, 3, 5), away_from_zero(5, 3)
      local c, d = cbase:permute(2, 3, 1), dbase:narrow(2, 2, 1)
      local lc = R.permute_list(helpers.list(cbase), { 4, 3, 5 }, { 2, 3, 1 })
      local ld = R.narrow_list(helpers.list(dbase), { 5, 3 }, 2, 2, 1)
      local y = op.t(c, d)
      same_shape(y, { 3, 5, 4 })
      helpers.assert_close(y, (ref_binary(lc, { 3, 5, 4 }, ld, { 5, 1 }, op.f)), RTOL, ATOL, 'permuted, broadcast')
    end)
  end

  it('results are new contiguous tensors and the inputs are unchanged', function()
    helpers.reseed(140)
    local a, b = uly.randn(3, 4), uly.randn(3, 4)
    local la, lb = helpers.list(a), helpers.list(b)
    local y = a + b
    assert.is_true(y:is_contiguous())
    assert.is_false(uly.C.uly_tensor_shares_storage(y._h, a._h) ~= 0)
    helpers.assert_close(a, la, 0, 0, 'a unchanged')
    helpers.assert_close(b, lb, 0, 0, 'b unchanged')
  end)

  it('shapes that cannot broadcast raise an error naming both shapes', function()
    helpers.reseed(141)
    local a, b = uly.randn(3, 4), uly.randn(5)
    for _, op in ipairs(OPS) do
      local ok, err = pcall(op.t, a, b)
      assert.is_false(ok)
      assert.matches('cannot be broadcast', tostring(err), 1, true)
      assert.matches('[3, 4]', tostring(err), 1, true)
      assert.matches('[5]', tostring(err), 1, true)
    end
  end)
end)

describe('tensor-scalar ops: values', function()
  local SCALAR_CASES = {
    { 'x + 2.5', function(x) return x + 2.5 end, function(v) return v + 2.5 end },
    { '2.5 + x', function(x) return 2.5 + x end, function(v) return 2.5 + v end },
    { 'x - 1.25', function(x) return x - 1.25 end, function(v) return v - 1.25 end },
    { '3 - x', function(x) return 3 - x end, function(v) return 3 - v end },
    { 'x * -2.5', function(x) return x * -2.5 end, function(v) return v * -2.5 end },
    { '0.75 * x', function(x) return 0.75 * x end, function(v) return 0.75 * v end },
    { 'x / 4', function(x) return x / 4 end, function(v) return v / 4 end },
    { 'x / 3', function(x) return x / 3 end, function(v) return v / 3 end },
    { '3 / x', function(x) return 3 / x end, function(v) return 3 / v end },
    { 'x ^ 2', function(x) return x ^ 2 end, function(v) return v * v end },
    { 'x ^ 3', function(x) return x ^ 3 end, function(v) return v * v * v end },
    { '-x', function(x) return -x end, function(v) return -v end },
    { 'x:neg()', function(x) return x:neg() end, function(v) return -v end },
  }
  for k, c in ipairs(SCALAR_CASES) do
    it(c[1] .. ' on a contiguous [7, 5] and a transposed [5, 7]', function()
      helpers.reseed(200 + k)
      local x = away_from_zero(7, 5)
      local lx = helpers.list(x)
      helpers.assert_close(c[2](x), R.map(lx, c[3]), 2e-6, 1e-6, c[1])
      local xt = x:t()
      local lxt = R.permute_list(lx, { 7, 5 }, { 2, 1 })
      local y = c[2](xt)
      same_shape(y, { 5, 7 })
      helpers.assert_close(y, R.map(lxt, c[3]), 2e-6, 1e-6, c[1] .. ' transposed')
    end)
  end

  it('x ^ 0.5 and x ^ -1.5 on positive values', function()
    helpers.reseed(220)
    local x = uly.rand(33) + 0.25
    local lx = helpers.list(x)
    helpers.assert_close(x ^ 0.5, R.map(lx, math.sqrt), 2e-6, 1e-7, 'x ^ 0.5')
    helpers.assert_close(x ^ -1.5, R.map(lx, function(v) return v ^ -1.5 end), 4e-6, 1e-7, 'x ^ -1.5')
  end)

  it('x ^ 0 is one and x ^ 1 is x', function()
    helpers.reseed(221)
    local x = away_from_zero(4, 3)
    helpers.assert_close(x ^ 0, R.map(helpers.list(x), function() return 1 end), 0, 0, 'x ^ 0')
    helpers.assert_close(x ^ 1, x, 0, 0, 'x ^ 1')
  end)

  it('x ^ 0 has gradient 0 everywhere, also at x = 0 (0 * 0^-1 would be NaN)', function()
    local x = uly.tensor({ 0, 2, -3 }, { requires_grad = true })
    local y = x ^ 0
    y:sum():backward()
    assert.are.same({ 0, 0, 0 }, helpers.list(x.grad))
  end)

  it('number ^ tensor is refused with a hint', function()
    local x = uly.ones(2)
    local ok, err = pcall(function() return 2 ^ x end)
    assert.is_false(ok)
    assert.matches('not supported', tostring(err), 1, true)
  end)
end)

describe('elementwise gradients', function()
  for k, op in ipairs(OPS) do
    it(op.name .. ': gradcheck, same shape [3, 5]', function()
      helpers.reseed(300 + k)
      local a, b = R.leaf(away_from_zero(3, 5)), R.leaf(away_from_zero(3, 5))
      helpers.gradcheck(op.t, { a, b })
    end)

    it(op.name .. ': gradcheck with broadcast [3, 1, 5] and [4, 1] (grads sum over broadcast dims)', function()
      helpers.reseed(310 + k)
      local a, b = R.leaf(away_from_zero(3, 1, 5)), R.leaf(away_from_zero(4, 1))
      helpers.gradcheck(op.t, { a, b })
      helpers.gradcheck(function(x, y) return op.t(y, x) end, { a, b })
    end)

    it(op.name .. ': gradcheck with a 0-d operand', function()
      helpers.reseed(320 + k)
      local a, s = R.leaf(away_from_zero(2, 7)), R.leaf(uly.tensor(0.8))
      helpers.gradcheck(op.t, { a, s })
      helpers.gradcheck(function(x, y) return op.t(y, x) end, { a, s })
    end)

    it(op.name .. ': gradcheck through non-contiguous views', function()
      helpers.reseed(330 + k)
      local a, b = R.leaf(away_from_zero(5, 4)), R.leaf(away_from_zero(4, 7))
      -- a:t() is [4, 5]; b narrowed to columns 2..6 is [4, 5]
      helpers.gradcheck(function(x, y) return op.t(x:t(), y:narrow(2, 2, 5)) end, { a, b })
    end)
  end

  it('broadcast gradients equal the number of broadcast copies (add) and the summed partner (mul)', function()
    helpers.reseed(340)
    local a, b = R.leaf(uly.randn(3, 1, 5)), R.leaf(uly.randn(4, 1))
    ;(a + b):sum():backward()
    -- every element of a is used 4 times, every element of b 3 * 5 = 15 times
    helpers.assert_close(a.grad, R.map(helpers.list(a), function() return 4 end), 0, 0, 'd(a+b)/da')
    helpers.assert_close(b.grad, R.map(helpers.list(b), function() return 15 end), 0, 0, 'd(a+b)/db')
    a:zero_grad(); b:zero_grad()
    ;(a * b):sum():backward()
    local la, lb = helpers.list(a), helpers.list(b)
    local sb, ga, gb = 0, {}, {}
    for j = 1, 4 do sb = sb + lb[j] end
    for i = 1, 15 do ga[i] = sb end
    for j = 1, 4 do
      local s = 0
      for i = 1, 15 do s = s + la[i] end
      gb[j] = s * 1
    end
    helpers.assert_close(a.grad, ga, 1e-5, 1e-6, 'd(a*b)/da')
    helpers.assert_close(b.grad, gb, 1e-5, 1e-6, 'd(a*b)/db')
  end)

  it('x * x (the same tensor twice): gradient is 2x, and gradcheck agrees', function()
    helpers.reseed(350)
    local x = R.leaf(uly.randn(3, 7))
    ;(x * x):sum():backward()
    helpers.assert_close(x.grad, R.map(helpers.list(x), function(v) return 2 * v end), 1e-6, 1e-7, 'd(x*x)/dx')
    helpers.gradcheck(function(v) return v * v end, { x })
    helpers.gradcheck(function(v) return v + v end, { x })
    helpers.gradcheck(function(v) return v - v:t():t() * 0.5 end, { x })
  end)

  it('x / x and x - x have zero gradient', function()
    helpers.reseed(351)
    local x = R.leaf(away_from_zero(2, 5))
    ;(x / x):sum():backward()
    helpers.assert_close(x.grad, R.map(helpers.list(x), function() return 0 end), 0, 1e-6, 'd(x/x)/dx')
    x:zero_grad()
    ;(x - x):sum():backward()
    helpers.assert_close(x.grad, R.map(helpers.list(x), function() return 0 end), 0, 0, 'd(x-x)/dx')
  end)

  local SCALAR_GRADS = {
    { 'x + 2.5', function(x) return x + 2.5 end },
    { '2.5 - x', function(x) return 2.5 - x end },
    { 'x - 1.5', function(x) return x - 1.5 end },
    { 'x * -3', function(x) return x * -3 end },
    { 'x / 4', function(x) return x / 4 end },
    { '3 / x', function(x) return 3 / x end },
    { 'x ^ 2', function(x) return x ^ 2 end },
    { 'x ^ 3', function(x) return x ^ 3 end },
    { '-x', function(x) return -x end },
  }
  for k, c in ipairs(SCALAR_GRADS) do
    it('gradcheck ' .. c[1] .. ' (also through a transposed view)', function()
      helpers.reseed(360 + k)
      local x = R.leaf(away_from_zero(3, 5))
      helpers.gradcheck(c[2], { x })
      helpers.gradcheck(function(v) return c[2](v:t()) end, { x })
    end)
  end

  it('gradcheck x ^ 0.5 and x ^ -1.5 on positive values', function()
    helpers.reseed(380)
    local x = R.leaf(uly.rand(4, 5) + 0.5)
    helpers.gradcheck(function(v) return v ^ 0.5 end, { x })
    helpers.gradcheck(function(v) return v ^ -1.5 end, { x })
  end)

  it('scalar-op gradients have the exact closed form', function()
    helpers.reseed(381)
    local x = R.leaf(uly.rand(6) + 0.5)
    local lx = helpers.list(x)
    ;(x ^ 3):sum():backward()
    helpers.assert_close(x.grad, R.map(lx, function(v) return 3 * v * v end), 1e-5, 1e-6, 'd(x^3)')
    x:zero_grad()
    ;(5 / x):sum():backward()
    helpers.assert_close(x.grad, R.map(lx, function(v) return -5 / (v * v) end), 1e-5, 1e-6, 'd(5/x)')
    x:zero_grad()
    ;(-x * 2 + 1):sum():backward()
    helpers.assert_close(x.grad, R.map(lx, function() return -2 end), 0, 0, 'd(-2x+1)')
  end)
end)
