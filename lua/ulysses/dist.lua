-- lua/ulysses/dist.lua — uly.dist: the process grid and collectives on CPU tensors (core/comm*.c).
--
--   local dist = uly.dist
--   local g = dist.init{ sp = 2 }   -- { rank, world, sp_rank, sp_size, dp_rank, dp_size,
--                                   --   world_group, sp_group, dp_group }
--   g.sp_group:all_reduce_(t, 'sum')
--
-- Under mpirun the world is split into sequence-parallel (SP) groups of `sp` consecutive ranks
-- and data-parallel (DP) groups of the ranks with the same SP rank. Without mpirun the process
-- is a world of one rank, MPI is never started, and the collectives are identities.
-- Ranks are 0-based everywhere here, like MPI's (group:rank(), dist.rank(), roots, stats peers).
-- Every collective first checks that all ranks of the group are in the same collective with
-- consistent sizes (a mismatch raises the same error on every rank) and gives up after
-- dist.set_timeout seconds (default 600, or ULY_COMM_TIMEOUT) instead of hanging; after a
-- timeout the job cannot continue: end it with dist.abort (dist.run does this for you).
local ffi = require 'ffi'
local lib = require 'ulysses.ffi'
local T = require 'ulysses.tensor'
local C = lib.C
local H, wrap, check, raise = T.handle, T.wrap, T.check, T.raise

local dist = {}

local KINDS = { [0] = 'all_to_all', 'all_reduce', 'all_gather', 'reduce_scatter', 'broadcast', 'barrier' }
local N_KINDS = 6
local OPS = { sum = 0, avg = 1, max = 2 }
local i64arr = ffi.typeof('int64_t[?]')
local tensor_ptrs = ffi.typeof('uly_tensor *[?]')

local function pack(...) return { n = select('#', ...), ... } end

---------------------------------------------------------------- groups
local Group = {}
Group.__index = Group
Group.__tostring = function(g)
  return string.format('dist group %s: rank %d of %d', g:name(), g:rank(), g:size())
end

local function new_group(ptr)
  if ptr == nil then raise(T.last_error()) end
  return setmetatable({ _c = ptr }, Group)
end

function Group:rank() return C.uly_comm_rank(self._c) end
function Group:size() return C.uly_comm_size(self._c) end
function Group:name() return ffi.string(C.uly_comm_name(self._c)) end
-- the world rank of a (0-based) rank of this group
function Group:world_rank(r) return C.uly_comm_world_rank_of(self._c, r or self:rank()) end
-- how device tensors move in this group, decided at its first device collective: 'device' (the
-- backend's own collectives, NCCL), 'host' (staged through host memory over MPI: ranks sharing a
-- GPU, no NCCL, one rank), or nil before then
function Group:device_path()
  local p = C.uly_comm_device_path(self._c)
  return p == 1 and 'device' or p == -1 and 'host' or nil
end

local function op_code(op, what)
  local code = OPS[op or 'sum']
  if not code then raise(string.format("%s: unknown reduction '%s' (use 'sum', 'avg' or 'max')", what, tostring(op))) end
  return code
end

-- in place over the group; t must be contiguous
function Group:all_reduce_(t, op)
  check(C.uly_comm_all_reduce_(self._c, H(t, 'all_reduce_'), op_code(op, 'all_reduce_')))
  return t
end

-- starts an all-reduce of t (contiguous) that completes at group:wait_all(): the data moves
-- while this rank goes on (NCCL on the device's communication stream; a non-blocking MPI
-- all-reduce on the host). Every rank starts the same ones in the same order; t must be neither
-- read nor written until wait_all returns. dist.grad_sync uses it.
function Group:all_reduce_start_(t, op)
  check(C.uly_comm_all_reduce_start(self._c, H(t, 'all_reduce_start_'), op_code(op, 'all_reduce_start_')))
  return t
end

-- completes every all-reduce started on this group, in order
function Group:wait_all() check(C.uly_comm_wait_all(self._c)) end

-- how many started all-reduces wait_all has still to complete
function Group:pending() return C.uly_comm_pending(self._c) end

-- lets MPI move the started all-reduces' data now (it moves host data only inside MPI calls)
function Group:progress() C.uly_comm_progress(self._c) end

-- a new tensor: every rank's t stacked along dim 1 in rank order ([size * n, ...]; a scalar gives [size])
function Group:all_gather(t)
  t = H(t, 'all_gather') and t:contiguous()
  local shape = t:shape()
  if #shape == 0 then shape = { 1 } end
  shape[1] = shape[1] * self:size()
  local out = T.empty(shape, { dtype = t:dtype(), device = t:device() })
  check(C.uly_comm_all_gather(self._c, t._h, out._h))
  return out
end

-- a new tensor: this rank's block (of dim 1, split in size equal parts) of the reduction of every rank's t
function Group:reduce_scatter(t, op)
  local code = op_code(op, 'reduce_scatter')
  t = H(t, 'reduce_scatter') and t:contiguous()
  local shape = t:shape()
  if #shape == 0 then raise('reduce_scatter: needs at least one dimension to split, got a scalar') end
  shape[1] = math.floor(shape[1] / self:size())  -- an indivisible size is reported by the core on every rank
  local out = T.empty(shape, { dtype = t:dtype(), device = t:device() })
  check(C.uly_comm_reduce_scatter(self._c, t._h, out._h, code))
  return out
end

-- the same two into tensors the caller owns (contiguous; out may be reused every step):
-- all_gather_into(t, out): out = every rank's t stacked along dim 1; t may be this rank's own
-- block of out (in place). reduce_scatter_into(t, out, op): out = this rank's block of the reduction.
function Group:all_gather_into(t, out)
  check(C.uly_comm_all_gather(self._c, H(t, 'all_gather_into'), H(out, 'all_gather_into')))
  return out
end
function Group:reduce_scatter_into(t, out, op)
  local code = op_code(op, 'reduce_scatter_into')
  check(C.uly_comm_reduce_scatter(self._c, H(t, 'reduce_scatter_into'), H(out, 'reduce_scatter_into'), code))
  return out
end

-- starts reduce_scatter_into(t, out, op), completed at group:wait_all() in order with the
-- started all-reduces; neither t nor out may be touched until then (ZeroAdamW's gradient sync)
function Group:reduce_scatter_start(t, out, op)
  local code = op_code(op, 'reduce_scatter_start')
  check(C.uly_comm_reduce_scatter_start(self._c, H(t, 'reduce_scatter_start'), H(out, 'reduce_scatter_start'), code))
  return out
end

-- in place: every rank gets the root's (0-based group rank) values
function Group:broadcast_(t, root)
  check(C.uly_comm_broadcast_(self._c, H(t, 'broadcast_'), root or 0))
  return t
end

function Group:barrier() check(C.uly_comm_barrier(self._c)) end

local function counts_array(list, size, what)
  if type(list) ~= 'table' or #list ~= size then
    raise(string.format('all_to_all_v: %s must be a list of %d element counts (one per rank of the group), got %s',
                        what, size, type(list) == 'table' and (#list .. ' entries') or type(list)))
  end
  local counts, displs, total = i64arr(size), i64arr(size), 0
  for j = 1, size do
    local n = list[j]
    if type(n) ~= 'number' or n < 0 or n ~= math.floor(n) then
      raise(string.format('all_to_all_v: %s[%d] = %s is not a non-negative integer', what, j, tostring(n)))
    end
    counts[j - 1], displs[j - 1] = n, total
    total = total + n
  end
  return counts, displs, total
end

-- send_tensor holds the blocks for ranks 0, 1, ... back to back (send_counts elements each);
-- the result (recv_tensor, or a new 1-D tensor) holds the blocks from ranks 0, 1, ... back to back
function Group:all_to_all_v(send, send_counts, recv_counts, recv)
  local size = self:size()
  H(send, 'all_to_all_v send')
  local scounts, sdispls, stotal = counts_array(send_counts, size, 'send_counts')
  local rcounts, rdispls, rtotal = counts_array(recv_counts, size, 'recv_counts')
  if send:device() ~= 'cpu' then raise('all_to_all_v: the send tensor is on the GPU; collectives here take CPU tensors') end
  send = send:contiguous()
  if send:numel() ~= stotal then
    raise(string.format('all_to_all_v: the send tensor %s has %d elements but send_counts add up to %d',
                        send:describe(), send:numel(), stotal))
  end
  if recv == nil then
    recv = T.empty({ rtotal }, { dtype = send:dtype(), device = 'cpu' })
  else
    H(recv, 'all_to_all_v recv')
    if recv:dtype() ~= send:dtype() or not recv:is_contiguous() or recv:numel() ~= rtotal or recv:device() ~= 'cpu' then
      raise(string.format('all_to_all_v: the receive tensor %s must be a contiguous CPU %s tensor of %d elements ' ..
                          '(recv_counts add up to %d)', recv:describe(), send:dtype(), rtotal, rtotal))
    end
  end
  check(C.uly_comm_all_to_all_v(self._c, send:data_ptr(), scounts, sdispls, recv:data_ptr(), rcounts, rdispls,
                                C.uly_tensor_dtype(send._h)))
  return recv
end

-- raises the same error on every rank when the ranks' lists of integers differ
function Group:check_same(what, values)
  if type(values) ~= 'table' then raise('check_same: values must be a list of integers') end
  local n = #values
  local arr = i64arr(math.max(n, 1))
  for i = 1, n do
    local v = values[i]
    if type(v) ~= 'number' or v ~= math.floor(v) then
      raise(string.format('check_same: value %d (%s) is not an integer', i, tostring(v)))
    end
    arr[i - 1] = v
  end
  check(C.uly_comm_check_same(self._c, tostring(what or 'a value'), arr, n))
end

-- raises the same error on every rank, naming the first difference, when the ranks' lists of
-- tensors (parameters) differ in length or in any tensor's dtype or shape (in order): a flat
-- buffer over them would otherwise mix up different parameters' elements
local MAX_DIMS = 8   -- ULY_MAX_DIMS
function Group:check_same_params(what, params)
  local n = #params
  self:check_same(what .. ': the number of parameters', { n })
  if n == 0 or self:size() == 1 then return end
  local W = 2 + MAX_DIMS   -- a row per tensor: dtype, number of dims, the dims (0 past them)
  local mine = T.empty({ n * W }, { dtype = 'i64', device = 'cpu' }):fill_(0)
  local row = ffi.cast('int64_t *', mine:data_ptr())
  for i, p in ipairs(params) do
    local shape = p:shape()
    row[(i - 1) * W], row[(i - 1) * W + 1] = C.uly_tensor_dtype(H(p, what .. ': parameter ' .. i)), #shape
    for d, s in ipairs(shape) do row[(i - 1) * W + 1 + d] = s end
  end
  local all = self:all_gather(mine)
  local rows = ffi.cast('int64_t *', all:data_ptr())
  local function desc(r, i)
    local at, dims = (r * n + i - 1) * W, {}
    for d = 1, tonumber(rows[at + 1]) do dims[d] = tostring(tonumber(rows[at + 1 + d])) end
    return string.format('%s[%s]', T.DTYPE_NAMES[tonumber(rows[at])] or '?', table.concat(dims, ', '))
  end
  for i = 1, n do
    for r = 1, self:size() - 1 do
      local a, b = desc(0, i), desc(r, i)
      if a ~= b then
        raise(string.format('%s: the ranks of group %s hold different parameters: parameter %d is %s on rank 0 but '
                            .. '%s on rank %d; every rank must build the same model and pass its parameters in the '
                            .. 'same order', what, self:name(), i, a, b, r))
      end
    end
  end
end

---------------------------------------------------------------- the grid
local function grid()
  if C.uly_dist_initialized() == 0 then
    raise('uly.dist: the process grid is not set up yet; call uly.dist.init { sp = P } first (every rank)')
  end
  local w, sp, dp = new_group(C.uly_dist_world()), new_group(C.uly_dist_sp_group()), new_group(C.uly_dist_dp_group())
  return {
    rank = w:rank(), world = w:size(),
    sp_rank = sp:rank(), sp_size = sp:size(),
    dp_rank = dp:rank(), dp_size = dp:size(),
    world_group = w, sp_group = sp, dp_group = dp,
  }
end

-- dist.init{ sp = P }: idempotent for the same sp; the grid is fixed for the life of the process
function dist.init(opts)
  opts = opts or {}
  if type(opts) ~= 'table' then raise('dist.init: expected an options table such as { sp = 4 }') end
  local sp = opts.sp or 1
  if type(sp) ~= 'number' or sp ~= math.floor(sp) then raise('dist.init: sp must be an integer, got ' .. tostring(sp)) end
  check(C.uly_dist_init(sp))
  return grid()
end

function dist.initialized() return C.uly_dist_initialized() ~= 0 end

-- the grid of an initialised process
function dist.grid()
  if not dist.initialized() then raise('dist.grid: call dist.init{ sp = P } first') end
  return grid()
end

-- world rank and size; before dist.init they come from mpirun's environment (or 0 and 1)
function dist.rank()
  if dist.initialized() then return C.uly_comm_rank(C.uly_dist_world()) end
  return tonumber(os.getenv('OMPI_COMM_WORLD_RANK')) or 0
end

function dist.world_size()
  if dist.initialized() then return C.uly_comm_size(C.uly_dist_world()) end
  return tonumber(os.getenv('OMPI_COMM_WORLD_SIZE')) or 1
end

function dist.is_main() return dist.rank() == 0 end

function dist.print0(...)
  if dist.is_main() then
    print(...)
    io.stdout:flush()
  end
end

-- { [kind] = { calls, seconds, sent, received, peers = { [world_rank] = { sent, received } } } }
-- Bytes of payload only; a rank's transfers to itself are never counted, so peers lists
-- every other world rank (zeros included) and never this one.
function dist.stats()
  local out, me, world = {}, dist.rank(), dist.world_size()
  for k = 0, N_KINDS - 1 do
    local s = { calls = tonumber(C.uly_comm_calls(k)), seconds = C.uly_comm_seconds(k), sent = 0, received = 0, peers = {} }
    for p = 0, world - 1 do
      if p ~= me then
        local sent, received = tonumber(C.uly_comm_bytes(k, p, 1)), tonumber(C.uly_comm_bytes(k, p, 0))
        s.peers[p] = { sent = sent, received = received }
        s.sent, s.received = s.sent + sent, s.received + received
      end
    end
    out[KINDS[k]] = s
  end
  return out
end

function dist.reset_stats() C.uly_comm_reset_stats() end

-- seconds each collective may wait for the other ranks; <= 0 waits forever
function dist.set_timeout(seconds)
  if type(seconds) ~= 'number' then raise('dist.set_timeout: expected a number of seconds') end
  C.uly_dist_set_timeout(seconds)
end

-- prints "ulysses: rank R: msg" and ends every rank of the job (exit status 1)
function dist.abort(msg) C.uly_dist_abort(tostring(msg or 'aborted')) end

-- shuts MPI down (also done automatically at exit); the grid cannot be set up again under MPI
function dist.finalize() C.uly_dist_finalize() end

-- fn(...) under xpcall: a Lua error prints its message and traceback as "ulysses: rank R: ..."
-- and aborts the whole job, so no other rank is left waiting in a collective
function dist.run(fn, ...)
  local args = pack(...)
  local res = pack(xpcall(function() return fn(unpack(args, 1, args.n)) end,
                          function(e) return debug.traceback(tostring(e), 2) end))
  if not res[1] then dist.abort(res[2]) end
  return unpack(res, 2, res.n)
end

---------------------------------------------------------------- gradients
local BUCKET_BYTES = 64 * 2 ^ 20
local grad_buffers = setmetatable({}, { __mode = 'k' })  -- params[1] -> flat buffer plan

local function same_list(plan, params, bucket_elems)
  if plan.n ~= #params or plan.bucket_elems ~= bucket_elems or plan.device ~= params[1]:device() then return false end
  for i = 1, plan.n do if plan.params[i] ~= params[i] then return false end end
  return true
end

-- a flat f32 buffer with a view per parameter and a view per bucket, reused while the list is the same
local function grad_plan(params, bucket_elems)
  local plan = grad_buffers[params[1]]
  if plan and same_list(plan, params, bucket_elems) then return plan end
  local total = 0
  for i, p in ipairs(params) do
    H(p, 'all_reduce_grads: parameter ' .. i)
    total = total + p:numel()
  end
  plan = { n = #params, bucket_elems = bucket_elems, params = setmetatable({}, { __mode = 'v' }),
           views = {}, buckets = {}, handles = tensor_ptrs(math.max(#params, 1)) }
  plan.device = params[1]:device()
  plan.flat = T.empty({ math.max(total, 1) }, { dtype = 'f32', device = plan.device })
  local off = 0
  for i, p in ipairs(params) do
    plan.params[i] = p
    plan.views[i] = plan.flat:narrow(1, off + 1, p:numel()):view(p:shape())
    off = off + p:numel()
  end
  for start = 0, total - 1, bucket_elems do
    plan.buckets[#plan.buckets + 1] = plan.flat:narrow(1, start + 1, math.min(bucket_elems, total - start))
  end
  grad_buffers[params[1]] = plan
  return plan
end

-- Sums every parameter's grad over `group` (default: the world) with one all-reduce per bucket
-- of opts.bucket_bytes (default 64 MiB) of a flat f32 buffer, then multiplies by opts.scale
-- (e.g. 1 / dp_size). A parameter without a grad contributes zeros and gets a zero-based grad.
function dist.all_reduce_grads(params, group, opts)
  opts = opts or {}
  if type(params) ~= 'table' then raise('all_reduce_grads: expected a list of parameters') end
  if #params == 0 then return end
  group = group or grid().world_group
  if getmetatable(group) ~= Group then raise('all_reduce_grads: the group must be a dist group (e.g. grid.dp_group)') end
  local bucket_bytes = opts.bucket_bytes or BUCKET_BYTES
  local plan = grad_plan(params, math.max(1, math.floor(bucket_bytes / 4)))
  if plan.checked_on ~= group then   -- once per list and group: the ranks hold the same parameters
    group:check_same('all_reduce_grads: the number of parameters', { #params })
    local sizes = {}
    for _, p in ipairs(params) do sizes[#sizes + 1] = p:numel() end
    group:check_same('all_reduce_grads: the list of parameter sizes', sizes)
    plan.checked_on = group
  end
  for i, p in ipairs(params) do
    local g = p.grad
    if g then plan.views[i]:copy_(g) else plan.views[i]:zero_() end
  end
  for _, b in ipairs(plan.buckets) do group:all_reduce_(b, 'sum') end
  for i, p in ipairs(params) do
    local g = p.grad
    if g then g:copy_(plan.views[i]) else check(C.uly_tensor_set_grad(p._h, plan.views[i]:clone()._h)) end
    plan.handles[i - 1] = p._h
  end
  local scale = opts.scale or 1
  if scale ~= 1 then check(C.uly_grad_scale_(plan.handles, #params, scale)) end
end

-- dist.grad_sync(params, group, opts): gradient all-reduce overlapped with backward (grad_sync.lua)
dist.Group = Group
function dist.grad_sync(params, group, opts) return require('ulysses.grad_sync').new(dist, params, group, opts) end
-- dist.ZeroAdamW(params, group, opts): AdamW with its state sharded over the group (zero.lua)
function dist.ZeroAdamW(params, group, opts) return require('ulysses.zero').new(dist, params, group, opts) end

---------------------------------------------------------------- Ulysses exchanges
-- dist.split(n, parts, index) -> start, length (0-based start; the first n % parts parts get
-- one extra): how a sequence of n tokens (or n heads) is shared out
function dist.split(n, parts, index)
  local s, l = ffi.new('int64_t[1]'), ffi.new('int64_t[1]')
  check(C.uly_ulysses_split(n, parts, index, s, l))
  return tonumber(s[0]), tonumber(l[0])
end

-- dist.heads(H, G, parts, index) -> { q_start, q_count, kv_start, kv_count } (0-based starts)
function dist.heads(heads, kv_heads, parts, index)
  local v = ffi.new('int64_t[4]')
  check(C.uly_ulysses_heads(heads, kv_heads, parts, index, v, v + 1, v + 2, v + 3))
  return { q_start = tonumber(v[0]), q_count = tonumber(v[1]), kv_start = tonumber(v[2]), kv_count = tonumber(v[3]) }
end

-- sequence-sharded qkv [B, n_r, H + 2G, D] -> head-sharded [B, N, Hq_r + 2 Gk_r, D] (autograd)
function dist.qkv_to_heads(group, qkv, heads, kv_heads, seq_total)
  return wrap(C.uly_ulysses_qkv_to_heads(group._c, H(qkv, 'qkv_to_heads'), heads, kv_heads, seq_total))
end

-- head-sharded attention output [B, N, Hq_r, D] -> sequence-sharded [B, n_r, H, D] (autograd)
function dist.heads_to_seq(group, o, heads, seq_total)
  return wrap(C.uly_ulysses_heads_to_seq(group._c, H(o, 'heads_to_seq'), heads, seq_total))
end

function dist.exchange_copies() return tonumber(C.uly_ulysses_copies()) end

return dist
