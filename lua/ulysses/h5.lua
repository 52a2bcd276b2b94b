-- lua/ulysses/h5.lua — HDF5 files from Lua (`uly.h5`), over core/h5.c:
--   local f = h5.create(path)            -- truncates
--   local f = h5.open(path, 'r' | 'r+')
--   f:write(name, tensor); f:write_array(name, ptr, 'u8'|'i32'|'i64'|'f32'|'f64'|'bf16', shape)
--   f:read(name, offset, count, {dtype =, out =}) -> tensor  (0-based offsets like h5py; nil = whole)
--   f:read_into(name, tensor); f:read_ptr(name, offset, count, ptr, dtype)
--   f:info(name) -> {shape = {...}, dtype = 'u8'} | nil; f:exists(name); f:list(group) -> sorted paths
--   f:set_attr(object, key, string | number); f:attr(object, key) -> value | nil; f:close()
--   h5.commit(tmp_path, final_path)        -- fsync + atomic rename + fsync of the directory
-- Names are paths inside the file ("model/blocks.0.attn.wqkv.weight"); the object of an attribute
-- is "" or "/" for the file itself. Files are closed by the garbage collector too. Errors carry
-- the C message (file, dataset, shapes) and are raised at the caller's line.
local ffi = require 'ffi'
local lib = require 'ulysses.ffi'
local T = require 'ulysses.tensor'
local C = lib.C
local raise, last_error = T.raise, T.last_error

local h5 = {}
h5.available = C.uly_has_feature('hdf5') ~= 0

local U8 = 100
local CODES = { u8 = U8, uint8 = U8 }
for k, v in pairs(T.DTYPES) do CODES[k] = v end
local NAMES = { [U8] = 'u8' }
for code, name in pairs(T.DTYPE_NAMES) do NAMES[code] = name end

local i64arr = ffi.typeof('int64_t[?]')
local handle_box = ffi.typeof('int64_t[1]')

local function check(rc)
  if rc ~= 0 then raise(last_error()) end
end

local function dtype_code(what, name)
  local code = CODES[name]
  if not code then
    raise(string.format("%s: unknown dtype '%s' (use u8, i32, i64, f32, f64 or bf16)", what, tostring(name)))
  end
  return code
end

local function check_name(what, name)
  if type(name) ~= 'string' then raise(string.format('%s: name must be a string, got %s', what, type(name))) end
end

local function int_list(what, list, label)
  if type(list) ~= 'table' then raise(string.format('%s: %s must be a list of integers such as {0, 128}', what, label)) end
  for i = 1, #list do
    local v = list[i]
    if type(v) ~= 'number' or v ~= math.floor(v) then
      raise(string.format('%s: %s[%d] must be an integer, got %s', what, label, i, tostring(v)))
    end
  end
  return list
end

local function to_i64(list)
  local a = i64arr(math.max(#list, 1))
  for i = 1, #list do a[i - 1] = list[i] end
  return a
end

---------------------------------------------------------------- files
local File = {}
File.__index = File

local function close_box(box)
  if box[0] ~= 0 then
    C.uly_h5_close(box[0])
    box[0] = 0
  end
end

local function new_file(h, path, mode)
  if h < 0 then raise(last_error()) end
  local box = ffi.gc(handle_box(h), close_box)
  return setmetatable({ _box = box, path = path, mode = mode }, File)
end

function h5.create(path)
  if type(path) ~= 'string' then raise('h5.create: path must be a string, got ' .. type(path)) end
  return new_file(C.uly_h5_create(path), path, 'w')
end

function h5.open(path, mode)
  if type(path) ~= 'string' then raise('h5.open: path must be a string, got ' .. type(path)) end
  mode = mode or 'r'
  if mode ~= 'r' and mode ~= 'r+' then raise("h5.open: mode must be 'r' or 'r+', got " .. tostring(mode)) end
  return new_file(C.uly_h5_open(path, mode == 'r+' and 1 or 0), path, mode)
end

-- the live C handle, or an error naming the closed file
local function fh(self, what)
  if getmetatable(self) ~= File then raise(what .. ': call it as f:' .. what:match('[%w_]+$') .. '(...) on an h5 file') end
  local h = self._box[0]
  if h == 0 then raise(string.format('%s: %s was closed', what, self.path)) end
  return h
end

function File:close()
  if getmetatable(self) ~= File then raise('close: call it as f:close()') end
  local box = self._box
  if box[0] ~= 0 then
    local h = box[0]
    box[0] = 0
    check(C.uly_h5_close(h))
  end
end

function File:__tostring()
  return string.format('h5 file %s (%s%s)', self.path, self.mode, self._box[0] == 0 and ', closed' or '')
end

---------------------------------------------------------------- writing
function File:write(name, t)
  local h = fh(self, 'h5 write')
  check_name('h5 write', name)
  check(C.uly_h5_write_tensor(h, name, T.handle(t, 'h5 write ' .. name)))
end

function File:write_array(name, ptr, dtype, shape)
  local h = fh(self, 'h5 write_array')
  check_name('h5 write_array', name)
  local code = dtype_code('h5 write_array', dtype)
  int_list('h5 write_array', shape, 'shape')
  check(C.uly_h5_write(h, name, ptr, code, #shape, to_i64(shape)))
end

---------------------------------------------------------------- metadata
local shape_buf = ffi.new('int64_t[8]')
local int_box = ffi.new('int[2]')

function File:exists(name)
  local h = fh(self, 'h5 exists')
  check_name('h5 exists', name)
  local rc = C.uly_h5_exists(h, name)
  if rc < 0 then raise(last_error()) end
  return rc == 1
end

-- {shape, dtype} of a dataset; errors name `what` (the Lua call) rather than uly_h5_info
local function info_of(what, h, name)
  if C.uly_h5_info(h, name, int_box, shape_buf, int_box + 1) ~= 0 then
    local msg = last_error()
    raise((msg:gsub('^uly_h5_info:', what .. ':')))
  end
  local shape = {}
  for i = 1, int_box[0] do shape[i] = tonumber(shape_buf[i - 1]) end
  return { shape = shape, dtype = NAMES[int_box[1]] }
end

function File:info(name)
  local h = fh(self, 'h5 info')
  check_name('h5 info', name)
  if C.uly_h5_exists(h, name) ~= 1 then return nil end
  return info_of('h5 info', h, name)
end

function File:list(group)
  local h = fh(self, 'h5 list')
  group = group or ''
  check_name('h5 list', group)
  local need = C.uly_h5_list(h, group, nil, 0)
  if need < 0 then raise(last_error()) end
  local buf = ffi.new('char[?]', need)
  check(C.uly_h5_list(h, group, buf, need))
  local out = {}
  for line in ffi.string(buf):gmatch('[^\n]+') do out[#out + 1] = line end
  return out
end

---------------------------------------------------------------- reading
local numel = T.numel_of

-- start and count arrays for a slab: offset defaults to zeros, count to the rest of each dim
local function slab(what, info, name, offset, count)
  if offset == nil and count == nil then return nil, nil, info.shape end
  local nd = #info.shape
  offset = offset and int_list(what, offset, 'offset') or {}
  if count then int_list(what, count, 'count') end
  if #offset > nd or (count and #count > nd) then
    raise(string.format("%s: dataset '%s' has %d dimensions; the slab has %d", what, name, nd,
                        math.max(#offset, count and #count or 0)))
  end
  local start, cnt = {}, {}
  for d = 1, nd do
    start[d] = offset[d] or 0
    cnt[d] = count and count[d] or (info.shape[d] - start[d])
  end
  return to_i64(start), to_i64(cnt), cnt
end

function File:read(name, offset, count, opts)
  local what = 'h5 read'
  local h = fh(self, what)
  check_name(what, name)
  opts = opts or {}
  local info = info_of(what, h, name)
  local start, cnt, shape = slab(what, info, name, offset, count)
  local out = opts.out
  if out ~= nil then
    T.handle(out, what .. ' opts.out')
    if not out:is_contiguous() or out:device() ~= 'cpu' then raise(what .. ': opts.out must be a contiguous CPU tensor') end
    if out.requires_grad then raise(what .. ': opts.out requires grad; read into a tensor that does not') end
    if out:numel() ~= numel(shape) then
      raise(string.format("%s: opts.out has %d elements but the slab of '%s' has %d", what, out:numel(), name, numel(shape)))
    end
    if opts.dtype and opts.dtype ~= out:dtype() then
      raise(string.format('%s: opts.dtype %s differs from opts.out, which is %s', what, opts.dtype, out:dtype()))
    end
  else
    local dtype = opts.dtype or ((info.dtype == 'f32' or info.dtype == 'f64' or info.dtype == 'bf16') and 'f32' or 'i32')
    out = T.empty(shape, { dtype = dtype, device = 'cpu' })
  end
  check(C.uly_h5_read(h, name, #info.shape, start, cnt, out:data_ptr(), T.dtype_code(out:dtype())))
  return out
end

function File:read_into(name, t)
  local h = fh(self, 'h5 read_into')
  check_name('h5 read_into', name)
  check(C.uly_h5_read_tensor(h, name, T.handle(t, 'h5 read_into')))
  return t
end

function File:read_ptr(name, offset, count, ptr, dtype)
  local what = 'h5 read_ptr'
  local h = fh(self, what)
  check_name(what, name)
  local code = dtype_code(what, dtype)
  if offset and count and #offset == #count then -- the common loader call: C checks rank and range
    int_list(what, offset, 'offset')
    int_list(what, count, 'count')
    check(C.uly_h5_read(h, name, #count, to_i64(offset), to_i64(count), ptr, code))
    return
  end
  local info = info_of(what, h, name)
  local start, cnt = slab(what, info, name, offset, count)
  check(C.uly_h5_read(h, name, #info.shape, start, cnt, ptr, code))
end

---------------------------------------------------------------- attributes
function File:set_attr(object, key, value)
  local h = fh(self, 'h5 set_attr')
  object = object or ''
  check_name('h5 set_attr', object)
  check_name('h5 set_attr', key)
  if type(value) == 'string' then
    check(C.uly_h5_set_attr_string(h, object, key, value))
  elseif type(value) == 'number' then
    check(C.uly_h5_set_attr_f64(h, object, key, value))
  else
    raise(string.format("h5 set_attr: attribute '%s' must be a string or a number, got %s", key, type(value)))
  end
end

local dbl_box = ffi.new('double[1]')

function File:attr(object, key)
  local h = fh(self, 'h5 attr')
  object = object or ''
  check_name('h5 attr', object)
  check_name('h5 attr', key)
  local kind = C.uly_h5_attr_type(h, object, key)
  if kind < 0 then raise(last_error()) end
  if kind == 0 then return nil end
  if kind == 2 then
    check(C.uly_h5_get_attr_f64(h, object, key, dbl_box))
    return dbl_box[0]
  end
  if kind ~= 1 then
    raise(string.format("h5 attr: attribute '%s' on '%s' in %s is neither a string nor a number", key, object, self.path))
  end
  local size = 256
  local buf = ffi.new('char[?]', size)
  local rc = C.uly_h5_get_attr_string(h, object, key, buf, size)
  if rc > 0 then
    size = rc
    buf = ffi.new('char[?]', size)
    rc = C.uly_h5_get_attr_string(h, object, key, buf, size)
  end
  check(rc)
  return ffi.string(buf)
end

---------------------------------------------------------------- atomic replace
function h5.commit(tmp_path, final_path)
  if type(tmp_path) ~= 'string' or type(final_path) ~= 'string' then
    raise('h5.commit: expects two paths (temporary file, final name)')
  end
  check(C.uly_file_commit(tmp_path, final_path))
end

-- where a save to `path` must land: the path, or a symbolic link's target; an error naming the
-- path for a directory, device or pipe (which the rename would replace)
function h5.destination(path)
  local buf = ffi.new('char[?]', 8192)
  check(C.uly_file_destination(path, buf, 8192))
  return ffi.string(buf)
end

return h5
