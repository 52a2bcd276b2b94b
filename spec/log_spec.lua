-- spec/log_spec.lua — ulysses.log: number/size/duration formatting, the Progress line (fields,
-- smoothed rates, MFU, rate limiting, rank filtering, summary), crash-safe CSV / JSON Lines writers
-- and their readers, and the SVG chart (well-formed, right points, nice ticks, NaN skipped).
-- Pure Lua: time comes from a fake clock, output goes to a fake file; nothing depends on wall time.
local log = require 'ulysses.log'
local helpers = require 'helpers'

-- a fake file that records each line written
local function capture()
  local out = { text = '', flushes = 0 }
  function out:write(...)
    for _, s in ipairs { ... } do self.text = self.text .. s end
  end
  function out:flush() self.flushes = self.flushes + 1 end
  function out:lines()
    local l = {}
    for line in self.text:gmatch('([^\n]*)\n') do l[#l + 1] = line end
    return l
  end
  return out
end

local function fake_clock()
  local c = { t = 100 }
  return c, function() return c.t end
end

local function tmpfile(ext)
  local base = os.tmpname()
  os.remove(base)
  return base .. ext
end

local function slurp(path) return assert(helpers.read_file(path), 'cannot read ' .. path) end

local exists = helpers.exists

-- the number after `label` in a progress line, with its SI prefix applied
local SI = { [''] = 1, k = 1e3, M = 1e6, G = 1e9, T = 1e12 }
local function si_field(line, pattern)
  local num, prefix = line:match(pattern)
  assert(num, 'no match for ' .. pattern .. ' in: ' .. line)
  return tonumber(num) * SI[prefix]
end

local function near(a, b, rel) return math.abs(a - b) <= (rel or 1e-9) * math.max(math.abs(a), math.abs(b), 1e-300) end

describe('formatting', function()
  it('format_si gives three significant digits and an SI prefix, rolling over at 1000', function()
    local cases = {
      { 0, nil, '0' }, { 5, nil, '5' }, { 999, nil, '999' }, { 3.5, nil, '3.50' }, { 1234, nil, '1.23 k' },
      { 12400, nil, '12.4 k' }, { 215e9, 'FLOP/s', '215 GFLOP/s' }, { 96.14e9, 'FLOP/s', '96.1 GFLOP/s' },
      { 999.7, nil, '1.00 k' }, { 999.96e3, nil, '1.00 M' }, { 1000, 'B', '1.00 kB' }, { 0.0123, 's', '12.3 ms' },
      { -1500, nil, '-1.50 k' }, { 7, 'tok', '7 tok' }, { 1 / 0, nil, 'inf' }, { -1 / 0, 'B', '-inf B' },
      { 0 / 0, nil, 'nan' }, { 1e-20, nil, '1.00e-20' }, { 2.5e27, nil, '2.50e+27' },
    }
    for _, c in ipairs(cases) do
      assert.are.equal(c[3], log.format_si(c[1], c[2]), 'format_si(' .. tostring(c[1]) .. ')')
    end
    assert.has_error(function() log.format_si('12') end, 'format_si: x must be a number, got string')
  end)

  it('format_bytes uses binary prefixes and drops trailing zeros', function()
    local cases = {
      { 0, '0 B' }, { 1023, '1023 B' }, { 1024, '1 KiB' }, { 1536, '1.5 KiB' }, { 1.5 * 2 ^ 30, '1.5 GiB' },
      { 412 * 2 ^ 20, '412 MiB' }, { 2 ^ 20 - 1, '1 MiB' }, { 10.25 * 2 ^ 40, '10.3 TiB' }, { -2048, '-2 KiB' },
      { 0 / 0, 'nan B' },
    }
    for _, c in ipairs(cases) do assert.are.equal(c[2], log.format_bytes(c[1]), 'format_bytes(' .. c[1] .. ')') end
  end)

  it('format_duration rounds to the shown unit and pads the second field', function()
    local cases = {
      { 0, '0 s' }, { 0.3456, '0.35 s' }, { 4.23, '4.2 s' }, { 9.97, '10 s' }, { 42, '42 s' }, { 42.4, '42 s' },
      { 59.6, '1 m 00 s' }, { 185, '3 m 05 s' }, { 3599.6, '1 h 00 m' }, { 3720, '1 h 02 m' },
      { 90000, '1 d 01 h' }, { -5, '-5.0 s' }, { 1 / 0, 'inf s' },
    }
    for _, c in ipairs(cases) do
      assert.are.equal(c[2], log.format_duration(c[1]), 'format_duration(' .. c[1] .. ')')
    end
  end)
end)

describe('Progress', function()
  local T, F, P, TOTAL = 4096, 1e6, 32.768e9, 300

  local function progress(extra)
    local out, c = capture(), nil
    local clock
    c, clock = fake_clock()
    local opts = { total_steps = TOTAL, tokens_per_step = T, flops_per_token = F, peak_flops = P, out = out,
                   clock = clock, peak_label = 'test peak' }
    for k, v in pairs(extra or {}) do opts[k] = v end
    return log.Progress(opts), out, c
  end

  it('prints every field, with tok/s, FLOP/s and MFU from the smoothed step time', function()
    local p, out = progress()
    p:step { step = 1, loss = 2.34123, lr = 3e-4, dt = 2.0, memory = 412 * 2 ^ 20 }
    p:step { step = 2, loss = 2.2, lr = 3e-4, dt = 0.5, memory = 412 * 2 ^ 20,
             extra = { comm_bytes = 3 * 2 ^ 20, comm_time = 0.125 } }
    p:step { step = 3, loss = 2.1, lr = 2.5e-4, dt = 0.5 }
    local lines = out:lines()
    assert.are.equal(3, #lines)

    -- the first step alone: its own time (warm-up included)
    local l1 = lines[1]
    assert.truthy(l1:find('^step   1/300 | loss 2%.3412 | lr 3%.00e%-04 | '), l1)
    assert.truthy(near(si_field(l1, '([%d.]+) (%a?) tok/s'), T / 2.0, 1e-2), l1)
    assert.truthy(l1:find('mem 412 MiB', 1, true), l1)
    assert.truthy(l1:find('ETA ' .. log.format_duration(299 * 2.0), 1, true), l1)

    -- later steps: the warm-up step is excluded, so the rate is T / 0.5
    for i = 2, 3 do
      local l = lines[i]
      local tps = si_field(l, '([%d.]+) (%a?) tok/s')
      local fps = si_field(l, '([%d.]+) (%a?)FLOP/s')
      local mfu = tonumber(l:match('MFU ([%d.]+)%%'))
      assert.truthy(near(tps, T / 0.5, 5e-3), l)
      assert.truthy(near(fps, F * T / 0.5, 5e-3), l)
      assert.truthy(near(mfu, 100 * F * (T / 0.5) / P, 1e-3), l)  -- 25.0%
      assert.truthy(l:find('ETA ' .. log.format_duration((TOTAL - i) * 0.5), 1, true), l)
    end
    assert.truthy(lines[2]:find('comm 3 MiB in 0.13 s (25%)', 1, true), lines[2])
    assert.truthy(lines[3]:find('lr 2.50e-04', 1, true), lines[3])
    assert.falsy(lines[3]:find('mem', 1, true))
  end)

  it('smooths over a window of recent steps and takes dt from the clock when absent', function()
    local p, out, c = progress { window = 2 }
    for _, dt in ipairs { 3, 1, 0.25, 0.25 } do p:step { dt = dt } end
    assert.are.equal(0.25, p:smoothed_dt())
    c.t = c.t + 7
    p:step {}                                 -- dt = 7 from the clock
    assert.are.equal((0.25 + 7) / 2, p:smoothed_dt())
    local lines = out:lines()
    assert.are.equal(5, #lines)
    assert.truthy(lines[5]:find('^step   5/300'), lines[5])   -- steps counted when not given
  end)

  it('prints at most one line per `every` seconds, always the first and the last step', function()
    local p, out, c = progress { every = 10, total_steps = 25 }
    local printed = {}
    for i = 1, 25 do
      c.t = c.t + 1
      if p:step { step = i, loss = 1 / i, dt = 1 } then printed[#printed + 1] = i end
      if i == 7 then p:eval { step = i, loss = 0.9, bpt = 1.3 } end
    end
    assert.are.same({ 1, 11, 21, 25 }, printed)
    local lines = out:lines()
    assert.are.equal(5, #lines)
    assert.truthy(lines[2]:find('^eval step  7/25 | val loss 0%.9000 | 1%.3000 bits/token'), lines[2])
    assert.truthy(lines[5]:find('^step 25/25 | .* | done in 25 s$'), lines[5])
  end)

  it('is silent on ranks other than 0 but still counts', function()
    local p, out = progress { rank = 1 }
    p:step { step = 1, loss = 1, dt = 1 }
    p:eval { step = 1, loss = 2 }
    local r = p:summary()
    assert.are.equal('', out.text)
    assert.are.equal(1, r.steps)
    assert.are.equal(2, r.best_val)
  end)

  it('summarises steps, tokens, time, steady-state rates and the best validation loss', function()
    local p, out = progress()
    local dts = { 5, 0.5, 0.25, 0.25 }
    for i, dt in ipairs(dts) do p:step { step = i, loss = 3 - i / 10, dt = dt } end
    p:eval { step = 2, loss = 2.5, bpt = 3.6 }
    p:eval { step = 4, loss = 2.25, bpt = 3.2 }
    p:eval { step = 4, loss = { item = function() return 2.75 end } }   -- a scalar-tensor-like loss
    local before = #out:lines()
    local r = p:summary()
    assert.are.equal(4, r.steps)
    assert.are.equal(4 * T, r.tokens)
    assert.are.equal(6, r.seconds)
    assert.truthy(near(r.tokens_per_s, 3 * T / 1.0))
    assert.truthy(near(r.flops_per_s, 3 * T * F))
    assert.truthy(near(r.mfu, 3 * T * F / P))
    assert.are.equal(2.25, r.best_val)
    assert.are.equal(4, r.best_val_step)
    assert.are.equal(3.2, r.best_bpt)
    local block = table.concat(out:lines(), '\n', before + 1)
    assert.truthy(block:find('4 steps, 16.4 k tokens in 6.0 s', 1, true), block)
    assert.truthy(block:find('MFU 37.5% of 32.8 GFLOP/s (test peak)', 1, true), block)
    assert.truthy(block:find('best val loss 2.2500 at step 4', 1, true), block)
  end)

  it('rejects bad arguments at the caller', function()
    local p = progress()
    assert.has_error(function() p:step(3) end, 'Progress:step expects a table {step=, loss=, dt=, ...}')
    assert.has_error(function() p:step { dt = -1 } end, 'Progress:step dt must be >= 0 seconds, got -1')
    assert.has_error(function() p:step { loss = 'x' } end,
                     'Progress: loss must be a number or a scalar tensor, got string')
    assert.has_error(function() log.Progress { total_steps = '10' } end,
                     'Progress: total_steps must be a number, got string')
  end)
end)

describe('Writer and readers', function()
  local tricky = { 'a,b', 'say "hi"', 'line1\nline2', '', '  padded ', '123', 'nan', 'plain', 'tab\there',
                   'back\\slash', 'crlf\r\nend', 'ünïcode' }

  local function records()
    local recs = {}
    for i, s in ipairs(tricky) do
      recs[i] = { step = i, loss = 1 / (i + 2), note = s, ok = i % 2 == 0 }
    end
    recs[2].loss = 0 / 0
    recs[3].loss = 1 / 0
    recs[4].extra = 7          -- only in this record
    return recs
  end

  local function same_value(a, b)
    if type(a) == 'number' and type(b) == 'number' then
      if a ~= a then return b ~= b end
      return a == b or near(a, b, 1e-5)
    end
    return a == b
  end

  it('round-trips CSV with quoting, numbers and missing cells, complete after every write', function()
    local path = tmpfile('.csv')
    local recs = records()
    local w = log.Writer(path, { fields = { 'step', 'loss', 'extra' } })
    for i, r in ipairs(recs) do
      w:write(r)
      -- without closing: what is on disk already holds every record so far
      local back = log.read_csv(path)
      assert.are.equal(i, #back)
      assert.are.equal(r.note, back[i].note)
    end
    w:close()
    local back, header = log.read_csv(path)
    assert.are.same({ 'step', 'loss', 'extra', 'note', 'ok' }, header)
    assert.are.equal(#recs, #back)
    for i, r in ipairs(recs) do
      for _, k in ipairs(header) do
        assert.truthy(same_value(back[i][k], r[k]), string.format('record %d %s: %s vs %s', i, k,
                                                                  tostring(back[i][k]), tostring(r[k])))
      end
    end
    assert.are.equal('number', type(back[1].step))
    assert.are.equal('string', type(back[6].note))   -- '123' stays a string
    local text = slurp(path)
    assert.truthy(text:find('\n1,0.333333,,"a,b",false\n', 1, true), text)
    assert.truthy(text:find('"say ""hi"""', 1, true))
    os.remove(path)
  end)

  it('round-trips JSON Lines with escapes; non-finite numbers become null', function()
    local path = tmpfile('.jsonl')
    local recs = records()
    recs[5].nested = { 1, 2, { a = 'x' } }
    local w = log.Writer(path)
    for i, r in ipairs(recs) do
      w:write(r)
      local back = log.read_jsonl(path)
      assert.are.equal(i, #back)
    end
    w:close()
    local back = log.read_jsonl(path)
    for i, r in ipairs(recs) do
      for _, k in ipairs { 'step', 'note', 'ok', 'extra' } do
        assert.truthy(same_value(back[i][k], r[k]), string.format('record %d %s', i, k))
      end
      if i == 2 or i == 3 then assert.is_nil(back[i].loss) else assert.truthy(near(back[i].loss, r.loss, 1e-5)) end
    end
    assert.are.same({ 1, 2, { a = 'x' } }, back[5].nested)
    local first = slurp(path):match('^[^\n]*')
    assert.are.equal('{"loss":0.333333,"note":"a,b","ok":false,"step":1}', first)
    os.remove(path)
  end)

  it('appends to an existing CSV under its header', function()
    local path = tmpfile('.csv')
    local w = log.Writer(path, { fields = { 'step', 'loss' } })
    w:write { step = 1, loss = 2.5 }
    w:close()
    w = log.Writer(path, { append = true })
    w:write { loss = 2.25, step = 2 }
    w:close()
    local back, header = log.read_csv(path)
    assert.are.same({ 'step', 'loss' }, header)
    assert.are.same({ { step = 1, loss = 2.5 }, { step = 2, loss = 2.25 } }, back)
    os.remove(path)
  end)

  it('reports unknown formats, new columns, writes after close and malformed input', function()
    assert.has_error(function() log.Writer('/tmp/x.txt') end)
    local path = tmpfile('.csv')
    local w = log.Writer(path)
    w:write { a = 1 }
    local ok, err = pcall(w.write, w, { a = 2, b = 3 })
    assert.is_false(ok)
    assert.truthy(err:find("column 'b' is not in the CSV header", 1, true), err)
    w:close()
    assert.has_error(function() w:write { a = 3 } end, 'Writer ' .. path .. ': write after close')
    local f = assert(io.open(path, 'wb'))
    f:write('a,b\n"unterminated,2\n')
    f:close()
    ok, err = pcall(log.read_csv, path)
    assert.is_false(ok)
    assert.truthy(err:find('unterminated quoted field starting on line 2', 1, true), err)
    os.remove(path)
  end)
end)

describe('plot_svg', function()
  -- tag balance; returns the list of opening tag names
  local function check_well_formed(svg)
    assert.truthy(svg:find('^<%?xml[^>]*%?>%s*<svg '), 'starts with the XML declaration and <svg>')
    local stack, names = {}, {}
    for close, name, attrs, selfclose in svg:gmatch('<(/?)([%a][%w:-]*)([^>]-)(/?)>') do
      if close == '/' then
        assert.are.equal(stack[#stack], name, 'closing </' .. name .. '>')
        stack[#stack] = nil
      elseif selfclose ~= '/' then
        stack[#stack + 1] = name
        names[#names + 1] = name
      else
        names[#names + 1] = name
      end
      assert.is_nil(attrs:find('[<&]'), 'no raw < or & inside a tag')
    end
    assert.are.equal(0, #stack, 'unclosed tags: ' .. table.concat(stack, ' '))
    assert.truthy(svg:find('</svg>%s*$'))
    return names
  end

  local function polylines(svg)
    local all = {}
    for pts in svg:gmatch('<polyline[^>]- points="([^"]*)"') do
      local p = {}
      for x, y in pts:gmatch('([-%d.]+),([-%d.]+)') do p[#p + 1] = { tonumber(x), tonumber(y) } end
      all[#all + 1] = p
    end
    return all
  end

  local function ticks(svg, class)
    local t = {}
    for label in svg:gmatch('<text class="' .. class .. '"[^>]*>([^<]*)</text>') do
      t[#t + 1] = assert(tonumber(label), 'tick label ' .. label .. ' is a number')
    end
    return t
  end

  -- at least two ticks, evenly spaced by 1, 2 or 5 times a power of ten, on multiples of it, inside [lo, hi]
  local function check_nice(t, lo, hi, what)
    assert.truthy(#t >= 2, what .. ': at least two ticks')
    local step = t[2] - t[1]
    local mag = 10 ^ math.floor(math.log10(step) + 1e-9)
    local m = step / mag
    assert.truthy(near(m, 1, 1e-6) or near(m, 2, 1e-6) or near(m, 5, 1e-6), what .. ': step ' .. step)
    for i, v in ipairs(t) do
      assert.truthy(near(v - t[1], (i - 1) * step, 1e-6) or math.abs(v - t[1] - (i - 1) * step) < 1e-9 * mag,
                    what .. ': evenly spaced')
      local k = v / step
      assert.truthy(math.abs(k - math.floor(k + 0.5)) < 1e-6, what .. ': ' .. v .. ' is a multiple of ' .. step)
      local tol = 1e-9 * math.max(math.abs(lo), math.abs(hi), step)
      assert.truthy(v >= lo - tol and v <= hi + tol, string.format('%s: tick %g outside [%g, %g]', what, v, lo, hi))
    end
    assert.truthy(#t <= 11, what .. ': not too many ticks')
  end

  local function render(series, opts)
    local path = tmpfile('.svg')
    assert.are.equal(path, log.plot_svg(path, series, opts))
    local svg = slurp(path)
    assert.is_false(exists(path .. '.tmp'))
    os.remove(path)
    return svg
  end

  it('draws well-formed SVG with one polyline per series, NaN/inf skipped, and nice ticks', function()
    local x, y1, y2 = {}, {}, {}
    for i = 1, 40 do
      x[i] = 10 * i
      y1[i] = 4.7 * math.exp(-i / 12) + 0.8
      y2[i] = i % 5 == 0 and 5.1 * math.exp(-i / 15) + 0.9 or 0 / 0
    end
    y1[7], y1[13] = 0 / 0, 1 / 0
    local svg = render({ { name = 'train', x = x, y = y1 }, { name = 'valid <&>', x = x, y = y2 } },
                       { title = 'loss & "curves"', xlabel = 'step', ylabel = 'loss',
                         hlines = { { y = 2.5, label = 'unigram entropy' } } })
    local names = check_well_formed(svg)
    assert.truthy(#names > 10)
    local lines = polylines(svg)
    assert.are.equal(2, #lines)
    assert.are.equal(38, #lines[1])
    assert.are.equal(8, #lines[2])
    -- the training curve falls, so its SVG y (downwards) rises; x increases left to right
    for j = 2, #lines[1] do
      assert.truthy(lines[1][j][1] > lines[1][j - 1][1])
      assert.truthy(lines[1][j][2] > lines[1][j - 1][2])
    end
    check_nice(ticks(svg, 'xtick'), 10, 400, 'x ticks')
    local ylo, yhi = math.huge, -math.huge
    for _, ys in ipairs { y1, y2 } do
      for _, v in ipairs(ys) do
        if v == v and v ~= math.huge then ylo, yhi = math.min(ylo, v), math.max(yhi, v) end
      end
    end
    check_nice(ticks(svg, 'ytick'), ylo, yhi, 'y ticks')
    assert.truthy(svg:find('unigram entropy', 1, true))
    assert.truthy(svg:find('valid &lt;&amp;&gt;', 1, true))
    assert.truthy(svg:find('loss &amp; &quot;curves&quot;', 1, true))
    assert.truthy(select(2, svg:gsub('stroke%-dasharray', '')) == 1, 'one dashed reference line')
    -- two distinct colours
    local c1, c2 = svg:match('<polyline[^>]- stroke="([^"]+)".-<polyline[^>]- stroke="([^"]+)"')
    assert.are_not.equal(c1, c2)
    -- every point inside the canvas
    local W, H = tonumber(svg:match('<svg[^>]- width="(%d+)"')), tonumber(svg:match('<svg[^>]- height="(%d+)"'))
    for _, l in ipairs(lines) do
      for _, p in ipairs(l) do assert.truthy(p[1] >= 0 and p[1] <= W and p[2] >= 0 and p[2] <= H) end
    end
  end)

  it('handles a single point, a constant series, x defaulting to 1..n and an empty chart', function()
    local svg = render({ { name = 'one', x = { 5 }, y = { 3 } } })
    check_well_formed(svg)
    assert.are.equal(1, #polylines(svg)[1])
    assert.truthy(svg:find('<circle', 1, true))
    local yt = ticks(svg, 'ytick')
    assert.truthy(#yt >= 2)

    svg = render({ { name = 'flat', y = { 2, 2, 2, 2 } } })
    check_well_formed(svg)
    local pl = polylines(svg)[1]
    assert.are.equal(4, #pl)
    for j = 2, 4 do assert.are.equal(pl[1][2], pl[j][2]) end
    check_nice(ticks(svg, 'xtick'), 1, 4, 'x ticks of 1..4')

    svg = render({ { name = 'nothing', y = { 0 / 0 } } })
    check_well_formed(svg)
    assert.are.equal(0, #polylines(svg))
    assert.truthy(svg:find('no data', 1, true))
  end)

  it('draws a log-scale y axis with decade ticks and skips values <= 0', function()
    local y = { 1000, 300, 100, 30, 10, 3, 1, 0, -1 }
    local svg = render({ { name = 'decay', y = y } }, { logy = true })
    check_well_formed(svg)
    assert.are.equal(7, #polylines(svg)[1])
    assert.are.same({ 1, 10, 100, 1000 }, ticks(svg, 'ytick'))
    svg = render({ { name = 'narrow', y = { 5.9, 3.1, 1.2 } } }, { logy = true })   -- under one decade
    assert.are.same({ 2, 3, 4, 5 }, ticks(svg, 'ytick'))
  end)

  it('rejects malformed series', function()
    assert.has_error(function() log.plot_svg('/tmp/never.svg', { { name = 'a', x = { 1, 2 }, y = { 1 } } }) end,
                     "plot_svg: series 1 ('a'): x has 2 values but y has 1")
    assert.has_error(function() log.plot_svg('/tmp/never.svg', { 5 }) end,
                     'plot_svg: series 1 must be a table {name=, x={...}, y={...}}')
  end)

  it('plot_csv draws loss and val_loss from a training log', function()
    local csv, svgpath = tmpfile('.csv'), tmpfile('.svg')
    local w = log.Writer(csv, { fields = { 'step', 'loss', 'val_loss', 'lr' } })
    for i = 1, 30 do
      w:write { step = i, loss = 5 / i + 1, val_loss = i % 10 == 0 and 6 / i + 1 or nil, lr = 1e-3 }
    end
    w:close()
    log.plot_csv(csv, svgpath, { hlines = { { y = 1, label = 'floor' } } })
    local svg = slurp(svgpath)
    check_well_formed(svg)
    local lines = polylines(svg)
    assert.are.equal(2, #lines)
    assert.are.equal(30, #lines[1])
    assert.are.equal(3, #lines[2])
    assert.truthy(svg:find('>train</text>', 1, true) and svg:find('>valid</text>', 1, true))
    assert.truthy(svg:find('class="xlabel"[^>]*>step</text>'))
    os.remove(csv)
    os.remove(svgpath)
  end)
end)
