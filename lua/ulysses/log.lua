-- lua/ulysses/log.lua — training progress and logging: human-readable number formatting, a
-- per-step progress line (loss, throughput, FLOP/s, MFU, memory, ETA), crash-safe CSV / JSON
-- Lines writers and readers, and a dependency-free SVG line chart for loss curves.
-- Pure Lua: it does not load the C library (Progress uses uly.clock only when ulysses is loaded).
local json = require 'ulysses.json'

local log = {}

local floor, abs, huge = math.floor, math.abs, math.huge

local function is_finite(x) return type(x) == 'number' and x == x and x ~= huge and x ~= -huge end

local function log10(x) return math.log(x) / math.log(10) end

-- raise unless `v` is a number (or nil when `optional`); `level` is the caller's level
local function check_number(v, what, level, optional)
  if v == nil and optional then return end
  if type(v) ~= 'number' then
    error(string.format('%s must be a number, got %s', what, type(v)), level + 1)
  end
end

---------------------------------------------------------------------------------------------
-- Formatting
---------------------------------------------------------------------------------------------

-- a positive value in [1, 1000) with three significant digits: 1.23, 12.3, 123
local function three_digits(v)
  if v >= 99.95 then return string.format('%.0f', v)
  elseif v >= 9.995 then return string.format('%.1f', v)
  else return string.format('%.2f', v) end
end

local function non_finite(x)
  if x ~= x then return 'nan' end
  return x > 0 and 'inf' or '-inf'
end

local SI_PREFIX = { [-5] = 'f', [-4] = 'p', [-3] = 'n', [-2] = 'µ', [-1] = 'm', [0] = '',
                    'k', 'M', 'G', 'T', 'P', 'E', 'Z', 'Y' }

-- "1.23 k", "215 GFLOP/s", "512 tok" (integers below 1000 print exactly); the unit follows the prefix
function log.format_si(x, unit)
  check_number(x, 'format_si: x', 2)
  unit = unit or ''
  local function join(num, prefix)
    local suffix = prefix .. unit
    return suffix == '' and num or num .. ' ' .. suffix
  end
  if not is_finite(x) then return join(non_finite(x), '') end
  if x == 0 then return join('0', '') end
  local sign, a = x < 0 and '-' or '', abs(x)
  if a >= 1 and a < 1000 and a == floor(a) then return join(sign .. string.format('%d', a), '') end
  local e = floor(log10(a) / 3 + 1e-12)
  if e < -5 or e > 8 then return join(sign .. string.format('%.2e', a), '') end
  local s = three_digits(a / 1000 ^ e)
  if tonumber(s) >= 1000 and e < 8 then
    e = e + 1
    s = three_digits(a / 1000 ^ e)
  end
  return join(sign .. s, SI_PREFIX[e])
end

local BIN_UNITS = { [0] = 'B', 'KiB', 'MiB', 'GiB', 'TiB', 'PiB', 'EiB' }

-- "512 B", "1.5 GiB", "412 MiB": binary prefixes, up to three significant digits
function log.format_bytes(n)
  check_number(n, 'format_bytes: n', 2)
  if not is_finite(n) then return non_finite(n) .. ' B' end
  local sign, a = n < 0 and '-' or '', abs(n)
  if a < 1024 then return sign .. string.format('%.0f B', a) end
  local e = math.min(floor(math.log(a) / math.log(1024) + 1e-12), 6)
  local s = three_digits(a / 1024 ^ e)
  if tonumber(s) >= 1024 and e < 6 then
    e = e + 1
    s = three_digits(a / 1024 ^ e)
  end
  if s:find('.', 1, true) then s = s:gsub('0+$', ''):gsub('%.$', '') end
  return sign .. s .. ' ' .. BIN_UNITS[e]
end

-- "0.35 s", "4.2 s", "42 s", "3 m 05 s", "1 h 02 m", "2 d 03 h"
function log.format_duration(seconds)
  check_number(seconds, 'format_duration: seconds', 2)
  local s = seconds
  if not is_finite(s) then return non_finite(s) .. ' s' end
  if s < 0 then return '-' .. log.format_duration(-s) end
  if s == 0 then return '0 s' end
  if s < 9.95 then return string.format(s < 0.995 and '%.2f s' or '%.1f s', s) end
  local r = floor(s + 0.5)
  if r < 60 then return string.format('%d s', r) end
  if r < 3600 then return string.format('%d m %02d s', floor(r / 60), r % 60) end
  local m = floor(s / 60 + 0.5)
  if m < 24 * 60 then return string.format('%d h %02d m', floor(m / 60), m % 60) end
  local h = floor(s / 3600 + 0.5)
  return string.format('%d d %02d h', floor(h / 24), h % 24)
end

---------------------------------------------------------------------------------------------
-- Progress: one line per step (rate-limited), eval lines and a final summary
---------------------------------------------------------------------------------------------

local Progress = {}
Progress.__index = Progress

-- the wall clock: uly.clock when the C library is loaded, else Lua's CPU clock
local function default_clock()
  local uly = package.loaded.ulysses
  if type(uly) == 'table' and type(rawget(uly, 'clock')) == 'function' then return uly.clock end
  return os.clock
end

-- a number, or a tensor-like object with :item() (a scalar loss tensor)
local function scalar(v, what)
  if v == nil or type(v) == 'number' then return v end
  if type(v) == 'table' and type(v.item) == 'function' then return v:item() end
  error(string.format('Progress: %s must be a number or a scalar tensor, got %s', what, type(v)), 3)
end

-- log.Progress{ total_steps, tokens_per_step, flops_per_token, peak_flops, peak_label,
--               every = seconds between lines (0: every step), out = io.stdout, rank = 0,
--               window = steps in the smoothed rate (20), clock = function() -> seconds }
function log.Progress(opts)
  opts = opts or {}
  if type(opts) ~= 'table' then error('Progress: expected an options table', 2) end
  for _, k in ipairs { 'total_steps', 'tokens_per_step', 'flops_per_token', 'peak_flops', 'every',
                       'rank', 'window' } do
    check_number(opts[k], 'Progress: ' .. k, 2, true)
  end
  local out = opts.out or io.stdout
  if type(out.write) ~= 'function' then error('Progress: out must have a :write method (a file)', 2) end
  local window = opts.window or 20
  if window < 1 then error('Progress: window must be >= 1 step, got ' .. window, 2) end
  local p = setmetatable({
    total_steps = opts.total_steps, tokens_per_step = opts.tokens_per_step,
    flops_per_token = opts.flops_per_token, peak_flops = opts.peak_flops, peak_label = opts.peak_label,
    every = opts.every or 0, out = out, rank = opts.rank or 0, window = floor(window),
    clock = opts.clock or default_clock(),
    steps = 0, seconds = 0, first_dt = nil, recent = {}, last_print = nil, last_step = nil,
    best_val = nil, best_val_step = nil, best_bpt = nil,
  }, Progress)
  p.last_time = p.clock()
  return p
end

function Progress:_emit(line)
  if self.rank ~= 0 then return end
  self.out:write(line, '\n')
  if self.out.flush then self.out:flush() end
end

-- mean step time over the recent window; the first step (warm-up) only counts while it is alone
function Progress:smoothed_dt()
  local r = self.recent
  if #r == 0 then return self.first_dt end
  local s = 0
  for i = 1, #r do s = s + r[i] end
  return s / #r
end

-- tokens/s, FLOP/s and MFU from the smoothed step time (nil where the inputs are missing)
function Progress:rates()
  local dt = self:smoothed_dt()
  if not dt or dt <= 0 or not self.tokens_per_step then return nil end
  local tps = self.tokens_per_step / dt
  local fps = self.flops_per_token and tps * self.flops_per_token
  local mfu = fps and self.peak_flops and self.peak_flops > 0 and fps / self.peak_flops
  return tps, fps or nil, mfu or nil
end

function Progress:_step_label(step)
  if self.total_steps then
    local w = #string.format('%d', self.total_steps)
    return string.format('step %' .. w .. 'd/%d', step, self.total_steps)
  end
  return string.format('step %d', step)
end

local function format_mfu(m)
  return string.format(m >= 0.01 and 'MFU %.1f%%' or 'MFU %.2f%%', 100 * m)
end

-- the fields of `extra`: comm_bytes/comm_time get a unit and a share of the step; others as is
local function format_extra(extra, dt)
  local parts, seen = {}, { comm_bytes = true, comm_time = true }
  if extra.comm_bytes or extra.comm_time then
    local s = 'comm'
    if extra.comm_bytes then s = s .. ' ' .. log.format_bytes(extra.comm_bytes) end
    if extra.comm_time then
      s = s .. ' in ' .. log.format_duration(extra.comm_time)
      if dt and dt > 0 then s = s .. string.format(' (%.0f%%)', 100 * extra.comm_time / dt) end
    end
    parts[#parts + 1] = s
  end
  local keys = {}
  for k in pairs(extra) do if not seen[k] then keys[#keys + 1] = tostring(k) end end
  table.sort(keys)
  for _, k in ipairs(keys) do
    local v = extra[k]
    parts[#parts + 1] = k .. ' ' .. (type(v) == 'number' and string.format('%.4g', v) or tostring(v))
  end
  return parts
end

-- p:step{ step = i, loss = l, lr = lr, dt = seconds of this step, memory = bytes, extra = {...} }
-- dt defaults to the clock time since the previous call. Prints at most one line per `every`
-- seconds, always on the first step and on step == total_steps. Returns true when it printed.
function Progress:step(s)
  if type(s) ~= 'table' then error('Progress:step expects a table {step=, loss=, dt=, ...}', 2) end
  local now = self.clock()
  local dt = s.dt
  check_number(dt, 'Progress:step dt', 2, true)
  check_number(s.step, 'Progress:step step', 2, true)
  check_number(s.lr, 'Progress:step lr', 2, true)
  check_number(s.memory, 'Progress:step memory', 2, true)
  if dt == nil then dt = now - self.last_time end
  if dt < 0 then error('Progress:step dt must be >= 0 seconds, got ' .. dt, 2) end
  self.last_time = now
  local loss = scalar(s.loss, 'loss')
  self.steps = self.steps + 1
  local step = s.step or ((self.last_step or 0) + 1)
  self.last_step = step
  self.seconds = self.seconds + dt
  if self.steps == 1 then self.first_dt = dt
  else
    local r = self.recent
    r[#r + 1] = dt
    if #r > self.window then table.remove(r, 1) end
  end

  local last = self.total_steps ~= nil and step >= self.total_steps
  local due = self.last_print == nil or last or self.every <= 0 or now - self.last_print >= self.every
  if not due or self.rank ~= 0 then return false end
  self.last_print = now

  local parts = { self:_step_label(step) }
  if loss then parts[#parts + 1] = string.format('loss %.4f', loss) end
  if s.lr then parts[#parts + 1] = string.format('lr %.2e', s.lr) end
  local tps, fps, mfu = self:rates()
  if tps then parts[#parts + 1] = log.format_si(tps) .. ' tok/s' end
  if fps then parts[#parts + 1] = log.format_si(fps, 'FLOP/s') end
  if mfu then parts[#parts + 1] = format_mfu(mfu) end
  if s.memory then parts[#parts + 1] = 'mem ' .. log.format_bytes(s.memory) end
  if s.extra then
    for _, e in ipairs(format_extra(s.extra, dt)) do parts[#parts + 1] = e end
  end
  if self.total_steps then
    if last then parts[#parts + 1] = 'done in ' .. log.format_duration(self.seconds)
    else parts[#parts + 1] = 'ETA ' .. log.format_duration((self.total_steps - step) * self:smoothed_dt()) end
  end
  self:_emit(table.concat(parts, ' | '))
  return true
end

-- p:eval{ step = i, loss = l, bpt = bits per token }: a validation line (never rate-limited)
function Progress:eval(e)
  if type(e) ~= 'table' then error('Progress:eval expects a table {step=, loss=, bpt=}', 2) end
  local loss = scalar(e.loss, 'loss')
  check_number(e.bpt, 'Progress:eval bpt', 2, true)
  check_number(e.step, 'Progress:eval step', 2, true)
  local step = e.step or self.last_step or 0
  if loss and (self.best_val == nil or loss < self.best_val) then
    self.best_val, self.best_val_step, self.best_bpt = loss, step, e.bpt
  end
  local parts = { 'eval ' .. self:_step_label(step) }
  if loss then parts[#parts + 1] = string.format('val loss %.4f', loss) end
  if e.bpt then parts[#parts + 1] = string.format('%.4f bits/token', e.bpt) end
  if self.best_val then parts[#parts + 1] = string.format('best %.4f @ %d', self.best_val, self.best_val_step) end
  self:_emit(table.concat(parts, ' | '))
end

-- totals and steady-state rates (the first step excluded when there are later ones); prints a block
function Progress:summary()
  local r = { steps = self.steps, seconds = self.seconds, best_val = self.best_val,
              best_val_step = self.best_val_step, best_bpt = self.best_bpt }
  local tps = self.tokens_per_step
  if tps then
    r.tokens = self.steps * tps
    local n, t = self.steps, self.seconds
    if n > 1 then n, t = n - 1, t - self.first_dt end
    if n > 0 and t > 0 then r.tokens_per_s = n * tps / t end
  end
  if r.tokens_per_s and self.flops_per_token then r.flops_per_s = r.tokens_per_s * self.flops_per_token end
  if r.flops_per_s and self.peak_flops and self.peak_flops > 0 then r.mfu = r.flops_per_s / self.peak_flops end

  local lines = { '--- summary ---' }
  local done = string.format('%d steps', r.steps)
  if r.tokens then done = done .. ', ' .. log.format_si(r.tokens) .. ' tokens' end
  lines[#lines + 1] = done .. ' in ' .. log.format_duration(r.seconds)
  if r.tokens_per_s then
    local s = 'throughput ' .. log.format_si(r.tokens_per_s) .. ' tok/s'
    if r.flops_per_s then s = s .. ', ' .. log.format_si(r.flops_per_s, 'FLOP/s') end
    if r.mfu then
      s = s .. ', ' .. format_mfu(r.mfu) .. ' of ' .. log.format_si(self.peak_flops, 'FLOP/s')
      if self.peak_label then s = s .. ' (' .. self.peak_label .. ')' end
    end
    if self.steps > 1 then s = s .. '; first step excluded' end
    lines[#lines + 1] = s
  end
  if r.best_val then
    local s = string.format('best val loss %.4f at step %d', r.best_val, r.best_val_step)
    if r.best_bpt then s = s .. string.format(' (%.4f bits/token)', r.best_bpt) end
    lines[#lines + 1] = s
  end
  for _, l in ipairs(lines) do self:_emit(l) end
  return r
end

log.ProgressClass = Progress

---------------------------------------------------------------------------------------------
-- CSV and JSON Lines: writers (flushed after every record) and readers
---------------------------------------------------------------------------------------------

local function format_number(x)
  if x ~= x then return 'nan' end
  if x == huge then return 'inf' elseif x == -huge then return '-inf' end
  if x == floor(x) and abs(x) < 2 ^ 53 then return string.format('%.0f', x) end
  return string.format('%.6g', x)
end

local NON_FINITE_WORDS = { nan = 0 / 0, inf = huge, ['-inf'] = -huge, ['+inf'] = huge }

local function csv_cell(v, key)
  local t = type(v)
  if v == nil then return '' end
  if t == 'number' then return format_number(v) end
  if t == 'boolean' then return tostring(v) end
  if t ~= 'string' then
    error(string.format("Writer: CSV column '%s' holds a %s; only numbers, strings and booleans fit a cell",
                        key, t), 3)
  end
  -- quote anything a reader would split or read back as a number / missing value
  if v == '' or v:find('[,"\r\n]') or v:find('^%s') or v:find('%s$') or tonumber(v) or
     NON_FINITE_WORDS[v:lower()] or v == 'true' or v == 'false' then
    return '"' .. v:gsub('"', '""') .. '"'
  end
  return v
end

local json_string = json.string

local function json_value(v, depth)
  local t = type(v)
  if t == 'number' then return is_finite(v) and format_number(v) or 'null' end
  if t == 'string' then return json_string(v) end
  if t == 'boolean' then return tostring(v) end
  if v == nil then return 'null' end
  if t ~= 'table' then error('Writer: cannot encode a ' .. t .. ' as JSON', 3 + depth) end
  if depth > 32 then error('Writer: table nested too deeply (a cycle?)', 3 + depth) end
  local n = #v
  if n > 0 or next(v) == nil then
    local items = {}
    for i = 1, n do items[i] = json_value(v[i], depth + 1) end
    return '[' .. table.concat(items, ',') .. ']'
  end
  local keys = {}
  for k in pairs(v) do keys[#keys + 1] = tostring(k) end
  table.sort(keys)
  local items = {}
  for i, k in ipairs(keys) do
    local val = v[k]
    if val == nil then val = v[tonumber(k)] end
    items[i] = json_string(k) .. ':' .. json_value(val, depth + 1)
  end
  return '{' .. table.concat(items, ',') .. '}'
end

-- the `fields` present in `rec` first (in order), then its other keys sorted
local function ordered_keys(rec, fields)
  local keys, seen = {}, {}
  for _, k in ipairs(fields or {}) do
    seen[k] = true
    keys[#keys + 1] = k
  end
  local rest = {}
  for k in pairs(rec) do
    if type(k) ~= 'string' then error('Writer: record keys must be strings, got a ' .. type(k), 3) end
    if not seen[k] then rest[#rest + 1] = k end
  end
  table.sort(rest)
  for _, k in ipairs(rest) do keys[#keys + 1] = k end
  return keys
end

-- RFC 4180 rows: a list of rows, each a list of {text, quoted}
local function parse_csv(text, where)
  local rows, row, i, n, line = {}, {}, 1, #text, 1
  while i <= n do
    if text:sub(i, i) == '"' then
      local buf, j = {}, i + 1
      while true do
        local q = text:find('"', j, true)
        if not q then error(string.format('%s: unterminated quoted field starting on line %d', where, line), 3) end
        buf[#buf + 1] = text:sub(j, q - 1)
        if text:sub(q + 1, q + 1) == '"' then
          buf[#buf + 1] = '"'
          j = q + 2
        else
          j = q + 1
          break
        end
      end
      local cell = table.concat(buf)
      local _, nl = cell:gsub('\n', '')
      line = line + nl
      row[#row + 1] = { cell, true }
      i = j
    else
      local e = text:find('[,\r\n]', i) or n + 1
      row[#row + 1] = { text:sub(i, e - 1), false }
      i = e
    end
    local d = text:sub(i, i)
    if d == ',' then
      i = i + 1
      if i > n then row[#row + 1] = { '', false } end
    elseif d == '\r' or d == '\n' then
      rows[#rows + 1] = row
      row = {}
      line = line + 1
      i = (d == '\r' and text:sub(i + 1, i + 1) == '\n') and i + 2 or i + 1
    elseif d ~= '' then
      error(string.format("%s: line %d: unexpected '%s' after a quoted field (quotes inside a field are doubled)",
                          where, line, d), 3)
    end
  end
  if #row > 0 then rows[#rows + 1] = row end
  return rows
end

local function csv_value(cell)
  local s, quoted = cell[1], cell[2]
  if quoted then return s end
  if s == '' then return nil end
  local x = tonumber(s)
  if x then return x end
  local w = NON_FINITE_WORDS[s:lower()]
  if w then return w end
  if s == 'true' then return true elseif s == 'false' then return false end
  return s
end

local function read_all(path, what)
  local f, err = io.open(path, 'rb')
  if not f then error(string.format('%s: cannot open %s (%s)', what, path, err), 3) end
  local text = f:read('*a')
  f:close()
  return text
end

-- log.read_csv(path) -> records (header names as keys; numbers, nan/inf, booleans converted;
-- quoted cells stay strings, empty cells are missing), header (list of column names)
function log.read_csv(path)
  local where = 'read_csv ' .. tostring(path)
  local rows = parse_csv(read_all(path, 'read_csv'), where)
  local header, records = {}, {}
  if #rows == 0 then return records, header end
  for i, c in ipairs(rows[1]) do header[i] = c[1] end
  for r = 2, #rows do
    local row = rows[r]
    if not (#row == 1 and row[1][1] == '' and not row[1][2]) then   -- skip blank lines
      if #row > #header then
        error(string.format('%s: record %d has %d cells but the header names %d columns', where, r - 1, #row,
                            #header), 2)
      end
      local rec = {}
      for i, c in ipairs(row) do rec[header[i]] = csv_value(c) end
      records[#records + 1] = rec
    end
  end
  return records, header
end

-- log.read_jsonl(path) -> list of records, one per non-empty line (null values are missing)
function log.read_jsonl(path)
  local records, lineno = {}, 0
  for line in (read_all(path, 'read_jsonl') .. '\n'):gmatch('([^\n]*)\n') do
    lineno = lineno + 1
    if line:find('%S') then
      local v, err = json.decode(line)
      if err then error(string.format('read_jsonl %s line %d: %s', path, lineno, err), 2) end
      records[#records + 1] = v
    end
  end
  return records
end

local Writer = {}
Writer.__index = Writer

local EXT_FORMAT = { csv = 'csv', jsonl = 'jsonl', ndjson = 'jsonl', json = 'jsonl' }

-- log.Writer(path, { format = 'csv'|'jsonl' (default from the extension), fields = {...} (column
-- order), append = false (true: keep an existing file; a CSV's header is read back from it) })
function log.Writer(path, opts)
  opts = opts or {}
  if type(path) ~= 'string' then error('Writer: path must be a string', 2) end
  local fmt = opts.format or EXT_FORMAT[(path:match('%.([%w]+)$') or ''):lower()]
  if fmt ~= 'csv' and fmt ~= 'jsonl' then
    error(string.format("Writer %s: format must be 'csv' or 'jsonl' (got %s); pass {format = ...} or use a "
                        .. ".csv / .jsonl name", path, tostring(opts.format or 'no known extension')), 2)
  end
  local header
  if opts.append and fmt == 'csv' then
    local f = io.open(path, 'rb')
    if f then
      local first = f:read('*l')
      f:close()
      if first and first ~= '' then
        header = {}
        for i, c in ipairs(parse_csv(first, 'Writer ' .. path)[1]) do header[i] = c[1] end
      end
    end
  end
  local f, err = io.open(path, opts.append and 'ab' or 'wb')
  if not f then error(string.format('Writer: cannot open %s for writing (%s)', path, err), 2) end
  return setmetatable({ path = path, format = fmt, fields = opts.fields, header = header, file = f }, Writer)
end

-- append one record (a table of string keys -> number/string/boolean) and flush it to disk
function Writer:write(rec)
  if not self.file then error('Writer ' .. self.path .. ': write after close', 2) end
  if type(rec) ~= 'table' then error('Writer:write expects a record table, got ' .. type(rec), 2) end
  local line
  if self.format == 'csv' then
    local parts = {}
    if not self.header then
      self.header = ordered_keys(rec, self.fields)
      for i, k in ipairs(self.header) do parts[i] = csv_cell(k, k) end
      self.file:write(table.concat(parts, ','), '\n')
      parts = {}
    end
    local known = {}
    for _, k in ipairs(self.header) do known[k] = true end
    for k in pairs(rec) do
      if not known[k] then
        error(string.format("Writer %s: column '%s' is not in the CSV header (%s); list every column in "
                            .. "{fields = ...} or write it in the first record", self.path, tostring(k),
                            table.concat(self.header, ',')), 2)
      end
    end
    for i, k in ipairs(self.header) do parts[i] = csv_cell(rec[k], k) end
    line = table.concat(parts, ',')
  else
    local parts = {}
    for _, k in ipairs(ordered_keys(rec, self.fields)) do
      if rec[k] ~= nil then parts[#parts + 1] = json_string(k) .. ':' .. json_value(rec[k], 0) end
    end
    line = '{' .. table.concat(parts, ',') .. '}'
  end
  self.file:write(line, '\n')
  self.file:flush()
end

function Writer:close()
  if self.file then
    self.file:close()
    self.file = nil
  end
end

log.WriterClass = Writer

---------------------------------------------------------------------------------------------
-- SVG line charts
---------------------------------------------------------------------------------------------

local COLORS = { '#1f77b4', '#d62728', '#2ca02c', '#ff7f0e', '#9467bd', '#8c564b', '#e377c2', '#17becf' }

local function xml_escape(s)
  return (tostring(s):gsub('[&<>"]', { ['&'] = '&amp;', ['<'] = '&lt;', ['>'] = '&gt;', ['"'] = '&quot;' }))
end

-- a 1, 2 or 5 times a power of ten, the smallest such >= range / target
local function nice_step(range, target)
  local raw = range / target
  local mag = 10 ^ floor(log10(raw))
  local f = raw / mag
  local m = f <= 1 + 1e-9 and 1 or f <= 2 + 1e-9 and 2 or f <= 5 + 1e-9 and 5 or 10
  return m * mag
end

-- multiples of a nice step inside [lo, hi]; labels with just enough decimals
local function linear_ticks(lo, hi)
  local step = nice_step(hi - lo, 5)
  local ticks = {}
  local maxabs = math.max(abs(lo), abs(hi))
  local dec = math.max(0, 0 - floor(log10(step) + 1e-9))  -- 0 - x: never -0
  local use_g = maxabs >= 1e6 or step < 1e-4
  local digits = math.max(1, floor(log10(maxabs) + 1e-9) - floor(log10(step) + 1e-9) + 1)
  for k = math.ceil(lo / step - 1e-9), floor(hi / step + 1e-9) do
    local v = k * step
    local label = use_g and string.format('%.' .. digits .. 'g', v) or string.format('%.' .. dec .. 'f', v)
    if tonumber(label) == 0 then label = '0' end
    ticks[#ticks + 1] = { v = v, label = label }
  end
  return ticks
end

-- ticks for a log10 axis (lo, hi are log10 of the values): decades, or 1-2-5 within few decades
local function log_ticks(lo, hi)
  local ticks = {}
  local k0, k1 = math.ceil(lo - 1e-9), floor(hi + 1e-9)
  if k1 - k0 >= 1 then
    local stride = math.max(1, math.ceil((k1 - k0 + 1) / 8))
    for k = k0, k1, stride do ticks[#ticks + 1] = { v = k, label = string.format('%g', 10 ^ k) } end
    return ticks
  end
  for _, mantissas in ipairs { { 1, 2, 5 }, { 1, 2, 3, 4, 5, 6, 7, 8, 9 } } do
    ticks = {}
    for k = floor(lo) - 1, math.ceil(hi) do
      for _, m in ipairs(mantissas) do
        local v = log10(m) + k
        if v >= lo - 1e-9 and v <= hi + 1e-9 then
          ticks[#ticks + 1] = { v = v, label = string.format('%g', m * 10 ^ k) }
        end
      end
    end
    if #ticks >= 3 then return ticks end
  end
  if #ticks >= 2 then return ticks end
  ticks = {}
  for _, t in ipairs(linear_ticks(10 ^ lo, 10 ^ hi)) do
    if t.v > 0 then ticks[#ticks + 1] = { v = log10(t.v), label = t.label } end
  end
  return ticks
end

-- [lo, hi] widened when empty or degenerate
local function widen(lo, hi)
  if lo == nil then return 0, 1 end
  if hi - lo > 1e-12 * math.max(abs(lo), abs(hi)) then return lo, hi end
  local d = lo == 0 and 1 or abs(lo) * 0.1
  return lo - d, hi + d
end

-- the finite points of each series (y as log10 when logy), and the data ranges
local function collect(series, opts)
  local data, xlo, xhi, ylo, yhi = {}, nil, nil, nil, nil
  local function grow_y(y)
    ylo, yhi = math.min(ylo or y, y), math.max(yhi or y, y)
  end
  for i, s in ipairs(series) do
    if type(s) ~= 'table' or type(s.y) ~= 'table' then
      error(string.format('plot_svg: series %d must be a table {name=, x={...}, y={...}}', i), 3)
    end
    local n = #s.y
    if s.x ~= nil and (type(s.x) ~= 'table' or #s.x ~= n) then
      error(string.format("plot_svg: series %d ('%s'): x has %s values but y has %d", i, tostring(s.name),
                          type(s.x) == 'table' and #s.x or type(s.x), n), 3)
    end
    local pts = {}
    for j = 1, n do
      local x, y = s.x and s.x[j] or j, s.y[j]
      if opts.logy and is_finite(y) then y = y > 0 and log10(y) or nil end
      if is_finite(x) and is_finite(y) then
        pts[#pts + 1] = { x, y }
        xlo, xhi = math.min(xlo or x, x), math.max(xhi or x, x)
        grow_y(y)
      end
    end
    data[i] = { name = s.name or ('series ' .. i), color = s.color or COLORS[(i - 1) % #COLORS + 1], pts = pts }
  end
  local hlines = {}
  for _, h in ipairs(opts.hlines or {}) do
    local y = h.y
    if opts.logy and is_finite(y) then y = y > 0 and log10(y) or nil end
    if is_finite(y) then
      hlines[#hlines + 1] = { y = y, label = h.label }
      grow_y(y)
    end
  end
  return data, hlines, xlo, xhi, ylo, yhi
end

local function fmt(x) return string.format('%.2f', x) end

-- log.plot_svg(path, series, opts): a line chart; series = { {name=, x={...}, y={...}}, ... },
-- opts = { title, xlabel, ylabel, hlines = { {y=, label=} }, width = 720, height = 420, logy }.
-- Non-finite points (and y <= 0 with logy) are skipped. Written atomically (tmp + rename).
function log.plot_svg(path, series, opts)
  if type(path) ~= 'string' then error('plot_svg: path must be a string', 2) end
  if type(series) ~= 'table' then error('plot_svg: series must be a list of {name=, x=, y=} tables', 2) end
  opts = opts or {}
  local W, H = opts.width or 720, opts.height or 420
  local ml, mr, mt, mb = 72, 24, opts.title and 40 or 20, opts.xlabel and 56 or 36
  local pw, ph = W - ml - mr, H - mt - mb
  if pw < 20 or ph < 20 then error(string.format('plot_svg: %dx%d is too small for a chart', W, H), 2) end

  local data, hlines, xlo, xhi, ylo, yhi = collect(series, opts)
  xlo, xhi = widen(xlo, xhi)
  ylo, yhi = widen(ylo, yhi)
  local xt = linear_ticks(xlo, xhi)
  local yt = opts.logy and log_ticks(ylo, yhi) or linear_ticks(ylo, yhi)
  local pad = 0.04 * (yhi - ylo)
  local y0, y1 = ylo - pad, yhi + pad
  local function X(x) return ml + (x - xlo) / (xhi - xlo) * pw end
  local function Y(y) return mt + ph - (y - y0) / (y1 - y0) * ph end

  local o = {}
  local function add(...) o[#o + 1] = table.concat({ ... }) end
  add('<?xml version="1.0" encoding="UTF-8"?>')
  add('<svg xmlns="http://www.w3.org/2000/svg" width="', W, '" height="', H, '" viewBox="0 0 ', W, ' ', H,
      '" font-family="sans-serif" font-size="12">')
  add('<rect width="', W, '" height="', H, '" fill="white"/>')
  if opts.title then
    add('<text class="title" x="', fmt(W / 2), '" y="24" text-anchor="middle" font-size="15">',
        xml_escape(opts.title), '</text>')
  end
  add('<g stroke="#e4e4e4" stroke-width="1">')
  for _, t in ipairs(xt) do
    add('<line x1="', fmt(X(t.v)), '" y1="', mt, '" x2="', fmt(X(t.v)), '" y2="', mt + ph, '"/>')
  end
  for _, t in ipairs(yt) do
    add('<line x1="', ml, '" y1="', fmt(Y(t.v)), '" x2="', ml + pw, '" y2="', fmt(Y(t.v)), '"/>')
  end
  add('</g>')
  for _, t in ipairs(xt) do
    add('<text class="xtick" x="', fmt(X(t.v)), '" y="', mt + ph + 16, '" text-anchor="middle">', t.label, '</text>')
  end
  for _, t in ipairs(yt) do
    add('<text class="ytick" x="', ml - 6, '" y="', fmt(Y(t.v) + 4), '" text-anchor="end">', t.label, '</text>')
  end
  add('<rect x="', ml, '" y="', mt, '" width="', pw, '" height="', ph, '" fill="none" stroke="#333"/>')
  if opts.xlabel then
    add('<text class="xlabel" x="', fmt(ml + pw / 2), '" y="', H - 14, '" text-anchor="middle">',
        xml_escape(opts.xlabel), '</text>')
  end
  if opts.ylabel then
    add('<text class="ylabel" x="16" y="', fmt(mt + ph / 2), '" text-anchor="middle" transform="rotate(-90 16 ',
        fmt(mt + ph / 2), ')">', xml_escape(opts.ylabel), '</text>')
  end
  for _, h in ipairs(hlines) do
    add('<line class="hline" x1="', ml, '" y1="', fmt(Y(h.y)), '" x2="', ml + pw, '" y2="', fmt(Y(h.y)),
        '" stroke="#777" stroke-dasharray="6 4"/>')
    if h.label then
      add('<text class="hline-label" x="', ml + pw - 4, '" y="', fmt(Y(h.y) - 4), '" text-anchor="end" fill="#555">',
          xml_escape(h.label), '</text>')
    end
  end
  for _, d in ipairs(data) do
    if #d.pts > 0 then
      local p = {}
      for j, pt in ipairs(d.pts) do p[j] = fmt(X(pt[1])) .. ',' .. fmt(Y(pt[2])) end
      add('<polyline class="series" fill="none" stroke="', d.color, '" stroke-width="1.6" points="',
          table.concat(p, ' '), '"/>')
      if #d.pts == 1 then
        add('<circle cx="', fmt(X(d.pts[1][1])), '" cy="', fmt(Y(d.pts[1][2])), '" r="3" fill="', d.color, '"/>')
      end
    end
  end
  if #data > 0 then
    local lx, ly = ml + pw - 150, mt + 8
    add('<g class="legend">')
    add('<rect x="', lx, '" y="', ly, '" width="142" height="', 18 * #data + 6,
        '" fill="white" fill-opacity="0.85" stroke="#bbb"/>')
    for i, d in ipairs(data) do
      local yy = ly + 18 * i - 3
      add('<line x1="', lx + 8, '" y1="', yy - 4, '" x2="', lx + 30, '" y2="', yy - 4, '" stroke="', d.color,
          '" stroke-width="2"/>')
      add('<text x="', lx + 36, '" y="', yy, '">', xml_escape(d.name), '</text>')
    end
    add('</g>')
  end
  local empty = true
  for _, d in ipairs(data) do if #d.pts > 0 then empty = false end end
  if empty then
    add('<text class="nodata" x="', fmt(ml + pw / 2), '" y="', fmt(mt + ph / 2), '" text-anchor="middle" fill="#999">',
        'no data</text>')
  end
  add('</svg>')

  local tmp = path .. '.tmp'
  local f, err = io.open(tmp, 'wb')
  if not f then error(string.format('plot_svg: cannot write %s (%s)', tmp, err), 2) end
  f:write(table.concat(o, '\n'), '\n')
  f:close()
  local ok, rerr = os.rename(tmp, path)
  if not ok then
    os.remove(tmp)
    error(string.format('plot_svg: cannot move %s to %s (%s)', tmp, path, rerr), 2)
  end
  return path
end

-- log.plot_csv(csv_path, svg_path, opts): the train log's loss and val_loss against step
-- (opts as plot_svg, plus x = 'step', y = {'loss', 'val_loss'}, names = {'train', 'valid'})
function log.plot_csv(csv_path, svg_path, opts)
  opts = opts or {}
  local records = log.read_csv(csv_path)
  local xcol = opts.x or 'step'
  local ycols = opts.y or { 'loss', 'val_loss' }
  local names = opts.names or { 'train', 'valid' }
  local series = {}
  for i, col in ipairs(ycols) do
    local s = { name = names[i] or col, x = {}, y = {} }
    for _, r in ipairs(records) do
      if type(r[xcol]) == 'number' and type(r[col]) == 'number' then
        s.x[#s.x + 1], s.y[#s.y + 1] = r[xcol], r[col]
      end
    end
    if #s.y > 0 then series[#series + 1] = s end
  end
  local o = {}
  for k, v in pairs(opts) do o[k] = v end
  o.title = o.title or csv_path:match('[^/]*$')
  o.xlabel = o.xlabel or xcol
  o.ylabel = o.ylabel or 'loss'
  return log.plot_svg(svg_path, series, o)
end

return log
