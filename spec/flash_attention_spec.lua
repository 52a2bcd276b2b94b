-- spec/flash_attention_spec.lua — memory-efficient attention (uly.flash_attention) against the
-- reference: uly.attention for dense / causal, and for window, block-sparse and document masks
-- a reference built from the foundation ops (scores matmul + additive mask + softmax + matmul).
-- Values and gradients of q, k, v at f32 tolerance on odd sizes (1, 37, 130: not multiples of
-- the 64-wide tiles), windows wider than N, empty rows, GQA, strided narrow() inputs of a fused
-- buffer; gradchecks; bit-identical results at 1 and 2 threads; tiles skipped in proportion to
-- the masked area; allocator peak O(N); nn.flash_attend; error paths.
local uly = require 'ulysses'
local nn = require 'ulysses.nn'
local helpers = require 'helpers'
local R = require 'reference'

local ASAN = (os.getenv('ULY_LIB') or ''):find('asan') ~= nil

---------------------------------------------------------------- reference from foundation ops
-- the visibility rule of uly.h, in plain Lua: opts as for uly.flash_attention (window given as
-- {left, right} with -1 unbounded, or a number), docs as Lua lists qd[b][i], kd[b][j]
local function visibility(opts, Tq, Tk, qd, kd, layout, bs)
  local off = Tk - Tq
  local L, Rw = -1, -1
  if type(opts.window) == 'number' then L, Rw = opts.window, opts.causal and 0 or opts.window
  elseif type(opts.window) == 'table' then L, Rw = opts.window[1], opts.window[2] end
  return function(b, i, j)
    local ii = i + off
    if opts.causal and j > ii then return false end
    if L >= 0 and j < ii - L then return false end
    if Rw >= 0 and j > ii + Rw then return false end
    if layout and layout[math.floor(i / bs) + 1][math.floor(j / bs) + 1] == 0 then return false end
    if qd and qd[b + 1][i + 1] ~= kd[b + 1][j + 1] then return false end
    return true
  end
end

-- [B, T, G, D] -> [B, H, T, D] with each K/V head repeated H / G times (differentiable)
local function heads(x, H)
  local B, T, G, D = unpack(x:shape())
  local xh = x:permute(1, 3, 2, 4)
  if G == H then return xh end
  return xh:contiguous():view(B, G, 1, T, D):expand(B, G, H / G, T, D):reshape(B, H, T, D)
end

-- softmax(scale q k^T - 1e9 [hidden]) v, rows that see nothing set to 0
local function ref_attention(q, k, v, scale, vis)
  local B, Tq, H, D = unpack(q:shape())
  local Tk = k:size(2)
  local add, rows = {}, {}
  for b = 0, B - 1 do
    for i = 0, Tq - 1 do
      local any = false
      for j = 0, Tk - 1 do
        local ok = vis(b, i, j)
        add[#add + 1] = ok and 0 or -1e9
        any = any or ok
      end
      rows[#rows + 1] = any and 1 or 0
    end
  end
  local mask = helpers.from_flat(add, { B, 1, Tq, Tk })
  local keep = helpers.from_flat(rows, { B, 1, Tq, 1 })
  local s = q:permute(1, 3, 2, 4):matmul(heads(k, H):transpose(3, 4)) * (scale or 1 / math.sqrt(D)) + mask
  local p = s:softmax(4) * keep
  return p:matmul(heads(v, H)):permute(1, 3, 2, 4)
end

-- values and gradients of flash vs reference on the same inputs and output gradient
local RTOL, ATOL = 2e-5, 3e-6
local function leaves(B, Tq, Tk, H, G, D)
  return R.leaf(uly.randn(B, Tq, H, D)), R.leaf(uly.randn(B, Tk, G, D)), R.leaf(uly.randn(B, Tk, G, D))
end
local function grads_of(f, q, k, v, g)
  q:zero_grad(); k:zero_grad(); v:zero_grad()
  local y = f(q, k, v)
  y:backward(g)
  return y, { q.grad:clone(), k.grad:clone(), v.grad:clone() }
end
local function compare(what, q, k, v, opts, ref)
  local g = uly.randn(q:shape())
  local y1, g1 = grads_of(function(a, b, c) return uly.flash_attention(a, b, c, opts) end, q, k, v, g)
  local y2, g2 = grads_of(ref, q, k, v, g)
  helpers.assert_close(y1, y2, RTOL, ATOL, what .. ': output')
  for n, name in ipairs({ 'dq', 'dk', 'dv' }) do helpers.assert_close(g1[n], g2[n], RTOL, ATOL, what .. ': ' .. name) end
  return y1, g1
end

-- ids as Lua lists and as an i32 tensor [B, T]
local function docs_from(lists)
  local flat = {}
  for _, l in ipairs(lists) do for _, x in ipairs(l) do flat[#flat + 1] = x end end
  return helpers.from_flat(flat, { #lists, #lists[1] }):int()
end
local function random_docs(B, T, ndocs)
  local out = {}
  for b = 1, B do
    out[b] = {}
    local d = 0
    for t = 1, T do
      if t > 1 and math.random() < ndocs / T then d = d + 1 end
      out[b][t] = d
    end
  end
  return out
end
local function layout_lists(t)
  local nr, nc = t:size(1), t:size(2)
  local flat, out = helpers.list(t), {}
  for r = 1, nr do
    out[r] = {}
    for c = 1, nc do out[r][c] = flat[(r - 1) * nc + c] end
  end
  return out
end

---------------------------------------------------------------- dense and causal
describe('flash_attention vs uly.attention (dense, causal)', function()
  local CASES = {
    -- B, Tq, Tk, H, G, D
    { 1, 1, 1, 1, 1, 4 },
    { 2, 37, 37, 2, 2, 8 },
    { 1, 130, 130, 3, 1, 16 },  -- GQA H / G = 3, two tiles plus a ragged one
    { 1, 37, 130, 2, 1, 5 },    -- Tq < Tk, odd head_dim
    { 1, 130, 37, 2, 2, 20 },   -- Tq > Tk: causal leaves the first 93 queries empty
    { 1, 70, 70, 2, 1, 64 },
  }
  for n, c in ipairs(CASES) do
    for _, causal in ipairs({ false, true }) do
      it(string.format('B %d Tq %d Tk %d H %d Hkv %d D %d causal %s', c[1], c[2], c[3], c[4], c[5], c[6],
                       tostring(causal)), function()
        helpers.reseed(100 + n)
        local q, k, v = leaves(unpack(c))
        compare('dense', q, k, v, { causal = causal },
                function(a, b, d) return uly.attention(a, b, d, { causal = causal }) end)
      end)
    end
  end

  it('explicit scale', function()
    helpers.reseed(110)
    local q, k, v = leaves(1, 37, 37, 2, 1, 8)
    compare('scale 0.3', q, k, v, { scale = 0.3, causal = true },
            function(a, b, d) return uly.attention(a, b, d, { scale = 0.3, causal = true }) end)
  end)

  it('strided q, k, v: narrow()s of one fused [B, T, H + 2G, D] buffer, read in place', function()
    helpers.reseed(111)
    local B, T, H, G, D = 2, 67, 3, 1, 16
    local fused = R.leaf(uly.randn(B, T, H + 2 * G, D))
    local function split(x) return x:narrow(3, 1, H), x:narrow(3, H + 1, G), x:narrow(3, H + G + 1, G) end
    local q, k, v = split(fused)
    assert.is_false(q:is_contiguous())
    local g = uly.randn(B, T, H, D)
    uly.flash_attention(q, k, v, { causal = true }):backward(g)
    local g1 = fused.grad:clone()
    fused:zero_grad()
    local q2, k2, v2 = split(fused)
    uly.attention(q2, k2, v2, { causal = true }):backward(g)
    helpers.assert_close(uly.flash_attention(q, k, v, { causal = true }),
                         uly.attention(q, k, v, { causal = true }), RTOL, ATOL, 'fused output')
    helpers.assert_close(g1, fused.grad, RTOL, ATOL, 'fused gradient')
  end)

  it('large scores stay finite (online softmax rescaling)', function()
    helpers.reseed(112)
    local q, k, v = uly.randn(1, 130, 1, 8) * 8, uly.randn(1, 130, 1, 8) * 8, uly.randn(1, 130, 1, 8)
    local y = uly.flash_attention(q, k, v, { causal = true })
    helpers.assert_close(y, uly.attention(q, k, v, { causal = true }), 3e-4, 3e-4, 'large scores')
  end)
end)

---------------------------------------------------------------- window, block-sparse, documents
describe('flash_attention masks vs the foundation-op reference', function()
  local function check_mask(what, B, Tq, Tk, H, G, D, opts, vis)
    local q, k, v = leaves(B, Tq, Tk, H, G, D)
    return compare(what, q, k, v, opts, function(a, b, c) return ref_attention(a, b, c, opts.scale, vis) end)
  end

  local WINDOWS = {
    -- Tq, Tk, window, causal
    { 130, 130, 7, true },
    { 130, 130, { 5, 9 }, false },
    { 37, 37, 100, true },        -- wider than N: plain causal
    { 37, 37, { 200, 300 }, false }, -- wider than N on both sides: dense
    { 37, 130, 20, true },        -- Tq < Tk, bottom-right aligned
    { 130, 37, { 3, 0 }, false }, -- Tq > Tk: the first rows see nothing
    { 130, 130, 0, true },        -- only the diagonal
    { 130, 130, { -1, 4 }, false }, -- unbounded left
  }
  for n, c in ipairs(WINDOWS) do
    it(string.format('sliding window %s causal %s, Tq %d Tk %d', type(c[3]) == 'table' and
                     ('{' .. c[3][1] .. ', ' .. c[3][2] .. '}') or c[3], tostring(c[4]), c[1], c[2]), function()
      helpers.reseed(200 + n)
      local opts = { window = c[3], causal = c[4] }
      check_mask('window', 1, c[1], c[2], 3, 1, 8, opts, visibility(opts, c[1], c[2]))
    end)
  end

  it('block-sparse: local + strided + global layouts, ragged blocks, with and without causal', function()
    helpers.reseed(220)
    for _, c in ipairs({ { 130, 16, 2, 3, 1 }, { 37, 8, 1, 2, 0 }, { 130, 64, 1, 0, 0 }, { 100, 33, 1, 2, 0 } }) do
      local T, bs, loc, stride, glob = unpack(c)
      local layout = uly.attention_layouts.local_strided(T, bs, loc, stride, glob)
      assert.are.same({ math.ceil(T / bs), math.ceil(T / bs) }, layout:shape())
      for _, causal in ipairs({ false, true }) do
        local opts = { block_layout = layout, block_size = bs, causal = causal }
        check_mask(string.format('block T %d bs %d causal %s', T, bs, tostring(causal)), 1, T, T, 2, 2, 8, opts,
                   visibility(opts, T, T, nil, nil, layout_lists(layout), bs))
      end
    end
  end)

  it('block-sparse with empty block rows (queries that see nothing) and Tq ~= Tk', function()
    helpers.reseed(221)
    local bs, Tq, Tk = 16, 50, 70
    local layout = uly.attention_layouts.from_function(4, 5, function(r, c) return r ~= 1 and (r + c) % 2 == 0 end)
    local opts = { block_layout = layout, block_size = bs }
    local y = check_mask('block empty rows', 1, Tq, Tk, 3, 1, 8, opts,
                         visibility(opts, Tq, Tk, nil, nil, layout_lists(layout), bs))
    for _, x in ipairs(helpers.list(y:narrow(2, 17, 16))) do assert(x == 0, 'empty block row output ' .. x) end
  end)

  it('document masks (packed sequences), alone and with causal / window; GQA', function()
    helpers.reseed(230)
    local B, T = 2, 130
    local docs = random_docs(B, T, 5)
    local ids = docs_from(docs)
    for _, extra in ipairs({ {}, { causal = true }, { causal = true, window = 9 } }) do
      local opts = { doc = ids, causal = extra.causal, window = extra.window }
      check_mask('documents', B, T, T, 3, 1, 8, opts, visibility(opts, T, T, docs, docs))
    end
  end)

  it('document ids that differ between queries and keys: empty rows give 0 output and 0 gradient', function()
    helpers.reseed(231)
    local Tq, Tk = 37, 70
    local qd, kd = { {} }, { {} }
    for i = 1, Tq do qd[1][i] = (i <= 10) and 99 or math.floor(i / 12) end -- doc 99: no key has it
    for j = 1, Tk do kd[1][j] = math.floor(j / 20) end
    local opts = { q_doc = docs_from(qd), k_doc = docs_from(kd), causal = true }
    local y, g = check_mask('doc empty rows', 1, Tq, Tk, 2, 1, 8, opts, visibility(opts, Tq, Tk, qd, kd))
    for _, x in ipairs(helpers.list(y:narrow(2, 1, 10))) do assert(x == 0, 'empty row output ' .. x) end
    for _, x in ipairs(helpers.list(g[1]:narrow(2, 1, 10))) do assert(x == 0, 'empty row dq ' .. x) end
    for _, t in ipairs({ y, g[1], g[2], g[3] }) do
      for _, x in ipairs(helpers.list(t)) do assert(x == x and math.abs(x) < math.huge, 'non-finite ' .. x) end
    end
  end)

  it('every mask at once: causal + window + block layout + documents, strided inputs, GQA 3', function()
    helpers.reseed(232)
    local T, bs = 130, 16
    local docs = random_docs(1, T, 3)
    local layout = uly.attention_layouts.local_strided(T, bs, 3, 2, 1)
    local opts = { causal = true, window = 50, block_layout = layout, block_size = bs, doc = docs_from(docs) }
    local fused = R.leaf(uly.randn(1, T, 5, 8))
    local vis = visibility(opts, T, T, docs, docs, layout_lists(layout), bs)
    local g = uly.randn(1, T, 3, 8)
    local function run(f)
      fused:zero_grad()
      local y = f(fused:narrow(3, 1, 3), fused:narrow(3, 4, 1), fused:narrow(3, 5, 1))
      y:backward(g)
      return y, fused.grad:clone()
    end
    local y1, g1 = run(function(a, b, c) return uly.flash_attention(a, b, c, opts) end)
    local y2, g2 = run(function(a, b, c) return ref_attention(a, b, c, nil, vis) end)
    helpers.assert_close(y1, y2, RTOL, ATOL, 'all masks output')
    helpers.assert_close(g1, g2, RTOL, ATOL, 'all masks gradient')
  end)

  it('doc_ids builds ids of packed documents', function()
    local ids = uly.attention_layouts.doc_ids({ 2, 3, 1 }, 2)
    assert.are.same({ 2, 6 }, ids:shape())
    assert.are.same({ 0, 0, 1, 1, 1, 2, 0, 0, 1, 1, 1, 2 }, helpers.list(ids))
  end)
end)

---------------------------------------------------------------- gradcheck, determinism, work, memory
describe('flash_attention gradients, threads, work and memory', function()
  it('gradcheck q, k, v on small cases of every mask kind', function()
    helpers.reseed(300)
    local ids = docs_from({ { 0, 0, 1, 1, 1, 2, 2 } })
    local layout = uly.attention_layouts.from_function(3, 3, function(r, c) return r == c or c == 0 end)
    for _, opts in ipairs({ {}, { causal = true }, { window = { 1, 2 } }, { doc = ids, causal = true },
                            { block_layout = layout, block_size = 3 } }) do
      local q, k, v = leaves(1, 7, 7, 2, 1, 3)
      helpers.gradcheck(function(a, b, c) return uly.flash_attention(a, b, c, opts) end, { q, k, v })
    end
  end)

  it('bit-identical values and gradients at 1 and 2 threads', function()
    helpers.reseed(310)
    local q, k, v = leaves(1, 200, 150, 4, 2, 32)
    local g = uly.randn(1, 200, 4, 32)
    local ids = docs_from(random_docs(1, 200, 4))
    local kids = docs_from(random_docs(1, 150, 3))
    local opts = { causal = true, window = 90, q_doc = ids, k_doc = kids }
    local runs = {}
    for t, n in ipairs({ 1, 2 }) do
      uly.set_num_threads(n)
      local y, gr = grads_of(function(a, b, c) return uly.flash_attention(a, b, c, opts) end, q, k, v, g)
      runs[t] = { y, gr[1], gr[2], gr[3] }
    end
    uly.set_num_threads(0)
    for x = 1, 4 do helpers.assert_close(runs[2][x], runs[1][x], 0, 0, 'threads 1 vs 2, tensor ' .. x) end
  end)

  it('skips hidden 64 x 64 tiles: work follows the unmasked area', function()
    local function tiles(T, opts)
      local q = uly.randn(1, T, 1, 16)
      uly.flash_attention_reset_tiles()
      uly.flash_attention(q, q, q, opts)
      return uly.flash_attention_tiles()
    end
    assert.are.equal(100, tiles(640, {}))
    assert.are.equal(55, tiles(640, { causal = true }))         -- the lower triangle of 10 x 10 tiles
    local w1, w2 = tiles(2048, { causal = true, window = 100 }), tiles(4096, { causal = true, window = 100 })
    -- a 100-key window touches at most 3 key tiles per query tile: 32 more query tiles, 96 more tiles
    assert.is_true(w1 <= 3 * 32 and w2 - w1 == 3 * 32, string.format('window tiles %d, %d', w1, w2))
    local layout = uly.attention_layouts.local_strided(640, 64, 1, 0, 0)       -- diagonal blocks only
    assert.are.equal(10, tiles(640, { block_layout = layout, block_size = 64 }))
    local ids = uly.attention_layouts.doc_ids({ 128, 256, 256 })                 -- 2 + 4 + 4 tiles per side
    assert.are.equal(4 + 16 + 16, tiles(640, { doc = ids }))
  end)

  it('allocator peak of forward + backward grows linearly in N (1k, 4k, 16k; B 1, H 1, D 64, causal)', function()
    helpers.reseed(320)
    -- under the sanitizer build a 512-wide window keeps the 16k point fast; memory is the same
    local opts = { causal = true, window = ASAN and 512 or nil }
    local function peak(N)
      local q, k, v = R.leaf(uly.randn(1, N, 1, 64)), R.leaf(uly.randn(1, N, 1, 64)), R.leaf(uly.randn(1, N, 1, 64))
      local g = uly.randn(1, N, 1, 64)
      collectgarbage(); collectgarbage()
      local base = uly.memory().allocated
      uly.reset_peak_memory()
      local y = uly.flash_attention(q, k, v, opts)
      y:backward(g)
      local p = uly.memory().peak - base
      assert.is_true(q.grad ~= nil and k.grad ~= nil and v.grad ~= nil)
      return p
    end
    local p1, p4, p16 = peak(1024), peak(4096), peak(16384)
    local msg = string.format('peaks %d, %d, %d bytes', p1, p4, p16)
    assert.is_true(p16 < 6 * p4 and p4 < 6 * p1, msg)
    assert.is_true(p16 < 16384 * 64 * 4 * 12, msg)       -- a dozen [N, D] f32 buffers at most
    assert.is_true(p16 < 16384 * 16384 * 4 / 20, msg)    -- far below one N x N f32 score matrix (1 GiB)
  end)
end)

---------------------------------------------------------------- nn.flash_attend
describe('nn.flash_attend', function()
  it('SelfAttention with flash_attend equals the reference attend (causal), and honours window', function()
    helpers.reseed(400)
    local x = uly.randn(2, 37, 24)
    local m = nn.SelfAttention(24, { heads = 6, kv_heads = 2, rope = true })
    local y_ref = m(x)
    m.attend = nn.flash_attend
    helpers.assert_close(m(x), y_ref, RTOL, ATOL, 'SelfAttention flash vs reference')
    m.window = 5
    local q, k, v = uly.randn(1, 37, 6, 4), uly.randn(1, 37, 2, 4), uly.randn(1, 37, 2, 4)
    helpers.assert_close(nn.flash_attend(q, k, v, { causal = true, scale = 0.5, window = 5, pos = 0 }),
                         uly.flash_attention(q, k, v, { causal = true, scale = 0.5, window = 5 }), 0, 0, 'attend opts')
    local yw = m(x)
    assert(R.max_abs(helpers.list(yw - y_ref)) > 1e-4, 'window had no effect')
  end)
end)

---------------------------------------------------------------- errors
describe('flash_attention errors', function()
  local q, k = uly.randn(1, 8, 2, 4), uly.randn(1, 8, 1, 4)
  local function fails(pattern, ...)
    local ok, err = pcall(uly.flash_attention, ...)
    assert.is_false(ok, 'accepted: ' .. pattern)
    assert.matches(pattern, tostring(err), 1, true)
    assert.matches('flash_attention', tostring(err), 1, true)
  end
  it('shapes, dtypes and heads', function()
    fails('multiple', uly.randn(1, 8, 3, 4), uly.randn(1, 8, 2, 4), uly.randn(1, 8, 2, 4))
    fails('[1, 9, 1, 4]', q, k, uly.randn(1, 9, 1, 4))
    fails('head_dim', uly.randn(8, 2, 4), k, k)
    fails('f32', q:int(), k, k)
    fails('expected a tensor', q, k, 3)
  end)
  it('bf16 q, k, v: computed in f32 on the CPU, the result in q\'s dtype, gradients f32', function()
    -- the CPU kernel computes in f32: the bf16 values, converted exactly
    local qb, kb, vb = uly.randn(1, 3, 2, 4):bf16(), uly.randn(1, 8, 1, 4):bf16(), uly.randn(1, 8, 1, 4):bf16()
    local got = uly.no_grad(uly.flash_attention, qb, kb, vb, { causal = true })
    assert.equal('bf16', got:dtype())
    local want = uly.flash_attention(qb:float(), kb:float(), vb:float(), { causal = true })
    helpers.assert_close(got:float(), want:bf16():float(), 0, 0, 'bf16 read as f32, rounded once')
    -- f32 queries against a bf16 KV cache: an f32 result
    local mixed = uly.no_grad(uly.flash_attention, qb:float(), kb, vb, { causal = true })
    assert.equal('f32', mixed:dtype())
    helpers.assert_close(mixed, want, 0, 0, 'f32 q, bf16 cache')
    local ref = uly.no_grad(uly.attention, qb, kb, vb, { causal = true })   -- the reference op too
    assert.equal('bf16', ref:dtype())
    helpers.assert_close(ref:float(), uly.attention(qb:float(), kb:float(), vb:float(), { causal = true }):bf16():float(),
                         0, 0, 'attention')
    -- with gradients: the f32 op's, on the same values (the output saved in bf16 enters delta = dO . O)
    local function grads(dtype)
      local leaves = {}
      for i, t in ipairs({ qb, kb, vb }) do leaves[i] = t:float():to(dtype):detach():requires_grad_() end
      local o = uly.flash_attention(leaves[1], leaves[2], leaves[3], { causal = true })
      o:float():mul(o:float()):sum():backward()
      return leaves
    end
    local g16, g32 = grads('bf16'), grads('f32')
    for i = 1, 3 do
      assert.equal('f32', g16[i].grad:dtype())
      helpers.assert_close(g16[i].grad, g32[i].grad, 2e-2, 2e-2, 'gradient ' .. i)
    end
  end)
  it('masks', function()
    fails('block_size', q, k, k, { block_layout = uly.ones(2, 2):int() })
    fails('[2, 2]', q, k, k, { block_layout = uly.ones(3, 2):int(), block_size = 4 })
    fails('only 0 and 1', q, k, k, { block_layout = uly.full({ 2, 2 }, 2):int(), block_size = 4 })
    fails('i32', q, k, k, { block_layout = uly.ones(2, 2), block_size = 4 })
    fails('q_doc', q, k, k, { q_doc = uly.zeros(1, 7):int(), k_doc = uly.zeros(1, 8):int() })
    fails('both', q, k, k, { k_doc = uly.zeros(1, 8):int() })
    fails('document ids', q, k, k, { doc = uly.zeros(1, 8) })
    fails('window', q, k, k, { window = -3 })
    fails('window', q, k, k, { window = 'wide' })
  end)
end)
