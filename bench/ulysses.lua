-- bench/ulysses.lua — what the DeepSpeed-Ulysses exchanges cost: time and bytes of the sequence
-- all-to-all alone and of a whole transformer layer, at several sequence lengths N, for the P
-- ranks this process runs with (one SP group over the whole world).
--
-- Rank 0 prints four tables (it never asserts on time):
--  1. the exchange alone: forward = qkv_to_heads + heads_to_seq, backward = their inverses; median
--     ms over several reps (slowest rank per rep), bytes each rank sent (from uly.dist.stats())
--     next to the exact formula and to the paper's one, their ratios and the achieved GB/s;
--  2. a whole layer (nn.Block whose attention is nn.DistributedAttention): forward+backward ms,
--     the all-to-all seconds counted by the comm layer (its waits for slower ranks included) and
--     their share of the step, bytes per rank;
--  3. copies: uly.dist.exchange_copies() per exchange / layer, forward and backward;
--  4. bytes per rank per layer forward of Megatron-style SP and ring attention, COMPUTED from
--     formulas (not measured) next to Ulysses' measured bytes.
-- Formulas (bytes per rank per layer forward, ES bytes an element (4 in f32, 2 in bf16); B batch,
-- N tokens, C = H * D, G K/V heads):
--   paper:  ES * B * (N/P) * (C + 2*C*G/H + C) * (P-1)/P    (Q, K, V, O; K/V scaled by G/H)
--   exact:  sum over ranks j ~= r of ES * B * D * (n_r * (hq_j + 2 gk_j) + n_j * hq_r)
--           n_j = tokens of rank j (first N % P ranks get one more), hq_j = its query heads
--           (first H % P ranks get one more), gk_j = the K/V heads those query heads use
--           (>= 1 per destination: with G < P a K/V head goes to every rank that needs it, so
--           exact > paper there). Backward sends what the forward received:
--           sum over j ~= r of ES * B * D * (n_j * (hq_r + 2 gk_r) + n_r * hq_j).
--   Megatron-SP (paper: O(N) per rank, independent of P): 2 all-gathers + 2 reduce-scatters of
--           the [B, N, C] activations: 4 * ES * B * N * C * (P-1)/P.
--   ring attention: every K/V block visits every rank: ES * 2 * B * N * C * (G/H) * (P-1)/P
--           (forward only; its backward also circulates dK, dV).
--
-- Run (bench/ulysses.sh does this for P = 1, 2, 4):
--   mpirun --oversubscribe --bind-to none --mca mpi_yield_when_idle 1 -np P \
--     bin/ulysses bench/ulysses.lua [--exchange-n 4096,16384,65536] [--layer-n 2048,8192]
--     [--models llama,gpt] [--reps 5] [--layer-reps 3] [--threads T] [--device cpu|cuda]
--     [--precision f32|bf16]
-- --device cuda: the tensors on each rank's GPU (NCCL between GPUs of their own, host staging
-- between ranks sharing one); --precision bf16: bf16 matmuls and exchanges (ES = 2 bytes an
-- element in every formula below instead of 4).
-- With P > 1 each rank uses 1 thread unless --threads says otherwise (P = 1: the library default).
-- The layer's local attention is nn.flash_attend when the library has it (then --layer-n may go
-- past 8192), else the reference kernel, which stores N^2 probabilities per head: N <= 8192 only.
local ffi = require 'ffi'
local uly = require 'ulysses'
local dist, nn = uly.dist, uly.nn

---------------------------------------------------------------- options
local opts = { ['exchange-n'] = '4096,16384,65536', ['layer-n'] = nil, models = 'llama,gpt',
               reps = 5, ['layer-reps'] = 3, threads = nil, device = 'cpu', precision = 'f32' }
local NUMERIC = { reps = true, ['layer-reps'] = true, threads = true }
local function usage()
  return 'usage: [mpirun -np P] bin/ulysses bench/ulysses.lua [--exchange-n N,...] [--layer-n N,...] ' ..
         '[--models llama,gpt] [--reps R] [--layer-reps R] [--threads T] [--device cpu|cuda] [--precision f32|bf16]'
end
do
  local args, i = arg or {}, 1
  while i <= #args do
    local k = args[i]:match('^%-%-([%w-]+)$')
    if k == 'help' then print(usage()) os.exit(0) end
    if not k or (opts[k] == nil and k ~= 'layer-n' and k ~= 'threads') or args[i + 1] == nil then
      error('bench/ulysses.lua: bad argument ' .. tostring(args[i]) .. '\n' .. usage(), 0)
    end
    local v = args[i + 1]
    if NUMERIC[k] then
      v = tonumber(v)
      if not v or v < 1 or v ~= math.floor(v) then error('bench/ulysses.lua: --' .. k .. ' needs a positive integer', 0) end
    end
    opts[k] = v
    i = i + 2
  end
end

local function int_list(s, what)
  local out = {}
  for w in tostring(s):gmatch('[^,]+') do
    local n = tonumber(w)
    if not n or n < 1 or n ~= math.floor(n) then error('bench/ulysses.lua: ' .. what .. ': bad length ' .. w, 0) end
    out[#out + 1] = n
  end
  return out
end

-- the layer configurations: Llama-style (GQA, RMSNorm, SwiGLU, RoPE) and GPT-style (G = H)
local MODELS = {
  llama = { name = 'llama', C = 256, H = 8, G = 2, B = 1, norm = 'rmsnorm', mlp = 'swiglu', hidden = 688,
            rope = true, bias = false },
  gpt = { name = 'gpt', C = 256, H = 8, G = 8, B = 1, norm = 'layernorm', mlp = 'gelu', hidden = 1024,
          rope = false, bias = true },
}

---------------------------------------------------------------- helpers
local median = require('bench.util').median

-- the largest of each value over the world (so a time is the slowest rank's)
local function world_max(world, values)
  local t = uly.tensor(values, { dtype = 'f64', device = 'cpu' })
  world:all_reduce_(t, 'max')
  local p = ffi.cast('double *', t:data_ptr())
  local out = {}
  for i = 1, #values do out[i] = p[i - 1] end
  return out
end

local function sysconf_cores()
  pcall(ffi.cdef, 'long sysconf(int);')
  local ok, n = pcall(function() return tonumber(ffi.C.sysconf(84)) end) -- _SC_NPROCESSORS_ONLN
  return ok and n or nil
end

local function mb(bytes) return string.format('%.3f', bytes / 1e6) end
-- bytes an exchanged element takes (bf16 precision exchanges bf16)
local function ES() return opts.precision == 'bf16' and 2 or 4 end
-- the device's queued work done, before a clock is read
local function sync() if opts.device ~= 'cpu' then uly.synchronize(opts.device) end end
local function ratio(a, b) return b > 0 and string.format('%.2f', a / b) or '-' end
local function gbps(bytes, s) return (bytes > 0 and s > 0) and string.format('%.2f', bytes / s / 1e9) or '-' end

-- one row per line, columns padded to the widest cell
local function print_table(title, header, rows, notes)
  local w = {}
  for i, h in ipairs(header) do w[i] = #h end
  for _, row in ipairs(rows) do for i, c in ipairs(row) do w[i] = math.max(w[i], #tostring(c)) end end
  local function line(cells)
    local out = {}
    for i, c in ipairs(cells) do out[i] = string.format('%' .. w[i] .. 's', tostring(c)) end
    return '  ' .. table.concat(out, '  ')
  end
  dist.print0('')
  dist.print0(title)
  dist.print0(line(header))
  for _, row in ipairs(rows) do dist.print0(line(row)) end
  for _, n in ipairs(notes or {}) do dist.print0('  ' .. n) end
end

---------------------------------------------------------------- formulas
-- query heads of rank j and the K/V heads they use
local function heads_of(m, P, j)
  local hd = dist.heads(m.H, m.G, P, j)
  return hd.q_count, hd.kv_count
end

-- exact bytes rank r sends forward and backward (QKV exchange + output exchange)
local function exact_bytes(m, N, P, r)
  local D = m.C / m.H
  local _, n_r = dist.split(N, P, r)
  local hq_r, gk_r = heads_of(m, P, r)
  local fwd, bwd = 0, 0
  for j = 0, P - 1 do
    if j ~= r then
      local _, n_j = dist.split(N, P, j)
      local hq_j, gk_j = heads_of(m, P, j)
      fwd = fwd + ES() * m.B * D * (n_r * (hq_j + 2 * gk_j) + n_j * hq_r)
      bwd = bwd + ES() * m.B * D * (n_j * (hq_r + 2 * gk_r) + n_r * hq_j)
    end
  end
  return fwd, bwd
end

local function paper_bytes(m, N, P)
  return ES() * m.B * (N / P) * (m.C + 2 * m.C * m.G / m.H + m.C) * (P - 1) / P
end
local function megatron_bytes(m, N, P) return 4 * ES() * m.B * N * m.C * (P - 1) / P end
local function ring_bytes(m, N, P) return ES() * 2 * m.B * N * m.C * (m.G / m.H) * (P - 1) / P end

---------------------------------------------------------------- 1. the exchange alone
local function bench_exchange(g, m, N, reps)
  local group, world, P, r = g.sp_group, g.world_group, g.sp_size, g.sp_rank
  local D, W = m.C / m.H, m.H + 2 * m.G
  local _, n = dist.split(N, P, r)
  local hq, gk = heads_of(m, P, r)
  uly.manual_seed(1 + r)
  local qkv = uly.randn(m.B, n, W, D, { requires_grad = true })
  local o = uly.randn(m.B, N, hq, D, { requires_grad = true })
  local g_recv = uly.randn(m.B, N, hq + 2 * gk, D)
  local g_out = uly.randn(m.B, n, m.H, D)
  local res = { fwd = {}, bwd = {}, fsent = nil, bsent = nil, fcopies = 0, bcopies = 0, same = true }
  for rep = 0, reps do                                        -- rep 0 warms up
    sync()
    group:barrier()
    dist.reset_stats()
    local c0, t0 = dist.exchange_copies(), uly.clock()
    local recv = dist.qkv_to_heads(group, qkv, m.H, m.G, N)
    local y = dist.heads_to_seq(group, o, m.H, N)
    sync()
    local t1 = uly.clock()
    local fs = dist.stats().all_to_all.sent
    local c1 = dist.exchange_copies()
    group:barrier()
    dist.reset_stats()
    local t2 = uly.clock()
    recv:backward(g_recv)
    y:backward(g_out)
    sync()
    local t3 = uly.clock()
    local bs = dist.stats().all_to_all.sent
    local c2 = dist.exchange_copies()
    recv, y = nil, nil
    qkv:zero_grad()
    o:zero_grad()
    local slow = world_max(world, { t1 - t0, t3 - t2 })
    if rep > 0 then
      res.fwd[#res.fwd + 1], res.bwd[#res.bwd + 1] = slow[1], slow[2]
      if res.fsent and (res.fsent ~= fs or res.bsent ~= bs) then res.same = false end
      res.fsent, res.bsent = fs, bs
      res.fcopies, res.bcopies = c1 - c0, c2 - c1
    end
  end
  local efwd, ebwd = exact_bytes(m, N, P, r)
  -- does every rank send exactly its formula? (1 = no on some rank)
  local off = world_max(world, { (res.fsent == efwd and res.bsent == ebwd and res.same) and 0 or 1 })[1]
  res.exact_fwd, res.exact_bwd, res.all_exact = efwd, ebwd, off == 0
  res.fwd_ms, res.bwd_ms = median(res.fwd) * 1e3, median(res.bwd) * 1e3
  collectgarbage()
  return res
end

---------------------------------------------------------------- 2. a whole layer
local function bench_layer(g, m, N, reps, attend)
  local group, world, P, r = g.sp_group, g.world_group, g.sp_size, g.sp_rank
  local lo, n = dist.split(N, P, r)
  uly.manual_seed(7)                                          -- the same weights on every rank
  local block = nn.Block(m.C, { heads = m.H, kv_heads = m.G, norm = m.norm, mlp = m.mlp, hidden = m.hidden,
                                rope = m.rope, bias = m.bias,
                                attend = nn.DistributedAttention(attend, group) })
  uly.manual_seed(11 + r)
  local x = uly.randn(m.B, n, m.C, { requires_grad = true })
  local gy = uly.randn(m.B, n, m.C)
  local ctx = { pos = lo, seq_total = N, seq_start = 0 }
  local res = { step = {}, fwd = {}, bwd = {}, comm = {} }
  for rep = 0, reps do                                        -- rep 0 warms up
    sync()
    group:barrier()
    dist.reset_stats()
    local c0, t0 = dist.exchange_copies(), uly.clock()
    local y = block(x, ctx)
    sync()
    local t1, c1 = uly.clock(), dist.exchange_copies()
    local fs = dist.stats().all_to_all.sent
    y:backward(gy)
    sync()
    local t2, c2 = uly.clock(), dist.exchange_copies()
    local st = dist.stats().all_to_all
    y = nil
    block:zero_grad()
    x:zero_grad()
    local slow = world_max(world, { t2 - t0, t1 - t0, t2 - t1, st.seconds })
    if rep > 0 then
      res.step[#res.step + 1], res.fwd[#res.fwd + 1], res.bwd[#res.bwd + 1] = slow[1], slow[2], slow[3]
      res.comm[#res.comm + 1] = slow[4]
      res.fsent, res.bsent, res.calls = fs, st.sent - fs, st.calls
      res.fcopies, res.bcopies = c1 - c0, c2 - c1
    end
    collectgarbage()
  end
  for _, k in ipairs({ 'step', 'fwd', 'bwd', 'comm' }) do res[k .. '_ms'] = median(res[k]) * 1e3 end
  res.peak = world_max(world, { uly.memory(opts.device).peak })[1]
  return res
end

---------------------------------------------------------------- main
local function main()
  local world_n = dist.world_size()
  local g = dist.init { sp = world_n }
  local P = g.sp_size
  if opts.device ~= 'cpu' and opts.device ~= 'cuda' then error('bench/ulysses.lua: --device cpu or cuda', 0) end
  if opts.precision ~= 'f32' and opts.precision ~= 'bf16' then error('bench/ulysses.lua: --precision f32 or bf16', 0) end
  if opts.device == 'cuda' then
    local ok, why = uly.cuda.ensure()
    if not ok then error('bench/ulysses.lua: --device cuda: ' .. tostring(why), 0) end
    uly.device('cuda')                                        -- every tensor below on the device
  end
  uly.matmul_precision(opts.precision)
  if opts.threads then uly.set_num_threads(opts.threads)
  elseif P > 1 then uly.set_num_threads(1) end
  local threads = uly.get_num_threads()
  local cores = sysconf_cores()
  local flash = nn.flash_attend
  local attend, attend_name = flash or nn.reference_attend, flash and 'nn.flash_attend' or 'nn.reference_attend'
  local layer_n = int_list(opts['layer-n'] or '2048,8192', '--layer-n')
  if not flash then
    for _, N in ipairs(layer_n) do
      if N > 8192 then
        error('bench/ulysses.lua: nn.flash_attend is not available and the reference attention stores N^2 ' ..
              'probabilities per head: keep --layer-n at 8192 or below (got ' .. N .. ')', 0)
      end
    end
  end
  local exchange_n = int_list(opts['exchange-n'], '--exchange-n')
  local models = {}
  for name in opts.models:gmatch('[^,]+') do
    models[#models + 1] = MODELS[name] or error('bench/ulysses.lua: unknown model ' .. name .. ' (llama, gpt)', 0)
  end

  local argv = {}
  for i = 1, #(arg or {}) do argv[i] = arg[i] end
  local cmd = 'bin/ulysses bench/ulysses.lua' .. (#argv > 0 and ' ' .. table.concat(argv, ' ') or '')
  if os.getenv('OMPI_COMM_WORLD_SIZE') then cmd = 'mpirun -np ' .. world_n .. ' ' .. cmd end
  local over = cores and P * threads > cores
  dist.print0(string.format('== bench/ulysses.lua   P = %d (one SP group of %d ranks)', P, P))
  dist.print0('command: ' .. cmd)
  local why = opts.threads and ' (--threads)' or (P > 1 and ' (set to 1 because P > 1)' or ' (library default)')
  dist.print0(string.format('ulysses %s, BLAS core %s, %d thread(s) per rank%s, %s cores%s', uly.version,
                            uly.blas_corename(), threads, why, tostring(cores),
                            over and string.format(' -> OVERSUBSCRIBED (%d ranks x %d threads): timings are not ' ..
                                                   'representative', P, threads) or ''))
  dist.print0(('local attention in the layer: %s; device %s, precision %s; times: per column, the median over reps '
               .. 'of the slowest rank'):format(attend_name, opts.device, opts.precision))
  for _, m in ipairs(models) do
    dist.print0(string.format('model %-5s: C = %d, H = %d, G = %d (K/V heads), D = %d, B = %d, %s, %s, hidden %d%s',
                              m.name, m.C, m.H, m.G, m.C / m.H, m.B, m.norm, m.mlp, m.hidden, m.rope and ', rope' or ''))
  end

  -- 1 + 3 + 4: the exchange alone
  local rows, crows, copies = {}, {}, {}
  for _, m in ipairs(models) do
    copies[m.name] = { ef = {}, eb = {}, lf = {}, lb = {} }
    for _, N in ipairs(exchange_n) do
      local e = bench_exchange(g, m, N, opts.reps)
      local c = copies[m.name]
      c.ef[e.fcopies], c.eb[e.bcopies] = true, true
      local paper = paper_bytes(m, N, P)
      rows[#rows + 1] = {
        m.name, N, P, string.format('%.2f', e.fwd_ms), string.format('%.2f', e.bwd_ms),
        mb(e.fsent), mb(e.exact_fwd), mb(paper), ratio(e.fsent, e.exact_fwd), ratio(e.fsent, paper),
        mb(e.bsent), ratio(e.bsent, e.exact_bwd), e.all_exact and 'yes' or 'NO',
        gbps(e.fsent, e.fwd_ms / 1e3), gbps(e.bsent, e.bwd_ms / 1e3), e.fcopies .. '/' .. e.bcopies }
      crows[#crows + 1] = {
        m.name, N, P, mb(e.fsent), mb(megatron_bytes(m, N, P)), ratio(megatron_bytes(m, N, P), e.fsent),
        mb(ring_bytes(m, N, P)), ratio(ring_bytes(m, N, P), e.fsent) }
    end
  end
  print_table('1. the all-to-all alone (fwd = qkv_to_heads + heads_to_seq, bwd = their inverses); MB = 1e6 bytes ' ..
              'sent by rank 0',
    { 'model', 'N', 'P', 'fwd ms', 'bwd ms', 'fwd MB', 'exact MB', 'paper MB', '/exact', '/paper', 'bwd MB',
      '/exact', 'all ranks exact', 'fwd GB/s', 'bwd GB/s', 'copies f/b' }, rows,
    { 'paper = ES*B*(N/P)*(C + 2*C*G/H + C)*(P-1)/P bytes; exact = sum_{j~=r} ES*B*D*(n_r*(hq_j+2*gk_j) + n_j*hq_r) ' ..
      '(ES = ' .. ES() .. ' bytes an element, ' .. opts.precision .. ') ' ..
      '(bwd: the forward\'s received bytes)',
      'with G < P a K/V head goes to every rank whose query heads use it, so exact > paper there (e.g. G = 2, P = 4)',
      'GB/s = bytes this rank sent / time (0 bytes leave the rank at P = 1: that time is a local copy)',
      'copies = uly.dist.exchange_copies() per forward / backward: the backward stages received gradients' })

  if opts.device == 'cuda' and P > 1 then
    dist.print0('  the device exchanges went ' .. (g.sp_group:device_path() == 'device' and 'over NCCL (a GPU per rank)'
                                                  or 'through host memory (ranks share a GPU, or no NCCL)'))
  end

  -- 2 + 3: a whole layer
  local lrows = {}
  for _, m in ipairs(models) do
    for _, N in ipairs(layer_n) do
      local l = bench_layer(g, m, N, opts['layer-reps'], attend)
      local c = copies[m.name]
      c.lf[l.fcopies], c.lb[l.bcopies] = true, true
      lrows[#lrows + 1] = {
        m.name, N, P, string.format('%.1f', l.step_ms), string.format('%.1f', l.fwd_ms), string.format('%.1f', l.bwd_ms),
        string.format('%.1f', l.comm_ms), string.format('%.1f%%', 100 * l.comm_ms / l.step_ms),
        mb(l.fsent), mb(l.bsent), l.calls, l.fcopies, l.bcopies, string.format('%.0f', l.peak / 2 ^ 20) }
    end
  end
  print_table('2. a whole layer: nn.Block with nn.DistributedAttention(' .. attend_name .. ', sp_group), forward + backward',
    { 'model', 'N', 'P', 'step ms', 'fwd ms', 'bwd ms', 'a2a ms', 'a2a share', 'fwd MB sent', 'bwd MB sent',
      'a2a calls', 'copies fwd', 'copies bwd', 'peak MiB' }, lrows,
    { 'a2a ms = seconds inside all_to_all counted by the comm layer (slowest rank; includes waiting for other ranks)',
      'copies = uly.dist.exchange_copies() per layer: 0 in forward (no packing); in backward 0 in f32 with G >= P, else staging buffers' })

  local function seen(set)
    local out = {}
    for k in pairs(set) do out[#out + 1] = k end
    table.sort(out)
    return #out > 0 and table.concat(out, ',') or '-'
  end
  local cprows = {}
  for _, m in ipairs(models) do
    local c = copies[m.name]
    cprows[#cprows + 1] = { m.name, P, seen(c.ef), seen(c.eb), seen(c.lf), seen(c.lb) }
  end
  print_table('3. packing copies made by the exchanges (uly.dist.exchange_copies(), every N above)',
    { 'model', 'P', 'exchange fwd', 'exchange bwd', 'layer fwd', 'layer bwd' }, cprows,
    { 'expected: 0 in forward (MPI datatypes read qkv and write the result in place); in backward 0 where the ' ..
      'exchange is f32, the input gradient new and no K/V head went to two ranks (G >= P): received straight into ' ..
      'it; else one staging buffer per exchange, added into the input gradient' })

  print_table('4. bytes sent per rank per layer forward: Ulysses MEASURED vs other schemes COMPUTED from formulas',
    { 'model', 'N', 'P', 'Ulysses MB (measured)', 'Megatron-SP MB (computed)', 'x Ulysses',
      'ring attn MB (computed)', 'x Ulysses' }, crows,
    { 'Megatron-SP: 2 all-gathers + 2 reduce-scatters of [B, N, C]: 4*ES*B*N*C*(P-1)/P bytes, O(N) independent of P',
      '  (DeepSpeed-Ulysses paper: P times what Ulysses moves; x P exactly for G = H, more under GQA where Ulysses\' ' ..
      'K/V share shrinks by G/H)',
      'ring attention: each rank\'s K/V block visits every other rank: 2*ES*B*N*C*(G/H)*(P-1)/P bytes (its backward ' ..
      'also circulates dK, dV)' })
end

dist.run(main)
