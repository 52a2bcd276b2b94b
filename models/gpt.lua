-- models/gpt.lua — GPT-2 (Radford et al., 2019): learned positions, pre-LayerNorm blocks,
-- GELU MLP, tied input/output embeddings.
--
--   h_0 = W_te[x] + W_pe[pos]                              [B, T, C]
--   h_l = h_{l-1} + Attn(LN(h_{l-1}));  h_l += MLP(LN(h_l))  l = 1..L
--   logits = LN_f(h_L) W_te^T                               [B, T, V]
--
-- local GPT = require 'models.gpt'
-- local model = GPT{preset = 'small', vocab = 256, seq = 1024}   -- any key overrides the preset
-- local loss = model:loss(x, y)        -- x, y i32 [B, T]; targets -1 are ignored
local uly = require 'ulysses'
local common = require 'models.common'
local nn = uly.nn

local GPT = nn.Module:extend('GPT')

GPT.presets = {
  tiny = { vocab = 256, layers = 2, heads = 2, dim = 32, seq = 64 },          -- for tests
  small = { vocab = 256, layers = 4, heads = 4, dim = 256, seq = 256 },       -- byte-level, CPU minutes
  base = { vocab = 256, layers = 6, heads = 6, dim = 384, seq = 256 },
  gpt2 = { vocab = 50257, layers = 12, heads = 12, dim = 768, seq = 1024 },   -- 124 M
  ['gpt2-medium'] = { vocab = 50257, layers = 24, heads = 16, dim = 1024, seq = 1024 }, -- 350 M
  ['gpt2-large'] = { vocab = 50257, layers = 36, heads = 20, dim = 1280, seq = 1024 },  -- 774 M
  ['gpt2-xl'] = { vocab = 50257, layers = 48, heads = 25, dim = 1600, seq = 1024 },     -- 1.56 B
}
GPT.defaults = { dropout = 0, bias = true, std = 0.02, pos_std = 0.01, eps = 1e-5 }

function GPT:__init(cfg)
  cfg = common.config('GPT', GPT.presets, GPT.defaults, cfg)
  cfg.model = 'gpt'
  self.config = cfg
  local C, L = cfg.dim, cfg.layers
  self:add('wte', nn.Embedding(cfg.vocab, C, { std = cfg.std }))          -- [V, C], also the output head
  self:add('wpe', nn.Embedding(cfg.seq, C, { std = cfg.pos_std }))        -- [seq, C]
  local attend, grid = common.attention_for(cfg)
  self.grid = grid                                                      -- set under sequence parallelism
  local blocks = nn.ModuleList()
  for _ = 1, L do
    blocks:append(nn.Block(C, {
      heads = cfg.heads, norm = 'layernorm', mlp = 'gelu', hidden = cfg.hidden or 4 * C,
      bias = cfg.bias, attend = attend, window = cfg.window, dropout = cfg.dropout, eps = cfg.eps, checkpoint = cfg.checkpoint, tile = cfg.tile,
      std = cfg.std, proj_std = cfg.std / math.sqrt(2 * L) }))              -- GPT-2: residual init / sqrt(2L)
  end
  self:add('blocks', blocks)
  self:add('ln_f', nn.LayerNorm(C, { eps = cfg.eps }))
end

-- idx i32 [B, T] -> final hidden states [B, T, C]; ctx = { pos = offset of idx's first token,
-- caches = per-layer nn.KVCache, seq_total = the whole sequence under sequence parallelism,
-- grad_sync = a dist.grad_sync marked at each block's input, doc = document ids [B, T] (of the
-- whole sequence under sequence parallelism) }; another key is an error (common.check_input)
function GPT:features(idx, ctx)
  local cfg = self.config
  local pos = common.check_input('GPT', idx, ctx, cfg.seq)
  local T = idx:size(2)
  local h = self.wte(idx) + self.wpe.weight:narrow(1, pos + 1, T)         -- [B, T, C]
  if self.training and cfg.dropout > 0 then h = h:dropout(cfg.dropout, true) end
  local caches, sync = ctx and ctx.caches, ctx and ctx.grad_sync
  for l, block in self.blocks:named_children() do
    if sync then h = sync:mark(h, block) end                              -- its grads start reducing
    h = block(h, { pos = pos, cache = caches and caches[l], seq_total = ctx and ctx.seq_total,
                  doc = ctx and ctx.doc })
  end
  if sync then h = sync:mark(h, self.ln_f) end                           -- wte is tied: reduced at finish
  return self.ln_f(h)                                                     -- [B, T, C]
end

-- the output head: h [.., C] -> logits [.., V] (tied: the token embedding transposed)
function GPT:head(h) return h:matmul(self.wte.weight:t()) end

function GPT:forward(idx, ctx) return self:head(self:features(idx, ctx)) end

GPT.loss = common.loss

-- parameters in matmuls (per token, forward: 2 FLOPs each): blocks + the tied output head
function GPT:matmul_parameters()
  local C, L, hid = self.config.dim, self.config.layers, self.config.hidden or 4 * self.config.dim
  return L * (C * 3 * C + C * C + 2 * C * hid) + self.config.vocab * C
end

-- training FLOPs per token at sequence length T (default: config.seq); see models/common.lua
function GPT:flops_per_token(T)
  return common.flops_per_token(self:matmul_parameters(), self.config.layers, self.config.dim, T or self.config.seq,
                                 self.config.window)
end

-- parameter count from a config alone (nothing allocated): for the large presets
function GPT.count_parameters(cfg)
  cfg = common.config('GPT', GPT.presets, GPT.defaults, cfg)
  local C, V, L, hid = cfg.dim, cfg.vocab, cfg.layers, cfg.hidden or 4 * cfg.dim
  local b = cfg.bias and 1 or 0
  local per_block = 2 * 2 * C + (3 * C * C + b * 3 * C) + (C * C + b * C) + (C * hid + b * hid) + (hid * C + b * C)
  return V * C + cfg.seq * C + L * per_block + 2 * C
end

function GPT:generate(prompt, opts) return common.generate(self, prompt, opts) end

function GPT:extra_repr()
  local c = self.config
  return string.format("preset='%s', vocab=%d, layers=%d, heads=%d, dim=%d, seq=%d", c.preset, c.vocab,
                       c.layers, c.heads, c.dim, c.seq)
end

return GPT
