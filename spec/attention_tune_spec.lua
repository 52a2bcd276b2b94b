-- spec/attention_tune_spec.lua — the fused attention kernels' tuning (lua/ulysses/attention_tune.lua,
-- tools/tune_attention.lua): the choice from measured results (synthetic ones), the cache file,
-- and on the CUDA emulator the whole command (children, a crashing and a wrong candidate left
-- out) and the CUDA backend applying a cache (the kernels that run, by uly.cuda.profile's names).
local helpers = require 'helpers'
local tune = require 'ulysses.attention_tune'
local base = require 'ulysses.ffi'

local function r(label, secs, status, err)
  return { label = label, secs = secs, status = status or (label == 'default' and 'default' or 'ran'), err = err or 0 }
end

describe('attention tuning: the choice', function()
  it('lists every variant once per head dim, the default first, and labels round-trip', function()
    for _, D in ipairs { 64, 128 } do
      -- the one-pass backward (dQ by atomics) only when asked for
      local _, deterministic = tune.candidates(D)
      assert.are.equal(D == 64 and 7 or 5, #deterministic)
      for _, s in ipairs(deterministic) do assert.is_nil(s.bwd) end
      local f, b = tune.candidates(D, true)
      assert.are.same({}, f[1])
      assert.are.same({}, b[1])
      assert.are.equal(8, #f)
      assert.are.equal(D == 64 and 9 or 6, #b)
      for _, list in ipairs { f, b } do
        local seen = {}
        for _, s in ipairs(list) do
          local l = tune.label(s)
          assert.is_nil(seen[l]); seen[l] = true
          assert.are.same(s, tune.parse_label(l))
        end
      end
    end
    assert.are.equal('dkv=ws+bwd=onepass', tune.label { bwd = 'onepass', dkv = 'ws' })
    assert.has_error(function() tune.candidates(32) end, 'attention_tune: head dim 32: only 64 and 128 have kernel variants')
    assert.has_error(function() tune.parse_label('fwd=ws+bogus=1') end)
    local uly = require 'ulysses'
    assert.has_error(function() uly.cuda.attention_choice(32) end,
                     'uly.cuda.attention_choice: expected head dim 64 or 128 (the ones with kernel variants), got 32')
    assert.has_error(function() uly.cuda.apply_tuned('yes') end, 'uly.cuda.apply_tuned: expected true, false or nothing, got string yes')
  end)

  it('takes the fastest candidate that ran its own kernels and agreed, by a margin over the default', function()
    local res = { r('default', 1.0), r('fwd=ws', 0.5, 'fallback'), r('fwd=tma', 0.4, 'crashed'), r('fwd=wspp', 0.3, 'ran', 0.5),
                  r('fwd=wsov', 0.8), r('fwd=rows128', 0.7) }
    res[3].secs = nil
    assert.are.equal('fwd=rows128', tune.fastest(res).label)
    -- within the margin of the default: the default stays
    assert.are.equal('default', tune.fastest({ r('default', 1.0), r('fwd=ws', 1 - tune.MARGIN / 2) }).label)
    assert.are.equal('fwd=ws', tune.fastest({ r('default', 1.0), r('fwd=ws', 1 - 2 * tune.MARGIN) }).label)
    -- no usable default: nothing is chosen
    assert.is_nil(tune.fastest({ r('default', 1.0, 'crashed'), r('fwd=ws', 0.5) }))
  end)

  it('adds the dQ and dK/dV gains, and prefers a one-pass set only where it beats them', function()
    local fwd = { r('default', 1.0), r('fwd=wsov', 0.5) }
    local bwd = { r('default', 10), r('dq=64', 9), r('dq=ws', 8), r('dkv=ws', 7), r('dkv=rows128', 12), r('bwd=onepass', 6),
                  r('dkv=ws+bwd=onepass', 4, 'ran', 1) }   -- the last disagrees: left out
    local labels = {}
    for _, s in ipairs(tune.confirm_sets(fwd, bwd)) do labels[#labels + 1] = tune.label(s) end
    -- two-pass estimate 10 - 2 - 3 = 5 beats the one pass (6)
    assert.are.same({ 'default', 'fwd=wsov', 'dq=ws+dkv=ws', 'fwd=wsov+dq=ws+dkv=ws' }, labels)
    bwd[6].secs = 4.5
    labels = {}
    for _, s in ipairs(tune.confirm_sets(fwd, bwd)) do labels[#labels + 1] = tune.label(s) end
    assert.are.same({ 'default', 'fwd=wsov', 'bwd=onepass', 'fwd=wsov+bwd=onepass' }, labels)
    -- nothing faster: the default alone
    labels = {}
    for _, s in ipairs(tune.confirm_sets({ r('default', 1) }, { r('default', 10), r('dq=ws', 11) })) do
      labels[#labels + 1] = tune.label(s)
    end
    assert.are.same({ 'default' }, labels)
  end)
end)

describe('attention tuning: the cache file', function()
  it('writes atomically, reads back, skips lines it cannot parse', function()
    local dir = helpers.mkdtemp()
    local path = dir .. '/sub/attention-tune.txt'
    local entries = { { key = 'GPU X, compute capability 9.0, library 1-2', D = 64, fwd = 'wsov', dq = '', dkv = 'ws', bwd = 'onepass',
                        ms = 1.5, default_ms = 2.25, date = '2026-12-06', shape = 'N 8192, 32 heads, 8 K/V heads' },
                      { key = 'GPU X, compute capability 9.0, library 1-2', D = 128, fwd = '', dq = '', dkv = '', bwd = '',
                        ms = 3, default_ms = 3, date = '2026-12-06', shape = '' } }
    tune.write(path, entries)
    local back, bad = tune.read(path)
    assert.are.equal(0, bad)
    assert.are.same(entries, back)
    local out = helpers.run('ls -A ' .. helpers.shq(dir .. '/sub'))
    assert.are.equal('attention-tune.txt\nexit=0\n', out)   -- no temporary file left beside it
    local f = assert(io.open(path, 'a'))
    f:write('not\ta line\n', 'key\t96\t-\t-\t-\t-\t1\t1\n')
    f:close()
    back, bad = tune.read(path)
    assert.are.equal(2, #back)
    assert.are.equal(2, bad)
    assert.are.same({}, (tune.read(dir .. '/none.txt')))
    -- a cache that cannot be written says which and why, and leaves nothing behind
    local blocker = dir .. '/file'
    assert(io.open(blocker, 'w')):close()
    local ok, err = pcall(tune.write, blocker .. '/attention-tune.txt', entries)
    assert.is_false(ok)
    assert.truthy(tostring(err):find('attention_tune: cannot write the cache ' .. blocker .. '/attention%-tune%.txt: '), err)
    helpers.rmtree(dir)
  end)

  it('the command refuses bad flags and says why nothing could be measured', function()
    local tool = helpers.shq(base.root .. '/bin/ulysses') .. ' ' .. helpers.shq(base.root .. '/tools/tune_attention.lua')
    local out, rc = helpers.run(tool .. ' --dims 32')
    assert.are.equal(2, rc, out)
    assert.truthy(out:find("%-%-dims: '32' is not 64 or 128"), out)
    out, rc = helpers.run(tool .. ' --seq 0')
    assert.are.equal(2, rc, out)
    assert.truthy(out:find('%-%-seq needs a positive integer, got 0'), out)
    out, rc = helpers.run(tool .. ' --heads 6 --kv-heads 4')
    assert.are.equal(2, rc, out)
    assert.truthy(out:find('%-%-heads 6 is not a multiple of %-%-kv%-heads 4'), out)
    out, rc = helpers.run(tool .. ' --kv-heads 4')
    assert.are.equal(2, rc, out)
    assert.truthy(out:find('%-%-kv%-heads needs %-%-heads'), out)
    out, rc = helpers.run('ULY_CUDA_LIB=/nonexistent/libulysses_cuda.so ' .. tool .. ' --dims 64 --no-write')
    assert.are.equal(2, rc, out)
    -- (the reason as uly.cuda gives it: 'no CUDA library at ...', or where libulysses was built
    -- without CUDA, '... looked for ...')
    assert.truthy(out:find('the fwd stage at D 64: its child process ended before measuring anything:\nno CUDA library[^\n]* ' ..
                           '/nonexistent/libulysses_cuda%.so'), out)
  end)
end)

-- the emulator library beside the libulysses in use (build/ or build-asan/)
local lib_dir = (os.getenv('ULY_LIB') or (base.root .. '/build/libulysses.so')):match('^(.*)/[^/]*$') or '.'
local emu = lib_dir .. '/libulysses_cuemu.so'

describe('attention tuning on the CUDA emulator', function()
  local function env(cache, extra)
    return ('ULY_CUDA_LIB=%s ULY_EMU_CC=9.0 ULY_TUNE_CACHE=%s ULY_CUDA_TUNED=1 %s '):format(helpers.shq(emu),
      helpers.shq(cache), extra or '')
  end

  it('measures in children, leaves out a candidate that crashes and one that disagrees, writes the choice', function()
    if not helpers.exists(emu) then pending('no ' .. emu) return end
    local dir = helpers.mkdtemp()
    local cache = dir .. '/tune.txt'
    local out, rc = helpers.run(env(cache, "ULY_TUNE_TEST_CRASH='fwd=ws' ULY_TUNE_TEST_WRONG='bwd=onepass'") ..
      helpers.shq(base.root .. '/bin/ulysses') .. ' ' .. helpers.shq(base.root .. '/tools/tune_attention.lua') ..
      ' --dims 64 --seq 128 --reps 1 --nondeterministic --heads 4 --kv-heads 2')
    assert.are.equal(0, rc, out)
    assert.truthy(out:find('\n  fwd=ws +%- ms +%-  crashed'), out)
    assert.truthy(out:find('\n  fwd=wspp +[%d.]+ ms +0%.0e%+00  ran +attention forward D 64 wgmma %(TMA, warp%-specialised, ping%-pong%)'), out)
    assert.truthy(out:find('\n  bwd=onepass +[%d.]+ ms +[%d.]+e%+00  ran'), out)   -- off by more than the largest value
    local entries = tune.read(cache)
    assert.are.equal(1, #entries)
    local e = entries[1]
    assert.are.equal(64, e.D)
    assert.are.equal('N 128, 4 heads, 2 K/V heads', e.shape)   -- --heads / --kv-heads reached the children
    assert.truthy(e.key:find('^ulysses CUDA emulator, compute capability 9%.0, library %d+%-%d+$'), e.key)
    assert.are_not.equal('ws', e.fwd)
    assert.is_false(e.bwd == 'onepass' and e.dkv == '', tune.label(e))
    assert.truthy(tune.label(e) == 'default' or e.ms <= e.default_ms * (1 - tune.MARGIN), tune.label(e))
    helpers.rmtree(dir)
  end)

  it('runs the cached choice for this GPU and library, unless a variable or ULY_CUDA_TUNED=0 says otherwise', function()
    if not helpers.exists(emu) then pending('no ' .. emu) return end
    local dir = helpers.mkdtemp()
    local cache = dir .. '/tune.txt'
    local probe = dir .. '/probe.lua'
    local f = assert(io.open(probe, 'w'))
    f:write([[
local uly = require 'ulysses'
assert(uly.cuda.ensure())
if arg[1] == 'key' then print('key=' .. require('ulysses.attention_tune').key(uly.cuda.lib())) return end
uly.matmul_precision('bf16')
local q = uly.randn(1, 128, 2, 64, { device = 'cuda' }):requires_grad_()
local k = uly.randn(1, 128, 1, 64, { device = 'cuda' }):requires_grad_()
local v = uly.randn(1, 128, 1, 64, { device = 'cuda' }):requires_grad_()
local report = uly.cuda.profile(function() uly.flash_attention(q, k, v, { causal = true }):sum():backward() end)
for _, kern in ipairs(report.kernels) do
  if kern.name:find('attention') then print('kernel=' .. kern.name) end
end
local c = uly.cuda.attention_choice(64)
print(('choice=%s/%s %s/%s'):format(c.fwd, c.from.fwd, c.bwd, c.from.bwd))
print('described=' .. uly.cuda.describe_attention_choice(64))
uly.cuda.apply_tuned(false)
print('described=' .. uly.cuda.describe_attention_choice(64))
c = uly.cuda.attention_choice(64)
print(('cleared=%s/%s %s/%s'):format(c.fwd, c.from.fwd, c.bwd, c.from.bwd))
]])
    f:close()
    local cmd = helpers.shq(base.root .. '/bin/ulysses') .. ' ' .. helpers.shq(probe)
    local out, rc = helpers.run(env(cache) .. cmd .. ' key')
    assert.are.equal(0, rc, out)
    local key = assert(out:match('key=([^\n]+)'), out)
    tune.write(cache, { { key = key, D = 64, fwd = 'wsov', dq = '', dkv = '', bwd = 'onepass', ms = 1, default_ms = 2 },
                        { key = 'another GPU', D = 64, fwd = 'tma', dq = '', dkv = '', bwd = '', ms = 1, default_ms = 2 } })
    out, rc = helpers.run(env(cache) .. cmd)
    assert.are.equal(0, rc, out)
    assert.truthy(out:find('kernel=attention forward D 64 wgmma %(TMA, warp%-specialised, overlapped%)'), out)
    assert.truthy(out:find('kernel=attention backward dK dV dQ %(one pass%) D 64 wgmma\n'), out)
    assert.truthy(out:find('choice=wsov/tuned onepass/tuned'), out)
    assert.truthy(out:find('cleared=/default /default'), out)   -- uly.cuda.apply_tuned(false)
    assert.truthy(out:find('described=fwd=wsov %(tuned%), bwd=onepass %(tuned%); dQ summed by atomics: its last bits vary run to run\n'), out)
    assert.truthy(out:find('described=the built%-in defaults'), out)
    -- a set variable wins over the cache, variable by variable
    out, rc = helpers.run(env(cache, 'ULY_CUDA_ATTN_FWD=tma') .. cmd)
    assert.are.equal(0, rc, out)
    assert.truthy(out:find('kernel=attention forward D 64 wgmma %(TMA%)\n'), out)
    assert.truthy(out:find('choice=tma/ULY_CUDA_ATTN_FWD onepass/tuned'), out)
    assert.truthy(out:find('described=fwd=tma %(ULY_CUDA_ATTN_FWD%), bwd=onepass %(tuned%);'), out)
    -- ULY_CUDA_TUNED=0: the defaults
    out, rc = helpers.run(env(cache, 'ULY_CUDA_TUNED=0') .. cmd)
    assert.are.equal(0, rc, out)
    assert.truthy(out:find('kernel=attention forward D 64 wgmma\n'), out)
    assert.truthy(out:find('kernel=attention backward dQ D 64 wgmma\n'), out)
    assert.truthy(out:find('choice=/default /default'), out)
    -- a name the library does not know: said once, the defaults run
    tune.write(cache, { { key = key, D = 64, fwd = 'warp9', dq = '', dkv = '', bwd = '', ms = 1, default_ms = 2 } })
    out, rc = helpers.run(env(cache) .. cmd)
    assert.are.equal(0, rc, out)
    assert.truthy(out:find("ulysses: ignoring the tuned attention kernels: attention_tune: the cache .*, head dim 64: " ..
                           "uly_cuda_attention_prefer: ULY_CUDA_ATTN_FWD: no variant 'warp9'"), out)
    assert.truthy(out:find('kernel=attention forward D 64 wgmma\n'), out)
    helpers.rmtree(dir)
  end)
end)
