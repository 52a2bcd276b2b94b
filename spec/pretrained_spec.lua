-- spec/pretrained_spec.lua — a trained model back from disk (uly.pretrained.load: run
-- directories, checkpoints, safetensors; the alphabet from the data or the vocabulary; errors),
-- and its command-line faces: tools/score.lua (log-likelihoods through sliding windows, against
-- the model's own loss) and tools/generate.lua (the tokens generate gives in-process).
local ffi = require 'ffi'
local uly = require 'ulysses'
local helpers = require 'helpers'
local GPT = require 'models.gpt'
local Llama = require 'models.llama'
local common = require 'models.common'

local root = (require 'ulysses.ffi').root
local prepare = dofile(root .. '/datasets/prepare.lua')
local describe_h5 = uly.h5.available and describe or pending

local function bytes_of(t) return ffi.string(uly.C.uly_tensor_data_ptr(t._h), t:nbytes()) end
local function err_of(fn, ...) return helpers.error_of(fn, ...) end
-- a tool's output and exit status (the status line helpers.run appends taken off)
local function run(cmd)
  local out, rc = helpers.run('bin/ulysses ' .. cmd)
  return (out:gsub('exit=%d+%s*$', '')), rc
end

-- a checkpoint of model as train.lua writes one (config, step, the data file's path)
local function save_ckpt(path, model, data_path)
  uly.checkpoint.save(path, { model = model, step = 3, config = common.plain_config(model.config),
                              extra = { data_path = data_path } })
end

local function same_parameters(a, b)
  local pb = {}
  for name, p in b:named_parameters() do pb[name] = p end
  local n = 0
  for name, p in a:named_parameters() do
    assert.are.equal(bytes_of(p), bytes_of(pb[name]), name)
    n = n + 1
  end
  assert.is_true(n > 0)
end

-- the negative log-likelihood of tokens (a Lua list) predicted from the first, one forward pass
local function nll_of(model, toks)
  local n = #toks - 1
  local x = uly.tensor({ { unpack(toks, 1, n) } }, { dtype = 'i32' })
  local y = uly.tensor({ { unpack(toks, 2, n + 1) } }, { dtype = 'i32' })
  return uly.no_grad(function() return model:loss(x, y, { reduction = 'none' }) end):to { dtype = 'f64' }:totable()[1]
end

-- numbers within tol of each other
local function near(a, b, tol, what)
  assert(math.abs(a - b) <= tol, string.format('%s: %.9g, expected %.9g (within %g)', what, a, b, tol))
end

-- the score table's row for an input: tokens and nats
local function row_of(out, name)
  local line = out:match('\n' .. name:gsub('%p', '%%%0') .. '%s+[^\n]*')
  assert.truthy(line, 'no row ' .. name .. ' in:\n' .. out)
  local count, nats = line:sub(#name + 2):match('^%s+(%d+)%s+(%S+)')
  return tonumber(count), tonumber(nats)
end

describe_h5('uly.pretrained and tools/score.lua, tools/generate.lua', function()
  local dir
  before_each(function() helpers.reseed(11); dir = helpers.mkdtemp() end)
  after_each(function() helpers.rmtree(dir) end)

  it('loads a run directory, a checkpoint and a safetensors export into the same model, in eval mode', function()
    for _, Model in ipairs({ GPT, Llama }) do
      local m = Model { preset = 'tiny', seq = 16, dropout = 0.1 }
      local run_dir = dir .. '/' .. m.config.model
      uly.checkpoint._mkdir_p(run_dir .. '/ckpt')
      save_ckpt(run_dir .. '/ckpt/step_000002.h5', Model { preset = 'tiny', seq = 16 })   -- older: not taken
      save_ckpt(run_dir .. '/ckpt/step_000010.h5', m)
      uly.checkpoint.export(run_dir .. '/ckpt/step_000010.h5', run_dir .. '/w.safetensors')
      for _, source in ipairs({ run_dir, run_dir .. '/ckpt', run_dir .. '/ckpt/step_000010.h5', run_dir .. '/w.safetensors' }) do
        uly.manual_seed(77)
        local before = uly.rng_state()
        local loaded, info = uly.pretrained.load(source)
        assert.are.same(before, uly.rng_state(), 'loading left the generator as it was')
        same_parameters(m, loaded)
        assert.are.equal(m.__name, loaded.__name)
        assert.is_false(loaded.training)
        assert.are.equal(16, loaded.config.seq)
        assert.are.equal(0.1, loaded.config.dropout)
        assert.are.equal(3, info.step)
        assert.are.equal(source:match('safetensors$') and 'safetensors' or 'checkpoint', info.format)
        assert.are.equal(source:match('safetensors$') and source or run_dir .. '/ckpt/step_000010.h5', info.path)
        assert.are.same({ 'text', 'vocabulary' }, { info.kind, info.kind_from })
        assert.are.equal('Hi', info.codec:decode(info.codec:encode('Hi')))
      end
    end
    -- a sequence-parallel run's config (sp, activation checkpointing) loads on one process
    local m = GPT { preset = 'tiny', seq = 16 }
    local cfg = common.plain_config(m.config)
    cfg.sp, cfg.checkpoint = 2, true
    uly.checkpoint.save(dir .. '/sp.h5', { model = m, step = 1, config = cfg })
    local loaded = uly.pretrained.load(dir .. '/sp.h5')
    same_parameters(m, loaded)
    assert.is_nil(loaded.grid)
    assert.is_false(loaded.config.checkpoint)
  end)

  it('takes the alphabet from the option, the data file, or the vocabulary, and refuses a mismatch', function()
    helpers.write_file(dir .. '/g.fa', '>one\nACGTACGTTTGA\n>two\nGGCATN\n')
    prepare { kind = 'dna', inputs = { dir .. '/g.fa' }, out = dir .. '/g.h5', valid = 0.2, quiet = true }
    helpers.write_file(dir .. '/t.txt', string.rep('some text to read. ', 20))
    prepare { kind = 'text', inputs = { dir .. '/t.txt' }, out = dir .. '/t.h5', valid = 0.1, quiet = true }
    local dna = GPT { preset = 'tiny', vocab = 6, seq = 16 }
    save_ckpt(dir .. '/dna.h5', dna, dir .. '/g.h5')
    local _, info = uly.pretrained.load(dir .. '/dna.h5')
    assert.are.same({ 'dna', 'data', dir .. '/g.h5' }, { info.kind, info.kind_from, info.data_path })
    assert.are.equal('ACGTN|', info.codec:decode({ 0, 1, 2, 3, 4, 5 }))
    save_ckpt(dir .. '/dna_moved.h5', dna, dir .. '/gone.h5')   -- the recorded file is gone: the vocabulary says
    _, info = uly.pretrained.load(dir .. '/dna_moved.h5')
    assert.are.same({ 'dna', 'vocabulary' }, { info.kind, info.kind_from })
    assert.is_nil(info.data_path)
    _, info = uly.pretrained.load(dir .. '/dna_moved.h5', { kind = 'dna' })
    assert.are.equal('option', info.kind_from)
    local e = err_of(uly.pretrained.load, dir .. '/dna.h5', { data = dir .. '/t.h5' })
    assert.truthy(e:find('pretrained.load: data ' .. dir .. '/t.h5 has a vocabulary of 256 tokens, the model 6: it was '
                         .. 'not trained on this file', 1, true), e)
    e = err_of(uly.pretrained.load, dir .. '/dna.h5', { kind = 'text' })
    assert.truthy(e:find('a vocabulary of 6 tokens cannot be text (256 tokens)', 1, true), e)
    save_ckpt(dir .. '/v50.h5', GPT { preset = 'tiny', vocab = 50, seq = 16 })
    e = err_of(uly.pretrained.load, dir .. '/v50.h5')
    assert.truthy(e:find("a vocabulary of 50 tokens is neither text bytes (256) nor DNA (6), and no data file says which: "
                         .. "pass kind = 'text' or 'dna', or data = the training file", 1, true), e)
    e = err_of(uly.pretrained.load, dir .. '/dna.h5', { data = dir .. '/none.h5' })
    assert.truthy(e:find("pretrained.load: data: no such file '" .. dir .. "/none.h5'", 1, true), e)
  end)

  it('names what is wrong with a source', function()
    local m = GPT { preset = 'tiny', seq = 16 }
    helpers.write_file(dir .. '/t.txt', string.rep('abc ', 50))
    prepare { kind = 'text', inputs = { dir .. '/t.txt' }, out = dir .. '/t.h5', valid = 0.1, quiet = true }
    uly.checkpoint.save(dir .. '/noconfig.h5', { model = m, step = 1 })
    uly.safetensors.save(dir .. '/plain.safetensors', m)
    local cfg = common.plain_config(m.config)
    cfg.model = 'bert'
    uly.checkpoint.save(dir .. '/bert.h5', { model = m, step = 1, config = cfg })
    cfg = common.plain_config(m.config)
    cfg.dim = 48    -- a config whose shapes are not the saved tensors'
    uly.checkpoint.save(dir .. '/shapes.h5', { model = m, step = 1, config = cfg })
    cfg.heads, cfg.dim = 5, 32
    uly.checkpoint.save(dir .. '/heads.h5', { model = m, step = 1, config = cfg })
    uly.checkpoint._mkdir_p(dir .. '/empty_run')
    for _, c in ipairs({
      { dir .. '/missing', "pretrained.load: no such file or directory: '" .. dir .. "/missing' (a run directory, a checkpoint .h5 or a .safetensors file)" },
      { dir .. '/empty_run', 'pretrained.load: ' .. dir .. '/empty_run is a directory without checkpoints (train.lua writes them to OUT/ckpt/step_N.h5' },
      { dir .. '/t.txt', 'pretrained.load: ' .. dir .. '/t.txt is neither an HDF5 checkpoint nor a safetensors file' },
      { dir .. '/t.h5', 'pretrained.load: ' .. dir .. '/t.h5 is a dataset (text), not a model: give the run directory or checkpoint of a model trained on it' },
      { dir .. '/noconfig.h5', 'has no model config (saved by uly.checkpoint.save without config = model.config): build the model yourself and use uly.checkpoint.load(path, {model = m})' },
      { dir .. '/plain.safetensors', 'has no ulysses_config in its metadata (train.lua --export and uly.checkpoint.export write it): build the model yourself and use uly.safetensors.load_into(model, path)' },
      { dir .. '/bert.h5', "its config names the model 'bert' (known: gpt, llama)" },
      { dir .. '/shapes.h5', 'does not match (nothing was loaded):\n  shape mismatch: wte.weight is [256, 32] in the file, [256, 48] in the model' },
      { dir .. '/heads.h5', 'its config does not make a model here: GPT: dim 32 is not divisible by heads 5' },
    }) do
      local e = err_of(uly.pretrained.load, c[1])
      assert.truthy(e:find(c[2], 1, true), c[1] .. ': ' .. e)
    end
    local e = err_of(uly.pretrained.load, dir .. '/bert.h5', { devise = 'cpu' })
    assert.truthy(e:find("pretrained.load: unknown option 'devise' (did you mean 'device'?)", 1, true), e)
    e = err_of(uly.pretrained.load, '')
    assert.truthy(e:find('pretrained.load: source must be a run directory, a checkpoint or a safetensors path', 1, true), e)
  end)

  it('tools/score.lua gives each sequence the model\'s own log-likelihood, through sliding windows beyond the context', function()
    local m = GPT { preset = 'tiny', seq = 8 }
    save_ckpt(dir .. '/m.h5', m)
    local short = 'the cat'                                   -- fits the context: one pass
    local long = 'a longer line of text than eight bytes'     -- 38 tokens: windows
    helpers.write_file(dir .. '/long.txt', long)
    local out, rc = run(string.format('tools/score.lua %s %s --text %s --stride 3 --batch 2 --per_token %s',
                                      helpers.shq(dir .. '/m.h5'), helpers.shq(dir .. '/long.txt'), helpers.shq(short),
                                      helpers.shq(dir .. '/pt.tsv')))
    assert.are.equal(0, rc, out)
    assert.truthy(out:find('windows of 8 tokens, stride 3; every token after the first scored', 1, true), out)
    local function toks(s) local t = {} for i = 1, #s do t[i] = s:byte(i) end return t end
    -- the short one: one forward pass over it
    local want = 0
    for _, v in ipairs(nll_of(m, toks(short))) do want = want + v end
    local count, nats = row_of(out, '--text 1')
    assert.are.equal(#short - 1, count)
    near(nats, want, 1e-3 + 1e-5 * want, 'short')
    -- the long one: target j (0-based) scored in the first window [s, s + 8) whose end reaches it,
    -- window starts 0, 3, 6, ... up to the last one, 37 - 8 = 29
    local t = toks(long)
    local starts, s = {}, 0
    while true do starts[#starts + 1] = s; if s == #t - 1 - 8 then break end s = math.min(s + 3, #t - 1 - 8) end
    local per_window = {}
    want = 0
    for j = 1, #t - 1 do
      local w
      for _, st in ipairs(starts) do if st + 8 >= j then w = st break end end
      per_window[w] = per_window[w] or nll_of(m, { unpack(t, w + 1, w + 9) })
      want = want + per_window[w][j - w]
    end
    count, nats = row_of(out, dir .. '/long.txt')
    assert.are.equal(#long - 1, count)
    near(nats, want, 1e-3 + 1e-5 * want, 'long')
    -- the per-token file: every scored token once, in order, adding up to the table
    local lines, sum, positions = 0, 0, {}
    for line in io.lines(dir .. '/pt.tsv') do
      local name, pos, tok, v = line:match('^([^\t]+)\t(%d+)\t([^\t]*)\t(%S+)$')
      if name == dir .. '/long.txt' then
        lines, sum = lines + 1, sum + tonumber(v)
        positions[#positions + 1] = tonumber(pos)
        assert.are.equal(long:sub(tonumber(pos), tonumber(pos)), tok)
      end
    end
    assert.are.equal(#long - 1, lines)
    for i, p in ipairs(positions) do assert.are.equal(i + 1, p) end
    near(sum, nats, 1e-3, 'per-token sum')
    local e_out, e_rc = run(string.format('tools/score.lua %s --text abc --strands both', helpers.shq(dir .. '/m.h5')))
    assert.are.equal(2, e_rc, e_out)
    assert.truthy(e_out:find('tools/score.lua: --strands both: a DNA model only (this one reads text)', 1, true), e_out)
    -- the batch size changes nothing but the grouping
    local out1 = run(string.format('tools/score.lua %s %s --stride 3 --batch 1', helpers.shq(dir .. '/m.h5'), helpers.shq(dir .. '/long.txt')))
    local c1, n1 = row_of(out1, dir .. '/long.txt')
    assert.are.equal(count, c1)
    near(n1, nats, 1e-3, 'batch 1')
  end)

  it('tools/score.lua scores every base of each FASTA record after the record separator', function()
    local m = GPT { preset = 'tiny', vocab = 6, seq = 8 }
    save_ckpt(dir .. '/dna.h5', m)
    helpers.write_file(dir .. '/r.fa', '>first rec\nACGTAC\n>second\nggatccat\ntgcaNN\n>empty\n')
    local out, rc = run(string.format('tools/score.lua %s %s --text ACGU', helpers.shq(dir .. '/dna.h5'), helpers.shq(dir .. '/r.fa')))
    assert.are.equal(0, rc, out)
    assert.truthy(out:find('(dna)', 1, true), out)
    local SEP = uly.data.DNA.SEP
    local codes = { A = 0, C = 1, G = 2, T = 3, N = 4 }
    local function expected(bases)   -- windows of 8, stride 4, from the separator on
      local t = { SEP }
      for c in bases:upper():gmatch('%a') do t[#t + 1] = codes[c] end
      local total, done, s = 0, 0, 0
      while done < #t - 1 do
        local L = math.min(8, #t - 1 - s)
        local nll = nll_of(m, { unpack(t, s + 1, s + L + 1) })
        for k = done - s + 1, L do total = total + nll[k] end
        done = s + L
        s = math.min(s + 4, #t - 1 - 8)
      end
      return total, #t - 1
    end
    for _, c in ipairs({ { 'r.fa:first rec', 'ACGTAC' }, { 'r.fa:second', 'GGATCCATTGCANN' }, { '--text 1', 'ACGT' } }) do
      local want, n = expected(c[2])
      local count, nats = row_of(out, c[1] == '--text 1' and c[1] or dir .. '/' .. c[1])
      assert.are.equal(n, count, c[1])
      near(nats, want, 1e-3 + 1e-5 * want, c[1])
    end
    assert.truthy(out:find(dir .. '/r.fa:empty%s+0%s+%-'), out)   -- an empty record: nothing to score
    -- --strands both: each record again as its reverse complement, in a row of its own
    out, rc = run(string.format('tools/score.lua %s %s --text ACGN --strands both', helpers.shq(dir .. '/dna.h5'), helpers.shq(dir .. '/r.fa')))
    assert.are.equal(0, rc, out)
    for _, c in ipairs({ { 'r.fa:first rec', 'ACGTAC' }, { 'r.fa:first rec [rc]', 'GTACGT' }, { 'r.fa:second [rc]', 'NNTGCAATGGATCC' },
                         { '--text 1 [rc]', 'NCGT' } }) do
      local want, n = expected(c[2])
      local count, nats = row_of(out, c[1]:sub(1, 2) == '--' and c[1] or dir .. '/' .. c[1])
      assert.are.equal(n, count, c[1])
      near(nats, want, 1e-3 + 1e-5 * want, c[1])
    end
    -- --split valid: the split's token stream (records joined by '|'), every token after the first;
    -- --per_token's positions count the split's own tokens from 1, as for any input
    helpers.write_file(dir .. '/g.fa', '>one\nACGTACGTTTGAACGGT\n>two\nGGCATNCCGATTAGCA\n')
    prepare { kind = 'dna', inputs = { dir .. '/g.fa' }, out = dir .. '/g.h5', valid = 0.5, quiet = true }
    save_ckpt(dir .. '/dna2.h5', m, dir .. '/g.h5')
    out, rc = run(string.format('tools/score.lua %s --split valid --per_token %s', helpers.shq(dir .. '/dna2.h5'),
                                helpers.shq(dir .. '/pt.tsv')))
    assert.are.equal(0, rc, out)
    local valid = uly.data.open(dir .. '/g.h5', { seq = 2, split = 'valid', random = false })
    local fh = uly.h5.open(dir .. '/g.h5')
    local letters = valid:decode(fh:read('valid'))
    fh:close()
    valid:close()
    local count = row_of(out, dir .. '/g.h5:valid')
    assert.are.equal(#letters - 1, count)
    local k = 0
    for line in io.lines(dir .. '/pt.tsv') do
      local pos, tok = line:match('^[^\t]+\t(%d+)\t([^\t]*)\t')
      if pos then
        k = k + 1
        assert.are.same({ k + 1, letters:sub(k + 1, k + 1) }, { tonumber(pos), tok })
      end
    end
    assert.are.equal(#letters - 1, k)
  end)

  it('tools/score.lua and tools/generate.lua name a wrong input, flag or value and exit 2', function()
    local m = GPT { preset = 'tiny', vocab = 6, seq = 8 }
    save_ckpt(dir .. '/dna.h5', m)
    helpers.write_file(dir .. '/p.fa', '>x\nACGTQ\n')
    local ck = helpers.shq(dir .. '/dna.h5')
    for _, c in ipairs({
      { 'tools/score.lua', 'tools/score.lua: no model given' },
      { 'tools/score.lua ' .. ck, 'tools/score.lua: nothing to score: give files after the model, --text STRING, or --split valid' },
      { 'tools/score.lua ' .. ck .. ' --split valid', 'tools/score.lua: --split valid: the data the model was trained on is not found (give --data FILE)' },
      { 'tools/score.lua ' .. ck .. ' --text ACGTJ', "tools/score.lua: --text 1: encode: character 'J' at position 5 is not a nucleotide code" },
      { 'tools/score.lua ' .. ck .. ' ' .. helpers.shq(dir .. '/p.fa'), "line 2 column 5: 'Q' is not a nucleotide code" },
      { 'tools/score.lua ' .. ck .. ' --text A --stride 9', 'tools/score.lua: --stride 9 is longer than the context 8' },
      { 'tools/score.lua ' .. ck .. ' --text A --batch 0', 'tools/score.lua: --batch must be an integer >= 1, got 0' },
      { 'tools/score.lua ' .. ck .. ' --text A --strands two', "tools/score.lua: --strands must be forward or both, got 'two'" },
      { 'tools/score.lua ' .. ck .. ' --text A --strid 2', "tools/score.lua: unknown flag --strid (did you mean '--stride'?)" },
      { 'tools/score.lua ' .. helpers.shq(dir .. '/none') .. ' --text A', "tools/score.lua: no such file or directory: '" .. dir .. "/none'" },
      { 'tools/score.lua ' .. ck .. ' --text A --precision fp8', "tools/score.lua: --precision must be auto, f32, bf16, got 'fp8'" },
      { 'tools/score.lua ' .. ck .. ' --text A --device gpu', "tools/score.lua: --device must be cpu, cuda, got 'gpu'" },
      { 'tools/score.lua ' .. ck .. ' --text A --kind protein', "tools/score.lua: --kind must be text, dna, got 'protein'" },
      { 'tools/score.lua ' .. ck .. ' ' .. ck, 'tools/score.lua: ' .. dir .. '/dna.h5 is an HDF5 file (a dataset or checkpoint), not a sequence: the model comes first' },
      { 'tools/score.lua ' .. ck .. ' ' .. helpers.shq(dir), 'tools/score.lua: ' .. dir .. ' is a directory: give the files in it' },
      { 'tools/generate.lua ' .. helpers.shq(dir .. '/p.fa'), 'tools/generate.lua: ' .. dir .. '/p.fa is neither an HDF5 checkpoint nor a safetensors file' },
      { 'tools/generate.lua', 'tools/generate.lua: no model given' },
      { 'tools/generate.lua ' .. ck .. ' --prompt ACGTZ', "tools/generate.lua: --prompt: encode: character 'Z' at position 5" },
      { 'tools/generate.lua ' .. ck, 'tools/generate.lua: --prompt is needed: the data the model was trained on is not found' },
      { 'tools/generate.lua ' .. ck .. ' --prompt A --prompt_file x', 'tools/generate.lua: --prompt or --prompt_file, not both' },
      { 'tools/generate.lua ' .. ck .. ' --prompt A --temperature -1', 'tools/generate.lua: --temperature must be a finite number >= 0' },
      { 'tools/generate.lua ' .. ck .. ' --prompt A --tokens 2.5', 'tools/generate.lua: --tokens must be an integer >= 0, got 2.5' },
      { 'tools/generate.lua ' .. ck .. ' --prompt A --tokens', 'tools/generate.lua: --tokens needs a value' },
      { 'tools/generate.lua ' .. ck .. ' --prompt A --top_k many', "tools/generate.lua: --top_k must be a number, got 'many'" },
      { 'tools/generate.lua ' .. ck .. ' ' .. ck, 'tools/generate.lua: one model at a time, got 2 arguments' },
    }) do
      local out, rc = run(c[1])
      assert.are.equal(2, rc, c[1] .. '\n' .. out)
      assert.truthy(out:find(c[2], 1, true), c[1] .. '\n' .. out)
    end
    local out, rc = helpers.run('OMPI_COMM_WORLD_SIZE=2 bin/ulysses tools/generate.lua ' .. ck .. ' --prompt A')
    assert.are.equal(2, rc, out)
    assert.truthy(out:find('tools/generate.lua: runs as one process, not under mpirun', 1, true), out)
    out, rc = run('tools/score.lua --help')
    assert.are.equal(0, rc, out)
    assert.truthy(out:find('--stride', 1, true) and out:find('--per_token', 1, true), out)
  end)

  it('tools/generate.lua gives the tokens generate gives in-process, past the context too, and starts from the data', function()
    local m = GPT { preset = 'tiny', seq = 8 }
    helpers.write_file(dir .. '/t.txt', string.rep('In the beginning was the word. ', 8))
    prepare { kind = 'text', inputs = { dir .. '/t.txt' }, out = dir .. '/t.h5', valid = 0.25, quiet = true }
    save_ckpt(dir .. '/m.h5', m, dir .. '/t.h5')
    local codec = uly.data.codec('text')
    local prompt = codec:encode('In the')
    for _, c in ipairs({ { 0, 0, 20 }, { 0.9, 5, 3 } }) do   -- greedy; sampled with a seed (20 tokens: past the context of 8)
      uly.manual_seed(c[3])
      local rows = m:generate(prompt, { max_new_tokens = 20, temperature = c[1], top_k = c[2], slide = true, samples = 2 })
      local want = { codec:decode(rows[1]), codec:decode(rows[2]) }
      local out, rc = run(string.format('tools/generate.lua %s --prompt %s --tokens 20 --temperature %g --top_k %d '
                                        .. '--seed %d --samples 2 --raw 1', helpers.shq(dir .. '/m.h5'),
                                        helpers.shq('In the'), c[1], c[2], c[3]))
      assert.are.equal(0, rc, out)
      assert.are.equal(want[1] .. '\n' .. want[2] .. '\n', out)
    end
    -- tools/score.lua --split valid: the split's tokens, as the same bytes in a file give
    local text = helpers.read_file(dir .. '/t.txt')
    helpers.write_file(dir .. '/v.txt', text:sub(#text - math.floor(#text * 0.25) + 1))
    local out, rc = run(string.format('tools/score.lua %s --split valid %s', helpers.shq(dir .. '/m.h5'), helpers.shq(dir .. '/v.txt')))
    assert.are.equal(0, rc, out)
    local c1, n1 = row_of(out, dir .. '/t.h5:valid')
    local c2, n2 = row_of(out, dir .. '/v.txt')
    assert.are.same({ math.floor(#text * 0.25) - 1, n2 }, { c1, n1 })
    assert.are.equal(c2, c1)
    out, rc = run(string.format('tools/score.lua %s --split test', helpers.shq(dir .. '/m.h5')))
    assert.are.equal(2, rc, out)
    assert.truthy(out:find("tools/score.lua: --split must be valid or train, got 'test'", 1, true), out)
    -- a DNA prompt from a FASTA file: its header lines dropped, the letters as --prompt gives them
    local dna = GPT { preset = 'tiny', vocab = 6, seq = 16 }
    save_ckpt(dir .. '/dna.h5', dna)
    helpers.write_file(dir .. '/p.fa', '>chr1 part\nACGTAC\nGGTA\n')
    local a = run('tools/generate.lua ' .. helpers.shq(dir .. '/dna.h5') .. ' --prompt_file ' .. helpers.shq(dir .. '/p.fa')
                  .. ' --tokens 30 --temperature 0 --raw 1')
    local b = run('tools/generate.lua ' .. helpers.shq(dir .. '/dna.h5') .. ' --prompt ACGTACGGTA --tokens 30 --temperature 0 --raw 1')
    assert.are.equal(b, a)
    assert.truthy(a:match('^[ACGTN|]+\n$'), a)
    -- no prompt: the first tokens of the validation split of the data the model was trained on
    local valid = uly.data.open(dir .. '/t.h5', { seq = 8, batch = 1, split = 'valid', random = false })
    local first = valid:decode(valid:batches()())
    out, rc = run('tools/generate.lua ' .. helpers.shq(dir .. '/m.h5') .. ' --tokens 5 --temperature 0')
    assert.are.equal(0, rc, out)
    assert.truthy(out:find('--- prompt (8 tokens)\n' .. first .. '\n--- sample 1 (5 tokens)\n', 1, true), out)
    uly.manual_seed(1)
    local cont = codec:decode(m:generate(codec:encode(first), { max_new_tokens = 5, temperature = 0, slide = true }))
    assert.truthy(out:find('--- sample 1 (5 tokens)\n' .. cont .. '\n', 1, true), out)
  end)
end)
