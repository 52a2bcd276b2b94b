-- lua/ulysses/nn/init.lua — neural-network modules: `local nn = require('ulysses').nn`.
-- nn.Module (class helper, parameter/child registration in a stable order, a tensor shared by
-- layers listed once, train/eval, zero_grad, printing) and the layers Linear, Embedding,
-- LayerNorm, RMSNorm, Dropout, GELU, Sequential, ModuleList, MLP and SwiGLU. Pure Lua over the
-- tensor ops; no globals.
--
-- Layout: nn.Linear stores its weight as [in, out] (not PyTorch's [out, in]), so forward is
-- x:matmul(weight) + bias with no transpose; x may have any leading dims ([B, T, in]).
--
-- Parameters live as plain fields (self.weight) and are listed by name in registration order,
-- so a field may be reassigned (e.g. to a detached copy) and named_parameters follows it.
local nn = {}

-- 'ulysses' requires this file while it loads: reach it lazily to avoid a require cycle
local uly_mod
local function U()
  uly_mod = uly_mod or require 'ulysses'
  return uly_mod
end

local function raise(msg, level) error('nn: ' .. msg, (level or 1) + 1) end
local options = require 'ulysses.options'

---------------------------------------------------------------- Module base class
local Module = { __name = 'Module' }
Module.__index = Module
nn.Module = Module

local function class_call(cls, ...)
  local self = setmetatable({ _params = {}, _children = {}, _registered = {}, training = true }, cls)
  self:__init(...)
  return self
end

-- Sub = nn.Module:extend('Name'); Sub(...) builds an instance and calls Sub:__init(...)
function Module:extend(name)
  if type(name) ~= 'string' then raise('extend: expects a class name string', 2) end
  local cls = {}
  for k, v in pairs(self) do
    if k:sub(1, 2) == '__' then cls[k] = v end  -- metamethods are not inherited through __index
  end
  cls.__name = name
  cls.__index = cls
  cls.super = self
  return setmetatable(cls, { __index = self, __call = class_call })
end

function Module:__init() end
function Module:forward() raise(self.__name .. ' has no forward(); define ' .. self.__name .. ':forward(...) in the subclass', 2) end
function Module:__call(...) return self:forward(...) end

-- register a parameter: a float tensor that requires grad; returns it
function Module:param(name, t)
  if not U().is_tensor(t) then raise(self.__name .. ': parameter ' .. tostring(name) .. ' must be a tensor', 2) end
  local kind = self._registered[name]
  if kind == 'child' then raise(self.__name .. ': ' .. tostring(name) .. ' is already a child module', 2) end
  if not kind then
    self._params[#self._params + 1] = name
    self._registered[name] = 'param'
  end
  if not t.requires_grad then t:requires_grad_(true) end
  self[name] = t
  return t
end

-- register a child module; returns it
function Module:add(name, m)
  if getmetatable(m) == nil or type(m.named_parameters) ~= 'function' then
    raise(self.__name .. ': child ' .. tostring(name) .. ' must be a module', 2)
  end
  local kind = self._registered[name]
  if kind == 'param' then raise(self.__name .. ': ' .. tostring(name) .. ' is already a parameter', 2) end
  if not kind then
    self._children[#self._children + 1] = name
    self._registered[name] = 'child'
  end
  self[name] = m
  return m
end

-- iterator over (name, child) in registration order
function Module:named_children()
  local i = 0
  return function()
    i = i + 1
    local k = self._children[i]
    if k ~= nil then return k, self[k] end
  end
end

function Module:children()
  local out = {}
  for _, m in self:named_children() do out[#out + 1] = m end
  return out
end

-- each tensor once, under the first name it is reached by (a module or weight shared between
-- layers, as PyTorch allows, is one parameter: counted, clipped, stepped and saved once)
local function collect(m, prefix, out, seen)
  for _, k in ipairs(m._params) do
    local p = m[k]
    if not seen[p] then
      seen[p] = true
      out[#out + 1] = { prefix .. tostring(k), p }
    end
  end
  for _, k in ipairs(m._children) do collect(m[k], prefix .. tostring(k) .. '.', out, seen) end
end

-- iterator over (name, tensor): own parameters first, then each child's, in registration order;
-- a shared tensor comes once, with its first name
function Module:named_parameters()
  local list = {}
  collect(self, '', list, {})
  local i = 0
  return function()
    i = i + 1
    local e = list[i]
    if e then return e[1], e[2] end
  end
end

function Module:parameters()
  local out = {}
  for _, p in self:named_parameters() do out[#out + 1] = p end
  return out
end

function Module:num_parameters()
  local n = 0
  for _, p in self:named_parameters() do n = n + p:numel() end
  return n
end

function Module:train(flag)
  if flag == nil then flag = true end
  self.training = flag and true or false
  for _, c in self:named_children() do c:train(flag) end
  return self
end
function Module:eval() return self:train(false) end

-- move every parameter to a device ('cuda', 'cpu') and/or dtype in place: the parameter objects
-- stay the same (references held elsewhere see the move); gradients are dropped. Create the
-- optimizer after moving. Returns the module.
function Module:to(what)
  local U_ = U()
  U_.no_grad(function()
    for _, p in self:named_parameters() do
      local moved = p:to(what)
      if moved ~= p then
        p:zero_grad(true)
        local h = moved:detach()._h
        p._h = h
        p:requires_grad_(true)
      end
    end
  end)
  return self
end
function Module:cuda() return self:to('cuda') end
function Module:cpu() return self:to('cpu') end

function Module:zero_grad(set_to_none)
  for _, p in self:named_parameters() do p:zero_grad(set_to_none) end
end

-- one-line description of the module's own settings (subclasses override)
function Module:extra_repr() return '' end

local function repr(m, indent, name)
  local extra = m:extra_repr()
  local head = (name and (name .. ': ') or '') .. m.__name .. '(' .. extra .. ')'
  local n = m:num_parameters()
  if n > 0 then head = head .. string.format(' [%d params]', n) end
  local lines = { indent .. head }
  for k, c in m:named_children() do lines[#lines + 1] = repr(c, indent .. '  ', tostring(k)) end
  return table.concat(lines, '\n')
end
function Module:__tostring() return repr(self, '') end

---------------------------------------------------------------- layers
-- Linear(in, out, {bias = true, std = 0.02}): weight [in, out] ~ N(0, std), bias zeros [out]
local Linear = Module:extend('Linear')
nn.Linear = Linear
function Linear:__init(n_in, n_out, opts)
  opts = options.check('nn.Linear', opts, { 'bias', 'std' })
  self.in_features, self.out_features = n_in, n_out
  self:param('weight', U().empty(n_in, n_out):normal_(0, opts.std or 0.02))
  if opts.bias ~= false then self:param('bias', U().zeros(n_out)) end
end
function Linear:forward(x)
  if self.bias then return U().addmm(x, self.weight, self.bias) end
  local y = x:matmul(self.weight)
  return y
end
function Linear:extra_repr()
  return string.format('%d -> %d%s', self.in_features, self.out_features, self.bias and '' or ', bias=false')
end

-- Embedding(V, C, {std = 0.02}): forward(indices i32/i64, 0-based) -> [..., C]
local Embedding = Module:extend('Embedding')
nn.Embedding = Embedding
function Embedding:__init(V, C, opts)
  opts = options.check('nn.Embedding', opts, { 'std' })
  self.num_embeddings, self.dim = V, C
  self:param('weight', U().empty(V, C):normal_(0, opts.std or 0.02))
end
function Embedding:forward(idx) return U().embedding(idx, self.weight) end
function Embedding:extra_repr() return string.format('%d, %d', self.num_embeddings, self.dim) end

-- LayerNorm(C, {eps = 1e-5}): weight ones, bias zeros
local LayerNorm = Module:extend('LayerNorm')
nn.LayerNorm = LayerNorm
function LayerNorm:__init(C, opts)
  opts = options.check('nn.LayerNorm', opts, { 'eps' })
  self.dim, self.eps = C, opts.eps or 1e-5
  self:param('weight', U().ones(C))
  self:param('bias', U().zeros(C))
end
function LayerNorm:forward(x) return U().layernorm(x, self.weight, self.bias, self.eps) end
function LayerNorm:extra_repr() return string.format('%d, eps=%g', self.dim, self.eps) end

-- RMSNorm(C, {eps = 1e-6}): weight ones
local RMSNorm = Module:extend('RMSNorm')
nn.RMSNorm = RMSNorm
function RMSNorm:__init(C, opts)
  opts = options.check('nn.RMSNorm', opts, { 'eps' })
  self.dim, self.eps = C, opts.eps or 1e-6
  self:param('weight', U().ones(C))
end
function RMSNorm:forward(x) return U().rmsnorm(x, self.weight, self.eps) end
function RMSNorm:extra_repr() return string.format('%d, eps=%g', self.dim, self.eps) end

-- Dropout(p = 0.5): drops only while self.training
local Dropout = Module:extend('Dropout')
nn.Dropout = Dropout
function Dropout:__init(p)
  p = p or 0.5
  if type(p) ~= 'number' or p < 0 or p >= 1 then raise('Dropout: p must be in [0, 1), got ' .. tostring(p), 3) end
  self.p = p
end
function Dropout:forward(x)
  if not self.training or self.p == 0 then return x end
  return x:dropout(self.p, true)
end
function Dropout:extra_repr() return string.format('p=%g', self.p) end

-- GELU({approximate = 'none' | 'tanh'})
local GELU = Module:extend('GELU')
nn.GELU = GELU
function GELU:__init(opts) self.approximate = options.check('nn.GELU', opts, { 'approximate' }).approximate or 'none' end
function GELU:forward(x) return x:gelu(self.approximate) end
function GELU:extra_repr() return self.approximate == 'tanh' and "approximate='tanh'" or '' end

-- Sequential(m1, m2, ...): children named 1, 2, ...; forward chains them
local Sequential = Module:extend('Sequential')
nn.Sequential = Sequential
function Sequential:__init(...)
  for i = 1, select('#', ...) do self:add(i, (select(i, ...))) end
end
function Sequential:forward(x)
  for _, m in self:named_children() do x = m(x) end
  return x
end

-- ModuleList{m1, m2, ...}: children named 1, 2, ...; list[i], #list (children are stored at
-- integer keys of the instance) and append(m)
local ModuleList = Module:extend('ModuleList')
nn.ModuleList = ModuleList
function ModuleList:__init(list)
  for _, m in ipairs(list or {}) do self:append(m) end
end
function ModuleList:append(m) return self:add(#self._children + 1, m) end
function ModuleList:forward() raise('ModuleList has no forward: iterate over its modules', 2) end

-- MLP(C, hidden = 4C): Linear(C, hidden) -> GELU tanh -> Linear(hidden, C)
local MLP = Module:extend('MLP')
nn.MLP = MLP
function MLP:__init(C, hidden, opts)
  hidden = hidden or 4 * C
  self:add('fc', Linear(C, hidden, opts))
  self:add('act', GELU { approximate = 'tanh' })
  self:add('proj', Linear(hidden, C, opts))
end
function MLP:forward(x) return self.proj(self.act(self.fc(x))) end

-- SwiGLU(C, hidden): w2(silu(x w1) * (x w3)); no biases by default (LLaMA)
local SwiGLU = Module:extend('SwiGLU')
nn.SwiGLU = SwiGLU
function SwiGLU:__init(C, hidden, opts)
  opts = options.check('nn.SwiGLU', opts, { 'bias', 'std' })
  local lopts = { bias = opts.bias or false, std = opts.std }
  self:add('w1', Linear(C, hidden, lopts))
  self:add('w3', Linear(C, hidden, lopts))
  self:add('w2', Linear(hidden, C, lopts))
end
function SwiGLU:forward(x) return self.w2(self.w1(x):swiglu(self.w3(x))) end

require('ulysses.nn.transformer')(nn, U)
require('ulysses.nn.checkpoint')(nn, U)
return nn
