-- spec/h5_spec.lua — uly.h5 over core/h5.c: dataset round trips for every dtype (u8 read as i32,
-- bf16 kept bit-exact), 1-D and 2-D hyperslab reads against the same slice of the tensor, slab and
-- name errors that name the file, dataset and shape, attributes, listing, truncated and non-HDF5
-- files, read-only and closed files, and the atomic commit.
local uly = require 'ulysses'
local helpers = require 'helpers'
local ffi = require 'ffi'
local h5 = uly.h5

local shq = helpers.shq

local tmpdir
local function path(name) return tmpdir .. '/' .. name end

local function read_bytes(p)
  local fh = assert(io.open(p, 'rb'))
  local s = fh:read('*a')
  fh:close()
  return s
end

local function write_bytes(p, s)
  local fh = assert(io.open(p, 'wb'))
  fh:write(s)
  fh:close()
end

local exists = helpers.exists

local list = helpers.list   -- flat Lua list of a tensor's values (float64)

-- error message of fn(), which must fail
local error_of = helpers.error_of

local describe_h5 = h5.available and describe or pending

describe_h5('uly.h5', function()
  setup(function()
    tmpdir = helpers.mkdtemp()
  end)
  teardown(function()
    helpers.rmtree(tmpdir)
  end)
  before_each(function() helpers.reseed(5101) end)

  it('round-trips f32, f64, i32, i64 and bf16 tensors bit-exactly and reports their dtypes', function()
    local p = path('dtypes.h5')
    local f = h5.create(p)
    local src = {
      f32 = uly.randn(3, 5),
      f64 = uly.tensor({ 0.1, 1 / 3, -2.5e-300, 1e300 }, { dtype = 'f64' }),
      i32 = uly.tensor({ { -2147483648, 7 }, { 2147483647, 0 } }, { dtype = 'i32' }),
      i64 = uly.tensor({ 2 ^ 40 + 3, -(2 ^ 50) - 1, 5 }, { dtype = 'i64' }),
      bf16 = uly.randn(4, 3):to('bf16'),
    }
    for name, t in pairs(src) do f:write('t/' .. name, t) end
    f:close()

    f = h5.open(p)
    for name, t in pairs(src) do
      local info = f:info('t/' .. name)
      assert.are.same({ shape = t:shape(), dtype = name }, info)
      local back = f:read('t/' .. name, nil, nil, { dtype = name })
      assert.are.equal(name, back:dtype())
      assert.are.same(t:shape(), back:shape())
      assert.are.same(list(t), list(back))
    end
    -- defaults: float data -> f32, integer data -> i32; bf16 widened exactly
    assert.are.equal('f32', f:read('t/f64'):dtype())
    assert.are.equal('i32', f:read('t/i32'):dtype())
    local widened = f:read('t/bf16')
    assert.are.equal('f32', widened:dtype())
    assert.are.same(list(src.bf16), list(widened))
    -- bf16 read as f64 is widened exactly too
    assert.are.same(list(src.bf16), list(f:read('t/bf16', nil, nil, { dtype = 'f64' })))
    f:close()
  end)

  it('stores bf16 as u16 with the uly_dtype attribute, and rounds f32 to bf16 on read', function()
    local p = path('bf16.h5')
    local f = h5.create(p)
    f:write('b', uly.tensor({ 1, 2, 3 }):to('bf16'))
    f:write('x', uly.tensor({ 1 + 2 ^ -8, 1 + 3 * 2 ^ -8 })) -- halfway cases: round to even
    assert.are.equal('bf16', f:attr('b', 'uly_dtype'))
    local raw = ffi.new('uint16_t[3]')
    f:read_ptr('b', nil, nil, raw, 'bf16')
    assert.are.same({ 0x3f80, 0x4000, 0x4040 }, { raw[0], raw[1], raw[2] })
    assert.are.same({ 1, 1 + 2 ^ -6 }, list(f:read('x', nil, nil, { dtype = 'bf16' })))
    f:close()
  end)

  it('writes u8 arrays and converts them to i32 (default) or f32 on read', function()
    local p = path('u8.h5')
    local f = h5.create(p)
    local n = 300
    local bytes = ffi.new('uint8_t[?]', n)
    for i = 0, n - 1 do bytes[i] = (i * 37) % 256 end
    f:write_array('tokens/train', bytes, 'u8', { n })
    f:close()
    f = h5.open(p)
    assert.are.same({ shape = { n }, dtype = 'u8' }, f:info('tokens/train'))
    local t = f:read('tokens/train')
    assert.are.equal('i32', t:dtype())
    local expect = {}
    for i = 0, n - 1 do expect[i + 1] = (i * 37) % 256 end
    assert.are.same(expect, list(t))
    assert.are.same({ expect[11], expect[12], expect[13] }, list(f:read('tokens/train', { 10 }, { 3 }, { dtype = 'f32' })))
    local back = ffi.new('uint8_t[4]')
    f:read_ptr('tokens/train', { 250 }, { 4 }, back, 'u8')
    for i = 0, 3 do assert.are.equal(bytes[250 + i], back[i]) end
    f:close()
  end)

  it('reads 1-D and 2-D hyperslabs equal to the same slice of the tensor', function()
    local p = path('slab.h5')
    local f = h5.create(p)
    local a = uly.arange(0, 100, { dtype = 'i32' })
    local m = uly.randn(7, 9)
    f:write('a', a)
    f:write('g/m', m)
    f:close()
    f = h5.open(p)
    assert.are.same(list(a:narrow(1, 18, 20)), list(f:read('a', { 17 }, { 20 })))
    assert.are.same(list(a:narrow(1, 91, 10)), list(f:read('a', { 90 })))  -- count: to the end
    local s = f:read('g/m', { 2, 3 }, { 4, 5 })
    assert.are.same({ 4, 5 }, s:shape())
    assert.are.same(list(m:narrow(1, 3, 4):narrow(2, 4, 5)), list(s))
    assert.are.same(list(m:narrow(1, 7, 1)), list(f:read('g/m', { 6, 0 }, { 1, 9 })))
    -- into an existing tensor
    local rows = uly.zeros(2, 9)
    assert.are.equal(rows, f:read('g/m', { 1, 0 }, { 2, 9 }, { out = rows }))
    assert.are.same(list(m:narrow(1, 2, 2)), list(rows))
    local out = uly.zeros(20)
    f:read('a', { 0 }, { 20 }, { out = out })
    assert.are.same(list(a:narrow(1, 1, 20)), list(out))
    assert.are.same({}, list(f:read('a', { 100 }, { 0 })))
    f:close()
  end)

  it('refuses out-of-range slabs with the dataset, its shape and the file in the message', function()
    local p = path('range.h5')
    local f = h5.create(p)
    f:write('g/m', uly.zeros(7, 9))
    local err = error_of(function() f:read('g/m', { 5, 0 }, { 3, 9 }) end)
    assert.matches("out of range for dataset 'g/m' of shape %[7, 9%]", err)
    assert.matches(p, err, 1, true)
    assert.matches('start %[5, 0%] count %[3, 9%]', err)
    assert.matches('out of range', error_of(function() f:read('g/m', { -1, 0 }, { 1, 1 }) end))
    assert.matches('has 2 dimensions', error_of(function() f:read('g/m', { 0, 0, 0 }, { 1, 1, 1 }) end))
    assert.matches('out of range', error_of(function() f:read('g/m', { 0, 0 }, { 8, 1 }) end))
    f:close()
  end)

  it('names the dataset and the file when a dataset is missing, at the caller line', function()
    local p = path('missing.h5')
    local f = h5.create(p)
    f:write('model/w', uly.zeros(2))
    local err = error_of(function() f:read('model/v') end)
    assert.matches("dataset 'model/v' not found in " .. p, err, 1, true)
    assert.matches('h5_spec.lua:%d+:', err)
    assert.matches("dataset 'nope/x' not found", error_of(function() f:read_into('nope/x', uly.zeros(2)) end), 1, true)
    assert.matches("'model' in .* is a group", error_of(function() f:read('model') end))
    assert.is_nil(f:info('model/v'))
    assert.is_false(f:exists('model/v'))
    assert.is_false(f:exists('nope/deeper/x'))
    assert.is_true(f:exists('model'))
    assert.is_true(f:exists('model/w'))
    f:close()
  end)

  it('read_into checks the shape exactly and converts the dtype', function()
    local p = path('into.h5')
    local f = h5.create(p)
    local w = uly.randn(3, 4)
    f:write('w', w)
    local err = error_of(function() f:read_into('w', uly.zeros(4, 3)) end)
    assert.matches('%[3, 4%]', err)
    assert.matches('f32%[4, 3%]', err)
    local d = f:read_into('w', uly.zeros(3, 4, { dtype = 'f64' }))
    assert.are.same(list(w), list(d))
    assert.matches('contiguous', error_of(function() f:read_into('w', uly.zeros(4, 3):transpose(1, 2)) end))
    f:close()
  end)

  it('writes each dataset once, and refuses writes to read-only or closed files', function()
    local p = path('once.h5')
    local f = h5.create(p)
    f:write('a/b', uly.zeros(2))
    assert.matches("'a/b' already exists", error_of(function() f:write('a/b', uly.zeros(2)) end))
    assert.matches('a dataset', error_of(function() f:write('a/b/c', uly.zeros(2)) end))
    f:write('scalar', uly.tensor(3.5))
    f:write('empty', uly.zeros(0, 3))
    f:close()
    f:close() -- a second close is harmless
    assert.matches('was closed', error_of(function() f:read('a/b') end))
    f = h5.open(p)
    assert.are.same({ 3.5 }, list(f:read('scalar')))
    assert.are.same({ shape = { 0, 3 }, dtype = 'f32' }, f:info('empty'))
    assert.matches('read%-only', error_of(function() f:write('c', uly.zeros(1)) end))
    f:close()
    f = h5.open(p, 'r+')
    f:write('c', uly.ones(1))
    f:close()
    assert.are.same({ 1 }, list(h5.open(p):read('c')))
    assert.matches("mode must be 'r' or 'r%+'", error_of(function() h5.open(p, 'w') end))
  end)

  it('round-trips string and number attributes on the file, groups and datasets', function()
    local p = path('attrs.h5')
    local f = h5.create(p)
    f:write('g/d', uly.zeros(1))
    local long = string.rep('0123456789', 10000) .. '\n"quoted"'
    f:set_attr('', 'name', 'run 7')
    f:set_attr('/', 'lr', 3e-4)
    f:set_attr('g', 'long', long)
    f:set_attr('g/d', 'scale', -0.1)
    f:set_attr('g/d', 'scale', 2.5) -- overwrite
    f:set_attr('g/d', 'note', '')
    f:close()
    f = h5.open(p)
    assert.are.equal('run 7', f:attr('/', 'name'))
    assert.are.equal(3e-4, f:attr('', 'lr'))
    assert.are.equal(long, f:attr('g', 'long'))
    assert.are.equal(2.5, f:attr('g/d', 'scale'))
    assert.are.equal('', f:attr('g/d', 'note'))
    assert.is_nil(f:attr('', 'missing'))
    assert.is_nil(f:attr('g/d', 'name'))
    assert.matches("no object 'nope'", error_of(function() f:attr('nope', 'x') end))
    assert.matches('string or a number', error_of(function() f:set_attr('', 'x', true) end))
    f:close()
  end)

  it('lists datasets recursively, sorted, with full paths', function()
    local p = path('list.h5')
    local f = h5.create(p)
    assert.are.same({}, f:list())
    for _, name in ipairs({ 'model/b.weight', 'optim/exp_avg/a', 'model/a.bias', 'model/a/deep', 'top' }) do
      f:write(name, uly.zeros(1))
    end
    assert.are.same({ 'model/a.bias', 'model/a/deep', 'model/b.weight', 'optim/exp_avg/a', 'top' }, f:list())
    assert.are.same({ 'model/a.bias', 'model/a/deep', 'model/b.weight' }, f:list('model'))
    assert.are.same({ 'optim/exp_avg/a' }, f:list('/optim'))
    assert.matches("no group 'nope'", error_of(function() f:list('nope') end))
    f:close()
  end)

  it('refuses a truncated file, a text file named .h5 and a missing file with clear messages', function()
    local p = path('whole.h5')
    local f = h5.create(p)
    f:write('w', uly.randn(64, 64))
    f:close()
    local bytes = read_bytes(p)
    local cut = path('cut.h5')
    write_bytes(cut, bytes:sub(1, math.floor(#bytes / 2)))
    local err = error_of(function() h5.open(cut) end)
    assert.matches(cut, err, 1, true)
    assert.matches('truncated', err)
    local txt = path('notes.h5')
    write_bytes(txt, 'these are notes, not HDF5\n')
    assert.matches(txt .. ' is not an HDF5 file', error_of(function() h5.open(txt) end), 1, true)
    assert.matches('No such file', error_of(function() h5.open(path('absent.h5')) end))
    assert.matches('directory', error_of(function() h5.create(path('no/such/dir.h5')) end))
    -- the intact file still reads
    assert.are.same({ 64, 64 }, h5.open(p):info('w').shape)
  end)

  it('closes a file that is dropped without close() when it is collected', function()
    local p = path('dropped.h5')
    local f = h5.create(p)
    f:write('w', uly.zeros(2))
    f = nil -- luacheck: ignore
    collectgarbage('collect')
    collectgarbage('collect')
    -- HDF5 refuses to truncate a file that is still open in this process
    local again = h5.create(p)
    again:close()
    assert.are.same({}, h5.open(p):list())
  end)

  it('commit replaces the final file with the temporary one', function()
    local final, tmp = path('ckpt.h5'), path('ckpt.h5.tmp')
    local f = h5.create(final)
    f:set_attr('', 'version', 'old')
    f:close()
    f = h5.create(tmp)
    f:set_attr('', 'version', 'new')
    f:close()
    h5.commit(tmp, final)
    assert.is_false(exists(tmp))
    assert.are.equal('new', h5.open(final):attr('', 'version'))
    local err = error_of(function() h5.commit(path('gone.tmp'), final) end)
    assert.matches('gone.tmp', err, 1, true)
    assert.matches('No such file', err)
    assert.are.equal('new', h5.open(final):attr('', 'version'))
  end)
end)

-- these hold in every build, with or without HDF5
describe('uly.h5 in any build', function()
  it('commits plain files atomically (no HDF5 needed)', function()
    local dir = os.tmpname()
    os.remove(dir)
    assert(os.execute('mkdir -p ' .. shq(dir)))
    write_bytes(dir .. '/final.txt', 'old')
    write_bytes(dir .. '/final.txt.tmp', 'new')
    h5.commit(dir .. '/final.txt.tmp', dir .. '/final.txt')
    assert.are.equal('new', read_bytes(dir .. '/final.txt'))
    assert.is_false(exists(dir .. '/final.txt.tmp'))
    local err = error_of(function() h5.commit(dir .. '/missing.tmp', dir .. '/final.txt') end)
    assert.matches("cannot open '" .. dir .. "/missing.tmp': No such file", err, 1, true)
    os.execute('rm -rf ' .. shq(dir))
  end)

  if not h5.available then
    it('says the library was built without HDF5', function()
      assert.matches('built without HDF5', error_of(function() h5.create(os.tmpname() .. '.h5') end))
      assert.matches('built without HDF5', error_of(function() h5.open('whatever.h5') end))
    end)
  end
end)
