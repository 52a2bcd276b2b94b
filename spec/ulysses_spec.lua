-- spec/ulysses_spec.lua — DeepSpeed-Ulysses sequence parallelism, run by scripts/test.sh under
-- mpirun at P = 1, 2, 4 and a DP 2 x SP 2 grid (#mpi): the loss and every parameter gradient of
-- GPT and Llama (GQA) match the single-process run; the same with uneven heads, K/V heads fewer
-- than P, a head grouping that is not uniform per rank, ranks without any head, and N not
-- divisible by P; the bytes each rank sends to each peer per layer equal the formula exactly,
-- forward and backward; the forward makes no packing copy; mismatches fail on every rank.
local uly = require 'ulysses'
local helpers = require 'helpers'
local dist = uly.dist
local nn = uly.nn
local GPT = require 'models.gpt'
local Llama = require 'models.llama'

local sp = require 'sp_compare'
local grid, split, batch, copy_cfg, compare = sp.grid, sp.split, sp.batch, sp.copy_cfg, sp.compare

describe('Ulysses sequence parallelism #mpi', function()
  local TOL = 1e-5   -- reached: loss within 1e-7 relative, gradients within 1e-6 of each tensor's largest entry

  local cases = {
    { 'GPT (4 heads)', GPT, { preset = 'tiny', heads = 4, dim = 32, seq = 16 }, 16 },
    { 'Llama with GQA (4 heads, 2 K/V heads)', Llama, { preset = 'tiny', heads = 4, kv_heads = 2, dim = 32, hidden = 48, seq = 16 }, 16 },
    { 'uneven heads (6 heads, 2 K/V) and N = 13', Llama, { preset = 'tiny', heads = 6, kv_heads = 2, dim = 48, hidden = 48, seq = 16 }, 13 },
    { 'a non-uniform head grouping (10 heads, 2 K/V), N = 11', Llama, { preset = 'tiny', heads = 10, kv_heads = 2, dim = 40, hidden = 48, seq = 16 }, 11 },
    { 'fewer heads than ranks (GPT, 2 heads) and N = 10', GPT, { preset = 'tiny', heads = 2, dim = 32, seq = 16 }, 10 },
    { 'K/V heads fewer than P (8 heads, 2 K/V) and N = 9', Llama, { preset = 'tiny', heads = 8, kv_heads = 2, dim = 32, hidden = 48, seq = 16 }, 9 },
  }
  cases[#cases + 1] = { 'flash attention with a sliding window and packed documents', Llama,
                         { preset = 'tiny', heads = 4, kv_heads = 2, dim = 32, hidden = 48, seq = 32, attention = 'flash',
                           window = 5 }, 23, false, true }
  cases[#cases + 1] = { 'the reference kernel', GPT, { preset = 'tiny', heads = 4, dim = 32, seq = 16, attention = 'reference' }, 15 }
  cases[#cases + 1] = { 'with activation checkpointing and tiled MLP and loss', Llama,
                         { preset = 'tiny', heads = 4, kv_heads = 2, dim = 32, hidden = 48, seq = 32, checkpoint = true,
                           tile = 4 }, 21 }
  cases[#cases + 1] = { 'with activation checkpointing (the replay repeats the exchanges)', GPT,
                         { preset = 'tiny', heads = 4, dim = 32, seq = 16, checkpoint = true }, 14 }
  cases[#cases + 1] = { 'with checkpointing except attention (its kept outputs between the exchanges), documents', Llama,
                         { preset = 'tiny', heads = 4, kv_heads = 2, dim = 32, hidden = 48, seq = 32, attention = 'flash',
                           window = 5, checkpoint = 'except_attention', tile = 4 }, 21, false, true }
  cases[#cases + 1] = { 'a shard whose targets are all ignored (no NaN, the others unchanged)', Llama,
                         { preset = 'tiny', heads = 4, kv_heads = 2, dim = 32, hidden = 48, seq = 16 }, 12, true }
  for _, c in ipairs(cases) do
    it('matches the single-process loss and gradients: ' .. c[1], function()
      local dl, dg, where = compare(c[2], c[3], c[4], { mask_last_shard = c[5], docs = c[6] })
      assert.is_true(dl <= TOL, string.format('loss differs by %.3g relative', dl))
      assert.is_true(dg <= TOL, string.format('gradient of %s differs by %.3g', tostring(where), dg))
    end)
  end

  -- the model on device 'cuda' (the simulation, or the emulator with ranks sharing one GPU or each
  -- its own; the GPU under scripts/gpu-check.sh, where the ranks share it): the exchanges go over
  -- NCCL when every rank has its own GPU, else they stage through host memory over MPI
  it('matches the single-process loss and gradients with the model on device cuda (NCCL or host-staged exchanges)', function()
    local real = helpers.use_test_device()
    local tol = real and 5e-3 or TOL
    local dl, dg, where = compare(Llama, { preset = 'tiny', heads = 4, kv_heads = 2, dim = 32, hidden = 48, seq = 32,
                                           window = 6 }, 19, { docs = true, device = 'cuda' })
    assert.is_true(dl <= tol, string.format('loss differs by %.3g relative', dl))
    assert.is_true(dg <= tol, string.format('gradient of %s differs by %.3g', tostring(where), dg))
    -- and the device exchanges move exactly the bytes the host ones do, peer by peer
    local function exchange_bytes(device)
      local g = grid()
      uly.manual_seed(3)
      local m = Llama(copy_cfg({ preset = 'tiny', heads = 4, kv_heads = 2, dim = 32, hidden = 48, seq = 16 },
                               { sp = g.sp_size }))
      if device ~= 'cpu' then m:to(device) end
      local lo, n = split(16, g.sp_size, g.sp_rank)
      local x = batch(1, 16, 256, 5)
      local xs = x:narrow(2, lo + 1, n):contiguous():to(device)
      dist.reset_stats()
      m:loss(xs, xs, { pos = lo, seq_total = 16 }):backward()
      local out = {}
      for p, v in pairs(dist.stats().all_to_all.peers) do out[p] = { v.sent, v.received } end
      return out
    end
    local host_bytes = exchange_bytes('cpu')
    if grid().sp_size > 1 then
      local any = 0
      for _, v in pairs(host_bytes) do any = any + v[1] end
      assert.is_true(any > 0, 'the host exchange moved no bytes')
    end
    assert.are.same(host_bytes, exchange_bytes('cuda'))
    if grid().sp_size > 1 then assert.equal(helpers.expected_device_path(), grid().sp_group:device_path()) end
    if not real then jit.flush(); collectgarbage('collect'); collectgarbage('collect'); uly.cuda.reset() end
  end)

  -- in bf16 mixed precision the four exchanges move bf16: half the bytes to every peer, and the
  -- single-process loss and gradients (same precision) to bf16 accuracy (the CPU attention, f32,
  -- sees Q, K and V rounded to bf16 now)
  it('moves half the bytes in bf16 mixed precision, and follows the single-process model', function()
    local cfg = { preset = 'tiny', heads = 4, kv_heads = 2, dim = 32, hidden = 48, seq = 32 }
    local function exchanged(precision)
      local g = grid()
      local prev = uly.matmul_precision(precision)
      uly.manual_seed(3)
      local m = Llama(copy_cfg(cfg, { sp = g.sp_size }))
      local lo, n = split(16, g.sp_size, g.sp_rank)
      local xs = batch(1, 16, 256, 5):narrow(2, lo + 1, n):contiguous()
      dist.reset_stats()
      local ok, err = pcall(function() m:loss(xs, xs, { pos = lo, seq_total = 16 }):backward() end)
      uly.matmul_precision(prev)
      assert(ok, err)
      local out = {}
      for p, v in pairs(dist.stats().all_to_all.peers) do out[p] = { v.sent, v.received } end
      return out
    end
    local f32, bf16 = exchanged('f32'), exchanged('bf16')
    for p, v in pairs(f32) do assert.are.same({ v[1] / 2, v[2] / 2 }, bf16[p]) end
    if grid().sp_size > 1 then assert.is_true(next(f32) ~= nil) end
    local prev = uly.matmul_precision('bf16')
    local ok, dl, dg, where = pcall(compare, Llama, cfg, 19)
    uly.matmul_precision(prev)
    assert(ok, dl)
    -- reached: loss within 3e-6 relative, gradients within 5e-3 of each tensor's largest entry
    assert.is_true(dl <= 1e-4, string.format('loss differs by %.3g relative', dl))
    assert.is_true(dg <= 2e-2, string.format('gradient of %s differs by %.3g', tostring(where), dg))
  end)

  -- bf16 activations: the exchanges move the bf16 activations as they are (the same bytes as bf16
  -- precision), and every rank count follows the single-process model in the same mode
  it('with bf16 activations, follows the single-process model (checkpointing, documents, flash)', function()
    local pa, pm = uly.activation_dtype('bf16'), uly.matmul_precision('bf16')
    local ok, dl, dg, where = pcall(compare, Llama, { preset = 'tiny', heads = 4, kv_heads = 2, dim = 32, hidden = 48,
                                                      seq = 32, attention = 'flash', window = 5,
                                                      checkpoint = 'except_attention', tile = 4 }, 21, { docs = true })
    uly.activation_dtype(pa)
    uly.matmul_precision(pm)
    assert(ok, dl)
    -- a rank's GEMMs over fewer rows may round a result to the neighbouring bf16 value
    assert.is_true(dl <= 1e-3, string.format('loss differs by %.3g relative', dl))
    assert.is_true(dg <= 3e-2, string.format('gradient of %s differs by %.3g', tostring(where), dg))
  end)

  it('moves bf16 on device cuda too, following the single-process model', function()
    local real = helpers.use_test_device()
    local prev = uly.matmul_precision('bf16')
    local ok, dl, dg, where = pcall(compare, Llama, { preset = 'tiny', heads = 4, kv_heads = 2, dim = 32, hidden = 48,
                                                      seq = 32, window = 6 }, 19, { docs = true, device = 'cuda' })
    uly.matmul_precision(prev)
    assert(ok, dl)
    -- reached on the emulator: loss within 5e-6, gradients within 6e-3 (the GPU's bf16 attention
    -- also rounds P and dS, which the CPU reference does not)
    assert.is_true(dl <= 1e-3, string.format('loss differs by %.3g relative', dl))
    assert.is_true(dg <= (real and 5e-2 or 3e-2), string.format('gradient of %s differs by %.3g', tostring(where), dg))
    if not real then helpers.reset_simulated_device() end
  end)

  it('with bf16 activations on device cuda, follows the single-process model (NCCL or host-staged)', function()
    local real = helpers.use_test_device()
    local pa, pm = uly.activation_dtype('bf16'), uly.matmul_precision('bf16')
    local ok, dl, dg, where = pcall(compare, Llama, { preset = 'tiny', heads = 4, kv_heads = 2, dim = 32, hidden = 48,
                                                      seq = 32, window = 6, checkpoint = 'except_attention', tile = 4 },
                                    19, { docs = true, device = 'cuda' })
    uly.activation_dtype(pa)
    uly.matmul_precision(pm)
    assert(ok, dl)
    assert.is_true(dl <= 1e-3, string.format('loss differs by %.3g relative', dl))
    assert.is_true(dg <= (real and 5e-2 or 3e-2), string.format('gradient of %s differs by %.3g', tostring(where), dg))
    if not real then helpers.reset_simulated_device() end
  end)

  it('sends and receives exactly the formula per peer per layer, forward and backward', function()
    local g = grid()
    local P, r = g.sp_size, g.sp_rank
    for _, shape in ipairs({ { H = 4, G = 4, N = 12 }, { H = 8, G = 2, N = 10 }, { H = 6, G = 2, N = 7 } }) do
      local H, G, N, D, B = shape.H, shape.G, shape.N, 4, 2
      local attn = nn.SelfAttention(H * D, { heads = H, kv_heads = G, rope = true,
                                              attend = nn.DistributedAttention(nn.reference_attend, g.sp_group) })
      local lo, n = split(N, P, r)
      local x = uly.randn(B, n, H * D, { requires_grad = true })
      -- the formula: rank j gets query heads hq_j and the K/V heads they use gk_j
      local function heads(j)
        local h0, hq = split(H, P, j)
        if hq == 0 then return 0, 0 end
        local grp = H / G
        return hq, math.floor((h0 + hq - 1) / grp) - math.floor(h0 / grp) + 1
      end
      local hq_r = heads(r)
      local gk_r = select(2, heads(r))
      local fwd_sent, fwd_recv = {}, {}
      for j = 0, P - 1 do
        local hq_j, gk_j = heads(j)
        local _, n_j = split(N, P, j)
        -- Q, K, V of my tokens for j's heads, then the output of my heads for j's tokens
        fwd_sent[j] = 4 * (B * n * (hq_j + 2 * gk_j) * D + B * n_j * hq_r * D)
        fwd_recv[j] = 4 * (B * n_j * (hq_r + 2 * gk_r) * D + B * n * hq_j * D)
      end
      dist.reset_stats()
      local copies0 = dist.exchange_copies()
      local y = attn(x, { seq_total = N })
      local fwd = dist.stats().all_to_all
      assert.are.equal(copies0, dist.exchange_copies())   -- no packing copy on the forward path
      assert.are.equal(2, fwd.calls)                       -- Q, K and V in ONE exchange, then O
      local total = 0
      for j = 0, P - 1 do
        local peer = fwd.peers[g.sp_group:world_rank(j)]
        if j == r then
          assert.is_nil(peer and peer.sent ~= 0 and peer or nil)
        else
          assert.are.equal(fwd_sent[j], peer.sent, 'bytes to rank ' .. j)
          assert.are.equal(fwd_recv[j], peer.received, 'bytes from rank ' .. j)
          total = total + fwd_sent[j]
        end
      end
      assert.are.equal(total, fwd.sent)
      dist.reset_stats()
      y:sum():backward()
      local bwd = dist.stats().all_to_all
      assert.are.equal(2, bwd.calls)
      for j = 0, P - 1 do
        if j ~= r then   -- backward is the same exchange reversed
          local peer = bwd.peers[g.sp_group:world_rank(j)]
          assert.are.equal(fwd_recv[j], peer.sent, 'backward bytes to rank ' .. j)
          assert.are.equal(fwd_sent[j], peer.received, 'backward bytes from rank ' .. j)
        end
      end
      -- backward receives straight into the new gradients, except where a K/V head went to several
      -- ranks (G < P): its gradients come back several times and are summed from a staging buffer
      local kv_sent = 0
      for j = 0, P - 1 do kv_sent = kv_sent + select(2, heads(j)) end
      assert.are.equal(copies0 + (kv_sent > G and 1 or 0), dist.exchange_copies())
    end
  end)

  it('with heads divisible by P and G >= P the total is 4 B N C / P elements, (P-1)/P of it sent', function()
    local g = grid()
    local P = g.sp_size
    local H, G, N, D, B = 4, 4, 8, 4, 1
    local attn = nn.SelfAttention(H * D, { heads = H, kv_heads = G,
                                            attend = nn.DistributedAttention(nn.reference_attend, g.sp_group) })
    local _, n = split(N, P, g.sp_rank)
    dist.reset_stats()
    attn(uly.randn(B, n, H * D), { seq_total = N })
    local C = H * D
    assert.are.equal(4 * (4 * B * N * C / P) * (P - 1) / P, dist.stats().all_to_all.sent)
  end)

  it('a rank with the wrong number of tokens fails on every rank with the same message', function()
    local g = grid()
    local P, r = g.sp_size, g.sp_rank
    if P == 1 then return end
    local N = 8
    local _, n = split(N, P, r)
    if r == P - 1 then n = n + 1 end   -- the last rank holds one token too many
    local ok, err = pcall(dist.qkv_to_heads, g.sp_group, uly.randn(1, n, 6, 4), 2, 2, N)
    assert.is_false(ok)
    assert.truthy(tostring(err):find('holds ' .. (split(N, P, P - 1) and select(2, split(N, P, P - 1)) + 1) .. ' tokens', 1, true), err)
    assert.truthy(tostring(err):find('rank ' .. (P - 1), 1, true), err)
    -- and ranks that disagree on the number of heads are caught by the exchange's size check
    local heads = r == 0 and 4 or 2
    ok, err = pcall(dist.qkv_to_heads, g.sp_group, uly.randn(1, select(2, split(N, P, r)), heads + 4, 4), heads, 2, N)
    assert.is_false(ok)
    assert.truthy(tostring(err):find('all_to_all on group sp', 1, true), err)
    -- the group is still usable afterwards
    local t = uly.tensor({ 1 })
    g.sp_group:all_reduce_(t, 'sum')
    assert.are.equal(P, t:item())
  end)
end)

describe('Ulysses without MPI', function()
  it('splits tokens and heads with the first n % P parts one longer', function()
    assert.are.same({ 0, 3 }, { dist.split(10, 4, 0) })
    assert.are.same({ 6, 2 }, { dist.split(10, 4, 2) })
    assert.are.same({ q_start = 3, q_count = 3, kv_start = 0, kv_count = 2 }, dist.heads(10, 2, 4, 1))
    assert.are.same({ q_start = 4, q_count = 0, kv_start = 0, kv_count = 0 }, dist.heads(4, 2, 5, 4))
    local ok, err = pcall(dist.heads, 6, 4, 2, 0)
    assert.is_false(ok)
    assert.truthy(err:find('not a multiple', 1, true))
  end)
end)
