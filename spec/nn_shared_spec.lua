-- spec/nn_shared_spec.lua — a module or weight used in two places (tied layers) is one parameter:
-- listed once under its first name, counted once, its gradient normed and clipped once, stepped
-- once by the optimizers, and saved and loaded once by checkpoints (as PyTorch's parameters()).
local uly = require 'ulysses'
local helpers = require 'helpers'
local nn = uly.nn

local function names(m)
  local out = {}
  for k in m:named_parameters() do out[#out + 1] = k end
  return out
end

-- the L2 norm over the distinct gradients, from their values
local function true_norm(...)
  local s = 0
  for _, t in ipairs({ ... }) do
    local v, n = helpers.values(t.grad)
    for i = 0, n - 1 do s = s + v[i] * v[i] end
  end
  return math.sqrt(s)
end

local function near(actual, expected, what)
  assert(math.abs(actual - expected) <= 1e-5 * expected,
         string.format('%s: %.9g, expected %.9g', what, actual, expected))
end

-- Sequential(lin, GELU, lin): the same Linear twice
local function tied(seed)
  uly.manual_seed(seed)
  local lin = nn.Linear(3, 3)
  uly.no_grad(function() lin.bias:copy_(uly.randn(3)) end)
  return nn.Sequential(lin, nn.GELU(), lin), lin
end

local function forward_backward(seq)
  local x = helpers.from_flat({ 0.5, -1, 2, 1.5, 0.25, -0.75 }, { 2, 3 })
  local loss = seq(x):pow(2):sum()
  loss:backward()
  return loss
end

describe('shared modules and weights', function()
  before_each(function() helpers.reseed(907) end)

  it('list each tensor once, under its first name, and count it once', function()
    local seq, lin = tied(1)
    assert.are.same({ '1.weight', '1.bias' }, names(seq))
    assert.are.equal(12, seq:num_parameters())
    local ps = seq:parameters()
    assert.are.equal(2, #ps)
    assert.are.equal(lin.weight, ps[1])
    assert.are.equal(lin.bias, ps[2])
    -- one weight registered by two modules (an embedding tied to a head)
    local emb, head = nn.Embedding(5, 4), nn.Linear(4, 5, { bias = false })
    head:param('weight', emb.weight)
    local m = nn.Sequential(emb, nn.LayerNorm(4), head)
    assert.are.same({ '1.weight', '2.weight', '2.bias' }, names(m))
    assert.are.equal(5 * 4 + 4 + 4, m:num_parameters())
    assert.truthy(tostring(m):find('[28 params]', 1, true), tostring(m))
  end)

  it('grad_norm and clip_grad_norm see each gradient once', function()
    local seq, lin = tied(2)
    forward_backward(seq)
    local want = true_norm(lin.weight, lin.bias)
    assert.is_true(want > 1.5, 'the clip below must act: norm ' .. want)
    near(uly.optim.grad_norm(seq), want, 'grad_norm(module)')
    near(uly.optim.grad_norm(seq:parameters()), want, 'grad_norm(parameters)')
    -- a hand-made list naming a tensor twice: still counted and scaled once
    local dup = { lin.weight, lin.bias, lin.weight }
    near(uly.optim.grad_norm(dup), want, 'grad_norm(list with a repeat)')
    local before = uly.optim.clip_grad_norm(seq, 1.0)
    near(before, want, 'clip_grad_norm returns the norm before')
    near(true_norm(lin.weight, lin.bias), 1.0, 'norm after clip_grad_norm(module, 1)')
    uly.optim.clip_grad_norm(dup, 0.5)
    near(true_norm(lin.weight, lin.bias), 0.5, 'norm after clip_grad_norm(list, 0.5)')
  end)

  it('optimizers take the module and step the shared tensor once', function()
    for _, make in ipairs({ uly.optim.AdamW, uly.optim.SGD }) do
      local a, la = tied(3)
      local b, lb = tied(3)
      local oa = make(a, { lr = 0.1 })
      local ob = make({ lb.weight, lb.bias }, { lr = 0.1 })
      assert.are.equal(2, #oa.params)
      for _ = 1, 2 do
        oa:zero_grad(); ob:zero_grad()
        forward_backward(a); forward_backward(b)
        oa:step(); ob:step()
      end
      helpers.assert_close(la.weight, lb.weight, 0, 0)
      helpers.assert_close(la.bias, lb.bias, 0, 0)
    end
  end)

  it('checkpoints save a tied model once and load it back, optimizer state included', function()
    local dir = helpers.mkdtemp()
    local path = dir .. '/tied.h5'
    local a, la = tied(4)
    local oa = uly.optim.AdamW(a, { lr = 0.05 })
    forward_backward(a); oa:step()
    uly.checkpoint.save(path, { model = a, optim = oa, step = 1 })
    local f = uly.h5.open(path)
    local saved = f:list('model')
    local count = f:attr('', 'num_parameter_tensors')
    f:close()
    table.sort(saved)
    assert.are.same({ 'model/1.bias', 'model/1.weight' }, saved)
    assert.are.equal(2, count)

    local b, lb = tied(5)
    local ob = uly.optim.AdamW(b, { lr = 0.05 })
    uly.checkpoint.load(path, { model = b, optim = ob })
    helpers.rmtree(dir)
    helpers.assert_close(lb.weight, la.weight, 0, 0)
    helpers.assert_close(lb.bias, la.bias, 0, 0)
    assert.are.equal(b[1], b[3])
    -- and training goes on identically
    oa:zero_grad(); ob:zero_grad()
    local l1, l2 = forward_backward(a), forward_backward(b)
    assert.are.equal(l1:item(), l2:item())
    oa:step(); ob:step()
    helpers.assert_close(lb.weight, la.weight, 0, 0)
  end)
end)
