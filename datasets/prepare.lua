-- datasets/prepare.lua — turn a raw corpus (text, or DNA in FASTA/GenBank) into an HDF5 token file
-- that uly.data.open reads: 1-D u8 datasets "train" and "valid" plus metadata (datasets/README.md).
--
--   luajit datasets/prepare.lua --kind text|dna --in FILE [--in FILE2] --out data/kjv.h5 [--valid 0.05] [--name kjv]
--   local prepare = dofile('datasets/prepare.lua'); prepare{kind = 'dna', inputs = {'x.fa'}, out = 'x.h5'}
--
-- gzip/dictzip, xz and bzip2 inputs are decompressed on the fly (by their magic bytes). The input is
-- read in chunks into one growing u8 token buffer; the split then copies it once (about two copies
-- of the tokens in memory at the peak). The file is written to OUT.tmp and renamed over OUT; an OUT
-- (or OUT.tmp) that is one of the inputs, or an existing file that is not HDF5, is refused.
local here = (debug.getinfo(1, 'S').source:match('^@(.*)/[^/]*$') or '.')
local root = here .. '/..'
package.path = root .. '/lua/?.lua;' .. root .. '/lua/?/init.lua;' .. package.path

local ffi = require 'ffi'
local data = require 'ulysses.data'

local M = {}
local DNA = data.DNA
local CHUNK = 1 * 2 ^ 20

local function fail(fmt, ...) error('prepare: ' .. string.format(fmt, ...), 0) end

local function shq(s) return "'" .. s:gsub("'", "'\\''") .. "'" end

local realpath = require('ulysses.paths').realpath

local function now()
  local ok, uly = pcall(require, 'ulysses')
  return ok and uly.clock() or os.clock()
end

---------------------------------------------------------------- growing u8 buffer
local Buffer = {}
Buffer.__index = Buffer
local function buffer(cap)
  cap = math.max(cap or 0, 1024)
  return setmetatable({ n = 0, cap = cap, p = ffi.new('uint8_t[?]', cap) }, Buffer)
end
function Buffer:reserve(extra)
  if self.n + extra <= self.cap then return end
  local cap = self.cap
  while cap < self.n + extra do cap = cap * 2 end
  local p = ffi.new('uint8_t[?]', cap)
  ffi.copy(p, self.p, self.n)
  self.p, self.cap = p, cap
end
function Buffer:append(src, len)
  self:reserve(len)
  ffi.copy(self.p + self.n, src, len)
  self.n = self.n + len
end

---------------------------------------------------------------- input files
-- a reader over the decompressed bytes of path: returns the file, a close() that reports
-- a failed decompression, and the size hint for the buffer
local function open_input(path)
  local f = io.open(path, 'rb')
  if not f then fail("cannot open input '%s' (no such file or not readable)", path) end
  local magic = f:read(6) or ''
  local size = f:seek('end')
  f:close()
  local tool, hint
  if magic:sub(1, 2) == '\31\139' then tool = 'gzip -dc'
  elseif magic == '\253' .. '7zXZ\0' then tool = 'xz -dc'
  elseif magic:sub(1, 3) == 'BZh' then tool = 'bzip2 -dc' end
  if not tool then
    f = io.open(path, 'rb')
    return f, function() f:close() end, size
  end
  if tool == 'gzip -dc' and size >= 18 then   -- the gzip trailer holds the size mod 2^32: a good hint
    f = io.open(path, 'rb')
    f:seek('set', size - 4)
    local b1, b2, b3, b4 = f:read(4):byte(1, 4)
    f:close()
    local isize = b1 + 256 * (b2 + 256 * (b3 + 256 * b4))
    hint = isize >= size and isize or nil
  end
  local status = os.tmpname()
  local p = io.popen(string.format('{ %s < %s; echo $? > %s; }', tool, shq(path), shq(status)), 'r')
  local function close(partial)   -- partial: read only the start (the tool then dies of a broken pipe)
    p:close()
    local s = io.open(status, 'r')
    local rc = s and s:read('*n')
    if s then s:close() end
    os.remove(status)
    if rc ~= 0 and not partial then fail("'%s < %s' failed (exit status %s): the file is damaged or the tool is missing", tool, path,
                         tostring(rc)) end
  end
  return p, close, hint or size * 4
end

---------------------------------------------------------------- text: bytes
local function read_text(inputs)
  local buf
  for _, path in ipairs(inputs) do
    local f, close, hint = open_input(path)
    buf = buf or buffer(hint)
    while true do
      local s = f:read(CHUNK)
      if not s then break end
      buf:append(s, #s)
    end
    close()
  end
  return buf
end

---------------------------------------------------------------- DNA: FASTA and GenBank
local lut = DNA.lut
local SKIP, BAD = DNA.SKIP, DNA.BAD

-- append the nucleotide codes of one line to buf; returns the 1-based column of a bad character
local function tokenize_line(buf, line)
  local n = #line
  buf:reserve(n)
  local src, dst, k = ffi.cast('const uint8_t *', line), buf.p, buf.n
  for i = 0, n - 1 do
    local v = lut[src[i]]
    if v < 5 then dst[k] = v; k = k + 1
    elseif v == BAD then buf.n = k return i + 1 end
  end
  buf.n = k
  return nil
end

local function read_dna(inputs)
  local buf, recs = nil, {}      -- recs[i] = { name, start, len }
  local function begin(name) recs[#recs + 1] = { name = name, start = buf.n } end
  for _, path in ipairs(inputs) do
    local f, close, hint = open_input(path)
    buf = buf or buffer(hint)
    local format, in_seq, lineno = nil, false, 0
    for line in f:lines() do
      lineno = lineno + 1
      -- the token buffer counts towards LuaJIT's heap, so the collector would let line strings
      -- pile up to its size before a cycle: collect them as we go
      if lineno % 16384 == 0 then collectgarbage('step', 4096) end
      if format == nil and line:match('%S') then
        if line:sub(1, 1) == '>' then format = 'fasta'
        elseif line:match('^LOCUS%s') then format = 'genbank'
        else close() fail("%s line %d: neither FASTA ('>name') nor GenBank ('LOCUS'): %q", path, lineno, line:sub(1, 60)) end
      end
      local bad
      if format == 'fasta' then
        if line:sub(1, 1) == '>' then begin((line:sub(2):gsub('%s+$', '')))
        else bad = tokenize_line(buf, line) end
      elseif format == 'genbank' then
        if in_seq then
          if line:match('^//') then in_seq = false else bad = tokenize_line(buf, line) end
        elseif line:match('^LOCUS%s') then begin(line:match('^LOCUS%s+(%S+)') or ('record' .. (#recs + 1)))
        elseif line:match('^ORIGIN') then in_seq = true end
      end
      if bad then
        close()
        fail("%s line %d column %d: '%s' is not a nucleotide code (ACGTU or IUPAC ambiguity letters)%s", path, lineno,
             bad, line:sub(bad, bad), format == 'fasta' and '; is this a protein FASTA?' or '')
      end
    end
    close()
  end
  if #recs == 0 then fail('no sequence records in %s', table.concat(inputs, ', ')) end
  for i, r in ipairs(recs) do r.len = (recs[i + 1] and recs[i + 1].start or buf.n) - r.start end
  return buf, recs
end

-- 'dna' when the first line that is not blank opens a FASTA ('>name') or GenBank ('LOCUS') record
-- (after decompression), else 'text'
function M.detect_kind(path)
  local f, close = open_input(path)
  local head = f:read(65536) or ''
  close(true)
  local first = head:match('^%s*([^\n]*)') or ''
  if first:sub(1, 1) == '>' or first:match('^LOCUS%s') then return 'dna' end
  return 'text'
end

-- what a file is, from its first bytes (decompressed): 'directory', 'hdf5', 'safetensors' (a
-- weights file), 'binary' (NUL bytes in its first 64 KiB), else 'text' (text or DNA)
function M.sniff(path)
  if realpath(path .. '/') then return 'directory' end
  local raw = io.open(path, 'rb')
  if not raw then fail("cannot open input '%s' (no such file or not readable)", path) end
  local magic = raw:read(8) or ''
  local size = raw:seek('end')
  raw:close()
  if magic == '\137HDF\r\n\26\n' then return 'hdf5' end
  local f, close = open_input(path)
  local head = f:read(65536) or ''
  close(true)
  if #head >= 10 then
    local n = 0
    for i = 8, 1, -1 do n = n * 256 + head:byte(i) end
    if n >= 2 and n + 8 <= size and head:sub(9, 9) == '{' then return 'safetensors' end
  end
  if head:find('\0', 1, true) then return 'binary' end
  return 'text'
end

-- the tokens of inputs as one u8 buffer {p, n} (for DNA also its records {name, start, len}, start
-- 0-based into the buffer), as prepare reads them; tools/score.lua reads its inputs so
function M.read_tokens(kind, inputs)
  if kind == 'text' then return read_text(inputs) end
  return read_dna(inputs)
end

---------------------------------------------------------------- splits
-- text: the last `valid` fraction of the stream
local function split_text(buf, valid)
  local nv = math.floor(buf.n * valid)
  return { p = buf.p, n = buf.n - nv }, { p = buf.p + (buf.n - nv), n = nv }
end

-- DNA: the last `valid` fraction of each record; each split is its records' pieces joined by SEP
local function split_dna(buf, recs, valid)
  local nt, nv, R = 0, 0, #recs
  for _, r in ipairs(recs) do
    r.nv = math.floor(r.len * valid)
    r.nt = r.len - r.nv
    nt, nv = nt + r.nt, nv + r.nv
  end
  local function build(field, total, skip)
    local out = { n = total + R - 1 }
    out.p = ffi.new('uint8_t[?]', math.max(out.n, 1))
    out.offsets = ffi.new('int64_t[?]', R)
    local k = 0
    for i, r in ipairs(recs) do
      if i > 1 then out.p[k] = DNA.SEP; k = k + 1 end
      out.offsets[i - 1] = k
      ffi.copy(out.p + k, buf.p + r.start + skip(r), r[field])
      k = k + r[field]
    end
    return out
  end
  local train = build('nt', nt, function() return 0 end)
  local valid_part = nv > 0 and build('nv', nv, function(r) return r.nt end) or { n = 0 }
  return train, valid_part
end

---------------------------------------------------------------- provenance
local read_all = require('ulysses.paths').read_file

-- the .provenance files fetch.sh wrote next to the inputs (NAME.provenance or STEM.provenance)
local function provenance(inputs, name)
  local parts, seen = {}, {}
  for _, path in ipairs(inputs) do
    local dir = path:match('^(.*)/[^/]*$') or '.'
    local stem = (path:match('([^/]*)$')):gsub('%..*$', '')
    for _, cand in ipairs({ dir .. '/' .. name .. '.provenance', dir .. '/' .. stem .. '.provenance' }) do
      local s = not seen[cand] and read_all(cand)
      seen[cand] = true
      if s then parts[#parts + 1] = s:gsub('%s+$', '') end
    end
  end
  return table.concat(parts, '\n')
end

---------------------------------------------------------------- main entry
local function check(opts)
  if type(opts) ~= 'table' then fail('expected an options table {kind =, inputs =, out =}, got %s', type(opts)) end
  if opts.kind ~= 'text' and opts.kind ~= 'dna' then fail("kind must be 'text' or 'dna', got %s", tostring(opts.kind)) end
  local inputs = opts.inputs or opts['in']
  if type(inputs) == 'string' then inputs = { inputs } end
  if type(inputs) ~= 'table' or #inputs == 0 then fail('no input files (inputs = {FILE, ...} or --in FILE)') end
  if type(opts.out) ~= 'string' or opts.out == '' then fail('no output file (out = PATH or --out PATH)') end
  local valid = opts.valid == nil and 0.05 or tonumber(opts.valid)
  if not valid or valid < 0 or valid >= 1 then fail('valid must be a fraction in [0, 1), got %s', tostring(opts.valid)) end
  local name = opts.name or (opts.out:match('([^/]*)$'):gsub('%.h5$', ''))
  -- the output (and OUT.tmp, written first) must not replace an input, nor a file that is not HDF5
  for _, path in ipairs(inputs) do
    local r = realpath(path)
    for _, o in ipairs({ opts.out, opts.out .. '.tmp' }) do
      if r and r == realpath(o) then
        fail("writing '%s' (%s) would replace the input '%s': give another output path%s", o,
             o == opts.out and 'the output' or "the output's temporary file", path,
             opts.out:match('%.h5$') and '' or string.format(' (e.g. %s.h5)', (opts.out:gsub('%.[^./]*$', ''))))
      end
    end
  end
  local f = io.open(opts.out, 'rb')
  local head = f and f:read(8)
  if f then f:close() end
  if head and head ~= '\137HDF\r\n\26\n' then
    fail("out '%s' exists and is not an HDF5 file, which writing would replace: give another output path, or remove it",
         opts.out)
  end
  return inputs, valid, name
end

-- prepare{kind = 'text'|'dna', inputs = {FILE, ...}, out = PATH, valid = 0.05, name = NAME, quiet = false,
--         attrs = {key = value, ...} (more root attributes)}
-- -> summary table {name, kind, n_train, n_valid, vocab_size, entropy_bits, seconds, out}
function M.prepare(opts)
  local inputs, valid, name = check(opts)
  local t0 = now()
  local kind = opts.kind
  local buf, recs = nil, nil
  local train, vpart
  if kind == 'text' then
    buf = read_text(inputs)
    train, vpart = split_text(buf, valid)
  else
    buf, recs = read_dna(inputs)
    train, vpart = split_dna(buf, recs, valid)
  end
  if train.n < 2 then fail('%s holds %d tokens for training; too small', table.concat(inputs, ', '), train.n) end
  if valid > 0 and vpart.n == 0 then
    fail('valid = %g of %d tokens leaves no validation tokens; use a larger input or --valid 0', valid, buf.n)
  end
  local entropy = data.unigram_entropy(train.p, train.n)

  local h5 = require 'ulysses.h5'
  local tmp = opts.out .. '.tmp'
  local ok, err = pcall(function()
    local f = h5.create(tmp)
    f:write_array('train', train.p, 'u8', { train.n })
    if vpart.n > 0 then f:write_array('valid', vpart.p, 'u8', { vpart.n }) end
    local attrs = {
      kind = kind, vocab_size = kind == 'dna' and DNA.vocab_size or 256, vocab = kind == 'dna' and DNA.symbols or 'bytes',
      name = name, source = table.concat(inputs, ' '), provenance = provenance(inputs, name),
      n_train = train.n, n_valid = vpart.n, valid_fraction = valid, entropy_bits = entropy,
      created = os.date('!%Y-%m-%dT%H:%M:%SZ'), format_version = data.FORMAT_VERSION,
      split = kind == 'dna' and 'last valid_fraction of each record; records joined by token 5 in each split'
                             or 'last valid_fraction of the byte stream',
    }
    if recs then
      local R = #recs
      attrs.n_records = R
      f:write_array('train_doc_offsets', train.offsets, 'i64', { R })
      if vpart.n > 0 then f:write_array('valid_doc_offsets', vpart.offsets, 'i64', { R }) end
      local names, lens = {}, ffi.new('int64_t[?]', R)
      for i, r in ipairs(recs) do names[i] = r.name:gsub('\n', ' '); lens[i - 1] = r.len end
      local joined = table.concat(names, '\n')
      if #joined > 0 then
        local bytes = ffi.new('uint8_t[?]', #joined)
        ffi.copy(bytes, joined, #joined)
        f:write_array('record_names', bytes, 'u8', { #joined })
      end
      f:write_array('record_lengths', lens, 'i64', { R })
    end
    for k, v in pairs(opts.attrs or {}) do attrs[k] = v end
    for k, v in pairs(attrs) do f:set_attr('/', k, v) end
    f:close()
    h5.commit(tmp, opts.out)
  end)
  if not ok then
    os.remove(tmp)
    fail('writing %s: %s', opts.out, tostring(err))
  end
  local s = { name = name, kind = kind, out = opts.out, n_train = train.n, n_valid = vpart.n,
              vocab_size = kind == 'dna' and DNA.vocab_size or 256, entropy_bits = entropy, seconds = now() - t0,
              n_records = recs and #recs or nil }
  if not opts.quiet then
    io.write(string.format('prepare: %s: %d tokens (train %d, valid %d%s), vocab %d, unigram entropy %.4f bits/token, %.2f s -> %s\n',
                           name, s.n_train + s.n_valid, s.n_train, s.n_valid,
                           recs and string.format(', %d records', #recs) or '', s.vocab_size, entropy, s.seconds, opts.out))
  end
  return s
end

local USAGE = [[usage: luajit datasets/prepare.lua --kind text|dna --in FILE [--in FILE2 ...] --out OUT.h5 [--valid 0.05] [--name NAME] [--quiet]
  text: bytes, vocab 256; dna: FASTA or GenBank, A C G T N and a record separator, vocab 6.
  .gz/.dz/.xz/.bz2 inputs are decompressed on the fly. See datasets/README.md.]]

-- command line arguments -> the options table
function M.parse_args(argv)
  local opts = { inputs = {} }
  local i = 1
  while i <= #argv do
    local a = argv[i]
    local key = a:match('^%-%-(%w+)$')
    if a == '-h' or a == '--help' then return nil end
    if not key or not ({ kind = 1, ['in'] = 1, out = 1, valid = 1, name = 1, quiet = 1 })[key] then
      fail("unknown argument '%s'\n%s", a, USAGE)
    end
    if key == 'quiet' then opts.quiet = true; i = i + 1
    else
      local v = argv[i + 1]
      if v == nil then fail('%s needs a value\n%s', a, USAGE) end
      if key == 'in' then opts.inputs[#opts.inputs + 1] = v
      elseif key == 'valid' then
        opts.valid = tonumber(v)
        if not opts.valid then fail('--valid expects a number, got %s', v) end
      else opts[key] = v end
      i = i + 2
    end
  end
  return opts
end

function M.main(argv)
  local ok, err = pcall(function()
    local opts = M.parse_args(argv)
    if not opts then io.write(USAGE, '\n') return end
    M.prepare(opts)
  end)
  if not ok then
    io.stderr:write(tostring(err), '\n')
    return 1
  end
  return 0
end

setmetatable(M, { __call = function(_, opts) return M.prepare(opts) end })

-- run as a script (luajit datasets/prepare.lua ...) rather than loaded with dofile/require
if arg and arg[0] and debug.getinfo(1, 'S').source == '@' .. arg[0] then
  os.exit(M.main(arg))
end
return M
