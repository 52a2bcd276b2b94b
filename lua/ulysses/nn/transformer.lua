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

  local function raise(msg, level) error('nn: ' .. msg, (level or 1) + 1) end

  -- the default local attention: the reference kernel (dense, causal bottom-right aligned)
  function nn.reference_attend(q, k, v, opts)
    return U().attention(q, k, v, { causal = opts.causal, scale = opts.scale })
  end

  ---------------------------------------------------------------- KVCache
  -- KVCache(B, max_T, Hkv, D): preallocated [B, max_T, Hkv, D] buffers; append(k, v) writes
  -- the new positions and returns views of everything cached so far.
  local KVCache = {}
  KVCache.__index = KVCache
  nn.KVCache = setmetatable(KVCache, { __call = function(cls, B, max_T, Hkv, D)
    return setmetatable({ k = U().zeros(B, max_T, Hkv, D), v = U().zeros(B, max_T, Hkv, D),
                          len = 0, max_T = max_T }, cls)
  end })
  function KVCache:append(k, v)
    local T = k:size(2)
    if self.len + T > self.max_T then
      raise(string.format('KVCache: %d cached + %d new positions exceed its capacity %d', self.len, T, self.max_T), 3)
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
    opts = opts or {}
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

  -- x [B, T, C] -> [B, T, C]; ctx = { pos = first position (0), cache = nn.KVCache or nil }
  function SelfAttention:forward(x, ctx)
    local B, T = x:size(1), x:size(2)
    local H, Hkv, D = self.heads, self.kv_heads, self.head_dim
    local pos = ctx and ctx.pos or 0
    local qkv = self.wqkv(x):view(B, T, H + 2 * Hkv, D)          -- [B, T, H + 2Hkv, D]
    local q = qkv:narrow(3, 1, H)                                   -- [B, T, H, D]
    local k = qkv:narrow(3, H + 1, Hkv)                             -- [B, T, Hkv, D]
    local v = qkv:narrow(3, H + Hkv + 1, Hkv)
    if self.rope then
      q, k = q:rope(pos, self.rope_theta), k:rope(pos, self.rope_theta)
    end
    if ctx and ctx.cache then k, v = ctx.cache:append(k, v) end    -- [B, pos + T, Hkv, D]
    local y = self.attend(q, k, v, { causal = self.causal, scale = 1 / math.sqrt(D),
                                     window = self.window, pos = pos })  -- [B, T, H, D]
    return self.proj(y:reshape(B, T, H * D))
  end
  function SelfAttention:extra_repr()
    return string.format('dim=%d, heads=%d, kv_heads=%d%s%s', self.dim, self.heads, self.kv_heads,
                         self.rope and ', rope' or '', self.causal and ', causal' or '')
  end

  ---------------------------------------------------------------- Block
  -- Block(C, opts): pre-norm residual block
  --   x = x + attn(norm1(x));  x = x + mlp(norm2(x))
  -- opts: heads, kv_heads, norm = 'layernorm' | 'rmsnorm', mlp = 'gelu' | 'swiglu', hidden,
  --   rope, rope_theta, bias, attend, dropout, std, proj_std (residual projections), eps
  local Block = Module:extend('Block')
  nn.Block = Block
  function Block:__init(C, opts)
    opts = opts or {}
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
  end
  function Block:forward(x, ctx)
    local a = self.attn(self.norm1(x), ctx)
    if self.training and self.dropout > 0 then a = a:dropout(self.dropout, true) end
    x = x + a
    local m = self.mlp(self.norm2(x))
    if self.training and self.dropout > 0 then m = m:dropout(self.dropout, true) end
    return x + m
  end
end
