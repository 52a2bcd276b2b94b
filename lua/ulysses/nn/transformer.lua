-- lua/ulysses/nn/transformer.lua — the transformer pieces the models are built from:
-- nn.SelfAttention (fused QKV projection, optional RoPE, grouped-query K/V heads, a pluggable
-- local attention kernel `attend(q, k, v, opts)`), nn.Block (pre-norm residual block) and
-- nn.KVCache (per-layer key/value cache for O(T) incremental decoding).
--
-- Shapes: x [B, T, C]; q [B, T, H, D]; k, v [B, T, Hkv, D]; C = H * D, H a multiple of Hkv.
-- Positions are global: ctx.pos is the index of x's first token in the whole sequence (under
-- sequence parallelism, the shard's offset; while decoding, the number of cached tokens).
return function(nn, U)
  local Module, Linear = nn.Module, nn.Linear
  local options = require 'ulysses.options'

  local function raise(msg, level) error('nn: ' .. msg, (level or 1) + 1) end

  -- the default local attention: the reference kernel (dense, causal bottom-right aligned)
  function nn.reference_attend(q, k, v, opts)
    if opts.window or opts.doc or opts.q_doc then
      raise('reference attention: it has no sliding-window or document masks; use the flash kernel ' ..
            "(nn.flash_attend, or attention = 'flash' in a model config)", 3)
    end
    return U().attention(q, k, v, { causal = opts.causal, scale = opts.scale })
  end

  -- memory-efficient attention (uly.flash_attention): O(N D) memory, honours opts.window (a
  -- number: that many keys back, and forward too unless causal; or {left, right}) and document
  -- ids (opts.doc, or opts.q_doc / opts.k_doc). opts.pos needs nothing: a KV cache's queries are
  -- the last Tq of Tk positions, which the bottom-right alignment already assumes.
  function nn.flash_attend(q, k, v, opts)
    return U().flash_attention(q, k, v, { causal = opts.causal, scale = opts.scale, window = opts.window,
                                          doc = opts.doc, q_doc = opts.q_doc, k_doc = opts.k_doc })
  end

  ---------------------------------------------------------------- KVCache
  -- KVCache(B, max_T, Hkv, D, {dtype = 'f32' | 'bf16', device}): preallocated [B, max_T, Hkv, D]
  -- buffers; append(k, v) writes the new positions (rounded, for bf16) and returns views of
  -- everything cached so far. A bf16 cache takes half the memory, and in bf16 precision on the
  -- GPU attention reads it as it is (it rounds K and V to bf16 anyway: the same numbers as f32).
  local KVCache = {}
  KVCache.__index = KVCache
  nn.KVCache = setmetatable(KVCache, { __call = function(cls, B, max_T, Hkv, D, opts)
    opts = options.check('nn.KVCache', opts, { 'dtype', 'device' })
    local dtype = opts.dtype or 'f32'
    if dtype ~= 'f32' and dtype ~= 'bf16' then raise("KVCache: dtype must be 'f32' or 'bf16', got " .. tostring(dtype), 2) end
    local o = { dtype = dtype, device = opts.device }
    return setmetatable({ k = U().zeros(B, max_T, Hkv, D, o), v = U().zeros(B, max_T, Hkv, D, o),
                          len = 0, max_T = max_T }, cls)
  end })
  -- the cache's buffers on a device (a new cache; the contents move along)
  function KVCache:to(device)
    return setmetatable({ k = self.k:to(device), v = self.v:to(device), len = self.len, max_T = self.max_T },
                        getmetatable(self))
  end
  function KVCache:append(k, v)
    local T = k:size(2)
    if self.len + T > self.max_T then
      raise(string.format('KVCache: %d cached + %d new positions exceed its capacity %d', self.len, T, self.max_T), 3)
    end
    if self.k:device() ~= k:device() then  -- created before the model moved: follow it once
      self.k, self.v = self.k:to(k:device()), self.v:to(k:device())
    end
    U().no_grad(function()
      self.k:narrow(2, self.len + 1, T):copy_(k)
      self.v:narrow(2, self.len + 1, T):copy_(v)
    end)
    self.len = self.len + T
    return self.k:narrow(2, 1, self.len), self.v:narrow(2, 1, self.len)
  end

  ---------------------------------------------------------------- SelfAttention
  -- SelfAttention(C, {heads = H, kv_heads = H, rope = false, rope_theta = 10000, bias = true,
  --   causal = true, attend = nn.reference_attend, std = 0.02, proj_std = std})
  -- wqkv: [C, (H + 2 Hkv) D] (Q heads, then K heads, then V heads); proj: [C, C].
  local SelfAttention = Module:extend('SelfAttention')
  nn.SelfAttention = SelfAttention
  function SelfAttention:__init(C, opts)
    opts = options.check('nn.SelfAttention', opts, { 'heads', 'kv_heads', 'rope', 'rope_theta', 'causal', 'window',
                                                     'attend', 'bias', 'std', 'proj_std' })
    local H = opts.heads or raise('SelfAttention: opts.heads is required', 3)
    local Hkv = opts.kv_heads or H
    if C % H ~= 0 then raise(string.format('SelfAttention: dim %d is not divisible by heads %d', C, H), 3) end
    if H % Hkv ~= 0 then raise(string.format('SelfAttention: heads %d is not a multiple of kv_heads %d', H, Hkv), 3) end
    self.dim, self.heads, self.kv_heads, self.head_dim = C, H, Hkv, C / H
    self.rope, self.rope_theta = opts.rope or false, opts.rope_theta or 10000
    self.causal = opts.causal ~= false
    self.window = opts.window
    self.attend = opts.attend or nn.reference_attend
    local D = C / H
    self:add('wqkv', Linear(C, (H + 2 * Hkv) * D, { bias = opts.bias, std = opts.std }))
    self:add('proj', Linear(C, C, { bias = opts.bias, std = opts.proj_std or opts.std }))
  end

  -- x [B, T, C] -> [B, T, C]; ctx = { pos = first position (0), cache = nn.KVCache or nil,
  -- seq_total = the whole sequence's length under sequence parallelism }
  function SelfAttention:forward(x, ctx)
    local B, T = x:size(1), x:size(2)
    local H, Hkv, D = self.heads, self.kv_heads, self.head_dim
    local pos = ctx and ctx.pos or 0
    local qkv = self.wqkv(x):view(B, T, H + 2 * Hkv, D)          -- [B, T, H + 2Hkv, D]
    if type(self.attend) == 'table' and self.attend.forward_qkv then
      -- sequence parallel: Q, K, V leave in one exchange; RoPE is applied after it, on the
      -- whole sequence (positions are global either way)
      if ctx and ctx.cache then raise('SelfAttention: a KV cache cannot be used with sequence-parallel attention', 2) end
      local y = self.attend:forward_qkv(qkv, { heads = H, kv_heads = Hkv, causal = self.causal,
                                               scale = 1 / math.sqrt(D), window = self.window,
                                               rope_theta = self.rope and self.rope_theta or nil,
                                               seq_total = ctx and ctx.seq_total, seq_start = ctx and ctx.seq_start or 0,
                                               doc = ctx and ctx.doc })
      return self.proj(y:reshape(B, T, H * D))
    end
    local q = qkv:narrow(3, 1, H)                                   -- [B, T, H, D]
    local k = qkv:narrow(3, H + 1, Hkv)                             -- [B, T, Hkv, D]
    local v = qkv:narrow(3, H + Hkv + 1, Hkv)
    if self.rope then
      q, k = q:rope(pos, self.rope_theta), k:rope(pos, self.rope_theta)
    end
    if ctx and ctx.cache then k, v = ctx.cache:append(k, v) end    -- [B, pos + T, Hkv, D]
    local y = self.attend(q, k, v, { causal = self.causal, scale = 1 / math.sqrt(D),
                                     window = self.window, pos = pos, doc = ctx and ctx.doc })  -- [B, T, H, D]
    return self.proj(y:reshape(B, T, H * D))
  end
  function SelfAttention:extra_repr()
    return string.format('dim=%d, heads=%d, kv_heads=%d%s%s', self.dim, self.heads, self.kv_heads,
                         self.rope and ', rope' or '', self.causal and ', causal' or '')
  end

  ---------------------------------------------------------------- DistributedAttention
  -- DistributedAttention(local_attend, group): DeepSpeed-Ulysses around any local attention.
  -- Each rank holds n_r tokens of every head; one all-to-all gives it the whole sequence for its
  -- share of the heads (and the K/V heads those use), local_attend runs on that, and a second
  -- all-to-all restores the sequence sharding. A model becomes sequence-parallel by swapping its
  -- attend for this (and its data loader for a sharded one); nothing else changes.
  local DistributedAttention = {}
  DistributedAttention.__index = DistributedAttention
  nn.DistributedAttention = setmetatable(DistributedAttention, { __call = function(cls, local_attend, group)
    if type(local_attend) ~= 'function' and not (type(local_attend) == 'table' and getmetatable(local_attend)) then
      raise('DistributedAttention: expects a local attention function attend(q, k, v, opts)', 3)
    end
    if type(group) ~= 'table' or not group._c then
      raise('DistributedAttention: expects a process group (uly.dist.init{sp = P}.sp_group)', 3)
    end
    return setmetatable({ local_attend = local_attend, group = group }, cls)
  end })

  -- local q heads [h0, h0 + hq) against K/V heads [g0, g0 + gk): one call when the grouping is
  -- uniform, else one call per K/V head over the query heads that use it
  local function attend_local(self, q, k, v, hd, group_size, opts)
    local hq, gk = hd.q_count, hd.kv_count
    local uniform = hq % gk == 0
    for i = 0, hq - 1 do
      if not uniform then break end
      uniform = math.floor(i / (hq / gk)) == math.floor((hd.q_start + i) / group_size) - hd.kv_start
    end
    if uniform then return self.local_attend(q, k, v, opts) end
    local parts, i = {}, 0
    for j = 0, gk - 1 do
      local first = i
      while i < hq and math.floor((hd.q_start + i) / group_size) - hd.kv_start == j do i = i + 1 end
      if i > first then
        parts[#parts + 1] = self.local_attend(q:narrow(3, first + 1, i - first), k:narrow(3, j + 1, 1),
                                              v:narrow(3, j + 1, 1), opts)
      end
    end
    local out = parts[1]
    for p = 2, #parts do out = U().cat({ out, parts[p] }, 3) end
    return out
  end

  -- qkv [B, n_r, H + 2G, D] (this rank's tokens) -> attention output [B, n_r, H, D]
  -- opts: heads, kv_heads, seq_total (N, required), seq_start (the sequence's first position),
  -- rope_theta (apply RoPE after the exchange), causal, scale, window
  function DistributedAttention:forward_qkv(qkv, opts)
    local dist = U().dist
    local N = opts.seq_total
    if not N then -- the sum of the shards (one small collective; pass ctx.seq_total to skip it)
      local t = U().tensor({ qkv:size(2) }, { dtype = 'i64' })
      self.group:all_reduce_(t, 'sum')
      N = t:item()
    end
    local H, G = opts.heads, opts.kv_heads
    local P, r = self.group:size(), self.group:rank()
    local hd = dist.heads(H, G, P, r)
    local recv = dist.qkv_to_heads(self.group, qkv, H, G, N)               -- [B, N, hq + 2gk, D]
    local y
    if hd.q_count == 0 then
      y = recv:narrow(3, 1, 0)                                              -- no heads here: still in the graph
    else
      local q = recv:narrow(3, 1, hd.q_count)
      local k = recv:narrow(3, hd.q_count + 1, hd.kv_count)
      local v = recv:narrow(3, hd.q_count + hd.kv_count + 1, hd.kv_count)
      if opts.rope_theta then
        q, k = q:rope(opts.seq_start or 0, opts.rope_theta), k:rope(opts.seq_start or 0, opts.rope_theta)
      end
      y = attend_local(self, q, k, v, hd, H / G, { causal = opts.causal, scale = opts.scale, window = opts.window,
                                                   pos = opts.seq_start or 0, doc = opts.doc })  -- doc: [B, N]
    end
    return dist.heads_to_seq(self.group, y, H, N)                         -- [B, n_r, H, D]
  end

  -- the DeepSpeed-style call with separate (already rotated) q [B, n_r, H, D], k, v [B, n_r, G, D]:
  -- packs them into one buffer (a copy) and runs the same exchange
  function DistributedAttention:__call(q, k, v, opts)
    opts = opts or {}
    local qkv = U().cat({ q, k, v }, 3)
    return self:forward_qkv(qkv, { heads = q:size(3), kv_heads = k:size(3), seq_total = opts.seq_total,
                                   causal = opts.causal, scale = opts.scale, window = opts.window,
                                   seq_start = opts.pos })
  end

  ---------------------------------------------------------------- Block
  -- Block(C, opts): pre-norm residual block
  --   x = x + attn(norm1(x));  x = x + mlp(norm2(x))
  -- opts: heads, kv_heads, norm = 'layernorm' | 'rmsnorm', mlp = 'gelu' | 'swiglu', hidden,
  --   rope, rope_theta, bias, attend, dropout, std, proj_std (residual projections), eps,
  --   checkpoint (true: recompute the block in backward instead of keeping its activations;
  --   'except_attention': the same, but keep attention's output so backward does not run
  --   attention's forward again: one more [B, T, C] tensor a block),
  --   tile (compute the MLP over slices of this many positions)
  local Block = Module:extend('Block')
  nn.Block = Block
  function Block:__init(C, opts)
    opts = options.check('nn.Block', opts, { 'heads', 'kv_heads', 'norm', 'mlp', 'hidden', 'rope', 'rope_theta',
                                             'bias', 'attend', 'window', 'dropout', 'std', 'proj_std', 'eps',
                                             'checkpoint', 'tile' })
    local Norm = (opts.norm == 'rmsnorm') and nn.RMSNorm or nn.LayerNorm
    local proj_std = opts.proj_std or opts.std
    self:add('norm1', Norm(C, { eps = opts.eps }))
    self:add('attn', SelfAttention(C, {
      heads = opts.heads, kv_heads = opts.kv_heads, rope = opts.rope, rope_theta = opts.rope_theta,
      bias = opts.bias, attend = opts.attend, window = opts.window, std = opts.std, proj_std = proj_std }))
    self:add('norm2', Norm(C, { eps = opts.eps }))
    if opts.mlp == 'swiglu' then
      self:add('mlp', nn.SwiGLU(C, opts.hidden, { bias = opts.bias, std = opts.std }))
      U().no_grad(function() self.mlp.w2.weight:normal_(0, proj_std or 0.02) end)
    else
      self:add('mlp', nn.MLP(C, opts.hidden, { bias = opts.bias, std = opts.std }))
      U().no_grad(function() self.mlp.proj.weight:normal_(0, proj_std or 0.02) end)
    end
    self.dropout = opts.dropout or 0
    if opts.checkpoint ~= nil and type(opts.checkpoint) ~= 'boolean' and opts.checkpoint ~= 'except_attention' then
      raise("Block: checkpoint must be true, false or 'except_attention', got " .. tostring(opts.checkpoint), 2)
    end
    self.checkpoint = opts.checkpoint or false
    self.tile = opts.tile                 -- rows per slice of the tiled MLP (nil: untiled)
  end
  -- with checkpoint = true (while training) only x is kept; backward recomputes the block
  -- ('except_attention': all but attention, whose output is kept too)
  function Block:forward(x, ctx)
    if self.checkpoint and self.training and not (ctx and ctx.cache) then
      local segment = self.checkpoint == 'except_attention' and nn.checkpoint_except_attention or nn.checkpoint
      return segment(function(t) return self:forward_body(t, ctx) end, x)
    end
    return self:forward_body(x, ctx)
  end
  function Block:forward_body(x, ctx)
    local a = self.attn(self.norm1(x), ctx)
    if self.training and self.dropout > 0 then a = a:dropout(self.dropout, true) end
    x = x + a
    local m
    if self.tile and self.tile < x:size(2) then   -- tiled MLP: one slice's hidden activations at a time
      m = nn.chunked(function(t) return self.mlp(self.norm2(t)) end, x, { dim = 2, size = self.tile })
    else
      m = self.mlp(self.norm2(x))
    end
    if self.training and self.dropout > 0 then m = m:dropout(self.dropout, true) end
    return x + m
  end
end
