-- spec/safetensors_spec.lua — uly.safetensors: round trips in every dtype, the exact bytes of a
-- small file (the format's layout), a model saved and loaded into another, a file written by
-- another program (Python's json and struct: F16, escaped names), errors that name the file and
-- tensor, and atomic saves. (The JSON reader itself: spec/json_spec.lua.)
local ffi = require 'ffi'
local uly = require 'ulysses'
local helpers = require 'helpers'
local GPT = require 'models.gpt'
local st = uly.safetensors

local function bytes_of(t) return ffi.string(uly.C.uly_tensor_data_ptr(t._h), t:nbytes()) end
local function err_of(fn, ...) return helpers.error_of(fn, ...) end

-- a file made of a header (a Lua string of JSON) and data bytes, as another writer would
local function raw_file(path, header, data)
  local n = #header
  local len = {}
  for i = 1, 8 do len[i] = string.char(n % 256); n = math.floor(n / 256) end
  helpers.write_file(path, table.concat(len) .. header .. (data or ''))
end

describe('uly.safetensors', function()
  local dir
  before_each(function() helpers.reseed(5); dir = helpers.mkdtemp() end)
  after_each(function() helpers.rmtree(dir) end)

  it('round-trips every dtype and shape bit for bit, names of any characters, and metadata', function()
    local tensors = {
      w = uly.randn(3, 5),
      ['h.bf16'] = uly.randn(2, 7):bf16(),
      d = uly.randn(4, { dtype = 'f64' }),
      ids = uly.tensor({ 1, -2, 2147483647 }, { dtype = 'i32' }),
      big = uly.tensor({ 2 ^ 40, -3 }, { dtype = 'i64' }),
      scalar = uly.tensor(2.5),
      empty = uly.zeros(0, 5),
      ['name "quoted" \\ ü\n\t'] = uly.randn(1, 1, 3),
    }
    local path = dir .. '/all.safetensors'
    st.save(path, tensors, { metadata = { format = 'pt', ['note "x"'] = 'line\nline' } })
    local back, meta = st.load(path)
    local n = 0
    for name, t in pairs(tensors) do
      local b = back[name]
      assert.is_truthy(b, 'missing ' .. name)
      assert.are.equal(t:dtype(), b:dtype(), name)
      assert.are.same(t:shape(), b:shape(), name)
      assert.are.equal(bytes_of(t), bytes_of(b), name)
      assert.are.equal('cpu', b:device())
      n = n + 1
    end
    local m = 0
    for _ in pairs(back) do m = m + 1 end
    assert.are.equal(n, m)
    assert.are.same({ format = 'pt', ['note "x"'] = 'line\nline' }, meta)
  end)

  it('writes the format\'s layout exactly: length, JSON header padded to 8 bytes, then the data', function()
    local path = dir .. '/small.safetensors'
    st.save(path, { w = uly.tensor({ 1.5, -2 }), b = uly.tensor({ 7 }, { dtype = 'i32' }) }, { metadata = { format = 'pt' } })
    local header = '{"__metadata__":{"format":"pt"},"b":{"dtype":"I32","shape":[1],"data_offsets":[0,4]},'
                   .. '"w":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}'
    header = header .. string.rep(' ', (8 - #header % 8) % 8)
    local data = ffi.string(ffi.new('int32_t[1]', 7), 4) .. ffi.string(ffi.new('float[2]', { 1.5, -2 }), 8)
    local len = ffi.string(ffi.new('uint64_t[1]', #header), 8)
    assert.are.equal(len .. header .. data, helpers.read_file(path))
    assert.are.equal(0, (8 + #header) % 8)
    local h, meta = st.header(path)
    assert.are.same({ dtype = 'F32', shape = { 2 }, offsets = { 4, 12 } }, h.w)
    assert.are.same({ format = 'pt' }, meta)
  end)

  it('saves a model and loads it into another: the same parameters and outputs', function()
    local a = GPT { preset = 'tiny' }
    helpers.reseed(6)
    local b = GPT { preset = 'tiny' }
    local path = dir .. '/gpt.safetensors'
    st.save(path, a, { metadata = { model = 'gpt tiny' } })
    local h = st.header(path)
    assert.are.same({ 32, 96 }, h['blocks.1.attn.wqkv.weight'].shape)
    local r = st.load_into(b, path)
    local names = {}
    for name in a:named_parameters() do names[#names + 1] = name end
    assert.are.same(names, r.loaded)
    assert.are.same({}, r.missing)
    assert.are.same({}, r.unexpected)
    local pa = {}
    for name, p in a:named_parameters() do pa[name] = p end
    for name, p in b:named_parameters() do assert.are.equal(bytes_of(pa[name]), bytes_of(p), name) end
    local x = helpers.token_ids(2, 9, 256)
    assert.are.equal(bytes_of(a(x)), bytes_of(b(x)))
  end)

  it('reads a file another program wrote (Python: spaced JSON, \\u escapes, F16, BF16, F64)', function()
    local python = 'env -u LD_PRELOAD python3'   -- without the sanitizer pass's preloaded runtime
    if select(2, helpers.run(python .. ' -c "import json, struct"')) ~= 0 then
      pending('no python3 here to write the file')
    end
    local path = dir .. '/py.safetensors'
    local script = dir .. '/write.py'
    helpers.write_file(script, [[
import json, struct, sys
halves = [0x3C00, 0xC000, 0x0001, 0x7BFF, 0x7C00, 0x8000, 0x3555]   # 1, -2, 2^-24, 65504, inf, -0, ~1/3
data = struct.pack('<7H', *halves) + struct.pack('<2H', 0x3F80, 0xC040) + struct.pack('<d', 0.1)
header = {
    'half \U0001F600 \u00e9': {'dtype': 'F16', 'shape': [7], 'data_offsets': [0, 14]},
    'bf': {'dtype': 'BF16', 'shape': [2, 1], 'data_offsets': [14, 18]},
    'dbl': {'dtype': 'F64', 'shape': [], 'data_offsets': [18, 26]},
    '__metadata__': {'format': 'pt', 'who': 'caf\u00e9 \u2603'},
}
text = json.dumps(header)      # ", " and ": " separators, non-ASCII as \u escapes
open(sys.argv[1], 'wb').write(struct.pack('<Q', len(text)) + text.encode() + data)
]])
    local out, code = helpers.run(python .. ' ' .. helpers.shq(script) .. ' ' .. helpers.shq(path))
    assert.are.equal(0, code, out)
    local t, meta = st.load(path)
    local half = t['half \240\159\152\128 \195\169']
    assert.is_truthy(half, 'the escaped name (a surrogate pair and a Latin letter) decoded to UTF-8')
    assert.are.equal('f32', half:dtype())
    local v = helpers.list(half)
    assert.are.same({ 1, -2, 2 ^ -24, 65504, math.huge, 0, (1 + 0x155 / 1024) / 4 }, { v[1], v[2], v[3], v[4], v[5], v[6],
                                                                                    v[7] })
    assert.are.equal(-math.huge, 1 / v[6], '-0 keeps its sign')
    assert.are.same({ 1, -3 }, helpers.list(t.bf:to('f32')))
    assert.are.same({ 2, 1 }, t.bf:shape())
    assert.are.equal(0.1, t.dbl:item())
    assert.are.same({}, t.dbl:shape())
    assert.are.same({ format = 'pt', who = 'caf\195\169 \226\152\131' }, meta)
  end)

  it('refuses broken files, naming the file, the tensor and what is wrong', function()
    local p = dir .. '/bad.safetensors'
    local function expect(header, data, what)
      raw_file(p, header, data)
      local err = err_of(st.load, p)
      assert.matches(p, err, 1, true)
      assert.matches(what, err, 1, true)
    end
    expect('{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', string.rep('\0', 7), 'the file is truncated')
    expect('{"w":{"dtype":"F8_E4M3","shape":[2],"data_offsets":[0,2]}}', '\0\0', 'tensor "w": dtype F8_E4M3 is not one')
    expect('{"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}', string.rep('\0', 8), 'shape [3] of F32 takes 12 bytes')
    expect('{"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}', string.rep('\0', 8), 'a hole')
    expect('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}',
           string.rep('\0', 8), 'overlapping')
    expect('{"w": [1, 2', '', 'its header is not JSON')
    expect('{"__metadata__":{"n":1}}', '', 'metadata "n" is a number')
    expect('[1, 2]', '', 'not a JSON object')
    helpers.write_file(p, '\1\0\0\0\0\0\0\0')
    assert.matches('runs past the end of the file', err_of(st.load, p), 1, true)
    helpers.write_file(p, 'abc')
    assert.matches('fewer than the 8 of its header length', err_of(st.load, p), 1, true)
    assert.matches("cannot open for reading '" .. dir .. "/none.safetensors'", err_of(st.load, dir .. '/none.safetensors'), 1, true)
  end)

  it('save refuses what the format cannot hold, before writing anything', function()
    local p = dir .. '/s.safetensors'
    assert.matches('metadata n = 1: the format holds strings only', err_of(st.save, p, { w = uly.ones(2) }, { metadata = { n = 1 } }), 1, true)
    assert.matches('"w" is a number, not a tensor', err_of(st.save, p, { w = 3 }), 1, true)
    assert.matches('"__metadata__" cannot name a tensor', err_of(st.save, p, { __metadata__ = uly.ones(1) }), 1, true)
    assert.matches("did you mean 'metadata'", err_of(st.save, p, { w = uly.ones(1) }, { metdata = {} }), 1, true)
    assert.matches('cannot open for writing', err_of(st.save, dir .. '/no/such/dir/x.safetensors', { w = uly.ones(1) }), 1, true)
    assert.is_nil(helpers.read_file(p))
  end)

  it('a save that fails midway leaves the old file as it was and no temporary file', function()
    local p = dir .. '/m.safetensors'
    st.save(p, { a = uly.ones(3), b = uly.zeros(2) })
    local before = helpers.read_file(p)
    st._test_hook = function(name) if name == 'a' then error('disk full (simulated)') end end
    local ok, err = pcall(st.save, p, { a = uly.randn(3), b = uly.randn(2) })
    st._test_hook = nil
    assert.is_false(ok)
    assert.matches('disk full', tostring(err), 1, true)
    assert.are.equal(before, helpers.read_file(p))
    local out = helpers.run('ls -A ' .. helpers.shq(dir))
    assert.are.equal('m.safetensors\nexit=0\n', out)
  end)

  it('works in a process whose code declared stdio with its own FILE type first', function()
    local p = dir .. '/f.safetensors'
    local code = string.format([[
      local ffi = require 'ffi'
      ffi.cdef 'typedef struct FILE FILE; FILE *fopen(const char *, const char *); int fclose(FILE *);'
      local uly = require 'ulysses'
      uly.safetensors.save(%q, { a = uly.ones(3) })
      io.write('sum ', uly.safetensors.load(%q).a:sum():item(), '\n')]], p, p)
    local out, rc = helpers.run('bin/ulysses -e ' .. helpers.shq(code))
    assert.are.equal(0, rc, out)
    assert.truthy(out:find('sum 3', 1, true), out)
  end)

  it('tools/inspect.lua lists a file\'s tensors, sizes and metadata (safetensors, a checkpoint)', function()
    local p = dir .. '/t.safetensors'
    st.save(p, { ['a.weight'] = uly.zeros(3, 4), b = uly.zeros(5, { dtype = 'i64' }) }, { metadata = { format = 'pt' } })
    local out, rc = helpers.run('bin/ulysses tools/inspect.lua ' .. helpers.shq(p))
    assert.are.equal(0, rc, out)
    assert.truthy(out:find(p .. ': safetensors, 2 tensors, 17 elements, 88 B', 1, true), out)
    assert.truthy(out:find('a.weight  F32    [3, 4]              48 B', 1, true), out)
    assert.truthy(out:find('b         I64    [5]                 40 B', 1, true), out)
    assert.truthy(out:find('metadata:\n  format = pt', 1, true), out)
    if uly.has('hdf5') then
      local c = dir .. '/c.h5'
      uly.checkpoint.save(c, { model = GPT { preset = 'tiny' }, step = 7 })
      out, rc = helpers.run('bin/ulysses tools/inspect.lua ' .. helpers.shq(c))
      assert.are.equal(0, rc, out)
      assert.truthy(out:find(c .. ': HDF5, ulysses-checkpoint, 28 tensors', 1, true), out)
      assert.truthy(out:find('model/wte.weight', 1, true), out)
      assert.truthy(out:find('  step = 7', 1, true), out)
    end
    out, rc = helpers.run('bin/ulysses tools/inspect.lua ' .. helpers.shq(dir))
    assert.are.equal(2, rc, out)
    assert.truthy(out:find('tools/inspect.lua: ' .. dir .. ' is a directory: give a file in it', 1, true), out)
    out, rc = helpers.run('bin/ulysses tools/inspect.lua ' .. helpers.shq(dir .. '/none'))
    assert.are.equal(2, rc, out)
    assert.truthy(out:find("tools/inspect.lua: cannot open '" .. dir .. "/none' for reading", 1, true), out)
  end)

  it('load_into checks every name, shape and dtype before changing a parameter', function()
    local m = GPT { preset = 'tiny' }
    local before = {}
    for name, p in m:named_parameters() do before[name] = bytes_of(p) end
    local function unchanged()
      for name, p in m:named_parameters() do assert.are.equal(before[name], bytes_of(p), name) end
    end
    local p = dir .. '/l.safetensors'
    -- one wrong shape among right ones: an error naming both shapes, nothing loaded
    local good = {}
    for name, t in m:named_parameters() do good[name] = uly.randn(t:shape()) end
    good['ln_f.weight'] = uly.randn(31)
    st.save(p, good)
    local err = err_of(st.load_into, m, p)
    assert.matches('tensor "ln_f.weight" is F32 [31], parameter "ln_f.weight" is f32 [32]', err, 1, true)
    unchanged()
    -- missing and unexpected names: strict refuses, listing them; strict = false loads the rest
    good['ln_f.weight'] = nil
    good['extra.weight'] = uly.ones(2)
    st.save(p, good)
    err = err_of(st.load_into, m, p)
    assert.matches('1 parameters of the model are not in it: "ln_f.weight"', err, 1, true)
    assert.matches('1 tensors in it are not parameters of the model: "extra.weight"', err, 1, true)
    unchanged()
    local r = st.load_into(m, p, { strict = false })
    assert.are.same({ 'ln_f.weight' }, r.missing)
    assert.are.same({ 'extra.weight' }, r.unexpected)
    for name, t in m:named_parameters() do
      if name ~= 'ln_f.weight' then assert.are.equal(bytes_of(good[name]), bytes_of(t), name) end
    end
    assert.are.equal(before['ln_f.weight'], bytes_of(m.ln_f.weight))
    -- rename maps a file's names onto the model's; integer tensors do not load into f32 ones
    st.save(p, { ['transformer.ln_f.weight'] = uly.full({ 32 }, 3) })
    r = st.load_into(m, p, { strict = false, rename = function(n) return (n:gsub('^transformer%.', '')) end })
    assert.are.same({ 'ln_f.weight' }, r.loaded)
    assert.are.same({ 3, 3 }, { helpers.list(m.ln_f.weight)[1], helpers.list(m.ln_f.weight)[32] })
    st.save(p, { ['ln_f.weight'] = uly.zeros(32, { dtype = 'i32' }) })
    assert.matches('tensor "ln_f.weight" is I32, parameter "ln_f.weight" is f32', err_of(st.load_into, m, p, { strict = false }), 1, true)
    -- a bf16 file loads into f32 parameters (converted exactly)
    st.save(p, { ['ln_f.weight'] = uly.full({ 32 }, 0.375):bf16() })
    st.load_into(m, p, { strict = false })
    assert.are.equal(0.375, helpers.list(m.ln_f.weight)[7])
  end)
end)
