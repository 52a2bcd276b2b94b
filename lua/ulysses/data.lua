-- lua/ulysses/data.lua — token datasets: the alphabets shared with datasets/prepare.lua and the
-- loader that reads training windows from an HDF5 token file by hyperslab (never the whole file).
--
--   local data = uly.data.open('data/kjv.h5', {seq = 1024, batch = 8, split = 'train'})
--   local x, y = data:next()          -- i32 [B, T_local]; y is x shifted by one on the global sequence
--   (documents = true: x, y, docs = data:next(), docs i32 [B, T] the document id of every position
--    of the whole window, numbered from 0; targets that would cross a document boundary are -1)
--   data:encode('And God said') / data:decode(ids), or uly.data.codec('text' | 'dna') without a file
--
-- Random windows come from the loader's own counter-based generator (splitmix64 of the seed and
-- the draw index), so loader:state() / loader:set_state() resume exactly and every sequence-parallel
-- rank picks the same windows. File layout: datasets/README.md.
local ffi = require 'ffi'
local bit = require 'bit'
local T = require 'ulysses.tensor'
local raise = T.raise

local M = {}
M.FORMAT_VERSION = 1

---------------------------------------------------------------- alphabets
-- DNA: A C G T N and the record separator; U reads as T, every other IUPAC code as N, lowercase
-- (soft-masked) as uppercase. Whitespace, digits (GenBank ORIGIN numbering) and gap symbols are
-- skipped; anything else is not a nucleotide code.
local DNA = { symbols = 'ACGTN|', vocab_size = 6, N = 4, SEP = 5, SKIP = 255, BAD = 254 }
M.DNA = DNA
local dna_lut = ffi.new('uint8_t[256]', DNA.BAD)
do
  local function set(chars, v)
    for i = 1, #chars do
      local c = chars:byte(i)
      dna_lut[c] = v
      if c >= 65 and c <= 90 then dna_lut[c + 32] = v end
    end
  end
  set('A', 0) set('C', 1) set('G', 2) set('T', 3) set('U', 3)
  set('NRYSWKMBDHVX', DNA.N)
  set(' \t\r\n\v\f0123456789-.*', DNA.SKIP)
end
DNA.lut = dna_lut   -- byte -> token (0..4), DNA.SKIP or DNA.BAD

-- the unigram entropy in bits per token of n u8 tokens at ptr (and the counts, 256 slots)
function M.unigram_entropy(ptr, n)
  local counts = ffi.new('int64_t[256]')
  local p = ffi.cast('const uint8_t *', ptr)
  for i = 0, n - 1 do counts[p[i]] = counts[p[i]] + 1 end
  local h = 0
  for v = 0, 255 do
    local c = tonumber(counts[v])
    if c > 0 then h = h - c / n * math.log(c / n) end
  end
  return h / math.log(2), counts
end

---------------------------------------------------------------- counter-based generator
-- splitmix64: the i-th output of a stream is a hash of (seed, i), computed with uint64 cdata
local GOLDEN = 0x9E3779B97F4A7C15ULL
local function mix64(z)
  z = bit.bxor(z, bit.rshift(z, 30)) * 0xBF58476D1CE4E5B9ULL
  z = bit.bxor(z, bit.rshift(z, 27)) * 0x94D049BB133111EBULL
  return bit.bxor(z, bit.rshift(z, 31))
end
-- a uniform integer in [0, range) for draw `index` of the stream `seed` (range < 2^53)
local function draw(seed, index, range)
  local key = mix64(ffi.cast('uint64_t', seed) * GOLDEN + 0x632BE59BD9B4E019ULL)
  local z = mix64(key + (ffi.cast('uint64_t', index) + 1ULL) * GOLDEN)
  return tonumber(z % ffi.cast('uint64_t', range))
end
M._draw = draw

---------------------------------------------------------------- option checks
local function is_int(v) return type(v) == 'number' and v == math.floor(v) and v > -2 ^ 53 and v < 2 ^ 53 end

local KNOWN = { 'batch', 'documents', 'random', 'seed', 'seq', 'shard', 'shuffle', 'split' }

local function check_opts(opts)
  if type(opts) ~= 'table' then
    raise('data.open: options must be a table such as {seq = 1024, batch = 8, split = \'train\'}, got ' .. type(opts))
  end
  require('ulysses.options').check('data.open', opts, KNOWN)
  if not (is_int(opts.seq) and opts.seq >= 1) then
    raise('data.open: opts.seq (tokens per window) must be a positive integer, got ' .. tostring(opts.seq))
  end
  if opts.batch ~= nil and not (is_int(opts.batch) and opts.batch >= 1) then
    raise('data.open: opts.batch must be a positive integer, got ' .. tostring(opts.batch))
  end
  if opts.split ~= nil and type(opts.split) ~= 'string' then
    raise('data.open: opts.split must be a dataset name such as \'train\' or \'valid\', got ' .. type(opts.split))
  end
  if opts.seed ~= nil and not (is_int(opts.seed) and opts.seed >= 0) then
    raise('data.open: opts.seed must be a non-negative integer, got ' .. tostring(opts.seed))
  end
  for _, k in ipairs({ 'shuffle', 'random' }) do
    if opts[k] ~= nil and type(opts[k]) ~= 'boolean' then
      raise(string.format('data.open: opts.%s must be true or false, got %s', k, tostring(opts[k])))
    end
  end
  if opts.shuffle ~= nil and opts.random ~= nil and opts.shuffle ~= opts.random then
    raise('data.open: opts.shuffle and opts.random are the same setting and disagree')
  end
  local sh = opts.shard
  if sh ~= nil then
    if type(sh) ~= 'table' or not is_int(sh.size) or not is_int(sh.rank) or sh.size < 1
       or sh.rank < 0 or sh.rank >= sh.size then
      raise('data.open: opts.shard must be {rank = r, size = P} with integers 0 <= r < P, got ' ..
            (type(sh) == 'table' and string.format('{rank = %s, size = %s}', tostring(sh.rank), tostring(sh.size))
             or type(sh)))
    end
    if sh.size > opts.seq then
      raise(string.format('data.open: %d sequence-parallel ranks cannot share seq = %d positions (each needs at least one)',
                          sh.size, opts.seq))
    end
  end
end

-- positions [lo, hi) of rank r when T positions are split over P ranks, the first T % P one longer
function M.shard_range(T_, rank, size)
  local base, extra = math.floor(T_ / size), T_ % size
  local lo = rank * base + math.min(rank, extra)
  return lo, lo + base + (rank < extra and 1 or 0)
end

---------------------------------------------------------------- the loader
local Loader = {}
Loader.__index = Loader

local function file_exists(path)
  local f = io.open(path, 'rb')
  if f then f:close() return true end
  return false
end

local function strip_location(msg)
  return (tostring(msg):gsub('^[^:\n]*:%d+: ', ''))
end

local function read_attr(f, key)
  local ok, v = pcall(f.attr, f, '/', key)
  if ok then return v end
  return nil
end

-- the document starts of `split` (its dataset `<split>_doc_offsets`: 1-D integers, the first 0,
-- increasing, none past the split's n tokens) and their count; a sentinel n + 1 follows the last
local function read_doc_starts(f, path, split, n)
  local name = split .. '_doc_offsets'
  local info = f:info(name)
  local function fail(fmt, ...)
    f:close()
    raise(string.format("data.open: dataset '%s' of '%s' ", name, path) .. string.format(fmt, ...)
          .. '; datasets/prepare.lua writes a valid one')
  end
  if not info then
    f:close()
    raise(string.format("data.open: documents = true needs the dataset '%s' in '%s' (DNA files made by " ..
                        'datasets/prepare.lua have it; text files are one document)', name, path))
  end
  if #info.shape ~= 1 or info.shape[1] < 1 or (info.dtype ~= 'i64' and info.dtype ~= 'i32') then
    fail('is %s [%s]; it must be 1-D i64, one start per document', tostring(info.dtype), table.concat(info.shape, ', '))
  end
  local nd = info.shape[1]
  local starts = ffi.new('int64_t[?]', nd + 1)
  f:read_ptr(name, { 0 }, { nd }, starts, 'i64')
  for i = 0, nd - 1 do
    local v = tonumber(starts[i])
    if (i == 0 and v ~= 0) or (i > 0 and v <= tonumber(starts[i - 1])) or v > n then
      fail("holds %d at entry %d: document starts begin at 0 and increase, up to the split's %d tokens", v, i + 1, n)
    end
  end
  starts[nd] = n + 1           -- a sentinel past the end
  return starts, nd
end

function M.open(path, opts)
  if type(path) ~= 'string' then raise('data.open: path must be a string, got ' .. type(path)) end
  opts = opts or {}
  check_opts(opts)
  if not file_exists(path) then
    raise(string.format("data.open: no such file '%s' (make one with datasets/prepare.sh or datasets/prepare.lua)", path))
  end
  local h5 = require 'ulysses.h5'
  local ok, f = pcall(h5.open, path, 'r')
  if not ok then
    raise(string.format("data.open: cannot read '%s' as an HDF5 file: %s", path, strip_location(f)))
  end
  local split = opts.split or 'train'
  local kind = read_attr(f, 'kind')
  if kind ~= 'text' and kind ~= 'dna' then
    f:close()
    raise(string.format("data.open: '%s' is not a ulysses token file (root attribute kind is %s, expected 'text' or 'dna'); " ..
                        'make one with datasets/prepare.lua', path, kind == nil and 'missing' or tostring(kind)))
  end
  local info = f:info(split)
  if not info then
    local names = {}
    local ok_list, listed = pcall(f.list, f, '/')
    for _, name in ipairs(ok_list and listed or {}) do
      name = name:gsub('^/', '')
      local i = f:info(name)
      if i and #i.shape == 1 and i.dtype == 'u8' and name ~= 'record_names' then names[#names + 1] = name end
    end
    f:close()
    raise(string.format("data.open: '%s' has no split '%s' (token datasets there: %s)%s", path, split,
                        #names > 0 and table.concat(names, ', ') or 'none',
                        split == 'valid' and '; prepare it with --valid > 0' or ''))
  end
  if #info.shape ~= 1 or info.dtype ~= 'u8' then
    f:close()
    raise(string.format("data.open: dataset '%s' of '%s' is %s [%s]; token datasets are 1-D u8", split, path,
                        tostring(info.dtype), table.concat(info.shape, ', ')))
  end
  local n, seq = info.shape[1], opts.seq
  if n < seq + 1 then
    f:close()
    raise(string.format("data.open: seq = %d needs windows of %d tokens, but split '%s' of '%s' has only %d tokens",
                        seq, seq + 1, split, path, n))
  end
  -- the model's vocabulary is read from the file: without it (or with nonsense) nothing later can say why
  local vocab_size, max_vocab = read_attr(f, 'vocab_size'), kind == 'dna' and DNA.vocab_size or 256
  if not (is_int(vocab_size) and vocab_size >= 1 and vocab_size <= max_vocab) then
    f:close()
    raise(string.format("data.open: '%s' %s (the number of token ids: an integer in 1..%d for a %s file); " ..
                        "datasets/prepare.lua writes it, or add it to this file with " ..
                        "uly.h5.open(path, 'r+'):set_attr('/', 'vocab_size', %d)", path,
                        vocab_size == nil and 'has no root attribute vocab_size'
                        or string.format('has the root attribute vocab_size = %s',
                                         type(vocab_size) == 'string' and "'" .. vocab_size .. "'" or tostring(vocab_size)),
                        max_vocab, kind, max_vocab))
  end
  local shuffle = opts.shuffle
  if shuffle == nil then shuffle = opts.random end
  if shuffle == nil then shuffle = (split == 'train') end
  local rank, size = 0, 1
  if opts.shard then rank, size = opts.shard.rank, opts.shard.size end
  local lo, hi = M.shard_range(seq, rank, size)
  local self = setmetatable({
    path = path, split = split, seq = seq, batch = opts.batch or 1, seed = opts.seed or 1234,
    shuffle = shuffle, rank = rank, ranks = size, offset = lo, hi = hi, seq_local = hi - lo,
    n_tokens = n, kind = kind,
    vocab_size = vocab_size, vocab = read_attr(f, 'vocab'), name = read_attr(f, 'name'),
    entropy_bits = read_attr(f, 'entropy_bits'),
    _file = f, _scratch = ffi.new('uint8_t[?]', hi - lo + 1),
    _draws = 0, _position = 0, _epoch = 0,
  }, Loader)
  self._windows = math.floor((n - 1) / seq)
  if opts.documents then
    -- packed documents: the split's document starts, for per-token document ids and masks
    self._doc_starts, self._n_docs = read_doc_starts(f, path, split, n)
    self.documents = true
  end
  return self
end

-- the index of the document holding token p (binary search over the document starts)
function Loader:_doc_of(p)
  local s = self._doc_starts
  local lo, hi = 0, self._n_docs - 1
  while lo < hi do
    local mid = math.floor((lo + hi + 1) / 2)
    if s[mid] <= p then lo = mid else hi = mid - 1 end
  end
  return lo
end

-- document ids of window `start` (positions 0..T-1, numbered from 0 within the window) into row
-- `row` of dp; targets that cross into another document are ignored (-1) in this rank's y
function Loader:_fill_docs(start, dp, yp, row)
  local T_, s = self.seq, self._doc_starts
  local d0 = self:_doc_of(start)
  local d, nxt = d0, tonumber(s[d0 + 1])
  for t = 0, T_ - 1 do
    local p = start + t
    while p >= nxt do d = d + 1; nxt = tonumber(s[d + 1]) end
    dp[row * T_ + t] = d - d0
    if t >= self.offset and t < self.hi and p + 1 >= nxt then yp[row * self.seq_local + t - self.offset] = -1 end
  end
end

-- number of non-overlapping windows (T + 1 tokens, stride T) in the split
function Loader:num_windows() return self._windows end

-- read window `start`'s slice of this rank into row `row` of x and y (i32 pointers)
function Loader:_fill_row(start, xp, yp, row)
  local L = self.seq_local
  local s = self._scratch
  if self._file == nil then raise('data: the loader of ' .. self.path .. ' is closed') end
  self._file:read_ptr(self.split, { start + self.offset }, { L + 1 }, s, 'u8')
  local base = row * L
  for i = 0, L - 1 do
    xp[base + i] = s[i]
    yp[base + i] = s[i + 1]
  end
end

local function new_batch(rows, L)
  local x = T.empty({ rows, L }, { dtype = 'i32', device = 'cpu' })
  local y = T.empty({ rows, L }, { dtype = 'i32', device = 'cpu' })
  return x, y, x:data(), y:data()
end

-- the next batch: x, y i32 [B, T_local]. Random mode: windows at uniform starts in [0, n - T - 1];
-- sequential mode: consecutive windows, wrapping to the start of the split (epoch + 1) at its end.
function Loader:next()
  local B, L = self.batch, self.seq_local
  local x, y, xp, yp = new_batch(B, L)
  local docs, dp
  if self.documents then
    docs = T.empty({ B, self.seq }, { dtype = 'i32', device = 'cpu' })
    dp = docs:data()
  end
  local range = self.n_tokens - self.seq
  for b = 0, B - 1 do
    local start
    if self.shuffle then
      start = draw(self.seed, self._draws, range)
      self._draws = self._draws + 1
      self._epoch = math.floor(self._draws / self._windows)
    else
      start = self._position * self.seq
      self._position = self._position + 1
      if self._position >= self._windows then self._position, self._epoch = 0, self._epoch + 1 end
    end
    self:_fill_row(start, xp, yp, b)
    if dp then self:_fill_docs(start, dp, yp, b) end
  end
  return x, y, docs
end

-- every window of the split in order, B at a time (the last batch may be smaller); leaves the
-- loader's own state alone.  for x, y in loader:batches() do ... end
function Loader:batches()
  local w, W = 0, self._windows
  return function()
    if w >= W then return nil end
    local rows = math.min(self.batch, W - w)
    local x, y, xp, yp = new_batch(rows, self.seq_local)
    local docs, dp
    if self.documents then
      docs = T.empty({ rows, self.seq }, { dtype = 'i32', device = 'cpu' })
      dp = docs:data()
    end
    for b = 0, rows - 1 do
      self:_fill_row((w + b) * self.seq, xp, yp, b)
      if dp then self:_fill_docs((w + b) * self.seq, dp, yp, b) end
    end
    w = w + rows
    return x, y, docs
  end
end

function Loader:state()
  return { draws = self._draws, position = self._position, epoch = self._epoch }
end

function Loader:set_state(s)
  if type(s) ~= 'table' then raise('data: set_state expects the table state() returned, got ' .. type(s)) end
  for _, k in ipairs({ 'draws', 'position', 'epoch' }) do
    if not (is_int(s[k]) and s[k] >= 0) then
      raise(string.format('data: set_state: field %s must be a non-negative integer, got %s', k, tostring(s[k])))
    end
  end
  if s.position >= self._windows then
    raise(string.format('data: set_state: position %d is past the %d windows of this split (seq = %d)', s.position,
                        self._windows, self.seq))
  end
  self._draws, self._position, self._epoch = s.draws, s.position, s.epoch
  return self
end

-- token ids of one sequence -> string: a Lua list, or a tensor with one row (1-D, or [1, n] as
-- generate's prompts and encode give). A batch [B, n] with B > 1 is an error: decode x[b], one row
-- (one string) at a time.
function Loader:decode(ids)
  local n, get
  if T.is_tensor(ids) then
    n = ids:numel()
    if ids:dim() >= 2 and n ~= ids:size(ids:dim()) then
      raise(string.format('decode: ids %s hold %d rows; decode one sequence at a time (ids[1], ids[2], ...: a string each)',
                          ids:describe(), n / ids:size(ids:dim())))
    end
    local buf = ffi.new('int32_t[?]', math.max(n, 1))
    if n > 0 then ids:copy_to_ptr(buf, 'i32') end
    get = function(i) return buf[i - 1] end
  elseif type(ids) == 'table' then
    n = #ids
    get = function(i) return ids[i] end
  else
    raise('decode: expected a tensor or a list of token ids, got ' .. type(ids))
  end
  local out = ffi.new('uint8_t[?]', math.max(n, 1))
  local V = self.vocab_size
  for i = 1, n do
    local v = get(i)
    if not is_int(v) or v < 0 or v >= V then
      raise(string.format('decode: id %s at position %d is outside the vocabulary 0..%d', tostring(v), i, V - 1))
    end
    out[i - 1] = self.kind == 'dna' and DNA.symbols:byte(v + 1) or v
  end
  return ffi.string(out, n)
end

-- string -> i32 tensor [1, n] (a prompt): bytes for text; for DNA letters (any case, IUPAC
-- codes read as N) and '|' for the record separator, whitespace skipped
function Loader:encode(s)
  if type(s) ~= 'string' then raise('encode: expected a string, got ' .. type(s)) end
  local toks = ffi.new('int32_t[?]', math.max(#s, 1))
  local n = 0
  for i = 1, #s do
    local c = s:byte(i)
    local v = c
    if self.kind == 'dna' then
      v = c == 124 and DNA.SEP or dna_lut[c]
      if v == DNA.BAD then
        raise(string.format("encode: character '%s' at position %d is not a nucleotide code (ACGTU, IUPAC, or '|')",
                            s:sub(i, i), i))
      end
    end
    if v ~= DNA.SKIP or self.kind ~= 'dna' then toks[n] = v; n = n + 1 end
  end
  if n == 0 then raise('encode: the string holds no tokens') end
  local t = T.empty({ 1, n }, { dtype = 'i32', device = 'cpu' })
  ffi.copy(t:data(), toks, n * 4)
  return t
end

-- uly.data.codec(kind): a dataset kind's encode and decode without its file ('text': bytes,
-- vocabulary 256; 'dna': ACGTN and '|', vocabulary 6), as a loader of that kind has them
local Codec = { encode = Loader.encode, decode = Loader.decode }
Codec.__index = Codec
function Codec:__tostring() return string.format('codec %s (vocab %d)', self.kind, self.vocab_size) end

function M.codec(kind)
  if kind ~= 'text' and kind ~= 'dna' then
    raise(string.format("data.codec: kind must be 'text' or 'dna', got %s", type(kind) == 'string' and "'" .. kind .. "'" or tostring(kind)))
  end
  return setmetatable({ kind = kind, vocab_size = kind == 'dna' and DNA.vocab_size or 256 }, Codec)
end

function Loader:close()
  if self._file then self._file:close() self._file = nil end
end

function Loader:__tostring()
  return string.format('data loader %s [%s, %s %s, %d tokens, vocab %s] seq %d (rank %d/%d: %d..%d) batch %d',
                       self.path, self.split, tostring(self.name), self.kind, self.n_tokens, tostring(self.vocab_size),
                       self.seq, self.rank, self.ranks, self.offset, self.hi, self.batch)
end

return M
