-- lua/ulysses/optim.lua — optimizers, gradient norms and learning-rate schedules:
-- `local optim = require('ulysses').optim`.
--
--   optim.AdamW(params, {lr = 3e-4, betas = {0.9, 0.95}, eps = 1e-8, weight_decay = 0.1})
--   optim.SGD(params, {lr = 1e-3, momentum = 0, dampening = 0, weight_decay = 0, nesterov = false})
--   opt:step(); opt:zero_grad(set_to_none = true); opt.lr = x; opt.step_count; opt.params; opt.param_steps
--   opt:state_dict(); opt:load_state_dict(sd); opt:grad_norm(); opt:clip_grad_norm(max_norm)
--   optim.grad_norm(params); optim.clip_grad_norm(params, max_norm)
--   optim.schedule.cosine{lr =, warmup =, steps =, min_lr =}; .constant{lr =, warmup =}; .from_opts(o)
--
-- `params` is a list of tensors (model:parameters(), or the module itself) or a list of groups
-- { {params = {...}, weight_decay = 0}, ... }. AdamW decays only tensors with 2 or more dims
-- (weights, embeddings; not norms and biases) unless a group sets weight_decay; SGD, like
-- PyTorch, decays every tensor unless a group says otherwise. The updates are those of
-- torch.optim.AdamW / torch.optim.SGD, run in C (core/optim.c) over every parameter in one call.
-- As in PyTorch, a step skips the parameters without a grad, and each parameter counts its own
-- steps (opt.param_steps[i]; opt.step_count counts calls of opt:step()): one that first gets a
-- grad late starts AdamW's bias correction and SGD's momentum buffer on its own first update.
--
-- Gradient accumulation needs nothing from the optimizer: backward ADDS into .grad, so
--   opt:zero_grad()
--   for micro = 1, micro_steps do
--     local loss = model:loss(x[micro], y[micro]) / micro_steps   -- mean over the whole batch
--     loss:backward()
--   end
--   optim.clip_grad_norm(opt.params, 1.0)                         -- optional
--   opt.lr = schedule(step); opt:step()
local ffi = require 'ffi'
local lib = require 'ulysses.ffi'
local T = require 'ulysses.tensor'
local C = lib.C
local raise, check, is_tensor = T.raise, T.check, T.is_tensor

local optim = { schedule = {} }

local handles_t = ffi.typeof('uly_tensor *[?]')
local doubles_t = ffi.typeof('double[?]')

---------------------------------------------------------------- helpers
local function fmt_shape(s) return '[' .. table.concat(s, ', ') .. ']' end
local function desc(t) return t:dtype() .. fmt_shape(t:shape()) end

local function same_shape(a, b)
  if #a ~= #b then return false end
  for i = 1, #a do if a[i] ~= b[i] then return false end end
  return true
end

local function is_int(x) return type(x) == 'number' and x == math.floor(x) and x == x end

-- a number option in [lo, hi] (hi may be nil), or its default
local function num_opt(what, opts, key, default, lo, hi)
  local v = opts[key]
  if v == nil then return default end
  if type(v) ~= 'number' or v ~= v or v < lo or (hi and v > hi) then
    raise(string.format('%s: %s must be a number in [%g, %s], got %s', what, key, lo, hi and ('%g'):format(hi) or 'inf',
                        tostring(v)))
  end
  return v
end

local function check_keys(what, opts, allowed)
  if type(opts) ~= 'table' then raise(what .. ': options must be a table, got ' .. type(opts)) end
  for k in pairs(opts) do
    if not allowed[k] then
      local names = {}
      for a in pairs(allowed) do names[#names + 1] = a end
      table.sort(names)
      raise(string.format("%s: unknown option '%s' (known: %s)", what, tostring(k), table.concat(names, ', ')))
    end
  end
end

-- a list of tensors from: a module (:parameters()), a single tensor, or a list
local function tensor_list(what, params)
  if is_tensor(params) then return { params } end
  if type(params) ~= 'table' then raise(what .. ': expected a list of tensors, got ' .. type(params)) end
  if getmetatable(params) and type(params.parameters) == 'function' then return params:parameters() end
  return params
end

-- one parameter the optimizer can update in place: an f32, contiguous CPU leaf
local function check_param(what, t, i)
  if not is_tensor(t) then raise(string.format('%s: parameter %d is a %s, not a tensor', what, i, type(t))) end
  if t._h == nil then raise(string.format('%s: parameter %d was freed (t:free())', what, i)) end
  if t:dtype() ~= 'f32' then
    raise(string.format('%s: parameter %d is %s; optimizers update f32 tensors (convert with :float())',
                        what, i, desc(t)))
  end
  if not t:is_contiguous() then
    raise(string.format('%s: parameter %d (%s) is not contiguous; pass the contiguous leaf itself', what, i, desc(t)))
  end
  if not t:is_leaf() then
    raise(string.format('%s: parameter %d (%s) is not a leaf (computed by %s); pass the leaf tensor or a :detach()ed copy',
                        what, i, desc(t), tostring(t.grad_fn)))
  end
end

--[[ Flatten params (tensors or groups) into a list of tensors and a parallel list of weight
  decays. default_wd(t) gives a tensor's decay when its group does not set one. ]]
local function collect(what, params, group_keys, default_wd)
  params = tensor_list(what, params)
  local groups
  if params[1] ~= nil and not is_tensor(params[1]) and type(params[1]) == 'table' and params[1].params ~= nil then
    groups = params
  else
    groups = { { params = params } }
  end
  local list, wd, seen = {}, {}, {}
  for g, group in ipairs(groups) do
    if type(group) ~= 'table' or is_tensor(group) or group.params == nil then
      raise(string.format('%s: group %d must be a table {params = {...}, ...}; mixing tensors and groups is not allowed',
                          what, g))
    end
    check_keys(string.format('%s group %d', what, g), group, group_keys)
    local gwd = group.weight_decay
    if gwd ~= nil and (type(gwd) ~= 'number' or not (gwd >= 0) or gwd == math.huge) then
      raise(string.format('%s: group %d: weight_decay must be a finite number >= 0, got %s', what, g, tostring(gwd)))
    end
    for _, t in ipairs(tensor_list(what, group.params)) do
      local i = #list + 1
      check_param(what, t, i)
      local key = tostring(ffi.cast('uintptr_t', t._h))
      if seen[key] then
        raise(string.format('%s: parameter %d is the same tensor as parameter %d; list each parameter once', what, i,
                            seen[key]))
      end
      seen[key] = i
      list[i] = t
      wd[i] = gwd or default_wd(t)
    end
  end
  if #list == 0 then raise(what .. ': got an empty parameter list') end
  return list, wd
end

local function zeros_like(t)
  return T.empty(t:shape(), { device = t:device() }):fill_(0)
end

local function zero_steps(list)
  local steps = {}
  for i = 1, #list do steps[i] = 0 end
  return steps
end

local function handle_array(list)
  local arr = handles_t(math.max(#list, 1))
  for i, t in ipairs(list) do arr[i - 1] = t._h end
  return arr
end

---------------------------------------------------------------- the shared optimizer base
local Optimizer = {}
Optimizer.__index = Optimizer

-- the cached handle arrays must still match live tensors: a freed one (t:free()) is an error, a
-- moved one (model:to(device) swaps the handle in place) is picked up again; the C step then
-- checks that each parameter's state lives on its device
function Optimizer:_check_handles()
  for name, list in pairs(self._lists) do
    local arr = self._arrays[name]
    for i = 1, #list do
      local h = list[i]._h
      if h == nil then
        raise(string.format('%s: %s %d was freed (t:free()); the optimizer cannot use it', self.kind,
                            name == 'params' and 'parameter' or name, i))
      end
      if h ~= arr[i - 1] then arr[i - 1] = h end
    end
  end
end

-- cache one handle array per list of tensors the C step reads (built once, at construction)
function Optimizer:_cache(lists)
  self._lists, self._arrays = lists, {}
  for name, list in pairs(lists) do self._arrays[name] = handle_array(list) end
  self._n = #self.params
  self._due = {}
  self._wd = doubles_t(math.max(self._n, 1))
  for i, w in ipairs(self.weight_decays) do self._wd[i - 1] = w end
end

function Optimizer:_lr()
  local lr = self.lr
  if type(lr) ~= 'number' or not (lr >= 0) or lr == math.huge then
    raise(string.format('%s: opt.lr must be a finite number >= 0, got %s', self.kind, tostring(lr)))
  end
  return lr
end

-- set_to_none (default true) drops the grads; false fills them with zeros
function Optimizer:zero_grad(set_to_none)
  local flag = (set_to_none == nil or set_to_none) and 1 or 0
  for _, p in ipairs(self.params) do
    if p._h ~= nil then check(C.uly_tensor_zero_grad(p._h, flag)) end
  end
end

function Optimizer:grad_norm()
  self:_check_handles()
  local norm = C.uly_grad_norm(self._arrays.params, self._n)
  if norm < 0 then raise(T.last_error()) end
  return norm
end

function Optimizer:clip_grad_norm(max_norm)
  self:_check_handles()
  return optim._clip(self._arrays.params, self._n, max_norm)
end

-- the cached lists cut down to the parameters with due[i] == k: arrays, weight decays, count
function Optimizer:_subset(due, k)
  local idx = {}
  for i = 1, self._n do if due[i] == k then idx[#idx + 1] = i end end
  local arrays, wd = {}, doubles_t(#idx)
  for name, list in pairs(self._lists) do
    if #list > 0 then   -- SGD without momentum keeps no buffers
      local arr = handles_t(#idx)
      for j, i in ipairs(idx) do arr[j - 1] = list[i]._h end
      arrays[name] = arr
    end
  end
  for j, i in ipairs(idx) do wd[j - 1] = self.weight_decays[i] end
  return arrays, wd, #idx
end

-- one opt:step(): the C step, self:_run(arrays, weight_decays, n, step, lr), for the parameters
-- with a grad, which then count the step. Those whose next step s has the same key(s) share a
-- call: one on the cached arrays when all do (the usual case; the C step skips parameters
-- without a grad), else one per key on arrays of their own (each call checks its own parameters
-- before it changes any).
function Optimizer:_update(key)
  local lr = self:_lr()
  self:_check_handles()
  local due, steps = self._due, self.param_steps   -- due[i]: parameter i's key, false without a grad
  local first, mixed = nil, false
  for i = 1, self._n do
    local g = C.uly_tensor_grad(self.params[i]._h)
    due[i] = g ~= nil and key(steps[i] + 1)
    if g ~= nil then
      C.uly_tensor_release(g)
      first = first or due[i]
      mixed = mixed or due[i] ~= first
    end
  end
  if not mixed then
    if first then self:_run(self._arrays, self._wd, self._n, first, lr) end
    for i = 1, self._n do if due[i] then steps[i] = steps[i] + 1 end end
  else
    for i = 1, self._n do
      local k = due[i]
      if k then
        local arrays, wd, n = self:_subset(due, k)
        self:_run(arrays, wd, n, k, lr)
        for j = i, self._n do
          if due[j] == k then steps[j], due[j] = steps[j] + 1, false end
        end
      end
    end
  end
  self.step_count = self.step_count + 1
end

-- { kind, step, param_steps = {steps per parameter}, hyper = {...}, state = { name = {tensor per
-- parameter} } }; the state tensors are the optimizer's own (not copies): save them before the
-- next step changes them
function Optimizer:state_dict()
  local state = {}
  for _, name in ipairs(self._state_names) do
    local list = {}
    for i, t in ipairs(self.state[name]) do list[i] = t end
    state[name] = list
  end
  local param_steps = {}
  for i, s in ipairs(self.param_steps) do param_steps[i] = s end
  return { kind = self.kind, step = self.step_count, param_steps = param_steps, hyper = self:_hyper(), state = state }
end

-- copy a state_dict's tensors into this optimizer's state (all checked before any copy) and
-- restore the step counts and lr; other hyperparameters stay as constructed. Without param_steps
-- (a state saved before they existed, or ZeroAdamW's) every parameter gets `step`.
function Optimizer:load_state_dict(sd)
  local what = self.kind .. ':load_state_dict'
  if type(sd) ~= 'table' then raise(what .. ': expected a state_dict table, got ' .. type(sd)) end
  if sd.kind ~= self.kind then
    raise(string.format('%s: the state is for %s, not %s', what, tostring(sd.kind), self.kind))
  end
  if not is_int(sd.step) or sd.step < 0 then
    raise(what .. ': step must be a non-negative integer, got ' .. tostring(sd.step))
  end
  local steps = sd.param_steps
  if steps ~= nil then
    if type(steps) ~= 'table' or #steps ~= #self.params then
      raise(string.format('%s: param_steps must be a list of %d step counts (one per parameter), got %s', what,
                          #self.params, type(steps) == 'table' and #steps .. ' entries' or type(steps)))
    end
    for i, s in ipairs(steps) do
      if not is_int(s) or s < 0 or s > sd.step then
        raise(string.format('%s: param_steps[%d] must be an integer in [0, step = %d], got %s', what, i, sd.step,
                            tostring(s)))
      end
    end
  end
  if type(sd.state) ~= 'table' then raise(what .. ': the state_dict has no state table') end
  local lr = sd.hyper and sd.hyper.lr
  if lr ~= nil and (type(lr) ~= 'number' or not (lr >= 0)) then raise(what .. ': hyper.lr must be a number >= 0') end
  for _, name in ipairs(self._state_names) do
    local mine, theirs = self.state[name], sd.state[name]
    if type(theirs) ~= 'table' then raise(string.format("%s: the state has no '%s' list", what, name)) end
    if #theirs ~= #mine then
      raise(string.format('%s: %s has %d tensors but this optimizer has %d%s', what, name, #theirs, #mine,
                          #mine == 0 and ' (momentum = 0 keeps no buffers)' or ' (one per parameter)'))
    end
    for i, t in ipairs(theirs) do
      if not is_tensor(t) or t._h == nil then
        raise(string.format('%s: %s[%d] is not a live tensor', what, name, i))
      end
      if not same_shape(t:shape(), mine[i]:shape()) then
        raise(string.format('%s: %s[%d] has shape %s but parameter %d has shape %s', what, name, i,
                            fmt_shape(t:shape()), i, fmt_shape(mine[i]:shape())))
      end
    end
  end
  for _, name in ipairs(self._state_names) do
    local mine = self.state[name]
    for i, t in ipairs(sd.state[name]) do
      if t ~= mine[i] then mine[i]:copy_(t) end
    end
  end
  self.step_count = sd.step
  for i = 1, #self.params do self.param_steps[i] = steps and steps[i] or sd.step end
  if lr ~= nil then self.lr = lr end
end

---------------------------------------------------------------- AdamW
local AdamW = setmetatable({}, { __index = Optimizer })
AdamW.__index = AdamW

local ADAMW_OPTS = { lr = true, betas = true, eps = true, weight_decay = true }

-- AdamW's options checked: { lr, betas, eps, weight_decay } (also used by dist.ZeroAdamW)
function optim._adamw_hyper(what, opts, allowed)
  check_keys(what, opts, allowed or ADAMW_OPTS)
  local betas = opts.betas or { 0.9, 0.95 }
  if type(betas) ~= 'table' or #betas ~= 2 then raise(what .. ': betas must be a table {beta1, beta2}') end
  for k = 1, 2 do
    local b = betas[k]
    if type(b) ~= 'number' or not (b >= 0 and b < 1) then
      raise(string.format('%s: betas[%d] must be a number in [0, 1), got %s', what, k, tostring(b)))
    end
  end
  return { lr = num_opt(what, opts, 'lr', 3e-4, 0), betas = { betas[1], betas[2] },
           eps = num_opt(what, opts, 'eps', 1e-8, 0), weight_decay = num_opt(what, opts, 'weight_decay', 0.1, 0) }
end

-- params (a list, a module or groups) as a checked list and AdamW's weight decay per tensor
function optim._adamw_params(what, params, weight_decay)
  return collect(what, params, { params = true, weight_decay = true },
                 function(t) return t:dim() >= 2 and weight_decay or 0 end)
end

function optim.AdamW(params, opts)
  opts = opts or {}
  local h = optim._adamw_hyper('AdamW', opts)
  local self = setmetatable({
    kind = 'AdamW',
    lr = h.lr,
    betas = h.betas,
    eps = h.eps,
    weight_decay = h.weight_decay,
    step_count = 0,
    _state_names = { 'exp_avg', 'exp_avg_sq' },
  }, AdamW)
  self.params, self.weight_decays = optim._adamw_params('AdamW', params, self.weight_decay)
  self.param_steps = zero_steps(self.params)
  local m, v = {}, {}
  for i, p in ipairs(self.params) do m[i], v[i] = zeros_like(p), zeros_like(p) end
  self.state = { exp_avg = m, exp_avg_sq = v }
  self:_cache({ params = self.params, exp_avg = m, exp_avg_sq = v })
  return self
end

function AdamW:_hyper()
  return { lr = self.lr, betas = { self.betas[1], self.betas[2] }, eps = self.eps, weight_decay = self.weight_decay }
end

local function own_step(s) return s end

function AdamW:step() self:_update(own_step) end

function AdamW:_run(a, wd, n, step, lr)
  check(C.uly_adamw_step(a.params, a.exp_avg, a.exp_avg_sq, wd, n, lr, self.betas[1], self.betas[2], self.eps, step))
end

---------------------------------------------------------------- SGD
local SGD = setmetatable({}, { __index = Optimizer })
SGD.__index = SGD

local SGD_OPTS = { lr = true, momentum = true, dampening = true, weight_decay = true, nesterov = true }

function optim.SGD(params, opts)
  opts = opts or {}
  check_keys('SGD', opts, SGD_OPTS)
  local self = setmetatable({
    kind = 'SGD',
    lr = num_opt('SGD', opts, 'lr', 1e-3, 0),
    momentum = num_opt('SGD', opts, 'momentum', 0, 0),
    dampening = num_opt('SGD', opts, 'dampening', 0, 0, 1),
    weight_decay = num_opt('SGD', opts, 'weight_decay', 0, 0),
    nesterov = opts.nesterov and true or false,
    step_count = 0,
    _state_names = { 'momentum_buf' },
  }, SGD)
  if self.nesterov and (self.momentum <= 0 or self.dampening ~= 0) then
    raise('SGD: nesterov momentum needs momentum > 0 and dampening = 0')
  end
  local wd = self.weight_decay
  self.params, self.weight_decays = collect('SGD', params, { params = true, weight_decay = true },
                                            function() return wd end)
  self.param_steps = zero_steps(self.params)
  local bufs = {}
  if self.momentum ~= 0 then
    for i, p in ipairs(self.params) do bufs[i] = zeros_like(p) end
  end
  self.state = { momentum_buf = bufs }
  self:_cache({ params = self.params, momentum_buf = bufs })
  return self
end

function SGD:_hyper()
  return { lr = self.lr, momentum = self.momentum, dampening = self.dampening, weight_decay = self.weight_decay,
           nesterov = self.nesterov }
end

-- SGD's update depends on the step only through whether it is the parameter's first (the
-- momentum buffer starts as the grad): 1 for a first step, 2 for any later one
local function first_or_later(s) return s == 1 and 1 or 2 end

function SGD:step() self:_update(first_or_later) end

function SGD:_run(a, wd, n, step, lr)
  local bufs = self.momentum ~= 0 and a.momentum_buf or nil
  check(C.uly_sgd_step(a.params, bufs, wd, n, lr, self.momentum, self.dampening, self.nesterov and 1 or 0, step))
end

---------------------------------------------------------------- gradient norm and clipping
-- handles of a parameter list (an optimizer uses its cached array)
local function param_handles(what, params)
  if type(params) == 'table' and rawget(params, 'sharded') then
    raise(string.format('%s: this optimizer keeps the reduced gradients sharded over its group (%s); call '
                        .. 'opt:%s(...) instead, which reduces them and takes the norm over every shard', what,
                        tostring(params.kind), what))
  end
  if getmetatable(params) and rawget(params, '_arrays') and rawget(params, 'params') then
    params:_check_handles()
    return params._arrays.params, params._n
  end
  local list, unique, seen = tensor_list(what, params), {}, {}
  for i, t in ipairs(list) do
    if not is_tensor(t) or t._h == nil then raise(string.format('%s: parameter %d is not a live tensor', what, i)) end
    local key = tostring(ffi.cast('uintptr_t', t._h))   -- a tensor listed twice is counted and scaled once
    if not seen[key] then seen[key] = true; unique[#unique + 1] = t end
  end
  return handle_array(unique), #unique
end

function optim._clip(arr, n, max_norm)
  if type(max_norm) ~= 'number' or not (max_norm >= 0) then
    raise('clip_grad_norm: max_norm must be a number >= 0, got ' .. tostring(max_norm))
  end
  local norm = C.uly_grad_norm(arr, n)
  if norm < 0 then raise(T.last_error()) end
  -- a NaN or infinite norm is returned as it is, grads untouched: the caller decides (skip the step).
  -- As torch.nn.utils.clip_grad_norm_: scaled whenever max_norm / (norm + 1e-6) < 1 (so also for
  -- a norm within 1e-6 below max_norm)
  local coef = max_norm / (norm + 1e-6)
  if norm == norm and norm < math.huge and coef < 1 then check(C.uly_grad_scale_(arr, n, coef)) end
  return norm
end

-- the global L2 norm of the grads of params (a list, a module or an optimizer); no grad counts 0
function optim.grad_norm(params)
  local arr, n = param_handles('grad_norm', params)
  local norm = C.uly_grad_norm(arr, n)
  if norm < 0 then raise(T.last_error()) end
  return norm
end

-- scale the grads by max_norm / (norm + 1e-6) when that is below 1 (as PyTorch); returns the norm
-- before clipping
function optim.clip_grad_norm(params, max_norm)
  local arr, n = param_handles('clip_grad_norm', params)
  return optim._clip(arr, n, max_norm)
end

---------------------------------------------------------------- learning-rate schedules
-- each returns function(step) -> lr, step counted from 1 (the step about to be taken)
local function sched_step(what, step)
  if type(step) ~= 'number' or step < 1 or step ~= math.floor(step) then
    raise(string.format('%s schedule: step must be an integer >= 1 (steps count from 1), got %s', what, tostring(step)))
  end
end

local function sched_opts(what, o, keys)
  if type(o) ~= 'table' then raise(what .. ' schedule: expects a table of options') end
  check_keys(what .. ' schedule', o, keys)
  if type(o.lr) ~= 'number' or not (o.lr >= 0) then raise(what .. ' schedule: lr must be a number >= 0') end
  local warmup = o.warmup or 0
  if not is_int(warmup) or warmup < 0 then raise(what .. ' schedule: warmup must be an integer >= 0') end
  return warmup
end

-- linear warmup from lr/warmup at step 1 to lr at step `warmup`, cosine decay to min_lr at step
-- `steps`, min_lr after that
function optim.schedule.cosine(o)
  local warmup = sched_opts('cosine', o, { lr = true, warmup = true, steps = true, min_lr = true })
  local lr, steps, min_lr = o.lr, o.steps, o.min_lr or 0
  if not is_int(steps) or steps < 1 or steps < warmup then
    raise('cosine schedule: steps must be an integer >= max(1, warmup), got ' .. tostring(steps))
  end
  if type(min_lr) ~= 'number' or not (min_lr >= 0) or min_lr > lr then
    raise('cosine schedule: min_lr must be a number in [0, lr], got ' .. tostring(min_lr))
  end
  return function(step)
    sched_step('cosine', step)
    if step <= warmup then return lr * step / warmup end
    if step >= steps then return min_lr end
    local progress = (step - warmup) / (steps - warmup)
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))
  end
end

-- linear warmup (if any), then lr
function optim.schedule.constant(o)
  local warmup = sched_opts('constant', o, { lr = true, warmup = true })
  local lr = o.lr
  return function(step)
    sched_step('constant', step)
    if step <= warmup then return lr * step / warmup end
    return lr
  end
end

-- from a training config: {schedule = 'cosine' | 'constant', lr =, warmup =, steps =, min_lr =};
-- the kind defaults to cosine when steps is given; unrelated keys of o are ignored
function optim.schedule.from_opts(o)
  if type(o) ~= 'table' then raise('schedule.from_opts: expects a table of options') end
  local kind = o.schedule or (o.steps and 'cosine' or 'constant')
  if kind == 'cosine' then
    return optim.schedule.cosine { lr = o.lr, warmup = o.warmup, steps = o.steps, min_lr = o.min_lr }
  elseif kind == 'constant' then
    return optim.schedule.constant { lr = o.lr, warmup = o.warmup }
  end
  raise("schedule.from_opts: schedule must be 'cosine' or 'constant', got " .. tostring(kind))
end

return optim
