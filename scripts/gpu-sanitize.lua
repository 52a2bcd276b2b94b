-- scripts/gpu-sanitize.lua — a small run of the bf16 attention kernels, fused
-- (kernels/cuda/attention_fused.cu: forward, dK/dV, dQ) and chunked (attention.cu: cuBLAS with
-- the masked softmax and dS row kernels; the fused forward both on wgmma where a Hopper GPU's
-- self-check enables it and on mma.sync; the two-warpgroup and, last, the TMA and
-- warp-specialised variants), at head dims 32, 64, 128 with causal, window,
-- block-sparse and document masks, for scripts/gpu-check.sh to run under NVIDIA's
-- compute-sanitizer (racecheck: shared-memory hazards between threads; memcheck: out-of-bounds
-- and misaligned accesses). Small shapes: the tools slow kernels down a hundredfold. Checks the
-- values against the CPU on the same bf16-rounded inputs and exits 1 on any error.
--   compute-sanitizer --tool racecheck --error-exitcode 3 luajit scripts/gpu-sanitize.lua
local dir = (arg and arg[0] or ''):match('^(.*)scripts/[^/]*$') or './'
package.path = dir .. 'lua/?.lua;' .. dir .. 'lua/?/init.lua;' .. package.path
local uly = require 'ulysses'
local ffi = require 'ffi'
io.stdout:setvbuf('line')   -- each line out at once: a run that dies shows how far it got

local ok, why = uly.cuda.ensure()
if not ok then io.stderr:write('gpu-sanitize: no CUDA device: ', tostring(why), '\n'); os.exit(1) end

local function max_rel_err(a, b)
  local x, y = a:float():totable(), b:float():totable()
  local worst, big = 0, 0
  local function walk(p, q)
    if type(p) == 'table' then for i = 1, #p do walk(p[i], q[i]) end return end
    worst = math.max(worst, math.abs(p - q))
    big = math.max(big, math.abs(q))
  end
  walk(x, y)
  return worst / math.max(big, 1e-30)
end

local function run(device, precision, q, k, v, opts)
  uly.matmul_precision(precision)
  local a, b, c = q:detach():to(device):requires_grad_(), k:detach():to(device):requires_grad_(),
                  v:detach():to(device):requires_grad_()
  local o_ = {}
  for key, x in pairs(opts) do o_[key] = uly.is_tensor(x) and x:to(device) or x end
  local o = uly.flash_attention(a, b, c, o_)
  o:sum():backward()
  uly.matmul_precision('f32')
  return { o:detach():cpu(), a.grad:cpu(), b.grad:cpu(), c.grad:cpu() }
end

local T, failed = 100, false
uly.manual_seed(7)
local docs = uly.cat({ uly.full({ 1, 40 }, 0, { dtype = 'i32' }), uly.full({ 1, T - 40 }, 1, { dtype = 'i32' }) }, 2)
local layout = uly.attention_layouts.from_function(4, 4, function(r, c) return c == 0 or c == r end)
local cases = { { 'causal', { causal = true } }, { 'window', { window = { 30, 5 } } },
                { 'layout', { block_layout = layout, block_size = 32, causal = true } },
                { 'documents', { causal = true, q_doc = docs, k_doc = docs } } }
-- the variables each path sets: ULY_CUDA_ATTN, _WGMMA, _BWD, _FWD, _DQ, _DKV
local env = {
  fused = { 'fused', '', '', '', '', '' },            -- its kernels on wgmma where the self-check put them (Hopper)
  ['fused-mma'] = { 'fused', '0', '', '', '', '' },   -- on mma.sync
  ['fused-1pass'] = { 'fused', '', 'onepass', '', '', '' },   -- dQ with atomics from dK/dV (D 32, 64; 128: two passes)
  ['fused-pipe'] = { 'fused', '', '', 'pipelined', '', '' },  -- the next tile's S issued before this softmax
  chunked = { 'chunked', '', '', '', '', '' },
  ['fused-128'] = { 'fused', '', '', 'rows128', 'rows128', 'rows128' },   -- two warpgroups a block
  ['fused-ws'] = { 'fused', '', '', 'ws', 'ws', 'ws' },   -- warp-specialised on TMA
  ['fused-wspp'] = { 'fused', '', '', 'wspp', '', '' },   -- its forward's ping-pong
  ['fused-ws1p'] = { 'fused', '', 'onepass', 'ws', '', 'ws' },   -- its dK/dV adding dQ (one pass)
  ['fused-wsppov'] = { 'fused', '', '', 'wsppov', '', '' },   -- its forward's ping-pong and intra-warpgroup overlap
}
local names = { 'ULY_CUDA_ATTN', 'ULY_CUDA_ATTN_WGMMA', 'ULY_CUDA_ATTN_BWD', 'ULY_CUDA_ATTN_FWD', 'ULY_CUDA_ATTN_DQ',
                'ULY_CUDA_ATTN_DKV' }
local inputs = {}
for _, D in ipairs({ 32, 64, 128 }) do
  local r = function(t) return t:bf16():float() end
  inputs[D] = { r(uly.randn(1, T, 4, D)), r(uly.randn(1, T, 2, D)), r(uly.randn(1, T, 2, D)) }
end
local function check(D, case, path)
  local q, k, v = unpack(inputs[D])
  local name, opts = case[1], case[2]
  local cpu = run('cpu', 'f32', q, k, v, opts)
  for i, var in ipairs(names) do ffi.C.setenv(var, env[path][i], 1) end
  local gpu = run('cuda', 'bf16', q, k, v, opts)
  uly.synchronize('cuda')
  for i, var in ipairs(names) do ffi.C.setenv(var, i == 1 and 'fused' or '', 1) end
  local worst = 0
  for i = 1, 4 do worst = math.max(worst, max_rel_err(gpu[i], cpu[i])) end
  local bad = worst > 2e-2
  failed = failed or bad
  print(('D %3d %-9s %-11s max error %.2e of the largest value%s'):format(D, name, path, worst, bad and '  TOO LARGE' or ''))
end
for _, D in ipairs({ 32, 64, 128 }) do
  for _, case in ipairs(cases) do
    for _, path in ipairs({ 'fused', 'fused-mma', 'fused-1pass', 'fused-pipe', 'chunked', 'fused-128' }) do check(D, case, path) end
  end
end
-- last: the TMA kernels (a fault in them, an mbarrier wait that traps, ends the process)
for _, D in ipairs({ 64, 128 }) do
  for _, case in ipairs(cases) do
    for _, path in ipairs({ 'fused-ws', 'fused-wspp', 'fused-ws1p', 'fused-wsppov' }) do check(D, case, path) end
  end
end
print('fused kernels on wgmma: ' .. tostring(uly.cuda.wgmma_status()))
if failed then os.exit(1) end
print('gpu-sanitize: ok')
