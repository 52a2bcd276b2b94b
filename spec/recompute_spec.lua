-- spec/recompute_spec.lua — activation checkpointing (nn.checkpoint, Block/model checkpoint
-- flag): the same loss and bit-identical gradients as without it, dropout included; a smaller
-- activation peak; errors in the replay surface from backward; nothing is kept after the graph
-- is dropped. Tiled MLP and loss (nn.chunked, config.tile): equal to untiled, lower peak. An input
-- written in place before backward is an error; parameters inside get gradients without any input
-- requiring grad.
local uly = require 'ulysses'
local helpers = require 'helpers'
local nn = uly.nn
local GPT = require 'models.gpt'
local Llama = require 'models.llama'

local function grads(model)
  local out = {}
  for name, p in model:named_parameters() do out[name] = p.grad and p.grad:clone() end
  return out
end

local ids = helpers.token_ids

describe('activation checkpointing', function()
  before_each(function() helpers.reseed(31) end)

  it('nn.checkpoint gives the same output and gradients for the input and the parameters', function()
    local lin = nn.Linear(6, 6)
    local x = uly.randn(3, 6, { requires_grad = true })
    local function f(t) return (lin(t):gelu() * t):tanh() end
    local y1 = f(x)
    ;(y1 * y1):sum():backward()
    local gx, gw = x.grad:clone(), lin.weight.grad:clone()
    x:zero_grad(); lin:zero_grad()
    local y2 = nn.checkpoint(f, x)
    helpers.assert_close(y2, y1, 0, 0)
    assert.are.equal('CustomBackward', y2.grad_fn)
    ;(y2 * y2):sum():backward()
    helpers.assert_close(x.grad, gx, 0, 0)
    helpers.assert_close(lin.weight.grad, gw, 0, 0)
  end)

  it('replays dropout with the same masks and leaves the generator where it was', function()
    local blk = nn.Block(16, { heads = 2, dropout = 0.3 })
    local x = uly.randn(2, 5, 16, { requires_grad = true })
    uly.manual_seed(5)
    local y1 = blk(x)
    ;(y1 * y1):sum():backward()
    local after1 = uly.rng_state()
    local g1 = grads(blk)
    local gx = x.grad:clone()
    x:zero_grad(); blk:zero_grad()
    blk.checkpoint = true
    uly.manual_seed(5)
    local y2 = blk(x)
    ;(y2 * y2):sum():backward()
    helpers.assert_close(y2, y1, 0, 0)
    helpers.assert_close(x.grad, gx, 0, 0)
    for name, g in pairs(grads(blk)) do helpers.assert_close(g, g1[name], 0, 0, name) end
    local after2 = uly.rng_state()
    assert.is_true(after1.seed == after2.seed and after1.offset == after2.offset)
  end)

  it('GPT and Llama with checkpoint = true train identically and keep fewer activations', function()
    for _, Model in ipairs({ GPT, Llama }) do
      local cfg = { preset = 'tiny', layers = 6, dim = 64, heads = 4, seq = 128, dropout = 0.1 }
      local x, y = ids(4, 128, 256), ids(4, 128, 256)
      local results = {}
      for _, ck in ipairs({ false, true }) do
        uly.manual_seed(3)
        cfg.checkpoint = ck
        local m = Model(cfg)
        collectgarbage(); collectgarbage()
        local base = uly.memory().allocated
        uly.reset_peak_memory()
        local loss = m:loss(x, y)
        collectgarbage(); collectgarbage()
        local held = uly.memory().allocated - base      -- activations kept for backward
        loss:backward()
        results[ck] = { loss = loss:item(), grads = grads(m), held = held }
      end
      assert.are.equal(results[false].loss, results[true].loss)
      for name, g in pairs(results[false].grads) do helpers.assert_close(results[true].grads[name], g, 0, 0, name) end
      assert.is_true(results[true].held < 0.35 * results[false].held,
                     string.format('%s: %d bytes kept with checkpointing vs %d without', Model.__name,
                                   results[true].held, results[false].held))
    end
  end)

  it('an error while replaying comes out of backward with its message', function()
    local x = uly.randn(4, { requires_grad = true })
    local calls = 0
    local y = nn.checkpoint(function(t)
      calls = calls + 1
      if calls == 2 then error('replay failed on purpose', 0) end
      return t * 2
    end, x)
    local ok, err = pcall(function() y:sum():backward() end)
    assert.is_false(ok)
    assert.truthy(tostring(err):find('replay failed on purpose', 1, true), err)
  end)

  it('keeps nothing once the graph is gone, and is a plain call under no_grad', function()
    -- (releasing a graph can take a few collector cycles: wrappers, then nodes, then closures)
    local function settle() for _ = 1, 6 do collectgarbage() end return nn.checkpoint_pending() end
    local before = settle()
    local during
    do
      local x = uly.randn(3, { requires_grad = true })
      local y = nn.checkpoint(function(t) return t * t end, x)
      during = nn.checkpoint_pending()
      y:sum():backward()
    end
    local after = settle()
    assert.is_true(during >= 1)
    assert.is_true(after <= before and after < during, string.format('%d %d %d', before, during, after))
    local z = uly.no_grad(function() return nn.checkpoint(function(t) return t + 1 end, uly.ones(2)) end)
    assert.is_nil(z.grad_fn)
  end)

  -- a compiled trace through the wrappers (inlining the segment's function) kept temporaries
  -- reachable at the segments' explicit collections: a step's peak then varied from run to run and
  -- went past the planner's by a fifth on the long DNA steps. No bytecode of them is ever recorded.
  it('keeps its wrappers out of compiled traces', function()
    local jutil = require 'jit.util'
    local recorded = {}
    local function on_record(_, func, pc)
      local source = jutil.funcinfo(func).source or ''
      if source:find('ulysses/nn/checkpoint.lua', 1, true) then recorded[#recorded + 1] = jutil.funcinfo(func, pc).loc end
    end
    jit.attach(on_record, 'record')
    local ok, err = pcall(function()
      local w = uly.randn(8, 8, { requires_grad = true })
      for _ = 1, 300 do   -- hot: the loop is compiled, and would record into nn.checkpoint
        local y = nn.checkpoint(function(t) return (t:matmul(w)):sum() end, uly.randn(2, 8))
        y:backward()
        local z = nn.chunked(function(t) return t * 2 end, uly.randn(4, 2, { requires_grad = true }), { dim = 1, size = 2 })
        z:sum():backward()
      end
    end)
    jit.attach(on_record)
    assert(ok, err)
    assert.are.equal(0, #recorded, 'recorded: ' .. table.concat(recorded, ', ', 1, math.min(#recorded, 5)))
  end)

  -- busted loads the package afresh for every spec file while the previous file's graphs may still
  -- be alive: their nodes, freed later, must not take the replays of this load's segments with them
  it('keeps the replays of two loads of the package apart', function()
    local factory = require 'ulysses.nn.checkpoint'
    local tensor = require 'ulysses.tensor'
    local hook = tensor.after_collect
    local first, second = {}, {}
    factory(first, function() return uly end)
    factory(second, function() return uly end)
    tensor.after_collect = hook
    local w = uly.randn(3, { requires_grad = true })
    local function segment(load) return load.checkpoint(function(t) return (t * w):sum() end, uly.randn(3)) end
    local old = segment(first)     -- a graph of the first load, alive
    local y = segment(second)      -- one of the second
    old = nil
    for _ = 1, 6 do collectgarbage() end
    second.checkpoint_pending()    -- takes in the freed ids
    y:backward()
    assert.is_not_nil(w.grad)
  end)
end)

describe('checkpointing except attention (nn.checkpoint_except_attention)', function()
  before_each(function() helpers.reseed(43) end)

  -- loss, gradients, and the flash score tiles computed in the forward and in backward
  local function step(Model, cfg, mode, x, y)
    uly.manual_seed(3)
    cfg.checkpoint = mode
    local m = Model(cfg)
    uly.flash_attention_reset_tiles()
    local loss = m:loss(x, y)
    local fwd = uly.flash_attention_tiles()
    loss:backward()
    return { loss = loss:item(), grads = grads(m), fwd = fwd, bwd = uly.flash_attention_tiles() - fwd }
  end

  it('GPT and Llama train as without checkpointing, bit for bit, and backward runs no attention forward', function()
    local x, y = ids(2, 192, 256), ids(2, 192, 256)
    for _, case in ipairs({ { GPT, { preset = 'tiny', layers = 3, dim = 64, heads = 4, seq = 192, dropout = 0.1 } },
                            { Llama, { preset = 'tiny', layers = 3, dim = 64, heads = 4, kv_heads = 2, seq = 192,
                                       window = 70, tile = 64 } } }) do
      local Model, cfg = case[1], case[2]
      cfg.attention = 'flash'
      local none, full = step(Model, cfg, false, x, y), step(Model, cfg, true, x, y)
      local keep = step(Model, cfg, 'except_attention', x, y)
      assert.are.equal(none.loss, keep.loss)
      for name, g in pairs(none.grads) do helpers.assert_close(keep.grads[name], g, 0, 0, name) end
      assert.is_true(none.fwd > 0 and keep.fwd == none.fwd and full.fwd == none.fwd)
      assert.are.equal(none.fwd, full.bwd)      -- a full checkpoint's replay runs every attention again
      assert.are.equal(0, keep.bwd, Model.__name .. ': the replay ran attention forward tiles')
    end
  end)

  it('keeps one attention output a block more than a full checkpoint, and nothing after backward', function()
    local cfg = { preset = 'tiny', layers = 4, dim = 64, heads = 4, seq = 256, attention = 'flash' }
    local x, y = ids(2, 256, 256), ids(2, 256, 256)
    local held = {}
    for _, mode in ipairs({ true, 'except_attention' }) do
      uly.manual_seed(3)
      cfg.checkpoint = mode
      local m = Llama(cfg)
      for _ = 1, 6 do collectgarbage() end
      local base = uly.memory().allocated
      local loss = m:loss(x, y)
      for _ = 1, 6 do collectgarbage() end
      held[mode] = uly.memory().allocated - base
      loss:backward()
      loss = nil
      for _ = 1, 6 do collectgarbage() end
      -- the gradients stay; the kept outputs and every replay closure are gone
      local grad_bytes = 0
      for _, p in ipairs(m:parameters()) do grad_bytes = grad_bytes + p.grad:numel() * 4 end
      local after = uly.memory().allocated - base
      assert.is_true(after < grad_bytes * 1.1 + 2 ^ 16, string.format('%s: %d bytes left, %d in gradients', tostring(mode), after, grad_bytes))
    end
    local out_bytes = 2 * 256 * 64 * 4 + 2 * 4 * 256 * 4     -- one block's output and log-sum-exp
    local extra = held.except_attention - held[true]
    assert.is_true(extra > 3 * out_bytes and extra < 5 * out_bytes,
                   string.format('kept %d bytes more than a full checkpoint; 4 blocks x %d expected', extra, out_bytes))
  end)

  -- an attention inside a segment, its output doubled in place afterwards (allowed without grad)
  local function segment(q, scale_in_place)
    local o = uly.flash_attention(q, q, q, { causal = true })
    if scale_in_place and not uly.is_grad_enabled() then o:copy_(o * 2) end
    return (o * q):tanh()
  end

  it('does not use a kept output that was written in place: the replay recomputes it', function()
    local q = uly.randn(1, 70, 2, 16, { requires_grad = true })
    local y1 = nn.checkpoint(segment, q, true)
    y1:sum():backward()
    local g1 = q.grad:clone()
    q:zero_grad()
    uly.flash_attention_reset_tiles()
    local y2 = nn.checkpoint_except_attention(segment, q, true)
    local fwd = uly.flash_attention_tiles()
    y2:sum():backward()
    helpers.assert_close(y2, y1, 0, 0)
    helpers.assert_close(q.grad, g1, 0, 0)
    assert.are.equal(fwd, uly.flash_attention_tiles() - fwd)   -- recomputed
  end)

  it('does not use a kept output for a call that differs in the replay (another window)', function()
    local q = uly.randn(1, 80, 2, 16, { requires_grad = true })
    local window = 100
    local function f(t) return (uly.flash_attention(t, t, t, { causal = true, window = window }) * t):sum() end
    local y = nn.checkpoint_except_attention(f, q)
    window = 7                       -- the replay computes f with this window: its gradient, not a mix
    y:backward()
    local g1 = q.grad:clone()
    q:zero_grad()
    f(q):backward()
    helpers.assert_close(g1, q.grad, 0, 0)
  end)

  it('nests: a segment inside a replayed one, and tiled slices, take back the kept outputs in order', function()
    local lin = nn.Linear(16, 32)
    local function attn(t)
      local qkv = lin(t):view(1, 48, 2, 16)
      local a = uly.flash_attention(qkv, qkv, qkv, { causal = true })
      return a:view(1, 48, 32):narrow(3, 1, 16) + t
    end
    -- (the nested segment's attention and the last one have the same shapes: taking back in the
    -- wrong order would hand the last one the nested one's output)
    local function body(x, inner)
      local h = nn.chunked(function(t) return (uly.flash_attention(t:view(1, t:size(2), 1, 16), t:view(1, t:size(2), 1, 16),
                                                                   t:view(1, t:size(2), 1, 16), { causal = true })
                                              :view(1, t:size(2), 16) * t):tanh() end, x, { dim = 2, size = 16 })
      h = inner(function(t) return attn(t) end, h)
      return attn(h)
    end
    local x = uly.randn(1, 48, 16, { requires_grad = true })
    local ref = body(x, function(fn, t) return fn(t) end)
    ref:sum():backward()
    local gx, gw = x.grad:clone(), lin.weight.grad:clone()
    for _, inner in ipairs({ nn.checkpoint, nn.checkpoint_except_attention }) do
      x:zero_grad(); lin:zero_grad()
      local y = nn.checkpoint_except_attention(body, x, inner)
      y:sum():backward()
      helpers.assert_close(y, ref, 0, 0)
      helpers.assert_close(x.grad, gx, 0, 0)
      helpers.assert_close(lin.weight.grad, gw, 0, 0)
    end
  end)

  it('uly_flash_attention_kept refuses a kept output or log-sum-exp that does not fit, naming it', function()
    local C, T = uly.C, require 'ulysses.tensor'
    local q = uly.randn(1, 8, 2, 4)
    local m = require('ffi').new('uly_attn_mask')
    m.window_left, m.window_right = -1, -1
    local function kept(out, lse)
      local ok, err = pcall(T.wrap, C.uly_flash_attention_kept(q._h, q._h, q._h, 0, m, out._h, lse._h))
      assert.is_false(ok)
      return tostring(err)
    end
    local good_out, good_lse = uly.zeros(1, 8, 2, 4), uly.zeros(1, 2, 8)
    assert.truthy(kept(uly.zeros(1, 8, 2, 5), good_lse):find('the kept output is f32[1, 8, 2, 5]', 1, true))
    assert.truthy(kept(good_out:transpose(2, 3):contiguous():transpose(2, 3), good_lse):find('kept output', 1, true))
    assert.truthy(kept(good_out, uly.zeros(1, 8, 2)):find('the kept log-sum-exp is f32[1, 8, 2] but must be contiguous f32 [1, 2, 8]', 1, true))
    local out = T.wrap(C.uly_flash_attention_kept(q._h, q._h, q._h, 0, m, good_out._h, good_lse._h))
    assert.are.same({ 1, 8, 2, 4 }, out:shape())
  end)

  it('Block accepts checkpoint = true, false or except_attention, and says so otherwise', function()
    local ok, err = pcall(nn.Block, 16, { heads = 2, checkpoint = 'attention' })
    assert.is_false(ok)
    assert.truthy(tostring(err):find("checkpoint must be true, false or 'except_attention', got attention", 1, true), err)
    -- a model whose attention has no outputs to keep says so instead of recomputing silently
    ok, err = pcall(GPT, { preset = 'tiny', attention = 'reference', checkpoint = 'except_attention' })
    assert.is_false(ok)
    assert.truthy(tostring(err):find("the reference kernel has none to keep: use attention = 'flash'", 1, true), err)
  end)
end)

describe('tiled MLP and loss (nn.chunked)', function()
  before_each(function() helpers.reseed(37) end)

  it("'cat' equals the function on the whole input, values and gradients", function()
    local mlp = nn.SwiGLU(8, 24)
    local x = uly.randn(2, 11, 8, { requires_grad = true })
    local y1 = mlp(x)
    ;(y1 * y1):sum():backward()
    local gx, g1 = x.grad:clone(), mlp.w1.weight.grad:clone()
    x:zero_grad(); mlp:zero_grad()
    local y2 = nn.chunked(function(t) return mlp(t) end, x, { dim = 2, size = 4 })   -- 4 + 4 + 3 rows
    -- row-wise, but not bit for bit: OpenBLAS may pick another kernel for another number of
    -- rows (seen on AVX-512 Zen), so the slices agree to float rounding
    helpers.assert_close(y2, y1, 1e-5, 1e-7)
    ;(y2 * y2):sum():backward()
    helpers.assert_close(x.grad, gx, 1e-5, 1e-7)
    helpers.assert_close(mlp.w1.weight.grad, g1, 1e-5, 1e-6) -- summed over slices: float order
  end)

  it("'sum' of a sliced cross-entropy equals the whole one, with ignored targets", function()
    local W = uly.randn(8, 30, { requires_grad = true })
    local h = uly.randn(2, 9, 8, { requires_grad = true })
    local t = {}
    for b = 1, 2 do t[b] = {} for i = 1, 9 do t[b][i] = (i == 4) and -1 or math.random(0, 29) end end
    local tg = uly.tensor(t, { dtype = 'i32' })
    local l1 = uly.cross_entropy(h:matmul(W), tg, { ignore_index = -1, reduction = 'sum' })
    l1:backward()
    local gh, gw = h.grad:clone(), W.grad:clone()
    h:zero_grad(); W:zero_grad()
    local l2 = nn.chunked(function(hs, ts) return uly.cross_entropy(hs:matmul(W), ts, { ignore_index = -1, reduction = 'sum' }) end,
                          h, { dim = 2, size = 2, with = { tg }, reduce = 'sum' })
    helpers.assert_close(l2, l1, 1e-6, 1e-6)
    l2:backward()
    -- (p - onehot) W^T cancels terms of order |W| = 1 down to ~1e-3: logits that differ in the
    -- last bit between the two GEMM paths show at ~1e-6 absolute here
    helpers.assert_close(h.grad, gh, 1e-5, 1e-5)
    helpers.assert_close(W.grad, gw, 1e-5, 1e-6)
  end)

  it('models with tile = 32 train like untiled ones and hold a smaller peak (logits of 4096 tokens)', function()
    for _, Model in ipairs({ GPT, Llama }) do
      local x, y = ids(2, 256, 4096), ids(2, 256, 4096)
      local res = {}
      for _, tile in ipairs({ false, 32 }) do
        uly.manual_seed(4)
        local m = Model { preset = 'tiny', vocab = 4096, dim = 64, heads = 4, seq = 256, tile = tile or nil }
        for _ = 1, 6 do collectgarbage() end
        local base = uly.memory().allocated
        uly.reset_peak_memory()
        local loss = m:loss(x, y)
        loss:backward()
        res[tile] = { loss = loss:item(), grads = grads(m), peak = uly.memory().peak - base }
      end
      assert.is_true(math.abs(res[32].loss - res[false].loss) < 1e-5 * res[false].loss)
      for name, g in pairs(res[false].grads) do helpers.assert_close(res[32].grads[name], g, 1e-4, 1e-6, name) end
      assert.is_true(res[32].peak < 0.8 * res[false].peak,
                     string.format('%s peak %d tiled vs %d', Model.__name, res[32].peak, res[false].peak))
    end
  end)
end)

describe('what a replay reads (nn.checkpoint, nn.checkpoint_except_attention, nn.chunked)', function()
  before_each(function() helpers.reseed(53) end)

  local segments = {
    ['nn.checkpoint'] = nn.checkpoint,
    ['nn.checkpoint_except_attention'] = nn.checkpoint_except_attention,
  }

  it('an input written in place after the forward is an error in backward, not wrong gradients', function()
    for name, ck in pairs(segments) do
      local p = uly.tensor({ 1, 2, 3 }, { requires_grad = true })
      local h = p * 1
      local loss = ck(function(t, scale) return (t * t):sum() * scale end, h, 2)
      uly.no_grad(function() h:copy_(h * 3) end)
      local err = helpers.error_of(function() loss:backward() end)
      assert.truthy(err:find(name .. ': argument 1 f32[3] was modified in place after the forward used it '
                             .. '(version 1, expected 0)', 1, true), err)
      assert.truthy(err:find('clone it before writing into it', 1, true), err)
    end
    -- an untouched input replays as before
    local p = uly.tensor({ 1, 2, 3 }, { requires_grad = true })
    nn.checkpoint(function(t) return (t * t):sum() end, p * 1):backward()
    helpers.assert_close(p.grad, { 2, 4, 6 }, 0, 0)
  end)

  it('nn.chunked: x or a `with` tensor written in place after the forward is an error in backward', function()
    local W = uly.randn(4, 5, { requires_grad = true })
    local function f(hs, ts) return uly.cross_entropy(hs:matmul(W), ts, { reduction = 'sum' }) end
    for _, which in ipairs({ 'x', 'with[1]' }) do
      local h = uly.randn(2, 6, 4, { requires_grad = true }) * 1
      local tg = uly.tensor({ { 0, 1, 2, 3, 4, 0 }, { 4, 3, 2, 1, 0, 1 } }, { dtype = 'i32' })
      local loss = nn.chunked(f, h, { dim = 2, size = 2, with = { tg }, reduce = 'sum' })
      uly.no_grad(function()
        if which == 'x' then h:copy_(h * 2) else tg:fill_(0) end
      end)
      local err = helpers.error_of(function() loss:backward() end)
      assert.truthy(err:find('nn.chunked: ' .. which .. ' ', 1, true), err)
      assert.truthy(err:find('was modified in place after the forward used it', 1, true), err)
    end
  end)

  it('parameters inside get their gradients when no input requires grad', function()
    local lin = nn.Linear(4, 3)
    local x = uly.randn(2, 5, 4)                 -- raw data
    local function f(t) return lin(t):gelu() end
    ;(f(x) * f(x)):sum():backward()
    local want_w, want_b = lin.weight.grad:clone(), lin.bias.grad:clone()
    for name, ck in pairs(segments) do
      lin:zero_grad()
      local y = ck(f, x)
      assert.is_true(y.requires_grad, name)
      ;(y * y):sum():backward()
      assert.is_not_nil(lin.weight.grad, name)
      helpers.assert_close(lin.weight.grad, want_w, 0, 0, name)
      helpers.assert_close(lin.bias.grad, want_b, 0, 0, name)
      assert.is_nil(x.grad)
    end
    -- a segment that uses no parameter: backward replays it and finds nothing to do
    nn.checkpoint(function(t) return t * 2 end, x):sum():backward()
    nn.chunked(function(t) return t * 2 end, x, { dim = 2, size = 2 }):sum():backward()
    -- nn.chunked, 'cat' and 'sum' (row-wise, to float rounding: other row counts, other kernels)
    lin:zero_grad()
    local y2 = nn.chunked(f, x, { dim = 2, size = 2 })
    assert.is_true(y2.requires_grad)
    ;(y2 * y2):sum():backward()
    helpers.assert_close(lin.weight.grad, want_w, 1e-5, 1e-6)
    helpers.assert_close(lin.bias.grad, want_b, 1e-5, 1e-6)
    lin:zero_grad()
    local l = nn.chunked(function(t) local z = f(t) return (z * z):sum() end, x, { dim = 2, size = 2, reduce = 'sum' })
    l:backward()
    helpers.assert_close(lin.weight.grad, want_w, 1e-5, 1e-6)
    assert.is_nil(x.grad)
  end)
end)
