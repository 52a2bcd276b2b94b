-- tools/tune_attention.lua — measures the fused attention kernels' variants on this GPU and keeps
-- the fastest per head dim in the cache the CUDA backend reads at start (lua/ulysses/attention_tune.lua
-- says how: each stage in a child process, so a kernel that faults costs only itself).
--
--   bin/ulysses tools/tune_attention.lua [--dims 64,128] [--seq 8192] [--heads H --kv-heads G]
--                                        [--reps 5] [--cache FILE] [--nondeterministic] [--no-write] [--show]
--   --heads, --kv-heads: your model's (default: 32 and 8 at D 64, as Llama 3.2 1B; 16 at D 128).
--   --nondeterministic: the one-pass backward may be chosen too (fewer products, but dQ summed by
--   atomics: its last bits vary from run to run; without the flag every choice is deterministic).
--   --show: the cache's entries (nothing measured). Run it once per GPU type and build; a rebuilt
--   library (another size or time) is measured again. ULY_CUDA_TUNED=0 makes a run ignore the cache.
-- (--child D STAGE SEQ REPS LABELS H G: one stage's measurements, what the command runs in its children.)
local tune = require 'ulysses.attention_tune'

local args = arg or {}
if args[1] == '--child' then
  local labels = {}
  for l in (args[6] or ''):gmatch('[^,]+') do labels[#labels + 1] = l end
  tune.child { D = tonumber(args[2]), stage = args[3], seq = tonumber(args[4]), reps = tonumber(args[5]) or 5,
               labels = labels, heads = tonumber(args[7]), kv_heads = tonumber(args[8]) }
  os.exit(0)
end

local o, show, i = { dims = nil, seq = 8192, reps = 5 }, false, 1
local function fail(msg)
  io.stderr:write('tools/tune_attention.lua: ', msg, '\n')
  os.exit(2)
end
while i <= #args do
  local a, v = args[i], args[i + 1]
  if a == '--dims' then
    o.dims = {}
    for d in (v or ''):gmatch('[^,]+') do
      local n = tonumber(d)
      if n ~= 64 and n ~= 128 then fail("--dims: '" .. d .. "' is not 64 or 128 (the head dims with kernel variants)") end
      o.dims[#o.dims + 1] = n
    end
    if #o.dims == 0 then fail('--dims needs a list, e.g. 64,128') end
    i = i + 2
  elseif a == '--seq' or a == '--reps' or a == '--heads' or a == '--kv-heads' then
    local n = tonumber(v)
    if not n or n < 1 or n % 1 ~= 0 then fail(a .. ' needs a positive integer, got ' .. tostring(v)) end
    o[(a:sub(3):gsub('-', '_'))] = n
    i = i + 2
  elseif a == '--cache' then
    if not v then fail('--cache needs a file') end
    o.cache = v
    i = i + 2
  elseif a == '--no-write' then o.write = false; i = i + 1
  elseif a == '--nondeterministic' then o.nondeterministic = true; i = i + 1
  elseif a == '--show' then show = true; i = i + 1
  elseif a == '-h' or a == '--help' then
    print('usage: bin/ulysses tools/tune_attention.lua [--dims 64,128] [--seq N] [--heads H --kv-heads G] [--reps R] '
          .. '[--cache FILE] [--nondeterministic] [--no-write] [--show]')
    os.exit(0)
  else fail('unknown argument ' .. tostring(a) .. ' (try --help)') end
end

if o.kv_heads and not o.heads then fail('--kv-heads needs --heads') end
if o.heads and o.heads % (o.kv_heads or o.heads) ~= 0 then
  fail(('--heads %d is not a multiple of --kv-heads %d'):format(o.heads, o.kv_heads))
end
local path = o.cache or tune.cache_path()
if show then
  local entries, bad = tune.read(path)
  print(('%s: %d entries%s'):format(path, #entries, bad > 0 and (', ' .. bad .. ' unreadable lines') or ''))
  for _, e in ipairs(entries) do
    print(('D %3d  %-40s %.3f ms (default %.3f) at %s, %s  %s'):format(e.D, tune.label(e), e.ms or 0, e.default_ms or 0,
                                                                      e.shape ~= '' and e.shape or '?', e.date, e.key))
  end
  os.exit(0)
end

print(('tuning the fused attention kernels: head dims %s, causal, N %d, median of %d, %s; cache %s'):format(
  table.concat(o.dims or tune.DIMS, ', '), o.seq, o.reps, o.nondeterministic and 'the one-pass backward too (nondeterministic dQ)'
  or 'deterministic kernels only', o.write == false and '(not written)' or path))
o.log = function(r)
  if type(r) == 'string' then print(r); return end
  local ms = r.secs and ('%10.3f'):format(r.secs * 1e3) or ('%10s'):format('-')
  local err = r.err and ('%9.1e'):format(r.err) or ('%9s'):format('-')
  print(('  %-26s %s ms %s  %-8s %s'):format(r.label, ms, err, r.status, r.status == 'crashed' and r.why or r.kernels))
end
print(('  %-26s %10s %12s  %-8s %s'):format('candidate', 'time', 'max error', 'status', 'attention kernels that ran'))
local ok, err = pcall(tune.tune, o)
if not ok then fail(tostring(err)) end
