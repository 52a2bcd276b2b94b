-- lua/ulysses/safetensors.lua — weights in the safetensors format (`uly.safetensors`), the one
-- PyTorch and Hugging Face users exchange them in: an 8-byte little-endian header length N, then
-- N bytes of JSON {"<name>": {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, ...,
-- "__metadata__": {"<key>": "<string>"}} (padded with spaces to a multiple of 8 bytes), then the
-- tensors' bytes, little-endian and row-major, back to back (offsets count from the end of the
-- header).
--   safetensors.save(path, tensors, {metadata = {key = 'value'}})
--       tensors: a module (its named_parameters, in that order) or {name = tensor} (sorted by name)
--   safetensors.load(path) -> {name = tensor}, metadata       CPU tensors; F16 is read as f32
--   safetensors.load_into(model, path, {strict = true, rename = function(file_name) -> name or nil})
--       -> {loaded = {names}, missing = {names}, unexpected = {file names}}
--   safetensors.header(path) -> {name = {dtype =, shape =, offsets = {begin, end}}}, metadata
-- dtypes: F32 BF16 F64 I32 I64 as they are, F16 converted to f32. nn.Linear keeps its weight as
-- [in, out] (the layout of Hugging Face GPT-2's Conv1D); torch.nn.Linear's is the transpose.
-- A save is atomic (a temporary file beside the target, fsync, rename): an error leaves the old
-- file as it was. A load checks the whole header first (dtypes, shapes against byte ranges, the
-- ranges inside the file and back to back), and load_into checks every name, shape and dtype
-- before it changes any parameter. Errors name the file, the tensor and what to do.
local ffi = require 'ffi'
local realpath = require('ulysses.paths').realpath
local bit = require 'bit'
local lib = require 'ulysses.ffi'
local T = require 'ulysses.tensor'
local options = require 'ulysses.options'
local json = require 'ulysses.json'
local C = lib.C
local raise, check, is_tensor = T.raise, T.check, T.is_tensor

-- one declaration per cdef, FILE * as void *: another module (or the user) may have declared
-- some of them already, with its own FILE type
for _, decl in ipairs {
  'void *fopen(const char *path, const char *mode);',
  'size_t fread(void *ptr, size_t size, size_t n, void *f);',
  'size_t fwrite(const void *ptr, size_t size, size_t n, void *f);',
  'int fseeko(void *f, int64_t offset, int whence);',
  'int fclose(void *f);',
  'int getpid(void);',
  'char *strerror(int errnum);',
} do pcall(ffi.cdef, decl) end

local M = {}

local MAX_HEADER = 100 * 1024 * 1024   -- the format's own limit on the header's size
-- file dtype -> ours, its bytes per element
local FROM_FILE = { F32 = { 'f32', 4 }, BF16 = { 'bf16', 2 }, F64 = { 'f64', 8 }, I32 = { 'i32', 4 },
                    I64 = { 'i64', 8 }, F16 = { 'f32', 2 } }
local TO_FILE = { f32 = 'F32', bf16 = 'BF16', f64 = 'F64', i32 = 'I32', i64 = 'I64' }
local FLOATING = { f32 = true, bf16 = true, f64 = true }

local json_string, json_decode = json.string, json.decode

---------------------------------------------------------------- files
local function open(path, mode, what)
  local f = ffi.C.fopen(path, mode)
  if f == nil then
    raise(string.format('%s: cannot open %s \'%s\': %s', what, mode == 'rb' and 'for reading' or 'for writing',
                        path, ffi.string(ffi.C.strerror(ffi.errno()))))
  end
  return f
end

local function u64_le(bytes)
  local v = 0
  for i = 8, 1, -1 do v = v * 256 + bytes:byte(i) end
  return v
end
local function u64_bytes(v)
  local out = {}
  for i = 1, 8 do out[i] = string.char(v % 256); v = math.floor(v / 256) end
  return table.concat(out)
end

local numel = T.numel_of
local function shape_str(shape) return '[' .. table.concat(shape, ', ') .. ']' end

-- the header of path, checked: entries {name = {dtype, shape, offsets, file_dtype}}, metadata,
-- the data section's start in the file
local function read_header(path, what)
  if type(path) ~= 'string' then raise(what .. ': path must be a string, got ' .. type(path)) end
  if realpath(path .. '/') then raise(string.format('%s: %s is a directory, not a safetensors file', what, path)) end
  local file_size
  do
    local h = io.open(path, 'rb')
    file_size = h and h:seek('end') or 0
    if h then h:close() end
  end
  local f = open(path, 'rb', what)
  local size_bytes = ffi.new('uint8_t[8]')
  local got = tonumber(ffi.C.fread(size_bytes, 1, 8, f))
  local function bad(msg)
    if f then ffi.C.fclose(f); f = nil end
    raise(string.format('%s: %s is not a valid safetensors file: %s', what, path, msg))
  end
  if got ~= 8 then bad(string.format('%d bytes, fewer than the 8 of its header length', file_size)) end
  local n = u64_le(ffi.string(size_bytes, 8))
  if ffi.string(size_bytes, 8) == '\137HDF\r\n\26\n' then
    bad('it is an HDF5 file (a ulysses checkpoint or dataset: uly.checkpoint and uly.data read those)')
  end
  if n > MAX_HEADER then
    bad(string.format('its first 8 bytes give a header length of %.0f bytes, where the format allows 100 MiB (another '
                      .. 'kind of file, or a damaged one)', n))
  end
  if 8 + n > file_size then bad(string.format('its header length %d runs past the end of the file (%d bytes)', n, file_size)) end
  local buf = ffi.new('char[?]', math.max(n, 1))
  if tonumber(ffi.C.fread(buf, 1, n, f)) ~= n then bad('the header could not be read') end
  ffi.C.fclose(f)
  f = nil
  local header, err = json_decode(ffi.string(buf, n))
  if not header then raise(string.format('%s: %s is not a valid safetensors file: its header is not JSON (%s)', what, path, err)) end
  if type(header) ~= 'table' or header[1] ~= nil then bad('its header is not a JSON object') end
  local metadata = header.__metadata__ or {}
  header.__metadata__ = nil
  if type(metadata) ~= 'table' then bad('"__metadata__" is not an object') end
  for k, v in pairs(metadata) do
    if type(v) ~= 'string' then bad(string.format('metadata "%s" is a %s; the format allows strings only', k, type(v))) end
  end
  local data_size = file_size - 8 - n
  local ranges = {}
  for name, e in pairs(header) do
    local function bad_entry(msg) bad(string.format('tensor "%s": %s', name, msg)) end
    if type(e) ~= 'table' then bad_entry('its entry is not an object') end
    local dt = FROM_FILE[e.dtype]
    if not dt then
      bad_entry(string.format('dtype %s is not one ulysses reads (F32, BF16, F64, I32, I64; F16 as f32)', tostring(e.dtype)))
    end
    if type(e.shape) ~= 'table' then bad_entry('no shape') end
    for _, d in ipairs(e.shape) do
      if type(d) ~= 'number' or d < 0 or d ~= math.floor(d) then bad_entry('shape ' .. tostring(d) .. ' is not a size') end
    end
    local o = e.data_offsets
    if type(o) ~= 'table' or type(o[1]) ~= 'number' or type(o[2]) ~= 'number' or o[1] > o[2] or o[1] < 0 then
      bad_entry('data_offsets must be [begin, end] with 0 <= begin <= end')
    end
    local bytes = numel(e.shape) * dt[2]
    if o[2] - o[1] ~= bytes then
      bad_entry(string.format('shape %s of %s takes %d bytes, data_offsets [%d, %d] hold %d', shape_str(e.shape),
                              e.dtype, bytes, o[1], o[2], o[2] - o[1]))
    end
    if o[2] > data_size then
      bad_entry(string.format('data_offsets [%d, %d] run past the data (%d bytes): the file is truncated', o[1], o[2], data_size))
    end
    header[name] = { dtype = dt[1], file_dtype = e.dtype, shape = e.shape, offsets = { o[1], o[2] } }
    ranges[#ranges + 1] = { o[1], o[2], name }
  end
  table.sort(ranges, function(a, b) return a[1] < b[1] or (a[1] == b[1] and a[2] < b[2]) end)
  local at = 0
  for _, r in ipairs(ranges) do
    if r[1] ~= at then
      bad(string.format('tensor "%s" starts at byte %d of the data, not at %d: the data has %s', r[3], r[1], at,
                        r[1] > at and 'a hole' or 'overlapping tensors'))
    end
    at = r[2]
  end
  return header, metadata, 8 + n
end

-- f16 bits -> f32 value (exact)
local function half_to_float(h)
  local sign = bit.band(h, 0x8000) ~= 0 and -1 or 1
  local e, m = bit.band(bit.rshift(h, 10), 0x1F), bit.band(h, 0x3FF)
  if e == 0 then return sign * m * 2 ^ -24 end
  if e == 31 then return m == 0 and sign * math.huge or 0 / 0 end
  return sign * (1 + m / 1024) * 2 ^ (e - 15)
end

-- the tensor of entry e, read from the open file f (data starting at byte `start`)
local function read_tensor(f, path, name, e, start, what)
  local t = T.empty(e.shape, { dtype = e.dtype })
  local bytes = e.offsets[2] - e.offsets[1]
  if bytes == 0 then return t end
  if ffi.C.fseeko(f, start + e.offsets[1], 0) ~= 0 then
    raise(string.format('%s: %s: cannot seek to tensor "%s"', what, path, name))
  end
  if e.file_dtype == 'F16' then
    local half = ffi.new('uint16_t[?]', bytes / 2)
    if tonumber(ffi.C.fread(half, 1, bytes, f)) ~= bytes then raise(string.format('%s: %s: tensor "%s" could not be read', what, path, name)) end
    local out = t:data()
    for i = 0, bytes / 2 - 1 do out[i] = half_to_float(half[i]) end
    return t
  end
  if tonumber(ffi.C.fread(C.uly_tensor_data_ptr(t._h), 1, bytes, f)) ~= bytes then
    raise(string.format('%s: %s: tensor "%s" could not be read', what, path, name))
  end
  return t
end

-- the tensors of entries {{name, entry}, ...} from path, in that order (the file opened once)
local function read_tensors(path, list, start, what)
  local f = open(path, 'rb', what)
  local out = {}
  local ok, err = pcall(function()
    for i, e in ipairs(list) do out[i] = read_tensor(f, path, e[1], e[2], start, what) end
  end)
  ffi.C.fclose(f)
  if not ok then error(err, 0) end
  return out
end

---------------------------------------------------------------- API
function M.header(path)
  local header, metadata = read_header(path, 'safetensors.header')
  for _, e in pairs(header) do e.dtype = e.file_dtype; e.file_dtype = nil end
  return header, metadata
end

function M.load(path)
  local header, metadata, start = read_header(path, 'safetensors.load')
  local list = {}
  for name, e in pairs(header) do list[#list + 1] = { name, e } end
  local out = {}
  for i, t in ipairs(read_tensors(path, list, start, 'safetensors.load')) do out[list[i][1]] = t end
  return out, metadata
end

-- {{name, tensor}, ...} to save: a module's named_parameters, or a table's entries sorted by name
local function entries_of(tensors)
  local list = {}
  if type(tensors) == 'table' and type(tensors.named_parameters) == 'function' then
    for name, p in tensors:named_parameters() do list[#list + 1] = { name, p } end
    return list
  end
  if type(tensors) ~= 'table' then
    raise('safetensors.save: tensors must be a module or a table {name = tensor}, got ' .. type(tensors))
  end
  for name, t in pairs(tensors) do
    if type(name) ~= 'string' then raise('safetensors.save: tensor names must be strings, got ' .. type(name) .. ' ' .. tostring(name)) end
    if not is_tensor(t) then raise(string.format('safetensors.save: "%s" is a %s, not a tensor', name, type(t))) end
    list[#list + 1] = { name, t }
  end
  table.sort(list, function(a, b) return a[1] < b[1] end)
  return list
end

local tmp_counter = 0
M._test_hook = nil   -- called with each tensor's name after it is written (specs: fail midway)

function M.save(path, tensors, opts)
  opts = options.check('safetensors.save', opts, { 'metadata' })
  if type(path) ~= 'string' or path == '' then raise('safetensors.save: path must be a non-empty string') end
  local list = entries_of(tensors)
  local parts, offset, seen = {}, 0, {}
  if opts.metadata ~= nil then
    if type(opts.metadata) ~= 'table' then raise('safetensors.save: metadata must be a table of strings') end
    local keys = {}
    for k, v in pairs(opts.metadata) do
      if type(k) ~= 'string' or type(v) ~= 'string' then
        raise(string.format('safetensors.save: metadata %s = %s: the format holds strings only (use tostring)',
                            tostring(k), tostring(v)))
      end
      keys[#keys + 1] = k
    end
    table.sort(keys)
    local m = {}
    for _, k in ipairs(keys) do m[#m + 1] = json_string(k) .. ':' .. json_string(opts.metadata[k]) end
    parts[1] = '"__metadata__":{' .. table.concat(m, ',') .. '}'
  end
  for _, e in ipairs(list) do
    local name, t = e[1], e[2]
    if name == '' or name == '__metadata__' then raise('safetensors.save: "' .. name .. '" cannot name a tensor') end
    if seen[name] then raise('safetensors.save: two tensors are named "' .. name .. '"') end
    seen[name] = true
    local dt = TO_FILE[t:dtype()]
    local bytes = t:nbytes()
    local shape = t:shape()
    parts[#parts + 1] = string.format('%s:{"dtype":"%s","shape":[%s],"data_offsets":[%d,%d]}', json_string(name), dt,
                                      table.concat(shape, ','), offset, offset + bytes)
    e[3] = bytes
    offset = offset + bytes
  end
  local header = '{' .. table.concat(parts, ',') .. '}'
  header = header .. string.rep(' ', (8 - #header % 8) % 8)
  -- where the file lands (a symbolic link's target), and a temporary file beside it
  local dest = ffi.new('char[?]', 8192)
  check(C.uly_file_destination(path, dest, 8192))
  dest = ffi.string(dest)
  tmp_counter = tmp_counter + 1
  local tmp = string.format('%s.tmp.%d.%d', dest, ffi.C.getpid(), tmp_counter)
  local f = open(tmp, 'wb', 'safetensors.save')
  local ok, err = pcall(function()
    local function put(ptr, n, what)
      if n > 0 and tonumber(ffi.C.fwrite(ptr, 1, n, f)) ~= n then
        raise(string.format('safetensors.save: writing %s to %s failed: %s', what, tmp, ffi.string(ffi.C.strerror(ffi.errno()))))
      end
    end
    local head = u64_bytes(#header) .. header
    put(head, #head, 'the header')
    for _, e in ipairs(list) do
      local t = e[2]
      if t:device() ~= 'cpu' then t = t:cpu() end
      if not t:is_contiguous() then t = t:contiguous() end
      put(C.uly_tensor_data_ptr(t._h), e[3], 'tensor "' .. e[1] .. '"')
      if M._test_hook then M._test_hook(e[1]) end
    end
    local rc = ffi.C.fclose(f)
    f = nil
    if rc ~= 0 then raise('safetensors.save: closing ' .. tmp .. ' failed: ' .. ffi.string(ffi.C.strerror(ffi.errno()))) end
    check(C.uly_file_commit(tmp, dest))
  end)
  if not ok then
    if f then ffi.C.fclose(f) end
    os.remove(tmp)
    error(err, 0)
  end
  return dest
end

function M.load_into(model, path, opts)
  opts = options.check('safetensors.load_into', opts, { 'strict', 'rename' })
  if type(model) ~= 'table' or type(model.named_parameters) ~= 'function' then
    raise('safetensors.load_into: expects a module (with named_parameters), got ' .. type(model))
  end
  if opts.rename ~= nil and type(opts.rename) ~= 'function' then
    raise('safetensors.load_into: rename must be a function(file_name) -> parameter name or nil')
  end
  local strict = opts.strict ~= false
  local header, _, start = read_header(path, 'safetensors.load_into')
  local params, order = {}, {}
  for name, p in model:named_parameters() do params[name] = p; order[#order + 1] = name end
  local plan, unexpected, found = {}, {}, {}
  local file_names = {}
  for name in pairs(header) do file_names[#file_names + 1] = name end
  table.sort(file_names)
  for _, file_name in ipairs(file_names) do
    local e = header[file_name]
    local name = file_name
    if opts.rename then name = opts.rename(file_name) end
    local p = name and params[name]
    if not p then unexpected[#unexpected + 1] = file_name
    else
      if found[name] then
        raise(string.format('safetensors.load_into: %s: "%s" and "%s" both load into parameter "%s"', path,
                            found[name], file_name, name))
      end
      found[name] = file_name
      local ps = p:shape()
      if shape_str(ps) ~= shape_str(e.shape) then
        raise(string.format('safetensors.load_into: %s: tensor "%s" is %s %s, parameter "%s" is %s %s', path, file_name,
                            e.file_dtype, shape_str(e.shape), name, p:dtype(), shape_str(ps)))
      end
      if FLOATING[p:dtype()] ~= FLOATING[e.dtype] then
        raise(string.format('safetensors.load_into: %s: tensor "%s" is %s, parameter "%s" is %s', path, file_name,
                            e.file_dtype, name, p:dtype()))
      end
      plan[#plan + 1] = { file_name, e, p }
    end
  end
  local missing = {}
  for _, name in ipairs(order) do if not found[name] then missing[#missing + 1] = name end end
  if strict and (#missing > 0 or #unexpected > 0) then
    local function few(list)
      local s = {}
      for i = 1, math.min(#list, 5) do s[i] = '"' .. list[i] .. '"' end
      return table.concat(s, ', ') .. (#list > 5 and string.format(' and %d more', #list - 5) or '')
    end
    local msg = {}
    if #missing > 0 then msg[#msg + 1] = string.format('%d parameters of the model are not in it: %s', #missing, few(missing)) end
    if #unexpected > 0 then msg[#msg + 1] = string.format('%d tensors in it are not parameters of the model: %s', #unexpected, few(unexpected)) end
    raise(string.format('safetensors.load_into: %s: %s (strict = false loads the rest; rename maps names)', path,
                        table.concat(msg, '; ')))
  end
  -- every tensor read before any parameter changes
  local values = read_tensors(path, plan, start, 'safetensors.load_into')
  require('ulysses').no_grad(function() for i, job in ipairs(plan) do job[3]:copy_(values[i]) end end)
  local loaded = {}
  for _, name in ipairs(order) do if found[name] then loaded[#loaded + 1] = name end end
  return { loaded = loaded, missing = missing, unexpected = unexpected }
end

return M
