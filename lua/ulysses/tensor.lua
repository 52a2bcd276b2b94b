-- lua/ulysses/tensor.lua — the Tensor type: a Lua object around a reference-counted C handle,
-- with methods, operators, indexing and printing. Dimensions are 1-based here (negative counts
-- from the end); the C core is 0-based. Errors from C are raised at the caller's own line.
local ffi = require 'ffi'
local lib = require 'ulysses.ffi'
local options = require 'ulysses.options'
local TENSOR_OPTIONS = { 'dtype', 'device', 'requires_grad' }   -- the option names each call takes
local BACKWARD_OPTIONS, TO_OPTIONS = { 'retain_graph' }, { 'device', 'dtype' }
local C = lib.C

local Tensor = {}          -- methods
local mt = {}              -- metatable of tensor objects
local M = { Tensor = Tensor, mt = mt }

local DTYPES = { f32 = 0, float = 0, float32 = 0, bf16 = 1, bfloat16 = 1, i32 = 2, int = 2, int32 = 2,
                 i64 = 3, long = 3, int64 = 3, f64 = 4, double = 4, float64 = 4 }
local DTYPE_NAMES = { [0] = 'f32', 'bf16', 'i32', 'i64', 'f64' }
local DEVICES = { cpu = 0, cuda = 1 }
M.DTYPES, M.DTYPE_NAMES = DTYPES, DTYPE_NAMES

local i64arr = ffi.typeof('int64_t[?]')
local intarr = ffi.typeof('int[?]')
local dblbox = ffi.typeof('double[1]')
local pkgdir = lib.package_dir

-- a file path made absolute (from $PWD) with its '.' and '..' segments resolved
local cwd = os.getenv('PWD') or '.'
local function absolute(path)
  if path:sub(1, 1) ~= '/' then path = cwd .. '/' .. path end
  local parts = {}
  for seg in path:gmatch('[^/]+') do
    if seg == '..' then parts[#parts] = nil elseif seg ~= '.' then parts[#parts + 1] = seg end
  end
  return '/' .. table.concat(parts, '/')
end
-- the library's own Lua (this package and the models shipped with it): errors skip past it
local library_dirs = { absolute(pkgdir) .. '/', absolute(lib.root) .. '/models/' }
local library_source = {}   -- source string -> is it the library's (memo)
local function in_library(src)
  local known = library_source[src]
  if known == nil then
    known = false
    if src:sub(1, 1) == '@' then
      local path = absolute(src:sub(2))
      for _, dir in ipairs(library_dirs) do
        if path:sub(1, #dir) == dir then known = true end
      end
    end
    library_source[src] = known
  end
  return known
end

-- raise `msg` at the first stack level outside the library: the user's own line
local function raise(msg)
  local level = 2
  while true do
    local info = debug.getinfo(level, 'S')
    if not info then level = 2 break end
    if not in_library(info.source) then break end
    level = level + 1
  end
  error(msg, level)
end
M.raise = raise

local function last_error()
  local msg = ffi.string(C.uly_last_error())
  C.uly_clear_error()
  return msg ~= '' and msg or 'unknown error in libulysses'
end
M.last_error = last_error

-- wrap a new handle (or raise the C error when it is NULL)
-- LuaJIT's collector sees only the small Lua wrapper of a tensor, never its C memory, so a loop
-- that drops large tensors could pile up gigabytes of garbage before a collection runs. Collect
-- whenever the bytes held by tensors grow by more than a quarter of what was live after the
-- previous collection (and at least 64 MiB): memory stays near the working set (garbage at most
-- ~25 % on top, which matters for million-token activations; with tensors on a GPU at most 1/16
-- of its memory) and the caching allocator hands the same blocks back every step. The threshold
-- also follows what is held down: after a large working set is released (a model dropped, a
-- collection the caller ran, backward freeing saved activations) the next one gets the same
-- bound, not the old one's (bench/train.lua's second row in a process had peaked 1.7x the
-- same row alone, every dead activation of a step kept until the first row's threshold).
local GC_MIN_GROWTH = 64 * 2 ^ 20
local gc_next = GC_MIN_GROWTH
local function held_bytes() return tonumber(C.uly_memory_allocated()) + tonumber(C.uly_device_memory_allocated(1)) end
M.held_bytes = held_bytes   -- bytes held by tensors on the host and the device together
local function collect_if_grown()
  local held = held_bytes()
  local lower = held + math.max(GC_MIN_GROWTH, held / 4)
  if lower < gc_next then gc_next = lower end
  if held > gc_next then
    collectgarbage('collect')
    if M.after_collect then M.after_collect() end   -- e.g. drop replay closures of freed graphs
    held = held_bytes()
    local growth = math.max(GC_MIN_GROWTH, held / 4)
    if C.uly_device_memory_allocated(1) > 0 then   -- a GPU's memory is fixed: garbage <= 1/16 of it
      local s = ffi.new('int64_t[6]')
      if C.uly_device_memory_stats(1, s) == 0 then growth = math.min(growth, math.max(GC_MIN_GROWTH, tonumber(s[3]) / 16)) end
    end
    gc_next = held + growth
  end
end

local function wrap(h)
  if h == nil then raise(last_error()) end
  local t = setmetatable({ _h = ffi.gc(h, C.uly_tensor_release) }, mt)
  collect_if_grown()
  return t
end
M.wrap = wrap

local function check(rc)
  if rc ~= 0 then raise(last_error()) end
end
M.check = check

local function is_tensor(x) return getmetatable(x) == mt end
M.is_tensor = is_tensor

-- the live handle of a tensor argument, with a clear error for anything else
local function H(t, what)
  if getmetatable(t) ~= mt then
    raise(string.format('%s: expected a tensor, got %s', what or 'argument', type(t)))
  end
  local h = t._h
  if h == nil then raise((what or 'tensor') .. ': this tensor was freed (t:free()) and cannot be used any more') end
  return h
end
M.handle = H

local function dtype_code(name)
  if name == nil then return 0 end
  if type(name) == 'number' then return name end
  local code = DTYPES[name]
  if not code then raise("unknown dtype '" .. tostring(name) .. "' (use f32, bf16, i32, i64 or f64)") end
  return code
end
M.dtype_code = dtype_code

-- the device new tensors go to when no device is given (uly.device('cuda') changes it)
M.default_device = 'cpu'

-- 'cpu' -> 0, 'cuda' -> 1; asking for 'cuda' loads the CUDA backend on first use (or raises why not)
local function device_code(name)
  if name == nil then name = M.default_device end
  if type(name) == 'string' and name:match('^cuda:%d+$') then   -- PyTorch's spelling
    if name ~= 'cuda:0' then
      raise("device '" .. name .. "': a process uses one GPU, 'cuda' (under mpirun the GPU of its local rank)")
    end
    name = 'cuda'
  end
  local code = DEVICES[name]
  if not code then raise("unknown device '" .. tostring(name) .. "' (use 'cpu' or 'cuda')") end
  if code ~= 0 and C.uly_device_available(code) == 0 then
    local ok, why = require('ulysses.cuda').ensure()
    if not ok then
      raise("device 'cuda' is not available: " .. why ..
            " (uly.cuda.simulate() makes 'cuda' a host-memory stand-in for tests)")
    end
  end
  return code
end
M.device_code = device_code
M.DEVICES = DEVICES

-- 1-based (negative from the end) Lua dim -> 0-based C dim
local function cdim(h, d, what, extra)
  local nd = C.uly_tensor_ndim(h) + (extra or 0)
  if type(d) ~= 'number' or d ~= math.floor(d) then raise(what .. ': dimension must be an integer, got ' .. tostring(d)) end
  local c = d < 0 and nd + d or d - 1
  if c < 0 or c >= nd then
    local desc = ffi.new('char[160]')  -- name the tensor's dtype and shape too
    C.uly_tensor_describe(h, desc, 160)
    raise(string.format('%s: dimension %d is out of range for a tensor with %d dimensions (%s)', what, d,
                        nd - (extra or 0), ffi.string(desc)))
  end
  return c
end

-- shape from varargs: (2, 3), ({2, 3}); returns a Lua list
local function shape_list(what, ...)
  local n, first = select('#', ...), ...
  local list = (n == 1 and type(first) == 'table') and first or { ... }
  for i = 1, #list do
    local s = list[i]
    if type(s) ~= 'number' or s ~= math.floor(s) then
      raise(string.format('%s: size %d must be an integer, got %s', what, i, tostring(s)))
    end
  end
  return list
end
M.shape_list = shape_list

-- the number of elements of a shape (a list of sizes; {} is a scalar: 1)
function M.numel_of(shape)
  local n = 1
  for i = 1, #shape do n = n * shape[i] end
  return n
end

local function to_i64(list)
  local a = i64arr(math.max(#list, 1))
  for i = 1, #list do a[i - 1] = list[i] end
  return a
end
M.to_i64 = to_i64

---------------------------------------------------------------- metadata
function Tensor:dim() return C.uly_tensor_ndim(H(self)) end
Tensor.ndim = Tensor.dim
function Tensor:numel() return tonumber(C.uly_tensor_numel(H(self))) end
function Tensor:nbytes() return tonumber(C.uly_tensor_nbytes(H(self))) end
function Tensor:dtype() return DTYPE_NAMES[C.uly_tensor_dtype(H(self))] end
function Tensor:device() return C.uly_tensor_device(H(self)) == 1 and 'cuda' or 'cpu' end
function Tensor:is_cuda() return C.uly_tensor_device(H(self)) == 1 end
function Tensor:is_contiguous() return C.uly_tensor_is_contiguous(H(self)) ~= 0 end
-- a counter of in-place writes to the storage (ops ending in _, copies, optimizer steps, backward
-- accumulating into a leaf's grad): unchanged means unchanged contents
function Tensor:version() return tonumber(C.uly_tensor_version(H(self))) end
function Tensor:data_ptr() return C.uly_tensor_data_ptr(H(self)) end
function Tensor:storage_offset() return tonumber(C.uly_tensor_storage_offset(H(self))) end

function Tensor:shape()
  local h = H(self)
  local s = {}
  for d = 0, C.uly_tensor_ndim(h) - 1 do s[d + 1] = tonumber(C.uly_tensor_size(h, d)) end
  return s
end

function Tensor:size(d)
  if d == nil then return self:shape() end
  local h = H(self)
  return tonumber(C.uly_tensor_size(h, cdim(h, d, 'size')))
end

function Tensor:stride(d)
  local h = H(self)
  if d ~= nil then return tonumber(C.uly_tensor_stride(h, cdim(h, d, 'stride'))) end
  local s = {}
  for i = 0, C.uly_tensor_ndim(h) - 1 do s[i + 1] = tonumber(C.uly_tensor_stride(h, i)) end
  return s
end

function Tensor:describe()
  return string.format('%s[%s]', self:dtype(), table.concat(self:shape(), ', '))
end

---------------------------------------------------------------- data in and out
-- flatten a nested Lua table, checking that it is rectangular
local function flatten(data, shape, depth, out)
  local n = #data
  if shape[depth] == nil then shape[depth] = n
  elseif shape[depth] ~= n then
    raise(string.format('tensor: ragged nested table (dimension %d has lengths %d and %d)', depth, shape[depth], n))
  end
  for i = 1, n do
    local v = data[i]
    if type(v) == 'table' then
      if depth == #shape and #out > 0 and shape[depth + 1] == nil then
        raise(string.format('tensor: ragged nested table at depth %d', depth + 1))
      end
      flatten(v, shape, depth + 1, out)
    elseif type(v) == 'number' or type(v) == 'boolean' then
      if shape[depth + 1] ~= nil then raise(string.format('tensor: ragged nested table at depth %d', depth + 1)) end
      out[#out + 1] = (v == true and 1) or (v == false and 0) or v
    else
      raise('tensor: element of type ' .. type(v) .. ' (only numbers and nested tables of numbers)')
    end
  end
end

function M.from_table(data, opts)
  opts = options.check('tensor', opts, TENSOR_OPTIONS)
  local shape, flat = {}, {}
  if type(data) == 'number' then flat[1] = data
  elseif type(data) == 'table' then flatten(data, shape, 1, flat)
  else raise('tensor: expected a number or a nested table of numbers, got ' .. type(data)) end
  local n = #flat
  local t = M.empty(shape, { dtype = opts.dtype, device = opts.device })
  local buf = ffi.new('double[?]', math.max(n, 1))
  for i = 1, n do buf[i - 1] = flat[i] end
  check(C.uly_tensor_copy_from(t._h, buf, 4, n))
  if opts.requires_grad then t:requires_grad_(true) end
  return t
end

function M.empty(shape, opts)
  opts = options.check('empty', opts, TENSOR_OPTIONS)
  local t = wrap(C.uly_tensor_empty(#shape, to_i64(shape), dtype_code(opts.dtype), device_code(opts.device)))
  if opts.requires_grad then check(C.uly_tensor_set_requires_grad(t._h, 1)) end
  return t
end

-- values as a flat Lua list (row-major) and the shape
local function flat_values(self)
  local h = H(self)
  local n = tonumber(C.uly_tensor_numel(h))
  local buf = ffi.new('double[?]', math.max(n, 1))
  check(C.uly_tensor_copy_to(h, buf, 4, n))
  return buf, n
end

function Tensor:totable()
  local shape = self:shape()
  local buf = flat_values(self)
  if #shape == 0 then return buf[0] end
  local pos = 0
  local function build(d)
    local out = {}
    for i = 1, shape[d] do
      if d == #shape then out[i] = buf[pos]; pos = pos + 1 else out[i] = build(d + 1) end
    end
    return out
  end
  return build(1)
end

function Tensor:item()
  local h = H(self)
  if C.uly_tensor_numel(h) ~= 1 then
    raise('item: only a one-element tensor can be converted to a number, this one is ' .. self:describe())
  end
  local buf = ffi.new('double[1]')
  check(C.uly_tensor_copy_to(h, buf, 4, 1))
  return buf[0]
end

-- a typed pointer to the data, for hand-written loops (contiguous tensors only)
function Tensor:data()
  if self:device() ~= 'cpu' then
    raise('data: tensor ' .. self:describe() .. ' lives on ' .. self:device() .. ', whose memory the host cannot read; use :cpu()')
  end
  if not self:is_contiguous() then raise('data: tensor ' .. self:describe() .. ' is not contiguous; call :contiguous()') end
  local ct = ({ f32 = 'float*', bf16 = 'uint16_t*', i32 = 'int32_t*', i64 = 'int64_t*', f64 = 'double*' })[self:dtype()]
  return ffi.cast(ct, C.uly_tensor_data_ptr(self._h))
end

-- copy the values to raw memory of the given dtype (a cdata pointer), converting
function Tensor:copy_to_ptr(ptr, dtype)
  check(C.uly_tensor_copy_to(H(self), ptr, dtype_code(dtype or self:dtype()), self:numel()))
end

function Tensor:fill_(v) check(C.uly_tensor_fill_(H(self), v)) return self end
function Tensor:zero_() return self:fill_(0) end
function Tensor:uniform_(a, b) check(C.uly_tensor_uniform_(H(self), a or 0, b or 1)) return self end
function Tensor:normal_(mean, std) check(C.uly_tensor_normal_(H(self), mean or 0, std or 1)) return self end
function Tensor:copy_(src)
  if type(src) == 'number' then return self:fill_(src) end
  check(C.uly_tensor_copy_(H(self), H(src, 'copy_'))) return self
end

function Tensor:free()
  local h = self._h
  if h ~= nil then
    ffi.gc(h, nil)
    C.uly_tensor_release(h)
    self._h = nil
  end
end

---------------------------------------------------------------- views and copies
-- resolve one -1 in a requested shape
local function infer_shape(self, list, what)
  local known, hole = 1, nil
  for i, s in ipairs(list) do
    if s == -1 then
      if hole then raise(what .. ': only one dimension can be -1') end
      hole = i
    else known = known * s end
  end
  if hole then
    local n = self:numel()
    if known == 0 or n % known ~= 0 then
      raise(string.format('%s: cannot infer the -1 in shape [%s] for %s', what, table.concat(list, ', '), self:describe()))
    end
    list = { unpack(list) }
    list[hole] = n / known
  end
  return list
end

function Tensor:view(...)
  local s = infer_shape(self, shape_list('view', ...), 'view')
  return wrap(C.uly_tensor_view(H(self), #s, to_i64(s)))
end

function Tensor:reshape(...)
  local s = infer_shape(self, shape_list('reshape', ...), 'reshape')
  return wrap(C.uly_tensor_reshape(H(self), #s, to_i64(s)))
end

function Tensor:flatten() return self:reshape(self:numel()) end

function Tensor:permute(...)
  local h = H(self)
  local dims = shape_list('permute', ...)
  local nd = C.uly_tensor_ndim(h)
  if #dims ~= nd then raise(string.format('permute: %d dims given for a tensor with %d dimensions', #dims, nd)) end
  local a = intarr(math.max(nd, 1))
  for i = 1, nd do a[i - 1] = cdim(h, dims[i], 'permute') end
  return wrap(C.uly_tensor_permute(h, a))
end

function Tensor:transpose(d0, d1)
  local h = H(self)
  return wrap(C.uly_tensor_transpose(h, cdim(h, d0 or 1, 'transpose'), cdim(h, d1 or 2, 'transpose')))
end
function Tensor:t()
  if self:dim() ~= 2 then raise('t: expects a 2-D tensor, got ' .. self:describe() .. '; use transpose(d0, d1)') end
  return self:transpose(1, 2)
end

-- an index or size argument: a whole number (a fraction is a mistake, not something to truncate)
local function whole(what, name, x)
  if type(x) ~= 'number' or x ~= math.floor(x) or x ~= x or x == math.huge or x == -math.huge then
    raise(string.format('%s: %s must be an integer, got %s', what, name, tostring(x)))
  end
  return x
end

-- narrow(dim, start, length), start 1-based like Torch7
function Tensor:narrow(d, start, length)
  local h = H(self)
  local cd = cdim(h, d, 'narrow')
  return wrap(C.uly_tensor_narrow(h, cd, whole('narrow', 'start', start) - 1, whole('narrow', 'length', length)))
end

function Tensor:select(d, index)
  local h = H(self)
  local cd = cdim(h, d, 'select')
  whole('select', 'index', index)
  local size = tonumber(C.uly_tensor_size(h, cd))
  local given = index
  if index < 0 then index = size + index + 1 end
  if index < 1 or index > size then -- report the caller's 1-based index, not the C core's 0-based one
    raise(string.format('select: index %s is out of range for dimension %d of size %d in %s (valid: 1..%d or -%d..-1)',
                        tostring(given), cd + 1, size, self:describe(), size, size))
  end
  return wrap(C.uly_tensor_select(h, cd, index - 1))
end

function Tensor:expand(...)
  local s = shape_list('expand', ...)
  return wrap(C.uly_tensor_expand(H(self), #s, to_i64(s)))
end
function Tensor:expand_as(other) return self:expand(other:shape()) end

function Tensor:unsqueeze(d)
  local h = H(self)
  local cd = cdim(h, d, 'unsqueeze', 1)
  local s = self:shape()
  table.insert(s, cd + 1, 1)
  return self:reshape(s)
end

function Tensor:squeeze(d)
  local s, out = self:shape(), {}
  if d ~= nil then
    local cd = cdim(H(self), d, 'squeeze') + 1
    for i, v in ipairs(s) do if i ~= cd or v ~= 1 then out[#out + 1] = v end end
  else
    for _, v in ipairs(s) do if v ~= 1 then out[#out + 1] = v end end
  end
  return self:reshape(out)
end

function Tensor:contiguous() return wrap(C.uly_tensor_contiguous(H(self))) end
function Tensor:clone() return wrap(C.uly_tensor_clone(H(self))) end
function Tensor:detach() return wrap(C.uly_tensor_detach(H(self))) end
-- t:to('cuda'), t:to('bf16'), t:to{device = 'cuda', dtype = 'bf16'}: a differentiable copy
-- (the tensor itself when nothing changes)
function Tensor:to(what)
  local device, dtype
  if type(what) == 'table' then
    options.check('to', what, TO_OPTIONS)
    device, dtype = what.device, what.dtype
  elseif DEVICES[what] or (type(what) == 'string' and what:match('^cuda:%d+$')) then device = what
  elseif DTYPES[what] then dtype = what
  else
    raise(string.format("to: '%s' is neither a device (cpu, cuda) nor a dtype (f32, bf16, i32, i64, f64)", tostring(what)))
  end
  local t = self
  if dtype and dtype_code(dtype) ~= C.uly_tensor_dtype(H(t)) then t = wrap(C.uly_tensor_to_dtype(H(t), dtype_code(dtype))) end
  if device then
    local code = device_code(device)
    if code ~= C.uly_tensor_device(H(t)) then t = wrap(C.uly_tensor_to_device(H(t), code)) end
  end
  return t
end
function Tensor:cuda() return self:to('cuda') end
function Tensor:cpu() return self:to('cpu') end
function Tensor:float() return self:to('f32') end
function Tensor:bf16() return self:to('bf16') end
function Tensor:double() return self:to('f64') end
function Tensor:int() return self:to('i32') end
function Tensor:long() return self:to('i64') end

---------------------------------------------------------------- autograd
function Tensor:requires_grad_(flag)
  if flag == nil then flag = true end
  check(C.uly_tensor_set_requires_grad(H(self), flag and 1 or 0))
  return self
end

function Tensor:backward(grad, opts)
  if type(grad) == 'table' and not is_tensor(grad) then grad, opts = nil, grad end
  opts = options.check('backward', opts, BACKWARD_OPTIONS)
  check(C.uly_backward(H(self), grad and H(grad, 'backward gradient') or nil, opts.retain_graph and 1 or 0))
end
-- a backward may call back into Lua (nn.checkpoint): never from JIT-compiled code
jit.off(Tensor.backward)

function Tensor:zero_grad(set_to_none)
  check(C.uly_tensor_zero_grad(H(self), (set_to_none == nil or set_to_none) and 1 or 0))
end

function Tensor:is_leaf() return C.uly_tensor_is_leaf(H(self)) ~= 0 end

-- properties reached as fields: t.grad, t.requires_grad, t.grad_fn
local properties = {
  grad = function(self)
    local g = C.uly_tensor_grad(H(self))
    if g == nil then return nil end
    return wrap(g)
  end,
  requires_grad = function(self) return C.uly_tensor_requires_grad(H(self)) ~= 0 end,
  grad_fn = function(self)
    local n = C.uly_tensor_grad_fn_name(H(self))
    return n ~= nil and ffi.string(n) or nil
  end,
}

---------------------------------------------------------------- math
local function scalar_or_tensor(a, b, tensor_fn, scalar_fn, what)
  if type(b) == 'number' then return wrap(scalar_fn(H(a, what), b)) end
  return wrap(tensor_fn(H(a, what), H(b, what)))
end

function Tensor:add(b)
  if type(b) == 'number' then return wrap(C.uly_add_scalar(H(self, 'add'), b)) end
  return wrap(C.uly_add(H(self, 'add'), H(b, 'add')))
end
function Tensor:sub(b)
  if type(b) == 'number' then return wrap(C.uly_add_scalar(H(self, 'sub'), -b)) end
  return wrap(C.uly_sub(H(self, 'sub'), H(b, 'sub')))
end
function Tensor:mul(b) return scalar_or_tensor(self, b, C.uly_mul, C.uly_mul_scalar, 'mul') end
function Tensor:div(b)
  if type(b) == 'number' then return wrap(C.uly_mul_scalar(H(self, 'div'), 1 / b)) end
  return wrap(C.uly_div(H(self, 'div'), H(b, 'div')))
end
function Tensor:scale(s) return wrap(C.uly_mul_scalar(H(self, 'scale'), s)) end
function Tensor:neg() return wrap(C.uly_mul_scalar(H(self, 'neg'), -1)) end
-- |x| as relu(x) + relu(-x): the exact values (one term is 0), gradient sign(x) and 0 at 0 (as PyTorch)
function Tensor:abs()
  H(self, 'abs')
  return self:relu() + self:neg():relu()
end
function Tensor:pow(e)
  if type(e) ~= 'number' then raise('pow: exponent must be a number, got ' .. type(e)) end
  return wrap(C.uly_pow_scalar(H(self, 'pow'), e))
end
function Tensor:matmul(b) return wrap(C.uly_matmul(H(self, 'matmul'), H(b, 'matmul'))) end

function Tensor:sum(d, keepdim)
  local h = H(self, 'sum')
  if d == nil then return wrap(C.uly_sum_all(h)) end
  return wrap(C.uly_sum(h, cdim(h, d, 'sum'), keepdim and 1 or 0))
end
function Tensor:mean(d, keepdim)
  local h = H(self, 'mean')
  if d == nil then return wrap(C.uly_mean_all(h)) end
  return wrap(C.uly_mean(h, cdim(h, d, 'mean'), keepdim and 1 or 0))
end
-- max() -> value; max(dim) -> values, indices (1-based positions along dim, i64)
-- the smallest value over dim d and its 1-based index (the first of tied minima), or of all: -max(-x)
function Tensor:min(d, keepdim)
  H(self, 'min')
  if d == nil then return self:neg():max():neg() end
  local v, i = self:neg():max(d, keepdim)
  return v:neg(), i
end
-- 1-based indices (i64) of the largest values over dim d, the first of tied maxima; without d the
-- index into the flattened tensor
function Tensor:argmax(d, keepdim)
  H(self, 'argmax')
  if d == nil then return select(2, self:reshape(self:numel()):max(1)) end
  return select(2, self:max(d, keepdim))
end
function Tensor:max(d, keepdim)
  local h = H(self, 'max')
  if d == nil then return wrap(C.uly_max_all(h)) end
  local idx = ffi.new('uly_tensor*[1]')
  local v = wrap(C.uly_max(h, cdim(h, d, 'max'), keepdim and 1 or 0, idx))
  local it = wrap(idx[0])
  local dev = it:device()
  if dev ~= 'cpu' then it = it:to('cpu') end
  local p, n = ffi.cast('int64_t*', C.uly_tensor_data_ptr(it._h)), it:numel()
  for i = 0, n - 1 do p[i] = p[i] + 1 end
  if dev ~= 'cpu' then it = it:to(dev) end
  return v, it
end

function Tensor:softmax(d) local h = H(self, 'softmax') return wrap(C.uly_softmax(h, cdim(h, d or -1, 'softmax'))) end
function Tensor:log_softmax(d)
  local h = H(self, 'log_softmax')
  return wrap(C.uly_log_softmax(h, cdim(h, d or -1, 'log_softmax')))
end

-- gelu(): exact erf form (PyTorch's default); gelu('tanh'): the GPT-2 approximation
function Tensor:gelu(approximate)
  if approximate ~= nil and approximate ~= 'tanh' and approximate ~= 'none' then
    raise("gelu: approximate must be 'tanh' or 'none', got " .. tostring(approximate))
  end
  return wrap(C.uly_gelu(H(self, 'gelu'), approximate == 'tanh' and 1 or 0))
end
function Tensor:silu() return wrap(C.uly_silu(H(self, 'silu'))) end
function Tensor:relu() return wrap(C.uly_relu(H(self, 'relu'))) end
function Tensor:tanh() return wrap(C.uly_tanh(H(self, 'tanh'))) end
function Tensor:sigmoid() return wrap(C.uly_sigmoid(H(self, 'sigmoid'))) end
function Tensor:exp() return wrap(C.uly_exp(H(self, 'exp'))) end
function Tensor:log() return wrap(C.uly_log(H(self, 'log'))) end
function Tensor:sqrt() return wrap(C.uly_sqrt(H(self, 'sqrt'))) end
function Tensor:swiglu(up) return wrap(C.uly_swiglu(H(self, 'swiglu'), H(up, 'swiglu'))) end
function Tensor:rope(offset, theta) return wrap(C.uly_rope(H(self, 'rope'), offset or 0, theta or 10000)) end
function Tensor:dropout(p, training)
  if training == nil then training = true end
  return wrap(C.uly_dropout(H(self, 'dropout'), p or 0.5, training and 1 or 0))
end

---------------------------------------------------------------- operators and indexing
mt.__add = function(a, b)
  if type(a) == 'number' then return b:add(a) end
  return a:add(b)
end
mt.__sub = function(a, b)
  if type(a) == 'number' then return b:neg():add(a) end
  return a:sub(b)
end
mt.__mul = function(a, b)
  if type(a) == 'number' then return b:mul(a) end
  return a:mul(b)
end
mt.__div = function(a, b)
  if type(a) == 'number' then return b:pow(-1):mul(a) end
  return a:div(b)
end
mt.__unm = function(a) return a:neg() end
mt.__pow = function(a, b)
  if type(a) == 'number' then raise('number ^ tensor is not supported; use tensor:log() and exp()') end
  return a:pow(b)
end

mt.__index = function(self, k)
  local m = Tensor[k]
  if m ~= nil then return m end
  local p = properties[k]
  if p then return p(self) end
  if type(k) == 'number' then return self:select(1, k) end
  return nil
end

mt.__newindex = function(self, k, v)
  if type(k) == 'number' then
    self:select(1, k):copy_(v)
  else
    raise("cannot set field '" .. tostring(k) .. "' on a tensor")
  end
end

---------------------------------------------------------------- printing
local function fmt_values(self)
  local h = H(self)
  local shape, nd = self:shape(), self:dim()
  local summarise = self:numel() > 1000
  local edge = 3
  local idx = i64arr(math.max(nd, 1))
  local box = dblbox()
  local isint = self:dtype() == 'i32' or self:dtype() == 'i64'
  -- nested brackets, eliding the middle of long dimensions when the tensor is large
  local function render(d, indent, emit)
    if nd == 0 then
      check(C.uly_tensor_get_item(h, idx, box))
      return emit(box[0])
    end
    local n = shape[d + 1]
    local parts = {}
    local i = 0
    while i < n do
      if summarise and n > 2 * edge and i == edge then
        parts[#parts + 1] = '...'
        i = n - edge
      end
      idx[d] = i
      if d == nd - 1 then
        check(C.uly_tensor_get_item(h, idx, box))
        parts[#parts + 1] = emit(box[0])
      else
        parts[#parts + 1] = render(d + 1, indent .. ' ', emit)
      end
      i = i + 1
    end
    if d == nd - 1 then return '[' .. table.concat(parts, ', ') .. ']' end
    local sep = ',' .. string.rep('\n', nd - d - 1) .. indent .. ' '
    return '[' .. table.concat(parts, sep) .. ']'
  end
  -- pass 1: the shown values decide the number format and the column width
  local maxabs, allint, shown = 0, true, {}
  render(0, '', function(v)
    shown[#shown + 1] = v
    if v == v and math.abs(v) ~= math.huge then
      maxabs = math.max(maxabs, math.abs(v))
      if v ~= math.floor(v) then allint = false end
    end
    return ''
  end)
  local fmt
  if isint then fmt = '%d'
  elseif allint and maxabs < 1e9 then fmt = '%.0f.'
  elseif maxabs >= 1e5 or (maxabs < 1e-4 and maxabs > 0) then fmt = '%.4e'
  else fmt = '%.4f' end
  local function f(v)
    if v ~= v then return 'nan' end
    if v == math.huge then return 'inf' elseif v == -math.huge then return '-inf' end
    return string.format(fmt, v)
  end
  local width = 0
  for _, v in ipairs(shown) do width = math.max(width, #f(v)) end
  return render(0, string.rep(' ', #'tensor('), function(v)
    local s = f(v)
    return string.rep(' ', width - #s) .. s
  end)
end

mt.__tostring = function(self)
  if self._h == nil then return 'tensor(<freed>)' end
  local extra = {}
  local fn = self.grad_fn
  if fn then extra[#extra + 1] = 'grad_fn=' .. fn
  elseif self.requires_grad then extra[#extra + 1] = 'requires_grad=true' end
  local dev = self:device() ~= 'cpu' and (' ' .. self:device()) or ''
  return string.format('tensor(%s) %s%s%s', fmt_values(self), self:describe(), dev,
                       #extra > 0 and (' ' .. table.concat(extra, ' ')) or '')
end

return M
