-- spec/checkpoint_spec.lua — uly.checkpoint: bit-exact round trips of an nn model, AdamW and SGD
-- state, the RNG and saved tables; load checks (shapes, missing/extra parameters, optimizer kind)
-- that leave the model untouched; corrupt, truncated and missing files; saves that fail midway
-- leaving the previous checkpoint and no temporary file; rotation and latest().
local uly = require 'ulysses'
local helpers = require 'helpers'
local ckpt = uly.checkpoint
local h5 = uly.h5
local nn = uly.nn

local shq = helpers.shq

local tmpdir
local function path(name) return tmpdir .. '/' .. name end

local function dir_entries(dir)
  local out = {}
  local p = assert(io.popen('ls -A ' .. shq(dir)))
  for line in p:lines() do out[#out + 1] = line end
  p:close()
  table.sort(out)
  return out
end

local values = helpers.list

-- name -> flat values of every parameter
local function snapshot(model)
  local out = {}
  for name, p in model:named_parameters() do out[name] = values(p) end
  return out
end

local error_of = helpers.error_of

local function make_model(hidden)
  return nn.Sequential(nn.Linear(5, hidden or 7), nn.LayerNorm(hidden or 7), nn.Linear(hidden or 7, 3))
end

local function train(model, opt, steps)
  for _ = 1, steps do
    opt:zero_grad()
    local loss = model(uly.randn(4, 5)):pow(2):mean()
    loss:backward()
    opt:step()
  end
end

local describe_h5 = h5.available and describe or pending

describe_h5('uly.checkpoint', function()
  setup(function()
    tmpdir = helpers.mkdtemp()
  end)
  teardown(function()
    ckpt._test_hook = nil
    helpers.rmtree(tmpdir)
  end)
  before_each(function() helpers.reseed(7301) end)

  it('save makes the checkpoint directory when it is missing', function()
    local m = uly.nn.Linear(3, 2)
    local target = path('new/nested/dir/step1.h5')
    ckpt.save(target, { model = m, step = 1 })
    local m2 = uly.nn.Linear(3, 2)
    assert.are.equal(1, ckpt.load(target, { model = m2 }).step)
    helpers.assert_close(m2.weight, m.weight, 0, 0)
  end)

  it('round-trips model and AdamW state bit-exactly into a differently initialised model', function()
    local model = make_model()
    local opt = uly.optim.AdamW(model:parameters(), { lr = 2e-3, weight_decay = 0.05 })
    train(model, opt, 2)
    local p = path('adamw.h5')
    ckpt.save(p, { model = model, optim = opt, step = 2 })

    helpers.reseed(99)
    local fresh = make_model()
    local opt2 = uly.optim.AdamW(fresh:parameters(), { lr = 1, weight_decay = 0.05 })
    assert.are_not.same(snapshot(model), snapshot(fresh))
    local info = ckpt.load(p, { model = fresh, optim = opt2 })
    assert.are.equal(2, info.step)
    assert.are.equal('AdamW', info.optim_kind)
    assert.are.same(snapshot(model), snapshot(fresh))
    assert.are.equal(2, opt2.step_count)
    assert.are.equal(2e-3, opt2.lr)
    for _, key in ipairs({ 'exp_avg', 'exp_avg_sq' }) do
      for i = 1, #opt.params do assert.are.same(values(opt.state[key][i]), values(opt2.state[key][i])) end
    end
    -- training continues identically from the loaded state
    helpers.reseed(5)
    train(model, opt, 1)
    helpers.reseed(5)
    train(fresh, opt2, 1)
    assert.are.same(snapshot(model), snapshot(fresh))
    -- the layout h5py / h5dump users see
    local f = h5.open(p)
    local names = f:list()
    assert.is_truthy(f:exists('model/1.weight'))
    assert.is_truthy(f:exists('optim/exp_avg_sq/3.bias'))
    assert.are.equal(6 * 3, #names)
    assert.are.equal('ulysses-checkpoint', f:attr('', 'format'))
    f:close()
  end)

  it('round-trips SGD momentum buffers', function()
    local model = make_model()
    local opt = uly.optim.SGD(model:parameters(), { lr = 0.1, momentum = 0.9 })
    train(model, opt, 2)
    local p = path('sgd.h5')
    ckpt.save(p, { model = model, optim = opt, step = 2 })
    local fresh = make_model()
    local opt2 = uly.optim.SGD(fresh:parameters(), { lr = 0.5, momentum = 0.9 })
    ckpt.load(p, { model = fresh, optim = opt2 })
    for i = 1, #opt.params do
      assert.are.same(values(opt.state.momentum_buf[i]), values(opt2.state.momentum_buf[i]))
    end
    assert.are.equal(0.1, opt2.lr)
    -- loading SGD state into AdamW is refused before anything changes
    local other = make_model()
    local before = snapshot(other)
    local err = error_of(function()
      ckpt.load(p, { model = other, optim = uly.optim.AdamW(other:parameters()) })
    end)
    assert.matches('optimizer kind: SGD in the file, AdamW here', err, 1, true)
    assert.are.same(before, snapshot(other))
  end)

  it('restores the random generator and returns config, data and extra exactly', function()
    local model = make_model()
    uly.randn(17) -- move the generator along
    local config = { layers = 4, lr = 0.1, name = 'gpt "small"\nv2', flags = { true, false }, betas = { 0.9, 0.95 },
                     ['odd key'] = 1 / 3, big = 2 ^ 53 + 2, tiny = 5e-324 }
    local data = { epoch = 3, position = 123456789012, files = { 'a.h5', 'b.h5' } }
    local p = path('rng.h5')
    ckpt.save(p, { model = model, step = 41, config = config, data = data, extra = { note = 'x' } })
    local after_save = values(uly.randn(8))
    uly.manual_seed(1)
    uly.randn(3)
    local info = ckpt.load(p, { model = make_model() })
    assert.are.same(after_save, values(uly.randn(8)))
    assert.are.same(config, info.config)
    assert.are.same(data, info.data)
    assert.are.same({ note = 'x' }, info.extra)
    assert.are.equal(41, info.step)
    assert.are.equal(uly.version, info.library_version)
  end)

  it('serialises tables deterministically and refuses what it cannot save', function()
    local t = { z = 1, a = { 3, 2, 1 }, [10] = 'ten', [true] = 0.1 }
    assert.are.equal('{[10]="ten",a={3,2,1},z=1,[true]=0.10000000000000001}', ckpt.serialize(t))
    assert.are.same(t, ckpt.deserialize(ckpt.serialize(t)))
    assert.are.equal(ckpt.serialize({ b = 1, a = 2 }), ckpt.serialize({ a = 2, b = 1 }))
    local inf = ckpt.deserialize(ckpt.serialize({ 1 / 0, -1 / 0 }))
    assert.are.same({ math.huge, -math.huge }, inf)
    assert.matches('config.fn is a function', error_of(function() ckpt.serialize({ fn = print }, 'config') end))
    local cyc = {}
    cyc.self = cyc
    assert.matches('refers to itself', error_of(function() ckpt.serialize(cyc, 'config') end))
    -- saved strings are evaluated with no globals
    assert.matches('could not be evaluated', error_of(function() ckpt.deserialize('os.exit(1)', 'config') end))
  end)

  it('refuses at save a value that could not be loaded back: too deep, or too many tables', function()
    local function nest(depth) -- depth tables, each the first element of the one before
      local t = {}
      local c = t
      for _ = 2, depth do c[1] = {}; c = c[1] end
      return t
    end
    local model = nn.Linear(2, 2)
    local p = path('deep.h5')
    ckpt.save(p, { model = model, extra = nest(198) })   -- the deepest the parser reads back
    local c = ckpt.load(p, { model = model }).extra
    for _ = 2, 198 do c = c[1] end
    assert.are.same({}, c)
    local err = error_of(function() ckpt.save(p, { model = model, step = 2, extra = nest(199) }) end)
    assert.matches('checkpoint.save: extra[1][1]', err, 1, true)
    assert.matches('is nested 199 tables deep; at most 198 levels can be loaded back: flatten it', err, 1, true)
    local many = {}
    for i = 1, 70000 do many[i] = { i } end   -- a constant each: over the 65536 of one chunk
    err = error_of(function() ckpt.save(p, { model = model, step = 2, config = { runs = many } }) end)
    assert.matches('checkpoint.save: config could not be loaded back (config:1: main function has more than 65536 '
                   .. 'constants)', err, 1, true)
    assert.is_nil(ckpt.load(p, { model = model }).step)   -- the checkpoint before the refused saves
  end)

  it('a checkpoint whose saved values cannot be read changes nothing: model, optimizer and RNG', function()
    local model = make_model()
    local opt = uly.optim.AdamW(model:parameters(), { lr = 2e-3 })
    train(model, opt, 2)
    local p = path('bad_extra.h5')
    ckpt.save(p, { model = model, optim = opt, step = 2, extra = { note = 'x' } })
    local f = h5.open(p, 'r+')   -- a value this library cannot read (written by hand, or by a buggy version)
    f:set_attr('', 'extra', '{' .. ('{'):rep(300) .. ('}'):rep(301))
    f:close()
    local other = make_model()
    local opt2 = uly.optim.AdamW(other:parameters(), { lr = 2e-3 })
    local before, rng_before = snapshot(other), uly.rng_state()
    local err = error_of(function() ckpt.load(p, { model = other, optim = opt2 }) end)
    assert.matches('checkpoint.load: extra is not a valid saved value', err, 1, true)
    assert.are.same(before, snapshot(other))
    assert.are.equal(0, opt2.step_count)
    assert.are.same(values(uly.zeros(5, 7)), values(opt2.state.exp_avg[1]))
    local rng = uly.rng_state()
    assert.are.equal(tostring(rng_before.seed), tostring(rng.seed))
    assert.are.equal(tostring(rng_before.offset), tostring(rng.offset))
  end)

  it('loads into non-contiguous parameters (a transposed leaf)', function()
    local Holder = nn.Module:extend('Holder')
    function Holder:__init(v)
      self:param('a', uly.ones(2) * v)
      self:param('w', (uly.randn(3, 2) + v):t())   -- [2, 3], not contiguous
    end
    local saved = Holder(1)
    assert.is_false(saved.w:is_contiguous())
    local p = path('noncontig.h5')
    ckpt.save(p, { model = saved })
    local other = Holder(7)
    ckpt.load(p, { model = other })
    assert.are.same(snapshot(saved), snapshot(other))
    assert.is_false(other.w:is_contiguous())   -- the parameter itself was filled, not replaced
  end)

  it('keeps each parameter\'s own optimizer step; a file without them gives each optim_step', function()
    -- b gets a grad from step 3 on: its own step count stays 2 behind the optimizer's
    local a, b = uly.randn(3, 2, { requires_grad = true }), uly.randn(4, { requires_grad = true })
    local Two = nn.Module:extend('Two')
    function Two:__init(x, y) self:param('a', x); self:param('b', y) end
    local function run(model, opt, from, to)
      for s = from, to do
        opt:zero_grad()
        local loss = (model.a * model.a):sum()
        if s >= 3 then loss = loss + (model.b * model.b):sum() end
        loss:backward()
        opt:step()
      end
    end
    local model = Two(a, b)
    local opt = uly.optim.AdamW(model:parameters(), { lr = 0.1, weight_decay = 0 })
    run(model, opt, 1, 3)
    assert.are.same({ 3, 1 }, opt.param_steps)
    local p = path('param_steps.h5')
    ckpt.save(p, { model = model, optim = opt, step = 3 })
    local fresh = Two(a:detach():clone():requires_grad_(true), b:detach():clone():requires_grad_(true))
    local opt2 = uly.optim.AdamW(fresh:parameters(), { lr = 0.1, weight_decay = 0 })
    ckpt.load(p, { model = fresh, optim = opt2 })
    assert.are.same({ 3, 1 }, opt2.param_steps)
    run(model, opt, 4, 5)
    run(fresh, opt2, 4, 5)
    assert.are.same(snapshot(model), snapshot(fresh))
    -- saved without per-parameter steps (as before they existed, or by ZeroAdamW): both get optim_step
    local function as_saved(sd) return { kind = 'AdamW', params = opt.params, state_dict = function() return sd end } end
    local sd = opt:state_dict()
    sd.param_steps = nil
    ckpt.save(p, { model = model, optim = as_saved(sd) })
    ckpt.load(p, { model = fresh, optim = opt2 })
    assert.are.same({ 5, 5 }, opt2.param_steps)
    -- a count that cannot be is refused before anything changes
    sd.param_steps = { 5, 6 }
    ckpt.save(p, { model = model, optim = as_saved(sd) })
    local other = Two(uly.zeros(3, 2), uly.zeros(4))
    local opt3 = uly.optim.AdamW(other:parameters())
    local err = error_of(function() ckpt.load(p, { model = other, optim = opt3 }) end)
    assert.matches('does not match (nothing was loaded)', err, 1, true)
    assert.matches('optim_param_steps has no step count in [0, optim_step] for b', err, 1, true)
    assert.are.same(values(uly.zeros(3, 2)), values(other.a))
    assert.are.same({ 0, 0 }, opt3.param_steps)
  end)

  it('refuses a wrong shape, naming the parameter and both shapes, and leaves the model unchanged', function()
    local p = path('shape.h5')
    ckpt.save(p, { model = make_model(7), step = 1 })
    local wrong = make_model(8)
    local before = snapshot(wrong)
    local err = error_of(function() ckpt.load(p, { model = wrong }) end)
    assert.matches('shape mismatch: 1.weight is [5, 7] in the file, [5, 8] in the model', err, 1, true)
    assert.matches('3.weight is [7, 3] in the file, [8, 3] in the model', err, 1, true)
    assert.matches(p, err, 1, true)
    assert.matches('checkpoint_spec.lua:%d+:', err)
    assert.are.same(before, snapshot(wrong))
  end)

  it('lists missing and unexpected parameters; strict = false loads the common ones', function()
    local p = path('names.h5')
    local small = nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7))
    ckpt.save(p, { model = small })
    local bigger = make_model()
    local before = snapshot(bigger)
    local err = error_of(function() ckpt.load(p, { model = bigger }) end)
    assert.matches('missing in the file: 3.weight, 3.bias', err, 1, true)
    assert.are.same(before, snapshot(bigger))
    local smaller = nn.Sequential(nn.Linear(5, 7))
    err = error_of(function() ckpt.load(p, { model = smaller }) end)
    assert.matches('in the file but not in the model: 2.bias, 2.weight', err, 1, true)
    ckpt.load(p, { model = bigger, strict = false })
    local loaded = snapshot(bigger)
    assert.are.same(snapshot(small)['1.weight'], loaded['1.weight'])
    assert.are.same(before['3.weight'], loaded['3.weight'])
  end)

  it('refuses a dtype mismatch when strict and converts it otherwise', function()
    local Holder = nn.Module:extend('Holder')
    function Holder:__init(dtype) self:param('w', uly.tensor({ 0.5, -1.25, 3 }, { dtype = dtype })) end
    local p = path('dtype.h5')
    ckpt.save(p, { model = Holder('f32') })
    local wide = Holder('f64')
    uly.no_grad(function() wide.w:fill_(0) end)
    local err = error_of(function() ckpt.load(p, { model = wide }) end)
    assert.matches('dtype mismatch: w is f32 in the file, f64 in the model', err, 1, true)
    assert.are.same({ 0, 0, 0 }, values(wide.w))
    ckpt.load(p, { model = wide, strict = false })
    assert.are.same({ 0.5, -1.25, 3 }, values(wide.w))
  end)

  it('refuses optimizer parameters that are not in the model', function()
    local model = make_model()
    local opt = uly.optim.AdamW({ model[1].weight, uly.zeros(2, 2, { requires_grad = true }) })
    local p = path('stray.h5')
    local err = error_of(function() ckpt.save(p, { model = model, optim = opt }) end)
    assert.matches('optimizer parameter 2 %(f32%[2, 2%]%) is not a parameter of the model', err)
    for _, name in ipairs(dir_entries(tmpdir)) do assert.is_nil(name:find('stray', 1, true), name) end
  end)

  it('reports corrupt, truncated and missing checkpoints while an older one still loads', function()
    local dir = path('run_corrupt')
    local model = make_model()
    local good = ckpt.save_rotating(dir, 1, { model = model })
    local fh = assert(io.open(good, 'rb'))
    local bytes = fh:read('*a')
    fh:close()
    local newest = dir .. '/step_000002.h5'
    fh = assert(io.open(newest, 'wb'))
    fh:write(bytes:sub(1, math.floor(#bytes / 2)))
    fh:close()
    assert.are.equal(newest, ckpt.latest(dir))
    local err = error_of(function() ckpt.load(newest, { model = make_model() }) end)
    assert.matches(newest, err, 1, true)
    assert.matches('truncated', err)
    local text = dir .. '/notes.h5'
    fh = assert(io.open(text, 'wb'))
    fh:write('not a checkpoint\n')
    fh:close()
    assert.matches('is not an HDF5 file', error_of(function() ckpt.load(text, { model = make_model() }) end))
    assert.matches('No such file', error_of(function() ckpt.load(dir .. '/step_000009.h5', { model = model }) end))
    local plain = dir .. '/plain.h5'
    local f = h5.create(plain)
    f:close()
    assert.matches('is it a ulysses checkpoint', error_of(function() ckpt.load(plain, { model = model }) end))
    local fresh = make_model()
    ckpt.load(good, { model = fresh })
    assert.are.same(snapshot(model), snapshot(fresh))
  end)

  it('a save that fails midway leaves the previous checkpoint intact and no temporary file', function()
    local dir = path('run_fail')
    local model = make_model()
    local p = ckpt.save_rotating(dir, 5, { model = model, config = { tag = 'old' } })
    local old = snapshot(model)
    train(model, uly.optim.SGD(model:parameters(), { lr = 0.5 }), 1)
    local writes = 0
    ckpt._test_hook = function(name)
      writes = writes + 1
      if writes == 3 then error('forced failure after ' .. name, 0) end
    end
    local err = error_of(function() ckpt.save(p, { model = model, config = { tag = 'new' } }) end)
    ckpt._test_hook = nil
    assert.matches('forced failure after model/2.weight', err, 1, true)
    assert.are.same({ 'step_000005.h5' }, dir_entries(dir))
    -- a value that cannot be serialised, and a parameter name that cannot be a dataset
    assert.matches('config.f is a function', error_of(function()
      ckpt.save(p, { model = model, config = { f = print } })
    end))
    local Bad = nn.Module:extend('Bad')
    function Bad:__init() self:param('a/b', uly.zeros(2)) end
    assert.matches("parameter name \"a/b\" cannot be a dataset name", error_of(function()
      ckpt.save(p, { model = Bad() })
    end), 1, true)
    assert.are.same({ 'step_000005.h5' }, dir_entries(dir))
    local fresh = make_model()
    local info = ckpt.load(p, { model = fresh })
    assert.are.same({ tag = 'old' }, info.config)
    assert.are.same(old, snapshot(fresh))
  end)

  it('finds a tensor whose bytes changed after saving (every dataset carries a checksum)', function()
    local file = path('runs/checksum.h5')
    local model = nn.Linear(3, 2)
    ckpt.save(file, { model = model, step = 1 })
    assert.are.equal(1, ckpt.load(file, { model = model }).step)
    local h5 = require 'ulysses.h5'
    local f = h5.open(file, 'r+')
    assert.matches('^%x+$', f:attr('model/weight', 'uly_checksum'))
    f:set_attr('model/weight', 'uly_checksum', '0123456789abcdef')   -- as if the data had changed
    f:close()
    local err = error_of(function() ckpt.load(file, { model = model }) end)
    assert.matches("dataset 'model/weight' in .* does not match the checksum written with it", err)
    assert.matches('the file is corrupt', err)
  end)

  it('saves through a symbolic link into its target, and never over a directory, pipe or device', function()
    local dir = path('runs/special')
    local model = nn.Linear(2, 2)
    ckpt.save(dir .. '/real.h5', { model = model, step = 1 })
    os.execute(string.format("ln -sf real.h5 '%s/link.h5' && mkfifo '%s/pipe.h5' && mkdir -p '%s/sub.h5'", dir, dir, dir))
    assert.are.equal(dir .. '/link.h5', ckpt.save(dir .. '/link.h5', { model = model, step = 2 }))
    assert.are.equal(2, ckpt.load(dir .. '/real.h5', { model = model }).step)   -- written through the link
    local p = io.popen("stat -c %F '" .. dir .. "/link.h5'")
    assert.matches('symbolic link', p:read('*a'))                              -- which is still a link
    p:close()
    assert.matches("pipe.h5' is not a regular file", error_of(function() ckpt.save(dir .. '/pipe.h5', { model = model }) end))
    p = io.popen("stat -c %F '" .. dir .. "/pipe.h5'")
    assert.matches('fifo', p:read('*a'))                                       -- untouched
    p:close()
    assert.matches("sub.h5' is a directory", error_of(function() ckpt.save(dir .. '/sub.h5', { model = model }) end))
    os.execute(string.format("ln -sf missing.h5 '%s/dangling.h5'", dir))
    assert.matches('a symbolic link to a missing file', error_of(function() ckpt.save(dir .. '/dangling.h5', { model = model }) end))
  end)

  it('save_rotating keeps the newest K by step and latest() finds the newest', function()
    local dir = path('runs/a/run_rotate') -- parents are created
    assert.is_nil(ckpt.latest(dir))
    local model = nn.Linear(2, 2)
    for _, step in ipairs({ 1, 2, 999999, 3, 1000000 }) do ckpt.save_rotating(dir, step, { model = model }, 2) end
    assert.are.same({ 'step_1000000.h5', 'step_999999.h5' }, dir_entries(dir))
    assert.are.equal(dir .. '/step_1000000.h5', ckpt.latest(dir))
    assert.are.equal(1000000, ckpt.load(ckpt.latest(dir), { model = model }).step)
    ckpt.save_rotating(dir, 7, { model = model, step = 123 }) -- default keep = 3; the dir's step wins
    assert.are.same({ 'step_000007.h5', 'step_1000000.h5', 'step_999999.h5' }, dir_entries(dir))
    assert.are.equal(7, ckpt.load(dir .. '/step_000007.h5', { model = model }).step)
    assert.matches('keep must be an integer >= 1', error_of(function() ckpt.save_rotating(dir, 8, { model = model }, 0) end))
    -- a save killed mid-write left its temporary file: removed once its process is gone
    local stale, live = dir .. '/step_000009.h5.tmp.999999999.1', dir .. '/step_000009.h5.tmp.1.1'
    for _, f in ipairs({ stale, live }) do io.open(f, 'w'):close() end
    ckpt.save_rotating(dir, 1000001, { model = model }, 2)
    assert.is_nil(io.open(stale, 'r'), 'a dead process\'s temporary file was kept')
    local f = io.open(live, 'r')   -- pid 1 is alive: its save may still be running
    assert.truthy(f, 'a live process\'s temporary file was removed')
    f:close()
    os.remove(live)
    -- a step below the ones already there (another run's) is never the one deleted
    local p5 = ckpt.save_rotating(dir, 5, { model = model }, 2)
    assert.are.same({ 'step_000005.h5', 'step_1000001.h5' }, dir_entries(dir))
    assert.are.equal(5, ckpt.load(p5, { model = model }).step)
  end)
end)
