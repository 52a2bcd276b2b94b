-- spec/models_spec.lua — the transformer modules (SelfAttention, Block, KVCache) against
-- references built from the foundation's ops and finite differences; GPT and Llama: shapes,
-- parameter names, counts (GPT-2 124M and Llama 3.2 1B exactly), seeded init, errors,
-- generation with the KV cache equal to recomputing the prefix, and a model that learns.
local uly = require 'ulysses'
local helpers = require 'helpers'
local nn = uly.nn
local GPT = require 'models.gpt'
local Llama = require 'models.llama'

-- attention from first principles: per head, softmax(q k^T * scale + causal mask) v, with
-- K/V head g = floor(h / (H / Hkv)); q [B, T, H, D], k, v [B, T, Hkv, D]
local function attention_from_ops(q, k, v, causal)
  local B, T, H, D = q:size(1), q:size(2), q:size(3), q:size(4)
  local Tk, Hkv = k:size(2), k:size(3)
  local mask = uly.zeros(T, Tk)
  if causal then
    for i = 1, T do for j = 1, Tk do if j > i + (Tk - T) then mask[i][j] = -1e9 end end end
  end
  local rows = {}
  for b = 1, B do
    local heads = {}
    for h = 1, H do
      local g = math.floor((h - 1) / (H / Hkv)) + 1
      local qh = q:select(1, b):select(2, h)                    -- [T, D]
      local kh, vh = k:select(1, b):select(2, g), v:select(1, b):select(2, g)
      local p = (qh:matmul(kh:t()) * (1 / math.sqrt(D)) + mask):softmax(2)
      heads[h] = p:matmul(vh):view(T, 1, D)
    end
    rows[b] = uly.cat(#heads == 1 and heads or (function()
      local acc = heads[1]
      for h = 2, H do acc = uly.cat({ acc, heads[h] }, 2) end
      return { acc }
    end)(), 2):view(1, T, H, D)
  end
  local out = rows[1]
  for b = 2, B do out = uly.cat({ out, rows[b] }, 1) end
  return out
end

local ids = helpers.token_ids

describe('nn.SelfAttention', function()
  before_each(function() helpers.reseed() end)

  it('equals attention written from matmul/softmax, with RoPE and grouped K/V heads', function()
    local C, H, Hkv, B, T = 24, 6, 2, 2, 5
    local attn = nn.SelfAttention(C, { heads = H, kv_heads = Hkv, rope = true, bias = true })
    local x = uly.randn(B, T, C)
    local D = C / H
    local qkv = x:matmul(attn.wqkv.weight) + attn.wqkv.bias
    local q = qkv:narrow(3, 1, H * D):contiguous():view(B, T, H, D):rope(0, 10000)
    local k = qkv:narrow(3, H * D + 1, Hkv * D):contiguous():view(B, T, Hkv, D):rope(0, 10000)
    local v = qkv:narrow(3, (H + Hkv) * D + 1, Hkv * D):contiguous():view(B, T, Hkv, D)
    local expected = attention_from_ops(q, k, v, true):reshape(B, T, C):matmul(attn.proj.weight) + attn.proj.bias
    helpers.assert_close(attn(x), expected, 1e-4, 1e-5, 'SelfAttention')
  end)

  it('uses global positions: a suffix at pos = offset sees the same RoPE angles', function()
    local attn = nn.SelfAttention(16, { heads = 4, kv_heads = 1, rope = true, causal = false })
    local x = uly.randn(1, 6, 16)
    -- non-causal attention over only the suffix with its true offset vs offset 0 differ
    local a = attn(x:narrow(2, 4, 3):contiguous(), { pos = 3 })
    local b = attn(x:narrow(2, 4, 3):contiguous(), { pos = 0 })
    -- RoPE is relative: scores are equal, so outputs agree whatever the offset
    helpers.assert_close(a, b, 1e-4, 1e-5, 'relative RoPE')
    -- but the keys themselves differ (the offset is really applied)
    local k3 = x:narrow(2, 4, 3):contiguous():view(1, 3, 4, 4):rope(3, 10000)
    local k0 = x:narrow(2, 4, 3):contiguous():view(1, 3, 4, 4):rope(0, 10000)
    assert.is_true(((k3 - k0) * (k3 - k0)):sum():item() > 1e-4)
  end)

  it('calls a pluggable attend(q, k, v, opts) with the shapes and options', function()
    local seen
    local attn = nn.SelfAttention(8, { heads = 4, kv_heads = 2, window = 3, attend = function(q, k, v, o)
      seen = { q = q:shape(), k = k:shape(), causal = o.causal, scale = o.scale, window = o.window, pos = o.pos }
      return nn.flash_attend(q, k, v, o)
    end })
    attn(uly.randn(2, 5, 8), { pos = 7 })
    -- the reference kernel refuses masks it does not implement instead of ignoring them
    local ref = nn.SelfAttention(8, { heads = 4, window = 3 })
    local ok, err = pcall(ref, uly.randn(1, 5, 8))
    assert.is_false(ok)
    assert.truthy(tostring(err):find('no sliding-window or document masks', 1, true), err)
    assert.are.same({ 2, 5, 4, 2 }, seen.q)
    assert.are.same({ 2, 5, 2, 2 }, seen.k)
    assert.is_true(seen.causal)
    assert.are.equal(3, seen.window)
    assert.are.equal(7, seen.pos)
    assert.is_true(math.abs(seen.scale - 1 / math.sqrt(2)) < 1e-12)
  end)

  it('gradcheck through SelfAttention (input and weights, GQA + RoPE)', function()
    local attn = nn.SelfAttention(8, { heads = 4, kv_heads = 2, rope = true })
    local x = uly.randn(2, 3, 8, { requires_grad = true })
    local w = attn.wqkv.weight:detach():clone():requires_grad_()
    local pw = attn.proj.weight:detach():clone():requires_grad_()
    helpers.gradcheck(function(xx, ww, pp)
      attn.wqkv.weight, attn.proj.weight = ww, pp
      return attn(xx)
    end, { x, w, pw })
  end)

  it('rejects bad head counts with a clear message', function()
    assert.has_error(function() nn.SelfAttention(10, { heads = 4 }) end,
                     'nn: SelfAttention: dim 10 is not divisible by heads 4')
    assert.has_error(function() nn.SelfAttention(12, { heads = 6, kv_heads = 4 }) end,
                     'nn: SelfAttention: heads 6 is not a multiple of kv_heads 4')
  end)
end)

describe('nn.Block', function()
  before_each(function() helpers.reseed(1) end)

  it('is x + attn(norm1(x)) then + mlp(norm2(x)) for both flavours', function()
    for _, opts in ipairs({ { heads = 2, norm = 'layernorm', mlp = 'gelu' },
                            { heads = 4, kv_heads = 2, norm = 'rmsnorm', mlp = 'swiglu', hidden = 20, rope = true, bias = false } }) do
      local blk = nn.Block(16, opts)
      local x = uly.randn(2, 5, 16)
      local h = x + blk.attn(blk.norm1(x))
      local expected = h + blk.mlp(blk.norm2(h))
      helpers.assert_close(blk(x), expected, 1e-5, 1e-6, opts.norm)
    end
  end)

  it('gradcheck through a Llama-style block', function()
    local blk = nn.Block(8, { heads = 2, kv_heads = 1, norm = 'rmsnorm', mlp = 'swiglu', hidden = 12, rope = true, bias = false })
    local x = uly.randn(1, 4, 8, { requires_grad = true })
    helpers.gradcheck(function(xx) return blk(xx) end, { x })
  end)

  it('scales the residual projections for depth (GPT-2 init)', function()
    local m = GPT { preset = 'tiny', layers = 8, dim = 64, heads = 2 }
    local function std(t)
      local v, n = helpers.values(t)
      local s = 0
      for i = 0, n - 1 do s = s + v[i] * v[i] end
      return math.sqrt(s / n)
    end
    local expect = 0.02 / math.sqrt(16)
    assert.is_true(math.abs(std(m.blocks[3].attn.proj.weight) - expect) < 0.15 * expect)
    assert.is_true(math.abs(std(m.blocks[3].mlp.proj.weight) - expect) < 0.15 * expect)
    assert.is_true(math.abs(std(m.blocks[3].attn.wqkv.weight) - 0.02) < 0.1 * 0.02)
  end)
end)

describe('models', function()
  before_each(function() helpers.reseed(2) end)

  it('GPT: logits [B, T, V], tied embeddings, learned positions, stable names', function()
    local m = GPT { preset = 'tiny' }
    local x = ids(2, 7, 256)
    local logits = m(x)
    assert.are.same({ 2, 7, 256 }, logits:shape())
    -- by hand: wte[x] + wpe[0..6] -> blocks -> ln_f -> @ wte^T
    local h = uly.embedding(x, m.wte.weight) + m.wpe.weight:narrow(1, 1, 7)
    for _, b in m.blocks:named_children() do h = b(h) end
    helpers.assert_close(logits, m.ln_f(h):matmul(m.wte.weight:t()), 1e-5, 1e-6, 'GPT forward')
    local names = {}
    for n in m:named_parameters() do names[#names + 1] = n end
    assert.are.equal('wte.weight', names[1])
    assert.are.equal('blocks.2.attn.wqkv.weight', names[#names - 14 + 3])
    assert.are.equal('ln_f.bias', names[#names])
    local names2 = {}
    for n in GPT { preset = 'tiny' }:named_parameters() do names2[#names2 + 1] = n end
    assert.are.same(names, names2)
  end)

  it('Llama: GQA, untied or tied output, RMSNorm, names', function()
    local m = Llama { preset = 'tiny' }
    local x = ids(2, 6, 256)
    assert.are.same({ 2, 6, 256 }, m(x):shape())
    assert.are.same({ 32, (4 + 2 * 2) * 8 }, m.layers[1].attn.wqkv.weight:shape())
    local tied = Llama { preset = 'tiny', tied = true }
    assert.is_nil(tied.output)
    assert.are.equal(m:num_parameters() - 256 * 32, tied:num_parameters())
    local has = {}
    for n in m:named_parameters() do has[n] = true end
    assert.is_true(has['layers.2.mlp.w3.weight'] and has['output.weight'] and has['norm.weight'])
  end)

  it('parameter counts: formulas match the built models and the published sizes', function()
    for _, cfg in ipairs({ { preset = 'tiny' }, { preset = 'small' }, { preset = 'tiny', bias = false, hidden = 40 } }) do
      assert.are.equal(GPT.count_parameters(cfg), GPT(cfg):num_parameters())
    end
    for _, cfg in ipairs({ { preset = 'tiny' }, { preset = 'tiny', tied = true, kv_heads = 1 }, { preset = 'small' } }) do
      assert.are.equal(Llama.count_parameters(cfg), Llama(cfg):num_parameters())
    end
    assert.are.equal(124439808, GPT.count_parameters { preset = 'gpt2' })     -- GPT-2 small
    assert.are.equal(1235814400, Llama.count_parameters { preset = '1b' })    -- Llama 3.2 1B
    -- FLOPs per token: 6 N + 12 L C T
    local m = GPT { preset = 'tiny' }
    local C, L, V = 32, 2, 256
    assert.are.equal(6 * (12 * L * C * C + V * C) + 12 * L * C * 64, m:flops_per_token())
    assert.are.equal(m:flops_per_token(64), m:flops_per_token())
  end)

  it('initialisation is reproducible under manual_seed', function()
    uly.manual_seed(42)
    local a = Llama { preset = 'tiny' }
    uly.manual_seed(42)
    local b = Llama { preset = 'tiny' }
    local pb = b:parameters()
    for i, p in ipairs(a:parameters()) do helpers.assert_close(p, pb[i], 0, 0) end
  end)

  it('loss is the mean cross-entropy with ignored targets, and near log V at init', function()
    local m = Llama { preset = 'tiny' }
    local x, y = ids(2, 8, 256), ids(2, 8, 256)
    y[1][8] = -1
    local loss = m:loss(x, y)
    local ref = uly.cross_entropy(m(x), y, { ignore_index = -1 })
    helpers.assert_close(loss, ref, 1e-6, 1e-6)
    assert.is_true(math.abs(loss:item() - math.log(256)) < 0.2)
  end)

  it('document ids keep attention inside each packed document', function()
    -- two documents packed in one window give the same outputs as each run on its own
    local m = Llama { preset = 'tiny' }
    local a, b = ids(1, 5, 256), ids(1, 7, 256)
    local both = uly.cat({ a, b }, 2)
    local doc = uly.tensor({ { 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1 } }, { dtype = 'i32' })
    uly.no_grad(function()
      local packed = m(both, { doc = doc })
      helpers.assert_close(packed:narrow(2, 1, 5), m(a), 1e-5, 1e-6, 'first document')
      -- the second document's positions continue (RoPE is relative, so its outputs match a fresh run)
      helpers.assert_close(packed:narrow(2, 6, 7), m(b), 1e-4, 1e-5, 'second document')
      local mixed = m(both)
      assert.is_true(((mixed:narrow(2, 6, 7) - m(b)) ^ 2):sum():item() > 1e-6)   -- without ids they mix
    end)
  end)

  it('errors name the model and what is wrong', function()
    assert.has_error(function() GPT { preset = 'huge' } end)
    local ok, err = pcall(GPT, { preset = 'huge' })
    assert.is_false(ok)
    assert.truthy(err:find("unknown preset 'huge'", 1, true) and err:find('gpt2', 1, true))
    ok, err = pcall(Llama, { preset = 'tiny', dim = 30 })
    assert.truthy(err:find('dim 30 is not divisible by heads 4', 1, true))
    local m = GPT { preset = 'tiny' }
    ok, err = pcall(m.forward, m, ids(1, 65, 256))
    assert.truthy(err:find('exceed the context length seq = 64', 1, true))
    ok, err = pcall(m.forward, m, uly.randn(1, 4))
    assert.truthy(err:find('token ids must be i32 or i64', 1, true))
  end)

  it('config values out of range are errors at the caller\'s line naming the key, the value and the range', function()
    local small = { preset = 'tiny', layers = 1, seq = 8 }
    local function with(extra)
      local c = {}
      for k, v in pairs(small) do c[k] = v end
      for k, v in pairs(extra) do c[k] = v end
      return c
    end
    for _, c in ipairs({
      { GPT, { dropout = -1 }, 'GPT: config.dropout must be a probability in [0, 1), got -1' },
      { GPT, { dropout = 1 }, 'config.dropout must be a probability in [0, 1), got 1' },
      { Llama, { dropout = 0 / 0 }, 'config.dropout must be a probability in [0, 1)' },
      { Llama, { eps = -1 }, 'Llama: config.eps must be a number > 0' },
      { GPT, { eps = 0 }, 'config.eps must be a number > 0' },
      { GPT, { tile = 0 }, 'GPT: config.tile must be a positive integer (positions per slice of the MLP and loss), '
                           .. 'or nil for no tiling, got 0' },
      { Llama, { tile = 2.5 }, 'config.tile must be a positive integer' },
      { Llama, { heads = 2, kv_heads = 1, dim = 6 }, 'Llama: the head dim (dim / heads = 6 / 2 = 3) must be even' },
      { Llama, { kv_heads = 0 }, 'Llama: config.kv_heads must be a positive integer' },
      { GPT, { hidden = -4 }, 'GPT: config.hidden must be a positive integer' },
      { GPT, { checkpoint = 'yes' }, "GPT: config.checkpoint must be true, false or 'except_attention', got 'yes'" },
      { Llama, { window = -1 }, 'Llama: config.window must be an integer >= 0' },
      { Llama, { rope_theta = 0 }, 'Llama: config.rope_theta must be a number > 0' },
      { GPT, { std = -0.02 }, 'GPT: config.std must be a number >= 0' },
      { GPT, { pos_std = 'big' }, "GPT: config.pos_std must be a number >= 0 (an init standard deviation), got 'big'" },
      { GPT, { bias = 'no' }, 'GPT: config.bias must be true or false' },
      { Llama, { tied = 1 }, 'Llama: config.tied must be true or false, got 1' },
    }) do
      local ok, err = pcall(function() local m = c[1](with(c[2])) return m end)
      assert.is_false(ok, c[3])
      assert.truthy(tostring(err):find(c[3], 1, true), tostring(err))
      assert.truthy(tostring(err):find('models_spec.lua:%d+: '), tostring(err))   -- the caller's line
    end
    -- the count from a config alone checks it too; values in range still build
    assert.has_error(function() GPT.count_parameters(with({ dropout = 2 })) end)
    for _, extra in ipairs({ { dropout = 0.5, tile = 4, window = 0, checkpoint = 'except_attention' }, { tile = false } }) do
      assert.is_true(GPT(with(extra)):num_parameters() > 0)
      assert.is_true(Llama(with(extra)):num_parameters() > 0)
    end
  end)

  it('loss and forward refuse misspelled context keys and positions out of range, naming them', function()
    local m = GPT { preset = 'tiny', layers = 1, seq = 8 }
    local x = ids(1, 4, 256)
    local function err_of(fn)
      local ok, e = pcall(fn)
      assert.is_false(ok)
      return tostring(e)
    end
    for _, c in ipairs({
      { { pso = 2 }, "GPT:loss: unknown option 'pso' (did you mean 'pos'?)" },
      { { seq_totl = 8 }, "unknown option 'seq_totl' (did you mean 'seq_total'?)" },
      { { pos = 1.5 }, 'GPT:loss: pos (the position of the first token) must be an integer >= 0, got 1.5' },
      { { pos = -1 }, 'pos (the position of the first token) must be an integer >= 0, got -1' },
      { { pos = 5 }, 'positions 5..8 exceed the context length seq = 8' },
      { { pos = 2, seq_total = 5 }, 'GPT:loss: seq_total (the whole sequence\'s length, of which these 4 tokens start at '
                                    .. 'pos = 2) must be an integer in 6..8 (up to the context length seq), got 5' },
      { { seq_total = 9 }, 'seq_total' },
      { { seq_total = 6.5 }, 'seq_total' },
    }) do
      local e = err_of(function() local l = m:loss(x, x, c[1]) return l end)
      assert.truthy(e:find(c[2], 1, true), e)
      assert.truthy(e:find('models_spec.lua:%d+: '), e)
    end
    local e = err_of(function() local l = Llama { preset = 'tiny', layers = 1 }:loss(x, x, { doc_ids = x }) return l end)
    assert.truthy(e:find("Llama:loss: unknown option 'doc_ids'", 1, true), e)
    -- forward's ctx has no loss options; every key the trainer and the Ulysses path pass still works
    e = err_of(function() local y = m:forward(x, { ignore_index = -1 }) return y end)
    assert.truthy(e:find("GPT: unknown option 'ignore_index'", 1, true), e)
    local doc = uly.tensor({ { 0, 0, 1, 1 } }, { dtype = 'i32' })
    local at2 = m:loss(x, x, { pos = 2, seq_total = 6, doc = doc, ignore_index = -1 })
    assert.is_true(at2:item() > 0)
    assert.are_not.equal(m:loss(x, x):item(), m:loss(x, x, { pos = 2 }):item())   -- pos moves the positions
    assert.are.same({ 1, 4 }, m:loss(x, x, { reduction = 'none' }):shape())
  end)

  it('generation with the KV cache equals recomputing the whole prefix', function()
    for _, Model in ipairs({ GPT, Llama }) do
      local m = Model { preset = 'tiny' }
      local prompt = ids(1, 5, 256)
      -- logits step by step through the cache equal the full forward's rows
      local caches = {}
      for l = 1, m.config.layers do
        caches[l] = nn.KVCache(1, 12, m.config.kv_heads or m.config.heads, m.config.dim / m.config.heads)
      end
      local seq = ids(1, 12, 256)
      local full = uly.no_grad(function() return m(seq) end)
      uly.no_grad(function()
        local first = m(seq:narrow(2, 1, 5):contiguous(), { pos = 0, caches = caches })
        helpers.assert_close(first, full:narrow(2, 1, 5), 1e-5, 1e-5, 'prefix')
        for t = 6, 12 do
          local step = m(seq:narrow(2, t, 1):contiguous(), { pos = t - 1, caches = caches })
          helpers.assert_close(step, full:narrow(2, t, 1), 1e-4, 1e-5, 'cached step ' .. t)
        end
      end)
      uly.manual_seed(9)
      local a = m:generate(prompt, { max_new_tokens = 20, temperature = 0.8, top_k = 10 })
      uly.manual_seed(9)
      local b = m:generate(prompt, { max_new_tokens = 20, temperature = 0.8, top_k = 10, cache = false })
      assert.are.same(a, b)
      assert.are.equal(20, #a)
    end
  end)

  it('generate with slide = true continues past the context on its last seq/2 tokens', function()
    local common = require 'models.common'
    for _, Model in ipairs({ GPT, Llama }) do
      local m = Model { preset = 'tiny', seq = 8 }
      -- the rule written out: each token from a whole forward pass over the context, which
      -- restarts from its last 4 tokens whenever it holds 8 (a prompt of 8 or more: its last 4)
      local function reference(prompt_ids, n)
        local ctx, out = {}, {}
        for i = math.max(1, #prompt_ids >= 8 and #prompt_ids - 3 or 1), #prompt_ids do ctx[#ctx + 1] = prompt_ids[i] end
        for _ = 1, n do
          if #ctx == 8 then ctx = { ctx[5], ctx[6], ctx[7], ctx[8] } end
          local logits = uly.no_grad(function() return m(uly.tensor({ ctx }, { dtype = 'i32' })) end)
          local tok = common.sample_from(logits[1][#ctx]:totable(), 0.9, 20, uly.rand(1):item())
          out[#out + 1], ctx[#ctx + 1] = tok, tok
        end
        return out
      end
      for _, P in ipairs({ 3, 8, 11 }) do
        local prompt = ids(1, P, 256)
        local pl = prompt:totable()[1]
        uly.manual_seed(5)
        local want = reference(pl, 21)
        for _, cache in ipairs({ true, false }) do
          uly.manual_seed(5)
          local got = m:generate(prompt, { max_new_tokens = 21, temperature = 0.9, top_k = 20, slide = true, cache = cache })
          assert.are.same(want, got, Model.__name .. ' prompt ' .. P .. ' cache ' .. tostring(cache))
        end
      end
      -- within the context, slide changes nothing; on_token sees each token as it comes
      local prompt = ids(1, 3, 256)
      uly.manual_seed(2)
      local seen = {}
      local a = m:generate(prompt, { max_new_tokens = 5, temperature = 0.9, slide = true,
                                     on_token = function(t) seen[#seen + 1] = t end })
      assert.are.same(a, seen)
      uly.manual_seed(2)
      assert.are.same(a, m:generate(prompt, { max_new_tokens = 5, temperature = 0.9 }))
    end
    local e = helpers.error_of(GPT { preset = 'tiny', seq = 8 }.generate, GPT { preset = 'tiny', seq = 8 },
                               uly.tensor({ { 1, 2, 3 } }, { dtype = 'i32' }), { max_new_tokens = 6 })
    assert.truthy(e:find('generate: prompt 3 + 6 new tokens exceed the context length 8 (slide = true continues past it '
                         .. 'on the last 4 tokens)', 1, true), e)
    e = helpers.error_of(GPT { preset = 'tiny', seq = 1 }.generate, GPT { preset = 'tiny', seq = 1 },
                         uly.tensor({ { 1 } }, { dtype = 'i32' }), { max_new_tokens = 2, slide = true })
    assert.truthy(e:find('generate: slide = true needs a context length (config.seq) of 2 or more, got 1', 1, true), e)
    e = helpers.error_of(GPT { preset = 'tiny' }.generate, GPT { preset = 'tiny' },
                         uly.tensor({ { 1 } }, { dtype = 'i32' }), { slide = 'yes' })
    assert.truthy(e:find('generate: slide must be true or false, got yes', 1, true), e)
    e = helpers.error_of(GPT { preset = 'tiny' }.generate, GPT { preset = 'tiny' },
                         uly.tensor({ { 1 } }, { dtype = 'i32' }), { on_token = 3 })
    assert.truthy(e:find('generate: on_token must be a function (called with each new token id), got number', 1, true), e)
  end)

  it('generate with samples = B draws B continuations side by side, each as its own draws would alone', function()
    local common = require 'models.common'
    for _, Model in ipairs({ GPT, Llama }) do
      local m = Model { preset = 'tiny', seq = 8 }
      local prompt = ids(1, 3, 256)
      local B, n = 3, 11   -- past the context of 8: the rows slide together
      uly.manual_seed(4)
      local U = uly.rand(B * n):totable()   -- the draws, step by step, row by row
      local want = {}
      for b = 1, B do
        local ctx, out = prompt:totable()[1], {}
        for t = 1, n do
          if #ctx == 8 then ctx = { ctx[5], ctx[6], ctx[7], ctx[8] } end
          local logits = uly.no_grad(function() return m(uly.tensor({ ctx }, { dtype = 'i32' })) end)
          local tok = common.sample_from(logits[1][#ctx]:totable(), 0.9, 20, U[(t - 1) * B + b])
          out[#out + 1], ctx[#ctx + 1] = tok, tok
        end
        want[b] = out
      end
      for _, cache in ipairs({ true, false }) do
        uly.manual_seed(4)
        local rows = {}
        local got = m:generate(prompt, { max_new_tokens = n, temperature = 0.9, top_k = 20, slide = true, cache = cache,
                                         samples = B, on_token = function(tok, b) rows[b] = (rows[b] or 0) + 1 end })
        assert.are.same(want, got, Model.__name .. ' cache ' .. tostring(cache))
        assert.are.same({ n, n, n }, rows)
      end
      -- samples = 1: one row, as a list of one list
      uly.manual_seed(6)
      local one = m:generate(prompt, { max_new_tokens = 4, temperature = 0.9, samples = 1 })
      uly.manual_seed(6)
      assert.are.same({ m:generate(prompt, { max_new_tokens = 4, temperature = 0.9 }) }, one)
    end
    local e = helpers.error_of(GPT { preset = 'tiny' }.generate, GPT { preset = 'tiny' },
                               uly.tensor({ { 1 } }, { dtype = 'i32' }), { samples = 0 })
    assert.truthy(e:find('generate: samples must be an integer >= 1, got 0', 1, true), e)
  end)

  it('generate refuses bad arguments by name and leaves the model as it came when it fails', function()
    local m = GPT { preset = 'tiny', dropout = 0.5 }
    local prompt = uly.tensor({ { 1, 2, 3 } }, { dtype = 'i32' })
    for _, c in ipairs({
      { uly.zeros({ 2, 3 }, { dtype = 'i32' }), {}, 'generate: the prompt must be token ids of shape [1, P]' },
      { uly.zeros({ 3 }, { dtype = 'i32' }), {}, 'generate: the prompt must be token ids of shape [1, P]' },
      { prompt, { max_new_tokens = 2.5 }, 'generate: max_new_tokens must be an integer >= 0, got 2.5' },
      { prompt, { max_new_tokens = -1 }, 'generate: max_new_tokens must be an integer >= 0' },
      { prompt, { temperature = 0 / 0 }, 'generate: temperature must be a finite number >= 0' },
      { prompt, { top_k = -5 }, 'generate: top_k must be an integer >= 0' },
      { prompt, { max_new_tokens = 1000 }, 'exceed the context length' },
    }) do
      local ok, err = pcall(m.generate, m, c[1], c[2])
      assert.is_false(ok)
      assert.truthy(tostring(err):find(c[3], 1, true), tostring(err))
      assert.is_true(m.training, 'generate left the model in eval mode after: ' .. tostring(err))
    end
    -- a failure inside the loop (a model whose forward fails) also restores training mode
    local forward = m.forward
    m.forward = function() error('boom') end
    local ok, err = pcall(m.generate, m, prompt, { max_new_tokens = 2 })
    m.forward = forward
    assert.is_false(ok)
    assert.matches('boom', tostring(err))
    assert.is_true(m.training)
  end)

  it('top-k sampling never returns a token outside the k largest logits', function()
    local common = require 'models.common'
    local logits = { 0.1, 5, -2, 4.9, 3, 0 }
    for i = 1, 200 do
      local t = common.sample_from(logits, 1.5, 2, (i - 0.5) / 200)
      assert.is_true(t == 1 or t == 3)
    end
    assert.are.equal(1, common.sample_from(logits, 0, 0, 0.7))  -- temperature 0: greedy
  end)

  it('a tiny GPT overfits one batch (loss falls below a third in 100 AdamW steps)', function()
    local m = GPT { preset = 'tiny' }
    local x = ids(2, 16, 256)
    local y = uly.tensor(uly.no_grad(function() return x:totable() end), { dtype = 'i32' })
    for b = 1, 2 do for t = 1, 16 do y[b][t] = (x[b][t]:item() * 7 + 3) % 256 end end  -- a learnable map
    local opt = uly.optim.AdamW(m:parameters(), { lr = 1e-2, weight_decay = 0 })
    local first, last
    for step = 1, 100 do
      opt:zero_grad()
      local loss = m:loss(x, y)
      loss:backward()
      if step == 1 then first = loss:item() end
      last = loss:item()
      opt:step()
    end
    assert.is_true(last < first / 3, string.format('loss %.3f -> %.3f', first, last))
  end)
end)
