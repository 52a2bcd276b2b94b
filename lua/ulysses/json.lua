-- lua/ulysses/json.lua — JSON for uly.log (JSON Lines records) and uly.safetensors (headers):
--   json.decode(text) -> value, or nil and 'at character N: what is wrong'   (null decodes to nil)
--   json.string(s)    -> s as a JSON string literal (quotes, backslashes, control characters escaped)
-- The reader takes objects, arrays, strings (every escape; \u surrogate pairs become UTF-8),
-- numbers, true, false and null; it refuses a key that appears twice in an object, a raw control
-- character in a string, an unpaired surrogate and nesting deeper than json.MAX_DEPTH.
local bit = require 'bit'

local json = { MAX_DEPTH = 32 }

local ESCAPES = { ['"'] = '\\"', ['\\'] = '\\\\', ['\n'] = '\\n', ['\r'] = '\\r', ['\t'] = '\\t', ['\b'] = '\\b',
                  ['\f'] = '\\f' }
function json.string(s)
  return '"' .. s:gsub('[%c"\\]', function(c) return ESCAPES[c] or string.format('\\u%04x', c:byte()) end) .. '"'
end

local function utf8(cp)
  if cp < 0x80 then return string.char(cp) end
  if cp < 0x800 then return string.char(0xC0 + bit.rshift(cp, 6), 0x80 + bit.band(cp, 0x3F)) end
  if cp < 0x10000 then
    return string.char(0xE0 + bit.rshift(cp, 12), 0x80 + bit.band(bit.rshift(cp, 6), 0x3F), 0x80 + bit.band(cp, 0x3F))
  end
  return string.char(0xF0 + bit.rshift(cp, 18), 0x80 + bit.band(bit.rshift(cp, 12), 0x3F),
                     0x80 + bit.band(bit.rshift(cp, 6), 0x3F), 0x80 + bit.band(cp, 0x3F))
end

local UNESCAPE = { ['"'] = '"', ['\\'] = '\\', ['/'] = '/', b = '\b', f = '\f', n = '\n', r = '\r', t = '\t' }

-- s decoded, or nil and what is wrong ('at character N: what'); null decodes to nil (an array
-- keeps its place: [1, null, 3] gives {1, nil, 3})
function json.decode(s)
  local pos = 1
  local function fail(what) error({ json = string.format('at character %d: %s', pos, what) }) end
  local function skip() pos = s:find('[^ \t\r\n]', pos) or #s + 1 end
  local value
  local function str()
    pos = pos + 1
    local parts = {}
    while true do
      local stop = s:find('["\\%z\1-\31]', pos)   -- U+0000-001F must be escaped (DEL need not)
      if not stop then fail('unterminated string') end
      parts[#parts + 1] = s:sub(pos, stop - 1)
      local c = s:sub(stop, stop)
      if c == '"' then pos = stop + 1; return table.concat(parts) end
      if c ~= '\\' then pos = stop; fail('control character in a string') end
      local e = s:sub(stop + 1, stop + 1)
      local simple = UNESCAPE[e]
      if simple then parts[#parts + 1] = simple; pos = stop + 2
      elseif e == 'u' then
        local hex = s:match('^%x%x%x%x', stop + 2)
        if not hex then pos = stop; fail('bad \\u escape') end
        local cp = tonumber(hex, 16)
        pos = stop + 6
        if cp >= 0xD800 and cp < 0xDC00 then   -- a surrogate pair
          local lo = s:match('^\\u(%x%x%x%x)', pos)
          lo = lo and tonumber(lo, 16)
          if not lo or lo < 0xDC00 or lo > 0xDFFF then fail('unpaired surrogate in a \\u escape') end
          cp = 0x10000 + (cp - 0xD800) * 0x400 + (lo - 0xDC00)
          pos = pos + 6
        end
        parts[#parts + 1] = utf8(cp)
      else pos = stop; fail('bad escape \\' .. e) end
    end
  end
  function value(depth)
    if depth > json.MAX_DEPTH then fail('nested deeper than ' .. json.MAX_DEPTH) end
    skip()
    local c = s:sub(pos, pos)
    if c == '{' then
      local out = {}
      pos = pos + 1
      skip()
      if s:sub(pos, pos) == '}' then pos = pos + 1; return out end
      while true do
        skip()
        if s:sub(pos, pos) ~= '"' then fail('expected a string key') end
        local k = str()
        if out[k] ~= nil then fail('key "' .. k .. '" appears twice') end
        skip()
        if s:sub(pos, pos) ~= ':' then fail('expected ":"') end
        pos = pos + 1
        out[k] = value(depth + 1)
        skip()
        c = s:sub(pos, pos)
        pos = pos + 1
        if c == '}' then return out end
        if c ~= ',' then pos = pos - 1; fail('expected "," or "}"') end
      end
    elseif c == '[' then
      local out = {}
      pos = pos + 1
      skip()
      if s:sub(pos, pos) == ']' then pos = pos + 1; return out end
      local n = 0
      while true do
        n = n + 1
        out[n] = value(depth + 1)
        skip()
        c = s:sub(pos, pos)
        pos = pos + 1
        if c == ']' then return out end
        if c ~= ',' then pos = pos - 1; fail('expected "," or "]"') end
      end
    elseif c == '"' then return str()
    elseif s:find('^true', pos) then pos = pos + 4; return true
    elseif s:find('^false', pos) then pos = pos + 5; return false
    elseif s:find('^null', pos) then pos = pos + 4; return nil
    else
      local num = s:match('^-?%d+%.?%d*[eE]?[-+]?%d*', pos)
      if not num or num == '' or num == '-' then fail('unexpected ' .. (c == '' and 'end' or '"' .. c .. '"')) end
      pos = pos + #num
      return tonumber(num) or fail('bad number ' .. num)
    end
  end
  local ok, v = pcall(function()
    local out = value(1)
    skip()
    if pos <= #s then fail('text after the value') end
    return out
  end)
  if ok then return v end
  if type(v) == 'table' and v.json then return nil, v.json end
  error(v, 0)
end

return json
