-- lua/ulysses/repl.lua — the interactive prompt behind bin/ulysses: evaluates expressions and
-- statements (multi-line input continues with '>>'), prints results readably (tensors with
-- shape and dtype), keeps going after errors, and uses GNU readline through the FFI for line
-- editing, history and Tab completion (M.complete) when the library is present. Also runs
-- scripts (see bin/ulysses).
local ffi = require 'ffi'

local M = {}

local function usage()
  io.stderr:write('usage: bin/ulysses [-i] [script.lua [args...]] | -e CODE | -h\n')
end

local function stdin_is_terminal() return os.execute('test -t 0') == 0 end

-- Tab completion: the words that complete `text` (the word at the cursor: a name, or a path of
-- names such as uly.nn.Lin or x:res) in env, sorted. A path
-- is resolved by indexing only (no calls); after ':' only functions (methods) are offered; a
-- tensor offers the Tensor methods, a module or object its fields and its class's, uly also the
-- submodules it loads on first use.
function M.complete(text, env)
  local base, sep, partial = text:match('^(.-)([.:])([%w_]*)$')
  if base == '' or (base and not base:match('^[%a_][%w_]*$') and not base:match('^[%a_][%w_.]*[%w_]$')) then
    return {}
  end
  local uly = package.loaded.ulysses
  local found, seen = {}, {}
  local function add(k, v)
    if type(k) ~= 'string' or not k:match('^[%a_][%w_]*$') or seen[k] then return end
    if k:sub(1, 1) == '_' and partial:sub(1, 1) ~= '_' then return end   -- (internals, unless asked for)
    if k:sub(1, #partial) ~= partial or (sep == ':' and type(v) ~= 'function') then return end
    seen[k] = true
    found[#found + 1] = k
  end
  local function add_all(t)   -- a table's keys, then its class's (metatable __index tables)
    for depth = 1, 8 do
      if type(t) ~= 'table' then return end
      for k, v in pairs(t) do add(k, v) end
      local mt = getmetatable(t)
      t = mt and mt.__index
    end
  end
  if not base then   -- a variable: the prompt's own, then the globals
    partial, sep = text, nil
    for k, v in pairs(env) do add(k, v) end
    for k, v in pairs(_G) do add(k, v) end
  else
    local ok, value = pcall(function()
      local v
      for name in base:gmatch('[^.]+') do
        if v == nil then v = env[name] else v = v[name] end
        if v == nil then return nil end
      end
      return v
    end)
    if not ok or value == nil then return {} end
    if uly and uly.is_tensor(value) then
      add_all(require('ulysses.tensor').Tensor)
      if sep == '.' then add('grad', 0) add('requires_grad', 0) end   -- (fields the tensor object reads for itself)
    else
      add_all(value)
      if value == uly and sep == '.' then for k in pairs(getmetatable(uly).lazy or {}) do add(k, true) end end
    end
  end
  table.sort(found)
  for i, k in ipairs(found) do found[i] = (base and (base .. sep) or '') .. k end
  return found
end

-- line input: readline if available (line editing, history, Tab completion), plain io.read otherwise
local function line_reader(env)
  local ok, rl = pcall(function()
    ffi.cdef [[
      char *readline(const char *prompt);
      void add_history(const char *line);
      int read_history(const char *filename);
      int write_history(const char *filename);
      void free(void *ptr);
      char *strdup(const char *s);
      typedef char *uly_rl_compentry_func_t(const char *text, int state);
      extern uly_rl_compentry_func_t *rl_completion_entry_function;
      extern const char *rl_basic_word_break_characters;
      extern int rl_completion_append_character;
    ]]
    return ffi.load('readline.so.8')
  end)
  local interactive = os.getenv('TERM') and stdin_is_terminal()
  if ok and interactive then
    local history = (os.getenv('HOME') or '.') .. '/.ulysses_history'
    rl.read_history(history)
    -- Tab: M.complete on the word before the cursor ('.' and ':' inside it, operators around it)
    local break_chars = ' \t\n"\\\'`@$><=;|&{(,+-*/%^#[]~)'
    local breaks = ffi.new('char[?]', #break_chars + 1, break_chars)
    local candidates = {}
    local complete = ffi.cast('uly_rl_compentry_func_t *', function(text, state)
      if state == 0 then
        local ok_c, list = pcall(M.complete, ffi.string(text), env)
        candidates = ok_c and list or {}
        rl.rl_completion_append_character = 0   -- (a path goes on with '.' or ':')
      end
      local c = candidates[state + 1]
      return c and ffi.C.strdup(c) or nil
    end)
    pcall(function()
      rl.rl_basic_word_break_characters = breaks
      rl.rl_completion_entry_function = complete
    end)
    local read = function(prompt)
      local p = rl.readline(prompt)
      if p == nil then return nil end
      local line = ffi.string(p)
      ffi.C.free(p)
      if line:match('%S') then rl.add_history(line); rl.write_history(history) end
      return line
    end
    jit.off(read)   -- readline calls back into Lua (completion): never from a compiled trace
    return function(prompt)
      local _ = breaks, complete   -- (kept alive while the reader is)
      return read(prompt)
    end
  end
  return function(prompt)
    if interactive then io.write(prompt) io.flush() end
    return io.read('*l')
  end
end

-- a readable form of any value
local function show(v, depth)
  depth = depth or 0
  local uly = package.loaded.ulysses
  if uly and uly.is_tensor(v) then return tostring(v) end
  if type(v) == 'string' then return string.format('%q', v) end
  if type(v) ~= 'table' or depth > 1 then return tostring(v) end
  local mt = getmetatable(v)
  if mt and mt.__tostring then return tostring(v) end
  local parts, n = {}, 0
  for k, x in pairs(v) do
    n = n + 1
    if n > 20 then parts[#parts + 1] = '...' break end
    local key = type(k) == 'string' and k:match('^[%a_][%w_]*$') and k or ('[' .. show(k, 2) .. ']')
    parts[#parts + 1] = key .. ' = ' .. show(x, depth + 1)
  end
  return '{' .. table.concat(parts, ', ') .. '}'
end
M.show = show

-- stderr is unbuffered and stdout is not when piped: flush results first, so they keep their order
local function to_stderr(msg)
  io.stdout:flush()
  io.stderr:write(msg, '\n')
end

-- a misspelt method or function (`x:sofmax(1)`, `uly.zero(3)`): the nearest tensor method or
-- uly function, appended as a hint
local function with_hint(msg)
  local kind, name = msg:match("attempt to call (%a+) '([%w_]+)' %(a nil value%)")
  local uly = package.loaded.ulysses
  if not name or not uly or (kind ~= 'method' and kind ~= 'field') then return msg end
  local names = {}
  local from = kind == 'method' and require('ulysses.tensor').Tensor or uly
  for k, v in pairs(from) do if type(k) == 'string' and type(v) == 'function' then names[#names + 1] = k end end
  table.sort(names)
  local guess = require('ulysses.options').nearest(name, names)
  if not guess then return msg end
  return string.format("%s (did you mean %s%s?)", msg, kind == 'method' and ':' or 'uly.', guess)
end

local function report_error(err)
  to_stderr(with_hint((tostring(err):gsub('\nstack traceback:.*', ''))))
end

-- compile `src` as an expression first, then as statements; the third result says the input
-- may only be unfinished (either reading ran out at its end: `uly.randn(2) *`, `for i = 1, 3 do`)
local function compile(src, env)
  src = src:gsub('^%s*=', '', 1)   -- `= expr`, the Lua 5.1 prompt's way to print a value
  local fn, err = loadstring('return ' .. src, '=stdin')
  local unfinished = not fn and err:match("near '<eof>'$") ~= nil
  if not fn then
    fn, err = loadstring(src, '=stdin')
    unfinished = unfinished or (not fn and err:match("near '<eof>'$") ~= nil)
  end
  if fn then setfenv(fn, env) end
  return fn, err, unfinished
end

-- print the results of a call; false when it failed (its error reported)
local function print_results(ok, ...)
  if not ok then report_error((...)) return false end
  local n = select('#', ...)
  for i = 1, n do print(show((select(i, ...)))) end
  return true
end

-- read, evaluate and print until the end of input; returns false when any input failed (an
-- error, or, from a pipe or file, a statement left unfinished at the end: Ctrl-D at a terminal
-- just quits)
function M.loop(env)
  local read = line_reader(env)
  local uly = env.uly
  io.write(string.format('ulysses %s on %s: `uly` is loaded; %d threads, BLAS %s; uly.cuda.devices() lists GPUs. Ctrl-D quits.\n',
                         uly.version, jit.version, uly.get_num_threads(), uly.blas_corename()))
  local buffer, all_ok = nil, true
  while true do
    local line = read(buffer and '>> ' or 'uly> ')
    if line == nil then
      io.write('\n')
      if buffer and not stdin_is_terminal() then
        report_error(string.format("unfinished input at end of input: %s (the statement from '%s')",
                                   select(2, compile(buffer, env)), buffer:match('^[^\n]*')))
        all_ok = false
      end
      break
    end
    local src = buffer and (buffer .. '\n' .. line) or line
    local fn, err, unfinished = compile(src, env)
    if not fn and unfinished then
      buffer = src -- incomplete statement: keep reading
    else
      buffer = nil
      if fn then all_ok = print_results(xpcall(fn, debug.traceback)) and all_ok
      elseif src:match('%S') then report_error(err) all_ok = false end
    end
  end
  return all_ok
end

-- the global environment scripts and the prompt see: _G plus `uly`
local function make_env()
  local uly = require 'ulysses'
  local env = setmetatable({ uly = uly }, { __index = _G, __newindex = function(t, k, v) rawset(t, k, v) end })
  return env
end

function M.main(args)
  local interactive_after, i = false, 1
  if args[1] == '-h' or args[1] == '--help' then usage() return 0 end
  if args[1] == '-e' then
    if not args[2] then usage() return 2 end
    local fn, err = compile(args[2], make_env())
    if not fn then report_error(err) return 1 end
    local ok, e = xpcall(fn, debug.traceback)
    if not ok then report_error(e) return 1 end
    return 0
  end
  if args[1] == '-i' then interactive_after, i = true, 2 end
  local script = args[i]
  local env = make_env()
  if script then
    local fn, err = loadfile(script)
    if not fn then to_stderr(err) return 1 end
    -- the script sees the usual `arg` table: arg[0] the script, arg[1..] its arguments
    _G.arg = { [0] = script }
    for k = i + 1, #args do _G.arg[k - i] = args[k] end
    local ok, e = xpcall(function() return fn(unpack(_G.arg)) end, debug.traceback)
    if not ok then to_stderr(tostring(e)) return 1 end
    if not interactive_after then return 0 end
  end
  -- at a terminal errors are part of the session; from a pipe or file they fail the run
  if not M.loop(env) and not stdin_is_terminal() then return 1 end
  return 0
end

-- run as the program (bin/ulysses), not when required
if not package.loaded['ulysses.repl'] and arg and arg[0] and arg[0]:match('repl%.lua$') then
  os.exit(M.main({ ... }) or 0, true) -- true: close the Lua state, so tensors are released
end
return M
