-- spec/train_spec.lua — train.lua end to end on the embedded text: it trains (the loss falls),
-- prints progress/eval/summary lines, writes the CSV log, the SVG plot and a checkpoint, samples
-- from the model; resuming (10 steps + checkpoint + 10 steps) is bit-for-bit the 20-step run,
-- dropout included; bad flags and missing data give clear messages; under mpirun the
-- sequence-parallel run (P = 2, 4) follows the single-process loss curve step by step.
local uly = require 'ulysses'
local helpers = require 'helpers'
local ffi = require 'ffi'

local tmpdir = helpers.mkdtemp

local function run(args) return helpers.run('bin/ulysses train.lua ' .. args) end

local TINY = '--data embedded --preset tiny --seq 32 --batch 8 --warmup 5 --lr 3e-3 --min_lr 3e-4 --threads 2 '

local read_file = helpers.read_file

describe('train.lua', function()
  it('trains on the embedded text with progress, eval, log, plot, checkpoint and a sample', function()
    local dir = tmpdir()
    local out, code = run(TINY .. '--steps 60 --eval_every 20 --sample 24 --prompt "And God said" --out ' .. dir)
    assert.are.equal(0, code, out)
    -- one progress line per step with every field
    local steps, losses = 0, {}
    for line in out:gmatch('[^\n]+') do
      if line:match('^step ') then
        steps = steps + 1
        for _, field in ipairs({ 'loss ', 'lr ', 'tok/s', 'FLOP/s', 'MFU ', 'mem ' }) do
          assert.truthy(line:find(field, 1, true), 'missing ' .. field .. ' in: ' .. line)
        end
        assert.truthy(line:find('ETA ', 1, true) or line:find('done in', 1, true), line)
        losses[#losses + 1] = tonumber(line:match('loss (%d+%.%d+)'))
      end
    end
    assert.are.equal(60, steps, out)
    assert.truthy(losses[1] > 5.0, out)                    -- ~ln 256 at initialisation
    assert.truthy(losses[#losses] < losses[1] - 2.0, out)  -- learned the byte statistics and more
    local evals = 0
    for _ in out:gmatch('eval step') do evals = evals + 1 end
    assert.are.equal(3, evals, out)
    assert.truthy(out:find('unigram entropy of the training data', 1, true), out)
    assert.truthy(out:find('--- summary ---', 1, true), out)
    assert.truthy(out:find('\nAnd God said\n--- continuation (24 tokens)\n', 1, true), out)   -- the prompt, then the sample (past --seq 32)
    -- the CSV log has one row per step; the plot is an SVG with a polyline
    local rows = uly.log.read_csv(dir .. '/log.csv')
    assert.are.equal(60, #rows)
    assert.are.equal(60, rows[60].step)
    assert.truthy(rows[20].val_loss and rows[60].val_loss and not rows[19].val_loss)
    local svg = read_file(dir .. '/loss.svg')
    assert.truthy(svg and svg:find('<svg', 1, true) and svg:find('<polyline', 1, true))
    -- a checkpoint holding every parameter by name
    local f = uly.h5.open(dir .. '/ckpt/step_000060.h5')
    assert.truthy(f:exists('model/blocks.2.attn.wqkv.weight'))
    assert.truthy(f:exists('optim/exp_avg/wte.weight'))
    assert.are.equal(60, f:attr('/', 'step'))
    f:close()
  end)

  -- stdout line-buffered: through a pipe or into a log, a header line printed before an error
  -- comes before it (fully buffered, it came out at exit, after the error)
  it('keeps its lines in order with its errors in one log', function()
    local dir = tmpdir()
    local out, code = helpers.run('ULY_CUDA_LIB=/nonexistent/libulysses_cuda.so bin/ulysses train.lua --device cuda ' ..
                                  TINY .. '--steps 1 --out ' .. dir)
    assert.are_not.equal(0, code, out)
    local data_at, error_at = out:find('data: ', 1, true), out:find("device 'cuda' is not available", 1, true)
    assert.truthy(data_at and error_at and data_at < error_at, out)
    helpers.rmtree(dir)
  end)

  it('--device cuda (the simulated device here) follows the CPU run step by step, and resumes', function()
    local a, b = tmpdir(), tmpdir()
    local common = TINY .. '--steps 12 --dropout 0.1 --eval_every 6 --sample 8 '
    -- on cuda the precision defaults to bf16: the CPU reference rounds the same way
    local out, code = run(common .. '--precision bf16 --out ' .. a)
    assert.are.equal(0, code, out)
    local engine = uly.cpu_bf16_gemm()
    assert.truthy(out:find('matmul precision bf16 (bf16 GEMM engine: ' .. engine .. '),', 1, true), out)
    if engine == 'amx' then   -- MFU against the tiles' bf16 peak (AVX512-BF16's: where above the f32 peak)
      assert.are.equal(engine == 'amx' and 'AMX' or 'AVX512-BF16', out:match('%((%S+) bf16 peak of %d+ threads, measured%)'),
                       out)
    end
    out, code = run('--device cuda --stop_after 6 ' .. common .. '--out ' .. b)
    if not uly.cuda.available() then  -- without a GPU (or the simulation) it refuses, saying why
      assert.are_not.equal(0, code, out)
      assert.truthy(out:find("--device cuda: device 'cuda' is not available", 1, true), out)
    end
    local sim = 'ULY_CUDA_SIMULATE=1 '
    local p = assert(io.popen(sim .. 'bin/ulysses train.lua --device cuda --stop_after 6 ' .. common .. '--out ' .. b ..
                              ' 2>&1 && ' .. sim .. 'bin/ulysses train.lua --device cuda --resume auto ' .. common ..
                              '--out ' .. b .. ' 2>&1; echo "exit=$?"'))
    out = p:read('*a')
    p:close()
    assert.truthy(out:match('exit=0%s*$'), out)
    assert.truthy(out:find('resumed from', 1, true), out)
    assert.truthy(out:find('matmul precision bf16', 1, true), out)
    assert.truthy(out:find('MFU: the device is the host-memory simulation; not reported', 1, true), out)
    local ra, rb = uly.log.read_csv(a .. '/log.csv'), uly.log.read_csv(b .. '/log.csv')
    assert.are.equal(12, #rb)
    for i = 1, 12 do
      assert.is_true(math.abs(ra[i].loss - rb[i].loss) <= 1e-5 * ra[i].loss, ('step %d: %s vs %s'):format(i, ra[i].loss, rb[i].loss))
    end
    helpers.rmtree(a)
    helpers.rmtree(b)
  end)

  it('--activations bf16 follows the f32 run within bf16 rounding, holds less, and resumes bit for bit', function()
    local a, b, c = tmpdir(), tmpdir(), tmpdir()
    local common = TINY .. '--steps 12 --dropout 0.1 --eval_every 6 --sample 8 --checkpoint 2 '
    local out, code = run(common .. '--out ' .. a)
    assert.are.equal(0, code, out)
    local out16
    out16, code = run(common .. '--activations bf16 --out ' .. b)
    assert.are.equal(0, code, out16)
    assert.truthy(out16:find('activations bf16', 1, true), out16)
    out, code = run(common .. '--activations bf16 --stop_after 6 --out ' .. c)
    assert.are.equal(0, code, out)
    out, code = run(common .. '--activations bf16 --resume auto --out ' .. c)
    assert.are.equal(0, code, out)
    local ra, rb, rc = uly.log.read_csv(a .. '/log.csv'), uly.log.read_csv(b .. '/log.csv'), uly.log.read_csv(c .. '/log.csv')
    assert.are.equal(12, #rc)
    local differs = false
    for i = 1, 12 do
      assert.is_true(math.abs(ra[i].loss - rb[i].loss) <= 2e-2 * ra[i].loss, ('step %d: %s vs %s'):format(i, ra[i].loss, rb[i].loss))
      assert.are.equal(rb[i].loss, rc[i].loss, 'resumed step ' .. i)
      differs = differs or ra[i].loss ~= rb[i].loss
    end
    assert.is_true(differs, 'bf16 activations changed nothing')
    local peak = function(o) return tonumber(o:match('peak memory per rank: ([%d.]+) MiB')) end
    assert.is_true(peak(out16) < peak(run(common .. '--out ' .. a)), 'bf16 activations hold less')
    out, code = run(common .. '--activations f16 --out ' .. a)
    assert.are_not.equal(0, code, out)
    assert.truthy(out:find("--activations must be f32 | bf16, got 'f16'", 1, true), out)
    helpers.rmtree(a)
    helpers.rmtree(b)
    helpers.rmtree(c)
  end)

  -- (the resumed run recomputes its blocks except attention in backward: the same numbers)
  it('resumes bit-for-bit: 10 steps + checkpoint + 10 steps equals 20 steps (with dropout)', function()
    local a, b = tmpdir(), tmpdir()
    local common = TINY .. '--steps 20 --dropout 0.1 --eval_every 0 --sample 0 '
    local out, code = run(common .. '--out ' .. a)
    assert.are.equal(0, code, out)
    assert.falsy(out:find('recomputed', 1, true), out)
    common = common .. '--checkpoint 2 '
    out, code = run(common .. '--stop_after 10 --out ' .. b)
    assert.are.equal(0, code, out)
    assert.truthy(out:find('blocks recomputed in backward except attention', 1, true), out)
    assert.is_nil(read_file(b .. '/ckpt/step_000020.h5'))
    -- the second half given only where the run is: its checkpoint says how it was started
    out, code = run('--resume auto --threads 2 --out ' .. b)
    assert.are.equal(0, code, out)
    assert.truthy(out:find('resume: the run\'s own flags from ' .. b .. '/ckpt/step_000010.h5: --preset tiny --dropout 0.1 '
                           .. '--checkpoint 2 --seq 32 --batch 8 --steps 20 --lr 0.003 --min_lr 0.0003 --warmup 5 '
                           .. '--data embedded --eval_every 0 --sample 0 (flags given here win)', 1, true), out)
    assert.truthy(out:find('resumed from ' .. b .. '/ckpt/step_000010.h5 at step 10', 1, true), out)
    -- the logs agree step by step (the resumed run appended to its log)
    local ra, rb = uly.log.read_csv(a .. '/log.csv'), uly.log.read_csv(b .. '/log.csv')
    assert.are.equal(20, #ra)
    assert.are.equal(20, #rb)
    for i = 1, 20 do assert.are.equal(ra[i].loss, rb[i].loss, 'loss at step ' .. i) end
    -- and every tensor of the final checkpoints is identical, bit for bit
    local fa, fb = uly.h5.open(a .. '/ckpt/step_000020.h5'), uly.h5.open(b .. '/ckpt/step_000020.h5')
    local names = fa:list('/')
    assert.are.same(names, fb:list('/'))
    assert.truthy(#names > 30)
    for _, name in ipairs(names) do
      local ta, tb = fa:read(name), fb:read(name)
      local n = ta:numel()
      local pa, pb = ta:data(), tb:data()
      for i = 0, n - 1 do
        if pa[i] ~= pb[i] then error(string.format('%s differs at %d: %.9g vs %.9g', name, i, pa[i], pb[i])) end
      end
    end
    fa:close()
    fb:close()
  end)

  it('--export writes the final weights as safetensors and --init starts another run from them', function()
    local a, b = tmpdir(), tmpdir()
    local common = TINY .. '--eval_every 0 --sample 0 '
    helpers.rmtree(a)   -- --out made by the run, the export written into it
    local out, code = run(common .. '--steps 3 --out ' .. a .. ' --export ' .. a .. '/w.safetensors')
    assert.are.equal(0, code, out)
    assert.truthy(out:find('weights: ' .. a .. '/w.safetensors', 1, true), out)
    -- the export holds the weights the final checkpoint holds, bit for bit, and the model's config
    local w, meta = uly.safetensors.load(a .. '/w.safetensors')
    local ck = uly.h5.open(a .. '/ckpt/step_000003.h5')
    local n = 0
    for name, t in pairs(w) do
      local c = ck:read('model/' .. name)
      assert.are.same(c:shape(), t:shape(), name)
      local pc, pt = c:data(), t:data()
      for i = 0, t:numel() - 1 do assert(pc[i] == pt[i], name) end
      n = n + 1
    end
    ck:close()
    assert.are.equal(#require('models.gpt') { preset = 'tiny', seq = 32 }:parameters(), n)
    assert.are.equal('gpt', meta.ulysses_model)
    assert.truthy(meta.ulysses_config:find('preset="tiny"', 1, true), meta.ulysses_config)
    -- checkpoint.export makes the same weights of the checkpoint, with its config and step
    assert.are.equal(n, uly.checkpoint.export(a .. '/ckpt/step_000003.h5', a .. '/c.safetensors'))
    local wc, mc = uly.safetensors.load(a .. '/c.safetensors')
    for name, t in pairs(w) do assert.are.equal(ffi.string(t:data(), t:nbytes()), ffi.string(wc[name]:data(), t:nbytes()), name) end
    assert.are.equal(meta.ulysses_config, mc.ulysses_config)
    assert.are.equal('3', mc.ulysses_step)
    assert.matches('is not an HDF5 file', helpers.error_of(uly.checkpoint.export, a .. '/c.safetensors', a .. '/d.safetensors'),
                   1, true)
    assert.matches('checkpoint.export: ' .. a .. "/embedded.h5 has no 'format' attribute; is it a ulysses checkpoint?",
                   helpers.error_of(uly.checkpoint.export, a .. '/embedded.h5', a .. '/d.safetensors'), 1, true)
    assert.is_nil(read_file(a .. '/d.safetensors'))
    -- a run from those weights with a learning rate too small to move them exports them back
    out, code = run(common .. '--steps 1 --lr 1e-12 --min_lr 0 --out ' .. b .. ' --init ' .. a .. '/w.safetensors --export '
                    .. b .. '/w.safetensors')
    assert.are.equal(0, code, out)
    assert.truthy(out:find('weights from ' .. a .. '/w.safetensors', 1, true), out)
    local w2 = uly.safetensors.load(b .. '/w.safetensors')
    for name, t in pairs(w) do
      local p, q = t:data(), w2[name]:data()
      for i = 0, t:numel() - 1 do
        assert(math.abs(p[i] - q[i]) <= 1e-9, string.format('%s[%d]: %.9g vs %.9g', name, i, p[i], q[i]))
      end
    end
    -- the same shapes with other heads: refused (the exported config says so); other settings noted
    out, code = run(common .. '--heads 4 --steps 1 --out ' .. b .. '/h --init ' .. a .. '/w.safetensors')
    assert.are.equal(2, code, out)
    assert.truthy(out:find('train.lua: --init ' .. a .. '/w.safetensors: its weights are of another model: heads 2 (this run: 4); '
                           .. 'to match it: --heads 2', 1, true), out)
    out, code = run(common .. '--window 8 --steps 1 --out ' .. b .. '/n --init ' .. a .. '/w.safetensors')
    assert.are.equal(0, code, out)
    assert.truthy(out:find('note: --init ' .. a .. '/w.safetensors: window 8 (saved with none)', 1, true), out)
    -- weights of another model, or of another size: every difference said at once, before training
    out, code = run(common .. '--model llama --steps 1 --out ' .. b .. '/l --init ' .. a .. '/w.safetensors')
    assert.are.equal(2, code, out)
    assert.truthy(out:find('train.lua: --init ' .. a .. '/w.safetensors: its weights are of another model: model gpt '
                           .. '(this run: llama), heads 2 (this run: 4); to match it: --model gpt --heads 2', 1, true), out)
    out, code = run(common .. '--layers 3 --preset small --seq 64 --steps 1 --out ' .. b .. '/l3 --init ' .. a .. '/w.safetensors')
    assert.are.equal(2, code, out)
    assert.truthy(out:find('train.lua: --init ' .. a .. '/w.safetensors: its weights are of another model: layers 2 (this run: '
                           .. '3), heads 2 (this run: 4), dim 32 (this run: 256), seq 32 (this run: 64); to match it: --preset '
                           .. 'tiny, or --layers 2 --heads 2 --dim 32 --seq 32', 1, true), out)
    -- a checkpoint gives its weights too (the generator as seeded: the run equals the one from the export)
    out, code = run(common .. '--steps 1 --lr 1e-12 --min_lr 0 --out ' .. b .. '/c --init ' .. a .. '/ckpt/step_000003.h5 --export '
                    .. b .. '/c/w.safetensors')
    assert.are.equal(0, code, out)
    local w3 = uly.safetensors.load(b .. '/c/w.safetensors')
    for name, t in pairs(w2) do helpers.assert_close(w3[name], t, 0, 0, name) end
    -- a checkpoint of another model to --resume, a safetensors file to --resume, a dataset to --init
    out, code = run(common .. '--dim 64 --steps 4 --out ' .. a .. ' --resume auto')
    assert.are.equal(2, code, out)
    assert.truthy(out:find('train.lua: --resume ' .. a .. '/ckpt/step_000003.h5: the checkpoint is of another model: dim 32 '
                           .. '(this run: 64); to match it: --dim 32', 1, true), out)
    out, code = run(common .. '--steps 4 --out ' .. b .. '/r --resume ' .. a .. '/w.safetensors')
    assert.are.equal(2, code, out)
    assert.truthy(out:find('train.lua: --resume ' .. a .. '/w.safetensors: a safetensors file holds weights only (--init starts '
                           .. 'a run from them); --resume takes a checkpoint, OUT/ckpt/step_N.h5, or auto', 1, true), out)
    out, code = run(common .. '--steps 1 --out ' .. b .. '/d --init ' .. a .. '/embedded.h5')
    assert.are.equal(2, code, out)
    assert.truthy(out:find('train.lua: --init ' .. a .. '/embedded.h5 is a dataset (text), not a model', 1, true), out)
    assert.falsy(out:find('step 1', 1, true), out)
  end)

  it('says what is wrong with bad flags and missing data', function()
    local out, code = run('--no_such_flag 1')
    assert.are.equal(2, code)
    assert.truthy(out:find('unknown flag --no_such_flag', 1, true), out)
    out, code = run('--steps many')
    assert.are.equal(2, code)
    assert.truthy(out:find('--steps expects a number, got "many"', 1, true), out)
    out, code = run('--data /nonexistent/x.h5')
    assert.are.equal(2, code)
    assert.truthy(out:find('--data /nonexistent/x.h5: no such file', 1, true), out)
    out, code = run('--help')
    assert.are.equal(0, code)
    assert.truthy(out:find('--resume', 1, true), out)
    -- every value is checked before anything runs, and the message names the flag at fault
    for flags, want in pairs({
      ['--keep 0'] = '--keep must be an integer >= 1, got 0',
      ['--accum 0'] = '--accum must be an integer >= 1, got 0',
      ['--steps -3'] = '--steps must be an integer >= 1, got -3',
      ['--steps 2.5'] = '--steps must be an integer >= 1, got 2.5',
      ['--schedule linear'] = "--schedule must be cosine | constant, got 'linear'",
      ['--checkpoint 3'] = "--checkpoint must be 0 | 1 | 2, got '3'",
      ['--checkpoint 2 --attention reference'] = '--checkpoint 2 keeps flash attention\'s outputs: it needs --attention flash',
      ['--dropout 1'] = '--dropout must be >= 0 and < 1, got 1',
      ['--lr 0'] = '--lr must be > 0, got 0',
      ['--top_k -5'] = '--top_k must be an integer >= 0, got -5',
      ['--device gpu'] = "--device gpu: say 'cuda'",
      ['--device cuda:0'] = "--device cuda:0: say 'cuda'",
      ['--resume /nonexistent/ckpt.h5'] = '--resume /nonexistent/ckpt.h5: no such checkpoint',
      ['--init /nonexistent/w.safetensors'] = '--init /nonexistent/w.safetensors: no such file',
      ['--export /nonexistent/w.safetensors'] = '--export /nonexistent/w.safetensors: no directory /nonexistent to write it in',
      ['--export spec'] = '--export spec is a directory: give the file to write (e.g. spec/model.safetensors)',
    }) do
      out, code = run(TINY .. flags)
      assert.are.equal(2, code, flags .. ':\n' .. out)
      assert.truthy(out:find('train.lua: ' .. want, 1, true), flags .. ':\n' .. out)
      assert.falsy(out:find('stack traceback', 1, true), out)
      assert.falsy(out:find('--eval_every', 1, true), 'a mistake prints the message, not every flag:\n' .. out)
    end
  end)

  it('--resume auto starts fresh without a checkpoint, and says so when the run is already done', function()
    local dir = tmpdir()
    local args = TINY .. '--steps 2 --eval_every 0 --sample 0 --out ' .. dir .. ' --resume auto'
    local out, code = run(args)
    assert.are.equal(0, code, out)
    assert.truthy(out:find('resume: no checkpoint in ' .. dir .. '/ckpt, starting fresh', 1, true), out)
    assert.truthy(out:find('step 2/2', 1, true), out)
    out, code = run(args)
    assert.are.equal(0, code, out)
    assert.truthy(out:find('nothing to train: the run is at step 2 already (--steps 2)', 1, true), out)
    assert.falsy(out:find('step 1/2', 1, true), out)
    helpers.rmtree(dir)
  end)

  it('trains without a validation split with --eval_batches 0, and says how when the split is too short', function()
    local dir = tmpdir()
    local out, code = run(TINY:gsub('--seq 32', '--seq 512') .. '--batch 1 --steps 1 --sample 0 --out ' .. dir)
    assert.are.equal(2, code, out)
    assert.truthy(out:find("split 'valid'", 1, true), out)
    assert.truthy(out:find('--eval_batches 0 trains without validation', 1, true), out)
    out, code = run(TINY:gsub('--seq 32', '--seq 512') .. '--batch 1 --steps 1 --sample 8 --eval_batches 0 --out ' .. dir)
    assert.are.equal(0, code, out)
    assert.truthy(out:find('no validation (--eval_batches 0)', 1, true), out)
    assert.truthy(out:find('sample (temperature', 1, true), out)
    -- prompt and continuation on lines of their own, with their lengths (no separator character)
    assert.truthy(out:find('%-%-%- prompt %(%d+ tokens%)\n'), out)
    assert.truthy(out:find('--- continuation (8 tokens)\n', 1, true), out)
    helpers.rmtree(dir)
  end)

  it('--data FILE (text, FASTA, GenBank, compressed or not) or a directory of them is prepared into OUT once and reused while unchanged', function()
    local dir, src = tmpdir(), tmpdir()
    local FLAGS = TINY:gsub('%-%-data embedded ', '') .. '--steps 2 --eval_every 0 --sample 0 --log_every 100 '
    local text = string.rep('In the beginning was a corpus of plain text. ', 30)
    helpers.write_file(src .. '/corpus.txt', text)
    local out, code = run(FLAGS .. '--data ' .. src .. '/corpus.txt --out ' .. dir)
    assert.are.equal(0, code, out)
    local n_valid = math.floor(#text * 0.05)
    assert.truthy(out:find(string.format('data: prepared %s/corpus.txt into %s/corpus.h5: text, %d train / %d valid tokens',
                                         src, dir, #text - n_valid, n_valid), 1, true), out)
    local f = uly.h5.open(dir .. '/corpus.h5')
    local train = f:read('train')
    assert.are.same({ 'text', #text - n_valid }, { f:attr('', 'kind'), train:numel() })
    for i = 1, 50 do assert.are.equal(text:byte(i), train[i]:item()) end
    f:close()
    -- unchanged: reused (the same kind asked for, or auto); changed: prepared again
    out, code = run(FLAGS .. '--data_kind text --data ' .. src .. '/corpus.txt --out ' .. dir)
    assert.are.equal(0, code, out)
    assert.truthy(out:find('data: ' .. dir .. '/corpus.h5, prepared from ' .. src .. '/corpus.txt (text) by an earlier run', 1, true), out)
    helpers.write_file(src .. '/corpus.txt', text .. text)
    out, code = run(FLAGS .. '--data ' .. src .. '/corpus.txt --out ' .. dir)
    assert.are.equal(0, code, out)
    assert.truthy(out:find('data: prepared ' .. src .. '/corpus.txt into ' .. dir .. '/corpus.h5: text, '
                           .. (2 * #text - math.floor(2 * #text * 0.05)) .. ' train', 1, true), out)
    -- FASTA, gzipped: DNA, a record each, the model's vocabulary 6; --data_kind text reads it as bytes
    local seq = string.rep('ACGTTGCA', 60)
    helpers.write_file(src .. '/g.fa', '>one\n' .. seq .. '\n>two\n' .. seq:reverse() .. '\n')
    assert.are.equal(0, os.execute('gzip -f ' .. helpers.shq(src .. '/g.fa')))
    out, code = run(FLAGS .. '--data ' .. src .. '/g.fa.gz --out ' .. dir)
    assert.are.equal(0, code, out)
    assert.truthy(out:find('data: prepared ' .. src .. '/g.fa.gz into ' .. dir .. '/g.h5: dna, ', 1, true), out)
    assert.truthy(out:find(', 2 records, ', 1, true), out)
    assert.truthy(out:find('data: ' .. dir .. '/g.h5, dna, vocab 6,', 1, true), out)
    out, code = run(FLAGS .. '--data_kind text --data ' .. src .. '/g.fa.gz --out ' .. dir)
    assert.are.equal(0, code, out)
    assert.truthy(out:find('into ' .. dir .. '/g.h5: text, ', 1, true), out)
    -- a protein FASTA, and a file of another origin where the prepared one would go
    helpers.write_file(src .. '/p.fa', '>protein\nMKVLQ\n')
    out, code = run(FLAGS .. '--data ' .. src .. '/p.fa --out ' .. dir)
    assert.are.equal(2, code, out)
    assert.truthy(out:find("train.lua: --data " .. src .. "/p.fa (read as dna): " .. src .. "/p.fa line 2 column 4: 'L' is not "
                           .. 'a nucleotide code (ACGTU or IUPAC ambiguity letters); is this a protein FASTA?; --data_kind '
                           .. 'text reads it as text', 1, true), out)
    -- what is not data: a directory, weights, a binary file (unless read as bytes on purpose)
    uly.safetensors.save(src .. '/w.safetensors', { x = uly.zeros(3) })
    helpers.write_file(src .. '/b.bin', 'ab\0cd' .. string.rep('z', 1000))
    for _, c in ipairs({
      { src .. '/w.safetensors', '--data ' .. src .. '/w.safetensors is a safetensors file of weights, not data (--init starts a run from weights)' },
      { src .. '/b.bin', '--data ' .. src .. '/b.bin holds NUL bytes: a binary file, not text or DNA (--data_kind text trains on its bytes anyway)' },
    }) do
      out, code = run(FLAGS .. '--data ' .. c[1] .. ' --out ' .. dir)
      assert.are.equal(2, code, out)
      assert.truthy(out:find('train.lua: ' .. c[2], 1, true), out)
    end
    out, code = run(FLAGS .. '--data ' .. src .. '/b.bin --data_kind text --out ' .. dir)
    assert.are.equal(0, code, out)
    -- a file too small to hold a validation split: said with the flag that helps, which then trains on all of it
    helpers.write_file(src .. '/tiny.txt', string.rep('x', 10))
    out, code = run(FLAGS .. '--data ' .. src .. '/tiny.txt --out ' .. dir)
    assert.are.equal(2, code, out)
    assert.truthy(out:find('leaves no validation tokens: a larger file, or --eval_batches 0 (no validation split)', 1, true), out)
    out, code = run(FLAGS .. '--data ' .. src .. '/tiny.txt --eval_batches 0 --seq 4 --out ' .. dir)
    assert.are.equal(0, code, out)
    assert.truthy(out:find('tiny.h5: text, 10 train / 0 valid tokens', 1, true), out)
    -- a directory: its files in name order (hidden ones and subdirectories left out), one kind
    local docs = src .. '/docs'
    uly.checkpoint._mkdir_p(docs .. '/sub')
    helpers.write_file(docs .. '/b.txt', string.rep('second document. ', 20))
    helpers.write_file(docs .. '/a.txt', string.rep('first document. ', 20))
    helpers.write_file(docs .. '/.hidden', 'not this')
    out, code = run(FLAGS .. '--data ' .. docs .. ' --out ' .. dir)
    assert.are.equal(0, code, out)
    assert.truthy(out:find('data: prepared ' .. docs .. ' (2 files) into ' .. dir .. '/docs.h5: text, ', 1, true), out)
    local fd = uly.h5.open(dir .. '/docs.h5')
    local toks = fd:read('train')
    fd:close()
    local both = string.rep('first document. ', 20) .. string.rep('second document. ', 20)
    for _, i in ipairs({ 1, 320, 321, toks:numel() }) do assert.are.equal(both:byte(i), toks[i]:item(), 'token ' .. i) end
    out, code = run(FLAGS .. '--data ' .. docs .. '/ --out ' .. dir)   -- the same files: reused
    assert.are.equal(0, code, out)
    assert.truthy(out:find('data: ' .. dir .. '/docs.h5, prepared from ' .. docs .. '/ (text) by an earlier run', 1, true), out)
    helpers.write_file(docs .. '/c.fa', '>x\nACGT\n')
    out, code = run(FLAGS .. '--data ' .. docs .. ' --out ' .. dir)
    assert.are.equal(2, code, out)
    assert.truthy(out:find('train.lua: --data ' .. docs .. ' holds DNA and text files (' .. docs .. '/a.txt is text, ' .. docs
                           .. '/c.fa is dna): --data_kind says how to read all of them', 1, true), out)
    uly.checkpoint._mkdir_p(src .. '/empty')
    out, code = run(FLAGS .. '--data ' .. src .. '/empty --out ' .. dir)
    assert.are.equal(2, code, out)
    assert.truthy(out:find('train.lua: --data ' .. src .. '/empty is a directory without files to train on', 1, true), out)
    local other = uly.h5.create(dir .. '/mine.h5')
    other:close()
    helpers.write_file(src .. '/mine.txt', text)
    out, code = run(FLAGS .. '--data ' .. src .. '/mine.txt --out ' .. dir)
    assert.are.equal(2, code, out)
    assert.truthy(out:find('train.lua: --data ' .. src .. '/mine.txt would be prepared into ' .. dir .. '/mine.h5, which holds '
                           .. 'something else (not a file train.lua prepared from a --data file): move it, or give another --out', 1, true), out)
    helpers.rmtree(dir)
    helpers.rmtree(src)
  end)

  it('keeps the weights of the best validation loss in OUT/ckpt/best.h5, across a resume, unless --save_best 0', function()
    local dir = tmpdir()
    local args = TINY .. '--steps 20 --eval_every 5 --ckpt_every 5 --sample 0 --log_every 100 --out ' .. dir .. ' '
    local out, code = run(args .. '--stop_after 10')
    assert.are.equal(0, code, out)
    local rows = uly.log.read_csv(dir .. '/log.csv')
    local best, best_step = math.huge, nil
    for _, r in ipairs(rows) do if r.val_loss and r.val_loss < best then best, best_step = r.val_loss, r.step end end
    local function saved()
      local f = uly.h5.open(dir .. '/ckpt/best.h5')
      local step, extra = f:attr('', 'step'), uly.checkpoint.deserialize(f:attr('', 'extra'), 'extra')
      local has_optim = f:exists('optim')
      f:close()
      return step, extra, has_optim
    end
    local step, extra, has_optim = saved()
    assert.are.equal(best_step, step)
    assert.is_true(math.abs(extra.val_loss - best) <= 1e-4 * best, tostring(extra.val_loss))
    assert.is_false(has_optim)                                  -- weights only
    assert.truthy(out:find('(the best validation loss, ' .. string.format('%.4f', extra.val_loss) .. ': ' .. dir
                           .. '/ckpt/best.h5)', 1, true), out)
    -- the weights are those of that step's model: its checkpoint holds the same tensors
    local a, b = uly.h5.open(dir .. '/ckpt/best.h5'), uly.h5.open(dir .. string.format('/ckpt/step_%06d.h5', step))
    for _, name in ipairs(a:list('model')) do
      helpers.assert_close(a:read(name), b:read(name), 0, 0, name)
    end
    a:close() b:close()
    -- resumed: compared with the loss the file records (here made unbeatable), so it stays
    local f = uly.h5.open(dir .. '/ckpt/best.h5', 'r+')
    f:set_attr('', 'extra', uly.checkpoint.serialize({ val_loss = 0.001, data_path = extra.data_path }, 'extra'))
    f:close()
    out, code = run(args .. '--resume auto')
    assert.are.equal(0, code, out)
    assert.are.equal(step, (saved()))
    assert.truthy(out:find('(the best validation loss, 0.0010: ', 1, true), out)
    -- a fresh run moves it aside with the rest of ckpt/; --save_best 0 writes none
    out, code = run(args .. '--save_best 0 --steps 5')
    assert.are.equal(0, code, out)
    assert.is_false(helpers.exists(dir .. '/ckpt/best.h5'))
    assert.is_true(helpers.exists(dir .. '/previous-1/ckpt/best.h5'))
    helpers.rmtree(dir)
  end)

  it('finds the default data under $ULY_DATA, where datasets/prepare.sh puts it', function()
    local dir = tmpdir()
    local out, code = run(TINY .. '--steps 1 --eval_every 0 --sample 0 --out ' .. dir)   -- makes embedded.h5
    assert.are.equal(0, code, out)
    os.rename(dir .. '/embedded.h5', dir .. '/kjv.h5')
    local p = assert(io.popen('ULY_DATA=' .. helpers.shq(dir) .. ' bin/ulysses train.lua '
                              .. TINY:gsub('%-%-data embedded ', '') .. '--steps 1 --eval_every 0 --sample 0 --out '
                              .. dir .. '/run 2>&1; echo "exit=$?"'))
    out = p:read('*a')
    p:close()
    assert.truthy(out:match('exit=0%s*$'), out)
    assert.truthy(out:find('data: ' .. dir .. '/kjv.h5', 1, true), out)
    helpers.rmtree(dir)
  end)

  it('a fresh run into a directory holding another run moves that run aside whole', function()
    local dir = tmpdir()
    local args = TINY .. '--eval_every 0 --eval_batches 0 --sample 0 --out ' .. dir
    local out, code = run(args .. ' --steps 3')
    assert.are.equal(0, code, out)
    out, code = run(args .. ' --steps 2 --seed 5')
    assert.are.equal(0, code, out)
    assert.truthy(out:find(dir .. ' held another run (its latest checkpoint step_000003.h5): moved to '
                           .. dir .. '/previous-1', 1, true), out)
    assert.truthy(read_file(dir .. '/previous-1/ckpt/step_000003.h5'), 'the old run\'s checkpoint was lost')
    assert.truthy(read_file(dir .. '/previous-1/log.csv'), 'the old run\'s log was lost')
    assert.truthy(read_file(dir .. '/ckpt/step_000002.h5'), 'the new run\'s checkpoint is missing')
    assert.falsy(read_file(dir .. '/ckpt/step_000003.h5'), 'the runs were mixed')
    helpers.rmtree(dir)
  end)

  it('notes a --warmup that covers the whole run and more threads than cores, and trains anyway', function()
    local dir = tmpdir()
    local cores = uly.get_num_threads()
    local out, code = run(TINY .. '--warmup 30 --steps 3 --eval_every 0 --sample 0 --out ' .. dir .. ' --threads ' .. (cores + 1))
    assert.are.equal(0, code, out)
    assert.truthy(out:find('note: --warmup 30 is not below --steps 3: the learning rate rises for the whole run', 1, true), out)
    assert.truthy(out:find(string.format('note: --threads %d is more than the %d cores here', cores + 1, cores), 1, true), out)
    out, code = run(TINY .. '--steps 6 --eval_every 0 --sample 0 --out ' .. dir .. '/b')
    assert.are.equal(0, code, out)
    assert.falsy(out:find('note:', 1, true), out)
    helpers.rmtree(dir)
  end)

  it('--sp without mpirun says that one process does no sequence parallelism', function()
    local dir = tmpdir()
    local out, code = run(TINY .. '--sp 2 --steps 1 --eval_every 0 --eval_batches 0 --sample 0 --out ' .. dir)
    assert.are.equal(0, code, out)
    assert.truthy(out:find('--sp 2: one process (not launched by mpirun), so no sequence parallelism', 1, true), out)
    helpers.rmtree(dir)
  end)
end)

describe('train.lua under mpirun', function()
  -- (not under the sanitizer build: Open MPI's own allocations trip LeakSanitizer in every rank)
  local has_mpi = os.execute('command -v mpirun >/dev/null 2>&1') == 0 and uly.has('mpi')
    and not (os.getenv('LD_PRELOAD') or ''):find('asan', 1, true)
  local function mpirun(np, args)
    return helpers.run('OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 '
      .. 'timeout 120 mpirun --bind-to none --mca mpi_yield_when_idle 1 -np ' .. np .. ' bin/ulysses train.lua ' .. args)
  end

  -- the logged rows of one single-process run of args
  local function reference(args)
    local dir = tmpdir()
    local out, code = run(args .. '--out ' .. dir)
    assert.are.equal(0, code, out)
    return uly.log.read_csv(dir .. '/log.csv')
  end

  -- the n logged losses of a distributed run against the single-process ones, step by step
  local function follows(rows, ref, n, what)
    assert.are.equal(n, #rows)
    for i = 1, n do
      assert.is_true(math.abs(rows[i].loss - ref[i].loss) <= 1e-5 * ref[i].loss,
                     string.format('%s step %d: %.6g vs %.6g', what, i, rows[i].loss, ref[i].loss))
    end
  end

  -- (Llama's blocks recomputed in backward except attention: the kept outputs between the exchanges,
  -- with the gradient reduction overlapping backward)
  it('sequence-parallel runs at P = 2 and 4 follow the single-process losses (GPT and Llama with GQA)', function()
    if not has_mpi then pending('no mpirun or a library without MPI') return end
    for _, model in ipairs({ '--model gpt --heads 2', '--model llama --heads 4 --kv_heads 2 --checkpoint 2' }) do
      local args = TINY .. model .. ' --steps 8 --eval_every 0 --sample 0 --threads 1 '
      local ref = reference(args)
      for _, np in ipairs({ 2, 4 }) do
        local dir = tmpdir()
        local out, code = mpirun(np, args .. '--sp ' .. np .. ' --out ' .. dir)
        assert.are.equal(0, code, out)
        assert.truthy(out:find('dp 1 x sp ' .. np, 1, true), out)
        assert.truthy(out:find('comm ', 1, true), out)            -- bytes and time per step
        follows(uly.log.read_csv(dir .. '/log.csv'), ref, 8, string.format('%s P=%d', model, np))
      end
    end
  end)

  it('a --data FASTA file is prepared once, by rank 0, and the ranks follow the single-process losses', function()
    if not has_mpi then pending('no mpirun or a library without MPI') return end
    local src = tmpdir()
    local seq = string.rep('ACGTTGCAAGGT', 40)
    helpers.write_file(src .. '/g.fa', '>one\n' .. seq .. '\n>two\n' .. seq:reverse() .. '\n')
    local args = TINY:gsub('%-%-data embedded ', '') .. '--data ' .. src .. '/g.fa --steps 4 --eval_every 0 --sample 0 --threads 1 '
    local ref = reference(args)
    local dir = tmpdir()
    local out, code = mpirun(2, args .. '--sp 2 --out ' .. dir)
    assert.are.equal(0, code, out)
    local _, prepared = out:gsub('data: prepared ', '')
    assert.are.equal(1, prepared, out)
    assert.truthy(out:find('data: ' .. dir .. '/g.h5, dna, vocab 6,', 1, true), out)
    follows(uly.log.read_csv(dir .. '/log.csv'), ref, 4, 'FASTA P=2')
    helpers.rmtree(src)
  end)

  it('gradient accumulation follows the single-process losses with the all-reduce overlapped or after backward', function()
    if not has_mpi then pending('no mpirun or a library without MPI') return end
    local args = TINY .. '--model llama --heads 4 --kv_heads 2 --steps 4 --accum 2 --batch 2 --eval_every 0 --sample 0 --threads 1 '
    local ref = reference(args)
    for _, overlap in ipairs({ 1, 0 }) do
      local dir = tmpdir()
      local out, code = mpirun(2, args .. '--sp 2 --overlap ' .. overlap .. ' --out ' .. dir)
      assert.are.equal(0, code, out)
      follows(uly.log.read_csv(dir .. '/log.csv'), ref, 4, 'overlap ' .. overlap)
    end
  end)

  it('--zero 1 (the AdamW state sharded over the ranks) follows the single-process losses and resumes, overlapped or not', function()
    if not has_mpi then pending('no mpirun or a library without MPI') return end
    local args = TINY .. '--model llama --heads 4 --kv_heads 2 --steps 4 --accum 2 --batch 2 --eval_every 0 --sample 0 --threads 1 '
    local ref = reference(args)
    for _, overlap in ipairs({ 1, 0 }) do
      local dir = tmpdir()
      local common = args .. '--sp 2 --zero 1 --overlap ' .. overlap .. ' --out ' .. dir
      local out, code = mpirun(2, common .. ' --stop_after 2')
      assert.are.equal(0, code, out)
      assert.truthy(out:find('AdamW state sharded over 2 ranks', 1, true), out)
      out, code = mpirun(2, common .. ' --resume auto')
      assert.are.equal(0, code, out)
      assert.truthy(out:find('at step 2', 1, true), out)
      follows(uly.log.read_csv(dir .. '/log.csv'), ref, 4, 'zero, overlap ' .. overlap)
    end
  end)

  it('a bad grid fails on every rank with one clear message', function()
    if not has_mpi then pending('no mpirun or a library without MPI') return end
    local out, code = mpirun(2, TINY .. '--steps 2 --sp 3 --out ' .. tmpdir())
    assert.are_not.equal(0, code)
    assert.truthy(out:find('sp', 1, true) and out:find('2 ranks', 1, true), out)
  end)
end)
