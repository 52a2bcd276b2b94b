-- spec/autograd_spec.lua — the autograd engine: accumulation, zero_grad, no_grad, detach,
-- leaves, explicit gradients, retain_graph, version counters, views, shared inputs, diamonds,
-- deep chains, and that graphs and tensors are freed.
local uly = require 'ulysses'
local helpers = require 'helpers'

local C = uly.C
local list, from_flat, assert_close = helpers.list, helpers.from_flat, helpers.assert_close

local function fails(fn)
  local ok, err = pcall(fn)
  assert.is_false(ok, 'expected an error')
  return tostring(err)
end

local function full_gc()
  collectgarbage()
  collectgarbage()
end

describe('gradient accumulation', function()
  it('two backward calls add into the leaves', function()
    local x = uly.tensor({ 1, 2, 3 }, { requires_grad = true })
    local w = uly.tensor({ 4, 5, 6 }, { requires_grad = true })
    ;(x * w):sum():backward()
    assert.are.same({ 4, 5, 6 }, list(x.grad))
    assert.are.same({ 1, 2, 3 }, list(w.grad))
    ;(x * x):sum():backward()                  -- a fresh graph: d/dx = 2x
    assert.are.same({ 6, 9, 12 }, list(x.grad))
    assert.are.same({ 1, 2, 3 }, list(w.grad))
  end)

  it('zero_grad sets to none or to zero', function()
    local x = uly.tensor({ 1, 2 }, { requires_grad = true })
    assert.is_nil(x.grad)
    ;(x * 3):sum():backward()
    assert.are.same({ 3, 3 }, list(x.grad))
    x:zero_grad(false)
    assert.is_not_nil(x.grad)
    assert.are.same({ 0, 0 }, list(x.grad))
    ;(x * 3):sum():backward()
    assert.are.same({ 3, 3 }, list(x.grad))
    x:zero_grad()
    assert.is_nil(x.grad)
    ;(x * 5):sum():backward()
    assert.are.same({ 5, 5 }, list(x.grad))
    x:zero_grad(true)
    assert.is_nil(x.grad)
  end)

  it('backward of a leaf itself accumulates the given gradient', function()
    local x = uly.tensor({ 1, 2 }, { requires_grad = true })
    x:backward(uly.tensor({ 0.5, -1 }))
    x:backward(uly.tensor({ 0.5, -1 }))
    assert.are.same({ 1, -2 }, list(x.grad))
  end)
end)

describe('grad mode', function()
  it('no_grad results have no grad_fn; enable_grad and nesting', function()
    local x = uly.tensor({ 1, 2 }, { requires_grad = true })
    assert.is_true(uly.is_grad_enabled())
    local y, inner, after_inner = uly.no_grad(function()
      local y = x * 2
      local inner = uly.no_grad(function() return x + 1 end)
      local after = uly.is_grad_enabled()
      local e = uly.enable_grad(function() return x * 3 end)
      assert.are.equal('MulScalarBackward', e.grad_fn)
      return y, inner, after
    end)
    assert.is_nil(y.grad_fn)
    assert.is_false(y.requires_grad)
    assert.is_nil(inner.grad_fn)
    assert.is_false(after_inner)
    assert.is_true(uly.is_grad_enabled())
    assert.are.equal('MulScalarBackward', (x * 2).grad_fn)
  end)

  it('no_grad restores the mode after an error inside', function()
    local ok, err = pcall(uly.no_grad, function() error('boom inside') end)
    assert.is_false(ok)
    assert.matches('boom inside', err)
    assert.is_true(uly.is_grad_enabled())
    ok = pcall(uly.no_grad, function()
      uly.no_grad(function() error('deeper') end)
    end)
    assert.is_false(ok)
    assert.is_true(uly.is_grad_enabled())
    -- and an error inside enable_grad nested in no_grad leaves no_grad in force
    uly.no_grad(function()
      assert.is_false(pcall(uly.enable_grad, function() error('x') end))
      assert.is_false(uly.is_grad_enabled())
    end)
    assert.is_true(uly.is_grad_enabled())
    local x = uly.ones(2, { requires_grad = true })
    assert.is_not_nil((x * 2).grad_fn)
  end)

  it('no_grad passes results and arguments through', function()
    local a, b = uly.no_grad(function(p, q) return p + q, p * q end, 3, 4)
    assert.are.equal(7, a)
    assert.are.equal(12, b)
  end)
end)

describe('leaves and detach', function()
  it('detach shares storage but cuts the graph', function()
    local x = uly.tensor({ 1, 2, 3 }, { requires_grad = true })
    local y = x * 2
    local d = y:detach()
    assert.is_nil(d.grad_fn)
    assert.is_false(d.requires_grad)
    assert.is_true(d:is_leaf())
    assert.is_true(C.uly_tensor_shares_storage(y._h, d._h) ~= 0)
    local z = (d * x):sum()
    z:backward()
    assert.are.same({ 2, 4, 6 }, list(x.grad))        -- only through x, not through d
    assert.is_nil(d.grad)
  end)

  it('requires_grad_ only on leaves', function()
    local x = uly.ones(3)
    assert.is_false(x.requires_grad)
    x:requires_grad_()
    assert.is_true(x.requires_grad)
    x:requires_grad_(false)
    assert.is_false(x.requires_grad)
    x:requires_grad_(true)
    local y = x * 2
    assert.is_false(y:is_leaf())
    y:requires_grad_(true)                               -- already true: allowed
    local msg = fails(function() y:requires_grad_(false) end)
    assert.matches('not a leaf', msg)
    assert.matches('detach', msg)
    assert.matches('floating', fails(function() uly.ones(2, { dtype = 'i64' }):requires_grad_() end))
  end)
end)

describe('backward', function()
  it('from a non-scalar with an explicit gradient', function()
    local x = uly.tensor({ 1, 2, 3 }, { requires_grad = true })
    local y = x * x
    y:backward(uly.tensor({ 1, 0.5, -1 }))
    assert.are.same({ 2, 2, -6 }, list(x.grad))
  end)

  it('on a non-scalar without a gradient errors', function()
    local x = uly.ones(2, 3, { requires_grad = true })
    local y = x * 2
    local msg = fails(function() y:backward() end)
    assert.matches('not a scalar', msg)
    assert.truthy(msg:find('f32[2, 3]', 1, true), msg)
    assert.is_nil(x.grad)
    assert.matches('does not match', fails(function() y:backward(uly.ones(3, 2)) end))
    assert.matches('does not require grad', fails(function() uly.ones(1):backward() end))
  end)

  it('twice without retain_graph errors and mentions retain_graph', function()
    helpers.reseed(1)
    local x = uly.randn(4, { requires_grad = true })
    local loss = x:exp():sum()
    loss:backward()
    local msg = fails(function() loss:backward() end)
    assert.matches('retain_graph', msg)
    -- the intermediate node is released too
    local y = x:tanh()
    local l1 = (y * 2):sum()
    local l2 = (y * 3):sum()
    l1:backward()
    assert.matches('retain_graph', fails(function() l2:backward() end))
  end)

  it('with retain_graph works and doubles the grads', function()
    helpers.reseed(2)
    local x = uly.randn(5, { requires_grad = true })
    local loss = (x:exp() * x):sum()
    loss:backward({ retain_graph = true })
    local g1 = list(x.grad)
    loss:backward()
    local g2 = list(x.grad)
    for i = 1, 5 do assert.is_true(math.abs(g2[i] - 2 * g1[i]) <= 1e-5 * math.abs(g1[i]) + 1e-6) end
    assert.are_not.same(g1, g2)
  end)

  it('detects in-place modification of a saved tensor (version counter)', function()
    helpers.reseed(3)
    local x = uly.randn(3, { requires_grad = true })
    local y = x * 1                -- a non-leaf, saved by the mul below
    local w = uly.randn(3)
    local z = (y * w):sum()
    w:fill_(1)                     -- w was saved by MulBackward
    local msg = fails(function() z:backward() end)
    assert.matches('modified in place', msg)
    assert.matches('MulBackward', msg)
    -- through a view sharing the storage
    local a = uly.randn(3, { requires_grad = true })
    local e = a:exp()              -- saves a and the result
    uly.no_grad(function() a:detach()[1] = 5 end)
    assert.matches('modified in place', fails(function() e:sum():backward() end))
    -- without the write, the same graph works
    local b = uly.randn(3, { requires_grad = true })
    b:exp():sum():backward()
    assert_close(b.grad, b:exp():detach(), 1e-6, 1e-7)
  end)

  it('refuses in-place writes into a leaf requiring grad outside no_grad', function()
    local x = uly.tensor({ 1, 2, 3 }, { requires_grad = true })
    assert.matches('leaf', fails(function() x:fill_(0) end))
    assert.matches('no_grad', fails(function() x[1] = 5 end))
    assert.matches('leaf', fails(function() x:copy_(uly.zeros(3)) end))
    assert.matches('leaf', fails(function() x:normal_() end))
    -- through views of the leaf, too
    assert.matches('view of a leaf', fails(function() x:narrow(1, 2, 2):fill_(0) end))
    assert.matches('view of a leaf', fails(function() x:view(3, 1):t()[1] = 9 end))
    assert.are.same({ 1, 2, 3 }, list(x))
    -- a tensor autograd computed: a write would leave its backward differentiating the old values
    -- (y = 2x; y:fill_(1); (y x):sum() once gave x.grad = 2x + 1 instead of 1)
    local y = x * 2
    assert.matches('autograd computed', fails(function() y[1] = 10 end))
    assert.matches('autograd computed', fails(function() y:fill_(1) end))
    assert.matches('autograd computed', fails(function() y:narrow(1, 1, 2):zero_() end))
    assert.matches('autograd computed', fails(function() y:copy_(uly.ones(3)) end))
    local c = y:clone()
    assert.matches('autograd computed', fails(function() c[1] = 10 end))   -- a clone is in the graph too
    local d = y:detach()
    d[1] = 10                                     -- out of the graph: allowed
    assert.are.same({ 10, 4, 6 }, list(d))
    local z = uly.no_grad(function() return x * 2 end)
    z:fill_(1)                                    -- made without a graph: allowed
    assert.are.same({ 1, 1, 1 }, list(z))
    uly.no_grad(function() x[2] = 7 end)
    assert.are.same({ 1, 7, 3 }, list(x))
    x:detach():fill_(0)
    assert.are.same({ 0, 0, 0 }, list(x))
  end)
end)

describe('gradients through views', function()
  it('transpose', function()
    helpers.reseed(10)
    local x = uly.randn(3, 4, { requires_grad = true })
    local w = uly.randn(3, 5)
    helpers.gradcheck(function(a) return a:transpose(1, 2):matmul(w) end, { x })
  end)
  it('narrow', function()
    helpers.reseed(11)
    local x = uly.randn(4, 6, { requires_grad = true })
    helpers.gradcheck(function(a) return a:narrow(2, 2, 3):exp() end, { x })
    x:zero_grad()
    x:narrow(1, 2, 2):sum():backward()
    assert.are.same({ 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0 }, list(x.grad))
  end)
  it('select and indexing', function()
    helpers.reseed(12)
    local x = uly.randn(3, 4, { requires_grad = true })
    helpers.gradcheck(function(a) return a:select(2, -1):tanh() * a[2]:narrow(1, 1, 3) end, { x })
    x:zero_grad()
    ;(x[-1] * 2):sum():backward()
    assert.are.same({ 0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2 }, list(x.grad))
  end)
  it('expand', function()
    helpers.reseed(13)
    local x = uly.randn(3, 1, { requires_grad = true })
    local y = uly.randn(2, 3, 4)
    helpers.gradcheck(function(a) return a:expand(2, 3, 4) * y end, { x })
    x:zero_grad()
    x:expand(2, 3, 4):sum():backward()
    assert.are.same({ 8, 8, 8 }, list(x.grad))
  end)
  it('permute', function()
    helpers.reseed(14)
    local x = uly.randn(2, 3, 4, { requires_grad = true })
    local w = uly.randn(4, 2, 3)
    helpers.gradcheck(function(a) return a:permute(3, 1, 2) * w end, { x })
  end)
  it('view, reshape, unsqueeze, contiguous', function()
    helpers.reseed(15)
    local x = uly.randn(2, 6, { requires_grad = true })
    local w = uly.randn(3, 4)
    helpers.gradcheck(function(a) return a:view(3, 4):sigmoid() * w end, { x })
    helpers.gradcheck(function(a) return a:t():reshape(4, 3):unsqueeze(1):contiguous():exp() end, { x })
  end)
end)

describe('graph shapes', function()
  it('the same tensor used twice: x * x and x:matmul(x)', function()
    local x = uly.tensor({ 1, -2, 3 }, { requires_grad = true })
    ;(x * x):sum():backward()
    assert.are.same({ 2, -4, 6 }, list(x.grad))
    helpers.reseed(20)
    local m = uly.randn(3, 3, { requires_grad = true })
    helpers.gradcheck(function(a) return a:matmul(a) end, { m })
    -- exact: d sum(M M) / dM = 1 M^T + M^T 1 (row sums + column sums)
    m:zero_grad()
    m:matmul(m):sum():backward()
    local v = m:totable()
    local g = m.grad:totable()
    for i = 1, 3 do
      for j = 1, 3 do
        local expect = 0
        for k = 1, 3 do expect = expect + v[j][k] + v[k][i] end
        assert.is_true(math.abs(g[i][j] - expect) < 1e-4, string.format('grad[%d][%d] %g vs %g', i, j, g[i][j], expect))
      end
    end
  end)

  it('diamond: y = a*b; z = y + y*a', function()
    local a = uly.tensor({ 2, -1, 0.5 }, { requires_grad = true })
    local b = uly.tensor({ 3, 4, -2 }, { requires_grad = true })
    local y = a * b
    local z = y + y * a
    z:sum():backward()
    -- z = ab + a^2 b: dz/da = b + 2ab, dz/db = a + a^2
    local av, bv = { 2, -1, 0.5 }, { 3, 4, -2 }
    local ga, gb = {}, {}
    for i = 1, 3 do ga[i] = bv[i] + 2 * av[i] * bv[i]; gb[i] = av[i] + av[i] ^ 2 end
    assert_close(a.grad, ga, 1e-6, 1e-6)
    assert_close(b.grad, gb, 1e-6, 1e-6)
    helpers.reseed(21)
    local p = uly.randn(2, 3, { requires_grad = true })
    local q = uly.randn(2, 3, { requires_grad = true })
    helpers.gradcheck(function(s, t) local yy = s * t return yy + yy * s end, { p, q })
  end)

  it('gradients handed through add/view by reference are copied before anything accumulates into them', function()
    -- u = h + k runs first in backward and lends its gradient to both h and k; w = h * 3 then
    -- accumulates into h: the lent buffer must be copied, not written, since k still reads it
    local x = uly.tensor({ 1, 2, 3, 4 }, { requires_grad = true })
    local y = uly.tensor({ 5, 6, 7, 8 }, { requires_grad = true })
    local h = x * 2
    local k = y * 1             -- runs after w in backward and reads the gradient u lent to it
    local w = h * 3
    local u = h + k
    local v = u:view(2, 2)
    local L = w:sum() + (v * uly.tensor({ { 1, 10 }, { 100, 1000 } })):sum()
    L:backward()
    assert_close(x.grad, { 2 * (3 + 1), 2 * (3 + 10), 2 * (3 + 100), 2 * (3 + 1000) }, 0, 0)
    assert_close(y.grad, { 1, 10, 100, 1000 }, 0, 0)
    -- the same node twice through a pass-through op: s = h + h
    x:zero_grad()
    local h2 = x * 2
    ;(h2 + h2):view(2, 2):sum():backward()
    assert_close(x.grad, { 4, 4, 4, 4 }, 0, 0)
    -- a - b lends only to a; b gets -g
    x:zero_grad(); y:zero_grad()
    local d = (x * 1) - (y * 1)
    d:sum():backward()
    assert_close(x.grad, { 1, 1, 1, 1 }, 0, 0)
    assert_close(y.grad, { -1, -1, -1, -1 }, 0, 0)
  end)

  it('profile_backward times every backward rule by op', function()
    local a = uly.randn(8, 4, { requires_grad = true })
    local b = uly.randn(4, 3, { requires_grad = true })
    local loss = (a:matmul(b):gelu() + 1):sum()
    local rows = uly.profile_backward(function() loss:backward() end)
    local by = {}
    for _, r in ipairs(rows) do by[r.op] = r end
    assert.are.equal(1, by.MatmulBackward.calls)
    assert.are.equal(1, by.UnaryBackward.calls)
    assert.is_true(by.MatmulBackward.seconds >= 0)
    assert.is_nil(by.AttentionBackward)
    -- off again afterwards: a second backward adds nothing to a fresh report
    local rows2 = uly.profile_backward(function() end)
    assert.are.same({}, rows2)
  end)

  it('a deep chain of 10000 ops backward without stack overflow', function()
    local x = uly.tensor({ 1.5, -0.5 }, { requires_grad = true })
    full_gc()
    local before = tonumber(C.uly_autograd_live_nodes())
    local v = x
    for _ = 1, 10000 do v = v * 1.0001 end
    assert.is_true(tonumber(C.uly_autograd_live_nodes()) - before >= 10000)
    v:sum():backward()
    local g = 1.0001 ^ 10000
    assert_close(x.grad, { g, g }, 1e-3, 1e-4)
    v = nil
    full_gc()
    assert.are.equal(before, tonumber(C.uly_autograd_live_nodes())) -- iterative release too
  end)
end)

describe('leaks', function()
  it('graphs and tensors are freed once out of scope', function()
    full_gc()
    local nodes0 = tonumber(C.uly_autograd_live_nodes())
    local tensors0 = uly.live_tensors()
    local mem0 = uly.memory().allocated
    do
      helpers.reseed(30)
      local w = uly.randn(4, 4, { requires_grad = true })
      local x = uly.randn(3, 4)
      for _ = 1, 3 do
        local h = x:matmul(w):tanh()
        local loss = (h * h):mean() + h:narrow(2, 1, 2):sum()
        assert.is_true(tonumber(C.uly_autograd_live_nodes()) > nodes0)
        loss:backward()
      end
      -- an un-backwarded graph, a retained one and a cycle through a view
      local y = (w:t() * 2):exp():sum()
      local r = (w * w):sum()
      r:backward({ retain_graph = true })
      assert.is_not_nil(w.grad)
      assert.is_true(uly.live_tensors() > tensors0)
    end
    full_gc()
    assert.are.equal(nodes0, tonumber(C.uly_autograd_live_nodes()))
    assert.are.equal(tensors0, uly.live_tensors())
    assert.are.equal(mem0, uly.memory().allocated)
  end)

  it('failed backward and failed ops leak nothing', function()
    full_gc()
    local nodes0 = tonumber(C.uly_autograd_live_nodes())
    local tensors0 = uly.live_tensors()
    do
      helpers.reseed(31)
      local x = uly.randn(3, { requires_grad = true })
      local w = uly.randn(3)
      local z = (x * w):sum()
      w:fill_(0)
      assert.is_false(pcall(function() z:backward() end))
      assert.is_false(pcall(function() local r = x:matmul(w) end))
      local l = x:exp():sum()
      l:backward()
      assert.is_false(pcall(function() l:backward() end))
    end
    full_gc()
    assert.are.equal(nodes0, tonumber(C.uly_autograd_live_nodes()))
    assert.are.equal(tensors0, uly.live_tensors())
  end)
end)

describe('gradient through a transposed view (tiled accumulation path)', function()
  it('x:t() * w accumulates w:t() into x.grad for tiles larger than 32, with batch dims', function()
    helpers.reseed(77)
    for _, shape in ipairs({ { 40, 70 }, { 3, 33, 65 } }) do
      local x = uly.randn(shape, { requires_grad = true })
      local nd = #shape
      local xt = x:transpose(nd - 1, nd)
      local w = uly.randn(xt:shape())
      local y = (xt * w):sum()
      y:backward()
      helpers.assert_close(x.grad, w:transpose(nd - 1, nd):contiguous(), 0, 0, 'grad through transpose')
      y = (xt * w):sum()
      y:backward() -- accumulates: twice the value
      helpers.assert_close(x.grad, (w * 2):transpose(nd - 1, nd):contiguous(), 1e-6, 0, 'accumulated grad')
    end
  end)
end)
