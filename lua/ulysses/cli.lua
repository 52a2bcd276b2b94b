-- lua/ulysses/cli.lua — command-line flags for the tools (tools/generate.lua, tools/score.lua):
--
--   local cfg, inputs = cli.parse('tools/generate.lua', arg, FLAGS, 'usage line')
--
-- FLAGS is a list of { name, default, help }: the default's type is the flag's (a number flag
-- takes a number, a string flag nil or a string default, a list default {} collects every use).
-- `--name value` and `--name=value` both work; other arguments are returned in order as inputs.
-- --help prints the usage and the flags on stdout and exits 0; a mistake (an unknown or
-- misspelled flag, with the nearest name; a missing or non-numeric value) is named on stderr with
-- the tool's name, exit 2.
local options = require 'ulysses.options'

local M = {}

-- the usage text: the line, then each flag with its default and help
function M.usage_text(tool, flags, line)
  local out = { 'usage: ' .. line, '' }
  for _, f in ipairs(flags) do
    local d = f[2]
    local shown = type(d) == 'table' and '(repeatable)' or d == nil and '' or tostring(d)
    out[#out + 1] = string.format('  --%-14s %-14s %s', f[1], shown, f[3])
  end
  return table.concat(out, '\n') .. '\n'
end

-- the flag lists a, b, ... as one list (a tool's own flags, then shared ones)
function M.flags(...)
  local out = {}
  for _, list in ipairs({ ... }) do
    for _, f in ipairs(list) do out[#out + 1] = f end
  end
  return out
end

-- an error's text without the file:line prefixes Lua put on it
function M.clean(err) return (tostring(err):gsub('^[^%s:]+%.lua:%d+: ', '')) end

-- a mistake: the tool's name and what was wrong on stderr, exit 2
function M.fail(tool, msg)
  io.stderr:write(tool, ': ', msg, '\n')
  os.exit(2, true)   -- the state closed: what was made so far (tensors) is freed
end

function M.parse(tool, argv, flags, line)
  local by_name, names, cfg = {}, {}, {}
  for _, f in ipairs(flags) do
    by_name[f[1]], names[#names + 1] = f, f[1]
    if type(f[2]) == 'table' then cfg[f[1]] = {} else cfg[f[1]] = f[2] end
  end
  local inputs, i = {}, 1
  while i <= #argv do
    local a = argv[i]
    if a == '--help' or a == '-h' then
      io.stdout:write(M.usage_text(tool, flags, line))
      os.exit(0)
    end
    local key, value = a:match('^%-%-([^=]+)=(.*)$')
    if not key then key = a:match('^%-%-(.+)$') end
    if key then
      local f = by_name[key]
      if not f then
        local near = options.nearest(key, names)
        M.fail(tool, string.format('unknown flag --%s%s (--help lists them)', key, near and " (did you mean '--" .. near .. "'?)" or ''))
      end
      if value == nil then
        value = argv[i + 1]
        if value == nil then M.fail(tool, '--' .. key .. ' needs a value') end
        i = i + 1
      end
      if type(f[2]) == 'number' then
        local n = tonumber(value)
        if not n then M.fail(tool, string.format("--%s must be a number, got '%s'", key, value)) end
        cfg[key] = n
      elseif type(f[2]) == 'table' then
        table.insert(cfg[key], value)
      else
        cfg[key] = value
      end
    else
      inputs[#inputs + 1] = a
    end
    i = i + 1
  end
  return cfg, inputs
end

return M
