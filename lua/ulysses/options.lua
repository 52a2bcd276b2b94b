-- lua/ulysses/options.lua — option tables checked by name: a misspelled key ({casual = true}) is an
-- error at the caller's line naming the key, the ones that exist and the nearest of them, instead
-- of a default taken silently.
--   options.check('uly.attention', opts, { 'causal', 'scale' })   -> opts (or {} for nil)
local M = {}

-- ulysses.tensor requires this file: reach its raise lazily
local function raise(msg) require('ulysses.tensor').raise(msg) end

-- edit distance (insertions, deletions, substitutions, and swaps of two neighbours)
local function distance(a, b)
  local d = {}
  for i = 0, #a do d[i] = { [0] = i } end
  for j = 0, #b do d[0][j] = j end
  for i = 1, #a do
    for j = 1, #b do
      local cost = a:sub(i, i) == b:sub(j, j) and 0 or 1
      local v = math.min(d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost)
      if i > 1 and j > 1 and a:sub(i, i) == b:sub(j - 1, j - 1) and a:sub(i - 1, i - 1) == b:sub(j, j) then
        v = math.min(v, d[i - 2][j - 2] + 1)
      end
      d[i][j] = v
    end
  end
  return d[#a][#b]
end

-- the allowed name nearest to `key` when it is close enough to be a typo, else nil
function M.nearest(key, allowed)
  local best, best_d
  for _, name in ipairs(allowed) do
    local d = distance(key, name)
    if not best_d or d < best_d then best, best_d = name, d end
  end
  if best_d and best_d <= math.max(1, math.floor(#key / 3)) then return best end
  return nil
end

-- the set of names of an `allowed` list, made once per list (the lists are constants of their
-- callers, some on per-step paths such as attention)
local sets = setmetatable({}, { __mode = 'k' })
local function set_of(allowed)
  local set = sets[allowed]
  if not set then
    set = {}
    for _, name in ipairs(allowed) do set[name] = true end
    sets[allowed] = set
  end
  return set
end

-- opts (a table or nil) must hold only the keys in `allowed` (a list of names)
function M.check(what, opts, allowed)
  if opts == nil then return {} end
  if type(opts) ~= 'table' then raise(string.format('%s: options must be a table, got %s', what, type(opts))) end
  local set = set_of(allowed)
  for k in pairs(opts) do
    if not set[k] then
      local names = {}
      for name in pairs(set) do names[#names + 1] = name end
      table.sort(names)
      local guess = type(k) == 'string' and M.nearest(k, allowed)
      raise(string.format("%s: unknown option '%s'%s (known: %s)", what, tostring(k),
                            guess and string.format(" (did you mean '%s'?)", guess) or '', table.concat(names, ', ')))
    end
  end
  return opts
end

return M
