-- spec/ops_attention_spec.lua — reference attention (q [B, Tq, H, D], k/v [B, Tk, Hkv, D]) against
-- a plain-Lua float64 implementation: causal (bottom-right aligned) or not, Tq != Tk, grouped
-- query heads, T = 1 / 7 / 33 and across the kernel's 64-row blocks, explicit scale; gradchecks
-- of q, k, v; shape errors.
local uly = require 'ulysses'
local helpers = require 'helpers'
local R = require 'reference'

---------------------------------------------------------------- float64 reference
-- out [B, Tq, H, D]; query i sees key j iff not causal or j <= i + Tk - Tq; a row that sees
-- no key outputs 0. Query head h uses kv head floor(h / (H / Hkv)).
local function ref_attention(lq, lk, lv, B, Tq, Tk, H, Hkv, D, scale, causal)
  scale = scale or 1 / math.sqrt(D)
  local rep = H / Hkv
  local out = {}
  for b = 0, B - 1 do
    for i = 0, Tq - 1 do
      for h = 0, H - 1 do
        local g = math.floor(h / rep)
        local qo = ((b * Tq + i) * H + h) * D
        local s, m = {}, -math.huge
        local nv = causal and math.min(Tk, math.max(0, i + Tk - Tq + 1)) or Tk
        for j = 0, nv - 1 do
          local ko = ((b * Tk + j) * Hkv + g) * D
          local dot = 0
          for d = 1, D do dot = dot + lq[qo + d] * lk[ko + d] end
          s[j] = scale * dot
          if s[j] > m then m = s[j] end
        end
        local z = 0
        for j = 0, nv - 1 do s[j] = math.exp(s[j] - m); z = z + s[j] end
        for d = 1, D do
          local acc = 0
          for j = 0, nv - 1 do acc = acc + s[j] / z * lv[((b * Tk + j) * Hkv + g) * D + d] end
          out[qo + d] = acc
        end
      end
    end
  end
  return out
end

-- sums of D products and of Tk weighted values in f32 (BLAS): a few 1e-7 relative
local RTOL, ATOL = 2e-5, 2e-6

local function check(B, Tq, Tk, H, Hkv, D, opts, what)
  local q, k, v = uly.randn(B, Tq, H, D), uly.randn(B, Tk, Hkv, D), uly.randn(B, Tk, Hkv, D)
  local y = uly.attention(q, k, v, opts)
  assert.are.same({ B, Tq, H, D }, y:shape())
  local ref = ref_attention(helpers.list(q), helpers.list(k), helpers.list(v), B, Tq, Tk, H, Hkv, D,
                            opts and opts.scale, opts and opts.causal)
  helpers.assert_close(y, ref, RTOL, ATOL, what)
  return y, q, k, v
end

describe('attention values', function()
  local CASES = {
    -- B, Tq, Tk, H, Hkv, D
    { 2, 7, 7, 2, 2, 8 },
    { 1, 1, 1, 1, 1, 4 },
    { 2, 1, 7, 2, 1, 4 },
    { 1, 33, 33, 2, 2, 4 },
    { 1, 3, 7, 2, 2, 5 },
    { 1, 7, 3, 2, 2, 4 },
    { 2, 7, 7, 4, 2, 4 },
    { 1, 7, 33, 4, 1, 3 },
    { 1, 70, 67, 2, 1, 4 },
    { 1, 67, 70, 2, 2, 3 },
  }
  for k, c in ipairs(CASES) do
    for _, causal in ipairs({ false, true }) do
      it(string.format('B %d Tq %d Tk %d H %d Hkv %d D %d, causal %s', c[1], c[2], c[3], c[4], c[5], c[6],
                       tostring(causal)), function()
        helpers.reseed(10 + k)
        check(c[1], c[2], c[3], c[4], c[5], c[6], { causal = causal }, 'attention')
      end)
    end
  end

  it('explicit scale, and the default scale is 1/sqrt(D)', function()
    helpers.reseed(30)
    local y, q, k, v = check(2, 7, 5, 4, 2, 6, { scale = 0.3 }, 'scale 0.3')
    check(1, 5, 7, 2, 1, 4, { scale = 2.5, causal = true }, 'scale 2.5 causal')
    local d = uly.attention(q, k, v, { scale = 1 / math.sqrt(6) })
    helpers.assert_close(uly.attention(q, k, v), d, 1e-6, 1e-7, 'default scale')
    assert(R.max_abs(helpers.list(y - d)) > 1e-3, 'the scale option had no effect')
  end)

  it('causal, Tq > Tk: queries that see no key output exactly 0', function()
    helpers.reseed(31)
    -- Tq 7, Tk 3: query i sees keys j <= i - 4, so queries 0..3 see nothing
    local y = check(1, 7, 3, 2, 1, 4, { causal = true }, 'Tq > Tk')
    local head = helpers.list(y:narrow(2, 1, 4))
    for i, x in ipairs(head) do assert(x == 0, 'masked query output ' .. i .. ' is ' .. x) end
    local last = helpers.list(y:narrow(2, 5, 3))
    local any = false
    for _, x in ipairs(last) do if x ~= 0 then any = true end end
    assert.is_true(any)
  end)

  it('causal with Tq == Tk: the first query returns the first value row', function()
    helpers.reseed(32)
    local y, _, _, v = check(2, 7, 7, 4, 2, 4, { causal = true }, 'causal')
    -- query 0 of head h sees key 0 of kv head h / 2 only
    local lv = helpers.list(v)
    local ly = helpers.list(y)
    for b = 0, 1 do
      for h = 0, 3 do
        for d = 1, 4 do
          local got = ly[((b * 7 + 0) * 4 + h) * 4 + d]
          local want = lv[((b * 7 + 0) * 2 + math.floor(h / 2)) * 4 + d]
          assert(math.abs(got - want) <= 1e-6, 'first query is not v[0]')
        end
      end
    end
  end)

  it('non-contiguous q, k, v (transposed from [B, H, T, D])', function()
    helpers.reseed(33)
    local qb, kb, vb = uly.randn(2, 4, 7, 4), uly.randn(2, 2, 5, 4), uly.randn(2, 2, 5, 4)
    local q, k, v = qb:transpose(2, 3), kb:transpose(2, 3), vb:transpose(2, 3)
    assert.is_false(q:is_contiguous())
    local lq = R.permute_list(helpers.list(qb), { 2, 4, 7, 4 }, { 1, 3, 2, 4 })
    local lk = R.permute_list(helpers.list(kb), { 2, 2, 5, 4 }, { 1, 3, 2, 4 })
    local lv = R.permute_list(helpers.list(vb), { 2, 2, 5, 4 }, { 1, 3, 2, 4 })
    for _, causal in ipairs({ false, true }) do
      helpers.assert_close(uly.attention(q, k, v, { causal = causal }),
                           ref_attention(lq, lk, lv, 2, 7, 5, 4, 2, 4, nil, causal), RTOL, ATOL,
                           'transposed inputs causal ' .. tostring(causal))
    end
  end)

  it('large scores (|s| ~ 100s, exp would overflow unshifted) stay finite', function()
    helpers.reseed(34)
    local q, k, v = uly.randn(1, 7, 2, 4) * 10, uly.randn(1, 7, 2, 4) * 10, uly.randn(1, 7, 2, 4)
    for _, causal in ipairs({ false, true }) do
      local y = uly.attention(q, k, v, { causal = causal })
      for i, x in ipairs(helpers.list(y)) do assert(x == x and math.abs(x) < math.huge, 'non-finite output ' .. i) end
      -- f32 scores of size S carry ~S * 2^-22 absolute error, which the softmax turns into a
      -- relative error of the weights: ~3e-5 here
      helpers.assert_close(y, ref_attention(helpers.list(q), helpers.list(k), helpers.list(v), 1, 7, 7, 2, 2, 4, nil,
                                            causal), 3e-4, 3e-4, 'large scores')
    end
  end)
end)

describe('attention gradients', function()
  local GCASES = {
    -- B, Tq, Tk, H, Hkv, D, causal
    { 1, 3, 4, 2, 2, 4, false },
    { 1, 3, 4, 2, 2, 4, true },
    { 1, 4, 3, 2, 1, 4, true },  -- Tq > Tk: the first query sees no key
    { 2, 3, 3, 4, 2, 2, true },  -- GQA
    { 1, 1, 5, 4, 1, 3, false }, -- T = 1, MQA
    { 1, 7, 7, 1, 1, 2, true },
  }
  for k, c in ipairs(GCASES) do
    it(string.format('gradcheck q, k, v: B %d Tq %d Tk %d H %d Hkv %d D %d causal %s', c[1], c[2], c[3], c[4],
                     c[5], c[6], tostring(c[7])), function()
      helpers.reseed(40 + k)
      local B, Tq, Tk, H, Hkv, D, causal = unpack(c, 1, 7)
      local q, kk, v = R.leaf(uly.randn(B, Tq, H, D)), R.leaf(uly.randn(B, Tk, Hkv, D)),
                       R.leaf(uly.randn(B, Tk, Hkv, D))
      helpers.gradcheck(function(a, b, d) return uly.attention(a, b, d, { causal = causal }) end, { q, kk, v })
    end)
  end

  it('gradcheck with an explicit scale and non-contiguous inputs', function()
    helpers.reseed(50)
    local q, k, v = R.leaf(uly.randn(1, 2, 3, 4)), R.leaf(uly.randn(1, 2, 4, 4)), R.leaf(uly.randn(1, 2, 4, 4))
    helpers.gradcheck(function(a, b, d)
      return uly.attention(a:transpose(2, 3), b:transpose(2, 3), d:transpose(2, 3), { causal = true, scale = 0.7 })
    end, { q, k, v })
  end)

  it('gradcheck across 64-row and 64-key blocks (T = 67 / 70, random directions)', function()
    helpers.reseed(51)
    for _, T in ipairs({ { 70, 67 }, { 67, 70 } }) do
      local Tq, Tk = T[1], T[2]
      local q, k, v = R.leaf(uly.randn(1, Tq, 2, 2)), R.leaf(uly.randn(1, Tk, 1, 2)), R.leaf(uly.randn(1, Tk, 1, 2))
      for _, causal in ipairs({ false, true }) do
        helpers.gradcheck(function(a, b, d) return uly.attention(a, b, d, { causal = causal }) end, { q, k, v },
                          { directions = 4 })
      end
    end
  end)

  it('masked queries and never-seen keys get zero gradient', function()
    helpers.reseed(52)
    -- Tq 5, Tk 3, causal: queries 0, 1 see no key; every key is seen by query 4
    local q, k, v = R.leaf(uly.randn(1, 5, 2, 4)), R.leaf(uly.randn(1, 3, 2, 4)), R.leaf(uly.randn(1, 3, 2, 4))
    uly.attention(q, k, v, { causal = true }):backward(uly.randn(1, 5, 2, 4))
    for i, x in ipairs(helpers.list(q.grad:narrow(2, 1, 2))) do assert(x == 0, 'masked query grad ' .. i) end
    local any = false
    for _, x in ipairs(helpers.list(q.grad:narrow(2, 3, 3))) do if x ~= 0 then any = true end end
    assert.is_true(any)
    -- Tq 3, Tk 3, causal: value row 2 is seen only by query 2
    local q2, k2, v2 = R.leaf(uly.randn(1, 3, 1, 4)), R.leaf(uly.randn(1, 3, 1, 4)), R.leaf(uly.randn(1, 3, 1, 4))
    local g = uly.zeros(1, 3, 1, 4)
    g:narrow(2, 1, 2):copy_(uly.randn(1, 2, 1, 4)) -- gradient only on queries 0, 1
    uly.attention(q2, k2, v2, { causal = true }):backward(g)
    for i, x in ipairs(helpers.list(v2.grad:narrow(2, 3, 1))) do assert(x == 0, 'unseen value grad ' .. i) end
    for i, x in ipairs(helpers.list(k2.grad:narrow(2, 3, 1))) do assert(x == 0, 'unseen key grad ' .. i) end
  end)
end)

describe('attention errors', function()
  it('a scale that is not a finite number > 0 is refused, naming it (both kernels)', function()
    local q = uly.randn(1, 3, 2, 4)
    for _, bad in ipairs({ 0, -0.5, 0 / 0, math.huge }) do
      for _, f in ipairs({ 'attention', 'flash_attention' }) do
        local err = helpers.error_of(function() local r = uly[f](q, q, q, { scale = bad }); return r end)
        assert.matches(f .. ': scale must be a finite number > 0, got ' .. tostring(bad):gsub('%-', '%%-'), err)
        assert.matches('ops_attention_spec.lua', err)
      end
    end
  end)

  it('shape errors name the tensors as given (bf16 q, k, v, not their f32 copies)', function()
    local t = uly.randn(1, 3):bf16()
    assert.matches('got q bf16%[1, 3%]', helpers.error_of(uly.attention, t, t, t))
  end)

  it('query heads that are not a multiple of kv heads', function()
    local ok, err = pcall(uly.attention, uly.randn(1, 3, 3, 4), uly.randn(1, 3, 2, 4), uly.randn(1, 3, 2, 4))
    assert.is_false(ok)
    assert.matches('multiple', tostring(err), 1, true)
  end)

  it('k and v of different shapes, and k/v that do not match q', function()
    local q = uly.randn(1, 3, 2, 4)
    local ok, err = pcall(uly.attention, q, uly.randn(1, 3, 2, 4), uly.randn(1, 4, 2, 4))
    assert.is_false(ok)
    assert.matches('attention', tostring(err), 1, true)
    assert.matches('[1, 4, 2, 4]', tostring(err), 1, true)
    local ok2 = pcall(uly.attention, q, uly.randn(1, 3, 2, 5), uly.randn(1, 3, 2, 5))
    assert.is_false(ok2, 'head_dim mismatch accepted')
    local ok3 = pcall(uly.attention, q, uly.randn(2, 3, 2, 4), uly.randn(2, 3, 2, 4))
    assert.is_false(ok3, 'batch mismatch accepted')
    local ok4, err4 = pcall(uly.attention, uly.randn(3, 2, 4), uly.randn(3, 2, 4), uly.randn(3, 2, 4))
    assert.is_false(ok4)
    assert.matches('head_dim', tostring(err4), 1, true)
  end)
end)
