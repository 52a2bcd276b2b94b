-- bench/gpu.lua — the GPU benchmarks (issue 6): achieved TFLOP/s and MFU against the GPU's
-- dense bf16 peak (uly.cuda.peak_flops: 989 TFLOP/s on an H100 SXM or H200; --peak to change) for
--   1. GEMM: uly.matmul on device tensors (our dispatch, cuBLAS underneath) vs raw cuBLAS on the
--      same shapes, f32 (TF32) and mixed precision (bf16 operands, f32 accumulation);
--   2. attention: uly.flash_attention forward + backward, causal, by N, next to cuDNN's fused
--      attention called through PyTorch (bench/peers/torch_sdpa.py; bf16, as cuDNN requires)
--      when the GPU machine's python3 has torch; ours three ways: f32 (TF32) and bf16 on the
--      chunked cuBLAS path, and bf16 on the fused tensor-core kernels (attention_fused.cu);
--   1b. the step's glue: copies, dtype conversions, binary ops and RoPE at the 1b step's
--      activation shape, in GB/s and against a contiguous clone (cudaMemcpyAsync);
--   2b. decoding: one query against a KV cache, with and without splitting the key band;
--   3. a training step of a Llama-style model (preset 1b: 1.24 B parameters) at 32k tokens:
--      flash attention, activation checkpointing (by default all but attention, whose outputs are
--      kept: backward runs no attention forward; --step-checkpoint full recomputes it too), tiled
--      loss, bf16 matmuls, AdamW, on the tuned attention kernels where tools/tune_attention.lua's
--      cache has a choice for this GPU; one more step under uly.cuda.profile prints the GPU time by kernel,
--      and one more with the untimed attention variants (128-row forward and dQ, 64-query dK/dV);
--      then with bf16 activations, through the bf16 kernels and through converting copies.
-- Never asserts on time. Each timing is the median of --reps runs after a warm-up, bracketed by
-- uly.synchronize('cuda'). FLOPs: GEMM 2 M N K; causal attention forward 2 N^2 D H (half of the
-- dense 4 N^2 D H), backward 2.5x forward; the step counts model FLOPs (6 N_params + 12 L C T per
-- token, halved attention term for causal is not applied: the same formula as train.lua).
--
-- Run (GPU):        bin/ulysses bench/gpu.lua [--peak TFLOPS] [--reps R] [--attn-max N]
--                                            [--step-seq T] [--step-preset NAME] [--no-step]
--                                            [--step-checkpoint except_attention|full]
-- Run (no GPU):     ULY_CUDA_SIMULATE=1 bin/ulysses bench/gpu.lua --quick   (the code path only)
local uly = require 'ulysses'
local ffi = require 'ffi'
local median = require('bench.util').median

local opts = { peak = nil, reps = 3, attn_max = 16384, step_seq = 32768, step_preset = '1b', step = true, quick = false,
               step_checkpoint = 'except_attention' }
do
  local args, i = arg or {}, 1
  local keys = { ['--peak'] = 'peak', ['--reps'] = 'reps', ['--attn-max'] = 'attn_max', ['--step-seq'] = 'step_seq' }
  while i <= #args do
    local a = args[i]
    if keys[a] then opts[keys[a]] = tonumber(args[i + 1]) or error('bench/gpu.lua: ' .. a .. ' needs a number', 0); i = i + 2
    elseif a == '--step-preset' then opts.step_preset = args[i + 1]; i = i + 2
    elseif a == '--step-checkpoint' and (args[i + 1] == 'full' or args[i + 1] == 'except_attention') then
      opts.step_checkpoint = args[i + 1]; i = i + 2
    elseif a == '--no-step' then opts.step = false; i = i + 1
    elseif a == '--quick' then opts.quick = true; i = i + 1
    elseif a == '-h' or a == '--help' then
      print('usage: bin/ulysses bench/gpu.lua [--peak TFLOPS] [--reps R] [--attn-max N] [--step-seq T] [--step-preset NAME] [--no-step] '
            .. '[--step-checkpoint except_attention|full] [--quick]')
      return
    else error('bench/gpu.lua: unknown argument ' .. tostring(a) .. ' (try --help)', 0) end
  end
end

local ok, why = uly.cuda.ensure()
if not ok then
  io.stderr:write('bench/gpu.lua: no CUDA device: ', why, '\n')
  os.exit(1)
end
local backend = uly.cuda.backend()
local lib = backend == 'cuda' and uly.cuda.lib() or nil
local peak_label = 'given'
if not opts.peak then
  local flops, label
  if lib then flops, label = uly.cuda.peak_flops() end
  opts.peak, peak_label = flops and flops / 1e12 or 989, flops and label or ('989 TFLOP/s assumed: ' .. tostring(label or 'no device'))
end
local peak = opts.peak * 1e12
print(('command: bin/ulysses bench/gpu.lua %s'):format(table.concat(arg or {}, ' ')))
if lib then
  for _, d in ipairs(uly.cuda.devices()) do print(('device %d: %s, %.1f GiB'):format(d.index, d.name, d.total_memory / 2^30)) end
else
  print('backend: ' .. tostring(backend) .. ' (host-memory simulation: timings mean nothing, the code path runs)')
end
print(('MFU against %.0f TFLOP/s (%s)'):format(opts.peak, peak_label))

-- the tuned attention kernels (tools/tune_attention.lua's cache; ULY_CUDA_TUNED=0 ignores it): the
-- training step runs on them, as a user's would; the attention tables run the variants as labelled
-- (the built-in defaults where a table's path names none)
local tuned = backend == 'cuda' and uly.cuda.apply_tuned() or {}
local tuned_text = {}
for _, e in ipairs(tuned) do
  tuned_text[#tuned_text + 1] = ('D %d %s (%.2f ms against the default\'s %.2f when tuned, %s)'):format(e.D,
    require('ulysses.attention_tune').label(e), e.ms, e.default_ms, e.date)
end
print('tuned attention kernels: ' .. (#tuned_text > 0 and table.concat(tuned_text, '; ')
      or 'none (the built-in defaults; bin/ulysses tools/tune_attention.lua measures them)'))
if backend == 'cuda' then uly.cuda.apply_tuned(false) end

-- median seconds of fn() over reps after one warm-up, the device synchronised around each run
-- the median of reps timed runs of fn, after one untimed run unless cold
local function time(fn, reps, cold)
  if not cold then fn() end
  uly.synchronize('cuda')
  local t = {}
  for r = 1, reps do
    local t0 = uly.clock()
    fn()
    uly.synchronize('cuda')
    t[r] = uly.clock() - t0
  end
  return median(t)
end

local function tf(flops, s) return flops / s / 1e12 end

---------------------------------------------------------------- 1. GEMM
print('\n== GEMM: ours (uly.matmul, device tensors) vs raw cuBLAS, same shapes')
-- (last column: ours with ULY_CUDA_GEMM=cublas, cuBLAS's GemmEx in place of cuBLASLt's first heuristic;
-- prec bf16: f32 tensors rounded to bf16 on the way in, as f32 activations are; bf16 in: bf16
-- tensors (bf16 activations: nothing rounded on the way in, a bf16 result), against raw cuBLAS's
-- bf16 operands and f32 result)
print(('%-24s %-7s %10s %10s %10s %8s %7s %12s'):format('M x N x K', 'prec', 'ours ms', 'ours TF/s', 'cuBLAS TF/s', 'ratio',
                                                        'MFU', 'via GemmEx'))
local shapes = opts.quick and { { 64, 48, 32 } } or
  { { 4096, 4096, 4096 }, { 8192, 8192, 8192 }, { 32768, 8192, 2048 }, { 32768, 2048, 8192 } }
for _, s in ipairs(shapes) do
  local M, N, K = s[1], s[2], s[3]
  local a, b = uly.randn(M, K, { device = 'cuda' }), uly.randn(K, N, { device = 'cuda' })
  local a16, b16 = a:bf16(), b:bf16()
  for _, prec in ipairs({ 'f32', 'bf16', 'bf16 in' }) do
    local x, y = a, b
    if prec == 'bf16 in' then x, y = a16, b16 end
    uly.matmul_precision(prec == 'f32' and 'f32' or 'bf16')
    local secs = time(function() local c = x:matmul(y) end, opts.reps)
    ffi.C.setenv('ULY_CUDA_GEMM', 'cublas', 1)
    local ex = time(function() local c = x:matmul(y) end, opts.reps)
    ffi.C.setenv('ULY_CUDA_GEMM', '', 1)
    uly.matmul_precision('f32')
    local flops = 2 * M * N * K
    local ref = 'n/a'
    local ratio = ''
    if lib then
      local out = ffi.new('double[1]')
      if lib.uly_cuda_cublas_gemm_seconds(M, N, K, prec == 'f32' and 0 or 1, opts.reps, out) == 0 then
        ref = ('%.1f'):format(tf(flops, out[0]))
        ratio = ('%.2f'):format(out[0] / secs)
      else
        ref = 'error: ' .. ffi.string(lib.uly_cuda_last_error())
      end
    end
    print(('%-24s %-7s %10.3f %10.1f %10s %8s %6.1f%% %12.1f'):format(('%d x %d x %d'):format(M, N, K), prec, secs * 1e3,
                                                           tf(flops, secs), ref, ratio, 100 * flops / secs / peak,
                                                           tf(flops, ex)))
  end
  a, b, a16, b16 = nil, nil, nil, nil
  collectgarbage('collect')
end

---------------------------------------------------------------- 1b. the step's glue
-- copies, conversions, binary ops and RoPE on a [T, C] activation (T 32768, C 2048: the 1b step's),
-- in GB/s moved (each element read and written once) and as a share of a contiguous clone's
-- (one cudaMemcpyAsync: what the memory does)
do
  local T, C, Dh = opts.quick and 64 or 32768, opts.quick and 32 or 2048, opts.quick and 16 or 64
  print(('\n== the step\'s glue on [%d, %d] (heads of %d): GB/s moved, and against a contiguous clone (cudaMemcpyAsync)'):format(T, C, Dh))
  print(('%-44s %10s %10s %10s'):format('op', 'ms', 'GB/s', 'of clone'))
  local x, y = uly.randn(T, C, { device = 'cuda' }), uly.randn(T, C, { device = 'cuda' })
  local xb, bias = x:bf16(), uly.randn(C, { device = 'cuda' })
  local fused = uly.randn(T, 3 * C, { device = 'cuda' })
  local n = T * C
  local cases = {
    { 'clone, f32 (cudaMemcpyAsync)', 8 * n, function() return x:clone() end },
    { 'f32 -> bf16', 6 * n, function() return x:bf16() end },
    { 'bf16 -> f32', 6 * n, function() return xb:float() end },
    { 'a column slice of [T, 3C] -> contiguous, f32', 8 * n, function() return fused:narrow(2, C + 1, C):contiguous() end },
    { '[T, H, D] -> [H, T, D] contiguous, f32', 8 * n,
      function() return x:view(T, C / Dh, Dh):transpose(1, 2):contiguous() end },
    { 'a + b, f32, same shape', 12 * n, function() return x + y end },
    { 'a + bias[C], f32', 8 * n, function() return x + bias end },
    { 'a + b, bf16 + f32 -> f32', 10 * n, function() return xb + y end },
    { 'RoPE, f32 [1, T, H, D]', 8 * n, function() return x:view(1, T, C / Dh, Dh):rope() end },
  }
  local clone_gbs
  for _, c in ipairs(cases) do
    local secs = time(c[3], opts.reps)
    local gbs = c[2] / secs / 1e9
    clone_gbs = clone_gbs or gbs
    print(('%-44s %10.3f %10.1f %9.0f%%'):format(c[1], secs * 1e3, gbs, 100 * gbs / clone_gbs))
  end
  x, y, xb, bias, fused = nil, nil, nil, nil, nil
  collectgarbage('collect')
end

---------------------------------------------------------------- 2. attention
local here = (debug.getinfo(1, 'S').source:match('^@(.*)/[^/]*$') or '.')
-- cuDNN's fused attention through PyTorch: { fwd = s, both = s, backend = name }, or nil and why
local function cudnn_attention(n, H, D)
  if backend ~= 'cuda' then return nil, 'no GPU' end
  local cmd = ('%spython3 %s/peers/torch_sdpa.py attention %d %d %d %d 2>&1'):format(require('bench.util').peer_env(),
                                                                                 here, n, H, D, opts.reps)
  local p = io.popen(cmd)
  local out = p:read('*a')
  p:close()
  local fwd, both = out:match('"fwd_s": ([%d%.e%-]+), "fwd_bwd_s": ([%d%.e%-]+)')
  if not fwd then return nil, (out:match('"error": "([^"]*)"') or out:gsub('\n', ' '):sub(1, 120)) end
  return { fwd = tonumber(fwd), both = tonumber(both), backend = out:match('"backend": "([^"]*)"') }
end
-- the paths: label, matmul precision, ULY_CUDA_ATTN (kernels/cuda/attention_fused.cu takes bf16 at D
-- 32/64/128), ULY_CUDA_ATTN_WGMMA for its kernels ('': decided by its self-check, wgmma on Hopper;
-- '0': the mma.sync kernels), ULY_CUDA_ATTN_BWD ('onepass': dQ with atomics from the dK/dV kernel,
-- D <= 64, and at D 128 from the warp-specialised one), ULY_CUDA_ATTN_FWD ('pipelined': the wgmma
-- forward issues the next tile's S before this softmax; 'rows128': 128 query rows a block, two warpgroups sharing K and V; 'tma': its
-- tiles loaded by TMA, waited for on mbarriers; 'ws': warp-specialised, a TMA producer warp and
-- two consumer warpgroups; 'wspp': those taking turns at the tensor cores; 'wsov', 'wsppov': with
-- each one's P V overlapping its next softmax, on 128-key tiles),
-- ULY_CUDA_ATTN_DKV ('64': the dK/dV kernel's 64-query tiles, D 64; 'rows128': 128 keys a block,
-- two warpgroups sharing Q and dO; 'ws': those two warpgroups fed by a TMA producer warpgroup) and
-- ULY_CUDA_ATTN_DQ ('64': the dQ kernel's 64-key tiles, D 64; 'rows128': 128 query rows a block,
-- two warpgroups sharing K and V; 'ws': those fed by a TMA producer warpgroup)
local all_paths = { { 'f32 chunked', 'f32', 'chunked', '', '', '', '', '' },
                    { 'bf16 chunked', 'bf16', 'chunked', '', '', '', '', '' },
                    { 'bf16 fused', 'bf16', 'fused', '', '', '', '', '' },
                    { 'fused 1-pass', 'bf16', 'fused', '', 'onepass', '', '', '' },
                    { 'fused pipe+1p', 'bf16', 'fused', '', 'onepass', 'pipelined', '', '' },
                    { 'fused mma.sync', 'bf16', 'fused', '0', '', '', '', '' },
                    { 'fused rows128', 'bf16', 'fused', '', '', 'rows128', 'rows128', 'rows128' } }
local fused_paths = { all_paths[3], all_paths[4], all_paths[5], all_paths[6], all_paths[7],   -- the D 64 table's, and:
                      { 'fused dkv64', 'bf16', 'fused', '', '', '', '64', '' }, { 'fused dq64', 'bf16', 'fused', '', '', '', '', '64' },
                      { 'fused bwd64', 'bf16', 'fused', '', '', '', '64', '64' },
                      { 'fused 128+dkv64', 'bf16', 'fused', '', '', 'rows128', '64', 'rows128' } }

-- which fused path ran forward + backward fastest at N, against the default ('bf16 fused', the
-- first): what decides whether a variant becomes the default
local function fastest_line(n, times)
  if #times == 0 then return '' end
  local best = times[1]
  for _, t in ipairs(times) do if t[2] < best[2] then best = t end end
  return ('N %d: fastest fused forward + backward \'%s\', %.2fx the default \'%s\''):format(n, best[1],
    times[1][2] / best[2], times[1][1])
end

-- causal forward + backward at B 1, H heads of D, N from 4096 (quick: 128) doubling up to n_max,
-- every path against cuDNN's fused kernel on the same shape (no_peer: without it)
local function attention_table(H, D, paths, n_max, no_peer)
  print(('\n== flash attention, causal, forward + backward (B 1, H %d, D %d): ours (%s) vs cuDNN fused (bf16)')
        :format(H, D, #paths == #all_paths and 'f32 with TF32 chunked cuBLAS, bf16 chunked, bf16 fused tensor-core kernels'
                                          or 'bf16 fused tensor-core kernels'))
  print(('%-8s %-14s %10s %10s %10s %10s %7s %14s %10s'):format('N', 'path', 'fwd ms', 'bwd ms', 'fwd TF/s', 'f+b TF/s',
                                                            'MFU', 'cuDNN f+b TF/s', 'ours/cuDNN'))
  local peer_note
  local n = opts.quick and 128 or 4096
  while n <= (opts.quick and 128 or n_max) do
    local q = uly.randn(1, n, H, D, { device = 'cuda' }):requires_grad_()
    local k = uly.randn(1, n, H, D, { device = 'cuda' }):requires_grad_()
    local v = uly.randn(1, n, H, D, { device = 'cuda' }):requires_grad_()
    local g = uly.randn(1, n, H, D, { device = 'cuda' })
    local f_flops = 2 * n * n * D * H
    local peer, why
    if no_peer then why = 'not run for this table' else peer, why = cudnn_attention(n, H, D) end
    local c_col = 'n/a'
    if peer then
      c_col = ('%.1f'):format(tf(3.5 * f_flops, peer.both))
      peer_note = 'peer: PyTorch scaled_dot_product_attention, backend ' .. tostring(peer.backend)
    else
      peer_note = 'cuDNN column: ' .. tostring(why)
    end
    local fused_times = {}   -- forward + backward seconds of each fused path at this N
    for _, path in ipairs(paths) do
      uly.matmul_precision(path[2])
      ffi.C.setenv('ULY_CUDA_ATTN', path[3], 1)
      ffi.C.setenv('ULY_CUDA_ATTN_WGMMA', path[4], 1)
      ffi.C.setenv('ULY_CUDA_ATTN_BWD', path[5], 1)
      ffi.C.setenv('ULY_CUDA_ATTN_FWD', path[6], 1)
      ffi.C.setenv('ULY_CUDA_ATTN_DKV', path[7], 1)
      ffi.C.setenv('ULY_CUDA_ATTN_DQ', path[8], 1)
      local fwd = time(function() local o = uly.no_grad(uly.flash_attention, q, k, v, { causal = true }) end, opts.reps)
      local both = time(function()
        local o = uly.flash_attention(q, k, v, { causal = true })
        o:backward(g)
      end, opts.reps)
      print(('%-8d %-14s %10.2f %10.2f %10.1f %10.1f %6.1f%% %14s %10s'):format(n, path[1], fwd * 1e3, (both - fwd) * 1e3,
        tf(f_flops, fwd), tf(3.5 * f_flops, both), 100 * 3.5 * f_flops / both / peak, c_col,
        peer and ('%.2f'):format(peer.both / both) or ''))
      if path[3] == 'fused' then fused_times[#fused_times + 1] = { path[1], both } end
    end
    print(fastest_line(n, fused_times))
    uly.matmul_precision('f32')
    ffi.C.setenv('ULY_CUDA_ATTN', 'fused', 1)
    ffi.C.setenv('ULY_CUDA_ATTN_WGMMA', '', 1)
    ffi.C.setenv('ULY_CUDA_ATTN_BWD', '', 1)
    ffi.C.setenv('ULY_CUDA_ATTN_FWD', '', 1)
    ffi.C.setenv('ULY_CUDA_ATTN_DKV', '', 1)
    ffi.C.setenv('ULY_CUDA_ATTN_DQ', '', 1)
    q, k, v, g = nil, nil, nil, nil
    collectgarbage('collect')
    n = n * 2
  end
  if peer_note then print(peer_note) end
  print('fused kernels on wgmma: ' .. tostring(uly.cuda.wgmma_status(D)))
end
-- head dim 128 (every path), then the 1b preset's 64 (32 heads; the fused kernels, which its
-- training step runs)
attention_table(opts.quick and 2 or 16, opts.quick and 32 or 128, all_paths, opts.attn_max)
attention_table(opts.quick and 2 or 32, 64, fused_paths, opts.attn_max)

---------------------------------------------------------------- 2b. decoding
-- one new token's attention against a KV cache (the 1b preset's 32 query / 8 K/V heads, D 64),
-- bf16 fused: the key band in one block per head (splits 1) or split over blocks (flash-decoding).
-- The time includes rounding the f32 cache to bf16, which the fused path does per call.
do
  local Hq, Hk, Dd = opts.quick and 4 or 32, opts.quick and 1 or 8, 64
  print(('\n== decoding: 1 query x Tk cached keys (B 1, H %d, K/V heads %d, D %d), bf16 fused'):format(Hq, Hk, Dd))
  print(('%-8s %-10s %10s %12s'):format('Tk', 'splits', 'us/call', 'cache GB/s'))
  uly.matmul_precision('bf16')
  for _, tk in ipairs(opts.quick and { 200 } or { 4096, 32768 }) do
    local q = uly.randn(1, 1, Hq, Dd, { device = 'cuda' })
    local k = uly.randn(1, tk, Hk, Dd, { device = 'cuda' })
    local v = uly.randn(1, tk, Hk, Dd, { device = 'cuda' })
    for _, splits in ipairs({ '1', '0' }) do   -- 0: the kernel's own choice
      ffi.C.setenv('ULY_CUDA_ATTN_SPLITS', splits, 1)
      local s = time(function() uly.no_grad(uly.flash_attention, q, k, v, { causal = true }) end, opts.reps)
      print(('%-8d %-10s %10.1f %12.1f'):format(tk, splits == '1' and '1' or 'auto', s * 1e6, 2 * tk * Hk * Dd * 4 / s / 1e9))
    end
    q, k, v = nil, nil, nil
    collectgarbage('collect')
  end
  ffi.C.setenv('ULY_CUDA_ATTN_SPLITS', '0', 1)
  uly.matmul_precision('f32')
end

---------------------------------------------------------------- 3. training step
-- variant_step(fwd, dq, dkv[, bwd]): one step with those attention variants (ULY_CUDA_ATTN_FWD,
-- _DQ, _DKV, _BWD), as a line (section 4 times the TMA kernels' steps with it, last)
local variant_step
if opts.step then
  local Llama = require 'models.llama'
  local preset, T = opts.quick and 'tiny' or opts.step_preset, opts.quick and 64 or opts.step_seq
  local keep = opts.step_checkpoint == 'except_attention'
  local checkpoint = keep and 'except_attention' or true
  print(('\n== training step: Llama %s, 1 x %d tokens, flash + checkpoint%s + tiled loss, bf16 matmuls, AdamW'):format(
        preset, T, keep and ' (except attention)' or ''))
  uly.manual_seed(1)
  local model = Llama({ preset = preset, seq = T, checkpoint = checkpoint, tile = math.min(T, 4096) }):to('cuda')
  local opt = uly.optim.AdamW(model:parameters(), { lr = 1e-4 })
  local vocab = model.config.vocab
  local x = uly.tensor(uly.no_grad(function()
    local rows = {}
    for t = 1, T do rows[t] = (t * 7919) % vocab end
    return { rows }
  end), { dtype = 'i32' }):cuda()
  uly.matmul_precision('bf16')
  if #tuned > 0 then
    uly.cuda.apply_tuned()
    print('(the step on the tuned attention kernels: ' .. table.concat(tuned_text, '; ') .. ')')
  end
  uly.reset_peak_memory('cuda')
  uly.synchronize('cuda')
  uly.cuda.temporaries_peak(true)
  local losses = {}
  local step_s = time(function()
    opt:zero_grad()
    local loss = model:loss(x, x)
    loss:backward()
    opt:step()
    losses[#losses + 1] = loss:item()
  end, opts.quick and 1 or 1)
  -- where one more step's time goes: the device synchronised between its phases
  local phases, t0 = {}, nil
  local function mark(name)
    uly.synchronize('cuda')
    local now = uly.clock()
    phases[#phases + 1] = ('%s %.2f s'):format(name, now - t0)
    t0 = now
  end
  t0 = uly.clock()
  opt:zero_grad()
  local loss = model:loss(x, x)
  mark('forward')
  loss:backward()
  mark('backward (checkpoint recomputation included)')
  opt:step()
  mark('optimizer')
  loss = nil
  local pool_peak, temporaries = uly.memory('cuda').peak, uly.cuda.temporaries_peak()   -- before the attention runs below
  -- one more step under the profiler: the GPU's time by kernel (uly.cuda.profile)
  local profile_text = 'n/a (no CUDA backend: the simulation)'
  if backend == 'cuda' then
    local report = uly.cuda.profile(function()
      opt:zero_grad()
      model:loss(x, x):backward()
      opt:step()
    end)
    profile_text = uly.cuda.format_profile(report, opts.quick and 5 or 30)
  end
  -- the step's attention alone, at its shape (B 1, T, heads / K/V heads of dim / heads): each layer
  -- runs one forward in the forward pass and a backward (after a recomputed forward unless kept)
  local c = model.config
  local hd = math.floor(c.dim / c.heads)
  local aq = uly.randn(1, T, c.heads, hd, { device = 'cuda' }):requires_grad_()
  local ak = uly.randn(1, T, c.kv_heads, hd, { device = 'cuda' }):requires_grad_()
  local av = uly.randn(1, T, c.kv_heads, hd, { device = 'cuda' }):requires_grad_()
  local ag = uly.randn(1, T, c.heads, hd, { device = 'cuda' })
  local a_fwd = time(function() uly.no_grad(uly.flash_attention, aq, ak, av, { causal = true }) end, opts.reps)
  local a_both = time(function() uly.flash_attention(aq, ak, av, { causal = true }):backward(ag) end, opts.reps)
  aq, ak, av, ag = nil, nil, nil, nil
  -- the same step with the attention variants not yet timed on a GPU (bench tables above): 128-row
  -- forward and dQ with 64-query dK/dV, and with 128-key dK/dV; the defaults should follow
  -- whichever is faster (the TMA kernels: section 4)
  variant_step = function(...)
    local env, names, set = { ... }, { 'ULY_CUDA_ATTN_FWD', 'ULY_CUDA_ATTN_DQ', 'ULY_CUDA_ATTN_DKV', 'ULY_CUDA_ATTN_BWD' }, {}
    for i, name in ipairs(names) do
      ffi.C.setenv(name, env[i] or '', 1)
      if (env[i] or '') ~= '' then set[#set + 1] = name .. '=' .. env[i] end
    end
    uly.matmul_precision('bf16')
    if #tuned > 0 then uly.cuda.apply_tuned(false) end   -- the variants as named, the built-in defaults elsewhere
    -- one step, no warm-up (the model and the step are warm; a variant's first launch adds only its
    -- kernels' loading and set-up, milliseconds): the check's time budget holds five such steps
    local variant_s = time(function()
      opt:zero_grad()
      model:loss(x, x):backward()
      opt:step()
    end, 1, true)
    uly.matmul_precision('f32')
    for _, name in ipairs(names) do ffi.C.setenv(name, '', 1) end
    return ('step with %s: %.2f s, MFU %.1f%% (%.2fx the step above)'):format(
      table.concat(set, ' '), variant_s, 100 * model:flops_per_token(T) * T / variant_s / peak, step_s / variant_s)
  end
  local variant_lines = { variant_step('rows128', 'rows128', '64'), variant_step('rows128', 'rows128', 'rows128') }
  -- the same step with bf16 activations (uly.activation_dtype): through the kernels that read and
  -- write bf16, then through converting copies around the f32 kernels (the same bits; what the
  -- bf16 kernels save in memory traffic); peak memory of each
  local function activations_step(kernels)
    uly.matmul_precision('bf16')
    uly.activation_dtype('bf16')
    if #tuned > 0 then uly.cuda.apply_tuned() end
    local prev = uly.cuda.bf16_kernels(kernels)
    uly.reset_peak_memory('cuda')
    local s = time(function()
      opt:zero_grad()
      model:loss(x, x):backward()
      opt:step()
    end, 1, not kernels)   -- the first one after a warm-up step (new block sizes in the pool)
    local peak_b = uly.memory('cuda').peak
    uly.cuda.bf16_kernels(prev)
    uly.activation_dtype('f32')
    uly.matmul_precision('f32')
    return ('step with bf16 activations (%s): %.2f s, MFU %.1f%% (%.2fx the step above), peak device memory %.1f GiB'):format(
      kernels and 'bf16 kernels' or 'converting copies around the f32 kernels', s,
      100 * model:flops_per_token(T) * T / s / peak, step_s / s, peak_b / 2^30)
  end
  variant_lines[#variant_lines + 1] = activations_step(true)
  variant_lines[#variant_lines + 1] = activations_step(false)
  local a_step = c.layers * (keep and a_both or a_fwd + a_both)
  local attention_line = ('attention at the step\'s shape (%d heads, %d K/V, D %d): %.1f ms forward, %.1f ms backward a layer;'
    .. ' %d layers x (forward + %sbackward) = %.2f s of the step'):format(c.heads, c.kv_heads, hd,
    a_fwd * 1e3, (a_both - a_fwd) * 1e3, c.layers, keep and '' or 'recomputed forward + ', a_step)
  uly.matmul_precision('f32')
  local flops = model:flops_per_token(T) * T
  print(('parameters %.3f B, %.1f GFLOP/token (model FLOPs), loss %.3f -> %.3f'):format(model:num_parameters() / 1e9,
        model:flops_per_token(T) / 1e9, losses[1], losses[#losses]))
  print(('step %.2f s, %.0f tokens/s, %.1f TFLOP/s, MFU %.1f%%, peak device memory %.1f GiB'):format(step_s, T / step_s,
        tf(flops, step_s), 100 * flops / step_s / peak, pool_peak / 2^30))
  print('one step: ' .. table.concat(phases, ', '))
  print(table.concat(variant_lines, '\n'))
  print(attention_line)
  print('GPU time by kernel in one step (uly.cuda.profile; events around each launch):\n' .. profile_text)
  -- the memory planner's GPU mode next to what the step took (pool peak; kernels' temporaries)
  local plan = require 'tools.plan'
  local est = plan.estimate { model = 'llama', preset = preset, seq = T, checkpoint = checkpoint, tile = math.min(T, 4096),
                              device = 'cuda', precision = 'bf16', device_memory = uly.memory('cuda').limit }
  print(('memory: pool peak %s (planner %s), kernels\' temporaries %s (planner %s)'):format(
    plan.format_bytes(pool_peak), plan.format_bytes(est.total),
    temporaries and plan.format_bytes(temporaries) or 'n/a', plan.format_bytes(est.untracked)))
end

---------------------------------------------------------------- 4. the TMA kernels
-- Last: a fault in these kernels on a GPU (an mbarrier wait that never completes traps) leaves
-- the context unusable for anything after it. The default fused kernels beside the forward with
-- TMA loads (ULY_CUDA_ATTN_FWD=tma), the warp-specialised forward (ws; wspp: with ping-pong;
-- wsov, wsppov: with P V overlapping the next tile's softmax), it
-- with the warp-specialised dK/dV (ULY_CUDA_ATTN_DKV=ws) and dQ too (ULY_CUDA_ATTN_DQ=ws), or
-- with that dK/dV adding dQ in one pass (ULY_CUDA_ATTN_BWD=onepass), the same two after the
-- overlapped forward (wsov: FlashAttention-3's kernels, 128 x 128 forward tiles, 64-query dK/dV),
-- and that dK/dV after the 128-row forward and dQ, at the two head dims (D 64 at the 1b preset's
-- 32 heads). The step then runs on the overlapped forward with either backward.
do
  local tma_paths = { all_paths[3], { 'fused tma', 'bf16', 'fused', '', '', 'tma', '', '' },
                      { 'fused ws', 'bf16', 'fused', '', '', 'ws', '', '' },
                      { 'fused wspp', 'bf16', 'fused', '', '', 'wspp', '', '' },
                      { 'fused wsov', 'bf16', 'fused', '', '', 'wsov', '', '' },
                      { 'fused wsppov', 'bf16', 'fused', '', '', 'wsppov', '', '' },
                      { 'fused ws+dkvws', 'bf16', 'fused', '', '', 'ws', 'ws', '' },
                      { 'fused all ws', 'bf16', 'fused', '', '', 'ws', 'ws', 'ws' },
                      { 'fused ws 1-pass', 'bf16', 'fused', '', 'onepass', 'ws', 'ws', '' },
                      { 'fused all ws ov', 'bf16', 'fused', '', '', 'wsov', 'ws', 'ws' },
                      { 'fused ov 1-pass', 'bf16', 'fused', '', 'onepass', 'wsov', 'ws', '' },
                      { 'fused 128+dkvws', 'bf16', 'fused', '', '', 'rows128', 'ws', 'rows128' } }
  print('\n== the TMA kernels (last: a fault in them ends the run)')
  for _, hd in ipairs({ { opts.quick and 2 or 16, opts.quick and 64 or 128 }, { opts.quick and 2 or 32, 64 } }) do
    local ok, err = pcall(attention_table, hd[1], hd[2], tma_paths, opts.attn_max, true)
    if not ok then print(('TMA kernels at D %d: %s'):format(hd[2], tostring(err))) break end
  end
  if variant_step then   -- the training step of section 3 on the warp-specialised kernels
    for _, v in ipairs({ { 'wsov', 'ws', 'ws' }, { 'wsov', '', 'ws', 'onepass' } }) do
      local ok, line = pcall(variant_step, unpack(v))
      print(ok and line or ('step on the warp-specialised kernels: ' .. tostring(line)))
    end
  end
end
