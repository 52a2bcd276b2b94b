-- spec/data_spec.lua — datasets/prepare.lua (text and DNA tokenisation, splits, metadata, the CLI)
-- and the uly.data loader (random and sequential windows, label shift, resume, sequence-parallel
-- shards, errors). Every input is generated into a temporary folder: no network, no data/.
local uly = require 'ulysses'
local ffi = require 'ffi'
local helpers = require 'helpers'
local data = require 'ulysses.data'
local h5 = require 'ulysses.h5'
local root = require('ulysses.ffi').root
local prepare = dofile(root .. '/datasets/prepare.lua')
if not uly.has('hdf5') then   -- a build without HDF5 (the GPU image, scripts/gpu-check.sh): no datasets
  describe('datasets', function() pending('libulysses was built without HDF5') end)
  return
end

local shq = helpers.shq

local tmpdir
local function path(name) return tmpdir .. '/' .. name end
local function write(name, content)
  local f = assert(io.open(path(name), 'wb'))
  f:write(content)
  f:close()
  return path(name)
end
local exists = helpers.exists

-- the values of a dataset as a Lua list, and a root attribute
local function dataset(file, name)
  local f = h5.open(file)
  local t = f:read(name, nil, nil, { dtype = 'f64' })
  f:close()
  return t:totable()
end
local function attr(file, key)
  local f = h5.open(file)
  local v = f:attr('/', key)
  f:close()
  return v
end
local function list_of(t) -- tensor -> flat list of numbers
  local v, n = helpers.values(t)
  local out = {}
  for i = 0, n - 1 do out[i + 1] = v[i] end
  return out
end
local function slice(list, a, b) -- list[a..b], 1-based inclusive
  local out = {}
  for i = a, b do out[#out + 1] = list[i] end
  return out
end
local function bytes_of(s)
  local out = {}
  for i = 1, #s do out[i] = s:byte(i) end
  return out
end

-- a deterministic byte string of length n from the spec seed
local function random_bytes(n, offset)
  helpers.reseed(offset)
  local t = {}
  for i = 1, n do t[i] = string.char(math.random(0, 255)) end
  return table.concat(t)
end

-- the unigram entropy in bits computed in plain Lua
local function entropy(list)
  local c, n = {}, #list
  for _, v in ipairs(list) do c[v] = (c[v] or 0) + 1 end
  local h = 0
  for _, k in pairs(c) do h = h - k / n * math.log(k / n, 2) end
  return h
end

setup(function()
  tmpdir = helpers.mkdtemp()
end)
teardown(function()
  helpers.rmtree(tmpdir)
end)

describe('prepare (DNA)', function()
  it('maps ACGT to 0-3, other IUPAC codes to N = 4, lowercase to upper, and separates records by 5', function()
    local fa = write('two.fa', '>r1 first record\nACGTNacgtRYK\n>r2\nAC\r\nGU\n\n')
    local out = path('two.h5')
    local s = prepare{ kind = 'dna', inputs = { fa }, out = out, valid = 0, quiet = true }
    assert.same({ 0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 4, 4, 5, 0, 1, 2, 3 }, dataset(out, 'train'))
    assert.same({ 0, 13 }, dataset(out, 'train_doc_offsets'))
    assert.same({ 12, 4 }, dataset(out, 'record_lengths'))
    local names = string.char(unpack(dataset(out, 'record_names')))
    assert.equal('r1 first record\nr2', names)
    assert.equal('dna', attr(out, 'kind'))
    assert.equal(6, attr(out, 'vocab_size'))
    assert.equal('ACGTN|', attr(out, 'vocab'))
    assert.equal(17, attr(out, 'n_train'))
    assert.equal(0, attr(out, 'n_valid'))
    assert.equal(2, attr(out, 'n_records'))
    assert.equal(1, attr(out, 'format_version'))
    assert.equal(17, s.n_train)
    local f = h5.open(out)
    assert.is_false(f:exists('valid'))
    f:close()
    assert.is_false(exists(out .. '.tmp'))
  end)

  it('splits off the last fraction of each record, reads gzip input, and stores the doc offsets', function()
    -- record 1: 20 bases (4 to valid), record 2: 10 bases (2 to valid)
    local r1, r2 = 'ACGTACGTACGTACGTGGCC', 'TTTTAAAACG'
    write('split.fa', '>one\n' .. r1:sub(1, 11) .. '\n' .. r1:sub(12) .. '\n>two\n' .. r2 .. '\n')
    assert(os.execute('gzip -c ' .. shq(path('split.fa')) .. ' > ' .. shq(path('split.fa.gz'))) )
    local out = path('split.h5')
    prepare{ kind = 'dna', inputs = { path('split.fa.gz') }, out = out, valid = 0.2, quiet = true }
    local code = { A = 0, C = 1, G = 2, T = 3 }
    local function enc(s) local t = {} for i = 1, #s do t[i] = code[s:sub(i, i)] end return t end
    local train, valid = enc(r1:sub(1, 16)), enc(r1:sub(17))
    train[#train + 1] = 5
    valid[#valid + 1] = 5
    for _, v in ipairs(enc(r2:sub(1, 8))) do train[#train + 1] = v end
    for _, v in ipairs(enc(r2:sub(9))) do valid[#valid + 1] = v end
    assert.same(train, dataset(out, 'train'))
    assert.same(valid, dataset(out, 'valid'))
    assert.same({ 0, 17 }, dataset(out, 'train_doc_offsets'))
    assert.same({ 0, 5 }, dataset(out, 'valid_doc_offsets'))
    assert.near(entropy(train), attr(out, 'entropy_bits'), 1e-12)
  end)

  it('reads the ORIGIN section of GenBank records', function()
    local gb = write('x.gb', table.concat({
      'LOCUS       SEQ1          12 bp    DNA     linear   SYN 01-JAN-2000',
      'DEFINITION  test.', 'FEATURES             Location/Qualifiers', 'ORIGIN',
      '        1 acgtnn acgt', '       11 gg', '//',
      'LOCUS       SEQ2           3 bp    DNA     linear   SYN 01-JAN-2000', 'ORIGIN', '        1 ttt', '//', '' }, '\n'))
    local out = path('gb.h5')
    prepare{ kind = 'dna', inputs = { gb }, out = out, valid = 0, quiet = true }
    assert.same({ 0, 1, 2, 3, 4, 4, 0, 1, 2, 3, 2, 2, 5, 3, 3, 3 }, dataset(out, 'train'))
    assert.equal('SEQ1\nSEQ2', string.char(unpack(dataset(out, 'record_names'))))
  end)

  it('rejects characters that are not nucleotide codes and files that are not FASTA', function()
    local fa = write('protein.fa', '>p\nACGT\nMKVLEQ\n')
    local ok, err = pcall(prepare, { kind = 'dna', inputs = { fa }, out = path('p.h5'), quiet = true })
    assert.is_false(ok)
    assert.matches("protein.fa line 3 column 4: 'L' is not a nucleotide code", err, 1, true)
    ok, err = pcall(prepare, { kind = 'dna', inputs = { write('plain.txt', 'hello\n') }, out = path('q.h5'), quiet = true })
    assert.is_false(ok)
    assert.matches('neither FASTA', err, 1, true)
    assert.is_false(exists(path('p.h5')))
  end)
end)

describe('prepare (text)', function()
  it('stores bytes with vocab 256, the last fraction as valid, the entropy and the provenance', function()
    local text = random_bytes(997, 1) .. 'the end\n'
    local src = write('tiny.txt', text)
    write('tiny.provenance', 'package=test-package\nversion=1.0\n')
    local out = path('tiny.h5')
    local s = prepare{ kind = 'text', inputs = { src }, out = out, valid = 0.1, name = 'tiny', quiet = true }
    local all = bytes_of(text)
    local nv = math.floor(#all * 0.1)
    local train = slice(all, 1, #all - nv)
    assert.same(train, dataset(out, 'train'))
    assert.same(slice(all, #all - nv + 1, #all), dataset(out, 'valid'))
    assert.equal(256, attr(out, 'vocab_size'))
    assert.equal('bytes', attr(out, 'vocab'))
    assert.equal('text', attr(out, 'kind'))
    assert.equal('tiny', attr(out, 'name'))
    assert.equal(#all - nv, attr(out, 'n_train'))
    assert.equal(nv, attr(out, 'n_valid'))
    assert.matches('package=test-package', attr(out, 'provenance'), 1, true)
    assert.matches(src, attr(out, 'source'), 1, true)
    assert.near(entropy(train), attr(out, 'entropy_bits'), 1e-12)
    assert.near(entropy(train), s.entropy_bits, 1e-12)
  end)

  it('tells DNA (FASTA, GenBank, compressed too) from text by the first line that is not blank', function()
    local d = helpers.mkdtemp()
    for name, c in pairs({ ['a.fa'] = { '\n\n>x\nACGT\n', 'dna' }, ['b.gb'] = { 'LOCUS  X 4 bp\nORIGIN\n 1 acgt\n//\n', 'dna' },
                           ['c.txt'] = { 'In the beginning\n>quoted\n', 'text' }, ['d.txt'] = { '', 'text' },
                           ['e.fa'] = { string.rep('>r\n' .. string.rep('ACGT', 40000) .. '\n', 3), 'dna' } }) do
      helpers.write_file(d .. '/' .. name, c[1])
      assert.are.equal(c[2], prepare.detect_kind(d .. '/' .. name), name)
    end
    -- compressed: read from the decompressed start (a large one: the rest is not read)
    assert.are.equal(0, os.execute('gzip -k ' .. helpers.shq(d .. '/e.fa') .. ' && xz -k ' .. helpers.shq(d .. '/c.txt')))
    assert.are.equal('dna', prepare.detect_kind(d .. '/e.fa.gz'))
    assert.are.equal('text', prepare.detect_kind(d .. '/c.txt.xz'))
    assert.has_error(function() prepare.detect_kind(d .. '/none') end)
    helpers.rmtree(d)
  end)

  it('runs as a command line tool and reports bad arguments', function()
    local src = write('cli.txt', string.rep('abcab\n', 50))
    local out = path('cli.h5')
    local cmd = string.format('luajit %s --kind text --in %s --out %s --valid 0.2 --name cli 2>&1; echo "rc=$?"',
                              shq(root .. '/datasets/prepare.lua'), shq(src), shq(out))
    local p = io.popen(cmd)
    local log = p:read('*a')
    p:close()
    assert.matches('rc=0', log, 1, true)
    assert.matches('prepare: cli: 300 tokens (train 240, valid 60), vocab 256, unigram entropy', log, 1, true)
    assert.equal('cli', attr(out, 'name'))
    assert.equal(240, attr(out, 'n_train'))
    p = io.popen(string.format('luajit %s --kind text --bogus 1 2>&1; echo "rc=$?"', shq(root .. '/datasets/prepare.lua')))
    log = p:read('*a')
    p:close()
    assert.matches("unknown argument '--bogus'", log, 1, true)
    assert.matches('rc=1', log, 1, true)
  end)

  it('names a missing input file', function()
    local ok, err = pcall(prepare, { kind = 'text', inputs = { path('nope.txt') }, out = path('n.h5'), quiet = true })
    assert.is_false(ok)
    assert.matches("cannot open input '" .. path('nope.txt') .. "'", err, 1, true)
  end)
end)

describe('data loader', function()
  local text_h5, all, tiny_h5, tiny, dna_h5
  local N_TRAIN = 900

  setup(function()
    local text = random_bytes(1000, 2)
    all = bytes_of(text)
    text_h5 = path('loader.h5')
    prepare{ kind = 'text', inputs = { write('loader.txt', text) }, out = text_h5, valid = 0.1, quiet = true }
    tiny = 'abcdefghijklmnopqrst'      -- 20 train tokens, no valid split
    tiny_h5 = path('tinyload.h5')
    prepare{ kind = 'text', inputs = { write('tinyload.txt', tiny) }, out = tiny_h5, valid = 0, quiet = true }
    dna_h5 = path('dna.h5')
    prepare{ kind = 'dna', inputs = { write('dna.fa', '>a\nACGTACGTAA\n>b\nGGGG\n') }, out = dna_h5, valid = 0, quiet = true }
  end)

  -- the token list of a split (1-based Lua list)
  local function split_tokens(split)
    if split == 'train' then return slice(all, 1, N_TRAIN) end
    return slice(all, N_TRAIN + 1, #all)
  end

  -- row b (1-based) of x as a list
  local function row(t, b)
    local l = list_of(t)
    local L = t:size(2)
    return slice(l, (b - 1) * L + 1, b * L)
  end

  it('reads metadata and keeps random windows inside the split, with y shifted by one', function()
    local d = uly.data.open(tiny_h5, { seq = 16, batch = 5 })
    assert.equal('text', d.kind)
    assert.equal(256, d.vocab_size)
    assert.equal(20, d.n_tokens)
    assert.equal(0, d.offset)
    assert.equal(1, d:num_windows())
    assert.near(attr(tiny_h5, 'entropy_bits'), d.entropy_bits, 0)
    local toks = bytes_of(tiny)
    local seen = {}
    for _ = 1, 40 do
      local x, y = d:next()
      assert.same({ 5, 16 }, x:shape())
      assert.equal('i32', x:dtype())
      for b = 1, 5 do
        local xr, yr = row(x, b), row(y, b)
        local start = xr[1] - 97           -- tokens are 'a' + position
        assert.is_true(start >= 0 and start <= 20 - 16 - 1, 'window start ' .. start)
        seen[start] = true
        assert.same(slice(toks, start + 1, start + 16), xr)
        assert.same(slice(toks, start + 2, start + 17), yr)
      end
    end
    assert.same({ [0] = true, true, true, true }, seen)
  end)

  it('draws the same windows as its generator says, against the raw tokens', function()
    local d = uly.data.open(text_h5, { seq = 32, batch = 4, seed = 7 })
    local raw = split_tokens('train')
    for k = 0, 7 do
      local x, y = d:next()
      for b = 1, 4 do
        local start = data._draw(7, k * 4 + b - 1, N_TRAIN - 32)
        assert.same(slice(raw, start + 1, start + 32), row(x, b))
        assert.same(slice(raw, start + 2, start + 33), row(y, b))
      end
    end
    local other = uly.data.open(text_h5, { seq = 32, batch = 4, seed = 8 })
    assert.are_not.same(list_of(uly.data.open(text_h5, { seq = 32, batch = 4, seed = 7 }):next()), list_of(other:next()))
  end)

  it('covers the split exactly with sequential windows, the last batch smaller', function()
    local d = uly.data.open(text_h5, { seq = 7, batch = 4, split = 'valid' })
    assert.is_false(d.shuffle)
    assert.equal(100, d.n_tokens)
    assert.equal(14, d:num_windows())      -- floor(99 / 7): 14 * 7 + 1 <= 100 < 15 * 7 + 1
    local raw = split_tokens('valid')
    local xs, ys, sizes = {}, {}, {}
    for x, y in d:batches() do
      sizes[#sizes + 1] = x:size(1)
      for _, v in ipairs(list_of(x)) do xs[#xs + 1] = v end
      for _, v in ipairs(list_of(y)) do ys[#ys + 1] = v end
    end
    assert.same({ 4, 4, 4, 2 }, sizes)
    assert.same(slice(raw, 1, 98), xs)
    assert.same(slice(raw, 2, 99), ys)
    -- next() walks the same windows and wraps into the next epoch
    for _ = 1, 3 do d:next() end
    assert.same({ draws = 0, position = 12, epoch = 0 }, d:state())
    local x = d:next()
    assert.same(slice(raw, 12 * 7 + 1, 14 * 7), slice(list_of(x), 1, 14))
    assert.same(slice(raw, 1, 14), slice(list_of(x), 15, 28))
    assert.same({ draws = 0, position = 2, epoch = 1 }, d:state())
  end)

  it('resumes exactly from state()', function()
    for _, shuffle in ipairs({ true, false }) do
      local a = uly.data.open(text_h5, { seq = 10, batch = 3, shuffle = shuffle, seed = 99 })
      for _ = 1, 5 do a:next() end
      local s = a:state()
      for k, v in pairs(s) do assert.equal('number', type(v), k) end
      local expect = {}
      for i = 1, 4 do
        local x, y = a:next()
        expect[i] = { list_of(x), list_of(y) }
      end
      local b = uly.data.open(text_h5, { seq = 10, batch = 3, shuffle = shuffle, seed = 99 })
      b:set_state(s)
      for i = 1, 4 do
        local x, y = b:next()
        assert.same(expect[i][1], list_of(x))
        assert.same(expect[i][2], list_of(y))
      end
      assert.same(a:state(), b:state())
    end
  end)

  it('gives each sequence-parallel rank its slice of the same windows, labels shifted globally', function()
    for _, shuffle in ipairs({ true, false }) do
      local opts = { seq = 10, batch = 2, seed = 3, shuffle = shuffle }
      local full = uly.data.open(text_h5, opts)
      local ranks, offsets = {}, {}
      for r = 0, 2 do
        ranks[r] = uly.data.open(text_h5, { seq = 10, batch = 2, seed = 3, shuffle = shuffle, shard = { rank = r, size = 3 } })
        offsets[r + 1] = ranks[r].offset
      end
      assert.same({ 0, 4, 7 }, offsets)
      for _ = 1, 3 do
        local fx, fy = full:next()
        local parts = {}
        for r = 0, 2 do parts[r] = { ranks[r]:next() } end
        assert.same({ 2, 4 }, parts[0][1]:shape())
        assert.same({ 2, 3 }, parts[2][1]:shape())
        for b = 1, 2 do
          local cx, cy = {}, {}
          for r = 0, 2 do
            for _, v in ipairs(row(parts[r][1], b)) do cx[#cx + 1] = v end
            for _, v in ipairs(row(parts[r][2], b)) do cy[#cy + 1] = v end
          end
          assert.same(row(fx, b), cx)
          assert.same(row(fy, b), cy)
          for r = 0, 1 do
            local y_last = row(parts[r][2], b)
            assert.equal(row(parts[r + 1][1], b)[1], y_last[#y_last])
          end
        end
      end
    end
  end)

  it('packs documents: per-position ids of the whole window, no target across a boundary, sharded too', function()
    -- dna.h5 train: A C G T A C G T A A | G G G G  (doc 0 = 11 tokens incl. the separator, doc 1 = 4)
    local L = uly.data.open(dna_h5, { seq = 13, batch = 1, random = false, documents = true })
    local x, y, docs = L:next()
    assert.are.same({ 0, 1, 2, 3, 0, 1, 2, 3, 0, 0, 5, 2, 2 }, list_of(x))
    assert.are.same({ 1, 2, 3, 0, 1, 2, 3, 0, 0, 5, -1, 2, 2 }, list_of(y))   -- '|' -> G is not a target
    assert.are.same({ 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1 }, list_of(docs))
    -- a shard gets the whole window's ids and its own masked targets
    local full = list_of(y)
    for r = 0, 2 do
      local S = uly.data.open(dna_h5, { seq = 13, batch = 1, random = false, documents = true, shard = { rank = r, size = 3 } })
      local xs, ys, ds = S:next()
      assert.are.same(list_of(docs), list_of(ds))
      assert.are.same(slice(full, S.offset + 1, S.hi), list_of(ys))
    end
    -- text files have no document table
    local ok, err = pcall(uly.data.open, tiny_h5, { seq = 4, documents = true })
    assert.is_false(ok)
    assert.truthy(err:find('train_doc_offsets', 1, true), err)
  end)

  it('decodes and encodes text bytes and DNA letters', function()
    local t = uly.data.open(tiny_h5, { seq = 4 })
    local ids = t:encode('Hi\n')
    assert.same({ 1, 3 }, ids:shape())
    assert.same({ 72, 105, 10 }, list_of(ids))
    assert.equal('Hi\n', t:decode(ids))
    assert.equal('AB', t:decode({ 65, 66 }))
    local d = uly.data.open(dna_h5, { seq = 4 })
    assert.equal('dna', d.kind)
    assert.equal(6, d.vocab_size)
    assert.equal('ACGTN|', d:decode({ 0, 1, 2, 3, 4, 5 }))
    assert.same({ 0, 1, 2, 3, 4, 5, 4, 3 }, list_of(d:encode('acgtn|R u')))
    local x = d:next()
    assert.matches('^[ACGTN|]+$', d:decode(x))
    assert.has_error(function() d:decode({ 6 }) end, 'decode: id 6 at position 1 is outside the vocabulary 0..5')
    assert.has_error(function() d:encode('ACQ') end)
    -- a batch is not one sequence: decode a row at a time
    local batch = uly.tensor({ { 0, 1 }, { 2, 3 } }, { dtype = 'i32' })
    assert.has_error(function() d:decode(batch) end,
                     'decode: ids i32[2, 2] hold 2 rows; decode one sequence at a time (ids[1], ids[2], ...: a string each)')
    assert.equal('GT', d:decode(batch[2]))
    assert.equal('AC', d:decode(batch:narrow(1, 1, 1)))
    -- a kind's codec without its file: the loader's alphabet and checks
    local ct, cd = uly.data.codec('text'), uly.data.codec('dna')
    assert.same({ 'text', 256, 'dna', 6 }, { ct.kind, ct.vocab_size, cd.kind, cd.vocab_size })
    assert.same(list_of(t:encode('Hi\n\255')), list_of(ct:encode('Hi\n\255')))
    assert.equal('Hi\n\255', ct:decode(ct:encode('Hi\n\255')))
    assert.same(list_of(d:encode('acgtn|R u')), list_of(cd:encode('acgtn|R u')))
    assert.equal('ACGTN|', cd:decode({ 0, 1, 2, 3, 4, 5 }))
    assert.has_error(function() cd:decode({ 6 }) end, 'decode: id 6 at position 1 is outside the vocabulary 0..5')
    assert.has_error(function() ct:decode({ 256 }) end, 'decode: id 256 at position 1 is outside the vocabulary 0..255')
    assert.has_error(function() cd:encode('AC>') end, "encode: character '>' at position 3 is not a nucleotide code (ACGTU, IUPAC, or '|')")
    assert.has_error(function() uly.data.codec('protein') end, "data.codec: kind must be 'text' or 'dna', got 'protein'")
    assert.equal('codec dna (vocab 6)', tostring(cd))
  end)

  it('refuses a file without a usable vocab_size or with garbage document offsets, naming them and the fix', function()
    -- a token file written by hand: 20 DNA-like tokens, root attributes `attrs`, and the train split's
    -- document offsets (values, dtype, shape) when given
    local function handmade(name, attrs, offsets, dtype, shape)
      local f = h5.create(path(name))
      for k, v in pairs(attrs) do f:set_attr('/', k, v) end
      local toks = ffi.new('uint8_t[20]')
      for i = 0, 19 do toks[i] = i % 4 end
      f:write_array('train', toks, 'u8', { 20 })
      if offsets then
        f:write_array('train_doc_offsets', ffi.new(dtype == 'f32' and 'float[?]' or 'int64_t[?]', #offsets, offsets),
                      dtype or 'i64', shape or { #offsets })
      end
      f:close()
      return path(name)
    end
    local function err_of(file, opts)
      local ok, e = pcall(function() local d = uly.data.open(file, opts or { seq = 4 }) return d end)
      assert.is_false(ok, file)
      assert.matches('data_spec.lua:%d+: ', tostring(e))
      return tostring(e)
    end
    local e = err_of(handmade('novocab.h5', { kind = 'text' }))
    assert.matches("data.open: '" .. path('novocab.h5') .. "' has no root attribute vocab_size (the number of token ids: "
                   .. "an integer in 1..256 for a text file); datasets/prepare.lua writes it, or add it to this file with "
                   .. "uly.h5.open(path, 'r+'):set_attr('/', 'vocab_size', 256)", e, 1, true)
    assert.matches('has the root attribute vocab_size = 0 (', err_of(handmade('vocab0.h5', { kind = 'text', vocab_size = 0 })), 1, true)
    assert.matches("vocab_size = 'many'", err_of(handmade('vocabs.h5', { kind = 'text', vocab_size = 'many' })), 1, true)
    assert.matches('vocab_size = 7 (the number of token ids: an integer in 1..6 for a dna file)',
                   err_of(handmade('vocab7.h5', { kind = 'dna', vocab_size = 7 })), 1, true)
    local dna = { kind = 'dna', vocab_size = 6 }
    assert.equal(6, uly.data.open(handmade('ok.h5', dna, { 0, 5, 19 }), { seq = 4, documents = true }).vocab_size)
    local docs = { seq = 4, documents = true }
    for _, c in ipairs({
      { { 0, 9, 5 }, nil, nil, "data.open: dataset 'train_doc_offsets' of '" .. path('bad.h5') .. "' holds 5 at entry 3: "
                               .. "document starts begin at 0 and increase, up to the split's 20 tokens; datasets/prepare.lua "
                               .. 'writes a valid one' },
      { { 0, 4, 4 }, nil, nil, 'holds 4 at entry 3' },
      { { 0, 30 }, nil, nil, 'holds 30 at entry 2' },
      { { 3, 9 }, nil, nil, 'holds 3 at entry 1' },
      { { -1 }, nil, nil, 'holds -1 at entry 1' },
      { { 0, 5.5 }, 'f32', nil, "dataset 'train_doc_offsets' of '" .. path('bad.h5') .. "' is f32 [2]; it must be 1-D i64, one start per document" },
      { { 0, 5, 9, 12 }, nil, { 2, 2 }, 'is i64 [2, 2]; it must be 1-D' },
    }) do
      assert.matches(c[4], err_of(handmade('bad.h5', dna, c[1], c[2], c[3]), docs), 1, true)
    end
    -- offsets are read only for documents = true
    assert.equal(20, uly.data.open(handmade('bad.h5', dna, { 0, 9, 5 }), { seq = 4 }).n_tokens)
  end)

  it('explains what is wrong with the file or the options', function()
    local function err_of(fn)
      local ok, e = pcall(fn)
      assert.is_false(ok)
      return tostring(e)
    end
    assert.matches("no such file '" .. path('absent.h5') .. "'", err_of(function() uly.data.open(path('absent.h5'), { seq = 4 }) end), 1, true)
    local fake = write('fake.h5', 'not an hdf5 file at all\n')
    assert.matches('cannot read .* as an HDF5 file', err_of(function() uly.data.open(fake, { seq = 4 }) end))
    local e = err_of(function() uly.data.open(tiny_h5, { seq = 4, split = 'valid' }) end)
    assert.matches("has no split 'valid' (token datasets there: train)", e, 1, true)
    e = err_of(function() uly.data.open(tiny_h5, { seq = 20 }) end)
    assert.matches("seq = 20 needs windows of 21 tokens, but split 'train'", e, 1, true)
    assert.matches('has only 20 tokens', e, 1, true)
    assert.matches('opts.seq', err_of(function() uly.data.open(tiny_h5, { batch = 2 }) end), 1, true)
    assert.matches('opts.batch', err_of(function() uly.data.open(tiny_h5, { seq = 4, batch = 0 }) end), 1, true)
    assert.matches("unknown option 'sequence'", err_of(function() uly.data.open(tiny_h5, { sequence = 4 }) end), 1, true)
    assert.matches("data.open: unknown option 'btach' (did you mean 'batch'?)",
                   err_of(function() uly.data.open(tiny_h5, { seq = 4, btach = 4 }) end), 1, true)
    assert.matches('opts.shard', err_of(function() uly.data.open(tiny_h5, { seq = 4, shard = { rank = 3, size = 3 } }) end), 1, true)
    assert.matches('5 sequence-parallel ranks cannot share seq = 4',
                   err_of(function() uly.data.open(tiny_h5, { seq = 4, shard = { rank = 0, size = 5 } }) end), 1, true)
    local d = uly.data.open(tiny_h5, { seq = 4 })
    assert.matches('field draws', err_of(function() d:set_state({ position = 0, epoch = 0 }) end), 1, true)
    assert.matches('data_spec.lua', err_of(function() uly.data.open(tiny_h5, { seq = -1 }) end), 1, true)
    d:close()
    assert.matches('closed', err_of(function() d:next() end), 1, true)
  end)
end)
