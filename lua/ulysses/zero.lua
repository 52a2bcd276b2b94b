-- lua/ulysses/zero.lua — dist.ZeroAdamW: AdamW with its state sharded over a group of ranks
-- (ZeRO: each rank keeps and updates 1/G of the optimizer state; the gradients are
-- reduce-scattered to the rank that owns them and the updated parameters all-gathered back;
-- stage 2, the default, also frees each parameter's gradient once it is copied for the reduction,
-- so with opt:grad_sync() the gradients of layers backward has left do not add up).
--
--   local opt = uly.dist.ZeroAdamW(model:parameters(), grid.world_group, { lr = 3e-4, weight_decay = 0.1 })
--   opt:zero_grad()
--   loss:backward()                       -- this rank's own gradients: do NOT all-reduce them
--   local norm = opt:clip_grad_norm(1.0)  -- reduce-scatter, then the norm over every shard (optional)
--   opt.lr = schedule(step); opt:step()   -- AdamW on this rank's shard, then all-gather the parameters
--
-- or, with the reduction overlapped with backward (as dist.grad_sync does for all-reduces):
--   local sync = opt:grad_sync()          -- once
--   local loss = model:loss(x, y, { grad_sync = sync }); loss:backward(); sync:finish()
--   opt:clip_grad_norm(1.0); opt:step()
--
-- Made once, after model:to(device), by every rank of the group with the same parameters
-- (their dtypes and shapes, in order, are checked first): the parameters become views of one
-- flat f32 buffer (the same tensor objects, laid out last parameter first; their values broadcast from the group's
-- rank 0, so every rank starts alike). The buffer is cut into buckets of opts.bucket_bytes (default 64 MiB; each a multiple of
-- G elements, the last padded with zeros); rank r owns the r-th 1/G of every bucket. A step
-- copies each grad into a flat gradient buffer of the same layout (a parameter without a grad
-- counts zeros, as in dist.all_reduce_grads), reduce-scatters every bucket (one collective each,
-- the same bytes as an all-reduce's reduce half), multiplies by opts.grad_scale (e.g.
-- 1 / dp_size), runs the AdamW update of torch.optim.AdamW on the owned pieces only (the C step
-- of optim.AdamW, one call), and all-gathers every bucket in place into the parameters. Per
-- parameter element the arithmetic is that of optim.AdamW after dist.all_reduce_grads; only the
-- order of the sum over ranks may differ. exp_avg and exp_avg_sq take 8 bytes per element over G
-- (plus padding) instead of 8. opts.stage = 2 (default) leaves p.grad nil once the reduction has
-- taken it; opts.stage = 1 keeps this rank's unreduced gradient there.
--
-- state_dict() is collective (it gathers the shards) and gives optim.AdamW's format, kind
-- 'AdamW', so checkpoints move between ZeroAdamW at any group size and plain AdamW;
-- load_state_dict(sd) takes such a state and keeps this rank's pieces. For checkpoint.save on
-- one rank, every rank calls opt:consolidated() first and the saving rank passes its result as
-- optim. Every method that communicates must be called by every rank of the group in the same
-- order, as any collective.
local ffi = require 'ffi'
local T = require 'ulysses.tensor'
local C = require('ulysses.ffi').C
local raise, check = T.raise, T.check

local ZeroAdamW = {}
ZeroAdamW.__index = ZeroAdamW
ZeroAdamW.__tostring = function(o)
  return string.format('ZeroAdamW: %d parameters (%d elements), this rank owns %d of them over %s', #o.params,
                       o.layout.total, o.layout.owned, tostring(o.group))
end

local OPTS = { lr = true, betas = true, eps = true, weight_decay = true, bucket_bytes = true, grad_scale = true,
               stage = true }
local BUCKET_BYTES = 64 * 2 ^ 20
local handles_t = ffi.typeof('uly_tensor *[?]')
local doubles_t = ffi.typeof('double[?]')

local M = {}

local function U() return require 'ulysses' end

-- the flat layout: parameters back to back from 0, buckets of E (a multiple of G) elements, the
-- last padded to a multiple of G; rank r owns [start + r s, start + (r + 1) s) of each bucket
local function plan_layout(params, G, r, bucket_elems)
  local total = 0
  for _, p in ipairs(params) do total = total + p:numel() end
  local E = math.max(G, math.floor(bucket_elems / G) * G)
  local buckets, padded, owned = {}, 0, 0
  while padded < total do
    local size = math.min(E, math.ceil((total - padded) / G) * G)
    local s = size / G
    buckets[#buckets + 1] = { start = padded, size = size, slice = s, shard_off = owned, lo = padded + r * s }
    padded, owned = padded + size, owned + s
  end
  if total == 0 then raise('ZeroAdamW: the parameters have no elements') end
  return { total = total, padded = padded, owned = owned, buckets = buckets }
end

-- the flat order: the last parameter first, as backward finishes them (model:parameters() lists
-- the embeddings first), so opt:grad_sync() fills the buckets in order and starts them early
local function flat_order(params)
  local order = {}
  for k = 1, #params do order[k] = #params + 1 - k end
  return order
end

-- each parameter's offset in the flat buffer, and the pieces of parameters inside this rank's
-- slices: { param, param_off, flat_lo, shard_off, len }
local function plan_segments(params, order, layout)
  local segs, offsets = {}, {}
  local off = 0
  for _, i in ipairs(order) do offsets[i] = off; off = off + params[i]:numel() end
  local k = 1
  for _, b in ipairs(layout.buckets) do
    local lo, hi = b.lo, math.min(b.lo + b.slice, layout.total)
    while k <= #order and offsets[order[k]] + params[order[k]]:numel() <= lo do k = k + 1 end
    local j = k
    while j <= #order and offsets[order[j]] < hi do
      local i = order[j]
      local a, c = math.max(lo, offsets[i]), math.min(hi, offsets[i] + params[i]:numel())
      if c > a then
        segs[#segs + 1] = { param = i, param_off = a - offsets[i], flat_lo = a, shard_off = b.shard_off + (a - lo),
                            len = c - a }
      end
      j = j + 1
    end
  end
  return segs, offsets
end

function M.new(dist, params, group, opts)
  opts = opts or {}
  local what = 'ZeroAdamW'
  local optim = U().optim
  if getmetatable(group) ~= dist.Group then
    raise('ZeroAdamW: the second argument must be a dist group (e.g. grid.world_group: the ranks that hold the '
          .. 'same parameters), got ' .. tostring(group))
  end
  local h = optim._adamw_hyper(what, opts, OPTS)
  local bucket_bytes = opts.bucket_bytes or BUCKET_BYTES
  if type(bucket_bytes) ~= 'number' or not (bucket_bytes >= 4) or bucket_bytes == math.huge then
    raise('ZeroAdamW: bucket_bytes must be a number >= 4, got ' .. tostring(bucket_bytes))
  end
  local grad_scale = opts.grad_scale or 1
  if type(grad_scale) ~= 'number' or grad_scale ~= grad_scale or math.abs(grad_scale) == math.huge then
    raise('ZeroAdamW: grad_scale must be a finite number, got ' .. tostring(grad_scale))
  end
  local stage = opts.stage or 2
  if stage ~= 1 and stage ~= 2 then
    raise('ZeroAdamW: stage must be 1 (keep each rank\'s own p.grad) or 2 (free the grads once copied for the '
          .. 'reduction), got ' .. tostring(stage))
  end
  local list, wd = optim._adamw_params(what, params, h.weight_decay)
  local device = list[1]:device()
  for i, p in ipairs(list) do
    if p:device() ~= device then
      raise(string.format('ZeroAdamW: parameter %d is on %s but parameter 1 is on %s; move the whole model '
                          .. '(model:to(device)) before making the optimizer', i, p:device(), device))
    end
  end
  -- before anything changes: the flat buffer (broadcast from rank 0) must hold the same parameters everywhere
  group:check_same_params(what, list)
  local G, r = group:size(), group:rank()
  local layout = plan_layout(list, G, r, math.floor(bucket_bytes / 4))
  local self = setmetatable({
    kind = 'AdamW', name = what, sharded = true, group = group, device = device,
    lr = h.lr, betas = h.betas, eps = h.eps, weight_decay = h.weight_decay, grad_scale = grad_scale, stage = stage,
    step_count = 0, params = list, weight_decays = wd, layout = layout, _reduced = false,
  }, ZeroAdamW)
  local on = { dtype = 'f32', device = device }
  local pflat = T.empty({ layout.padded }, on):fill_(0)
  local gflat = T.empty({ layout.padded }, on):fill_(0)
  self._pflat, self._gflat = pflat, gflat
  -- the parameters become views of pflat (the same Lua objects, as model:to moves them)
  local order = flat_order(list)
  local segs, offsets = plan_segments(list, order, layout)
  self._order, self._offsets, self._gviews, self._handles = order, offsets, {}, {}
  U().no_grad(function()
    for i, p in ipairs(list) do
      local shape, n = p:shape(), p:numel()
      local v = pflat:narrow(1, offsets[i] + 1, n):view(shape)
      v:copy_(p)
      p:zero_grad(true)
      p._h = v:detach()._h
      p:requires_grad_(true)
      self._handles[i] = p._h
      self._gviews[i] = gflat:narrow(1, offsets[i] + 1, n):view(shape)
    end
  end)
  group:broadcast_(pflat, 0)
  -- this rank's shards of the gradient and the state, and the per-bucket views the collectives use
  local S = math.max(layout.owned, 1)
  self._gshard = T.empty({ S }, on):fill_(0)
  self._m, self._v = T.empty({ S }, on):fill_(0), T.empty({ S }, on):fill_(0)
  for _, b in ipairs(layout.buckets) do
    b.pbucket = pflat:narrow(1, b.start + 1, b.size)
    b.gbucket = gflat:narrow(1, b.start + 1, b.size)
    b.pslice = pflat:narrow(1, b.lo + 1, b.slice)
    b.gslice = self._gshard:narrow(1, b.shard_off + 1, b.slice)
  end
  -- one piece per (bucket, parameter) overlap: views of the parameter, its shard of the gradient
  -- (set as the piece's grad, so the C AdamW step reads it) and of the state
  local n = #segs
  self._segs = segs
  self._seg_p, self._seg_m, self._seg_v = handles_t(math.max(n, 1)), handles_t(math.max(n, 1)), handles_t(math.max(n, 1))
  self._seg_wd = doubles_t(math.max(n, 1))
  for k, s in ipairs(segs) do
    s.p = pflat:narrow(1, s.flat_lo + 1, s.len)
    s.g = self._gshard:narrow(1, s.shard_off + 1, s.len)
    s.m = self._m:narrow(1, s.shard_off + 1, s.len)
    s.v = self._v:narrow(1, s.shard_off + 1, s.len)
    check(C.uly_tensor_set_grad(s.p._h, s.g._h))
    self._seg_p[k - 1], self._seg_m[k - 1], self._seg_v[k - 1] = s.p._h, s.m._h, s.v._h
    self._seg_wd[k - 1] = wd[s.param]
  end
  return self
end

-- every parameter must still be the view made at construction
function ZeroAdamW:_check_params()
  for i, p in ipairs(self.params) do
    if p._h ~= self._handles[i] then
      raise(string.format('ZeroAdamW: parameter %d %s was moved or replaced (model:to, t:free) after the optimizer '
                          .. 'was made; its updates would be lost: make the optimizer after moving the model', i,
                          p._h ~= nil and tostring(p) or '(freed)'))
    end
  end
end

function ZeroAdamW:_lr()
  local lr = self.lr
  if type(lr) ~= 'number' or not (lr >= 0) or lr == math.huge then
    raise('ZeroAdamW: opt.lr must be a finite number >= 0, got ' .. tostring(lr))
  end
  return lr
end

-- set_to_none (default true) drops the parameters' grads; false fills them with zeros
function ZeroAdamW:zero_grad(set_to_none)
  local flag = (set_to_none == nil or set_to_none) and 1 or 0
  for _, p in ipairs(self.params) do
    if p._h ~= nil then check(C.uly_tensor_zero_grad(p._h, flag)) end
  end
  self._reduced = false
end

-- collective: this step's gradients summed over the group into this rank's shard (once a step;
-- a finished opt:grad_sync() did it already)
function ZeroAdamW:reduce_grads()
  if self._syncing then
    raise('ZeroAdamW: the gradient sync of this step is still reducing; call sync:finish() after backward, '
          .. 'before clip_grad_norm, grad_norm or step')
  end
  if self._reduced then return end
  self:_check_params()
  for i = 1, #self.params do self:_take_grad(i) end
  for _, b in ipairs(self.layout.buckets) do self.group:reduce_scatter_into(b.gbucket, b.gslice, 'sum') end
  if self.grad_scale ~= 1 and #self._segs > 0 then
    check(C.uly_grad_scale_(self._seg_p, #self._segs, self.grad_scale))
  end
  self._reduced = true
end

-- collective: the L2 norm of the reduced gradient (every shard)
function ZeroAdamW:grad_norm()
  self:reduce_grads()
  local sq = 0
  if #self._segs > 0 then
    local norm = C.uly_grad_norm(self._seg_p, #self._segs)
    if norm < 0 then raise(T.last_error()) end
    sq = norm * norm
  end
  local t = U().tensor({ sq }, { dtype = 'f64' })
  self.group:all_reduce_(t, 'sum')
  return math.sqrt(t:item())
end

-- collective: scales the reduced gradient by max_norm / (norm + 1e-6) when that is below 1 (as
-- optim.clip_grad_norm and PyTorch); returns the norm before clipping (NaN or inf: untouched)
function ZeroAdamW:clip_grad_norm(max_norm)
  if type(max_norm) ~= 'number' or not (max_norm >= 0) then
    raise('ZeroAdamW:clip_grad_norm: max_norm must be a number >= 0, got ' .. tostring(max_norm))
  end
  local norm = self:grad_norm()
  local coef = max_norm / (norm + 1e-6)
  if norm == norm and norm < math.huge and coef < 1 and #self._segs > 0 then
    check(C.uly_grad_scale_(self._seg_p, #self._segs, coef))
  end
  return norm
end

-- collective: reduces the gradients (unless clip/grad_norm did), updates this rank's shard, and
-- all-gathers the parameters
function ZeroAdamW:step()
  local lr = self:_lr()
  self:reduce_grads()
  local step = self.step_count + 1
  check(C.uly_adamw_step(self._seg_p, self._seg_m, self._seg_v, self._seg_wd, #self._segs, lr, self.betas[1],
                         self.betas[2], self.eps, step))
  for _, b in ipairs(self.layout.buckets) do self.group:all_gather_into(b.pslice, b.pbucket) end
  self.step_count = step
  self._reduced = false
end

-- parameter i's grad into its place in the flat gradient buffer (zeros when it has none); stage
-- 2 then drops the grad, through C (no Lua wrapper), so its memory is back in the pool at once.
-- Returns what grad_sync's finish checks: stage 1 the grad and its version, stage 2 'dropped'.
function ZeroAdamW:_take_grad(i)
  local p, view = self.params[i], self._gviews[i]
  local gh = C.uly_tensor_grad(p._h)
  if gh == nil then view:zero_(); return nil end
  local rc = C.uly_tensor_copy_(view._h, gh)
  C.uly_tensor_release(gh)
  check(rc)
  if self.stage == 2 then
    check(C.uly_tensor_zero_grad(p._h, 1))
    return 'dropped'
  end
  local g = p.grad
  return { g, g:version() }
end

-- A dist.grad_sync over this optimizer's buckets: pass it to the model's forward (ctx.grad_sync)
-- and call sync:finish() after backward; each bucket starts its reduce-scatter into this rank's
-- shard while backward goes on. Then clip_grad_norm / grad_norm / step use what it reduced.
function ZeroAdamW:grad_sync()
  return require('ulysses').dist.grad_sync(self.params, self.group, { target = self })
end

-- for grad_sync.lua: the flat layout as its plan (parameter order, a gradient view per parameter,
-- the buckets each parameter spans)
function ZeroAdamW:_sync_plan()
  if self._plan then return self._plan end
  local L, span = self.layout, {}
  for i, p in ipairs(self.params) do
    local n = p:numel()
    if n > 0 then
      local first, last
      for b, bk in ipairs(L.buckets) do
        if bk.start < self._offsets[i] + n and self._offsets[i] < bk.start + bk.size then
          first = first or b
          last = b
        end
      end
      span[i] = { first, last }
    end
  end
  local buckets = {}
  for b, bk in ipairs(L.buckets) do buckets[b] = bk.gbucket end
  self._plan = { order = self._order, views = self._gviews, span = span, buckets = buckets, device = self.device }
  return self._plan
end

function ZeroAdamW:_start_bucket(b)
  if not self._syncing then self:_check_params() end   -- once a step, before its first bucket
  self._syncing = true
  local bk = self.layout.buckets[b]
  self.group:reduce_scatter_start(bk.gbucket, bk.gslice, 'sum')
end

function ZeroAdamW:_synced()
  self._syncing = nil
  if self.grad_scale ~= 1 and #self._segs > 0 then
    check(C.uly_grad_scale_(self._seg_p, #self._segs, self.grad_scale))
  end
  self._reduced = true
end

function ZeroAdamW:_sync_failed() self._syncing, self._reduced = nil, false end

-- { total, padded, owned, buckets, pieces, state_bytes }: the layout and this rank's share
function ZeroAdamW:shard_info()
  local L = self.layout
  return { total = L.total, padded = L.padded, owned = L.owned, buckets = #L.buckets, pieces = #self._segs,
           state_bytes = 8 * L.owned }
end

function ZeroAdamW:_hyper()
  return { lr = self.lr, betas = { self.betas[1], self.betas[2] }, eps = self.eps, weight_decay = self.weight_decay }
end

-- a full-size flat copy of a shard (m or v), gathered bucket by bucket
function ZeroAdamW:_gather(shard)
  local full = T.empty({ self.layout.padded }, { dtype = 'f32', device = self.device })
  for _, b in ipairs(self.layout.buckets) do
    self.group:all_gather_into(shard:narrow(1, b.shard_off + 1, b.slice), full:narrow(1, b.start + 1, b.size))
  end
  return full
end

-- collective: optim.AdamW's state_dict (kind 'AdamW', a full tensor per parameter) gathered from
-- every shard; new tensors, on the parameters' device
function ZeroAdamW:state_dict()
  self:_check_params()
  local state = {}
  -- in a fixed order: pairs() may visit keys in another order on another rank
  for _, e in ipairs({ { 'exp_avg', self._m }, { 'exp_avg_sq', self._v } }) do
    local name, shard = e[1], e[2]
    local full, list = self:_gather(shard), {}
    for i, p in ipairs(self.params) do list[i] = full:narrow(1, self._offsets[i] + 1, p:numel()):view(p:shape()) end
    state[name] = list
  end
  return { kind = 'AdamW', step = self.step_count, hyper = self:_hyper(), state = state }
end

-- collective: a stand-in for checkpoint.save on one rank (params and the gathered state_dict)
function ZeroAdamW:consolidated()
  local sd = self:state_dict()
  return { kind = 'AdamW', params = self.params, state_dict = function() return sd end }
end

-- takes optim.AdamW's state (from any group size, or plain AdamW) and keeps this rank's pieces;
-- everything checked before anything changes; not collective
function ZeroAdamW:load_state_dict(sd)
  local what = 'ZeroAdamW:load_state_dict'
  if type(sd) ~= 'table' then raise(what .. ': expected a state_dict table, got ' .. type(sd)) end
  if sd.kind ~= 'AdamW' then raise(string.format('%s: the state is for %s, not AdamW', what, tostring(sd.kind))) end
  if type(sd.step) ~= 'number' or sd.step < 0 or sd.step ~= math.floor(sd.step) then
    raise(what .. ': step must be a non-negative integer, got ' .. tostring(sd.step))
  end
  if type(sd.state) ~= 'table' then raise(what .. ': the state_dict has no state table') end
  local lr = sd.hyper and sd.hyper.lr
  if lr ~= nil and (type(lr) ~= 'number' or not (lr >= 0)) then raise(what .. ': hyper.lr must be a number >= 0') end
  for _, name in ipairs({ 'exp_avg', 'exp_avg_sq' }) do
    local list = sd.state[name]
    if type(list) ~= 'table' then raise(string.format("%s: the state has no '%s' list", what, name)) end
    if #list ~= #self.params then
      raise(string.format('%s: %s has %d tensors but this optimizer has %d parameters', what, name, #list,
                          #self.params))
    end
    for i, t in ipairs(list) do
      if not T.is_tensor(t) or t._h == nil then raise(string.format('%s: %s[%d] is not a live tensor', what, name, i)) end
      local a, b = t:shape(), self.params[i]:shape()
      local same = #a == #b
      for d = 1, #a do same = same and a[d] == b[d] end
      if not same then
        raise(string.format('%s: %s[%d] has shape [%s] but parameter %d has shape [%s]', what, name, i,
                            table.concat(a, ', '), i, table.concat(b, ', ')))
      end
    end
  end
  for _, e in ipairs({ { 'exp_avg', 'm' }, { 'exp_avg_sq', 'v' } }) do
    local name, key = e[1], e[2]
    local list, flat = sd.state[name], {}
    for _, s in ipairs(self._segs) do
      local i = s.param
      flat[i] = flat[i] or list[i]:contiguous():view(-1):to(self.device)
      s[key]:copy_(flat[i]:narrow(1, s.param_off + 1, s.len))
    end
  end
  self.step_count = sd.step
  if lr ~= nil then self.lr = lr end
end

M.ZeroAdamW = ZeroAdamW
return M
