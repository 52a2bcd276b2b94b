-- tools/inspect.lua — what a weights, checkpoint or dataset file holds, without loading it into a
-- model: each tensor's name, dtype, shape and size, the totals, and the file's metadata (a
-- safetensors header's __metadata__; a ulysses checkpoint's step, optimizer, config, creation time
-- and library version; a dataset's kind, vocabulary, split sizes and entropy). Nothing is read but
-- the header / the HDF5 descriptions and attributes.
--
--   bin/ulysses tools/inspect.lua FILE.safetensors | FILE.h5 [FILE ...]
local uly = require 'ulysses'

local HDF5_SIGNATURE = '\137HDF\r\n\26\n'
local BYTES = { F32 = 4, BF16 = 2, F16 = 2, F64 = 8, I32 = 4, I64 = 8, f32 = 4, bf16 = 2, f64 = 8, i32 = 4, i64 = 8, u8 = 1 }

local function fail(msg)
  io.stderr:write('tools/inspect.lua: ', msg, '\n')
  os.exit(2)
end

local numel = require('ulysses.tensor').numel_of

-- rows {name, dtype, shape} as a table with sizes and totals, then key = value lines
local function report(path, kind, rows, meta_title, meta)
  table.sort(rows, function(a, b) return a[1] < b[1] end)
  local width, elements, bytes = 4, 0, 0
  for _, r in ipairs(rows) do
    width = math.max(width, #r[1])
    r.n = numel(r[3])
    r.bytes = r.n * (BYTES[r[2]] or 0)
    elements, bytes = elements + r.n, bytes + r.bytes
  end
  print(string.format('%s: %s, %d tensors, %s elements, %s', path, kind, #rows, uly.log.format_si(elements),
                      uly.log.format_bytes(bytes)))
  print(string.format('  %-' .. width .. 's  %-5s  %-18s  %s', 'name', 'dtype', 'shape', 'size'))
  for _, r in ipairs(rows) do
    print(string.format('  %-' .. width .. 's  %-5s  %-18s  %s', r[1], r[2], '[' .. table.concat(r[3], ', ') .. ']',
                        uly.log.format_bytes(r.bytes)))
  end
  local keys = {}
  for k in pairs(meta) do keys[#keys + 1] = k end
  table.sort(keys)
  if #keys > 0 then
    print(meta_title .. ':')
    for _, k in ipairs(keys) do print(string.format('  %s = %s', k, (tostring(meta[k]):gsub('\n', '\n      ')))) end
  end
end

local function inspect_safetensors(path)
  local ok, header, meta = pcall(uly.safetensors.header, path)
  if not ok then fail(tostring(header):gsub('^[^:]*%.lua:%d+: ', '')) end
  local rows = {}
  for name, e in pairs(header) do rows[#rows + 1] = { name, e.dtype, e.shape } end
  report(path, 'safetensors', rows, 'metadata', meta)
end

local function inspect_h5(path)
  if not uly.h5.available then fail(path .. ': an HDF5 file, and this library was built without HDF5') end
  local ok, f = pcall(uly.h5.open, path, 'r')
  if not ok then fail(tostring(f):gsub('^[^:]*%.lua:%d+: ', '')) end
  local rows = {}
  for _, name in ipairs(f:list('')) do
    local info = f:info(name)
    if info then rows[#rows + 1] = { name, info.dtype, info.shape } end
  end
  local meta = {}
  for _, key in ipairs { 'format', 'step', 'optim_kind', 'optim_step', 'config', 'extra', 'created', 'library_version',   -- checkpoints
                         'kind', 'name', 'vocab_size', 'vocab', 'n_train', 'n_valid', 'valid_fraction', 'split',          -- datasets
                         'n_records', 'entropy_bits', 'source', 'source_stamp', 'provenance', 'format_version' } do
    meta[key] = f:attr('', key)
  end
  f:close()
  local kind = meta.format and ('HDF5, ' .. tostring(meta.format)) or 'HDF5'
  report(path, kind, rows, 'attributes', meta)
end

local files = arg or {}
if #files == 0 or files[1] == '-h' or files[1] == '--help' then
  print('usage: bin/ulysses tools/inspect.lua FILE.safetensors | FILE.h5 [FILE ...]')
  os.exit(#files == 0 and 2 or 0)
end
for i, path in ipairs(files) do
  if require('ulysses.paths').realpath(path .. '/') then
    fail(string.format('%s is a directory: give a file in it (a run keeps its checkpoints in %s/ckpt)', path, path))
  end
  local h = io.open(path, 'rb')
  if not h then fail(string.format("cannot open '%s' for reading", path)) end
  local head = h:read(8) or ''
  h:close()
  if i > 1 then print() end
  if head == HDF5_SIGNATURE then inspect_h5(path) else inspect_safetensors(path) end
end
