-- models/common.lua — what GPT and Llama share: config merging with presets and validation,
-- the loss, parameter/FLOP accounting and generation with a KV cache.
local uly = require 'ulysses'
local T = require 'ulysses.tensor'
local options = require 'ulysses.options'

local M = {}

-- the keys a model config may hold beyond its presets' and defaults': what common.attention_for
-- and the blocks read, and what a saved config carries (models/gpt.lua and llama.lua add theirs)
M.CONFIG_KEYS = { 'preset', 'model', 'vocab', 'layers', 'heads', 'dim', 'seq', 'hidden', 'dropout', 'eps', 'std',
                  'checkpoint', 'window', 'tile', 'sp', 'attention', 'attend' }

local function is_int(v) return type(v) == 'number' and v % 1 == 0 and v > -2 ^ 53 and v < 2 ^ 53 end
local function shown(v) return type(v) == 'string' and "'" .. v .. "'" or tostring(v) end

-- the ranges of a merged config's other values, each an error naming the key, the value and
-- what is allowed (where a block would otherwise fail at the first forward, or train on NaN)
local function check_values(name, cfg)
  local function bad(k, allowed)
    T.raise(string.format('%s: config.%s must be %s, got %s', name, k, allowed, shown(cfg[k])))
  end
  local function finite(v) return type(v) == 'number' and v > -math.huge and v < math.huge end
  for _, k in ipairs({ 'hidden', 'kv_heads' }) do
    if cfg[k] ~= nil and not (is_int(cfg[k]) and cfg[k] >= 1) then bad(k, 'a positive integer (or nil: the default)') end
  end
  if not (finite(cfg.dropout) and cfg.dropout >= 0 and cfg.dropout < 1) then bad('dropout', 'a probability in [0, 1)') end
  if not (finite(cfg.eps) and cfg.eps > 0) then bad('eps', 'a number > 0 (the norms divide by sqrt(mean + eps))') end
  for _, k in ipairs({ 'std', 'pos_std' }) do
    if cfg[k] ~= nil and not (finite(cfg[k]) and cfg[k] >= 0) then bad(k, 'a number >= 0 (an init standard deviation)') end
  end
  if cfg.rope_theta ~= nil and not (finite(cfg.rope_theta) and cfg.rope_theta > 0) then
    bad('rope_theta', 'a number > 0 (the RoPE base)')
  end
  if cfg.window ~= nil and not (is_int(cfg.window) and cfg.window >= 0) then
    bad('window', 'an integer >= 0 (keys each position sees before it), or nil for all')
  end
  if cfg.tile and not (is_int(cfg.tile) and cfg.tile >= 1) then
    bad('tile', 'a positive integer (positions per slice of the MLP and loss), or nil for no tiling')
  end
  if cfg.checkpoint ~= nil and type(cfg.checkpoint) ~= 'boolean' and cfg.checkpoint ~= 'except_attention' then
    bad('checkpoint', "true, false or 'except_attention'")
  end
  for _, k in ipairs({ 'bias', 'tied' }) do
    if cfg[k] ~= nil and type(cfg[k]) ~= 'boolean' then bad(k, 'true or false') end
  end
end

-- merge a preset (cfg.preset or 'tiny') with the caller's overrides; check required keys and
-- that every key given is one the model reads (`extra`: its own beyond CONFIG_KEYS)
function M.config(name, presets, defaults, cfg, extra)
  cfg = cfg or {}
  if type(cfg) ~= 'table' then T.raise(name .. ': expects a config table, e.g. ' .. name .. "{preset = 'tiny'}") end
  local allowed = {}
  for _, k in ipairs(M.CONFIG_KEYS) do allowed[#allowed + 1] = k end
  for _, k in ipairs(extra or {}) do allowed[#allowed + 1] = k end
  for k in pairs(defaults) do allowed[#allowed + 1] = k end
  for _, preset in pairs(presets) do
    for k in pairs(preset) do allowed[#allowed + 1] = k end
  end
  options.check(name, cfg, allowed)
  local preset_name = cfg.preset or 'tiny'
  local preset = presets[preset_name]
  if not preset then
    local names = {}
    for k in pairs(presets) do names[#names + 1] = k end
    table.sort(names)
    T.raise(string.format("%s: unknown preset '%s' (known: %s)", name, tostring(preset_name), table.concat(names, ', ')))
  end
  local out = {}
  for k, v in pairs(defaults) do out[k] = v end
  for k, v in pairs(preset) do out[k] = v end
  for k, v in pairs(cfg) do out[k] = v end
  out.preset = preset_name
  for _, k in ipairs({ 'vocab', 'layers', 'heads', 'dim', 'seq' }) do
    local v = out[k]
    if type(v) ~= 'number' or v < 1 or v % 1 ~= 0 then
      T.raise(string.format('%s: config.%s must be a positive integer, got %s', name, k, tostring(v)))
    end
  end
  if out.dim % out.heads ~= 0 then
    T.raise(string.format('%s: dim %d is not divisible by heads %d', name, out.dim, out.heads))
  end
  check_values(name, out)
  if out.checkpoint == 'except_attention' and out.attention == 'reference' and not out.attend then
    T.raise(string.format("%s: checkpoint = 'except_attention' keeps flash attention's outputs, and the reference "
                          .. "kernel has none to keep: use attention = 'flash', or checkpoint = true", name))
  end
  return out
end

-- a plain copy of the config without functions (for checkpoints and logs)
function M.plain_config(cfg)
  local out = {}
  for k, v in pairs(cfg) do
    if type(v) ~= 'function' and type(v) ~= 'userdata' and type(v) ~= 'cdata' then out[k] = v end
  end
  return out
end

-- the keys of a forward pass's ctx (features, forward), and of loss's options: ctx's and its own
local CTX_KEYS = { 'pos', 'seq_total', 'doc', 'caches', 'grad_sync' }
local LOSS_KEYS = { 'pos', 'seq_total', 'doc', 'caches', 'grad_sync', 'ignore_index', 'reduction' }
M.CTX_KEYS, M.LOSS_KEYS = CTX_KEYS, LOSS_KEYS

-- check token ids [B, T] (i32/i64) and the context `ctx` (its keys, a subset of `allowed`, default
-- CTX_KEYS; pos and seq_total against T and the context length seq); returns pos (0 when unset)
function M.check_input(name, idx, ctx, seq, allowed)
  ctx = options.check(name, ctx, allowed or CTX_KEYS)
  if not uly.is_tensor(idx) or idx:dim() ~= 2 then
    T.raise(string.format('%s: expects token ids of shape [B, T], got %s', name,
                        uly.is_tensor(idx) and idx:describe() or type(idx)))
  end
  local dt = idx:dtype()
  if dt ~= 'i32' and dt ~= 'i64' then
    T.raise(string.format('%s: token ids must be i32 or i64, got %s', name, idx:describe()))
  end
  local pos, n = ctx.pos or 0, idx:size(2)
  if not (is_int(pos) and pos >= 0) then
    T.raise(string.format("%s: pos (the position of the first token) must be an integer >= 0, got %s", name, shown(pos)))
  end
  if pos + n > seq then
    T.raise(string.format('%s: positions %d..%d exceed the context length seq = %d', name, pos, pos + n - 1, seq))
  end
  local N = ctx.seq_total
  if N ~= nil and not (is_int(N) and N >= pos + n and N <= seq) then
    T.raise(string.format('%s: seq_total (the whole sequence\'s length, of which these %d tokens start at pos = %d) '
                          .. 'must be an integer in %d..%d (up to the context length seq), got %s', name, n, pos,
                          pos + n, seq, shown(N)))
  end
  return pos
end

-- the attention a config asks for: cfg.attend, else cfg.attention = 'flash' (default: the
-- memory-efficient kernel, which also does config.window and document masks) or 'reference', wrapped in
-- nn.DistributedAttention over the sequence-parallel group when cfg.sp is set
function M.attention_for(cfg)
  local attend = cfg.attend
  if not attend then
    local kind = cfg.attention or 'flash'
    attend = kind == 'flash' and uly.nn.flash_attend or kind == 'reference' and uly.nn.reference_attend or nil
    if not attend then
      T.raise(string.format("config.attention must be 'flash' or 'reference' (or pass config.attend), got %s", tostring(kind)))
    end
  end
  if not cfg.sp then return attend, nil end
  if type(cfg.sp) ~= 'number' or cfg.sp < 1 or cfg.sp % 1 ~= 0 then
    T.raise('config.sp must be a positive integer (ranks per sequence-parallel group), got ' .. tostring(cfg.sp))
  end
  local grid = uly.dist.init { sp = cfg.sp }
  if cfg.sp == 1 then return attend, grid end   -- data parallelism only: attention stays local
  return uly.nn.DistributedAttention(attend, grid.sp_group), grid
end

-- number of targets that are not ignore_index
local function count_valid(targets, ignore_index)
  local t = targets:contiguous():to { dtype = 'i64', device = 'cpu' }
  local p, n, valid = t:data(), t:numel(), 0
  for i = 0, n - 1 do if p[i] ~= ignore_index then valid = valid + 1 end end
  return valid
end

-- Cross-entropy of logits [B, T, V] against targets [B, T] (ignore_index masked), the mean over
-- the valid targets. Under sequence/data parallelism (the model has a grid) every rank returns
-- its share: the sum over its own targets divided by the count over ALL ranks, so the shares
-- add up to the global token-weighted mean and the gradients need one SUM all-reduce over the
-- world (uly.dist.all_reduce_grads). A rank whose targets are all ignored contributes 0, never NaN.
-- With config.tile the vocabulary projection and the cross-entropy run over slices of `tile`
-- positions (nn.chunked), so the logits of the whole sequence never exist at once. opts: ignore_index
-- (-1), reduction (cross_entropy's) and the forward pass's ctx (pos, seq_total, doc, caches,
-- grad_sync: models/gpt.lua's features); a misspelled key is an error.
function M.loss(model, idx, targets, opts)
  opts = opts or {}
  M.check_input(model.__name .. ':loss', idx, opts, model.config.seq, LOSS_KEYS)
  local ctx = { pos = opts.pos, seq_total = opts.seq_total, doc = opts.doc, caches = opts.caches, grad_sync = opts.grad_sync }
  local ignore = opts.ignore_index or -1
  local grid = model.grid
  local tile = model.config.tile
  local distributed = grid and grid.world > 1
  if not tile or tile >= idx:size(2) or opts.reduction then
    local logits = model:forward(idx, ctx)
    if not distributed or opts.reduction then
      return uly.cross_entropy(logits, targets, { ignore_index = ignore, reduction = opts.reduction })
    end
    local total = uly.tensor({ count_valid(targets, ignore) }, { dtype = 'f64', device = 'cpu' })
    grid.world_group:all_reduce_(total, 'sum')
    return uly.cross_entropy(logits, targets, { ignore_index = ignore, reduction = 'sum' }) * (1 / math.max(total:item(), 1))
  end
  local h = model:features(idx, ctx)                                     -- [B, T, C]
  local sum = uly.nn.chunked(function(hs, ts)
    return uly.cross_entropy(model:head(hs), ts, { ignore_index = ignore, reduction = 'sum' })
  end, h, { dim = 2, size = tile, with = { targets }, reduce = 'sum' })
  local count = count_valid(targets, ignore)
  if distributed then
    local total = uly.tensor({ count }, { dtype = 'f64', device = 'cpu' })
    grid.world_group:all_reduce_(total, 'sum')
    count = total:item()
  end
  return sum * (1 / math.max(count, 1))
end

-- the global loss value from each rank's share (one small all-reduce; the share itself if alone)
function M.global_loss(model, loss)
  local v = type(loss) == 'number' and loss or loss:item()
  local grid = model.grid
  if not grid or grid.world == 1 then return v end
  local t = uly.tensor({ v }, { dtype = 'f64', device = 'cpu' })
  grid.world_group:all_reduce_(t, 'sum')
  return t:item()
end

-- Model FLOPs per token for training (forward + backward = 3x forward), the convention of
-- ../shared/ENVIRONMENT.md: 6 * N_matmul + 12 * L * C_attn * T, with the attention term
-- counted over the full T x T (a causal kernel skipping the masked half does half of it).
-- With a sliding window of W keys each query sees at most W + 1 keys: the term uses min(T, W + 1).
-- Recomputation for activation checkpointing is not counted (model FLOPs, not hardware FLOPs).
function M.flops_per_token(n_matmul, layers, attn_dim, T, window)
  local keys = window and math.min(T, window + 1) or T
  return 6 * n_matmul + 12 * layers * attn_dim * keys
end

-- sample one token id from logits (a Lua list of V numbers) with temperature and top-k
local function sample_from(logits, temperature, top_k, u)
  local V = #logits
  if temperature <= 0 then -- greedy
    local best = 1
    for i = 2, V do if logits[i] > logits[best] then best = i end end
    return best - 1
  end
  local idx = {}
  for i = 1, V do idx[i] = i end
  if top_k and top_k > 0 and top_k < V then
    table.sort(idx, function(a, b) return logits[a] > logits[b] end)
    for i = top_k + 1, V do idx[i] = nil end
  end
  local m = -math.huge
  for _, i in ipairs(idx) do if logits[i] > m then m = logits[i] end end
  local w, total = {}, 0
  for j, i in ipairs(idx) do
    w[j] = math.exp((logits[i] - m) / temperature)
    total = total + w[j]
  end
  local r, acc = u * total, 0
  for j, i in ipairs(idx) do
    acc = acc + w[j]
    if r < acc then return i - 1 end
  end
  return idx[#idx] - 1
end
M.sample_from = sample_from

-- generate(model, prompt i32 [1, P], {max_new_tokens = 100, temperature = 1, top_k = 0,
-- cache = true, cache_dtype, slide = false, on_token = fn, samples = nil}) -> list of new token ids
-- (each also given to on_token(tok, row) as it comes: to print a long generation as it goes).
-- samples = B: B continuations of the prompt sampled side by side in one batch (each row its own
-- draws, in row order per step), returned as a list of B lists. With the KV cache each new
-- token runs the model on one position: O(T) attention per token. cache = false recomputes the
-- whole prefix (O(T^2); kept for checking the cache). A prompt and new tokens beyond the context
-- length config.seq are an error, unless slide = true: then whenever the context is full the model
-- starts again on its last seq/2 tokens (a prompt longer than the context is cut to its last
-- seq/2 tokens likewise), so any number of tokens can be generated, each seeing at least seq/2
-- before it. Uses the global generator (uly.manual_seed): one uniform draw per token.
function M.generate(model, prompt, opts)
  opts = options.check('generate', opts, { 'max_new_tokens', 'temperature', 'top_k', 'cache', 'cache_dtype', 'slide',
                                            'on_token', 'samples' })
  local n_new = opts.max_new_tokens or 100
  local temperature = opts.temperature or 1.0
  local cfg = model.config
  if not uly.is_tensor(prompt) or prompt:dim() ~= 2 or prompt:size(1) ~= 1 or prompt:size(2) < 1 then
    T.raise('generate: the prompt must be token ids of shape [1, P] with P >= 1, got '
            .. (uly.is_tensor(prompt) and prompt:describe() or type(prompt)))
  end
  if type(n_new) ~= 'number' or n_new ~= math.floor(n_new) or n_new < 0 then
    T.raise('generate: max_new_tokens must be an integer >= 0, got ' .. tostring(n_new))
  end
  if type(temperature) ~= 'number' or not (temperature >= 0) or temperature == math.huge then
    T.raise('generate: temperature must be a finite number >= 0 (0 = greedy), got ' .. tostring(temperature))
  end
  local top_k = opts.top_k
  if top_k ~= nil and (type(top_k) ~= 'number' or top_k ~= math.floor(top_k) or top_k < 0) then
    T.raise('generate: top_k must be an integer >= 0 (0 = all tokens), got ' .. tostring(top_k))
  end
  local samples = opts.samples
  if samples ~= nil and (type(samples) ~= 'number' or samples ~= math.floor(samples) or samples < 1) then
    T.raise('generate: samples must be an integer >= 1, got ' .. tostring(samples))
  end
  if opts.on_token ~= nil and type(opts.on_token) ~= 'function' then
    T.raise('generate: on_token must be a function (called with each new token id), got ' .. type(opts.on_token))
  end
  if opts.slide ~= nil and type(opts.slide) ~= 'boolean' then
    T.raise('generate: slide must be true or false, got ' .. tostring(opts.slide))
  end
  local P = prompt:size(2)
  if opts.slide and cfg.seq < 2 and n_new > 0 then
    T.raise('generate: slide = true needs a context length (config.seq) of 2 or more, got ' .. cfg.seq)
  end
  if P + n_new > cfg.seq and not opts.slide then
    T.raise(string.format('generate: prompt %d + %d new tokens exceed the context length %d (slide = true '
                          .. 'continues past it on the last %d tokens)', P, n_new, cfg.seq, math.max(1, math.floor(cfg.seq / 2))))
  end
  local was_training = model.training
  model:eval()
  -- a sequence-parallel model generates on one rank: its attention runs locally meanwhile
  local swapped = {}
  local function unshard(m)
    if type(m.attend) == 'table' and m.attend.local_attend then
      swapped[#swapped + 1] = { m, m.attend }
      m.attend = m.attend.local_attend
    end
    for _, c in m:named_children() do unshard(c) end
  end
  unshard(model)
  local B = samples or 1
  local outs = {}   -- outs[b]: row b's new tokens
  for b = 1, B do outs[b] = {} end
  local device = model:parameters()[1]:device()
  local Hkv, D = cfg.kv_heads or cfg.heads, cfg.dim / cfg.heads
  -- bf16 on the GPU in bf16 precision: half the memory, read in place (the same numbers)
  local cache_dtype = opts.cache_dtype or ((device ~= 'cpu' and uly.matmul_precision() == 'bf16') and 'bf16' or 'f32')
  -- n tokens after the contexts ctx[b] (lists of one length), appended to outs[b] and ctx[b]
  local function run(ctx, n)
    local caches
    if opts.cache ~= false then
      caches = {}
      for l = 1, cfg.layers do
        caches[l] = uly.nn.KVCache(B, #ctx[1] + n, Hkv, D, { dtype = cache_dtype, device = device })
      end
    end
    local next_input, pos = uly.tensor(ctx, { dtype = 'i32', device = device }), 0
    for _ = 1, n do
      local logits
      if caches then
        logits = model:forward(next_input, { pos = pos, caches = caches })
        pos = pos + next_input:size(2)
      else
        logits = model:forward(uly.tensor(ctx, { dtype = 'i32', device = device }))
      end
      local u = uly.rand(B):totable()   -- one draw per row, in row order
      local last, new = logits:select(2, logits:size(2)):totable(), {}
      for b = 1, B do
        local tok = sample_from(last[b], temperature, opts.top_k, u[b])
        outs[b][#outs[b] + 1], ctx[b][#ctx[b] + 1], new[b] = tok, tok, { tok }
        if opts.on_token then opts.on_token(tok, b) end
      end
      next_input = uly.tensor(new, { dtype = 'i32', device = device })
    end
  end
  -- whatever happens below, the model leaves as it came (training mode, sharded attention)
  local ok, err = pcall(uly.no_grad, function()
    local first = prompt:to { dtype = 'i32', device = 'cpu' }:contiguous():totable()[1]
    local keep = math.floor(cfg.seq / 2)
    local function last_keep(ids)
      local t = {}
      for i = #ids - keep + 1, #ids do t[#t + 1] = ids[i] end
      return t
    end
    if #first >= cfg.seq then first = last_keep(first) end   -- (only with slide)
    local ctx = {}
    for b = 1, B do
      ctx[b] = {}
      for i, t in ipairs(first) do ctx[b][i] = t end
    end
    while #outs[1] < n_new do
      run(ctx, math.min(n_new - #outs[1], cfg.seq - #ctx[1]))
      if #outs[1] < n_new then for b = 1, B do ctx[b] = last_keep(ctx[b]) end end
    end
  end)
  for _, e in ipairs(swapped) do e[1].attend = e[2] end
  model:train(was_training)
  if not ok then error(err, 0) end
  return opts.samples and outs or outs[1]
end

return M
