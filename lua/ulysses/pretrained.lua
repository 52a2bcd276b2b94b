-- lua/ulysses/pretrained.lua — a trained model back from disk, ready to generate or score
-- (`uly.pretrained`; tools/generate.lua and tools/score.lua are its command-line faces):
--
--   local model, info = uly.pretrained.load('runs/train')       -- the run's newest checkpoint
--   print(info.codec:decode(model:generate(info.codec:encode('And God said'), {max_new_tokens = 80})))
--
-- load(source, {device = 'cpu', kind = nil, data = nil}) -> model (in eval mode), info
--   source: a train.lua run directory (its newest checkpoint, DIR/ckpt/step_N.h5), a directory of
--     checkpoints, one checkpoint (uly.checkpoint), or a safetensors file with the model's config in
--     its metadata (train.lua --export, uly.checkpoint.export).
--   The model is rebuilt from the saved config (models/gpt.lua or models/llama.lua) on one process:
--   no sequence parallelism, no activation checkpointing; everything else (window, attention,
--   tile, eps, ...) as trained. Loading leaves the random generator as it was.
--   kind ('text' | 'dna'): the alphabet; else the training data file's (`data`, or the path the
--   checkpoint recorded if that file is still there), else read from the vocabulary: 256 tokens are
--   text bytes, 6 DNA (what datasets/prepare.lua makes).
--   info: {path (the file read), format ('checkpoint' | 'safetensors'), step (nil if not saved),
--     config (the model's), kind, codec (uly.data.codec(kind): encode / decode), data_path (the
--     training data file if found, else nil), kind_from ('option' | 'data' | 'vocabulary')}
local T = require 'ulysses.tensor'
local realpath = require('ulysses.paths').realpath

local raise = T.raise
local M = {}

local function U() return require 'ulysses' end

local HDF5_SIGNATURE = '\137HDF\r\n\26\n'
local MODELS = { gpt = true, llama = true }
local LOAD_KEYS = { 'device', 'kind', 'data' }

-- an error's text without the file:line prefixes Lua put on it
local function clean(err) return (tostring(err):gsub('^[^:]*%.lua:%d+: ', '')) end

local function fail(fmt, ...) raise('pretrained.load: ' .. string.format(fmt, ...)) end

local function first_bytes(path, n)
  local f = io.open(path, 'rb')
  if not f then return nil end
  local s = f:read(n)
  f:close()
  return s
end

-- the file behind source: a checkpoint or safetensors file as given, a directory's newest checkpoint
local function resolve(source)
  local ck = U().checkpoint
  local newest = ck.latest(source .. '/ckpt') or ck.latest(source)
  if newest then return newest end
  if realpath(source .. '/') then
    fail('%s is a directory without checkpoints (train.lua writes them to OUT/ckpt/step_N.h5; a run stopped '
         .. 'before its first has none)', source)
  end
  if not realpath(source) then fail("no such file or directory: '%s' (a run directory, a checkpoint .h5 or a .safetensors file)", source) end
  return source
end

-- {config, step, extra} of a ulysses checkpoint, read from its attributes
local function checkpoint_meta(path)
  local h5 = U().h5
  if not h5.available then fail('%s is an HDF5 checkpoint, and this library was built without HDF5', path) end
  local ok, f = pcall(h5.open, path, 'r')
  if not ok then fail('%s', clean(f)) end
  local ok2, res = pcall(function()
    local data_kind = f:attr('', 'kind')
    if f:attr('', 'format') == nil and (data_kind == 'text' or data_kind == 'dna') then
      fail('%s is a dataset (%s), not a model: give the run directory or checkpoint of a model trained on it', path, data_kind)
    end
    if f:attr('', 'format') ~= 'ulysses-checkpoint' then
      fail("%s is an HDF5 file but not a ulysses checkpoint (its format attribute is '%s')", path, tostring(f:attr('', 'format')))
    end
    local cfg_text = f:attr('', 'config')
    local config = cfg_text and U().checkpoint.deserialize(cfg_text, path .. ' config')
    if type(config) ~= 'table' then
      fail('%s has no model config (saved by uly.checkpoint.save without config = model.config): build the model '
           .. 'yourself and use uly.checkpoint.load(path, {model = m})', path)
    end
    local extra = f:attr('', 'extra')
    return { config = config, step = f:attr('', 'step'),
             extra = extra and U().checkpoint.deserialize(extra, path .. ' extra') or nil }
  end)
  f:close()
  if not ok2 then raise(clean(res)) end
  return res
end

local function safetensors_meta(path)
  local ok, _, meta = pcall(U().safetensors.header, path)
  if not ok then fail('%s is neither an HDF5 checkpoint nor a safetensors file: %s', path, (clean(_):gsub('^safetensors%.header: ', ''))) end
  if not meta.ulysses_config then
    fail('%s has no ulysses_config in its metadata (train.lua --export and uly.checkpoint.export write it): build the '
         .. 'model yourself and use uly.safetensors.load_into(model, path)', path)
  end
  local ok_cfg, cfg = pcall(U().checkpoint.deserialize, meta.ulysses_config, path .. ' ulysses_config')
  if not ok_cfg or type(cfg) ~= 'table' then fail("%s: its ulysses_config metadata is not a config table", path) end
  return { config = cfg, step = tonumber(meta.ulysses_step) }
end

-- saved_config(path) -> config, format ('checkpoint' | 'safetensors'), step: the model config a
-- checkpoint or a safetensors file from train.lua --export records (an error naming what the file
-- is when it records none)
local function read_meta(path)
  local is_h5 = first_bytes(path, 8) == HDF5_SIGNATURE
  local meta = is_h5 and checkpoint_meta(path) or safetensors_meta(path)
  meta.format = is_h5 and 'checkpoint' or 'safetensors'
  return meta
end

function M.saved_config(path)
  local meta = read_meta(path)
  return meta.config, meta.format, meta.step
end

-- load_weights(model, path, format): the weights of a checkpoint (its model only) or of a
-- safetensors file into model, every name and shape checked first; the random generator is left
-- as it was (a checkpoint would restore its own). Raises the loader's error.
function M.load_weights(model, path, format)
  local uly = U()
  local rng = uly.rng_state()
  local ok, err
  if format == 'checkpoint' then
    ok, err = pcall(uly.checkpoint.load, path, { model = model })
  else
    ok, err = pcall(uly.safetensors.load_into, model, path)
  end
  uly.set_rng_state(rng)
  if not ok then error(err, 0) end
end

-- the model of a saved config, for one process
local function build(config, path)
  local name = config.model
  if not MODELS[name] then
    fail("%s: its config names the model %s (known: gpt, llama)", path, type(name) == 'string' and "'" .. name .. "'" or tostring(name))
  end
  local mc = {}
  for k, v in pairs(config) do mc[k] = v end
  mc.model, mc.sp, mc.checkpoint = nil, nil, false
  local Model = require('models.' .. name)
  local ok, model = pcall(Model, mc)
  if not ok then fail('%s: its config does not make a model here: %s', path, clean(model)) end
  return model
end

local function data_kind(path)
  local h5 = U().h5
  if not h5.available then return nil end
  local ok, f = pcall(h5.open, path, 'r')
  if not ok then fail('data %s: %s', path, clean(f)) end
  local kind, vocab = f:attr('', 'kind'), f:attr('', 'vocab_size')
  f:close()
  if kind ~= 'text' and kind ~= 'dna' then fail("data %s is not a ulysses token file (its kind attribute is %s)", path, tostring(kind)) end
  return kind, vocab
end

function M.load(source, opts)
  opts = require('ulysses.options').check('pretrained.load', opts, LOAD_KEYS)
  if type(source) ~= 'string' or source == '' then
    fail('source must be a run directory, a checkpoint or a safetensors path (a non-empty string), got %s', tostring(source))
  end
  if opts.kind ~= nil and opts.kind ~= 'text' and opts.kind ~= 'dna' then
    fail("kind must be 'text' or 'dna', got %s", tostring(opts.kind))
  end
  local uly = U()
  local path = resolve(source)
  local meta = read_meta(path)
  local rng = uly.rng_state()   -- (building the model draws its initial weights)
  local model = build(meta.config, path)
  local ok, err = pcall(M.load_weights, model, path, meta.format)
  uly.set_rng_state(rng)
  if not ok then fail('%s', clean(err)) end
  model:eval()
  local V = model.config.vocab
  -- the alphabet: given, else the training data's, else the vocabulary's
  local data_path = opts.data
  if data_path then
    if not realpath(data_path) then fail("data: no such file '%s'", data_path) end
  else
    local recorded = meta.extra and meta.extra.data_path
    if type(recorded) == 'string' and realpath(recorded) then data_path = recorded end
  end
  local kind, kind_from = opts.kind, 'option'
  if not kind and data_path then
    local dv
    kind, dv = data_kind(data_path)
    kind_from = 'data'
    if kind and dv and dv ~= V then
      fail('data %s has a vocabulary of %d tokens, the model %d: it was not trained on this file', data_path, dv, V)
    end
  end
  if not kind then
    kind = V == 256 and 'text' or V == uly.data.DNA.vocab_size and 'dna' or nil
    kind_from = 'vocabulary'
    if not kind then
      fail("%s: a vocabulary of %d tokens is neither text bytes (256) nor DNA (%d), and no data file says which: "
           .. "pass kind = 'text' or 'dna', or data = the training file", path, V, uly.data.DNA.vocab_size)
    end
  end
  local codec = uly.data.codec(kind)
  if V ~= codec.vocab_size then
    fail("%s: a vocabulary of %d tokens cannot be %s (%d tokens)", path, V, kind, codec.vocab_size)
  end
  if opts.device and opts.device ~= 'cpu' then
    local ok_d, err_d = pcall(model.to, model, opts.device)
    if not ok_d then fail('device %s: %s', tostring(opts.device), clean(err_d)) end
  end
  return model, { path = path, format = meta.format, step = meta.step, config = model.config,
                  kind = kind, kind_from = kind_from, codec = codec, data_path = data_path }
end

-- For the tools (tools/generate.lua, tools/score.lua): the flags that say how to load, to append
-- to a tool's own (uly.cli), and the load itself: a mistake named with the tool's name, exit 2
M.LOAD_FLAGS = {
  { 'device', 'cpu', 'cpu | cuda' },
  { 'precision', 'auto', 'f32 | bf16 matmuls (auto: bf16 on cuda, f32 on cpu)' },
  { 'kind', '', 'text | dna: the alphabet (default: the training data\'s, else from the vocabulary)' },
  { 'data', '', 'the training data file (HDF5), if not the one the checkpoint names' },
}

function M.load_for_tool(tool, source, cfg)
  local cli = require 'ulysses.cli'
  if tonumber(os.getenv('OMPI_COMM_WORLD_SIZE') or '1') > 1 then cli.fail(tool, 'runs as one process, not under mpirun') end
  for _, c in ipairs({ { 'precision', { 'auto', 'f32', 'bf16' } }, { 'device', { 'cpu', 'cuda' } }, { 'kind', { '', 'text', 'dna' } } }) do
    local ok = false
    for _, v in ipairs(c[2]) do ok = ok or cfg[c[1]] == v end
    if not ok then
      cli.fail(tool, string.format("--%s must be %s, got '%s'", c[1], table.concat(c[2], ', '):gsub('^, ', ''), cfg[c[1]]))
    end
  end
  local ok, model, info = pcall(M.load, source, { device = cfg.device, kind = cfg.kind ~= '' and cfg.kind or nil,
                                                  data = cfg.data ~= '' and cfg.data or nil })
  if not ok then cli.fail(tool, (clean(model):gsub('^pretrained%.load: ', ''))) end
  U().matmul_precision(cfg.precision == 'auto' and (cfg.device == 'cpu' and 'f32' or 'bf16') or cfg.precision)
  local c = model.config
  info.summary = string.format('model: %s %s, %d layers, dim %d, %s parameters, context %d; %s%s (%s)', tostring(c.model),
                               tostring(c.preset), c.layers, c.dim, U().log.format_si(model:num_parameters()), c.seq,
                               info.path, info.step and (' step ' .. info.step) or '', info.kind)
  return model, info
end

return M
