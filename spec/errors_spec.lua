-- spec/errors_spec.lua — bad input gives a Lua error (never a crash), the message names the op
-- and the shapes/dtypes involved, it points at the caller's own line, and the process goes on.
local uly = require 'ulysses'
local helpers = require 'helpers'

-- Run fn(mark) under pcall; fn calls mark() on the line just before the offending call, which is
-- never a tail call. Checks that it failed, at that line of this file, and that the message
-- contains every plain string in `needles`; then checks that the library still works.
local function expect_error(needles, fn)
  local line
  local function mark() line = debug.getinfo(2, 'l').currentline + 1 end
  local ok, err = pcall(fn, mark)
  assert.is_false(ok, 'expected an error')
  err = tostring(err)
  assert.is_not_nil(line, 'the test did not mark its offending line')
  assert.truthy(err:match('^[^:]*errors_spec%.lua:%d+: '), 'no caller position in: ' .. err)
  local at = tonumber(err:match('errors_spec%.lua:(%d+):'))
  assert.are.equal(line, at, 'error points at the wrong line: ' .. err)
  for _, s in ipairs(needles) do
    assert.truthy(err:find(s, 1, true), string.format('message lacks %q: %s', s, err))
  end
  -- the process continues and can still compute
  local y = uly.tensor({ 1, 2 }) * 3
  assert.are.same({ 3, 6 }, helpers.list(y))
  return err
end

describe('shape errors', function()
  it('matmul with mismatched inner dimensions', function()
    helpers.reseed(1)
    local a, b = uly.randn(2, 3), uly.randn(4, 5)
    expect_error({ 'matmul', 'f32[2, 3]', 'f32[4, 5]' }, function(mark)
      mark()
      local r = a:matmul(b)
    end)
    expect_error({ 'matmul', 'f32[3]' }, function(mark)
      mark()
      local r = uly.ones(3):matmul(uly.ones(3, 2))
    end)
  end)

  it('add with shapes that cannot broadcast', function()
    local a, b = uly.ones(2, 3), uly.ones(4, 3)
    expect_error({ 'add', 'f32[2, 3]', 'f32[4, 3]', 'broadcast' }, function(mark)
      mark()
      local r = a + b
    end)
    expect_error({ 'mul', 'f32[5]', 'f32[2, 3]' }, function(mark)
      mark()
      local r = uly.ones(5) * a
    end)
  end)

  it('layernorm weight of the wrong size', function()
    local x, w = uly.ones(3, 4), uly.ones(5)
    expect_error({ 'layernorm', 'weight', 'f32[5]', '4' }, function(mark)
      mark()
      local r = uly.layernorm(x, w)
    end)
  end)

  it('view with the wrong number of elements', function()
    local t = uly.ones(3, 4)
    expect_error({ 'view', '[5]', 'f32[3, 4]', '12' }, function(mark)
      mark()
      local r = t:view(5)
    end)
    expect_error({ 'view', 'f32[3, 4]' }, function(mark)
      mark()
      local r = t:view(5, -1)
    end)
  end)

  it('cross_entropy targets of the wrong shape', function()
    local logits = uly.zeros(3, 4)
    local targets = uly.tensor({ 1, 2 }, { dtype = 'i64' })
    expect_error({ 'cross_entropy', 'i64[2]', 'f32[3, 4]', '[3]' }, function(mark)
      mark()
      local r = uly.cross_entropy(logits, targets)
    end)
  end)
end)

describe('dtype errors', function()
  it('an f32 op on an i32 tensor suggests a conversion', function()
    local t = uly.ones(3, { dtype = 'i32' })
    expect_error({ 'exp', 'i32[3]', 'f32', ':float()' }, function(mark)
      mark()
      local r = t:exp()
    end)
    expect_error({ 'add', 'i32[3]', ':float()' }, function(mark)
      mark()
      local r = uly.ones(3) + t
    end)
  end)

  it('embedding with float indices', function()
    local idx, w = uly.tensor({ 0, 1 }), uly.ones(5, 2)
    expect_error({ 'embedding', 'f32[2]', 'i32 or i64' }, function(mark)
      mark()
      local r = uly.embedding(idx, w)
    end)
  end)

  it('an unknown dtype name', function()
    expect_error({ "'f8'", 'bf16' }, function(mark)
      mark()
      local r = uly.zeros(2, { dtype = 'f8' })
    end)
  end)
end)

describe('index errors', function()
  it('t[10] on a tensor of size 3, and negative past the start', function()
    local t = uly.ones(3)
    expect_error({ 'select', 'index 10', 'size 3', 'f32[3]' }, function(mark)
      mark()
      local r = t[10]
    end)
    expect_error({ 'select', 'index -4', 'size 3' }, function(mark)
      mark()
      local r = t[-4]
    end)
    expect_error({ 'select', 'index 0' }, function(mark)
      mark()
      t[0] = 1
    end)
  end)

  it('narrow out of range', function()
    local t = uly.ones(3, 4)
    expect_error({ 'narrow', 'size 4', 'f32[3, 4]' }, function(mark)
      mark()
      local r = t:narrow(2, 3, 3)
    end)
    expect_error({ 'narrow', 'dimension 3', 'f32[3, 4]' }, function(mark)
      mark()
      local r = t:narrow(3, 1, 1)
    end)
  end)

  it('embedding id >= vocab', function()
    local idx, w = uly.tensor({ { 0, 1, 2 }, { 3, 5, 1 } }, { dtype = 'i64' }), uly.ones(5, 2)
    expect_error({ 'embedding: index 5 at [2, 2] of i64[2, 3]', '5 rows' }, function(mark)
      mark()
      local r = uly.embedding(idx, w)
    end)
  end)

  it('cross_entropy target out of range', function()
    local logits = uly.zeros(3, 4)
    local targets = uly.tensor({ 0, 4, 1 }, { dtype = 'i32' })
    expect_error({ 'cross_entropy: target 4 at [2] of i32[3]', '4 classes' }, function(mark)
      mark()
      local r = uly.cross_entropy(logits, targets)
    end)
  end)

  it('dimension out of range in sum', function()
    local t = uly.ones(3, 4)
    expect_error({ 'sum', 'dimension 3', 'f32[3, 4]' }, function(mark)
      mark()
      local r = t:sum(3)
    end)
    expect_error({ 'sum', 'dimension -3' }, function(mark)
      mark()
      local r = t:sum(-3)
    end)
  end)
end)

describe('lifetime and autograd errors', function()
  it('using a freed tensor', function()
    local t = uly.ones(3)
    t:free()
    expect_error({ 'sum', 'freed' }, function(mark)
      mark()
      local r = t:sum()
    end)
    expect_error({ 'freed' }, function(mark)
      mark()
      local r = uly.ones(3) + t
    end)
  end)

  it('backward twice without retain_graph', function()
    local x = uly.tensor({ 1, 2 }, { requires_grad = true })
    local loss = x:exp():sum()
    loss:backward()
    expect_error({ 'backward', 'retain_graph' }, function(mark)
      mark()
      loss:backward()
    end)
  end)

  it('a non-tensor argument', function()
    expect_error({ 'matmul', 'expected a tensor', 'number' }, function(mark)
      mark()
      local r = uly.ones(2, 2):matmul(3)
    end)
  end)
end)

-- a misspelled option is an error naming it and the nearest real one, never a default taken
-- silently ({casual = true} once gave non-causal attention without a word)
describe('misspelled options', function()
  local q = uly.randn(1, 4, 2, 8)
  local GPT, Llama = require('models.gpt'), require('models.llama')
  local cases = {
    { 'attention', 'casual', 'causal', function() return uly.attention(q, q, q, { casual = true }) end },
    { 'flash_attention', 'casual', 'causal', function() return uly.flash_attention(q, q, q, { casual = true }) end },
    { 'GPT', 'layrs', 'layers', function() return GPT { preset = 'tiny', layrs = 2 } end },
    { 'Llama', 'hedas', 'heads', function() return Llama { hedas = 8 } end },
    { 'nn.Linear', 'bais', 'bias', function() return uly.nn.Linear(4, 4, { bais = false }) end },
    { 'nn.Block', 'head', 'heads', function() return uly.nn.Block(8, { head = 2 }) end },
    { 'randn', 'requires_gard', 'requires_grad', function() return uly.randn(2, 3, { requires_gard = true }) end },
    { 'tensor', 'dtyp', 'dtype', function() return uly.tensor({ 1 }, { dtyp = 'f64' }) end },
    { 'cross_entropy', 'ignore_idx', 'ignore_index',
      function() return uly.cross_entropy(uly.randn(2, 3), uly.tensor({ 0, 1 }, { dtype = 'i32' }), { ignore_idx = 1 }) end },
    { 'generate', 'temprature', 'temperature',
      function() return GPT { preset = 'tiny' }:generate(uly.tensor({ { 1, 2 } }, { dtype = 'i32' }), { temprature = 0 }) end },
    { 'backward', 'retain_grpah', 'retain_graph',
      function() return uly.randn(2, { requires_grad = true }):sum():backward { retain_grpah = true } end },
    { 'to', 'devic', 'device', function() return uly.randn(2):to { devic = 'cpu' } end },
  }
  for _, c in ipairs(cases) do
    it(c[1] .. ': ' .. c[2], function()
      expect_error({ c[1] .. ": unknown option '" .. c[2] .. "' (did you mean '" .. c[3] .. "'?)" }, function(mark)
        mark()
        local r = c[4]()
        return r
      end)
    end)
  end

  it('a word far from every option gets no guess, only the list', function()
    local err = expect_error({ "attention: unknown option 'zebra' (known: causal, scale)" }, function(mark)
      mark()
      local r = uly.attention(q, q, q, { zebra = 1 })
      return r
    end)
    assert.falsy(err:find('did you mean', 1, true), err)
  end)

  it('devices: a string that is neither a device nor a dtype, and another GPU index', function()
    local t = uly.randn(2)
    expect_error({ "to: 'gpu' is neither a device (cpu, cuda) nor a dtype" }, function(mark)
      mark()
      local r = t:to('gpu')
      return r
    end)
    expect_error({ "device 'cuda:1': a process uses one GPU, 'cuda'" }, function(mark)
      mark()
      local r = t:to('cuda:1')
      return r
    end)
  end)
end)

describe('state tables', function()
  it('set_rng_state names what it expects', function()
    expect_error({ 'set_rng_state: expects the table uly.rng_state() returns' }, function(mark)
      mark()
      uly.set_rng_state({})
    end)
  end)
end)

describe('out of memory', function()
  it('a huge allocation fails cleanly, naming the size, and allocation works afterwards', function()
    local err = expect_error({ 'out of memory', 'f32[10000000, 10000000]', 'TiB' }, function(mark)
      mark()
      local r = uly.zeros(1e7, 1e7)
    end)
    assert.truthy(err:find('363.80 TiB', 1, true), err)  -- 1e14 floats of 4 bytes
    collectgarbage()
    collectgarbage('stop')
    local before = uly.memory().allocated
    local failed = not pcall(uly.zeros, 1e7, 1e7)
    local after = uly.memory().allocated
    collectgarbage('restart')
    assert.is_true(failed)
    assert.are.equal(before, after)  -- a refused allocation is not counted
    local t = uly.ones(1000, 1000)
    assert.are.equal(1e6, t:sum():item())
  end)

  it('the memory limit refuses cleanly and can be raised again', function()
    local old = uly.memory_limit()
    local used = uly.memory().allocated
    uly.memory_limit(used + 4096 * 1024)
    local ok, err = pcall(function()
      expect_error({ 'out of memory', 'f32[2048, 1024]' }, function(mark)
        mark()
        local r = uly.empty(2048, 1024)
      end)
    end)
    uly.memory_limit(old)
    assert(ok, err)
    assert.are.equal(old, uly.memory_limit())
    assert.are.equal(2048 * 1024, uly.empty(2048, 1024):numel())
  end)
end)
