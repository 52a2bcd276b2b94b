-- lua/ulysses/attention_tune.lua — which of the fused attention kernels' variants (the
-- ULY_CUDA_ATTN_FWD, _DQ, _DKV and _BWD names of kernels/cuda/attention_fused.cu) run fastest on
-- this GPU, measured here and remembered in a cache file, so a run gets them without knowing
-- their names. The tools/tune_attention.lua command measures; the CUDA backend applies the cache
-- when it starts (uly.cuda.ensure); uly.cuda.attention_choice(D) says what is in effect.
--
-- Measuring is isolated: a kernel that faults (an mbarrier wait that never completes traps) leaves
-- its CUDA context unusable, so each stage runs in a child process (`--child`), one candidate at
-- a time, reporting as it goes; a child that dies takes only the candidate it was running with
-- it (marked 'crashed') and a new child goes on with the rest. This process never touches the GPU.
--
-- Per head dim (64, 128), at B 1, N --seq (8192), causal, with GQA at D 64 as the Llama presets
-- (32 query and 8 K/V heads of 64; 16 heads of 128; --heads and --kv-heads for a model's own):
--   1. forward: each forward variant, the forward alone;
--   2. backward: each dQ and dK/dV variant alone (and with --nondeterministic the one-pass
--      backward, whose dQ sums by atomics), forward + backward;
--   3. confirm: the fastest forward with the fastest backward, each alone and the default, forward
--      + backward; the fastest of these is kept (the default unless one is MARGIN faster).
-- A candidate counts only if it ran kernels of its own (uly.cuda.profile's names differ from the
-- default's: a variant this GPU cannot run falls back to the default) and agrees with the default
-- within TOLERANCE of the largest value (output, and in stages 2 and 3 the gradients).
--
-- Cache file (ULY_TUNE_CACHE, else $XDG_CACHE_HOME/ulysses/attention-tune.txt, else
-- ~/.cache/ulysses/attention-tune.txt): a line per (key, head dim), tab-separated: key (device,
-- compute capability, the CUDA library's size and time: uly_cuda_tune_key), D, fwd, dq, dkv, bwd
-- ('-' for the default), the choice's and the default's forward + backward ms, the date, the shape
-- it was measured at ('N 8192, 32 heads, 8 K/V heads').
-- ULY_CUDA_TUNED=0 ignores the cache; a set ULY_CUDA_ATTN_* variable overrides its entry.
local ffi = require 'ffi'

local M = {}

M.VARS = { 'fwd', 'dq', 'dkv', 'bwd' }
M.ENV = { fwd = 'ULY_CUDA_ATTN_FWD', dq = 'ULY_CUDA_ATTN_DQ', dkv = 'ULY_CUDA_ATTN_DKV', bwd = 'ULY_CUDA_ATTN_BWD' }
M.TOLERANCE = 1e-2   -- of the largest value: kernels differ in summation order only; a wrong tile is off by O(1)
M.MARGIN = 0.03      -- a choice replaces the default only when at least 3 % faster (timing noise)
M.DIMS = { 64, 128 }

local function raise(msg) error('attention_tune: ' .. msg, 0) end

-- the candidates at head dim D: the forward stage's sets and the backward stage's (the default, {},
-- first in each). The one-pass backward adds dQ with atomics, in no fixed order, so its last bits
-- vary run to run: a candidate only with nondeterministic = true (--nondeterministic).
function M.candidates(D, nondeterministic)
  if D ~= 64 and D ~= 128 then raise('head dim ' .. tostring(D) .. ': only 64 and 128 have kernel variants') end
  local fwd = { {} }
  for _, name in ipairs { 'pipelined', 'rows128', 'tma', 'ws', 'wspp', 'wsov', 'wsppov' } do fwd[#fwd + 1] = { fwd = name } end
  local bwd = { {} }
  if D == 64 then
    bwd[#bwd + 1] = { dq = '64' }
    bwd[#bwd + 1] = { dkv = '64' }
  end
  for _, s in ipairs { { dq = 'rows128' }, { dq = 'ws' }, { dkv = 'rows128' }, { dkv = 'ws' } } do bwd[#bwd + 1] = s end
  if nondeterministic then
    if D == 64 then bwd[#bwd + 1] = { bwd = 'onepass' } end
    bwd[#bwd + 1] = { bwd = 'onepass', dkv = 'ws' }
  end
  return fwd, bwd
end

-- a set as one word: 'default', or 'fwd=ws+dq=64' (in VARS order); and back
function M.label(set)
  local parts = {}
  for _, v in ipairs(M.VARS) do
    if set[v] and set[v] ~= '' then parts[#parts + 1] = v .. '=' .. set[v] end
  end
  return #parts == 0 and 'default' or table.concat(parts, '+')
end

function M.parse_label(label)
  local set = {}
  if label == 'default' then return set end
  for part in label:gmatch('[^+]+') do
    local v, name = part:match('^(%w+)=([%w]+)$')
    if not v or not M.ENV[v] then raise("bad candidate '" .. label .. "' (expected default or fwd=NAME+dq=NAME...)") end
    set[v] = name
  end
  return set
end

local function merge(a, b)
  local s = {}
  for _, v in ipairs(M.VARS) do s[v] = (b[v] and b[v] ~= '') and b[v] or a[v] end
  return s
end

-- whether a measured result counts: ran its own kernels (or is the default) and agreed
local function usable(r)
  return (r.status == 'ran' or r.status == 'default') and r.err ~= nil and r.err <= M.TOLERANCE and r.secs ~= nil
end
M.usable = usable

local function default_of(results)
  for _, r in ipairs(results) do
    if r.label == 'default' then return r end
  end
end

-- the fastest usable result, the default unless one beats it by MARGIN; nil without a usable default
local function fastest(results)
  local base = default_of(results)
  if not base or not usable(base) then return nil end
  local best = base
  for _, r in ipairs(results) do
    if usable(r) and r.secs < best.secs then best = r end
  end
  if best ~= base and best.secs > base.secs * (1 - M.MARGIN) then best = base end
  return best
end
M.fastest = fastest

-- stages 1 and 2's results -> the sets stage 3 compares: the default, the fastest forward, the
-- fastest backward (the best dQ with the best dK/dV, or a one-pass set if faster), and both
-- together. Each result: { label =, secs =, err =, status = 'ran'|'default'|'fallback'|'crashed' }.
function M.confirm_sets(fwd_results, bwd_results)
  local f = fastest(fwd_results)
  local fset = f and M.parse_label(f.label) or {}
  local base = default_of(bwd_results)
  local bset = {}
  if base and usable(base) then
    -- dQ and dK/dV run as separate kernels: their gains add
    local gain = { dq = 0, dkv = 0 }
    local pick = {}
    for _, r in ipairs(bwd_results) do
      local s = M.parse_label(r.label)
      local only = (s.dq and not s.dkv and not s.bwd and 'dq') or (s.dkv and not s.dq and not s.bwd and 'dkv') or nil
      if only and usable(r) and base.secs - r.secs > gain[only] then gain[only], pick[only] = base.secs - r.secs, s[only] end
    end
    local two_pass = base.secs - gain.dq - gain.dkv
    local best_secs, best = two_pass, { dq = pick.dq, dkv = pick.dkv }
    for _, r in ipairs(bwd_results) do
      local s = M.parse_label(r.label)
      if s.bwd == 'onepass' and usable(r) and r.secs < best_secs then best_secs, best = r.secs, s end
    end
    if best_secs <= base.secs * (1 - M.MARGIN) then bset = best end
  end
  local sets, seen = {}, {}
  for _, s in ipairs { {}, fset, bset, merge(fset, bset) } do
    local l = M.label(s)
    if not seen[l] then seen[l] = true; sets[#sets + 1] = s end
  end
  return sets
end

---------------------------------------------------------------- the cache file

-- a line's tab-separated fields (the cache's, the children's reports)
local function fields(line)
  local out = {}
  for field in (line .. '\t'):gmatch('([^\t]*)\t') do out[#out + 1] = field end
  return out
end

function M.cache_path()
  local p = os.getenv('ULY_TUNE_CACHE')
  if p and p ~= '' then return p end
  local base = os.getenv('XDG_CACHE_HOME')
  if not base or base == '' then base = (os.getenv('HOME') or '/tmp') .. '/.cache' end
  return base .. '/ulysses/attention-tune.txt'
end

-- the entries of a cache file ({} when there is none); lines that do not parse are skipped and
-- counted in the second result
function M.read(path)
  local f = io.open(path, 'r')
  if not f then return {}, 0 end
  local entries, bad = {}, 0
  for line in f:lines() do
    if line ~= '' and line:sub(1, 1) ~= '#' then
      local c = fields(line)
      local D = tonumber(c[2])
      if #c >= 8 and (D == 64 or D == 128) then
        local e = { key = c[1], D = D, ms = tonumber(c[7]), default_ms = tonumber(c[8]), date = c[9] or '', shape = c[10] or '' }
        for i, v in ipairs(M.VARS) do e[v] = c[2 + i] ~= '-' and c[2 + i] or '' end
        entries[#entries + 1] = e
      else
        bad = bad + 1
      end
    end
  end
  f:close()
  return entries, bad
end

local function shq(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end

-- the entries written to path atomically (a temporary file beside it, renamed over it)
function M.write(path, entries)
  local dir = path:match('^(.*)/[^/]*$')
  if dir and dir ~= '' then os.execute('mkdir -p ' .. shq(dir) .. ' 2>/dev/null') end   -- io.open says why it failed
  local tmp = ('%s.tmp.%d'):format(path, math.random(1, 2 ^ 30))
  local f, why = io.open(tmp, 'w')
  if not f then raise('cannot write the cache ' .. path .. ': ' .. tostring(why)) end
  f:write('# ulysses: fused attention kernels chosen by tools/tune_attention.lua (lua/ulysses/attention_tune.lua)\n')
  f:write('# key\tD\tfwd\tdq\tdkv\tbwd\tms\tdefault_ms\tdate\tshape\n')
  for _, e in ipairs(entries) do
    local c = { e.key, tostring(e.D) }
    for _, v in ipairs(M.VARS) do c[#c + 1] = (e[v] and e[v] ~= '') and e[v] or '-' end
    c[#c + 1] = ('%.4f'):format(e.ms or 0)
    c[#c + 1] = ('%.4f'):format(e.default_ms or 0)
    c[#c + 1] = e.date or ''
    c[#c + 1] = e.shape or ''
    f:write(table.concat(c, '\t'), '\n')
  end
  local ok, err = f:close()
  if not ok then os.remove(tmp); raise('cannot write the cache ' .. path .. ': ' .. tostring(err)) end
  local renamed, rerr = os.rename(tmp, path)
  if not renamed then os.remove(tmp); raise('cannot replace the cache ' .. path .. ': ' .. tostring(rerr)) end
end

-- this process's key (the CUDA library loaded, its current device); nil and why without one
function M.key(lib)
  local buf = ffi.new('char[512]')
  if lib.uly_cuda_tune_key(buf, 512) ~= 0 then return nil, ffi.string(lib.uly_cuda_last_error()) end
  return ffi.string(buf)
end

-- the cache's entries for this key set into the CUDA library (ULY_CUDA_TUNED=0: none, cleared);
-- returns the entries applied
function M.apply(lib, path)
  for _, D in ipairs(M.DIMS) do lib.uly_cuda_attention_prefer(D, '', '', '', '') end
  if os.getenv('ULY_CUDA_TUNED') == '0' then return {} end
  local entries = M.read(path or M.cache_path())
  if #entries == 0 then return {} end
  local key = M.key(lib)
  local applied = {}
  for _, e in ipairs(entries) do
    if e.key == key then
      if lib.uly_cuda_attention_prefer(e.D, e.fwd, e.dq, e.dkv, e.bwd) ~= 0 then
        raise(('the cache %s, head dim %d: %s'):format(path or M.cache_path(), e.D, ffi.string(lib.uly_cuda_last_error())))
      end
      applied[#applied + 1] = e
    end
  end
  return applied
end

---------------------------------------------------------------- the child: one stage's measurements

local function emit(...)
  io.stdout:write(table.concat({ 'tune', ... }, '\t'), '\n')
  io.stdout:flush()
end

-- the query and K/V heads a tuning runs at head dim D: o.heads / o.kv_heads where given, else GQA
-- at D 64 as the Llama presets (1b: 32 heads, 8 K/V heads), 16 heads at 128; below 4096 tokens
-- (specs, the emulator) 2 heads (1 K/V head at D 64)
function M.heads(D, o)
  local H, Hkv = 2, D == 64 and 1 or 2
  if o.seq >= 4096 then H, Hkv = D == 64 and 32 or 16, D == 64 and 8 or 16 end
  return o.heads or H, o.kv_heads or o.heads or Hkv
end

-- runs in the child (tools/tune_attention.lua --child): o.D, o.stage ('fwd', 'bwd', 'confirm'),
-- o.labels, o.seq, o.reps, o.heads, o.kv_heads; reports its shape and each candidate on stdout as
-- it goes
function M.child(o)
  local uly = require 'ulysses'
  local ok, why = uly.cuda.ensure()
  if not ok then emit('error', tostring(why)); os.exit(3) end
  if uly.cuda.backend() ~= 'cuda' then emit('error', 'the CUDA backend is not running'); os.exit(3) end
  emit('key', assert(M.key(uly.cuda.lib())))
  local D, N = o.D, o.seq
  local H, Hkv = M.heads(D, o)
  emit('shape', ('N %d, %d heads, %d K/V heads'):format(N, H, Hkv))
  uly.manual_seed(1)
  uly.matmul_precision('bf16')
  local q = uly.randn(1, N, H, D, { device = 'cuda' }):requires_grad_()
  local k = uly.randn(1, N, Hkv, D, { device = 'cuda' }):requires_grad_()
  local v = uly.randn(1, N, Hkv, D, { device = 'cuda' }):requires_grad_()
  local g = uly.randn(1, N, H, D, { device = 'cuda' })
  local backward = o.stage ~= 'fwd'
  local crash = os.getenv('ULY_TUNE_TEST_CRASH')   -- specs: this candidate's child aborts
  local wrong = os.getenv('ULY_TUNE_TEST_WRONG')   -- specs: this candidate's output is changed
  local function set_env(set)
    for _, var in ipairs(M.VARS) do ffi.C.setenv(M.ENV[var], set[var] or '', 1) end
  end
  -- the outputs of one run (o; with backward also dq, dk, dv), as host values
  local function run()
    q:zero_grad(); k:zero_grad(); v:zero_grad()
    if not backward then return { uly.no_grad(uly.flash_attention, q, k, v, { causal = true }) } end
    local out = uly.flash_attention(q, k, v, { causal = true })
    out:backward(g)
    return { out:detach(), q.grad, k.grad, v.grad }
  end
  local function attention_kernels()
    local report = uly.cuda.profile(run)
    local names = {}
    for _, kern in ipairs(report.kernels) do
      if kern.name:find('attention', 1, true) then names[#names + 1] = kern.name end
    end
    table.sort(names)
    return table.concat(names, '; ')
  end
  local function seconds()   -- (warm: the candidate just ran twice, compared and profiled)
    uly.synchronize('cuda')
    local t = {}
    for r = 1, o.reps do
      local t0 = uly.clock()
      run()
      uly.synchronize('cuda')
      t[r] = uly.clock() - t0
    end
    table.sort(t)
    return t[math.floor((#t + 1) / 2)]
  end
  -- a tensor's values on the host (float[n]) and n
  local function host(t)
    local n = t:numel()
    local buf = ffi.new('float[?]', n)
    t:copy_to_ptr(buf, 'f32')
    return buf, n
  end
  set_env({})
  local ref = run()
  for i, t in ipairs(ref) do ref[i] = host(t) end
  local ref_kernels = attention_kernels()
  for _, label in ipairs(o.labels) do
    emit('try', label)
    if crash == label then pcall(ffi.cdef, 'void abort(void);'); ffi.C.abort() end
    local set = M.parse_label(label)
    set_env(set)
    local outs = run()
    local err, big = 0, 0
    for i, r in ipairs(ref) do
      local a, n = host(outs[i])
      for e = 0, n - 1 do
        local d = math.abs(a[e] - r[e])
        if not (d <= err) then err = d ~= d and math.huge or d end
        big = math.max(big, math.abs(r[e]))
      end
    end
    if wrong == label then err = err + big end
    local kernels = attention_kernels()
    local status = label == 'default' and 'default' or kernels == ref_kernels and 'fallback' or 'ran'
    local secs = seconds()
    emit('result', label, ('%.6e'):format(secs), ('%.3e'):format(err / math.max(big, 1e-30)), status, kernels)
    outs = nil
  end
  set_env({})
  emit('done')
end

---------------------------------------------------------------- the parent: stages in children

local function root()
  return require('ulysses.ffi').root
end

local has_timeout
local function child_command(D, stage, labels, o)
  if has_timeout == nil then has_timeout = os.execute('command -v timeout >/dev/null 2>&1') == 0 end
  local r = root()
  local H, Hkv = M.heads(D, o)
  return ('ULY_CUDA_TUNED=0 %s%s %s --child %d %s %d %d %s %d %d 2>&1'):format(
    has_timeout and ('timeout ' .. (o.child_timeout or 120) .. ' ') or '', shq(r .. '/bin/ulysses'),
    shq(r .. '/tools/tune_attention.lua'), D, stage, o.seq, o.reps, table.concat(labels, ','), H, Hkv)
end

-- one stage's labels measured in children, a new child after each that dies; returns the results
-- (in the labels' order), the key the children reported and the shape they ran
function M.stage(D, stage, labels, o)
  local log = o.log or function() end
  local results, by_label, key, shape = {}, {}, nil, nil
  local left = labels
  while #left > 0 do
    local p = io.popen(child_command(D, stage, left, o), 'r')
    local trying, finished, tail = nil, false, {}
    for line in p:lines() do
      local f = fields(line)
      if f[1] == 'tune' and f[2] == 'key' then key = f[3]
      elseif f[1] == 'tune' and f[2] == 'shape' then shape = f[3]
      elseif f[1] == 'tune' and f[2] == 'try' then trying = f[3]
      elseif f[1] == 'tune' and f[2] == 'result' then
        local r = { label = f[3], secs = tonumber(f[4]), err = tonumber(f[5]), status = f[6], kernels = f[7] or '' }
        by_label[r.label] = r
        trying = nil
        log(r)
      elseif f[1] == 'tune' and f[2] == 'done' then finished = true
      elseif f[1] == 'tune' and f[2] == 'error' then tail[#tail + 1] = f[3]
      else
        tail[#tail + 1] = line
        if #tail > 20 then table.remove(tail, 1) end
      end
    end
    p:close()
    if not finished then
      if not trying then
        raise(('the %s stage at D %d: its child process ended before measuring anything:\n%s'):format(stage, D,
              table.concat(tail, '\n')))
      end
      local r = { label = trying, status = 'crashed', kernels = '', why = tail[#tail] or '' }
      by_label[trying] = r
      log(r)
    end
    local rest = {}
    for _, l in ipairs(left) do
      if not by_label[l] then rest[#rest + 1] = l end
    end
    if #rest == #left then   -- no progress: a child that measures nothing would be started forever
      raise(('the %s stage at D %d: its child process measured none of %s:\n%s'):format(stage, D, table.concat(left, ', '),
            table.concat(tail, '\n')))
    end
    left = rest
  end
  for _, l in ipairs(labels) do results[#results + 1] = by_label[l] end
  return results, key, shape
end

-- measures every head dim in o.dims (M.DIMS) and writes the choices to the cache (o.cache, else
-- M.cache_path(); o.write == false: not written); o.nondeterministic (the one-pass backward a
-- candidate too: see candidates); o.seq (8192), o.heads, o.kv_heads (M.heads), o.reps (5), o.log(result or
-- text), o.child_timeout (120 s: a child still running then is killed, and the candidate it was
-- on counts as crashed, so a kernel that hangs costs that much). Returns the new entries.
function M.tune(o)
  o = o or {}
  o.seq, o.reps = o.seq or 8192, o.reps or 5
  local path = o.cache or M.cache_path()
  local log = o.log or function() end
  local entries, key = {}, nil
  for _, D in ipairs(o.dims or M.DIMS) do
    local fsets, bsets = M.candidates(D, o.nondeterministic)
    local labels = function(sets)
      local out = {}
      for _, s in ipairs(sets) do out[#out + 1] = M.label(s) end
      return out
    end
    local H, Hkv = M.heads(D, o)
    log(('D %d (%d heads, %d K/V heads), forward (forward alone):'):format(D, H, Hkv))
    local fr, k1 = M.stage(D, 'fwd', labels(fsets), o)
    log(('D %d, backward (forward + backward):'):format(D))
    local br, k2 = M.stage(D, 'bwd', labels(bsets), o)
    log(('D %d, confirm (forward + backward):'):format(D))
    local cr, k3, shape = M.stage(D, 'confirm', labels(M.confirm_sets(fr, br)), o)
    key = k1 or k2 or k3
    if not (k1 == k2 and k2 == k3) then raise('the children reported different devices or libraries') end
    local best, base = fastest(cr), default_of(cr)
    if not best then raise(('D %d: the default kernels did not run (see the log)'):format(D)) end
    local e = { key = key, D = D, ms = best.secs * 1e3, default_ms = base.secs * 1e3, date = os.date('!%Y-%m-%d'),
                shape = shape or '' }
    local set = M.parse_label(best.label)
    for _, v in ipairs(M.VARS) do e[v] = set[v] or '' end
    entries[#entries + 1] = e
    log(('D %d: %s, %.3f ms forward + backward (default %.3f ms)'):format(D, best.label, e.ms, e.default_ms))
  end
  if o.write ~= false then
    local kept = {}
    for _, e in ipairs(M.read(path)) do
      local replaced = false
      for _, n in ipairs(entries) do replaced = replaced or (e.key == n.key and e.D == n.D) end
      if not replaced then kept[#kept + 1] = e end
    end
    for _, n in ipairs(entries) do kept[#kept + 1] = n end
    M.write(path, kept)
  end
  return entries
end

return M
