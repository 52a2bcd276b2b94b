-- lua/ulysses/grad_sync.lua — dist.grad_sync: the gradient all-reduce overlapped with backward.
--
--   local sync = uly.dist.grad_sync(model:parameters(), grid.world_group)
--   local loss = model:loss(x, y, { grad_sync = sync })   -- the model marks each layer's input
--   loss:backward()           -- each bucket starts reducing once its layers' gradients are final
--   sync:finish()             -- the rest; then every grad holds the sum over the group
--
-- During the forward the model calls sync:mark(x, module) on a layer's input (nn.on_backward).
-- When backward passes that point, everything computed from x has finished its backward, so
-- the gradients of the module's parameters are final: they are copied into a flat f32 buffer laid
-- out in the order backward finishes them (the last layer first), and every bucket of that buffer
-- whose parameters are all in starts its all-reduce (group:all_reduce_start_) while backward goes
-- on with the layers before. Buckets start strictly in order, so every rank starts the same
-- all-reduces in the same order. finish() copies in what no mark covered (embeddings, tied
-- weights, a parameter marked twice), starts the remaining buckets, waits for all of them and
-- copies the sums back into the grads (then multiplies by opts.scale, as all_reduce_grads).
-- The sums are those of dist.all_reduce_grads (per element; the bucketing differs).
-- The ranks must hold the same parameters (checked when the sync is made) and mark the same
-- layers in the same order (checked every step, as the layout follows the marks): otherwise
-- every rank raises the same error, and dist.all_reduce_grads is the way to sync such models.
--
-- With gradient accumulation pass grad_sync to the last micro-batch's forward only: the marks
-- of one forward are used by the next backward, and finish() starts over.
--
-- opt:grad_sync() of a dist.ZeroAdamW makes one whose buckets are the optimizer's: each complete
-- bucket starts a reduce-scatter into the optimizer's gradient shard (group:reduce_scatter_start)
-- instead of an all-reduce, and finish() leaves the reduced shard to the optimizer and the grads
-- to its stage (1: as backward made them; 2: freed when taken) (ZeRO's reduction overlapped with
-- backward).
local ffi = require 'ffi'
local T = require 'ulysses.tensor'
local C = require('ulysses.ffi').C
local raise = T.raise

local GradSync = {}
GradSync.__index = GradSync

local BUCKET_BYTES = 25 * 2 ^ 20

local M = {}

function M.new(dist, params, group, opts)
  opts = opts or {}
  if type(params) ~= 'table' or #params == 0 then raise('grad_sync: expected a non-empty list of parameters') end
  if getmetatable(group) ~= dist.Group then raise('grad_sync: the group must be a dist group (e.g. grid.world_group)') end
  local bucket_bytes = opts.bucket_bytes or BUCKET_BYTES
  if type(bucket_bytes) ~= 'number' or bucket_bytes < 4 then raise('grad_sync: bucket_bytes must be a number >= 4') end
  local index = {}
  for i, p in ipairs(params) do
    T.handle(p, 'grad_sync: parameter ' .. i)
    if index[p] then raise('grad_sync: parameter ' .. i .. ' is parameter ' .. index[p] .. ' again: list each once') end
    index[p] = i
  end
  local target = opts.target
  if target ~= nil and not (type(target) == 'table' and target.sharded and target._sync_plan) then
    raise('grad_sync: target must be a dist.ZeroAdamW (use opt:grad_sync())')
  end
  if not target then group:check_same_params('grad_sync', params) end   -- (ZeroAdamW checked its own)
  return setmetatable({ params = params, index = index, group = group, bucket_elems = math.floor(bucket_bytes / 4),
                        marks = {}, step = nil, plan = nil, last = nil, target = target }, GradSync)
end

-- the parameter indices of a module (anything with :parameters()), a tensor, or a list of those
local function indices(self, what)
  if type(what) ~= 'table' then raise('grad_sync:mark: expected a module, a parameter or a list of them') end
  local list = {}
  local function add(x)
    if T.is_tensor(x) then list[#list + 1] = x
    elseif type(x) == 'table' and x.parameters then
      for _, p in ipairs(x:parameters()) do list[#list + 1] = p end
    else raise('grad_sync:mark: expected a module, a parameter or a list of them, got ' .. tostring(x)) end
  end
  if T.is_tensor(what) or what.parameters then add(what) else for _, x in pairs(what) do add(x) end end
  local out = {}
  for _, p in ipairs(list) do
    local i = self.index[p]
    if not i then
      raise('grad_sync:mark: a parameter of the marked module (' .. tostring(p) .. ') is not among the '
            .. 'parameters the sync was made with')
    end
    out[#out + 1] = i
  end
  return out
end

-- x (a view) for the forward; when backward gets back to it, `what` (a module or a list of its
-- parameters) has its gradients final. Marks only while recording a graph that reaches x.
function GradSync:mark(x, what)
  local uly = require 'ulysses'
  if not uly.is_grad_enabled() or not x.requires_grad then return x end
  if self.step then raise('grad_sync:mark: a backward already started reducing; call finish() before the next forward') end
  local k = #self.marks + 1
  self.marks[k] = indices(self, what)
  return uly.nn.on_backward(x, function() self:_fired(k) end)
end

-- Every rank must lay the buffer out alike, or the all-reduces would sum different parameters'
-- gradients. A rank's marks may change from step to step (a layer skipped), so this is checked
-- every step (one small collective); on a mismatch every rank raises the same error.
local function agree(self, order)
  local ok, err = pcall(self.group.check_same, self.group,
                        'grad_sync: the layout of the gradient buffer (parameter numbers, in the order the '
                        .. 'layers this forward marked finish in backward)', order)
  if ok then return end
  err = tostring(err)
  if not err:find('differs between the ranks', 1, true) then error(err, 0) end
  self.marks = {}
  raise(err .. '. The ranks\' forward passes marked different layers, or the same ones in another order (a '
        .. 'layer skipped on some ranks, as stochastic depth does): run every layer on every rank (scale a '
        .. 'skipped layer\'s output by 0 instead), or leave grad_sync out of the forward and call '
        .. 'dist.all_reduce_grads after backward')
end

-- the flat layout for this forward's marks: the order backward finishes parameters in, then the rest
local function layout(self)
  local n, count = #self.params, {}
  for _, m in ipairs(self.marks) do for _, i in ipairs(m) do count[i] = (count[i] or 0) + 1 end end
  local order, owner = {}, {}
  for k = #self.marks, 1, -1 do
    for _, i in ipairs(self.marks[k]) do
      if count[i] == 1 then order[#order + 1] = i; owner[i] = k end
    end
  end
  for i = 1, n do if count[i] ~= 1 then order[#order + 1] = i end end
  if self.target then return self.target:_sync_plan(), owner end   -- a fixed layout: any marks agree
  agree(self, order)
  local signature = table.concat(order, ',')
  local plan = self.plan
  local device = self.params[1]:device()
  if plan and plan.signature == signature and plan.device == device then return plan, owner end
  local total = 0
  for _, i in ipairs(order) do total = total + self.params[i]:numel() end
  plan = { signature = signature, device = device, order = order, views = {}, span = {}, buckets = {} }
  plan.flat = T.empty({ math.max(total, 1) }, { dtype = 'f32', device = device })
  local E, off = self.bucket_elems, 0
  for _, i in ipairs(order) do
    local p = self.params[i]
    local len = p:numel()
    plan.views[i] = plan.flat:narrow(1, off + 1, len):view(p:shape())
    if len > 0 then plan.span[i] = { math.floor(off / E) + 1, math.floor((off + len - 1) / E) + 1 } end
    off = off + len
  end
  for start = 0, total - 1, E do
    local b = #plan.buckets + 1
    plan.buckets[b] = plan.flat:narrow(1, start + 1, math.min(E, total - start))
  end
  self.plan = plan
  return plan, owner
end

-- this step's state, on the first mark that fires (or at finish)
local function begin(self)
  local plan, owner = layout(self)
  local left = {}
  for b = 1, #plan.buckets do left[b] = 0 end
  for _, i in ipairs(plan.order) do
    local s = plan.span[i]
    if s then for b = s[1], s[2] do left[b] = left[b] + 1 end end
  end
  self.step = { plan = plan, owner = owner, left = left, next = 1, done = {}, fired = {}, copied = {},
                early = 0 }
end

-- parameter i's gradient is final: into the flat buffer; start the buckets now complete, in order
local function take(self, i, early)
  local st, p = self.step, self.params[i]
  if st.done[i] then return end
  st.done[i] = true
  if self.target then
    st.copied[i] = self.target:_take_grad(i)
  else
    local view, g = st.plan.views[i], p.grad
    if g then
      view:copy_(g)
      st.copied[i] = { g, g:version() }
    else
      view:zero_()
    end
  end
  local s = st.plan.span[i]
  if s then for b = s[1], s[2] do st.left[b] = st.left[b] - 1 end end
  local buckets = st.plan.buckets
  while st.next <= #buckets and st.left[st.next] == 0 do
    if self.target then self.target:_start_bucket(st.next) else self.group:all_reduce_start_(buckets[st.next], 'sum') end
    if early then st.early = st.early + 1 end
    st.next = st.next + 1
  end
end

function GradSync:_fired(k)
  if not self.step then
    if k ~= #self.marks then
      raise('grad_sync: the backward of an earlier forward reached its marks; pass grad_sync to one forward '
            .. 'per step (with gradient accumulation, the last micro-batch), then call finish()')
    end
    begin(self)
  end
  local st = self.step
  if st.fired[k] then raise('grad_sync: a layer was backpropagated twice in one step (retain_graph?); call finish() between') end
  st.fired[k] = true
  for _, i in ipairs(self.marks[k]) do
    if st.owner[i] == k then take(self, i, true) end
  end
  self.group:progress()   -- the buckets started earlier move on while this layer's backward ran
end

-- Finishes the step: the gradients no mark covered, the remaining buckets, the wait, and the
-- sums copied back into every parameter's grad (a parameter without one gets one); then
-- multiplies by opts.scale (e.g. 1 / dp_size). Returns { buckets, started_in_backward }.
function GradSync:finish(opts)
  opts = opts or {}
  if self.target and opts.scale then
    raise('grad_sync:finish: this sync reduces into a ZeroAdamW; give the scale as its grad_scale option')
  end
  if not self.step then begin(self) end
  local st = self.step
  local ok, err = pcall(function()
    for _, i in ipairs(st.plan.order) do take(self, i, false) end
    self.group:wait_all()
    for i, c in pairs(st.copied) do
      local p = self.params[i]
      local g = p.grad
      local changed
      if c == 'dropped' then changed = g ~= nil   -- (ZeroAdamW stage 2 dropped it when it was taken)
      else changed = not g or g._h ~= c[1]._h or c[1]:version() ~= c[2] end
      if changed then
        raise('grad_sync: the gradient of parameter ' .. i .. ' ' .. tostring(p) .. ' changed after its mark '
              .. 'fired (it is used outside the marked module, before it in the forward): leave it out of '
              .. 'that mark, or mark the module that uses it last')
      end
    end
  end)
  self.marks, self.step = {}, nil
  -- drop this step's references to the grads: a stale Lua stack slot or compiled trace may still
  -- hold st, and through it every grad (the next zero_grad would free nothing)
  st.copied, st.done = nil, nil
  if not ok then
    pcall(self.group.wait_all, self.group)   -- nothing left in flight over the buffer
    if self.target then self.target:_sync_failed() end
    error(err, 2)
  end
  local plan = st.plan
  if self.target then   -- the reduced shard stays with the optimizer; no grads are copied back
    self.target:_synced()
    self.last = { buckets = #plan.buckets, started_in_backward = st.early }
    return self.last
  end
  local handles = ffi.new('uly_tensor *[?]', #self.params)
  for i, p in ipairs(self.params) do
    local g = p.grad
    if g then g:copy_(plan.views[i]) else T.check(C.uly_tensor_set_grad(p._h, plan.views[i]:clone()._h)) end
    handles[i - 1] = p._h
  end
  local scale = opts.scale or 1
  if scale ~= 1 then T.check(C.uly_grad_scale_(handles, #self.params, scale)) end
  self.last = { buckets = #plan.buckets, started_in_backward = st.early }
  return self.last
end

M.GradSync = GradSync
return M
