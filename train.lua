-- train.lua — the main entry point: trains a GPT or Llama model on an HDF5 token dataset.
--   bin/ulysses train.lua [--flag value ...]          (luajit train.lua ... works too)
--   bin/ulysses train.lua --help                      lists every flag and its default
-- Flags can also come from a Lua config file (--config run.lua returning a table); flags on the
-- command line override it. One progress line per step (tokens/s, FLOP/s, MFU, memory, ETA),
-- validation loss at intervals, a CSV log and an SVG loss plot in --out, rotating HDF5
-- checkpoints, exact resume (--resume auto|PATH) and a sample from the model at the end.
-- Without --data it trains on data/kjv.h5 ($ULY_DATA/kjv.h5) if present, else on an embedded
-- text (Genesis 1).
-- Under mpirun (mpirun -np 4 luajit train.lua --sp 2) the ranks form data-parallel x sequence-
-- parallel groups: each rank reads only its slice of every window, attention goes through
-- nn.DistributedAttention, gradients are summed once over all ranks, rank 0 prints and saves.
local here = debug.getinfo(1, 'S').source:match('^@(.*)/[^/]*$') or '.'
package.path = here .. '/lua/?.lua;' .. here .. '/lua/?/init.lua;' .. here .. '/?.lua;' .. package.path
local uly = require 'ulysses'
local options = require 'ulysses.options'
-- stdout a line at a time: in a log file (`> log 2>&1`, mpirun's output) the header lines keep
-- their place beside stderr's warnings and errors (the progress lines flush themselves)
io.stdout:setvbuf('line')

local FLAGS = { -- name, default, help (the type is the default's; nil default = string)
  { 'config', '', 'Lua file returning a table of these flags' },
  { 'model', 'gpt', 'gpt | llama' },
  { 'preset', 'small', 'model preset (models/gpt.lua, models/llama.lua)' },
  { 'layers', 0, 'override the preset (0 = keep)' },
  { 'heads', 0, 'override the preset' },
  { 'kv_heads', 0, 'Llama K/V heads (0 = preset)' },
  { 'dim', 0, 'override the preset' },
  { 'hidden', 0, 'MLP width (0 = preset/default)' },
  { 'dropout', 0, 'dropout probability' },
  { 'checkpoint', 0, '1: recompute each block in backward instead of keeping its activations; 2: all but attention (its output kept)' },
  { 'attention', 'flash', 'flash (memory O(N), windows, documents) | reference (stores N^2 probabilities)' },
  { 'window', 0, 'sliding-window attention: each token sees this many before it (0 = all)' },
  { 'tile', 0, 'compute MLP and loss over slices of this many positions (0 = whole sequence)' },
  { 'documents', 0, '1: attention stays inside each packed document (DNA files with several records)' },
  { 'seq', 256, 'sequence length T (tokens per window)' },
  { 'batch', 16, 'windows per micro-batch' },
  { 'accum', 1, 'micro-batches per optimizer step (gradient accumulation)' },
  { 'steps', 300, 'optimizer steps' },
  { 'lr', 1e-3, 'peak learning rate' },
  { 'min_lr', 1e-4, 'final learning rate of the cosine schedule' },
  { 'warmup', 30, 'linear warmup steps' },
  { 'schedule', 'cosine', 'cosine | constant' },
  { 'wd', 0.1, 'AdamW weight decay (matrices only)' },
  { 'beta2', 0.95, 'AdamW beta2' },
  { 'clip', 1.0, 'clip the global gradient norm (0 = off)' },
  { 'data', '', "HDF5 dataset from datasets/prepare.lua, or a text / FASTA / GenBank file (.gz, .xz, .bz2 too) or a directory of them, prepared into OUT once; 'embedded' = Genesis 1 (default: data/kjv.h5, or $ULY_DATA/kjv.h5, if present, else embedded)" },
  { 'data_kind', 'auto', 'how a --data file that is not HDF5 is read: text | dna | auto (FASTA or GenBank is DNA, anything else text)' },
  { 'eval_every', 100, 'validation every N steps (0 = only at the end)' },
  { 'eval_batches', 8, 'validation batches per evaluation (0 = no evaluation)' },
  { 'out', 'runs/train', 'run directory: log.csv, loss.svg, ckpt/ (a run found there that this one does not resume moves to OUT/previous-N)' },
  { 'stop_after', 0, 'stop after this step, writing a checkpoint (0 = run to --steps); continue with --resume auto' },
  { 'ckpt_every', 0, 'checkpoint every N steps (0 = only at the end)' },
  { 'keep', 3, 'checkpoints kept' },
  { 'save_best', 1, '1: keep the model of the best validation loss so far in OUT/ckpt/best.h5 (weights only); 0: not' },
  { 'resume', '', "'auto' (latest in OUT/ckpt) or a checkpoint path" },
  { 'init', '', 'start from the weights of this safetensors file (uly.safetensors: every name and shape must match the model; --resume replaces them)' },
  { 'export', '', 'write the final weights to this safetensors file (PyTorch / Hugging Face tools read it)' },
  { 'seed', 1337, 'seed for initialisation, data order and dropout' },
  { 'threads', 0, 'threads for kernels and BLAS (0 = all cores; under mpirun: cores / ranks)' },
  { 'device', 'cpu', 'cpu | cuda (ULY_CUDA_SIMULATE=1 runs the cuda code path in host memory)' },
  { 'precision', 'auto', 'f32 | bf16 (matmul operands rounded to bf16, f32 accumulation, master weights and optimizer; on a CPU with AMX-BF16 on its tiles); auto: bf16 on cuda, f32 on cpu' },
  { 'activations', 'f32', 'f32 | bf16 (activations kept in bf16 between ops, each op computing in f32: half the activation memory; weights, gradients and optimizer stay f32)' },
  { 'sp', 0, 'ranks per sequence-parallel group under mpirun (0 = all ranks; world / sp groups do data parallelism)' },
  { 'overlap', 1, '1: each layer\'s gradients start their all-reduce during backward (dist.grad_sync); 0: all after backward' },
  { 'zero', 0, '1: shard the AdamW state over the ranks (dist.ZeroAdamW, ZeRO stage 2: gradients reduce-scattered, with --overlap 1 during backward, and freed; parameters all-gathered)' },
  { 'peak_gflops', 0, 'peak for MFU (0: cpu the f32 FMA peak of the threads, or with bf16 on AMX tiles their bf16 peak, measured at start; cuda the GPU\'s dense bf16 peak, by name or estimated)' },
  { 'log_every', 0, 'seconds between progress lines (0 = every step)' },
  { 'sample', 200, 'tokens to generate at the end (0 = none; needs --seq 2 or more; past the context the model goes on from its last half)' },
  { 'prompt', '', 'text prompt for the sample (default: the start of the validation split)' },
  { 'temperature', 0.8, 'sampling temperature (0 = greedy)' },
  { 'top_k', 40, 'sample among the k most likely tokens (0 = all)' },
}

-- --help: every flag, on stdout; a mistake: what was wrong, on stderr (once under mpirun), exit 2
local function usage(msg)
  if msg then
    -- once the ranks are a grid, a mistake one rank finds must end them all (the others would wait)
    if uly.dist.initialized() then uly.dist.abort('train.lua: ' .. msg) end
    if (tonumber(os.getenv('OMPI_COMM_WORLD_RANK') or '0') or 0) == 0 then
      io.stderr:write('train.lua: ', msg, '\n(bin/ulysses train.lua --help lists every flag)\n')
    end
    os.exit(2, true)   -- the state closed: what was made so far (tensors) is freed
  end
  local lines = { 'usage: bin/ulysses train.lua [--flag value ...]', '' }
  for _, f in ipairs(FLAGS) do
    lines[#lines + 1] = string.format('  --%-13s %-12s %s', f[1], tostring(f[2]), f[3])
  end
  io.stdout:write(table.concat(lines, '\n'), '\n')
  os.exit(0)
end

-- the flag names, for "did you mean" on a misspelled one
local FLAG_NAMES = {}
for i, f in ipairs(FLAGS) do FLAG_NAMES[i] = f[1] end
local function did_you_mean(key, prefix)
  local guess = options.nearest(key, FLAG_NAMES)
  return guess and string.format(" (did you mean '%s%s'?)", prefix, guess) or ''
end

local realpath = require('ulysses.paths').realpath   -- nil where the path does not exist

-- an error's text without the file:line prefixes Lua put on it (the user's flag is the place)
local function clean(err) return (tostring(err):gsub('[^%s:]+%.lua:%d+: ', '')) end

-- the values every flag may take, checked before anything runs (a mistake found after an hour of
-- training, or reported under another flag's name, costs more than one found now)
local function one_of(key, v, allowed)
  for _, a in ipairs(allowed) do if v == a then return end end
  usage(string.format("--%s must be %s, got '%s'", key, table.concat(allowed, ' | '), tostring(v)))
end

-- the model's config from the flags (vocab from the data; sp under mpirun)
local function model_args(cfg, vocab, sp)
  local mc = { preset = cfg.preset, vocab = vocab, seq = cfg.seq, dropout = cfg.dropout, sp = sp,
               checkpoint = ({ false, true, 'except_attention' })[cfg.checkpoint + 1], attention = cfg.attention,
               window = cfg.window > 0 and cfg.window or nil, tile = cfg.tile > 0 and cfg.tile or nil }
  for _, k in ipairs({ 'layers', 'heads', 'kv_heads', 'dim', 'hidden' }) do
    if cfg[k] > 0 then mc[k] = cfg[k] end
  end
  if cfg.model == 'gpt' then mc.kv_heads = nil end
  return mc
end

local function check_flags(cfg)
  for _, f in ipairs(FLAGS) do   -- inf or nan: training forever, or failing after it
    local v = cfg[f[1]]
    if type(v) == 'number' and (v ~= v or v == math.huge or v == -math.huge) then
      usage(string.format('--%s must be a finite number, got %s', f[1], tostring(v)))
    end
  end
  local function int(key, lo)
    local v = cfg[key]
    if v ~= math.floor(v) or v < lo then
      usage(string.format('--%s must be an integer >= %d, got %s', key, lo, tostring(v)))
    end
    if v > 2 ^ 53 then usage(string.format('--%s must be an integer <= 2^53, got %s', key, tostring(v))) end
  end
  local function num(key, lo, hi, open_lo)
    local v = cfg[key]
    if v < lo or (open_lo and v == lo) or (hi and v >= hi) then
      usage(string.format('--%s must be %s %g%s, got %s', key, open_lo and '>' or '>=', lo,
                          hi and string.format(' and < %g', hi) or '', tostring(v)))
    end
  end
  for _, k in ipairs({ 'seq', 'batch', 'accum', 'steps', 'keep' }) do int(k, 1) end
  for _, k in ipairs({ 'layers', 'heads', 'kv_heads', 'dim', 'hidden', 'window', 'tile', 'warmup', 'eval_every',
                       'eval_batches', 'stop_after', 'ckpt_every', 'threads', 'sp', 'sample', 'top_k' }) do
    int(k, 0)
  end
  for _, k in ipairs({ 'documents', 'overlap', 'zero', 'save_best' }) do one_of(k, cfg[k], { 0, 1 }) end
  one_of('checkpoint', cfg.checkpoint, { 0, 1, 2 })
  num('lr', 0, nil, true)
  num('dropout', 0, 1)
  num('beta2', 0, 1, true)
  for _, k in ipairs({ 'min_lr', 'wd', 'clip', 'temperature', 'peak_gflops', 'log_every' }) do num(k, 0) end
  one_of('model', cfg.model, { 'gpt', 'llama' })
  one_of('schedule', cfg.schedule, { 'cosine', 'constant' })
  if cfg.schedule == 'cosine' and cfg.min_lr > cfg.lr then
    usage(string.format('--min_lr %g is above --lr %g: the cosine schedule decays from --lr to --min_lr', cfg.min_lr, cfg.lr))
  end
  if cfg.sample > 0 and cfg.seq < 2 then   -- a prompt of one token and one to generate
    usage(string.format('--seq %d leaves no room to sample (a prompt token and a generated one need --seq 2): raise '
                        .. '--seq, or --sample 0', cfg.seq))
  end
  one_of('attention', cfg.attention, { 'flash', 'reference' })
  if cfg.checkpoint == 2 and cfg.attention ~= 'flash' then
    usage("--checkpoint 2 keeps flash attention's outputs: it needs --attention flash (or use --checkpoint 1)")
  end
  one_of('precision', cfg.precision, { 'auto', 'f32', 'bf16' })
  one_of('activations', cfg.activations, { 'f32', 'bf16' })
  if cfg.device == 'gpu' or cfg.device:match('^cuda:') then
    usage(string.format("--device %s: say 'cuda' (each rank takes the GPU of its local rank)", cfg.device))
  end
  one_of('device', cfg.device, { 'cpu', 'cuda' })
  one_of('data_kind', cfg.data_kind, { 'auto', 'text', 'dna' })
  if cfg.resume ~= '' and cfg.resume ~= 'auto' then
    local f = io.open(cfg.resume, 'rb')
    if not f then usage(string.format("--resume %s: no such checkpoint (give a file under OUT/ckpt, or 'auto')", cfg.resume)) end
    f:close()
  end
  if cfg.init ~= '' then
    local f = io.open(cfg.init, 'rb')
    if not f then usage(string.format('--init %s: no such file (give a .safetensors file of weights)', cfg.init)) end
    f:close()
  end
  if cfg.export ~= '' then   -- found now, not after training
    local dir = cfg.export:match('^(.*)/[^/]*$') or '.'
    if cfg.export:sub(-1) == '/' or realpath(cfg.export .. '/') then
      usage(string.format('--export %s is a directory: give the file to write (e.g. %s/model.safetensors)', cfg.export,
                          (cfg.export:gsub('/$', ''))))
    end
    local in_out = dir:gsub('/+$', '') == cfg.out:gsub('/+$', '')   -- the run's own directory: made before training
    if not in_out and not realpath((dir == '' and '/' or dir) .. '/') then
      usage(string.format('--export %s: no directory %s to write it in (make it first)', cfg.export, dir))
    end
  end
  if cfg.out == '' then usage('--out must name a directory for the run (log.csv, loss.svg, ckpt/)') end
  if realpath(cfg.out) and not realpath(cfg.out .. '/') then
    usage(string.format('--out %s is a file: give a directory for the run (log.csv, loss.svg, ckpt/)', cfg.out))
  end
end

-- flags -> cfg (defaults < config file < command line), values typed like the defaults
-- --resume: the flags the run was started with (its checkpoints record them) where this command
-- line and config file do not give them, so `--out OUT --resume auto` continues a run as it was;
-- flags of this invocation alone (where to write, threads, stopping early, the grid) are not taken
local NOT_ADOPTED = { resume = true, out = true, config = true, init = true, stop_after = true, threads = true,
                      log_every = true, peak_gflops = true, sp = true, zero = true, overlap = true }
local function adopt_run_flags(cfg, explicit)
  if cfg.resume == '' then return end
  local path = cfg.resume == 'auto' and uly.checkpoint.latest(cfg.out .. '/ckpt') or cfg.resume
  if not path or not uly.h5.available then return end
  local ok, f = pcall(uly.h5.open, path, 'r')
  if not ok then return end   -- (not a checkpoint: said where it is loaded)
  local ok2, extra = pcall(uly.checkpoint.deserialize, f:attr('', 'extra') or 'nil', 'extra')
  f:close()
  local saved = ok2 and type(extra) == 'table' and type(extra.flags) == 'table' and extra.flags
  if not saved then return end
  local taken = {}
  for _, fl in ipairs(FLAGS) do
    local k, v = fl[1], saved[fl[1]]
    if v ~= nil and type(v) == type(fl[2]) and not explicit[k] and not NOT_ADOPTED[k] and v ~= cfg[k] then
      cfg[k] = v
      taken[#taken + 1] = string.format('--%s %s', k, tostring(v))
    end
  end
  if #taken > 0 and (tonumber(os.getenv('OMPI_COMM_WORLD_RANK') or '0') or 0) == 0 then
    print(string.format('resume: the run\'s own flags from %s: %s (flags given here win)', path, table.concat(taken, ' ')))
  end
end

local function parse_flags(argv)
  local cfg, kinds, given, from_file = {}, {}, {}, nil
  for _, f in ipairs(FLAGS) do cfg[f[1]], kinds[f[1]] = f[2], type(f[2]) end
  local i = 1
  while i <= #argv do
    local a = argv[i]
    if a == '--help' or a == '-h' then usage() end
    local key, inline = a:match('^%-%-([%w_]+)=(.*)$')
    key = key or a:match('^%-%-([%w_]+)$')
    if not key then usage('unexpected argument ' .. a) end
    if kinds[key] == nil then usage('unknown flag --' .. key .. did_you_mean(key, '--')) end
    local v = inline
    if not v then
      i = i + 1
      v = argv[i]
      if v == nil then usage('--' .. key .. ' needs a value') end
    end
    if kinds[key] == 'number' then
      local n = tonumber(v)
      if not n then usage(string.format('--%s expects a number, got %q', key, v)) end
      v = n
    end
    given[key] = v
    i = i + 1
  end
  if given.config and given.config ~= '' then
    -- the file sees pure functions only (copies: it cannot change train.lua's), and os.getenv
    local env = { tonumber = tonumber, tostring = tostring, type = type, pairs = pairs, ipairs = ipairs,
                  select = select, unpack = unpack, error = error, assert = assert, os = { getenv = os.getenv } }
    for _, lib in ipairs({ 'math', 'string', 'table' }) do
      env[lib] = {}
      for k, f in pairs(_G[lib]) do env[lib][k] = f end
    end
    local chunk, err = loadfile(given.config, 't', env)
    if not chunk then usage('cannot read config file: ' .. err) end
    local ok, t = pcall(chunk)
    if not ok then usage('--config ' .. given.config .. ': ' .. tostring(t)) end
    if type(t) ~= 'table' then
      usage(string.format('config file %s must return a table of flags, got %s', given.config, type(t)))
    end
    from_file = t
    for k, v in pairs(t) do
      if kinds[k] == nil then
        usage(string.format('config file %s: unknown key %s%s', given.config, tostring(k),
                            type(k) == 'string' and did_you_mean(k, '') or ''))
      end
      if type(v) ~= kinds[k] then usage(string.format('config file %s: %s must be a %s', given.config, k, kinds[k])) end
      cfg[k] = v
    end
  end
  for k, v in pairs(given) do cfg[k] = v end
  local explicit = {}
  for k in pairs(given) do explicit[k] = true end
  for k in pairs(from_file or {}) do explicit[k] = true end
  adopt_run_flags(cfg, explicit)
  check_flags(cfg)
  cfg.parsed = {}   -- the flags as given (defaults included), for the checkpoints: before main fills in sp, precision
  for _, f in ipairs(FLAGS) do cfg.parsed[f[1]] = cfg[f[1]] end
  -- the model's own checks (its preset, heads dividing dim, ...) now, not after the data is prepared
  local ok, err = pcall(require('models.' .. cfg.model).count_parameters, model_args(cfg, 256))
  if not ok then usage(clean(err)) end
  return cfg
end

local EMBEDDED_TEXT = [[
In the beginning God created the heaven and the earth. And the earth was without form, and void; and darkness was upon the face of the deep. And the Spirit of God moved upon the face of the waters.
And God said, Let there be light: and there was light. And God saw the light, that it was good: and God divided the light from the darkness. And God called the light Day, and the darkness he called Night. And the evening and the morning were the first day.
And God said, Let there be a firmament in the midst of the waters, and let it divide the waters from the waters. And God made the firmament, and divided the waters which were under the firmament from the waters which were above the firmament: and it was so. And God called the firmament Heaven. And the evening and the morning were the second day.
And God said, Let the waters under the heaven be gathered together unto one place, and let the dry land appear: and it was so. And God called the dry land Earth; and the gathering together of the waters called he Seas: and God saw that it was good.
And God said, Let the earth bring forth grass, the herb yielding seed, and the fruit tree yielding fruit after his kind, whose seed is in itself, upon the earth: and it was so. And the earth brought forth grass, and herb yielding seed after his kind, and the tree yielding fruit, whose seed was in itself, after his kind: and God saw that it was good. And the evening and the morning were the third day.
And God said, Let there be lights in the firmament of the heaven to divide the day from the night; and let them be for signs, and for seasons, and for days, and years: And let them be for lights in the firmament of the heaven to give light upon the earth: and it was so.
And God made two great lights; the greater light to rule the day, and the lesser light to rule the night: he made the stars also. And God set them in the firmament of the heaven to give light upon the earth, And to rule over the day and over the night, and to divide the light from the darkness: and God saw that it was good. And the evening and the morning were the fourth day.
And God said, Let the waters bring forth abundantly the moving creature that hath life, and fowl that may fly above the earth in the open firmament of heaven. And God created great whales, and every living creature that moveth, which the waters brought forth abundantly, after their kind, and every winged fowl after his kind: and God saw that it was good.
And God blessed them, saying, Be fruitful, and multiply, and fill the waters in the seas, and let fowl multiply in the earth. And the evening and the morning were the fifth day.
And God said, Let the earth bring forth the living creature after his kind, cattle, and creeping thing, and beast of the earth after his kind: and it was so. And God made the beast of the earth after his kind, and cattle after their kind, and every thing that creepeth upon the earth after his kind: and God saw that it was good.
And God said, Let us make man in our image, after our likeness: and let them have dominion over the fish of the sea, and over the fowl of the air, and over the cattle, and over all the earth, and over every creeping thing that creepeth upon the earth. So God created man in his own image, in the image of God created he him; male and female created he them.
And God blessed them, and God said unto them, Be fruitful, and multiply, and replenish the earth, and subdue it: and have dominion over the fish of the sea, and over the fowl of the air, and over every living thing that moveth upon the earth.
And God said, Behold, I have given you every herb bearing seed, which is upon the face of all the earth, and every tree, in the which is the fruit of a tree yielding seed; to you it shall be for meat. And to every beast of the earth, and to every fowl of the air, and to every thing that creepeth upon the earth, wherein there is life, I have given every green herb for meat: and it was so.
And God saw every thing that he had made, and, behold, it was very good. And the evening and the morning were the sixth day.
]]

local function file_exists(path)
  local f = io.open(path, 'rb')
  if f then f:close() return true end
  return false
end

-- datasets/prepare.lua, loaded once when first needed
local prepare_lua
local function prepare_module()
  prepare_lua = prepare_lua or dofile(here .. '/datasets/prepare.lua')
  return prepare_lua
end

-- --data FILE that is not HDF5 (text, FASTA, GenBank; compressed or not), or a directory of such
-- files (in name order): prepared into OUT/<name>.h5 by datasets/prepare.lua, once: a later run
-- reuses it while the files' paths, sizes and modification times are the ones recorded in it (and
-- --data_kind does not ask for another kind)
local function prepared(cfg, quiet, inputs)
  local stamps = {}
  for _, path in ipairs(inputs) do
    local source = realpath(path)
    local size, mtime = uly.file_stamp(source)
    stamps[#stamps + 1] = string.format('%s|%d|%.0f', source, size, mtime)
  end
  local name = (cfg.data:gsub('/+$', ''):match('([^/]*)$'):gsub('%.[gG][zZ]$', ''):gsub('%.xz$', ''):gsub('%.bz2$', '')
                :gsub('%.dz$', ''):gsub('%.[^.]*$', ''))
  if name == '' then name = 'data' end
  local out = cfg.out .. '/' .. name .. '.h5'
  local valid = cfg.eval_batches > 0 and 0.05 or 0   -- no validation asked for: every token for training
  local stamp = table.concat(stamps, ';') .. string.format('|%g', valid)
  if file_exists(out) then   -- ours to reuse or replace; anything else is left alone
    local ok, f = pcall(uly.h5.open, out, 'r')
    local recorded = ok and f:attr('', 'source_stamp')
    local kind = ok and f:attr('', 'kind')
    if ok then f:close() end
    if type(recorded) ~= 'string' then
      usage(string.format('--data %s would be prepared into %s, which holds something else (not a file train.lua '
                          .. 'prepared from a --data file): move it, or give another --out', cfg.data, out))
    end
    if recorded == stamp and (cfg.data_kind == 'auto' or cfg.data_kind == kind) then
      if not quiet then print(string.format('data: %s, prepared from %s (%s) by an earlier run', out, cfg.data, kind)) end
      return out
    end
  end
  if quiet then return out end   -- (the other ranks: rank 0 prepared it)
  local prepare = prepare_module()
  local kind = cfg.data_kind ~= 'auto' and cfg.data_kind or nil
  if not kind then   -- each file's kind; a directory's files must agree
    local first
    for _, path in ipairs(inputs) do
      local ok, k = pcall(prepare.detect_kind, path)
      if not ok then usage('--data ' .. clean(k):gsub('^prepare: ', '')) end
      if kind and k ~= kind then
        usage(string.format('--data %s holds DNA and text files (%s is %s, %s is %s): --data_kind says how to read '
                            .. 'all of them, or give the kinds separate directories', cfg.data, first, kind, path, k))
      end
      kind, first = k, first or path
    end
  end
  local ok2, s = pcall(prepare.prepare, { kind = kind, inputs = inputs, out = out, name = name, quiet = true,
                                          valid = valid, attrs = { source_stamp = stamp } })
  if not ok2 then
    local msg = clean(s):gsub('^prepare: ', ''):gsub('; use a larger input or %-%-valid 0$',
                                                     ': a larger file, or --eval_batches 0 (no validation split)')
    usage(string.format('--data %s (read as %s): %s%s', cfg.data, kind, msg,
                        kind == 'dna' and cfg.data_kind == 'auto' and '; --data_kind text reads it as text' or ''))
  end
  print(string.format('data: prepared %s%s into %s: %s, %d train / %d valid tokens%s, %.1f s', cfg.data,
                      #inputs > 1 and string.format(' (%d files)', #inputs) or '', out, kind, s.n_train, s.n_valid,
                      s.n_records and string.format(', %d records', s.n_records) or '', s.seconds))
  return out
end

-- the dataset to train on: --data, else data/kjv.h5, else the embedded text prepared into OUT
local function resolve_data(cfg, quiet)
  if cfg.data ~= '' and cfg.data ~= 'embedded' then
    if not file_exists(cfg.data) then
      local near = not cfg.data:find('/', 1, true) and (os.getenv('ULY_DATA') or (here .. '/data')) .. '/' .. cfg.data .. '.h5'
      usage(string.format('--data %s: no such file (an HDF5 dataset from datasets/prepare.sh, or a text, FASTA or '
                          .. 'GenBank file)%s', cfg.data,
                          near and file_exists(near) and string.format("; did you mean '%s'?", near) or ''))
    end
    local sniff = prepare_module().sniff
    local function what_is(path)
      local ok, what = pcall(sniff, path)
      if not ok then usage('--data ' .. (clean(what):gsub('^prepare: ', ''))) end
      return what
    end
    local what = what_is(cfg.data)
    if what == 'hdf5' then return cfg.data end
    local inputs = { cfg.data }
    if what == 'directory' then   -- its files, in name order (hidden ones and subdirectories left out)
      inputs = {}
      local dir = cfg.data:gsub('/+$', '')
      for _, n in ipairs(require('ulysses.paths').list_dir(dir) or {}) do
        if n:sub(1, 1) ~= '.' and not realpath(dir .. '/' .. n .. '/') then inputs[#inputs + 1] = dir .. '/' .. n end
      end
      table.sort(inputs)
      if #inputs == 0 then usage(string.format('--data %s is a directory without files to train on', cfg.data)) end
    end
    for _, path in ipairs(inputs) do
      local w = path == cfg.data and what or what_is(path)
      if w == 'hdf5' then
        usage(string.format('--data %s holds an HDF5 file, %s: give that file alone as --data, or a directory of '
                            .. 'text or DNA files', cfg.data, path))
      elseif w == 'safetensors' then
        usage(string.format('--data %s is a safetensors file of weights, not data (--init starts a run from weights)', path))
      elseif w == 'binary' and cfg.data_kind ~= 'text' then
        usage(string.format('--data %s holds NUL bytes: a binary file, not text or DNA (--data_kind text trains on its '
                            .. 'bytes anyway)', path))
      end
    end
    return prepared(cfg, quiet, inputs)
  end
  local data_dir = os.getenv('ULY_DATA') or (here .. '/data')   -- where datasets/prepare.sh puts it
  if cfg.data == '' and file_exists(data_dir .. '/kjv.h5') then return data_dir .. '/kjv.h5' end
  local path = cfg.out .. '/embedded.h5'
  if not file_exists(path) then
    local txt = cfg.out .. '/embedded.txt'
    local f = assert(io.open(txt, 'wb'))
    f:write(EMBEDDED_TEXT)
    f:close()
    prepare_module() { kind = 'text', inputs = { txt }, out = path, valid = 0.1, name = 'genesis-1', quiet = true }
  end
  if not quiet then
    print(string.format('data: %s (embedded Genesis 1; datasets/prepare.sh kjv gets the whole Bible)', path))
  end
  return path
end

-- The model config a --init or --resume file records (a checkpoint's, or train.lua --export's in
-- a safetensors file) against this run's model: another architecture is one error naming every
-- difference and the flags that match it; other differences (eps, window, ...) a note.
-- -> the saved config (nil where the file records none) and the file's format
local ARCH_KEYS = { 'model', 'layers', 'heads', 'kv_heads', 'dim', 'hidden', 'vocab', 'seq' }
local NOTE_KEYS = { 'eps', 'rope_theta', 'window', 'tied', 'bias', 'attention' }
local function saved_model(model, flag, path, say)
  local ok, saved, format = pcall(uly.pretrained.saved_config, path)
  if not ok then
    local msg = clean(saved):gsub('^pretrained%.load: ', '')
    if msg:find('has no ulysses_config', 1, true) or msg:find('has no model config', 1, true) then
      return nil, path:match('%.h5$') and 'checkpoint' or 'safetensors'   -- weights alone: names and shapes decide
    end
    usage(string.format('--%s %s', flag, msg))
  end
  local mine, diffs, flags = model.config, {}, {}
  for _, k in ipairs(ARCH_KEYS) do
    local theirs = saved[k]
    -- (Llama's context length holds no weights; the vocabulary comes from the data)
    if theirs ~= nil and mine[k] ~= theirs and not (k == 'seq' and mine.model ~= 'gpt') then
      diffs[#diffs + 1] = string.format('%s %s (this run: %s)', k, tostring(theirs), tostring(mine[k]))
      if k ~= 'vocab' then flags[#flags + 1] = string.format('--%s %s', k, tostring(theirs)) end
    end
  end
  if #diffs > 0 then
    local fix = {}
    if saved.preset and saved.preset ~= mine.preset then fix[#fix + 1] = '--preset ' .. saved.preset end
    if #flags > 0 then fix[#fix + 1] = table.concat(flags, ' ') end
    if saved.vocab and saved.vocab ~= mine.vocab then
      fix[#fix + 1] = string.format('data of its kind (--data; a vocabulary of %d is %s)', saved.vocab,
                                    saved.vocab == 256 and 'text' or saved.vocab == 6 and 'DNA' or 'another alphabet')
    end
    usage(string.format('--%s %s: %s of another model: %s; to match it: %s', flag, path,
                        flag == 'init' and 'its weights are' or 'the checkpoint is', table.concat(diffs, ', '),
                        table.concat(fix, ', or ')))
  end
  local notes = {}
  for _, k in ipairs(NOTE_KEYS) do
    if mine[k] ~= saved[k] then
      notes[#notes + 1] = string.format('%s %s (saved with %s)', k, tostring(mine[k]), saved[k] == nil and 'none' or tostring(saved[k]))
    end
  end
  if #notes > 0 then say('note: --' .. flag .. ' ' .. path .. ': ' .. table.concat(notes, ', ')) end
  return saved, format
end

local function build_model(cfg, vocab)
  local Model = require('models.' .. cfg.model)   -- gpt or llama (check_flags)
  local ok, model = pcall(Model, model_args(cfg, vocab, cfg.world > 1 and cfg.sp or nil))
  if not ok then usage(clean(model)) end
  return model
end

-- mkdir -p without a shell (--out may hold $, quotes or backticks)
local function mkdir_p(path)
  uly.checkpoint._mkdir_p(path)
  if not realpath(path .. '/') then usage(string.format('--out: cannot make the directory %s', path)) end
end

local function main()
  local cfg = parse_flags(arg)
  local launched = tonumber(os.getenv('OMPI_COMM_WORLD_SIZE') or '1')
  cfg.world = launched
  local grid
  if launched > 1 then
    if cfg.sp == 0 then cfg.sp = launched end
    local ok, g = pcall(uly.dist.init, { sp = cfg.sp })
    if not ok then usage(clean(g)) end
    grid = g
  else
    if cfg.sp > 1 then
      print(string.format('--sp %d: one process (not launched by mpirun), so no sequence parallelism; '
                          .. 'mpirun -np %d bin/ulysses train.lua ... runs %d ranks', cfg.sp, cfg.sp, cfg.sp))
    end
    cfg.sp = 1
  end
  local rank = grid and grid.rank or 0
  local main_rank = rank == 0
  local function say(...) if main_rank then print(...) end end
  local cores = uly.get_num_threads()   -- (the default: the cores OpenMP sees)
  if cfg.threads * launched > cores then
    say(string.format('note: --threads %d%s is more than the %d cores here: threads then share cores, which is slower',
                      cfg.threads, launched > 1 and string.format(' x %d ranks', launched) or '', cores))
  end
  if cfg.threads > 0 then uly.set_num_threads(cfg.threads)
  elseif launched > 1 then uly.set_num_threads(math.max(1, math.floor(uly.get_num_threads() / launched))) end
  -- OUT holding another run (its checkpoints, or the log and plot of one stopped before its first
  -- checkpoint): unless this run continues it (--resume auto, or --resume with its newest
  -- checkpoint), that run moves aside whole to OUT/previous-N (rotation, the log and a later
  -- `--resume auto` would otherwise mix the two runs, or a fresh log replace its own)
  local latest = uly.checkpoint.latest(cfg.out .. '/ckpt')
  local held = latest or file_exists(cfg.out .. '/log.csv') or file_exists(cfg.out .. '/loss.svg')
  local continues = latest and (cfg.resume == 'auto' or realpath(cfg.resume) == realpath(latest))
  local dest
  if held and not continues then
    local n = 1
    while file_exists(cfg.out .. '/previous-' .. n) do n = n + 1 end
    dest = cfg.out .. '/previous-' .. n
    if cfg.resume ~= '' and cfg.resume ~= 'auto' then   -- a checkpoint in the moved ckpt/: from its new place
      local dir = cfg.resume:match('^(.*)/') or '.'
      local path = realpath(dir == '' and '/' or dir) .. '/' .. cfg.resume:match('[^/]*$')   -- the file itself may be a link
      local ckpt = realpath(cfg.out .. '/ckpt')
      if ckpt and path:sub(1, #ckpt + 1) == ckpt .. '/' then cfg.resume = dest .. '/ckpt/' .. path:sub(#ckpt + 2) end
    end
  end
  if grid then grid.world_group:barrier() end   -- every rank has looked before rank 0 moves anything
  if main_rank then
    mkdir_p(cfg.out)
    if dest then
      mkdir_p(dest)
      for _, name in ipairs({ 'ckpt', 'log.csv', 'loss.svg' }) do
        local ok, err, code = os.rename(cfg.out .. '/' .. name, dest .. '/' .. name)
        if not ok and code ~= 2 then   -- (2: ENOENT, a run without a plot)
          usage(string.format('--out %s holds another run, which could not be moved aside: %s', cfg.out, err))
        end
      end
      say(string.format('%s held another run (%s): moved to %s; --resume auto continues a run', cfg.out,
                        latest and ('its latest checkpoint ' .. latest:match('[^/]+$')) or 'a log, no checkpoint', dest))
    end
  end
  if grid then grid.world_group:barrier() end
  uly.manual_seed(cfg.seed)

  -- rank 0 resolves the data first (and prepares the embedded text if needed), then the others
  local data_path = main_rank and resolve_data(cfg) or nil
  if grid then grid.world_group:barrier() end
  data_path = data_path or resolve_data(cfg, true)
  local shard = grid and { rank = grid.sp_rank, size = grid.sp_size } or nil
  local dp_rank = grid and grid.dp_rank or 0
  local documents = cfg.documents ~= 0 or nil
  local function open_split(opts, hint)
    local ok, d = pcall(uly.data.open, data_path, opts)
    if not ok then usage(clean(d) .. (hint or '')) end
    return d
  end
  local train_data = open_split({ seq = cfg.seq, batch = cfg.batch, split = 'train',
                                  seed = cfg.seed + 7919 * dp_rank, shard = shard, documents = documents })
  -- validation only when asked for (--eval_batches 0 trains on a file without a usable split)
  local valid_data = cfg.eval_batches > 0 and open_split({ seq = cfg.seq, batch = cfg.batch, split = 'valid',
                                                           random = false, shard = shard, documents = documents },
                                                         '; --eval_batches 0 trains without validation') or nil
  if cfg.sample > 0 and cfg.prompt ~= '' then   -- found now, not after training
    local ok, p = pcall(train_data.encode, train_data, cfg.prompt)
    if not ok then usage('--prompt: ' .. clean(p)) end
  end
  local model = build_model(cfg, train_data.vocab_size)
  if cfg.init ~= '' then
    local _, format = saved_model(model, 'init', cfg.init, say)
    -- (a checkpoint's weights only; the generator stays as seeded)
    local ok, err = pcall(uly.pretrained.load_weights, model, cfg.init, format)
    if not ok then usage('--init ' .. (clean(err):gsub('^safetensors%.load_into: ', ''):gsub('^checkpoint%.load: ', ''))) end
    say(string.format('weights from %s', cfg.init))
  end
  if cfg.device ~= 'cpu' then
    local ok, err = pcall(model.to, model, cfg.device)
    if not ok then usage('--device ' .. cfg.device .. ': ' .. clean(err)) end
  end
  local device = cfg.device
  if cfg.precision == 'auto' then cfg.precision = device == 'cuda' and 'bf16' or 'f32' end
  uly.matmul_precision(cfg.precision)
  uly.activation_dtype(cfg.activations)
  local ctx = { pos = train_data.offset or 0, seq_total = cfg.seq }
  local adamw = { lr = cfg.lr, betas = { 0.9, cfg.beta2 }, weight_decay = cfg.wd }
  local zero = grid and cfg.zero ~= 0
  if cfg.zero ~= 0 and not grid then say('--zero 1: a single process has nothing to shard over; plain AdamW') end
  local opt = zero and uly.dist.ZeroAdamW(model:parameters(), grid.world_group, adamw)
    or uly.optim.AdamW(model:parameters(), adamw)
  local warmup = math.min(cfg.warmup, cfg.steps)
  local schedule = cfg.schedule == 'constant' and uly.optim.schedule.constant { lr = cfg.lr, warmup = warmup }
    or uly.optim.schedule.cosine { lr = cfg.lr, warmup = warmup, steps = cfg.steps, min_lr = cfg.min_lr }
  local common = require 'models.common'

  -- resume: model, optimizer, RNG, data position and step from a checkpoint
  local ckpt_dir = cfg.out .. '/ckpt'
  local start_step = 0
  if cfg.resume ~= '' then
    local path = cfg.resume ~= 'auto' and cfg.resume or uly.checkpoint.latest(ckpt_dir)
    if path then
      if select(2, saved_model(model, 'resume', path, say)) == 'safetensors' then
        usage(string.format('--resume %s: a safetensors file holds weights only (--init starts a run from them); '
                            .. '--resume takes a checkpoint, OUT/ckpt/step_N.h5, or auto', path))
      end
      local ok, info = pcall(uly.checkpoint.load, path, { model = model, optim = opt })
      if not ok then usage('--resume ' .. path .. ': ' .. clean(info)) end
      start_step = info.step
      if type(start_step) ~= 'number' then
        usage('--resume ' .. path .. ': the checkpoint has no step (checkpoint.save without step = n); train.lua '
              .. 'resumes from its own checkpoints (OUT/ckpt)')
      end
      if info.data then train_data:set_state(info.data) end
      local offsets = info.extra and info.extra.rng_offsets
      if offsets and offsets[rank + 1] then uly.set_rng_state { seed = info.rng.seed, offset = offsets[rank + 1] } end
      say(string.format('resumed from %s at step %d', path, start_step))
    else
      say('resume: no checkpoint in ' .. ckpt_dir .. ', starting fresh')
    end
  end

  local tokens_per_step = cfg.batch * cfg.seq * cfg.accum * (grid and grid.dp_size or 1)
  local threads = uly.get_num_threads() * launched
  -- MFU's denominator: given, else the GPU's dense bf16 peak (published for its name, or estimated
  -- from its SMs and clock), else the CPU threads' peak measured now: the bf16 GEMM engine's peak
  -- (AMX tiles or AVX512-BF16) for bf16 matmuls where above the f32 FMA peak, else that; every rank alike
  local peak, peak_label
  if cfg.peak_gflops > 0 then
    peak, peak_label = cfg.peak_gflops * 1e9, 'given peak'
  elseif device == 'cuda' then
    local gpu_peak, label
    if uly.cuda.backend() == 'cuda' then gpu_peak, label = uly.cuda.peak_flops()
    else label = 'the device is the host-memory simulation' end
    if not gpu_peak then
      say('MFU: ' .. tostring(label) .. '; not reported')
    else
      peak, peak_label = gpu_peak * launched, label .. (launched > 1 and (' x ' .. launched .. ' ranks') or '')
    end
  else   -- the bf16 GEMM engine's peak for bf16 matmuls, where above the f32 FMA peak
    local f32_peak, bf16_peak = uly.cpu_peak_flops(), cfg.precision == 'bf16' and uly.cpu_bf16_peak_flops() or 0
    if bf16_peak > f32_peak then
      local unit = uly.cpu_bf16_gemm() == 'amx' and 'AMX' or 'AVX512-BF16'
      peak, peak_label = bf16_peak * launched, string.format('%s bf16 peak of %d threads, measured', unit, threads)
    else
      peak, peak_label = f32_peak * launched, string.format('FMA peak of %d threads, measured', threads)
    end
  end
  local flops_per_token = model:flops_per_token(cfg.seq)
  local mc = model.config
  local recompute = mc.checkpoint == 'except_attention' and ', blocks recomputed in backward except attention'
    or mc.checkpoint and ', blocks recomputed in backward' or ''
  say(string.format('model: %s %s, %d layers, %d heads%s, dim %d, %.2f M parameters, %.1f MFLOP/token (6N + 12LCT)%s',
                    mc.model, mc.preset, mc.layers, mc.heads, mc.kv_heads and (', ' .. mc.kv_heads .. ' kv') or '',
                    mc.dim, model:num_parameters() / 1e6, flops_per_token / 1e6, recompute))
  say(string.format('data: %s, %s, vocab %d, %d train / %s, unigram entropy %.3f bits/token',
                    data_path, train_data.kind, train_data.vocab_size, train_data.n_tokens,
                    valid_data and (valid_data.n_tokens .. ' valid tokens') or 'no validation (--eval_batches 0)',
                    train_data.entropy_bits or 0 / 0))
  say(string.format('run: %d steps x %d tokens (batch %d x seq %d x accum %d%s), lr %.2g %s, %d threads, BLAS %s',
                    cfg.steps, tokens_per_step, cfg.batch, cfg.seq, cfg.accum,
                    grid and string.format(' x dp %d; %d ranks = dp %d x sp %d', grid.dp_size, grid.world, grid.dp_size,
                                           grid.sp_size) or '',
                    cfg.lr, cfg.schedule, threads, uly.blas_corename()))
  if cfg.warmup >= cfg.steps and cfg.warmup > 0 then
    say(string.format('note: --warmup %d is not below --steps %d: the learning rate rises for the whole run and '
                      .. 'reaches --lr only at its end (a smaller --warmup gives the %s schedule room)', cfg.warmup,
                      cfg.steps, cfg.schedule))
  end
  say(string.format('device: %s%s, matmul precision %s%s, activations %s', device,
                    device == 'cuda' and (' (backend ' .. tostring(uly.cuda.backend()) .. ')') or '', cfg.precision,
                    (device == 'cpu' and cfg.precision == 'bf16') and (' (bf16 GEMM engine: ' .. uly.cpu_bf16_gemm() .. ')') or '',
                    cfg.activations))
  local head_dim = mc.dim / mc.heads
  if device == 'cuda' and cfg.precision == 'bf16' and (head_dim == 64 or head_dim == 128) and uly.cuda.backend() == 'cuda' then
    say(string.format('attention kernels at D %d: %s', head_dim, uly.cuda.describe_attention_choice(head_dim)))
  end
  if zero then
    local info = opt:shard_info()
    say(string.format('optimizer: AdamW state sharded over %d ranks (ZeRO-2): %s of state per rank instead of %s',
                      grid.world, uly.log.format_bytes(info.state_bytes), uly.log.format_bytes(8 * info.total)))
  end

  local log_path = cfg.out .. '/log.csv'
  local writer = main_rank and uly.log.Writer(log_path, {
    fields = { 'step', 'loss', 'val_loss', 'lr', 'grad_norm', 'tokens_per_s', 'seconds' }, append = start_step > 0 })
  local progress = uly.log.Progress { total_steps = cfg.steps, tokens_per_step = tokens_per_step,
                                      flops_per_token = flops_per_token, peak_flops = peak, peak_label = peak_label,
                                      every = cfg.log_every, rank = rank }

  local function evaluate()
    model:eval()
    local total, n = 0, 0
    uly.no_grad(function()
      local vctx = { pos = valid_data.offset or 0, seq_total = cfg.seq }
      for x, y, doc in valid_data:batches() do
        vctx.doc = doc
        total = total + common.global_loss(model, model:loss(x:to(device), y:to(device), vctx)) * x:size(1)
        n = n + x:size(1)
        if n >= cfg.eval_batches * cfg.batch then break end
      end
    end)
    model:train()
    return total / n
  end

  local function save_checkpoint(step)
    local offsets = { tonumber(uly.rng_state().offset) }
    if grid then
      local t = uly.tensor(offsets, { dtype = 'f64' })
      offsets = grid.world_group:all_gather(t):totable()
    end
    local optim_state = zero and opt:consolidated() or opt   -- the shards gathered, on every rank
    if not main_rank then return end
    return uly.checkpoint.save_rotating(ckpt_dir, step, {
      model = model, optim = optim_state, step = step, config = common.plain_config(model.config),
      data = train_data:state(), extra = { data_path = data_path, rng_offsets = offsets, flags = cfg.parsed } }, cfg.keep)
  end

  -- the best validation loss's weights, OUT/ckpt/best.h5 (atomic, like every checkpoint); a run
  -- that continues starts from the loss the file records
  local best_path, best_saved = ckpt_dir .. '/best.h5', nil
  if main_rank and cfg.save_best ~= 0 and start_step > 0 and file_exists(best_path) then
    local ok, f = pcall(uly.h5.open, best_path, 'r')
    if ok then
      local ok2, extra = pcall(uly.checkpoint.deserialize, f:attr('', 'extra') or 'nil', 'extra')
      f:close()
      best_saved = ok2 and type(extra) == 'table' and tonumber(extra.val_loss) or nil
    end
  end
  local function save_best(step, loss)
    if not main_rank or cfg.save_best == 0 or (best_saved and loss >= best_saved) then return end
    uly.checkpoint._mkdir_p(ckpt_dir)
    uly.checkpoint.save(best_path, { model = model, step = step, config = common.plain_config(model.config),
                                     extra = { data_path = data_path, val_loss = loss } })
    best_saved = loss
  end

  local function comm_totals()
    if not grid then return 0, 0 end
    local bytes, secs = 0, 0
    for _, s in pairs(uly.dist.stats()) do bytes, secs = bytes + s.sent, secs + s.seconds end
    return bytes, secs
  end

  local params = model:parameters()
  -- under mpirun the gradients are summed over the world; with --overlap 1 during the last
  -- micro-batch's backward, bucket by bucket as layers finish (NCCL on its own stream on GPUs);
  -- with --zero 1 reduce-scattered into each rank's shard of the optimizer
  local sync = grid and cfg.overlap ~= 0 and (zero and opt:grad_sync() or uly.dist.grad_sync(params, grid.world_group)) or nil
  local t_start = uly.clock()
  local val_loss
  local last_step = cfg.stop_after > 0 and math.min(cfg.stop_after, cfg.steps) or cfg.steps
  if start_step >= last_step then
    say(string.format('nothing to train: the run is at step %d already (--steps %d%s)', start_step, cfg.steps,
                      cfg.stop_after > 0 and string.format(', --stop_after %d', cfg.stop_after) or ''))
    return
  end
  for step = start_step + 1, last_step do
    local t0 = uly.clock()
    local bytes0, secs0 = comm_totals()
    opt.lr = schedule(step)
    opt:zero_grad()
    local loss_sum = 0
    for micro = 1, cfg.accum do
      local x, y, doc = train_data:next()
      ctx.doc = doc
      ctx.grad_sync = micro == cfg.accum and sync or nil
      local loss = model:loss(x:to(device), y:to(device), ctx)
      loss_sum = loss_sum + loss:item()
      if cfg.accum > 1 then loss = loss * (1 / cfg.accum) end
      loss:backward()
    end
    ctx.grad_sync = nil
    -- the gradients summed over the world: here, or (ZeroAdamW) reduce-scattered by the norm below
    if sync then sync:finish() elseif grid and not zero then uly.dist.all_reduce_grads(params, grid.world_group) end
    local loss = common.global_loss(model, loss_sum / cfg.accum)
    local norm
    if zero then norm = cfg.clip > 0 and opt:clip_grad_norm(cfg.clip) or opt:grad_norm()
    else norm = cfg.clip > 0 and uly.optim.clip_grad_norm(params, cfg.clip) or uly.optim.grad_norm(params) end
    if loss ~= loss or norm ~= norm or norm == math.huge then
      error(string.format('step %d: loss %s, gradient norm %s; stopping (lower --lr, or check the data)',
                          step, tostring(loss), tostring(norm)), 0)
    end
    opt:step()
    local dt = uly.clock() - t0
    local bytes1, secs1 = comm_totals()
    progress:step { step = step, loss = loss, lr = opt.lr, dt = dt, memory = uly.memory(device).allocated,
                    extra = grid and { comm_bytes = bytes1 - bytes0, comm_time = secs1 - secs0 } or nil }
    val_loss = nil
    if cfg.eval_batches > 0 and ((cfg.eval_every > 0 and step % cfg.eval_every == 0) or step == last_step) then
      val_loss = evaluate()
      progress:eval { step = step, loss = val_loss, bpt = val_loss / math.log(2) }
      save_best(step, val_loss)
    end
    if writer then
      writer:write { step = step, loss = loss, val_loss = val_loss, lr = opt.lr, grad_norm = norm,
                     tokens_per_s = tokens_per_step / dt, seconds = uly.clock() - t_start }
    end
    if (cfg.ckpt_every > 0 and step % cfg.ckpt_every == 0) or step == last_step then save_checkpoint(step) end
  end
  -- the allocator's high-water mark, the largest over the ranks
  local peak_bytes = uly.memory(device).peak
  if grid then
    local t = uly.tensor({ peak_bytes }, { dtype = 'f64' })
    grid.world_group:all_reduce_(t, 'max')
    peak_bytes = t:item()
  end
  if not main_rank then return end
  writer:close()

  local summary = progress:summary()
  print(string.format('peak memory per rank: %s held by tensors (the allocator\'s high-water mark%s)',
                      uly.log.format_bytes(peak_bytes), grid and ', largest over the ranks' or ''))
  if summary and train_data.entropy_bits then
    print(string.format('unigram entropy of the training data: %.3f bits/token; validation: %s bits/token',
                        train_data.entropy_bits, val_loss and string.format('%.3f', val_loss / math.log(2)) or 'n/a'))
  end
  uly.log.plot_csv(log_path, cfg.out .. '/loss.svg', {
    title = string.format('%s %s on %s', mc.model, mc.preset, data_path:match('([^/]+)$')),
    hlines = train_data.entropy_bits and { { y = train_data.entropy_bits * math.log(2), label = 'unigram entropy' } } or nil })
  print(string.format('log: %s  plot: %s  checkpoints: %s%s', log_path, cfg.out .. '/loss.svg', ckpt_dir,
                      best_saved and string.format(' (the best validation loss, %.4f: %s)', best_saved, best_path) or ''))
  if cfg.export ~= '' and main_rank then
    local mc_plain = common.plain_config(model.config)
    local ok, err = pcall(uly.safetensors.save, cfg.export, model, { metadata = {
      format = 'pt', ulysses_model = tostring(mc.model), ulysses_config = uly.checkpoint.serialize(mc_plain, 'config') } })
    if not ok then
      usage(string.format('--export %s (the final checkpoint in %s holds the weights: uly.checkpoint.export writes '
                          .. 'them as safetensors later)', clean(err), ckpt_dir))
    end
    print('weights: ' .. cfg.export)
  end

  if cfg.sample > 0 then
    local prompt
    if cfg.prompt ~= '' then prompt = train_data:encode(cfg.prompt)
    else   -- the start of the validation split (or of the training split, without one)
      local full = uly.data.open(data_path, { seq = cfg.seq, batch = 1, split = valid_data and 'valid' or 'train',
                                               random = false })
      local x = full:batches()()
      prompt = x:narrow(2, 1, math.min(16, cfg.seq - 1)):contiguous()
    end
    -- (past the context the model goes on from its last seq/2 tokens: generate's slide)
    local ids = model:generate(prompt, { max_new_tokens = cfg.sample, temperature = cfg.temperature, top_k = cfg.top_k,
                                         slide = true })
    -- prompt and continuation on lines of their own: no character can mark the seam (DNA decodes
    -- its record separator as '|', text can hold anything)
    print('sample (temperature ' .. cfg.temperature .. ', top-k ' .. cfg.top_k .. '), prompt then continuation:')
    print('--- prompt (' .. prompt:size(2) .. ' tokens)')
    print(train_data:decode(prompt))
    print('--- continuation (' .. #ids .. ' tokens)')
    print(train_data:decode(ids))
  end
end

uly.dist.run(main)
