-- spec/train_safety_spec.lua — train.lua and datasets/prepare.lua never lose or mix a user's data:
-- a run into an --out holding another run (checkpoints, or only a log) moves that run aside, also
-- with --resume PATH; --out goes through no shell; prepare refuses to write over its input or a
-- file that is not HDF5; every flag value (inf, nan, min_lr above lr, no room to sample) and a
-- config file's own errors are reported before training, naming the flag or the file and line.
local helpers = require 'helpers'
local uly = require 'ulysses'

local tmpdir, shq = helpers.mkdtemp, helpers.shq
local function run(args) return helpers.run('bin/ulysses train.lua ' .. args) end

-- a 1-layer model on 16-token windows: each run takes a fraction of a second
local SMALL = '--data embedded --preset tiny --layers 1 --seq 16 --batch 2 --warmup 1 --lr 3e-3 --min_lr 3e-4 '
  .. '--threads 1 --eval_batches 0 --sample 0 '

local read_file, write_file = helpers.read_file, helpers.write_file

-- the sorted file names in dir
local function ls(dir)
  local p = assert(io.popen('ls -1 ' .. shq(dir) .. ' 2>/dev/null'))
  local names = {}
  for name in p:lines() do names[#names + 1] = name end
  p:close()
  return names
end

local function steps_of(log) local s = {} for i, r in ipairs(uly.log.read_csv(log)) do s[i] = r.step end return s end

describe('train.lua keeps every run', function()
  it('--resume PATH of another run into an --out holding a run moves that run aside first', function()
    local a, b = tmpdir(), tmpdir()
    local out, code = run(SMALL .. '--steps 6 --ckpt_every 2 --out ' .. a)            -- run A: steps 2, 4, 6
    assert.are.equal(0, code, out)
    out, code = run(SMALL .. '--steps 1 --seed 99 --out ' .. b)                       -- run B: step 1
    assert.are.equal(0, code, out)
    local a_ckpts, a_log = {}, read_file(a .. '/log.csv')
    for _, name in ipairs(ls(a .. '/ckpt')) do a_ckpts[name] = read_file(a .. '/ckpt/' .. name) end
    out, code = run(SMALL .. '--steps 3 --ckpt_every 1 --seed 99 --resume ' .. b .. '/ckpt/step_000001.h5 --out ' .. a)
    assert.are.equal(0, code, out)
    assert.truthy(out:find(a .. ' held another run (its latest checkpoint step_000006.h5): moved to ' .. a .. '/previous-1',
                           1, true), out)
    assert.truthy(out:find('resumed from ' .. b .. '/ckpt/step_000001.h5 at step 1', 1, true), out)
    -- run A whole and unchanged in previous-1; OUT holds B's continuation only
    assert.are.same({ 'step_000002.h5', 'step_000004.h5', 'step_000006.h5' }, ls(a .. '/previous-1/ckpt'))
    for name, bytes in pairs(a_ckpts) do
      assert.are.equal(bytes, read_file(a .. '/previous-1/ckpt/' .. name), name .. ' of run A changed')
    end
    assert.are.equal(a_log, read_file(a .. '/previous-1/log.csv'))
    assert.are.same({ 'step_000002.h5', 'step_000003.h5' }, ls(a .. '/ckpt'))
    assert.are.same({ 2, 3 }, steps_of(a .. '/log.csv'))
    helpers.rmtree(a)
    helpers.rmtree(b)
  end)

  it('--resume PATH of the newest checkpoint in --out continues in place; of an older one, from where it moved', function()
    local a = tmpdir()
    local out, code = run(SMALL .. '--steps 4 --ckpt_every 2 --stop_after 4 --out ' .. a)
    assert.are.equal(0, code, out)
    -- the newest (named through a path with '.' and '..'): as --resume auto
    out, code = run(SMALL .. '--steps 6 --ckpt_every 2 --resume ' .. a .. '/./ckpt/../ckpt/step_000004.h5 --out ' .. a)
    assert.are.equal(0, code, out)
    assert.falsy(out:find('held another run', 1, true), out)
    assert.are.same({ 'step_000002.h5', 'step_000004.h5', 'step_000006.h5' }, ls(a .. '/ckpt'))
    assert.are.same({ 1, 2, 3, 4, 5, 6 }, steps_of(a .. '/log.csv'))
    assert.is_nil(read_file(a .. '/previous-1/log.csv'))
    -- an older one: the run (with its step 6) moves aside, and the resume reads step 2 from there
    out, code = run(SMALL .. '--steps 6 --ckpt_every 2 --resume ' .. a .. '/ckpt/step_000002.h5 --out ' .. a)
    assert.are.equal(0, code, out)
    assert.truthy(out:find('resumed from ' .. a .. '/previous-1/ckpt/step_000002.h5 at step 2', 1, true), out)
    assert.are.same({ 'step_000002.h5', 'step_000004.h5', 'step_000006.h5' }, ls(a .. '/previous-1/ckpt'))
    assert.are.same({ 1, 2, 3, 4, 5, 6 }, steps_of(a .. '/previous-1/log.csv'))
    assert.are.same({ 3, 4, 5, 6 }, steps_of(a .. '/log.csv'))
    helpers.rmtree(a)
  end)

  it('a log (or plot) without checkpoints, from a run stopped before its first, moves aside too', function()
    for _, resume in ipairs({ '', '--resume auto ' }) do
      local a = tmpdir()
      local log = 'step,loss,val_loss,lr,grad_norm,tokens_per_s,seconds\n1,5.5,,0.001,2.4,1000,0.1\n2,5.4,,0.001,2.3,1000,0.2\n'
      write_file(a .. '/log.csv', log)
      write_file(a .. '/loss.svg', '<svg/>')
      local out, code = run(SMALL .. resume .. '--steps 1 --out ' .. a)
      assert.are.equal(0, code, out)
      assert.truthy(out:find(a .. ' held another run (a log, no checkpoint): moved to ' .. a .. '/previous-1', 1, true), out)
      assert.are.equal(log, read_file(a .. '/previous-1/log.csv'), resume)
      assert.are.equal('<svg/>', read_file(a .. '/previous-1/loss.svg'), resume)
      assert.are.same({ 1 }, steps_of(a .. '/log.csv'))
      helpers.rmtree(a)
    end
  end)

  it('makes --out without a shell: $(...), $VAR and quotes are parts of the name', function()
    local dir = tmpdir()
    for _, name in ipairs({ 'inj$(touch ' .. dir .. '/pwned)', 'lr$1e-3', [[q"'`x`]] }) do
      local out, code = run(SMALL .. '--steps 1 --out ' .. shq(dir .. '/' .. name))
      assert.are.equal(0, code, out)
      assert.truthy(read_file(dir .. '/' .. name .. '/log.csv'), name .. ':\n' .. out)
    end
    assert.is_nil(read_file(dir .. '/pwned'), 'the shell ran a command from --out')
    assert.is_nil(read_file(dir .. '/lre-3/log.csv'), 'the shell expanded $1 in --out')
    helpers.rmtree(dir)
  end)
end)

describe('train.lua checks every flag before training', function()
  it('rejects inf, nan, --min_lr above --lr, no room to sample, a misspelled flag and a file as --out', function()
    local dir = tmpdir()
    write_file(dir .. '/file', 'not a directory')
    for flags, want in pairs({
      ['--steps inf'] = '--steps must be a finite number, got inf',
      ['--steps 1e300'] = '--steps must be an integer <= 2^53, got 1e+300',
      ['--temperature inf'] = '--temperature must be a finite number, got inf',
      ['--lr inf'] = '--lr must be a finite number, got inf',
      ['--lr nan'] = '--lr must be a finite number, got nan',
      ['--wd inf'] = '--wd must be a finite number, got inf',
      ['--clip -inf'] = '--clip must be a finite number, got -inf',
      ['--min_lr 1'] = '--min_lr 1 is above --lr 0.003: the cosine schedule decays from --lr to --min_lr',
      ['--seq 1 --sample 200'] = '--seq 1 leaves no room to sample',
      ['--stpes 3'] = "unknown flag --stpes (did you mean '--steps'?)",
      ['--out ' .. dir .. '/file'] = '--out ' .. dir .. '/file is a file: give a directory',
    }) do
      local out, code = run(SMALL .. '--steps 2 ' .. flags .. (flags:find('--out', 1, true) and '' or ' --out ' .. dir))
      assert.are.equal(2, code, flags .. ':\n' .. out)
      assert.truthy(out:find('train.lua: ' .. want, 1, true), flags .. ':\n' .. out)
      assert.falsy(out:find('step 1/', 1, true), flags .. ': trained before the message:\n' .. out)
      assert.falsy(out:find('traceback', 1, true), out)
    end
    assert.are.equal('not a directory', read_file(dir .. '/file'))
    -- --min_lr means nothing to a constant schedule; --seq 1 trains without a sample
    local out, code = run(SMALL .. '--steps 1 --min_lr 1 --schedule constant --out ' .. dir .. '/c')
    assert.are.equal(0, code, out)
    out, code = run(SMALL .. '--steps 1 --seq 1 --out ' .. dir .. '/s')
    assert.are.equal(0, code, out)
    helpers.rmtree(dir)
  end)

  it('a config file gets math and string, and its own errors are reported with the file and line', function()
    local dir = tmpdir()
    local cfg = dir .. '/run.lua'
    -- it cannot change train.lua's math (which checks the flags)
    write_file(cfg, 'local lr = 3e-3 * math.sqrt(2)\nmath.floor = nil\n'
                    .. 'return { steps = 1, lr = lr, out = string.format("%s/run", os.getenv("RUNS")) }\n')
    local out, code = helpers.run('RUNS=' .. shq(dir) .. ' bin/ulysses train.lua --config ' .. cfg .. ' '
                            .. SMALL:gsub('%-%-lr 3e%-3 ', ''))
    assert.are.equal(0, code, out)
    assert.truthy(out:find('lr 0.0042 cosine', 1, true), out)
    assert.truthy(read_file(dir .. '/run/log.csv'), out)
    write_file(cfg, 'return {\n  steps = 2,\n  lr = 3e-4 * nosuch.sqrt(2),\n}\n')
    out, code = run('--config ' .. cfg)
    assert.are.equal(2, code, out)
    assert.truthy(out:find('train.lua: --config ' .. cfg .. ': ' .. cfg .. ":3: attempt to index global 'nosuch'", 1, true),
                  out)
    write_file(cfg, 'return { stpes = 2 }\n')
    out, code = run('--config ' .. cfg)
    assert.are.equal(2, code, out)
    assert.truthy(out:find("config file " .. cfg .. ": unknown key stpes (did you mean 'steps'?)", 1, true), out)
    helpers.rmtree(dir)
  end)
end)

describe('datasets/prepare.lua keeps its inputs', function()
  local prepare = dofile('datasets/prepare.lua')
  local corpus = 'hello world, a corpus I care about\n'

  local function cli(args) return helpers.run('luajit datasets/prepare.lua --kind text --valid 0.2 --quiet ' .. args) end

  it('refuses an --out that is an input (by any path), or whose temporary file is one', function()
    local dir = tmpdir()
    write_file(dir .. '/corpus.txt', corpus)
    os.execute('ln -s corpus.txt ' .. shq(dir .. '/link.txt'))
    for _, args in ipairs({ '--in %s/corpus.txt --out %s/corpus.txt', '--in %s/corpus.txt --out %s/./sub/../corpus.txt',
                            '--in %s/link.txt --out %s/corpus.txt' }) do
      os.execute('mkdir -p ' .. shq(dir .. '/sub'))
      local out, code = cli(args:format(dir, dir))
      assert.are_not.equal(0, code, out)
      assert.truthy(out:find("(the output) would replace the input '", 1, true), out)
      assert.truthy(out:find('give another output path (e.g. ', 1, true), out)
      assert.are.equal(corpus, read_file(dir .. '/corpus.txt'))
    end
    write_file(dir .. '/c.h5.tmp', corpus)
    local ok, err = pcall(prepare, { kind = 'text', inputs = { dir .. '/c.h5.tmp' }, out = dir .. '/c.h5', quiet = true })
    assert.is_false(ok)
    assert.truthy(err:find("prepare: writing '" .. dir .. "/c.h5.tmp' (the output's temporary file) would replace the input",
                           1, true), err)
    assert.are.equal(corpus, read_file(dir .. '/c.h5.tmp'))
    helpers.rmtree(dir)
  end)

  it('refuses to replace an existing file that is not HDF5, and replaces its own output', function()
    local dir = tmpdir()
    write_file(dir .. '/corpus.txt', corpus)
    write_file(dir .. '/notes.txt', 'my notes\n')
    local out, code = cli(('--in %s/corpus.txt --out %s/notes.txt'):format(dir, dir))
    assert.are_not.equal(0, code, out)
    assert.truthy(out:find("prepare: out '" .. dir .. "/notes.txt' exists and is not an HDF5 file", 1, true), out)
    assert.are.equal('my notes\n', read_file(dir .. '/notes.txt'))
    for _ = 1, 2 do
      out, code = cli(('--in %s/corpus.txt --out %s/c.h5'):format(dir, dir))
      assert.are.equal(0, code, out)
    end
    assert.are.equal(28, uly.data.open(dir .. '/c.h5', { seq = 4, batch = 1 }).n_tokens)
    helpers.rmtree(dir)
  end)

  it('decompresses an input whose name holds shell syntax without running it', function()
    local dir = tmpdir()
    local name = dir .. [[/in$(touch pwned)'`x`.txt]]
    write_file(dir .. '/plain.txt', corpus)
    assert.are.equal(0, os.execute('gzip -c ' .. shq(dir .. '/plain.txt') .. ' > ' .. shq(name .. '.gz')))
    local s = prepare { kind = 'text', inputs = { name .. '.gz' }, out = dir .. '/c.h5', valid = 0.2, quiet = true }
    assert.are.equal(#corpus, s.n_train + s.n_valid)
    assert.is_nil(read_file('pwned'))
    assert.is_nil(read_file(dir .. '/pwned'))
    helpers.rmtree(dir)
  end)
end)
