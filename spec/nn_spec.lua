-- spec/nn_spec.lua — the nn modules: parameter naming and order, counts, train/eval, zero_grad,
-- printing, seeded init, and each layer's forward values and gradients (finite differences).
local uly = require 'ulysses'
local helpers = require 'helpers'
local nn = uly.nn

local function names(m)
  local out = {}
  for k, p in m:named_parameters() do
    assert(uly.is_tensor(p), k .. ' is not a tensor')
    out[#out + 1] = k
  end
  return out
end

describe('nn.Module', function()
  before_each(function() helpers.reseed(701) end)

  it('is reached as require("ulysses").nn', function()
    assert.are.equal(require 'ulysses.nn', uly.nn)
    assert.is_function(nn.Module.extend)
  end)

  it('names parameters in registration order, nested with dots, list children 1-based', function()
    local m = nn.Sequential(nn.Linear(4, 8), nn.GELU { approximate = 'tanh' },
                            nn.ModuleList { nn.LayerNorm(8), nn.SwiGLU(8, 6) }, nn.RMSNorm(8))
    assert.are.same({ '1.weight', '1.bias', '3.1.weight', '3.1.bias', '3.2.w1.weight', '3.2.w3.weight',
                      '3.2.w2.weight', '4.weight' }, names(m))
    local ps = m:parameters()
    assert.are.equal(8, #ps)
    assert.are.equal(m[1].weight, ps[1])
    assert.are.equal(m[3][2].w2.weight, ps[7])
    -- the order is stable across calls
    assert.are.same(names(m), names(m))
  end)

  it('a custom module nests its own parameters before its children', function()
    local Block = nn.Module:extend('Block')
    function Block:__init(C)
      self:add('attn', nn.Module:extend('Attn')())
      self.attn:add('wqkv', nn.Linear(C, 3 * C))
      self:param('gain', uly.ones(C))
      self:add('mlp', nn.MLP(C, 2 * C))
    end
    function Block:forward(x) return self.mlp(x) * self.gain end
    local Model = nn.Module:extend('Model')
    function Model:__init()
      self:add('blocks', nn.ModuleList { Block(2), Block(2), Block(2) })
    end
    local n = names(Model())
    assert.are.equal(3 * 7, #n)
    assert.are.equal('blocks.1.gain', n[1])
    assert.are.equal('blocks.1.attn.wqkv.weight', n[2])
    assert.are.equal('blocks.3.attn.wqkv.weight', n[16])
    assert.are.equal('blocks.3.mlp.proj.bias', n[21])
    assert.is_true(Block(3):parameters()[1].requires_grad)
  end)

  it('counts parameters', function()
    assert.are.equal(4 * 8 + 8, nn.Linear(4, 8):num_parameters())
    assert.are.equal(4 * 8, nn.Linear(4, 8, { bias = false }):num_parameters())
    assert.are.equal(10 * 3, nn.Embedding(10, 3):num_parameters())
    assert.are.equal(10, nn.LayerNorm(5):num_parameters())
    assert.are.equal(5, nn.RMSNorm(5):num_parameters())
    assert.are.equal(0, nn.GELU():num_parameters())
    assert.are.equal((4 * 16 + 16) + (16 * 4 + 4), nn.MLP(4, 16):num_parameters())
    assert.are.equal(3 * 4 * 6, nn.SwiGLU(4, 6):num_parameters())
    assert.are.equal((4 * 8 + 8) + (8 * 4 + 4), nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.1), nn.Linear(8, 4)):num_parameters())
  end)

  it('train() and eval() reach every descendant', function()
    local m = nn.Sequential(nn.Dropout(0.5), nn.ModuleList { nn.MLP(2, 4), nn.Dropout(0.1) })
    assert.is_true(m.training)
    m:eval()
    assert.is_false(m.training)
    assert.is_false(m[1].training)
    assert.is_false(m[2][1].fc.training)
    assert.is_false(m[2][2].training)
    m:train()
    assert.is_true(m[2][1].act.training)
    assert.is_true(m[2][2].training)
  end)

  it('zero_grad clears every parameter gradient', function()
    local m = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))
    m(uly.randn(2, 3)):sum():backward()
    for k, p in m:named_parameters() do assert.is_not_nil(p.grad, k) end
    m:zero_grad()
    for k, p in m:named_parameters() do assert.is_nil(p.grad, k) end
  end)

  it('prints the module tree with class names and parameter counts', function()
    local s = tostring(nn.Sequential(nn.Linear(4, 8), nn.GELU { approximate = 'tanh' }, nn.MLP(8, 2)))
    assert.truthy(s:find('Sequential', 1, true))
    assert.truthy(s:find('Linear(4 -> 8) [40 params]', 1, true))
    assert.truthy(s:find("GELU(approximate='tanh')", 1, true))
    assert.truthy(s:find('MLP() [' .. (8 * 2 + 2 + 2 * 8 + 8) .. ' params]', 1, true))
    assert.truthy(s:find('\n  3: MLP', 1, true))
    assert.truthy(s:find('\n    fc: Linear(8 -> 2)', 1, true))
  end)

  it('initialization is reproducible under uly.manual_seed and N(0, 0.02) by default', function()
    uly.manual_seed(1234)
    local a = nn.Linear(64, 64)
    uly.manual_seed(1234)
    local b = nn.Linear(64, 64)
    local c = nn.Linear(64, 64)
    helpers.assert_close(a.weight, b.weight, 0, 0, 'same seed')
    assert.is_true(helpers.list(a.weight)[1] ~= helpers.list(c.weight)[1])
    local v = helpers.list(a.weight)
    local s2 = 0
    for i = 1, #v do s2 = s2 + v[i] * v[i] end
    local std = math.sqrt(s2 / #v)
    assert.is_true(std > 0.018 and std < 0.022, 'std ' .. std)
    helpers.assert_close(a.bias, uly.zeros(64), 0, 0, 'bias')
    local wide = nn.Linear(64, 64, { std = 0.5 })
    v = helpers.list(wide.weight)
    s2 = 0
    for i = 1, #v do s2 = s2 + v[i] * v[i] end
    assert.is_true(math.sqrt(s2 / #v) > 0.45, 'opts.std')
  end)
end)

describe('nn layers', function()
  before_each(function() helpers.reseed(702) end)

  it('Linear stores weight [in, out] and computes x:matmul(W) + b, also on [B, T, C]', function()
    local lin = nn.Linear(5, 3)
    assert.are.same({ 5, 3 }, lin.weight:shape())
    lin:param('bias', uly.randn(3))  -- re-registering replaces the zero bias
    local x = uly.randn(4, 5)
    helpers.assert_close(lin(x), x:matmul(lin.weight) + lin.bias, 1e-6, 1e-6, 'Linear 2-D')
    local x3 = uly.randn(2, 7, 5)
    local y3 = lin(x3)
    assert.are.same({ 2, 7, 3 }, y3:shape())
    helpers.assert_close(y3:reshape(14, 3), lin(x3:reshape(14, 5)), 1e-6, 1e-6, 'Linear 3-D')
    -- exact float64 reference of one row
    local xl, wl, bl = helpers.list(x), helpers.list(lin.weight), helpers.list(lin.bias)
    local yl = helpers.list(lin(x))
    for j = 1, 3 do
      local s = bl[j]
      for k = 1, 5 do s = s + xl[k] * wl[(k - 1) * 3 + j] end
      assert.is_true(math.abs(s - yl[j]) < 1e-5, 'row 1 col ' .. j)
    end
    local nb = nn.Linear(5, 3, { bias = false })
    assert.is_nil(nb.bias)
    helpers.assert_close(nb(x), x:matmul(nb.weight), 1e-6, 1e-6, 'no bias')
  end)

  it('Embedding looks up rows of its weight', function()
    local e = nn.Embedding(6, 4)
    local y = e(uly.tensor({ { 5, 0 } }, { dtype = 'i64' }))
    assert.are.same({ 1, 2, 4 }, y:shape())
    helpers.assert_close(y:reshape(2, 4):select(1, 1), e.weight:select(1, 6), 0, 0, 'row 5')
    helpers.assert_close(y:reshape(2, 4):select(1, 2), e.weight:select(1, 1), 0, 0, 'row 0')
  end)

  it('gradcheck through Linear (x, weight, bias)', function()
    local lin = nn.Linear(4, 3)
    local x = uly.randn(2, 4, { requires_grad = true })
    local w = uly.randn(4, 3, { requires_grad = true })
    local b = uly.randn(3, { requires_grad = true })
    helpers.gradcheck(function(xx, ww, bb) lin.weight, lin.bias = ww, bb return lin(xx) end, { x, w, b })
  end)

  it('gradcheck through LayerNorm and RMSNorm', function()
    local ln, rn = nn.LayerNorm(5), nn.RMSNorm(5)
    local x = uly.randn(3, 5, { requires_grad = true })
    local w = uly.randn(5, { requires_grad = true })
    local b = uly.randn(5, { requires_grad = true })
    helpers.gradcheck(function(xx, ww, bb) ln.weight, ln.bias = ww, bb return ln(xx) end, { x, w, b })
    helpers.gradcheck(function(xx, ww) rn.weight = ww return rn(xx) end, { x, w })
    helpers.assert_close(ln(x), uly.layernorm(x, w, b, 1e-5), 1e-6, 1e-6, 'LayerNorm value')
    helpers.assert_close(rn(x), uly.rmsnorm(x, w, 1e-6), 1e-6, 1e-6, 'RMSNorm value')
  end)

  it('gradcheck through MLP and SwiGLU', function()
    local mlp = nn.MLP(3, 5)
    local x = uly.randn(2, 3, { requires_grad = true })
    local ps = {}
    for _, p in mlp:named_parameters() do ps[#ps + 1] = uly.randn(p:shape()):scale(0.5):requires_grad_(true) end
    helpers.gradcheck(function(xx, w1, b1, w2, b2)
      mlp.fc.weight, mlp.fc.bias, mlp.proj.weight, mlp.proj.bias = w1, b1, w2, b2
      return mlp(xx)
    end, { x, unpack(ps) })
    helpers.assert_close(mlp(x), (x:matmul(ps[1]) + ps[2]):gelu('tanh'):matmul(ps[3]) + ps[4], 1e-5, 1e-6, 'MLP')

    local sw = nn.SwiGLU(3, 4)
    local w1 = uly.randn(3, 4, { requires_grad = true })
    local w3 = uly.randn(3, 4, { requires_grad = true })
    local w2 = uly.randn(4, 3, { requires_grad = true })
    helpers.gradcheck(function(xx, a, c, d) sw.w1.weight, sw.w3.weight, sw.w2.weight = a, c, d return sw(xx) end,
                      { x, w1, w3, w2 })
    helpers.assert_close(sw(x), (x:matmul(w1):silu() * x:matmul(w3)):matmul(w2), 1e-5, 1e-6, 'SwiGLU')
  end)

  it('Dropout is the identity in eval mode and drops in train mode', function()
    local d = nn.Dropout(0.5)
    local x = uly.ones(2000)
    local v = helpers.list(d(x))
    local zeros = 0
    for i = 1, #v do
      if v[i] == 0 then zeros = zeros + 1 else assert.is_true(math.abs(v[i] - 2) < 1e-6, 'scaled by 1/(1-p)') end
    end
    assert.is_true(zeros > 850 and zeros < 1150, 'dropped ' .. zeros)
    d:eval()
    helpers.assert_close(d(x), x, 0, 0, 'eval identity')
    assert.has_error(function() nn.Dropout(1) end)
  end)

  it('GELU follows its approximate option', function()
    local x = uly.randn(7)
    helpers.assert_close(nn.GELU { approximate = 'tanh' }(x), x:gelu('tanh'), 0, 0, 'tanh')
    helpers.assert_close(nn.GELU()(x), x:gelu(), 0, 0, 'exact')
  end)
end)
