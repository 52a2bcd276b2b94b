-- scripts/gpu-profile.lua — the workloads scripts/gpu-profile.sh puts under ncu, one per call:
--   attention D   one bf16 fused causal attention forward + backward (B 1, N 4096, D 64 with 32
--                 heads or D 128 with 16)
--   gemm f32|bf16 one 4096^3 uly.matmul
-- each run once to warm up (cuBLASLt's heuristic, the wgmma self-check, the pool) and once inside
-- a profiler range (uly.cuda.profiler), which is all `ncu --profile-from-start off` records.
-- Also runs without ncu (and on the emulator: ULY_CUDA_LIB=build/libulysses_cuemu.so, small sizes
-- with --small), printing what it ran.
local dir = (arg and arg[0] or ''):match('^(.*)scripts/[^/]*$') or './'
package.path = dir .. 'lua/?.lua;' .. dir .. 'lua/?/init.lua;' .. package.path
local uly = require 'ulysses'

local what, param, small = arg[1], arg[2], arg[3] == '--small'
local function usage(msg)
  io.stderr:write('gpu-profile.lua: ', msg, '\nusage: luajit scripts/gpu-profile.lua attention 64|128 [--small]',
                  ' | gemm f32|bf16 [--small]\n')
  os.exit(2)
end
if what ~= 'attention' and what ~= 'gemm' then usage('unknown workload ' .. tostring(what)) end
if what == 'attention' and param ~= '64' and param ~= '128' then
  usage('attention takes head dim 64 or 128, got ' .. tostring(param))
end
if what == 'gemm' and param ~= 'f32' and param ~= 'bf16' then usage('gemm takes f32 or bf16, got ' .. tostring(param)) end
local ok, why = uly.cuda.ensure()
if not ok then io.stderr:write('gpu-profile.lua: no CUDA device: ', tostring(why), '\n'); os.exit(1) end

-- fn() once to warm up, then once more inside the profiler range
local function twice(fn)
  fn()
  uly.synchronize('cuda')
  uly.cuda.profiler(true)
  fn()
  uly.synchronize('cuda')
  uly.cuda.profiler(false)
end

if what == 'attention' then
  local D = tonumber(param)
  local N, H = small and 128 or 4096, D == 64 and 32 or 16
  if small then H = 2 end
  uly.matmul_precision('bf16')
  local q = uly.randn(1, N, H, D, { device = 'cuda' }):requires_grad_()
  local k = uly.randn(1, N, H, D, { device = 'cuda' }):requires_grad_()
  local v = uly.randn(1, N, H, D, { device = 'cuda' }):requires_grad_()
  twice(function()
    local o = uly.flash_attention(q, k, v, { causal = true })
    o:sum():backward()
  end)
  print(('attention: B 1, N %d, H %d, D %d, causal, bf16, forward + backward, the second profiled; wgmma at D %d: %s'):format(
    N, H, D, D, tostring(uly.cuda.wgmma_status(D))))
else
  local n = small and 64 or 4096
  local a, b = uly.randn(n, n, { device = 'cuda' }), uly.randn(n, n, { device = 'cuda' })
  uly.matmul_precision(param)
  twice(function() local c = a:matmul(b) end)
  print(('gemm: %d^3, %s (TF32 %s), the second profiled'):format(n, param, tostring(uly.cuda.tf32())))
end
