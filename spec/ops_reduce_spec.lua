-- spec/ops_reduce_spec.lua — sum / mean / max over each dim (negative dims, keepdim), full
-- reductions, max indices (1-based, first of ties), softmax and log_softmax over every dim
-- (large inputs stay finite); values against plain-Lua float64 references, gradchecks.
local uly = require 'ulysses'
local helpers = require 'helpers'
local R = require 'reference'

---------------------------------------------------------------- float64 reference helpers
-- the lines along dim d (1-based), in row-major order of the other dims: calls
-- visit(k, line, base, step) for the k-th line (1-based), whose values are
-- list[base + j * step + 1], j = 0 .. shape[d] - 1; returns the keepdim shape
local function each_line(list, shape, d, visit)
  local st = R.strides_of(shape)
  local kshape = {}
  for i = 1, #shape do kshape[i] = i == d and 1 or shape[i] end
  for p = 0, R.numel(kshape) - 1 do
    local idx = R.unravel(p, kshape)
    local base = 0
    for i = 1, #shape do base = base + idx[i] * st[i] end
    local line = {}
    for j = 0, shape[d] - 1 do line[j + 1] = list[base + j * st[d] + 1] end
    visit(p + 1, line, base, st[d])
  end
  return kshape
end

-- calls f(values) for each line along dim d (1-based); returns the list of f's results and the
-- reduced shape (keepdim or not)
local function along(list, shape, d, keepdim, f)
  local out = {}
  local kshape = each_line(list, shape, d, function(k, line) out[k] = f(line) end)
  if keepdim then return out, kshape end
  local rshape = {}
  for i = 1, #shape do
    if i ~= d then rshape[#rshape + 1] = shape[i] end
  end
  return out, rshape
end

-- scatter a per-line function back to full shape: g(line) returns a list of the same length
local function along_full(list, shape, d, g)
  local out = {}
  each_line(list, shape, d, function(_, line, base, step)
    local res = g(line)
    for j = 0, #line - 1 do out[base + j * step + 1] = res[j + 1] end
  end)
  return out
end

local function lmean(v) return R.lsum(v) / #v end
local function lmax(v)
  local m, a = v[1], 1
  for j = 2, #v do if v[j] > m then m, a = v[j], j end end
  return m, a
end

-- the max m of v and s = sum exp(v - m), shared by the softmax references
local function max_and_expsum(v)
  local m = lmax(v)
  local s = 0
  for _, x in ipairs(v) do s = s + math.exp(x - m) end
  return m, s
end

local function ref_softmax(v)
  local m, s = max_and_expsum(v)
  local out = {}
  for j, x in ipairs(v) do out[j] = math.exp(x - m) / s end
  return out
end

local function ref_log_softmax(v)
  local m, s = max_and_expsum(v)
  local out = {}
  for j, x in ipairs(v) do out[j] = x - m - math.log(s) end
  return out
end

-- values whose pairwise gaps are >= 0.1, so that a finite-difference step of 1e-2 never moves
-- the argmax: a random permutation of 0.1 * (0 .. n-1), shifted
local function separated(shape)
  local n = R.numel(shape)
  local v = {}
  for i = 1, n do v[i] = (i - 1) * 0.1 - n * 0.05 end
  for i = n, 2, -1 do
    local j = math.random(i)
    v[i], v[j] = v[j], v[i]
  end
  return helpers.from_flat(v, shape)
end

local SHAPES = { { 33 }, { 7, 5 }, { 3, 7, 5 }, { 1, 7, 1 } }

-- non-contiguous inputs: {make(base) -> view, base shape, list transform}
local function noncontig_cases()
  return {
    {
      'transposed [5, 7]', { 7, 5 },
      function(b) return b:t() end,
      function(l) return R.permute_list(l, { 7, 5 }, { 2, 1 }) end, { 5, 7 },
    },
    {
      'permuted [5, 3, 7]', { 3, 7, 5 },
      function(b) return b:permute(3, 1, 2) end,
      function(l) return R.permute_list(l, { 3, 7, 5 }, { 3, 1, 2 }) end, { 5, 3, 7 },
    },
    {
      'narrowed [3, 4, 5]', { 3, 7, 5 },
      function(b) return b:narrow(2, 2, 4) end,
      function(l) return R.narrow_list(l, { 3, 7, 5 }, 2, 2, 4) end, { 3, 4, 5 },
    },
  }
end

-- one case of noncontig_cases() made from a fresh randn base: the view, its values (row-major)
-- and its shape
local function noncontig_input(c)
  local base = uly.randn(c[2])
  return c[3](base), c[4](helpers.list(base)), c[5]
end

describe('sum / mean / max over one dim', function()
  for si, shape in ipairs(SHAPES) do
    local nd = #shape
    it('every dim of [' .. table.concat(shape, ', ') .. '], positive and negative, keepdim or not', function()
      helpers.reseed(10 + si)
      local x = uly.randn(shape)
      local lx = helpers.list(x)
      for d = 1, nd do
        for _, dd in ipairs({ d, d - nd - 1 }) do
          for _, keep in ipairs({ false, true }) do
            local what = string.format('dim %d keepdim %s', dd, tostring(keep))
            local rs, rshape = along(lx, shape, d, keep, R.lsum)
            local s = x:sum(dd, keep)
            assert.are.same(rshape, s:shape(), 'sum shape ' .. what)
            helpers.assert_close(s, rs, 1e-6, 1e-6, 'sum ' .. what)
            local rm = along(lx, shape, d, keep, lmean)
            local m = x:mean(dd, keep)
            assert.are.same(rshape, m:shape(), 'mean shape ' .. what)
            helpers.assert_close(m, rm, 1e-6, 1e-6, 'mean ' .. what)
            local rv = along(lx, shape, d, keep, function(v) return (lmax(v)) end)
            local ri = along(lx, shape, d, keep, function(v) return select(2, lmax(v)) end)
            local v, i = x:max(dd, keep)
            assert.are.same(rshape, v:shape(), 'max shape ' .. what)
            assert.are.same(rshape, i:shape(), 'argmax shape ' .. what)
            assert.are.equal('i64', i:dtype())
            helpers.assert_close(v, rv, 0, 0, 'max ' .. what)
            helpers.assert_close(i, ri, 0, 0, 'argmax (1-based) ' .. what)
          end
        end
      end
    end)
  end

  for ci, c in ipairs(noncontig_cases()) do
    it('every dim of a non-contiguous ' .. c[1] .. ' input', function()
      helpers.reseed(20 + ci)
      local x, lx, shape = noncontig_input(c)
      assert.is_false(x:is_contiguous())
      for d = 1, #shape do
        for _, keep in ipairs({ false, true }) do
          local what = string.format('%s dim %d keepdim %s', c[1], d, tostring(keep))
          helpers.assert_close(x:sum(d, keep), (along(lx, shape, d, keep, R.lsum)), 1e-6, 1e-6, 'sum ' .. what)
          helpers.assert_close(x:mean(d, keep), (along(lx, shape, d, keep, lmean)), 1e-6, 1e-6, 'mean ' .. what)
          local v, i = x:max(d, keep)
          helpers.assert_close(v, (along(lx, shape, d, keep, function(l) return (lmax(l)) end)), 0, 0, 'max ' .. what)
          helpers.assert_close(i, (along(lx, shape, d, keep, function(l) return select(2, lmax(l)) end)), 0, 0,
                               'argmax ' .. what)
        end
      end
    end)
  end

  it('max indices are 1-based and pick the first of tied maxima', function()
    helpers.reseed(30)
    local x = uly.tensor({ { 1, 3, 3, 2 }, { 5, 5, 5, 5 }, { -1, -2, -1, -7 } })
    local v, i = x:max(2)
    helpers.assert_close(v, { 3, 5, -1 }, 0, 0, 'row max')
    helpers.assert_close(i, { 2, 1, 1 }, 0, 0, 'row argmax')
    local v1, i1 = x:max(1)
    helpers.assert_close(v1, { 5, 5, 5, 5 }, 0, 0, 'column max')
    helpers.assert_close(i1, { 2, 2, 2, 2 }, 0, 0, 'column argmax')
    -- random small integers: many ties, along every dim of a 3-D shape
    local vals = {}
    for k = 1, 105 do vals[k] = math.random(0, 2) end
    local t = helpers.from_flat(vals, { 3, 7, 5 })
    for d = 1, 3 do
      local _, idx = t:max(d)
      helpers.assert_close(idx, (along(vals, { 3, 7, 5 }, d, false, function(l) return select(2, lmax(l)) end)), 0, 0,
                           'tied argmax dim ' .. d)
    end
  end)

  it('min and argmax: values and 1-based indices, the first of ties; over all elements too', function()
    local x = uly.tensor({ { 1, 3, 3, 2 }, { 5, 5, 5, 5 }, { -1, -2, -7, -7 } })
    local v, i = x:min(2)
    helpers.assert_close(v, { 1, 5, -7 }, 0, 0, 'row min')
    helpers.assert_close(i, { 1, 1, 3 }, 0, 0, 'row argmin')
    local vk = x:min(1, true)
    assert.are.same({ 1, 4 }, vk:shape())
    helpers.assert_close(vk, { -1, -2, -7, -7 }, 0, 0, 'column min, keepdim')
    assert.are.equal(-7, x:min():item())
    helpers.assert_close(x:argmax(2), { 2, 1, 1 }, 0, 0, 'row argmax')
    assert.are.same({ 3, 1 }, x:argmax(2, true):shape())
    assert.are.equal('i64', x:argmax(1):dtype())
    assert.are.equal(5, x:argmax():item(), 'flat index of the first maximum')
    assert.are.equal(11, x:neg():argmax():item(), 'flat index of the first minimum')
  end)

  it('gradcheck min over every dim and full min; abs: exact values, gradient sign(x), 0 at 0', function()
    helpers.reseed(84)
    local x = R.leaf(separated({ 3, 4 }))
    for d = -2, 2 do
      if d ~= 0 then helpers.gradcheck(function(t) return (t:min(d)) end, { x }) end
    end
    helpers.gradcheck(function(t) return t:min() end, { x })
    local vals = { -2.5, 0, 3, -0.125, 7, -2 ^ -100 }
    local a = R.leaf(uly.tensor(vals))
    local y = a:abs()
    helpers.assert_close(y, { 2.5, 0, 3, 0.125, 7, 2 ^ -100 }, 0, 0, 'abs values')
    y:backward(uly.tensor({ 1, 2, 3, 4, 5, 6 }))
    helpers.assert_close(a.grad, { -1, 0, 3, -4, 5, -6 }, 0, 0, 'abs gradient')
    helpers.gradcheck(function(t) return t:abs() end, { R.leaf(separated({ 5, 3 })) })
  end)

  it('max over a 1-element dim returns the input and index 1', function()
    helpers.reseed(31)
    local x = uly.randn(3, 1, 4)
    local v, i = x:max(2)
    helpers.assert_close(v, x:view(3, 4), 0, 0, 'values')
    helpers.assert_close(i, (function() local t = {} for k = 1, 12 do t[k] = 1 end return t end)(), 0, 0, 'indices')
  end)

  it('sum of a long row accumulates accurately (100003 elements of 0.1)', function()
    helpers.reseed(32)
    local x = uly.full({ 100003 }, 0.1)
    local f = helpers.list(x)[1] -- 0.1 rounded to f32
    helpers.assert_close(x:sum(), { 100003 * f }, 1e-6, 0, 'sum')
    helpers.assert_close(x:mean(1), { f }, 1e-6, 0, 'mean')
  end)
end)

describe('full reductions', function()
  for si, shape in ipairs(SHAPES) do
    it('sum(), mean(), max() of [' .. table.concat(shape, ', ') .. '] are 0-d', function()
      helpers.reseed(40 + si)
      local x = uly.randn(shape)
      local lx = helpers.list(x)
      local s, m, mx = x:sum(), x:mean(), x:max()
      for _, t in ipairs({ s, m, mx }) do
        assert.are.equal(0, t:dim())
        assert.are.equal(1, t:numel())
      end
      helpers.assert_close(s, { R.lsum(lx) }, 1e-6, 1e-6, 'sum')
      helpers.assert_close(m, { lmean(lx) }, 1e-6, 1e-6, 'mean')
      helpers.assert_close(mx, { (lmax(lx)) }, 0, 0, 'max')
    end)
  end

  it('of empty tensors: sum 0, mean NaN (as PyTorch), over all and over a dim', function()
    local e = uly.zeros(0, 3)
    assert.are.equal(0, e:sum():item())
    assert.is_true(e:mean():item() ~= e:mean():item())
    local m = helpers.list(e:mean(1))
    assert.are.equal(3, #m)
    for _, v in ipairs(m) do assert.is_true(v ~= v) end
    assert.are.same({ 0, 0, 0 }, helpers.list(e:sum(1)))
  end)

  it('full reductions of non-contiguous inputs', function()
    helpers.reseed(45)
    for _, c in ipairs(noncontig_cases()) do
      local x, lx = noncontig_input(c)
      helpers.assert_close(x:sum(), { R.lsum(lx) }, 1e-6, 1e-6, 'sum ' .. c[1])
      helpers.assert_close(x:mean(), { lmean(lx) }, 1e-6, 1e-6, 'mean ' .. c[1])
      helpers.assert_close(x:max(), { (lmax(lx)) }, 0, 0, 'max ' .. c[1])
    end
  end)
end)

describe('softmax and log_softmax', function()
  for si, shape in ipairs({ { 7 }, { 7, 5 }, { 3, 7, 5 }, { 1, 33, 1 } }) do
    it('over every dim of [' .. table.concat(shape, ', ') .. '] (positive and negative dims)', function()
      helpers.reseed(50 + si)
      local x = uly.randn(shape) * 3
      local lx = helpers.list(x)
      local nd = #shape
      for d = 1, nd do
        local rs = along_full(lx, shape, d, ref_softmax)
        local rl = along_full(lx, shape, d, ref_log_softmax)
        for _, dd in ipairs({ d, d - nd - 1 }) do
          local s, l = x:softmax(dd), x:log_softmax(dd)
          assert.are.same(shape, s:shape())
          helpers.assert_close(s, rs, 1e-5, 1e-7, 'softmax dim ' .. dd)
          helpers.assert_close(l, rl, 1e-5, 1e-6, 'log_softmax dim ' .. dd)
        end
      end
      -- default dim is the last; the functional forms agree
      helpers.assert_close(x:softmax(), along_full(lx, shape, nd, ref_softmax), 1e-5, 1e-7, 'softmax default dim')
      helpers.assert_close(uly.log_softmax(x, nd), x:log_softmax(nd), 0, 0, 'uly.log_softmax')
    end)
  end

  for ci, c in ipairs(noncontig_cases()) do
    it('over every dim of a non-contiguous ' .. c[1] .. ' input', function()
      helpers.reseed(60 + ci)
      local x, lx, shape = noncontig_input(c)
      for d = 1, #shape do
        helpers.assert_close(x:softmax(d), along_full(lx, shape, d, ref_softmax), 1e-5, 1e-7, c[1] .. ' softmax ' .. d)
        helpers.assert_close(x:log_softmax(d), along_full(lx, shape, d, ref_log_softmax), 1e-5, 1e-6,
                             c[1] .. ' log_softmax ' .. d)
      end
    end)
  end

  it('large inputs (|x| ~ 1e4) stay finite and match the reference, over every dim', function()
    helpers.reseed(70)
    local shape = { 3, 7, 5 }
    local x = uly.randn(shape) * 1e4
    local lx = helpers.list(x)
    for d = 1, 3 do
      local s, l = x:softmax(d), x:log_softmax(d)
      local ls, ll = helpers.list(s), helpers.list(l)
      for k = 1, #ls do
        assert(ls[k] == ls[k] and ls[k] >= 0 and ls[k] <= 1, 'softmax not finite in [0, 1] at ' .. k)
        assert(ll[k] == ll[k] and ll[k] > -math.huge and ll[k] <= 0, 'log_softmax not finite at ' .. k)
      end
      helpers.assert_close(s, along_full(lx, shape, d, ref_softmax), 1e-5, 1e-7, 'softmax 1e4 dim ' .. d)
      -- |log_softmax| reaches ~1e4: f32 keeps ~1e-3 absolute there
      helpers.assert_close(l, along_full(lx, shape, d, ref_log_softmax), 1e-6, 1e-5, 'log_softmax 1e4 dim ' .. d)
      -- rows of softmax sum to one
      helpers.assert_close(s:sum(d), (along(ls, shape, d, false, function() return 1 end)), 1e-5, 1e-6, 'sums')
    end
    -- a row of equal huge values is uniform
    local e = uly.full({ 2, 4 }, 3e4)
    helpers.assert_close(e:softmax(2), { 0.25, 0.25, 0.25, 0.25, 0.25, 0.25, 0.25, 0.25 }, 1e-6, 0, 'uniform')
    helpers.assert_close(e:log_softmax(2), (function()
      local t = {} for k = 1, 8 do t[k] = -math.log(4) end return t end)(), 1e-6, 0, 'log uniform')
  end)
end)

describe('reduction and softmax gradients', function()
  it('gradcheck sum and mean over every dim, keepdim or not, and full', function()
    helpers.reseed(80)
    local x = R.leaf(uly.randn(3, 5, 3))
    for d = -3, 3 do
      if d ~= 0 then
        for _, keep in ipairs({ false, true }) do
          helpers.gradcheck(function(t) return t:sum(d, keep) end, { x })
          helpers.gradcheck(function(t) return t:mean(d, keep) end, { x })
        end
      end
    end
    helpers.gradcheck(function(t) return t:sum() end, { x })
    helpers.gradcheck(function(t) return t:mean() end, { x })
  end)

  it('gradcheck sum, mean and softmax through non-contiguous views', function()
    helpers.reseed(81)
    local x = R.leaf(uly.randn(3, 7, 2))
    for d = 1, 3 do
      helpers.gradcheck(function(t) return t:permute(3, 1, 2):sum(d) end, { x })
      helpers.gradcheck(function(t) return t:narrow(2, 2, 5):mean(d, true) end, { x })
      helpers.gradcheck(function(t) return t:transpose(1, 3):softmax(d) end, { x })
      helpers.gradcheck(function(t) return t:narrow(2, 3, 4):log_softmax(d) end, { x })
    end
  end)

  it('gradcheck max over every dim and full max (well-separated values)', function()
    helpers.reseed(82)
    local x = R.leaf(separated({ 3, 5, 3 }))
    for d = -3, 3 do
      if d ~= 0 then
        helpers.gradcheck(function(t) return (t:max(d)) end, { x })
        helpers.gradcheck(function(t) return (t:max(d, true)) end, { x })
      end
    end
    helpers.gradcheck(function(t) return t:max() end, { x })
    helpers.gradcheck(function(t) return (t:t():max(1)) end, { R.leaf(separated({ 4, 7 })) })
  end)

  it('max gradient is one-hot at the first maximum, also with ties', function()
    helpers.reseed(83)
    local x = R.leaf(uly.tensor({ { 1, 4, 4, 0 }, { 2, 2, 2, 2 }, { -3, -1, -2, -1 } }))
    local v = x:max(2)
    v:backward(uly.tensor({ 10, 20, 30 }))
    helpers.assert_close(x.grad, { 0, 10, 0, 0, 20, 0, 0, 0, 0, 30, 0, 0 }, 0, 0, 'one-hot grad')
    x:zero_grad()
    x:max():backward()
    helpers.assert_close(x.grad, { 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0 }, 0, 0, 'full max grad')
  end)

  it('gradcheck softmax and log_softmax over every dim', function()
    helpers.reseed(84)
    local x = R.leaf(uly.randn(3, 5, 3))
    for d = -3, 3 do
      if d ~= 0 then
        helpers.gradcheck(function(t) return t:softmax(d) end, { x })
        helpers.gradcheck(function(t) return t:log_softmax(d) end, { x })
      end
    end
    local v = R.leaf(uly.randn(33))
    helpers.gradcheck(function(t) return t:softmax(1) end, { v })
    helpers.gradcheck(function(t) return t:log_softmax(1) end, { v })
  end)

  it('softmax and log_softmax gradients have the closed form', function()
    helpers.reseed(85)
    local x = R.leaf(uly.randn(2, 7))
    local g = uly.randn(2, 7)
    local lg = helpers.list(g)
    local y = x:softmax(2)
    y:backward(g)
    local ly = helpers.list(y)
    local ref = {}
    for r = 0, 1 do
      local s = 0
      for j = 1, 7 do s = s + lg[r * 7 + j] * ly[r * 7 + j] end
      for j = 1, 7 do ref[r * 7 + j] = ly[r * 7 + j] * (lg[r * 7 + j] - s) end
    end
    helpers.assert_close(x.grad, ref, 1e-5, 1e-6, 'softmax grad')
    x:zero_grad()
    x:log_softmax(2):backward(g)
    for r = 0, 1 do
      local s = 0
      for j = 1, 7 do s = s + lg[r * 7 + j] end
      for j = 1, 7 do ref[r * 7 + j] = lg[r * 7 + j] - ly[r * 7 + j] * s end
    end
    helpers.assert_close(x.grad, ref, 1e-5, 1e-6, 'log_softmax grad')
  end)

  it('softmax of large inputs has a finite gradient', function()
    helpers.reseed(86)
    local x = R.leaf(uly.randn(4, 5) * 1e4)
    x:softmax(2):backward(uly.randn(4, 5))
    for _, v in ipairs(helpers.list(x.grad)) do assert(v == v and math.abs(v) < math.huge, 'non-finite gradient') end
    x:zero_grad()
    x:log_softmax(1):backward(uly.randn(4, 5))
    for _, v in ipairs(helpers.list(x.grad)) do assert(v == v and math.abs(v) < math.huge, 'non-finite gradient') end
  end)
end)
