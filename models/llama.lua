-- models/llama.lua — Llama (Touvron et al., 2023): RoPE positions, RMSNorm, SwiGLU MLP,
-- grouped-query attention (kv_heads K/V heads shared by heads / kv_heads query heads each),
-- no biases, a separate output head (tied = true shares the embedding as Llama 3.2 1B does).
--
--   h_0 = E[x]                                                   [B, T, C]
--   h_l = h_{l-1} + Attn(RMSNorm(h_{l-1}), RoPE(pos))            q [B,T,H,D], k,v [B,T,Hkv,D]
--   h_l = h_l + W2 (silu(W1 n) * W3 n),  n = RMSNorm(h_l)        hidden F
--   logits = RMSNorm(h_L) W_out                                  [B, T, V]
--
-- local Llama = require 'models.llama'
-- local m = Llama{preset = 'tiny', heads = 8, kv_heads = 2}
local uly = require 'ulysses'
local common = require 'models.common'
local nn = uly.nn

local Llama = nn.Module:extend('Llama')

-- SwiGLU width as in the paper: 2/3 of 4C, rounded up to a multiple of `multiple_of`
function Llama.hidden_for(C, multiple_of)
  multiple_of = multiple_of or 256
  local h = math.floor(2 * 4 * C / 3)
  return multiple_of * math.ceil(h / multiple_of)
end

Llama.presets = {
  tiny = { vocab = 256, layers = 2, heads = 4, kv_heads = 2, dim = 32, hidden = 96, seq = 64 },  -- for tests
  small = { vocab = 256, layers = 4, heads = 4, kv_heads = 2, dim = 256, hidden = 688, seq = 256 },
  dna = { vocab = 8, layers = 4, heads = 8, kv_heads = 2, dim = 256, hidden = 688, seq = 4096 },
  ['1b'] = { vocab = 128256, layers = 16, heads = 32, kv_heads = 8, dim = 2048, hidden = 8192, seq = 8192,
             rope_theta = 500000, tied = true },                      -- Llama 3.2 1B shape: 1.24 B
  ['7b'] = { vocab = 32000, layers = 32, heads = 32, kv_heads = 32, dim = 4096, hidden = 11008, seq = 4096 },
}
Llama.defaults = { rope_theta = 10000, eps = 1e-5, std = 0.02, tied = false, dropout = 0 }

function Llama:__init(cfg)
  cfg = common.config('Llama', Llama.presets, Llama.defaults, cfg)
  cfg.model = 'llama'
  cfg.kv_heads = cfg.kv_heads or cfg.heads
  cfg.hidden = cfg.hidden or Llama.hidden_for(cfg.dim)
  local raise = require('ulysses.tensor').raise
  if cfg.heads % cfg.kv_heads ~= 0 then
    raise(string.format('Llama: heads %d is not a multiple of kv_heads %d', cfg.heads, cfg.kv_heads))
  end
  if (cfg.dim / cfg.heads) % 2 ~= 0 then
    raise(string.format('Llama: the head dim (dim / heads = %d / %d = %d) must be even (RoPE rotates pairs of '
                        .. 'features): change dim or heads', cfg.dim, cfg.heads, cfg.dim / cfg.heads))
  end
  self.config = cfg
  local C, L = cfg.dim, cfg.layers
  self:add('tok_embeddings', nn.Embedding(cfg.vocab, C, { std = cfg.std }))
  local attend, grid = common.attention_for(cfg)
  self.grid = grid                                                      -- set under sequence parallelism
  local layers = nn.ModuleList()
  for _ = 1, L do
    layers:append(nn.Block(C, {
      heads = cfg.heads, kv_heads = cfg.kv_heads, norm = 'rmsnorm', mlp = 'swiglu', hidden = cfg.hidden,
      rope = true, rope_theta = cfg.rope_theta, bias = false, attend = attend, window = cfg.window,
      dropout = cfg.dropout, eps = cfg.eps, checkpoint = cfg.checkpoint, tile = cfg.tile, std = cfg.std, proj_std = cfg.std / math.sqrt(2 * L) }))
  end
  self:add('layers', layers)
  self:add('norm', nn.RMSNorm(C, { eps = cfg.eps }))
  if not cfg.tied then self:add('output', nn.Linear(C, cfg.vocab, { bias = false, std = cfg.std })) end
end

-- idx i32 [B, T] -> final hidden states [B, T, C]; ctx = { pos = global offset of idx's first
-- token, caches, seq_total, grad_sync = a dist.grad_sync marked at each layer's input, doc } as GPT's
function Llama:features(idx, ctx)
  local cfg = self.config
  local pos = common.check_input('Llama', idx, ctx, cfg.seq)
  local h = self.tok_embeddings(idx)                                       -- [B, T, C]
  local caches, sync = ctx and ctx.caches, ctx and ctx.grad_sync
  for l, layer in self.layers:named_children() do
    if sync then h = sync:mark(h, layer) end                              -- its grads start reducing
    h = layer(h, { pos = pos, cache = caches and caches[l], seq_total = ctx and ctx.seq_total,
                  doc = ctx and ctx.doc })
  end
  if sync then h = sync:mark(h, { self.norm, not cfg.tied and self.output or nil }) end
  return self.norm(h)                                                     -- [B, T, C]
end

-- the output head: h [.., C] -> logits [.., V]
function Llama:head(h)
  if self.config.tied then return h:matmul(self.tok_embeddings.weight:t()) end
  return self.output(h)
end

function Llama:forward(idx, ctx) return self:head(self:features(idx, ctx)) end

Llama.loss = common.loss

function Llama:matmul_parameters()
  local c = self.config
  local C, D = c.dim, c.dim / c.heads
  local per_layer = C * (c.heads + 2 * c.kv_heads) * D + C * C + 3 * C * c.hidden
  return c.layers * per_layer + c.vocab * C
end

function Llama:flops_per_token(T)
  return common.flops_per_token(self:matmul_parameters(), self.config.layers, self.config.dim, T or self.config.seq,
                                 self.config.window)
end

-- parameter count from a config alone (nothing allocated): for the large presets
function Llama.count_parameters(cfg)
  cfg = common.config('Llama', Llama.presets, Llama.defaults, cfg)
  local C, V, L, H = cfg.dim, cfg.vocab, cfg.layers, cfg.heads
  local Hkv, hid = cfg.kv_heads or H, cfg.hidden or Llama.hidden_for(C)
  local per_layer = 2 * C + C * (H + 2 * Hkv) * (C / H) + C * C + 3 * C * hid
  return V * C * (cfg.tied and 1 or 2) + L * per_layer + C
end

-- training FLOPs per token from a config alone
function Llama.config_flops_per_token(cfg, T)
  cfg = common.config('Llama', Llama.presets, Llama.defaults, cfg)
  local C, H = cfg.dim, cfg.heads
  local Hkv, hid = cfg.kv_heads or H, cfg.hidden or Llama.hidden_for(C)
  local n_mm = cfg.layers * (C * (H + 2 * Hkv) * (C / H) + C * C + 3 * C * hid) + cfg.vocab * C
  return common.flops_per_token(n_mm, cfg.layers, C, T or cfg.seq, cfg.window)
end

function Llama:generate(prompt, opts) return common.generate(self, prompt, opts) end

function Llama:extra_repr()
  local c = self.config
  return string.format("preset='%s', vocab=%d, layers=%d, heads=%d, kv_heads=%d, dim=%d, hidden=%d, seq=%d",
                       c.preset, c.vocab, c.layers, c.heads, c.kv_heads, c.dim, c.hidden, c.seq)
end

return Llama
