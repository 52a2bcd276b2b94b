-- tools/generate.lua — text or DNA from a trained model: a run directory, checkpoint or
-- safetensors file (uly.pretrained.load), a prompt, and how to sample.
--
--   bin/ulysses tools/generate.lua SOURCE [--prompt TEXT | --prompt_file FILE] [--tokens 200]
--     [--temperature 0.8] [--top_k 40] [--samples 1] [--seed 1] [--raw 1]
--     [--device cpu|cuda] [--precision auto|f32|bf16] [--kind text|dna] [--data H5]
--
-- Without a prompt it starts from the first 16 tokens of the validation split of the data the
-- model was trained on, where that file is still found. Any number of tokens can be asked for:
-- when the context fills, the model goes on from its last half (generate's slide = true). Each
-- sample prints its prompt and continuation under a header (one sample: each token as it comes;
-- several: sampled side by side in one batch); --raw 1 prints only the continuations, each
-- followed by a newline. The same seed gives the same samples.
local uly = require 'ulysses'
local cli = require 'ulysses.cli'

local TOOL = 'tools/generate.lua'
local FLAGS = cli.flags({
  { 'prompt', '', 'the text (or DNA letters) to continue' },
  { 'prompt_file', '', 'read the prompt from this file (whitespace in DNA skipped; FASTA header lines dropped)' },
  { 'tokens', 200, 'tokens to generate per sample' },
  { 'temperature', 0.8, 'sampling temperature (0 = greedy)' },
  { 'top_k', 40, 'sample among the k most likely tokens (0 = all)' },
  { 'samples', 1, 'how many samples' },
  { 'seed', 1, 'seed of the sampling' },
  { 'raw', 0, '1: print only the continuations, each followed by a newline' },
}, uly.pretrained.LOAD_FLAGS)
local USAGE = 'bin/ulysses tools/generate.lua SOURCE [--flag value ...]\n'
  .. '  SOURCE: a train.lua run directory, a checkpoint (.h5) or a safetensors file'

local function fail(msg) cli.fail(TOOL, msg) end
local clean = cli.clean
local function integer(key, lo)
  return function(v)
    if v % 1 ~= 0 or v < lo then fail(string.format('--%s must be an integer >= %d, got %s', key, lo, tostring(v))) end
  end
end

local cfg, inputs = cli.parse(TOOL, arg, FLAGS, USAGE)
if #inputs ~= 1 then
  fail(#inputs == 0 and 'no model given: the argument is a run directory, checkpoint or safetensors file (--help)'
       or string.format('one model at a time, got %d arguments: %s', #inputs, table.concat(inputs, ' ')))
end
integer('tokens', 0)(cfg.tokens)
integer('top_k', 0)(cfg.top_k)
integer('samples', 1)(cfg.samples)
integer('seed', 0)(cfg.seed)
if not (cfg.temperature >= 0) or cfg.temperature == math.huge then
  fail('--temperature must be a finite number >= 0 (0 = greedy), got ' .. tostring(cfg.temperature))
end
if cfg.raw ~= 0 and cfg.raw ~= 1 then fail('--raw must be 0 or 1, got ' .. cfg.raw) end
if cfg.prompt ~= '' and cfg.prompt_file ~= '' then fail('--prompt or --prompt_file, not both') end

local model, info = uly.pretrained.load_for_tool(TOOL, inputs[1], cfg)
local codec = info.codec

-- the prompt: given, from a file, or the start of the training data's validation split
local prompt
if cfg.prompt_file ~= '' then
  local text = require('ulysses.paths').read_file(cfg.prompt_file)
  if not text then fail("--prompt_file: cannot read '" .. cfg.prompt_file .. "'") end
  if codec.kind == 'dna' then text = ('\n' .. text):gsub('\n>[^\n]*', '\n') end   -- FASTA header lines
  cfg.prompt = text
end
if cfg.prompt ~= '' then
  local ok_p, p = pcall(codec.encode, codec, cfg.prompt)
  if not ok_p then fail((cfg.prompt_file ~= '' and '--prompt_file ' or '--prompt: ') .. clean(p)) end
  prompt = p
elseif info.data_path then
  local ok_d, d = pcall(uly.data.open, info.data_path, { seq = math.min(16, model.config.seq), batch = 1, random = false,
                                                        split = 'valid' })
  if not ok_d then
    ok_d, d = pcall(uly.data.open, info.data_path, { seq = math.min(16, model.config.seq), batch = 1, random = false })
  end
  if not ok_d then fail('no --prompt, and the data file gives none: ' .. clean(d)) end
  prompt = d:batches()()
  d:close()
else
  fail('--prompt is needed: the data the model was trained on is not found to start from (or give --data FILE)')
end

local quiet = cfg.raw == 1
if not quiet then
  print(info.summary)
  print(string.format('sampling: %d tokens, temperature %g, top-k %d, seed %d', cfg.tokens, cfg.temperature, cfg.top_k,
                      cfg.seed))
  print('--- prompt (' .. prompt:size(2) .. ' tokens)')
  print(codec:decode(prompt))
end
uly.manual_seed(cfg.seed)
if cfg.samples == 1 and not quiet then print(string.format('--- sample 1 (%d tokens)', cfg.tokens)) end
-- one sample: each token written as it comes (a long generation shows as it goes); several: drawn
-- side by side in one batch (generate's samples), then written one after another
local function emit(tok)
  io.stdout:write(codec:decode({ tok }))
  io.stdout:flush()
end
local ok_g, res = pcall(model.generate, model, prompt, {
  max_new_tokens = cfg.tokens, temperature = cfg.temperature, top_k = cfg.top_k, slide = true,
  samples = cfg.samples > 1 and cfg.samples or nil,
  on_token = cfg.samples == 1 and emit or nil,
})
if not ok_g then io.stdout:write('\n') fail(clean(res)) end
if cfg.samples == 1 then
  io.stdout:write('\n')
else
  for i, ids in ipairs(res) do
    if not quiet then print(string.format('--- sample %d (%d tokens)', i, #ids)) end
    print(codec:decode(ids))
  end
end
