-- lua/ulysses/checkpoint.lua — training checkpoints in HDF5 (`uly.checkpoint`):
--   checkpoint.save(path, {model = m, optim = opt, step = n, config = t, data = t, extra = t})
--   checkpoint.load(path, {model = m, optim = opt, strict = true}) -> {step, config, data, extra, rng, ...}
--   checkpoint.latest(dir) -> newest dir/step_NNNNNN.h5 by step, or nil
--   checkpoint.save_rotating(dir, step, what, keep = 3) -> path; keeps the newest `keep`
--   checkpoint.export(path, out) -> n; the model's weights as a safetensors file (uly.safetensors)
--
-- Layout (h5dump / h5py can read it): "model/<name>" one dataset per named_parameters() entry;
-- "optim/<state>/<name>" optimizer state (exp_avg, exp_avg_sq, momentum_buf) by parameter name;
-- root attributes: format, format_version, step and optim_step (numbers), rng_seed and rng_offset
-- (decimal strings: exact uint64), optim_kind, optim_hyper, optim_param_steps (parameter name ->
-- its own step count; a file without it gives every parameter optim_step), config, data, extra
-- (Lua-literal strings), created (UTC), library_version, num_parameter_tensors.
--
-- Saves are atomic: written to "<path>.tmp.<pid>.<n>" and renamed over `path` after an fsync,
-- so a crash or an error leaves the previous checkpoint intact and no temporary file; a value
-- that could not be read back is refused. Loads check every name, shape and dtype and read every
-- other value before anything in the model, optimizer or random generator is changed. The saving
-- process writes the whole checkpoint: under MPI, save from one rank.
local ffi = require 'ffi'
local T = require 'ulysses.tensor'
local h5 = require 'ulysses.h5'

local raise = T.raise
local M = {}

local FORMAT, FORMAT_VERSION = 'ulysses-checkpoint', 1

-- the package, reached lazily ('ulysses' loads this file on first use of uly.checkpoint)
local function U() return require 'ulysses' end

---------------------------------------------------------------- Lua-literal serialisation
local KEYWORDS = {}
for w in ([[and break do else elseif end false for function goto if in local nil not or repeat return then
            true until while]]):gmatch('%a+') do KEYWORDS[w] = true end

local function number_literal(v)
  if v ~= v then return '0/0' end
  if v == math.huge then return '1/0' end
  if v == -math.huge then return '-1/0' end
  return string.format('%.17g', v)
end

local TYPE_ORDER = { number = 1, string = 2, boolean = 3 }
local function key_less(a, b)
  local ta, tb = type(a), type(b)
  if ta ~= tb then return TYPE_ORDER[ta] < TYPE_ORDER[tb] end
  if ta == 'boolean' then return (not a) and b end
  return a < b
end

-- tables nested deeper than this cannot be read back: LuaJIT's parser takes at most 198 nested
-- table constructors after 'return' ("chunk has too many syntax levels")
local MAX_DEPTH = 198

local serialize
local function table_literal(t, where, seen, out, depth)
  if seen[t] then raise(string.format('checkpoint.save: %s refers to itself; only tree-shaped tables can be saved', where)) end
  if depth > MAX_DEPTH then
    raise(string.format('checkpoint.save: %s is nested %d tables deep; at most %d levels can be loaded back: '
                        .. 'flatten it', where, depth, MAX_DEPTH))
  end
  seen[t] = true
  local n = #t
  local keys = {}
  for k in pairs(t) do
    local tk = type(k)
    if not TYPE_ORDER[tk] then
      raise(string.format('checkpoint.save: %s has a %s key; keys must be strings, numbers or booleans', where, tk))
    end
    if not (tk == 'number' and k >= 1 and k <= n and k == math.floor(k)) then keys[#keys + 1] = k end
  end
  table.sort(keys, key_less)
  out[#out + 1] = '{'
  local first = true
  local function sep()
    if not first then out[#out + 1] = ',' end
    first = false
  end
  for i = 1, n do
    sep()
    serialize(t[i], where .. '[' .. i .. ']', seen, out, depth)
  end
  for _, k in ipairs(keys) do
    sep()
    if type(k) == 'string' and k:match('^[%a_][%w_]*$') and not KEYWORDS[k] then
      out[#out + 1] = k .. '='
      serialize(t[k], where .. '.' .. k, seen, out, depth)
    else
      out[#out + 1] = '['
      serialize(k, where, seen, out, depth)
      out[#out + 1] = ']='
      serialize(t[k], where .. '[' .. tostring(k) .. ']', seen, out, depth)
    end
  end
  out[#out + 1] = '}'
  seen[t] = nil
end

function serialize(v, where, seen, out, depth)
  local tv = type(v)
  if tv == 'string' then out[#out + 1] = string.format('%q', v)
  elseif tv == 'number' then out[#out + 1] = number_literal(v)
  elseif tv == 'boolean' or tv == 'nil' then out[#out + 1] = tostring(v)
  elseif tv == 'table' then
    if T.is_tensor(v) then
      raise(string.format('checkpoint.save: %s is a tensor; put tensors in the model or save them with uly.h5', where))
    end
    table_literal(v, where, seen, out, depth + 1)
  else
    raise(string.format('checkpoint.save: %s is a %s; only strings, numbers, booleans and tables of them can be saved',
                        where, tv))
  end
end

-- a deterministic Lua literal for v (sorted keys, numbers with %.17g), checked to load back
function M.serialize(v, where)
  where = where or 'value'
  local out = {}
  serialize(v, where, {}, out, 0)
  local s = table.concat(out)
  local ok, err = load('return ' .. s, '=' .. where, 't', {})   -- compiled, not run: the parser's other limits
  if not ok then
    raise(string.format('checkpoint.save: %s could not be loaded back (%s); save a smaller or flatter value', where,
                        tostring(err)))
  end
  return s
end

-- the value of a literal written by serialize, evaluated with no access to any global
function M.deserialize(s, where)
  local fn, err = load('return ' .. s, '=' .. (where or 'checkpoint value'), 't', {})
  if not fn then raise(string.format('checkpoint.load: %s is not a valid saved value: %s', where, err)) end
  setfenv(fn, {})
  local ok, v = pcall(fn)
  if not ok then raise(string.format('checkpoint.load: %s could not be evaluated: %s', where, tostring(v))) end
  return v
end

---------------------------------------------------------------- uint64 <-> decimal string
local function u64_string(v)
  return (tostring(ffi.cast('uint64_t', v)):gsub('ULL$', ''))
end

local U64_MAX = '18446744073709551615'
local function parse_u64(s, what)
  if type(s) ~= 'string' or not s:match('^%d+$') or #s > 20 or (#s == 20 and s > U64_MAX) then
    raise(string.format('checkpoint.load: %s must be a decimal uint64 string, got %s', what, tostring(s)))
  end
  local v = ffi.new('uint64_t', 0)
  for i = 1, #s do v = v * 10 + (s:byte(i) - 48) end
  return v
end

---------------------------------------------------------------- names
local function shape_str(shape) return '[' .. table.concat(shape, ', ') .. ']' end

local function same_shape(a, b)
  if #a ~= #b then return false end
  for i = 1, #a do if a[i] ~= b[i] then return false end end
  return true
end

-- address of a tensor's C handle: the identity shared by the model and the optimizer
local function tensor_key(t) return tostring(ffi.cast('uintptr_t', T.handle(t))) end

-- { {name, tensor}, ... } in named_parameters order, plus name -> tensor and handle -> name
local function model_params(what, model)
  if type(model) ~= 'table' or type(model.named_parameters) ~= 'function' then
    raise(what .. ': model must be an nn module (something with named_parameters())')
  end
  local list, by_name, by_key = {}, {}, {}
  for name, p in model:named_parameters() do
    if type(name) ~= 'string' or name == '' or name:find('/', 1, true) or name:find('^%.') then
      raise(string.format("%s: parameter name %q cannot be a dataset name (no '/', not empty, not starting with '.')",
                          what, tostring(name)))
    end
    if by_name[name] then raise(string.format("%s: two parameters are named '%s'", what, name)) end
    T.handle(p, what .. ' parameter ' .. name)
    list[#list + 1] = { name, p }
    by_name[name] = p
    by_key[tensor_key(p)] = name
  end
  return list, by_name, by_key
end

-- parameter names of the optimizer's params, in its order (errors for params not in the model)
local function optim_names(what, opt, by_key)
  if type(opt) ~= 'table' or type(opt.params) ~= 'table' or type(opt.state_dict) ~= 'function' then
    raise(what .. ': optim must be an optimizer (opt.params and opt:state_dict())')
  end
  if not by_key then raise(what .. ': saving or loading an optimizer needs the model too (its parameter names)') end
  local names = {}
  for i, p in ipairs(opt.params) do
    local name = T.is_tensor(p) and p._h ~= nil and by_key[tensor_key(p)]
    if not name then
      raise(string.format('%s: optimizer parameter %d (%s) is not a parameter of the model', what, i,
                          T.is_tensor(p) and tostring(p:dtype()) .. shape_str(p:shape()) or type(p)))
    end
    names[i] = name
  end
  return names
end

local function sorted_keys(t)
  local keys = {}
  for k in pairs(t) do keys[#keys + 1] = k end
  table.sort(keys)
  return keys
end

---------------------------------------------------------------- save
local tmp_counter = 0
local getpid = (function()
  pcall(ffi.cdef, 'int getpid(void);')
  local ok, pid = pcall(function() return ffi.C.getpid() end)
  return ok and pid or math.floor(os.clock() * 1e6) % 100000
end)()

-- M._test_hook(stage) is called after each dataset written (stage = its name): specs use it to
-- make a save fail midway
local function write_checkpoint(f, what)
  local hook = M._test_hook
  local literals = {}  -- serialised first, so a value that cannot be saved fails before any write
  for _, key in ipairs({ 'config', 'data', 'extra' }) do literals[key] = M.serialize(what[key], key) end
  local names, by_key = {}, nil
  if what.model ~= nil then
    local list, _, keys = model_params('checkpoint.save', what.model)
    by_key = keys
    for _, e in ipairs(list) do
      f:write('model/' .. e[1], e[2])
      if hook then hook('model/' .. e[1]) end
    end
    names = list
  end
  if what.optim ~= nil then
    local opt = what.optim
    local pnames = optim_names('checkpoint.save', opt, by_key)
    local sd = opt:state_dict()
    for _, key in ipairs(sorted_keys(sd.state or {})) do
      local states = sd.state[key]
      for i = 1, #opt.params do
        local t = states[i]
        if t ~= nil then
          f:write('optim/' .. key .. '/' .. pnames[i], t)
          if hook then hook('optim/' .. key .. '/' .. pnames[i]) end
        end
      end
    end
    f:set_attr('', 'optim_kind', tostring(sd.kind))
    if type(sd.step) == 'number' then f:set_attr('', 'optim_step', sd.step) end
    if sd.param_steps ~= nil then
      local steps = {}
      for i, name in ipairs(pnames) do steps[name] = sd.param_steps[i] end
      f:set_attr('', 'optim_param_steps', M.serialize(steps, 'optimizer param_steps'))
    end
    f:set_attr('', 'optim_hyper', M.serialize(sd.hyper or {}, 'optimizer hyper'))
  end
  local rng = U().rng_state()
  f:set_attr('', 'format', FORMAT)
  f:set_attr('', 'format_version', FORMAT_VERSION)
  if what.step ~= nil then f:set_attr('', 'step', what.step) end
  f:set_attr('', 'rng_seed', u64_string(rng.seed))
  f:set_attr('', 'rng_offset', u64_string(rng.offset))
  f:set_attr('', 'config', literals.config)
  f:set_attr('', 'data', literals.data)
  f:set_attr('', 'extra', literals.extra)
  f:set_attr('', 'created', os.date('!%Y-%m-%dT%H:%M:%SZ'))
  f:set_attr('', 'library_version', U().version)
  f:set_attr('', 'num_parameter_tensors', #names)
end

local SAVE_KEYS = { model = true, optim = true, step = true, config = true, data = true, extra = true }

function M.save(path, what)
  if type(path) ~= 'string' or path == '' then raise('checkpoint.save: path must be a non-empty string') end
  if type(what) ~= 'table' then raise('checkpoint.save: expects a table {model = m, optim = opt, step = n, ...}') end
  for k in pairs(what) do
    if not SAVE_KEYS[k] then
      raise(string.format("checkpoint.save: unknown field '%s' (use model, optim, step, config, data, extra)", tostring(k)))
    end
  end
  if what.step ~= nil and type(what.step) ~= 'number' then raise('checkpoint.save: step must be a number') end
  M._mkdir_p(path:match('^(.*)/[^/]*$') or '')   -- the checkpoint's directory, made if missing
  local ok_dest, dest = pcall(h5.destination, path)   -- a symlink's target; never over a device
  if not ok_dest then raise('checkpoint.save: ' .. tostring(dest):gsub('^[^:]*%.lua:%d+: ', '')) end
  local given = path
  path = dest
  tmp_counter = tmp_counter + 1
  local tmp = string.format('%s.tmp.%d.%d', path, getpid, tmp_counter)
  local f
  local ok, err = pcall(function()
    f = h5.create(tmp)
    write_checkpoint(f, what)
    f:close()
    h5.commit(tmp, path)
  end)
  if not ok then
    if f then pcall(f.close, f) end
    os.remove(tmp)
    raise(tostring(err))
  end
  return given
end

---------------------------------------------------------------- load
local function read_attr(f, key, required, what)
  local v = f:attr('', key)
  if v == nil and required then
    raise(string.format("%s: %s has no '%s' attribute; is it a ulysses checkpoint?", what or 'checkpoint.load', f.path, key))
  end
  return v
end

-- names, shapes and dtypes of the model against the file: a list of problems (empty when fine)
local function check_model(f, list, by_name, strict)
  local problems, plan = {}, {}
  local in_file = {}
  if f:exists('model') then
    for _, ds in ipairs(f:list('model')) do in_file[ds:sub(#'model/' + 1)] = true end
  end
  local missing, unexpected = {}, {}
  for _, e in ipairs(list) do
    local name, p = e[1], e[2]
    if not in_file[name] then
      missing[#missing + 1] = name
    else
      local info = f:info('model/' .. name)
      if not same_shape(info.shape, p:shape()) then
        problems[#problems + 1] = string.format('  shape mismatch: %s is %s in the file, %s in the model', name,
                                                shape_str(info.shape), shape_str(p:shape()))
      elseif strict and info.dtype ~= p:dtype() then
        problems[#problems + 1] = string.format('  dtype mismatch: %s is %s in the file, %s in the model', name,
                                                info.dtype, p:dtype())
      else
        plan[#plan + 1] = { 'model/' .. name, p }
      end
    end
  end
  for _, name in ipairs(sorted_keys(in_file)) do
    if not by_name[name] then unexpected[#unexpected + 1] = name end
  end
  if strict and #missing > 0 then
    table.insert(problems, 1, '  missing in the file: ' .. table.concat(missing, ', '))
  end
  if strict and #unexpected > 0 then
    table.insert(problems, 1, '  in the file but not in the model: ' .. table.concat(unexpected, ', '))
  end
  return problems, plan
end

-- the optimizer's state_dict rebuilt from the file (tensors to fill are the optimizer's own)
local function check_optim(f, opt, by_key, strict, problems, plan)
  local pnames = optim_names('checkpoint.load', opt, by_key)
  local kind = f:attr('', 'optim_kind')
  if kind == nil then
    problems[#problems + 1] = '  the file holds no optimizer state (saved without optim)'
    return nil
  end
  local mine = opt:state_dict()
  if kind ~= mine.kind then
    problems[#problems + 1] = string.format('  optimizer kind: %s in the file, %s here', kind, tostring(mine.kind))
    return nil
  end
  local sd = {
    kind = kind,
    step = f:attr('', 'optim_step'),
    hyper = M.deserialize(read_attr(f, 'optim_hyper', true), 'optim_hyper'),
    state = {},
  }
  local step = sd.step
  if type(step) ~= 'number' or step < 0 or step ~= math.floor(step) then
    problems[#problems + 1] = '  the file has no optim_step (a non-negative integer)'
    step = math.huge
  end
  local lr = type(sd.hyper) == 'table' and sd.hyper.lr
  if type(sd.hyper) ~= 'table' or (lr ~= nil and (type(lr) ~= 'number' or not (lr >= 0))) then
    problems[#problems + 1] = '  optim_hyper is not a table with lr a number >= 0'
  end
  local steps = f:attr('', 'optim_param_steps')   -- absent in older files: every parameter has optim_step
  if steps ~= nil then
    steps = M.deserialize(steps, 'optim_param_steps')
    sd.param_steps = {}
    for i, name in ipairs(pnames) do
      local s = type(steps) == 'table' and steps[name]
      if type(s) ~= 'number' or s < 0 or s > step or s ~= math.floor(s) then
        problems[#problems + 1] = string.format('  optim_param_steps has no step count in [0, optim_step] for %s', name)
      end
      sd.param_steps[i] = s
    end
  end
  local file_keys = {}
  if f:exists('optim') then
    for _, ds in ipairs(f:list('optim')) do file_keys[ds:match('^optim/([^/]+)/')] = true end
  end
  for _, key in ipairs(sorted_keys(mine.state or {})) do
    local list, out = mine.state[key], {}
    for i = 1, #list do
      local ds = 'optim/' .. key .. '/' .. pnames[i]
      local info = f:info(ds)
      local t = list[i]
      if not info then
        problems[#problems + 1] = string.format('  missing optimizer state: %s', ds)
      elseif not same_shape(info.shape, t:shape()) then
        problems[#problems + 1] = string.format('  shape mismatch: %s is %s in the file, %s in the optimizer', ds,
                                                shape_str(info.shape), shape_str(t:shape()))
      else
        plan[#plan + 1] = { ds, t }
      end
      out[i] = t
    end
    sd.state[key] = out
    file_keys[key] = nil
  end
  if strict and next(file_keys) then
    problems[#problems + 1] = '  optimizer state in the file but not in this optimizer: ' ..
                              table.concat(sorted_keys(file_keys), ', ')
  end
  return sd
end

-- dataset `name` into t; a non-contiguous t (a transposed parameter) through a contiguous copy
local function read_into(f, name, t)
  if t:is_contiguous() then return f:read_into(name, t) end
  t:copy_(f:read_into(name, T.empty(t:shape(), { dtype = t:dtype(), device = t:device() })))
end

local function load_from(f, opts)
  if read_attr(f, 'format', true) ~= FORMAT then
    raise(string.format("checkpoint.load: %s is not a ulysses checkpoint (format attribute is '%s')", f.path,
                        tostring(f:attr('', 'format'))))
  end
  local version = read_attr(f, 'format_version', true)
  if type(version) ~= 'number' or version > FORMAT_VERSION then
    raise(string.format('checkpoint.load: %s has format version %s; this library reads up to %d (upgrade ulysses)',
                        f.path, tostring(version), FORMAT_VERSION))
  end
  local strict = opts.strict ~= false
  local problems, plan, by_key = {}, {}, nil
  if opts.model ~= nil then
    local list, by_name
    list, by_name, by_key = model_params('checkpoint.load', opts.model)
    problems, plan = check_model(f, list, by_name, strict)
  end
  local sd
  if opts.optim ~= nil then sd = check_optim(f, opts.optim, by_key, strict, problems, plan) end
  if #problems > 0 then
    raise(string.format('checkpoint.load: %s does not match (nothing was loaded):\n%s', f.path,
                        table.concat(problems, '\n')))
  end
  -- every other value read and checked too, before anything changes
  local res = {
    step = f:attr('', 'step'),
    config = M.deserialize(read_attr(f, 'config', true), 'config'),
    data = M.deserialize(read_attr(f, 'data', true), 'data'),
    extra = M.deserialize(read_attr(f, 'extra', true), 'extra'),
    rng = { seed = parse_u64(read_attr(f, 'rng_seed', true), 'rng_seed'),
            offset = parse_u64(read_attr(f, 'rng_offset', true), 'rng_offset') },
    optim_kind = f:attr('', 'optim_kind'),
    created = f:attr('', 'created'),
    library_version = f:attr('', 'library_version'),
  }
  -- everything checked: copy
  U().no_grad(function()
    for i, e in ipairs(plan) do
      local ok, err = pcall(read_into, f, e[1], e[2])
      if not ok then   -- a corrupt tensor (its checksum) or an unreadable one, found while copying
        raise(string.format('checkpoint.load: %s%s', tostring(err):gsub('^[^:]*%.lua:%d+: ', ''),
                            i > 1 and string.format(' (%d tensors before it were already loaded: load a good checkpoint '
                                                    .. 'into this model before using it)', i - 1) or ''))
      end
    end
  end)
  if sd then opts.optim:load_state_dict(sd) end
  U().set_rng_state(res.rng)
  return res
end

local LOAD_KEYS = { model = true, optim = true, strict = true }

function M.load(path, opts)
  if type(path) ~= 'string' or path == '' then raise('checkpoint.load: path must be a non-empty string') end
  opts = opts or {}
  if type(opts) ~= 'table' then raise('checkpoint.load: options must be a table {model = m, optim = opt, strict = true}') end
  for k in pairs(opts) do
    if not LOAD_KEYS[k] then
      raise(string.format("checkpoint.load: unknown option '%s' (use model, optim, strict)", tostring(k)))
    end
  end
  local ok, f = pcall(h5.open, path, 'r')
  if not ok then raise('checkpoint.load: ' .. tostring(f)) end
  local ok2, res = pcall(load_from, f, opts)
  f:close()
  if not ok2 then raise(tostring(res)) end
  return res
end

-- the model weights of checkpoint `path` as the safetensors file `out` (uly.safetensors; every
-- tensor's checksum verified as it is read), with the model's config, step and the checkpoint it
-- came from in the metadata; returns the number of tensors written
function M.export(path, out)
  if type(path) ~= 'string' or path == '' then raise('checkpoint.export: path must be a non-empty string') end
  if type(out) ~= 'string' or out == '' then raise('checkpoint.export: out must be a non-empty string (a .safetensors path)') end
  local ok, f = pcall(h5.open, path, 'r')
  if not ok then raise('checkpoint.export: ' .. tostring(f):gsub('^[^:]*%.lua:%d+: ', '')) end
  local ok2, res = pcall(function()
    if read_attr(f, 'format', true, 'checkpoint.export') ~= FORMAT then
      raise(string.format("checkpoint.export: %s is not a ulysses checkpoint (format attribute is '%s')", path,
                          tostring(f:attr('', 'format'))))
    end
    local tensors, n = {}, 0
    for _, p in ipairs(f:list('model')) do   -- read whole, so each tensor's checksum is verified
      local info = f:info(p)
      tensors[p:sub(#'model/' + 1)] = f:read_into(p, T.empty(info.shape, { dtype = info.dtype }))
      n = n + 1
    end
    local step = f:attr('', 'step')
    return { tensors = tensors, n = n, metadata = { format = 'pt', ulysses_config = read_attr(f, 'config', true, 'checkpoint.export'),
                                                   ulysses_step = step and string.format('%.17g', step) or nil,
                                                   ulysses_checkpoint = path } }
  end)
  f:close()
  if not ok2 then raise(tostring(res):gsub('^[^:]*%.lua:%d+: ', '')) end
  require('ulysses.safetensors').save(out, res.tensors, { metadata = res.metadata })
  return res.n
end

---------------------------------------------------------------- directories
local list_dir = require('ulysses.paths').list_dir

-- { {step, path}, ... } of dir/step_N.h5, newest first
local function checkpoints_in(dir)
  local found = {}
  for _, name in ipairs(list_dir(dir) or {}) do
    local step = name:match('^step_(%d+)%.h5$')
    if step then found[#found + 1] = { tonumber(step), dir .. '/' .. name } end
  end
  table.sort(found, function(a, b) return a[1] > b[1] end)
  return found
end

-- make dir and any missing parents (mkdir -p); existing ones are fine
M._mkdir_p = require('ulysses.paths').mkdir_p

function M.latest(dir)
  if type(dir) ~= 'string' then raise('checkpoint.latest: dir must be a string') end
  local found = checkpoints_in(dir)
  return found[1] and found[1][2] or nil
end

-- temporary files of saves whose process is gone (killed mid-write): each nearly a checkpoint's size
local function remove_stale_temporaries(dir)
  for _, name in ipairs(list_dir(dir) or {}) do
    local pid = name:match('^step_%d+%.h5%.tmp%.(%d+)%.%d+$')
    if pid and tonumber(pid) ~= getpid and not io.open('/proc/' .. pid .. '/stat', 'r') then os.remove(dir .. '/' .. name) end
  end
end

function M.save_rotating(dir, step, what, keep)
  if type(dir) ~= 'string' or dir == '' then raise('checkpoint.save_rotating: dir must be a non-empty string') end
  if type(step) ~= 'number' or step < 0 or step ~= math.floor(step) then
    raise('checkpoint.save_rotating: step must be a non-negative integer, got ' .. tostring(step))
  end
  keep = keep or 3
  if type(keep) ~= 'number' or keep < 1 or keep ~= math.floor(keep) then
    raise('checkpoint.save_rotating: keep must be an integer >= 1, got ' .. tostring(keep))
  end
  if type(what) ~= 'table' then raise('checkpoint.save_rotating: expects a table {model = m, optim = opt, ...}') end
  M._mkdir_p(dir)
  local copy = {}
  for k, v in pairs(what) do copy[k] = v end
  copy.step = step
  local path = string.format('%s/step_%06d.h5', dir, step)
  M.save(path, copy)
  -- the newest `keep` by step stay, and always the one just written (a directory that also holds
  -- later steps, from another run, must not lose it)
  remove_stale_temporaries(dir)
  local found, kept = checkpoints_in(dir), 1
  for i = 1, #found do
    if found[i][2] ~= path then
      if kept < keep then kept = kept + 1 else os.remove(found[i][2]) end
    end
  end
  return path
end

return M
