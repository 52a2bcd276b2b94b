-- spec/ops_matmul_spec.lua — matmul: 2-D, batched, broadcast batch dims, the Linear case
-- [B, T, K] @ [K, N], transposed / narrowed / strided operands, odd sizes and K = 1; values
-- against a naive float64 Lua matmul, gradients by finite differences, shape errors.
local uly = require 'ulysses'
local helpers = require 'helpers'
local R = require 'reference'

---------------------------------------------------------------- float64 reference
-- [..., M, K] @ [..., K, N] with right-aligned broadcast batch dims, naive triple loop in float64
local function ref_matmul(la, sa, lb, sb)
  local M, K, N = sa[#sa - 1], sa[#sa], sb[#sb]
  assert(sb[#sb - 1] == K, 'reference: inner dimensions differ')
  local bshape, oa, ob = R.broadcast(sa, sb, #sa - 2, #sb - 2)
  local out = {}
  for bi = 1, #oa do
    for i = 0, M - 1 do
      for j = 0, N - 1 do
        local s = 0
        for k = 0, K - 1 do s = s + la[oa[bi] + i * K + k + 1] * lb[ob[bi] + k * N + j + 1] end
        out[#out + 1] = s
      end
    end
  end
  local oshape = { unpack(bshape) }
  oshape[#oshape + 1] = M
  oshape[#oshape + 1] = N
  return out, oshape
end

-- sgemm accumulates K products in f32: relative error grows like K * 2^-24 of sum |a||b|
local function check_matmul(a, b, la, sa, lb, sb, what)
  local y = a:matmul(b)
  local ref, oshape = ref_matmul(la, sa, lb, sb)
  assert.are.same(oshape, y:shape())
  helpers.assert_close(y, ref, 1e-5, 2e-5, what)
  return y
end

describe('matmul values', function()
  local SIZES = {
    { 1, 1, 1 }, { 7, 33, 1 }, { 1, 7, 33 }, { 33, 7, 7 }, { 7, 1, 33 }, { 33, 33, 33 }, { 5, 64, 3 },
  }
  for k, s in ipairs(SIZES) do
    local M, K, N = s[1], s[2], s[3]
    it(string.format('2-D [%d, %d] @ [%d, %d]', M, K, K, N), function()
      helpers.reseed(10 + k)
      local a, b = uly.randn(M, K), uly.randn(K, N)
      check_matmul(a, b, helpers.list(a), { M, K }, helpers.list(b), { K, N }, 'matmul')
    end)
  end

  it('K = 1 is an outer product', function()
    helpers.reseed(20)
    local a, b = uly.randn(7, 1), uly.randn(1, 33)
    local la, lb = helpers.list(a), helpers.list(b)
    local y = a:matmul(b)
    local ref = {}
    for i = 1, 7 do for j = 1, 33 do ref[#ref + 1] = la[i] * lb[j] end end
    helpers.assert_close(y, ref, 1e-6, 1e-7, 'outer product')
  end)

  it('batched 3-D [3, 7, 5] @ [3, 5, 4], and uly.matmul', function()
    helpers.reseed(21)
    local a, b = uly.randn(3, 7, 5), uly.randn(3, 5, 4)
    local y = check_matmul(a, b, helpers.list(a), { 3, 7, 5 }, helpers.list(b), { 3, 5, 4 }, 'batched')
    helpers.assert_close(uly.matmul(a, b), y, 0, 0, 'uly.matmul')
  end)

  it('broadcast batch dims [2, 1, 3, 4] @ [5, 4, 6] -> [2, 5, 3, 6]', function()
    helpers.reseed(22)
    local a, b = uly.randn(2, 1, 3, 4), uly.randn(5, 4, 6)
    local y = check_matmul(a, b, helpers.list(a), { 2, 1, 3, 4 }, helpers.list(b), { 5, 4, 6 }, 'broadcast batch')
    assert.are.same({ 2, 5, 3, 6 }, y:shape())
  end)

  it('broadcast batch the other way [5, 3, 4] @ [2, 1, 4, 6] and [1, 3, 4] @ [7, 4, 2]', function()
    helpers.reseed(23)
    local a, b = uly.randn(5, 3, 4), uly.randn(2, 1, 4, 6)
    check_matmul(a, b, helpers.list(a), { 5, 3, 4 }, helpers.list(b), { 2, 1, 4, 6 }, 'broadcast b batch')
    local c, d = uly.randn(1, 3, 4), uly.randn(7, 4, 2)
    check_matmul(c, d, helpers.list(c), { 1, 3, 4 }, helpers.list(d), { 7, 4, 2 }, 'size-1 batch')
  end)

  it('the Linear case [B, T, K] @ [K, N], contiguous and not', function()
    helpers.reseed(24)
    local x, w = uly.randn(2, 7, 33), uly.randn(33, 5)
    local lw = helpers.list(w)
    check_matmul(x, w, helpers.list(x), { 2, 7, 33 }, lw, { 33, 5 }, 'linear')
    -- a non-contiguous [B, T, K] (from [7, 2, 33]) takes the batched path
    local xb = uly.randn(7, 2, 33)
    local xt = xb:transpose(1, 2)
    assert.is_false(xt:is_contiguous())
    local lxt = R.permute_list(helpers.list(xb), { 7, 2, 33 }, { 2, 1, 3 })
    check_matmul(xt, w, lxt, { 2, 7, 33 }, lw, { 33, 5 }, 'linear, transposed input')
    -- 4-D input [2, 3, 1, 7] @ [7, 1]
    local x4, w1 = uly.randn(2, 3, 1, 7), uly.randn(7, 1)
    check_matmul(x4, w1, helpers.list(x4), { 2, 3, 1, 7 }, helpers.list(w1), { 7, 1 }, 'linear 4-D, N = 1')
  end)

  it('transposed operands: a:t(), b:t(), both, and batched transpose', function()
    helpers.reseed(25)
    local abase, bbase = uly.randn(33, 7), uly.randn(5, 33)
    local la = R.permute_list(helpers.list(abase), { 33, 7 }, { 2, 1 })
    local lb = R.permute_list(helpers.list(bbase), { 5, 33 }, { 2, 1 })
    local a2, b2 = uly.randn(7, 33), uly.randn(33, 5)
    check_matmul(abase:t(), b2, la, { 7, 33 }, helpers.list(b2), { 33, 5 }, 'a:t() @ b')
    check_matmul(a2, bbase:t(), helpers.list(a2), { 7, 33 }, lb, { 33, 5 }, 'a @ b:t()')
    check_matmul(abase:t(), bbase:t(), la, { 7, 33 }, lb, { 33, 5 }, 'a:t() @ b:t()')
    local q, kk = uly.randn(3, 7, 4), uly.randn(3, 5, 4)
    local lk = R.permute_list(helpers.list(kk), { 3, 5, 4 }, { 1, 3, 2 })
    check_matmul(q, kk:transpose(2, 3), helpers.list(q), { 3, 7, 4 }, lk, { 3, 4, 5 }, 'q @ k^T batched')
    -- a [1, K] row transposed from a column and a [K, 1] column transposed from a row
    local col, row = uly.randn(7, 1), uly.randn(1, 7)
    check_matmul(col:t(), row:t(), helpers.list(col), { 1, 7 }, helpers.list(row), { 7, 1 }, 'vector transposes')
  end)

  it('narrowed and strided operands (including ones BLAS cannot take directly)', function()
    helpers.reseed(26)
    local abase, bbase = uly.randn(9, 12), uly.randn(8, 10)
    -- [7, 5] with row stride 12; [5, 6] with row stride 10
    local a = abase:narrow(1, 2, 7):narrow(2, 3, 5)
    local b = bbase:narrow(1, 4, 5):narrow(2, 2, 6)
    local la = R.narrow_list(R.narrow_list(helpers.list(abase), { 9, 12 }, 1, 2, 7), { 7, 12 }, 2, 3, 5)
    local lb = R.narrow_list(R.narrow_list(helpers.list(bbase), { 8, 10 }, 1, 4, 5), { 5, 10 }, 2, 2, 6)
    check_matmul(a, b, la, { 7, 5 }, lb, { 5, 6 }, 'narrowed')
    -- neither row nor column stride is 1: select(3, 2) of [7, 5, 2] has strides (10, 2)
    local cbase = uly.randn(7, 5, 2)
    local c = cbase:select(3, 2)
    local lc = {}
    local lcb = helpers.list(cbase)
    for i = 0, 34 do lc[i + 1] = lcb[i * 2 + 2] end
    check_matmul(c, b, lc, { 7, 5 }, lb, { 5, 6 }, 'strided a')
    local d = uly.randn(7, 3)
    check_matmul(c:t(), d, R.permute_list(lc, { 7, 5 }, { 2, 1 }), { 5, 7 }, helpers.list(d), { 7, 3 }, 'strided a:t()')
  end)

  it('expanded (stride-0) batch operands', function()
    helpers.reseed(27)
    local a, w = uly.randn(3, 7, 4), uly.randn(4, 2)
    local wexp = w:view(1, 4, 2):expand(3, 4, 2)
    local lw = helpers.list(w)
    local lwexp = {}
    for _ = 1, 3 do for i = 1, 8 do lwexp[#lwexp + 1] = lw[i] end end
    check_matmul(a, wexp, helpers.list(a), { 3, 7, 4 }, lwexp, { 3, 4, 2 }, 'expanded b')
  end)
end)

describe('matmul gradients', function()
  it('gradcheck 2-D with odd sizes [7, 5] @ [5, 3] and [1, 7] @ [7, 1]', function()
    helpers.reseed(40)
    helpers.gradcheck(uly.matmul, { R.leaf(uly.randn(7, 5)), R.leaf(uly.randn(5, 3)) })
    helpers.gradcheck(uly.matmul, { R.leaf(uly.randn(1, 7)), R.leaf(uly.randn(7, 1)) })
  end)

  it('gradcheck K = 1: [7, 1] @ [1, 5]', function()
    helpers.reseed(41)
    helpers.gradcheck(uly.matmul, { R.leaf(uly.randn(7, 1)), R.leaf(uly.randn(1, 5)) })
  end)

  it('gradcheck batched [3, 4, 5] @ [3, 5, 2]', function()
    helpers.reseed(42)
    helpers.gradcheck(uly.matmul, { R.leaf(uly.randn(3, 4, 5)), R.leaf(uly.randn(3, 5, 2)) })
  end)

  it('gradcheck broadcast batch [2, 1, 3, 4] @ [5, 4, 6] (b has 120 elements: random directions)', function()
    helpers.reseed(43)
    helpers.gradcheck(uly.matmul, { R.leaf(uly.randn(2, 1, 3, 4)), R.leaf(uly.randn(5, 4, 6)) }, { directions = 10 })
    -- all coordinates with a smaller b: [2, 1, 3, 4] @ [3, 4, 2]
    helpers.gradcheck(uly.matmul, { R.leaf(uly.randn(2, 1, 3, 4)), R.leaf(uly.randn(3, 4, 2)) })
  end)

  it('gradcheck the Linear case [2, 3, 5] @ [5, 4], contiguous and transposed input', function()
    helpers.reseed(44)
    local x, w = R.leaf(uly.randn(2, 3, 5)), R.leaf(uly.randn(5, 4))
    helpers.gradcheck(uly.matmul, { x, w })
    local xt = R.leaf(uly.randn(3, 2, 5))
    helpers.gradcheck(function(a, b) return a:transpose(1, 2):matmul(b) end, { xt, w })
  end)

  it('gradcheck transposed operands', function()
    helpers.reseed(45)
    local a, b = R.leaf(uly.randn(5, 7)), R.leaf(uly.randn(3, 5))
    helpers.gradcheck(function(x, y) return x:t():matmul(y:t()) end, { a, b })
    local q, k = R.leaf(uly.randn(2, 3, 4)), R.leaf(uly.randn(2, 5, 4))
    helpers.gradcheck(function(x, y) return x:matmul(y:transpose(2, 3)) end, { q, k })
  end)

  it('gradcheck narrowed and strided operands', function()
    helpers.reseed(46)
    local a, b = R.leaf(uly.randn(6, 8)), R.leaf(uly.randn(5, 7, 2))
    helpers.gradcheck(function(x, y) return x:narrow(1, 2, 4):narrow(2, 3, 5):matmul(y:select(3, 2)) end, { a, b })
  end)

  it('gradcheck an expanded weight (gradient summed over the batch)', function()
    helpers.reseed(47)
    local a, w = R.leaf(uly.randn(3, 2, 4)), R.leaf(uly.randn(4, 3))
    helpers.gradcheck(function(x, y) return x:matmul(y:view(1, 4, 3):expand(3, 4, 3)) end, { a, w })
  end)

  it('gradients equal G B^T and A^T G', function()
    helpers.reseed(48)
    local a, b = R.leaf(uly.randn(7, 5)), R.leaf(uly.randn(5, 3))
    local g = uly.randn(7, 3)
    a:matmul(b):backward(g)
    local la, lb, lg = helpers.list(a), helpers.list(b), helpers.list(g)
    local lbt = R.permute_list(lb, { 5, 3 }, { 2, 1 })
    local lat = R.permute_list(la, { 7, 5 }, { 2, 1 })
    helpers.assert_close(a.grad, (ref_matmul(lg, { 7, 3 }, lbt, { 3, 5 })), 1e-5, 1e-6, 'dA')
    helpers.assert_close(b.grad, (ref_matmul(lat, { 5, 7 }, lg, { 7, 3 })), 1e-5, 1e-6, 'dB')
  end)
end)

describe('matmul errors', function()
  it('inner-dimension mismatch names both shapes', function()
    local ok, err = pcall(uly.matmul, uly.randn(3, 4), uly.randn(5, 6))
    assert.is_false(ok)
    err = tostring(err)
    assert.matches('inner dimensions', err, 1, true)
    assert.matches('[3, 4]', err, 1, true)
    assert.matches('[5, 6]', err, 1, true)
    local ok2, err2 = pcall(uly.matmul, uly.randn(2, 7, 4), uly.randn(3, 6))
    assert.is_false(ok2)
    assert.matches('inner dimensions', tostring(err2), 1, true)
  end)

  it('batch dims that cannot broadcast, and 1-D operands, are errors', function()
    local ok, err = pcall(uly.matmul, uly.randn(2, 3, 4), uly.randn(3, 4, 5))
    assert.is_false(ok)
    assert.matches('cannot be broadcast', tostring(err), 1, true)
    local ok2, err2 = pcall(uly.matmul, uly.randn(4), uly.randn(4, 2))
    assert.is_false(ok2)
    assert.matches('at least 2 dimensions', tostring(err2), 1, true)
  end)
end)

describe('addmm (a Linear layer in one op)', function()
  before_each(function() helpers.reseed() end)

  it('equals matmul + bias in values and gradients, with leading dims and a transposed weight', function()
    for _, shape in ipairs({ { 5, 7 }, { 2, 3, 7 }, { 1, 1, 7 } }) do
      local a = uly.randn(shape):requires_grad_()
      local w = uly.randn(3, 7):t():requires_grad_()           -- [7, 3], column-major storage
      local b = uly.randn(3):requires_grad_()
      local out = uly.addmm(a, w, b)
      local g = uly.randn(out:shape())
      out:backward(g)
      local a2, w2, b2 = a:detach():requires_grad_(), w:detach():requires_grad_(), b:detach():requires_grad_()
      local ref = a2:matmul(w2) + b2
      ref:backward(g)
      helpers.assert_close(out, ref, 1e-6, 1e-6, 'value')
      helpers.assert_close(a.grad, a2.grad, 1e-6, 1e-6, 'grad a')
      helpers.assert_close(w.grad, w2.grad, 1e-6, 1e-6, 'grad w')
      helpers.assert_close(b.grad, b2.grad, 1e-6, 1e-6, 'grad bias')
      assert.equal('AddmmBackward', out.grad_fn)
    end
  end)

  it('passes a finite-difference gradient check', function()
    helpers.gradcheck(function(a, w, b) return uly.addmm(a, w, b) end,
                      { uly.randn(2, 4, 5):requires_grad_(), uly.randn(5, 3):requires_grad_(), uly.randn(3):requires_grad_() })
  end)

  it('accumulates into existing gradients (two uses of the same weight)', function()
    local a, w, b = uly.randn(4, 5), uly.randn(5, 3):requires_grad_(), uly.randn(3):requires_grad_()
    local y = uly.addmm(a, w, b) + uly.addmm(a * 2, w, b)
    y:sum():backward()
    local ref = (a + a * 2):t():matmul(uly.ones(4, 3))
    helpers.assert_close(w.grad, ref, 1e-5, 1e-5, 'grad w')
    helpers.assert_close(b.grad, uly.full({ 3 }, 8), 0, 0, 'grad bias')
  end)

  it('names the shapes when they do not fit', function()
    local msg = helpers.error_of(function() return uly.addmm(uly.randn(4, 5), uly.randn(6, 3), uly.randn(3)) end)
    assert.matches('addmm: needs a [..., K] @ w [K, N] + bias [N], got f32[4, 5] @ f32[6, 3] + f32[3]', msg, 1, true)
  end)
end)
