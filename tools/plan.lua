-- tools/plan.lua — the memory planner: the peak memory per rank of one training step (forward,
-- backward, AdamW) for a model config, sequence length, sequence-parallel degree P, batch,
-- attention kind and checkpoint/tile choices, and the longest sequence that fits a budget.
--
--   luajit tools/plan.lua --model llama --preset small --seq 65536 --sp 4 --attention flash \
--     --checkpoint 1 (2: except attention) --tile 1024 [--budget 20GiB] [--window 4096] [--batch 1] [--dim ..]
--     [--device cuda [--precision bf16] [--gpu-memory 139GiB]]   (one GPU per rank)
--     [--activations bf16]   (uly.activation_dtype: activations kept in bf16 between ops)
--     [--dp 2] [--zero 1] [--overlap 1]   (data parallel x sp ranks; ZeroAdamW's sharded state
--     over all of them; the gradient reduction during backward, train.lua's default)
--   local plan = require 'tools.plan'
--   plan.estimate(cfg) -> { total = bytes, parts = { parameters = .., ... }, untracked = .., ... }
--   plan.longest(cfg, budget_bytes) -> N (a multiple of cfg.step, default 1024), its estimate
--
-- How: not fitted constants but a replay of the step on sizes only. The model's Lua code is
-- mirrored op by op (models/gpt.lua, models/llama.lua, nn/transformer.lua, nn/checkpoint.lua,
-- models/common.lua); each op allocates what its C dispatch allocates (core/ops.c, flash.c,
-- ulysses.c: results, contiguous copies, saved statistics, scratch), saves what it saves for
-- backward, and the backward engine of core/autograd.c is replayed (gradient buffers created on
-- first use, views/adds passing the gradient through, saved tensors released per node). Sizes
-- go through the allocator's size classes (core/alloc.c). Two effects of LuaJIT matter and are
-- replayed too: a tensor dropped by Lua is freed only when the collector runs, and the
-- collector runs when the bytes held grow past a threshold that follows them up and down
-- (lua/ulysses/tensor.lua: wrap) or
-- when checkpoint/chunked force it. Memory malloc'ed inside kernels (the reference attention's
-- dS scratch, RoPE's kept cos/sin table) is outside the allocator's counters: reported as `untracked`.
-- On a GPU (--device cuda) the same replay runs against the device pool (512 B granularity,
-- garbage capped at 1/16 of the GPU's memory), the CUDA attention takes no pool scratch, and the
-- kernels' stream-ordered temporaries (bf16 operand copies, chunked score scratch) are the
-- untracked part: the largest one call takes. kernels = 'cpu' replays the simulated device
-- (ULY_CUDA_SIMULATE: device pools, the CPU's kernels), as the specs check it.
-- Not replayed: LuaJIT's own incremental cycles (paced by Lua-side allocation). They can only
-- free garbage earlier, so the estimate is an upper bound; measured within 10 % for most
-- configs, but reference attention + checkpoint without tile can measure ~40 % lower in some
-- runs (a replayed block's garbage collected early during backward).
local M = {}

local MiB, GiB = 2 ^ 20, 2 ^ 30
local GC_MIN_GROWTH = 64 * MiB          -- lua/ulysses/tensor.lua
local HUGE_PAGE = 2 * MiB               -- core/alloc.c

-- core/alloc.c round_size: 64 B granularity to 64 KiB (512 B in a device pool), 1/8 power-of-two
-- steps, whole huge pages
local function round_size(n, device)
  if n <= 0 then n = 1 end
  local g = device and device ~= 'cpu' and 512 or 64
  if n <= 65536 then return math.ceil(n / g) * g end
  if n >= HUGE_PAGE then return math.ceil(n / HUGE_PAGE) * HUGE_PAGE end
  local p = 2 ^ math.floor(math.log(n) / math.log(2))
  while p * 2 <= n do p = p * 2 end
  while p > n do p = p / 2 end
  local step = p / 8
  return math.ceil(n / step) * step
end
M.round_size = round_size

M.H200_MEMORY = 139 * GiB   -- an H200 as lent here ("about 139 GiB"); pass the real total with --gpu-memory

M.PARTS = { 'parameters', 'gradients', 'optimizer', 'inputs', 'activations', 'attention', 'communication',
            'logits', 'backward', 'uncollected' }
M.PART_HELP = {
  parameters = 'model weights',
  gradients = 'parameter .grad buffers',
  optimizer = 'AdamW exp_avg + exp_avg_sq (f32)',
  inputs = 'token ids and targets of the step',
  activations = 'kept for backward (saved tensors, checkpoint inputs)',
  attention = 'probabilities / log-sum-exp / flash tile scratch',
  communication = 'Ulysses exchanges, their staging buffers, all-reduce flat buffer',
  logits = 'logits, loss rows and their gradient',
  backward = 'transient gradient buffers during backward',
  uncollected = 'tensors dropped by Lua, waiting for its collector',
}

---------------------------------------------------------------- the simulated allocator
local Sim = {}
Sim.__index = Sim

-- c.device: the pool replayed ('cpu' or 'cuda'); c.device_memory: its size (a device pool's
-- garbage is capped at 1/16 of it, lua/ulysses/tensor.lua)
local function new_sim(c, gc_next)
  local by = {}
  for _, p in ipairs(M.PARTS) do by[p] = 0 end
  return setmetatable({ cur = 0, peak = 0, by = by, at_peak = {}, gc_next = gc_next or GC_MIN_GROWTH,
                        garbage = {}, frame = {}, grad = true, pending = {}, swept = {}, seq = 0, untracked = 0, phase = 'setup',
                        peak_phase = 'setup', device = c.device, device_memory = c.device_memory,
                        kernels = c.kernels, precision = c.precision, act16 = c.activations == 'bf16',
                        native16 = c.activations == 'bf16' and c.kernels == 'cuda' and c.precision == 'bf16',
                        -- bf16-activation kernels: the CUDA library's, and the CPU's own on the host
                        -- (kernels/cpu/bf16_twins.c; the simulated device has none)
                        k16 = c.kernels == 'cuda' or c.device == 'cpu' }, Sim)
end

function Sim:mark_peak()
  if self.cur > self.peak then
    self.peak = self.cur
    for k, v in pairs(self.by) do self.at_peak[k] = v end
    self.peak_phase = self.phase
  end
end

-- a new storage of `bytes` owned by one handle
function Sim:alloc(bytes, cat)
  local b = round_size(bytes, self.device)
  local s = { b = b, cat = cat, refs = 1, dead = 0 }
  self.cur = self.cur + b
  self.by[cat] = self.by[cat] + b
  self:mark_peak()
  return s
end

function Sim:ref(s) s.refs = s.refs + 1 end

-- a storage whose only handles are dead Lua wrappers counts as uncollected garbage
local function recheck(self, s)
  if s.refs > 0 and s.refs == s.dead and not s.garbage then
    s.garbage = true
    self.by[s.cat] = self.by[s.cat] - s.b
    self.by.uncollected = self.by.uncollected + s.b
  end
end

function Sim:unref(s)
  s.refs = s.refs - 1
  if s.refs == 0 then
    self.cur = self.cur - s.b
    local cat = s.garbage and 'uncollected' or s.cat
    self.by[cat] = self.by[cat] - s.b
  else
    recheck(self, s)
  end
end

-- Lua wrappers: every handle a Lua frame holds; leave() turns them into garbage
function Sim:hold(s) self.frame[#self.frame + 1] = s end
function Sim:enter()
  local outer = self.frame
  self.frame = {}
  return outer
end
function Sim:drop(s)
  for i = #self.frame, 1, -1 do
    if self.frame[i] == s then
      table.remove(self.frame, i)
      s.dead = s.dead + 1
      self.garbage[#self.garbage + 1] = s
      recheck(self, s)
      return
    end
  end
end
function Sim:leave(outer, keep)
  local kept = false
  for _, s in ipairs(self.frame) do
    if keep and s == keep.s and not kept then
      kept = true
      outer[#outer + 1] = s
    else
      s.dead = s.dead + 1
      self.garbage[#self.garbage + 1] = s
      recheck(self, s)
    end
  end
  self.frame = outer
end

-- a handle held by a Lua table (not a frame) that the table lets go of: garbage from now on
function Sim:forget(s)
  s.dead = s.dead + 1
  self.garbage[#self.garbage + 1] = s
  recheck(self, s)
end

-- a full collection: every dead wrapper releases its handle
function Sim:collect()
  local g = self.garbage
  self.garbage = {}
  for _, s in ipairs(g) do
    s.dead = s.dead - 1
    if s.garbage and s.dead == 0 then
      s.garbage = false
      self.by.uncollected = self.by.uncollected - s.b
      self.by[s.cat] = self.by[s.cat] + s.b
    end
    self:unref(s)
  end
end

-- after every wrap(): the threshold comes down with the held bytes, then a collection when they
-- passed it (lua/ulysses/tensor.lua: collect_if_grown)
function Sim:wrapped()
  local lower = self.cur + math.max(GC_MIN_GROWTH, self.cur / 4)
  if lower < self.gc_next then self.gc_next = lower end
  if self.cur > self.gc_next then
    self:collect()
    local growth = math.max(GC_MIN_GROWTH, self.cur / 4)                -- lua/ulysses/tensor.lua
    if self.device ~= 'cpu' then growth = math.min(growth, math.max(GC_MIN_GROWTH, self.device_memory / 16)) end
    self.gc_next = self.cur + growth
  end
end

-- memory a CUDA kernel takes from the stream-ordered allocator for one call (bf16 operand
-- copies, score scratch): outside the pool, freed in stream order, so its pool keeps the
-- largest call's worth (kernels/cuda/backend.cu)
function Sim:cuda_temporary(bytes)
  if self.kernels == 'cuda' then self.untracked = math.max(self.untracked, bytes) end
end

---------------------------------------------------------------- tensors and autograd
-- a tensor: { s = storage, b = bytes, es = element size (2: bf16 activations; nil: 4), node =
--   producing node, rg = requires grad, leaf = bool, contig = bool, param = bool, grad = storage }
local function result(self, bytes, cat)
  local s = self:alloc(bytes, cat)
  self:hold(s)
  return { s = s, b = bytes, contig = true }
end

-- a tensor's bytes as f32 (its gradient's size)
local function f32_bytes(t) return t.es == 2 and t.b * 2 or t.b end

-- record a node when grad mode is on and an input requires grad; saved storages gain a handle;
-- conv: the bytes of the f32 copies the engine makes of bf16 saved tensors around the rule
function Sim:record(out, inputs, saved, rule, pass, conv)
  if not self.grad then return end
  local any = false
  for _, t in ipairs(inputs) do any = any or t.rg end
  if not any then return end
  self.seq = self.seq + 1
  local n = { id = self.seq, inputs = inputs, saved = {}, rule = rule, pass = pass, out_f32 = f32_bytes(out), conv = conv }
  for _, s in ipairs(saved or {}) do
    self:ref(s)
    n.saved[#n.saved + 1] = s
  end
  out.node, out.rg = n, true
end

-- a view handle on t's storage (wrapped in Lua unless internal); node passes the gradient through
function Sim:view(t, bytes, opts)
  opts = opts or {}
  local v = { s = t.s, b = bytes or t.b, es = t.es, contig = opts.contig ~= false and t.contig }
  if not opts.internal then
    self:ref(t.s)
    self:hold(t.s)
  end
  self:record(v, { t }, nil, nil, opts.narrow and nil or { true })
  if not opts.internal then self:wrapped() end
  return v
end

-- gradient buffer of input t (core/autograd.c edge_grad)
-- gradients are f32, whatever the tensor's dtype
function Sim:edge_grad(t)
  local gb = f32_bytes(t)
  if t.node then
    local slot = t.node.gout
    if not slot then
      slot = { s = self:alloc(gb, 'backward') }
      t.node.gout = slot
    elseif slot.borrowed then
      local own = self:alloc(gb, 'backward')
      self:unref(slot.s)
      slot.s, slot.borrowed = own, false
    end
    return slot.s
  end
  if not t.grad then t.grad = self:alloc(gb, t.param and 'gradients' or 'backward') end
  return t.grad
end

local function reachable(root)
  local seen, list, stack = {}, {}, { root.node }
  while #stack > 0 do
    local n = table.remove(stack)
    if not seen[n] then
      seen[n] = true
      list[#list + 1] = n
      for _, t in ipairs(n.inputs) do if t.node and not seen[t.node] then stack[#stack + 1] = t.node end end
    end
  end
  table.sort(list, function(a, b) return a.id > b.id end)
  return list
end

-- core/autograd.c uly_backward: g0 is a new buffer (a copy of the given gradient)
function Sim:backward(root)
  local prev = self.grad
  self.grad = false
  local order = reachable(root)
  root.node.gout = { s = self:alloc(f32_bytes(root), 'backward') }
  for _, n in ipairs(order) do
    if n.gout then
      local gins = {}
      for k, t in ipairs(n.inputs) do
        if t.rg then
          if n.pass and n.pass[k] and t.node and not t.node.gout and f32_bytes(t) == n.out_f32 then
            self:ref(n.gout.s)
            t.node.gout = { s = n.gout.s, borrowed = true }
          else
            gins[k] = self:edge_grad(t)
          end
        end
      end
      local conv = {}   -- core/autograd.c saved_as_f32: bf16 saved tensors as f32 copies for the rule
      for _, b in ipairs(n.conv or {}) do conv[#conv + 1] = self:alloc(b, 'backward') end
      if n.rule then n.rule(self, n, gins) end
      for _, cs in ipairs(conv) do self:unref(cs) end
      self:unref(n.gout.s)
      n.gout = nil
      for _, s in ipairs(n.saved) do self:unref(s) end
      n.saved = {}
    end
  end
  self.grad = prev
end

-- a transient buffer inside an op or rule
function Sim:scratch(bytes, cat)
  local s = self:alloc(bytes, cat)
  self:unref(s)
end

---------------------------------------------------------------- ops (core/ops.c and friends)
local F = 4 -- bytes per f32

-- t itself when contiguous, else a copy (a C-internal handle the caller releases)
local function contiguous(self, t, cat)
  if t.contig then
    self:ref(t.s)
    return t.s
  end
  return self:alloc(t.b, cat or 'activations')
end

local function elems(t) return t.b / (t.es or F) end

-- bf16 activations (core/tensor.c): the f32 copy an op's kernel reads of a bf16 input
-- (uly_contiguous_f32; the caller unrefs it); nil for an f32 input
local function f32_copy(self, t, cat)
  if t.es ~= 2 then return nil end
  return self:alloc(t.b * 2, cat or 'activations')
end
local function unref_opt(self, s) if s then self:unref(s) end end
-- a bf16 result of n elements
local function result16(self, n, cat)
  local out = result(self, n * 2, cat)
  out.es = 2
  return out
end

-- an op's result of n elements: computed into f32 (output_begin), then, for bf16 inputs,
-- rounded into a bf16 result and the f32 one freed (output_end: uly_result_as)
local function output_begin(self, n, bf16, cat)
  if not bf16 then return { out = result(self, n * F, cat) } end
  return { f = self:alloc(n * F, cat), n = n, cat = cat }
end
local function output_end(self, o)
  if o.out then return o.out end
  local out = result16(self, o.n, o.cat)
  self:unref(o.f)
  return out
end
local function output(self, n, bf16, cat) return output_end(self, output_begin(self, n, bf16, cat)) end

-- the CUDA GEMM's temporaries (kernels/cuda/gemm.cu): in bf16, copies of both operands in the
-- forward (x [rows, k], w [n, k]); in backward the output gradient is rounded once into the pool
-- when both GEMMs take it (core/backward.c bf16_once), and each GEMM rounds its other operand
-- (dx = g w^T: w; dw = x^T g: x); a bias gradient over >= 4096 rows sums partials in doubles
-- (kernels/cuda/elementwise.cu sum_view); returns the backward's rule. x16: x is bf16 already
-- (bf16 activations), so nothing rounds it
local function gemm_temporaries(self, rows, k, n, bias, x_grad, x16)
  if self.kernels ~= 'cuda' then return nil end
  local xr = x16 and 0 or rows * k   -- x's rounded copy
  if self.precision == 'bf16' then self:cuda_temporary((xr + n * k) * 2) end
  return function(sim)
    if sim.precision == 'bf16' then
      if x_grad then
        sim:scratch(rows * n * 2, 'backward')
        sim:cuda_temporary(math.max(n * k, xr) * 2)
      else   -- dw = x^T g alone
        sim:cuda_temporary((xr + rows * n) * 2)
      end
    end
    if bias and rows >= 4096 and n < 65536 then sim:cuda_temporary(math.min(math.floor(rows / 1024), 128) * n * 8) end
  end
end

-- x @ w (w a parameter [k, n]); x saved as it is when contiguous, else a copy. nn.Linear with a
-- bias is one addmm (core/ops.c: the bias seeds the output, one GEMM adds), which saves the same.
-- bf16 activations: x saved as bf16; where the GEMM cannot read bf16 (CPU kernels, f32
-- precision) an f32 copy of it for the product, and one for backward's rule; the result rounded
-- to bf16 (by cuBLASLt itself on the CUDA kernels without a bias; with a bias and no bf16 GEMMs:
-- the f32 product, plus the bias, then a copy node)
local function matmul(self, x, rows, k, n, w, cat, bias)
  cat = cat or 'activations'
  local x16 = x.es == 2
  local native = x16 and self.native16
  local xs = contiguous(self, x)
  local xf = (x16 and not native) and self:alloc(rows * k * F, 'activations') or nil
  local inputs = bias and { x, w, bias } or { x, w }
  local conv = (x16 and not native) and { rows * k * F } or nil
  local rule = gemm_temporaries(self, rows, k, n, bias ~= nil, x.rg, x16)
  local out
  if x16 and bias and not native then   -- core/ops.c addmm's general path
    local t = self:alloc(rows * n * F, cat)
    self:unref(xf)
    xf = nil
    local sum = self:alloc(rows * n * F, cat)
    self:unref(t)
    local inner = { s = sum, b = rows * n * F, contig = true }
    self:record(inner, inputs, { xs }, rule, nil, conv)
    out = result16(self, rows * n, cat)
    self:unref(sum)
    self:record(out, { inner })
  elseif native and not bias then   -- core/ops.c: the bf16 result straight from cuBLASLt
    out = result16(self, rows * n, cat)
    self:record(out, inputs, { xs }, rule, nil, conv)
  else
    out = output(self, rows * n, x16, cat)
    self:record(out, inputs, { xs }, rule, nil, conv)
  end
  unref_opt(self, xf)
  self:unref(xs)
  self:wrapped()
  return out
end

local function linear(self, x, rows, k, n, lin, cat)
  return matmul(self, x, rows, k, n, lin.weight, cat, lin.bias)
end

-- (k16: kernels that read and write bf16 themselves, uly_backend.h, the CUDA ones or the CPU's: no
-- f32 copies, the result written in its dtype, and backward's rule reads the bf16 saved input)
local function add(self, a, b)
  local bf16 = (a.es == 2 and b.es == 2) or ((a.es == 2 or b.es == 2) and self.act16)
  local direct = self.k16 and (a.es == 2 or b.es == 2)
  local af = not direct and f32_copy(self, a) or nil
  local bf = not direct and f32_copy(self, b) or nil
  local n = math.max(elems(a), elems(b))
  local out
  if not direct then out = output(self, n, bf16, 'activations')
  elseif bf16 then out = result16(self, n, 'activations')
  else out = result(self, n * F, 'activations') end
  unref_opt(self, af); unref_opt(self, bf)
  self:record(out, { a, b }, nil, nil, { true, true })
  self:wrapped()
  return out
end

local function norm(self, x, rows, kind, mod)
  local x16 = x.es == 2
  local direct = x16 and self.k16
  local xf = not direct and f32_copy(self, x) or nil
  local xs = contiguous(self, x)
  local o = direct and { out = result16(self, elems(x), 'activations') } or output_begin(self, elems(x), x16, 'activations')
  local stats = { self:alloc(rows * F, 'activations') }
  if kind == 'layernorm' then stats[2] = self:alloc(rows * F, 'activations') end
  local out = output_end(self, o)
  local rule = self.kernels == 'cuda' and function(sim)   -- kernels/cuda/rows.cu: per-chunk partial sums
    sim:cuda_temporary(2 * math.min(rows, 128) * (elems(x) / rows) * 8)
  end or nil
  self:record(out, { x, mod.weight, mod.bias }, { xs, stats[1], stats[2] }, rule, nil,
              (x16 and not direct) and { elems(x) * F } or nil)
  unref_opt(self, xf)
  self:unref(xs)
  for _, s in ipairs(stats) do self:unref(s) end
  self:wrapped()
  return out
end

-- the CPU kernel keeps the (cos, sin) table of its last large call, T positions x D floats,
-- malloc'ed (kernels/cpu/rope.c: from 65536 (position, pair)s, up to 256 MiB): untracked, held
local ROPE_TABLE_MIN, ROPE_TABLE_MAX = 65536, 256 * 2 ^ 20
local function rope(self, x, T, D)
  local bytes = T * D * F
  if self.kernels ~= 'cuda' and T * D / 2 >= ROPE_TABLE_MIN and bytes <= ROPE_TABLE_MAX then
    self.rope_table = math.max(self.rope_table or 0, bytes)
  end
  local direct = self.k16 and x.es == 2
  local xs = (x.es == 2 and not direct) and f32_copy(self, x) or contiguous(self, x)
  local out = direct and result16(self, elems(x), 'activations') or output(self, elems(x), x.es == 2, 'activations')
  self:record(out, { x })
  self:unref(xs)
  self:wrapped()
  return out
end

local function unary(self, x)     -- gelu: saves its input and its output
  local direct = self.k16 and x.es == 2
  local xf, xs = nil, nil
  if direct then xs = contiguous(self, x) else xf = f32_copy(self, x) end
  local out = direct and result16(self, elems(x), 'activations') or output(self, elems(x), x.es == 2, 'activations')
  if not direct then xs = contiguous(self, x) end
  self:record(out, { x }, { xs, out.s }, nil, nil, (x.es == 2 and not direct) and { elems(x) * F, elems(x) * F } or nil)
  unref_opt(self, xf)
  self:unref(xs)
  self:wrapped()
  return out
end

local function swiglu(self, g, u)
  local direct = self.k16 and g.es == 2 and u.es == 2
  local gs, us, gf, uf
  if direct then gs, us = contiguous(self, g), contiguous(self, u) else gf, uf = f32_copy(self, g), f32_copy(self, u) end
  local bf16 = (g.es == 2 and u.es == 2) or ((g.es == 2 or u.es == 2) and self.act16)
  local out = direct and result16(self, elems(g), 'activations') or output(self, elems(g), bf16, 'activations')
  if not direct then gs, us = contiguous(self, g), contiguous(self, u) end
  local conv = {}
  if g.es == 2 and not direct then conv[#conv + 1] = elems(g) * F end
  if u.es == 2 and not direct then conv[#conv + 1] = elems(u) * F end
  self:record(out, { g, u }, { gs, us }, nil, nil, conv)
  unref_opt(self, gf); unref_opt(self, uf)
  self:unref(gs); self:unref(us)
  self:wrapped()
  return out
end

-- the reference kernel: contiguous q/k/v (saved), probabilities [B, H, Tq, Tk] (saved), output;
-- backward malloc's a dS scratch outside the allocator (kernels/cpu/attention_ref.c)
local function attention_ref(self, q, k, v, a)
  local qs, ks, vs = contiguous(self, q), contiguous(self, k), contiguous(self, v)
  local probs = self:alloc(a.B * a.H * a.Tq * a.Tk * F, 'attention')
  local out = result(self, a.B * a.Tq * a.H * a.D * F, 'activations')
  if self.kernels == 'cuda' then self:cuda_temporary(a.B * a.H * a.Tq * F) end   -- the lse of the fused pass
  local function rule(sim)
    if sim.kernels == 'cuda' then   -- out, delta and lse recomputed (kernels/cuda/attention.cu)
      sim:cuda_temporary(a.B * a.H * a.Tq * (a.D + 2) * F)
      return
    end
    local rep, nt = a.H / a.Hkv, a.threads
    local nrb, nkb = math.ceil(a.Tq / 64), math.ceil(a.Tk / 64)
    local stride = math.ceil(a.Tq * a.Tk / 16) * 16
    local par = nt > 1 and 4 * a.B * a.H * a.Tq * a.Tk * a.D >= 65536
    local per_group = math.min(rep * nrb, nkb)
    local nbatch = par and math.ceil(4 * nt / per_group) or 1
    nbatch = math.min(nbatch, a.B * a.Hkv)
    while nbatch > 1 and nbatch * rep * stride > 2 ^ 26 do nbatch = math.floor(nbatch / 2) end
    sim.untracked = math.max(sim.untracked, nbatch * rep * stride * F)
  end
  self:record(out, { q, k, v }, { qs, ks, vs, probs }, rule)
  self:unref(qs); self:unref(ks); self:unref(vs); self:unref(probs)
  self:wrapped()
  return out
end

-- the flash kernel (core/flash.c): q/k/v read in place (saved: a strided view keeps its whole
-- storage), output and log-sum-exp saved, K tile scratch in forward, Q/dO tiles + two dQ
-- partial-sum buffers + delta in backward (kernels/cpu/flash_attention.c
-- flash_attention_scratch_floats)
-- The CUDA kernels take no scratch from the pool (one float, the minimum) but stream-ordered
-- temporaries (kernels/cuda/attention.cu): in bf16 copies of q, k, v (and dO in backward); at
-- head dims 32 / 64 / 128 in bf16 the fused kernels need nothing else, otherwise the chunked
-- path's scores (and probabilities / dS in backward) for a chunk of ~64 Mi / Tk query rows.
local function cuda_flash_temporaries(a, precision, backward)
  local nq, nk = a.B * a.Tq * a.H * a.D, a.B * a.Tk * a.Hkv * a.D
  local bf16 = precision == 'bf16'
  local copied = a.qkv16 and 0 or nq + 2 * nk   -- bf16 activations: q, k, v read as they are
  local bytes = bf16 and (copied + (backward and nq or 0)) * 2 or 0
  if not (bf16 and (a.D == 32 or a.D == 64 or a.D == 128)) then
    local rows = tonumber(os.getenv('ULY_CUDA_ATTN_CHUNK') or '') or math.max(16, math.floor(2 ^ 26 / math.max(a.Tk, 1) / 16) * 16)
    local per = math.min(rows, a.Tq) * math.max(a.Tk, 1)
    bytes = bytes + per * (backward and 2 or 1) * (F + (bf16 and 2 or 0))
  end
  return bytes
end

M.cuda_flash_temporaries = cuda_flash_temporaries

-- in a checkpoint_except_attention segment (lua/ulysses/attention_keep.lua) the forward's output
-- and lse gain a handle on the segment's tape; the replay's call takes them back (a new view of
-- the output, no forward, no scratch) and the tape's handles become garbage
-- bf16 activations (core/flash.c): on the CUDA kernels in bf16 q, k, v are read and saved as
-- they are; elsewhere each is an f32 copy (saved); the output is computed in f32 and rounded to
-- bf16, and backward's rule gets an f32 copy of it
local function attention_flash(self, q, k, v, a)
  local nqt, nkt = math.ceil(a.Tq / 64), math.ceil(a.Tk / 64)
  local kt, qt = a.B * a.Hkv * nkt * a.D * 64, a.B * a.H * nqt * a.D * 64
  local cuda = self.kernels == 'cuda'
  local q16 = q.es == 2
  a.qkv16 = q16 and self.native16
  local no = a.B * a.Tq * a.H * a.D
  local operands = { q.s, k.s, v.s }
  if q16 and not self.native16 then
    operands = { f32_copy(self, q), f32_copy(self, k), f32_copy(self, v) }
  end
  local lse, out
  local tape = self.keep_replaying
  if tape then
    tape.pos = tape.pos + 1
    local item = tape.items[tape.pos]
    tape.items[tape.pos] = nil
    out = { s = item.out, b = no * (q16 and 2 or F), es = q16 and 2 or nil, contig = true }
    self:ref(out.s); self:hold(out.s)
    lse = item.lse
    self:ref(lse)
    self:forget(item.out); self:forget(item.lse)
  else
    lse = self:alloc(a.B * a.H * a.Tq * F, 'attention')
    local o = output_begin(self, no, q16, 'activations')
    self:scratch(cuda and F or kt * F, 'attention')
    out = output_end(self, o)
    if cuda then self:cuda_temporary(cuda_flash_temporaries(a, self.precision, false)) end
    if self.keep_recording then
      self:ref(out.s); self:ref(lse)
      local items = self.keep_recording.items
      items[#items + 1] = { out = out.s, lse = lse }
    end
  end
  local Dp = math.ceil(a.D / 16) * 16
  local dq_groups = 2 * a.B * a.H * nqt * 64 * Dp    -- DQ_GROUPS = 2 partial dQ buffers
  local function rule(sim)
    local delta = sim:alloc(a.B * a.H * a.Tq * F, 'backward')
    if cuda then
      sim:scratch(F, 'attention')
      sim:cuda_temporary(cuda_flash_temporaries(a, sim.precision, true))
    else
      sim:scratch((2 * qt + dq_groups) * F, 'attention')   -- Q^T and dO^T tiles + the dQ groups
    end
    sim:unref(delta)
  end
  self:record(out, { q, k, v }, { operands[1], operands[2], operands[3], out.s, lse }, rule, nil,
              q16 and { no * F } or nil)
  if operands[1] ~= q.s then for _, st in ipairs(operands) do self:unref(st) end end
  self:unref(lse)
  self:wrapped()
  return out
end

local function cross_entropy(self, logits, rows)
  local direct = self.k16 and logits.es == 2
  local lf = not direct and f32_copy(self, logits, 'logits') or nil   -- bf16 logits: read as f32, saved as bf16
  local ls = contiguous(self, logits)
  local loss_rows = self:alloc(rows * F, 'logits')
  local lse = self:alloc(rows * F, 'logits')
  local out = result(self, F, 'logits')
  local function rule(sim) sim:scratch(rows * F, 'logits') end
  self:record(out, { logits }, { ls, lse }, rule, nil, (logits.es == 2 and not direct) and { elems(logits) * F } or nil)
  unref_opt(self, lf)
  self:unref(ls); self:unref(loss_rows); self:unref(lse)
  self:wrapped()
  return out
end

local function scalar_mul(self, x)
  local out = result(self, x.b, 'logits')
  self:record(out, { x })
  self:wrapped()
  return out
end

---------------------------------------------------------------- the model, mirrored
-- parameters as leaf tensors, allocated in registration order (each through wrap)
local function param(self, list, numel)
  local p = { s = self:alloc(numel * F, 'parameters'), b = numel * F, rg = true, leaf = true, param = true,
              contig = true }
  list[#list + 1] = p
  self:wrapped()
  return p
end

local function build_params(self, c)
  local ps = {}
  local C, L, V = c.dim, c.layers, c.vocab
  local model = { layers = {} }
  local function lin(i, o, bias) return { weight = param(self, ps, i * o), bias = bias and param(self, ps, o) or nil } end
  local function nrm() return { weight = param(self, ps, C), bias = c.norm == 'layernorm' and param(self, ps, C) or nil } end
  model.embed = param(self, ps, V * C)
  if c.model == 'gpt' then model.pos = param(self, ps, c.seq * C) end
  for l = 1, L do
    local blk = {}
    blk.norm1 = nrm()
    blk.wqkv = lin(C, (c.heads + 2 * c.kv_heads) * c.head_dim, c.bias)
    blk.proj = lin(C, C, c.bias)
    blk.norm2 = nrm()
    if c.mlp == 'swiglu' then
      blk.w1, blk.w3, blk.w2 = lin(C, c.hidden, c.bias), lin(C, c.hidden, c.bias), lin(c.hidden, C, c.bias)
    else
      blk.fc, blk.fproj = lin(C, c.hidden, c.bias), lin(c.hidden, C, c.bias)
    end
    model.layers[l] = blk
  end
  model.norm = nrm()
  if not c.tied then model.output = lin(C, V, false) end
  model.params = ps
  return model
end

-- A Ulysses exchange's transient buffers around its f32 result or staging buffer (core/ulysses.c,
-- core/comm_exchange.c): in bf16 precision a bf16 copy of what it sends (made before the result) and a
-- bf16 buffer it receives into (after); on the device also the packed send and receive blocks,
-- in the exchanged dtype. exchange_begin before the result, exchange_end after it, with the
-- elements this rank sends and receives.
-- With bf16 activations what crosses is bf16 whatever the precision, and bf16 data is sent and
-- received as it is (data16: no copy, no receive buffer).
local function exchange_begin(sim, send_elems, data16)
  if sim.precision ~= 'bf16' and not sim.act16 then return nil end
  if data16 then return nil end
  return sim:alloc(send_elems * 2, 'communication')
end

local function exchange_end(sim, send_copy, send_elems, recv_elems)
  local es = (sim.precision == 'bf16' or sim.act16) and 2 or 4
  local recv = send_copy and sim:alloc(recv_elems * es, 'communication')
  if sim.device == 'cuda' then
    local packed = sim:alloc(math.max(send_elems, 1) * es, 'communication')
    sim:scratch(math.max(recv_elems, 1) * es, 'communication')
    sim:unref(packed)
  end
  if recv then sim:unref(recv) end
  if send_copy then sim:unref(send_copy) end
end

-- SelfAttention:forward (+ DistributedAttention:forward_qkv under P > 1) on x [B, n, C]
local function self_attention(self, c, blk, x)
  local outer = self:enter()
  local B, n, D, H, G = c.batch, c.n, c.head_dim, c.heads, c.kv_heads
  local rows = B * n
  local qkv = linear(self, x, rows, c.dim, (H + 2 * G) * D, blk.wqkv)
  qkv = self:view(qkv)
  local y
  local attend = c.attention == 'flash' and attention_flash or attention_ref
  if c.sp > 1 then
    local N, hq, gk = c.seq_total, c.hq, c.gk
    local es = qkv.es or F
    local src = contiguous(self, qkv)
    local heads, stage_floats = B * N * (hq + 2 * gk) * D, B * n * c.stage_width * D
    local send = exchange_begin(self, B * n * (H + 2 * G) * D, es == 2)
    local recv = result(self, heads * es, 'communication')
    recv.es = qkv.es
    exchange_end(self, send, stage_floats, heads)
    -- backward receives straight into the new gradient (core/ulysses.c) when the exchange is f32
    -- and no K/V head went to two ranks; else into a staging buffer, added after
    local f32_exchange = self.precision ~= 'bf16' and not self.act16
    local direct_qkv = f32_exchange and c.stage_width == H + 2 * G
    self:record(recv, { qkv }, nil, function(sim)
      local stage = not direct_qkv and sim:alloc(stage_floats * F, 'communication')
      exchange_end(sim, exchange_begin(sim, heads), heads, stage_floats)
      if stage then sim:unref(stage) end
    end)
    self:unref(src)
    self:wrapped()
    local q = self:view(recv, B * N * hq * D * es, { narrow = true, contig = false })
    local k = self:view(recv, B * N * gk * D * es, { narrow = true, contig = false })
    local v = self:view(recv, B * N * gk * D * es, { narrow = true, contig = false })
    if c.rope then q, k = rope(self, q, N, D), rope(self, k, N, D) end
    local o = attend(self, q, k, v, { B = B, Tq = N, Tk = N, H = hq, Hkv = gk, D = D, threads = c.threads })
    local os_ = contiguous(self, o)
    local mine, back = B * N * hq * D, B * n * H * D    -- o's elements, y's elements
    local oes = o.es or F
    local send = exchange_begin(self, mine, oes == 2)
    y = result(self, back * oes, 'communication')
    y.es = o.es
    exchange_end(self, send, mine, back)
    local ob = f32_bytes(o)
    self:record(y, { o }, nil, function(sim)
      local stage = not f32_exchange and sim:alloc(ob, 'communication')
      exchange_end(sim, exchange_begin(sim, back), back, mine)
      if stage then sim:unref(stage) end
    end)
    self:unref(os_)
    self:wrapped()
  else
    local es = qkv.es or F
    local q = self:view(qkv, rows * H * D * es, { narrow = true, contig = false })
    local k = self:view(qkv, rows * G * D * es, { narrow = true, contig = false })
    local v = self:view(qkv, rows * G * D * es, { narrow = true, contig = false })
    if c.rope then q, k = rope(self, q, n, D), rope(self, k, n, D) end
    y = attend(self, q, k, v, { B = B, Tq = n, Tk = n, H = H, Hkv = G, D = D, threads = c.threads })
  end
  y = self:view(y)
  local out = linear(self, y, rows, c.dim, c.dim, blk.proj)
  self:leave(outer, out)
  return out
end

local function mlp(self, c, blk, x, rows)
  if c.mlp == 'swiglu' then
    local g = linear(self, x, rows, c.dim, c.hidden, blk.w1)
    local u = linear(self, x, rows, c.dim, c.hidden, blk.w3)
    return linear(self, swiglu(self, g, u), rows, c.hidden, c.dim, blk.w2)
  end
  local h = unary(self, linear(self, x, rows, c.dim, c.hidden, blk.fc))
  return linear(self, h, rows, c.hidden, c.dim, blk.fproj)
end

-- nn.chunked(fn, x, {size = tile, reduce = 'cat' | 'sum'}): the forward runs slice by slice
-- without recording (collecting after each slice that grew > 1 MiB) into one preallocated
-- output; without grad mode (inside a checkpointed block's forward) that is all; with grad mode
-- backward replays one slice at a time (collecting likewise) and the closure keeps x.
local function chunked(self, c, x, fn, reduce)
  local B, n, tile = c.batch, c.n, c.tile
  local slices = {}
  for s0 = 1, n, tile do slices[#slices + 1] = math.min(tile, n - s0 + 1) end
  local function slice(t, len)
    local v = { s = t.s, b = B * len * c.dim * (t.es or F), es = t.es, contig = B == 1 }
    self:ref(t.s); self:hold(t.s); self:wrapped()
    return v
  end
  local recording = self.grad
  self.grad = false
  local res
  for _, len in ipairs(slices) do
    local before = self.cur
    local outer = self:enter()
    local y = fn(slice(x, len), len)
    if reduce == 'sum' then
      res = result(self, F, 'logits')
      self:wrapped()
    elseif not res then
      res = result(self, B * n * c.dim * (y.es or F), 'activations')   -- in y's dtype
      res.es = y.es
      self:wrapped()
    end
    self:leave(outer, res)
    if self.cur - before > MiB then self:collect() end
  end
  self.grad = recording
  if not recording then return res end
  self:ref(x.s)                                 -- the replay closure keeps its argument
  self.pending[#self.pending + 1] = x.s
  local out = { s = res.s, b = res.b, es = res.es, contig = true }
  self:ref(res.s); self:hold(res.s); self:wrapped()
  local function replay(sim, _, gins)
    sim:wrapped()                               -- T.wrap(g_handle)
    for _, len in ipairs(slices) do
      local before = sim.cur
      local outer = sim:enter()
      local xs = slice(x, len)
      local leaf = { s = xs.s, b = xs.b, es = xs.es, rg = gins[1] ~= nil, leaf = true, contig = true }
      if xs.contig then
        sim:ref(xs.s)
      else
        leaf.s = sim:alloc(xs.b, 'backward')
      end
      sim:hold(leaf.s); sim:wrapped()
      sim.grad = true
      local y = fn(leaf, len)
      sim.grad = false
      if reduce == 'cat' then sim:wrapped(); sim:wrapped() end   -- slice(g), :contiguous()
      sim:backward(y)
      if leaf.grad then sim:hold(leaf.grad); sim:wrapped(); sim:wrapped() end  -- xs.grad, the gin view
      sim:leave(outer)
      if sim.cur - before > MiB then sim:collect() end
    end
  end
  self:record(out, { x }, nil, replay)
  return out
end

-- Block:forward_body on x [B, n, C]
local function block_body(self, c, blk, x)
  local outer = self:enter()
  local rows = c.batch * c.n
  local a = self_attention(self, c, blk, norm(self, x, rows, c.norm, blk.norm1))
  local x1 = add(self, x, a)
  local m
  if c.tile and c.tile < c.n then
    m = chunked(self, c, x1, function(t, len) return mlp(self, c, blk, norm(self, t, c.batch * len, c.norm, blk.norm2), c.batch * len) end, 'cat')
  else
    m = mlp(self, c, blk, norm(self, x1, rows, c.norm, blk.norm2), rows)
  end
  local out = add(self, x1, m)
  self:leave(outer, out)
  return out
end

-- nn.checkpoint(fn, x): forward without recording (collect if it grew > 1 MiB), the output a
-- view whose backward replays fn on a detached copy of x and backpropagates through the replay;
-- nn.checkpoint_except_attention (c.keep_attention): the forward's attentions record onto a tape
-- that the replay takes them back from
local function checkpointed(self, c, blk, x)
  local before = self.cur
  local prev = self.grad
  self.grad = false
  local outer = self:enter()
  local tape = c.keep_attention and { items = {}, pos = 0 } or nil
  self.keep_recording = tape
  local y = block_body(self, c, blk, x)
  self.keep_recording = nil
  self:leave(outer, y)
  self.grad = prev
  if self.cur - before > MiB then self:collect() end
  self:ref(x.s) -- the replay closure keeps its argument until the node is freed
  self.pending[#self.pending + 1] = x.s
  local out = { s = y.s, b = y.b, es = y.es, contig = true }
  self:ref(y.s); self:hold(y.s); self:wrapped()
  local function replay(sim, n_, gins)
    local outer2 = sim:enter()
    local pending_before = #sim.pending
    local leaf = { s = x.s, b = x.b, es = x.es, rg = gins[1] ~= nil, leaf = true, contig = true }
    sim:ref(x.s); sim:hold(x.s); sim:wrapped()
    sim.grad = true
    sim.keep_replaying = tape
    local y2 = block_body(sim, c, blk, leaf)
    sim.keep_replaying = nil
    sim.grad = false
    sim:wrapped()                               -- T.wrap(g_handle)
    sim:backward(y2)
    if leaf.grad then sim:hold(leaf.grad); sim:wrapped() end
    sim:leave(outer2)
    -- the previous replay's tiled segments (below) were swept during this one: garbage now
    for _, st in ipairs(sim.swept) do sim:forget(st) end
    sim:collect()                               -- nn.checkpoint collects after each replay
    -- this replay's own tiled segments: their graph is gone, but their closures (and what they
    -- keep) go only at a sweep, at the next segment's creation: in the next replay
    sim.swept = {}
    while #sim.pending > pending_before do sim.swept[#sim.swept + 1] = table.remove(sim.pending) end
  end
  self:record(out, { x }, nil, replay)
  return out
end

-- one training step's forward + loss; returns the loss tensor
-- the parameter entries (tables with .param) inside a module table of build_params
local function params_in(mod, out)
  out = out or {}
  if type(mod) ~= 'table' then return out end
  if mod.param then out[#out + 1] = mod; return out end
  for _, k in ipairs({ 'weight', 'bias' }) do if mod[k] then params_in(mod[k], out) end end
  for k, v in pairs(mod) do
    if k ~= 'weight' and k ~= 'bias' and type(v) == 'table' then params_in(v, out) end
  end
  return out
end

-- dist.grad_sync's mark of a layer's input (nn.on_backward, lua/ulysses/nn/checkpoint.lua): a
-- custom node whose output shares x's storage; its backward accumulates the gradient into a new
-- buffer for x, then hands the layer's grads to the sync: plain, the first one makes its flat
-- buffer; ZeroAdamW stage 2 frees each grad once copied into its own (held from construction)
local function mark(self, c, x, params)
  local v = { s = x.s, b = x.b, es = x.es, contig = x.contig }
  self:ref(x.s)
  self:hold(x.s)
  self:record(v, { x }, nil, function(sim)
    if c.zero then
      if c.zero_stage ~= 1 then
        for _, p in ipairs(params) do if p.grad then sim:unref(p.grad); p.grad = nil end end
      end
    elseif not c.flat then
      c.flat = sim:alloc(c.nparams * F, 'communication')
      sim:wrapped()                               -- T.wrap of the flat buffer
    end
  end)
  self:wrapped()
  return v
end

local function forward_loss(self, c, model)
  local outer = self:enter()
  local B, n, C = c.batch, c.n, c.dim
  local rows = B * n
  local idx = { s = c.ids_s, b = rows * 4, contig = true }
  local h = output(self, rows * C, self.act16, 'activations')   -- bf16 activations start here
  self:record(h, { idx, model.embed })
  self:wrapped()
  if c.model == 'gpt' then
    local pe = self:view(model.pos, n * C * F, { narrow = true })
    h = add(self, h, pe)
  end
  for l = 1, c.layers do
    if c.overlap then h = mark(self, c, h, params_in(model.layers[l])) end
    if c.checkpoint then
      h = checkpointed(self, c, model.layers[l], h)
    else
      h = block_body(self, c, model.layers[l], h)
    end
  end
  if c.overlap then
    local ps = params_in(model.norm)
    if model.output then params_in(model.output, ps) end
    h = mark(self, c, h, ps)
  end
  h = norm(self, h, rows, c.norm, model.norm)
  local head = function(t, r)
    if model.output then return linear(self, t, r, C, c.vocab, model.output, 'logits') end
    local wt = self:view(model.embed, nil, { narrow = true, contig = false })
    return matmul(self, t, r, C, c.vocab, wt, 'logits')
  end
  local loss
  if c.tile and c.tile < n then
    local sum = chunked(self, c, h, function(t, len) return cross_entropy(self, head(t, B * len), B * len) end, 'sum')
    self:scratch(rows * 8, 'inputs')          -- count_valid: targets as i64
    if c.distributed then self:scratch(64, 'inputs') end
    loss = scalar_mul(self, sum)
  else
    local logits = head(h, rows)
    if c.distributed then
      self:scratch(rows * 8, 'inputs')
      self:scratch(64, 'inputs')
      loss = scalar_mul(self, cross_entropy(self, logits, rows))
    else
      loss = cross_entropy(self, logits, rows)
    end
  end
  self:leave(outer, loss)
  return loss
end

---------------------------------------------------------------- configs
local function presets_of(model)
  local ok, mod = pcall(require, model == 'gpt' and 'models.gpt' or 'models.llama')
  if not ok then error('plan: cannot load the model presets (' .. tostring(mod) .. '); run from the repository root', 3) end
  return mod
end

-- a setting that must be a or b (the error points at the caller of estimate / config)
local function one_of(name, value, a, b)
  if value ~= a and value ~= b then
    error(("plan: %s must be '%s' or '%s', got %s"):format(name, a, b, tostring(value)), 4)
  end
end

-- the planner's config: model defaults + preset + overrides, plus the derived sizes
function M.config(cfg)
  cfg = cfg or {}
  local model = cfg.model or 'llama'
  one_of('model', model, 'llama', 'gpt')
  local mod = presets_of(model)
  local preset = mod.presets[cfg.preset or 'small']
  if not preset then error('plan: unknown ' .. model .. " preset '" .. tostring(cfg.preset) .. "'", 3) end
  local c = {}
  for k, v in pairs(mod.defaults) do c[k] = v end
  for k, v in pairs(preset) do c[k] = v end
  for k, v in pairs(cfg) do c[k] = v end
  c.model = model
  c.preset = cfg.preset or 'small'
  c.kv_heads = c.kv_heads or c.heads
  if c.dim % c.heads ~= 0 then error(('plan: dim %d is not divisible by heads %d'):format(c.dim, c.heads), 3) end
  if c.heads % c.kv_heads ~= 0 then
    error(('plan: heads %d is not a multiple of kv_heads %d'):format(c.heads, c.kv_heads), 3)
  end
  c.seq_total = cfg.seq or cfg.n or preset.seq
  c.seq = math.max(c.seq_total, model == 'gpt' and (cfg.context or c.seq_total) or c.seq_total)
  c.batch = cfg.batch or 1
  c.sp = cfg.sp or 1
  c.world = cfg.world or c.sp * (cfg.dp or 1)   -- ranks in all (data parallel x sequence parallel)
  c.distributed = c.world > 1
  c.zero = cfg.zero == true or cfg.zero == 1   -- dist.ZeroAdamW over the world (at 1 rank: the whole state)
  c.zero_stage = cfg.zero_stage or 2
  -- the gradient reduction overlapped with backward (train.lua's --overlap 1: dist.grad_sync, or
  -- ZeroAdamW's opt:grad_sync()): the models mark each layer's input
  c.overlap = cfg.overlap == true or cfg.overlap == 1
  c.attention = cfg.attention or 'flash'
  one_of('attention', c.attention, 'reference', 'flash')
  c.keep_attention = cfg.checkpoint == 'except_attention' or cfg.checkpoint == 2
  c.checkpoint = cfg.checkpoint == true or cfg.checkpoint == 1 or c.keep_attention
  c.tile = cfg.tile and cfg.tile > 0 and cfg.tile or nil
  c.threads = cfg.threads or tonumber(os.getenv('OMP_NUM_THREADS') or '') or 2
  -- the device the step runs on, the kernels behind it (the simulation runs the CPU's), its
  -- memory and the matmul precision
  c.device = cfg.device or 'cpu'
  one_of('device', c.device, 'cpu', 'cuda')
  c.kernels = cfg.kernels or c.device
  one_of('kernels', c.kernels, 'cpu', 'cuda')
  c.device_memory = cfg.device_memory or M.H200_MEMORY
  c.precision = cfg.precision or 'f32'
  one_of('precision', c.precision, 'f32', 'bf16')
  if c.precision == 'bf16' and c.kernels ~= 'cuda' then   -- the CPU's rounded operand copies are not replayed
    error('plan: bf16 matmuls only with the CUDA kernels (--device cuda); on the CPU plan in f32', 3)
  end
  c.activations = cfg.activations or 'f32'   -- uly.activation_dtype, train.lua --activations
  one_of('activations', c.activations, 'f32', 'bf16')
  if c.activations == 'bf16' and c.attention == 'reference' then   -- its f32 copies and casts are not replayed
    error("plan: bf16 activations only with --attention flash (the reference kernel's casts are not replayed)", 3)
  end
  if model == 'llama' then
    c.kv_heads = cfg.kv_heads or preset.kv_heads or c.heads
    c.hidden = cfg.hidden or preset.hidden or mod.hidden_for(c.dim)
    c.norm, c.mlp, c.rope, c.bias = 'rmsnorm', 'swiglu', true, false
  else
    c.kv_heads = c.heads
    c.hidden = cfg.hidden or 4 * c.dim
    c.norm, c.mlp, c.rope, c.tied = 'layernorm', 'gelu', false, true
    c.bias = c.bias ~= false
  end
  c.head_dim = c.dim / c.heads
  -- this rank (rank 0: the first N % P ranks hold one token more, the first H % P one head more)
  local P, N, H, G = c.sp, c.seq_total, c.heads, c.kv_heads
  c.n = math.ceil(N / P)
  local function heads_of(r)
    local base, extra = math.floor(H / P), H % P
    local hq = base + (r < extra and 1 or 0)
    local h0 = r * base + math.min(r, extra)
    if hq == 0 then return 0, 0 end
    local group = H / G
    return hq, math.floor((h0 + hq - 1) / group) - math.floor(h0 / group) + 1
  end
  c.hq, c.gk = heads_of(0)
  c.stage_width = 0
  for r = 0, P - 1 do
    local hq, gk = heads_of(r)
    c.stage_width = c.stage_width + hq + 2 * gk
  end
  return c
end

local function count_params(c)
  local C, V, L, F_ = c.dim, c.vocab, c.layers, c.hidden
  local D = c.head_dim
  local b = c.bias and 1 or 0
  local nb = c.norm == 'layernorm' and 2 or 1
  local per = nb * 2 * C + C * (c.heads + 2 * c.kv_heads) * D + b * (c.heads + 2 * c.kv_heads) * D + C * C + b * C
  if c.mlp == 'swiglu' then per = per + 3 * C * F_ + b * (2 * F_ + C) else per = per + 2 * C * F_ + b * (F_ + C) end
  return V * C + (c.model == 'gpt' and c.seq * C or 0) + L * per + nb * C + (c.tied and 0 or V * C)
end
M.count_params = count_params

-- dist.ZeroAdamW's flat layout (lua/ulysses/zero.lua): buckets of a multiple of G elements, the
-- last padded to a multiple of G; returns the padded total and one rank's share, in elements
function M.zero_layout(n, G, bucket_bytes)
  local E = math.max(G, math.floor((bucket_bytes or 64 * MiB) / 4 / G) * G)
  local padded, owned = 0, 0
  while padded < n do
    local size = math.min(E, math.ceil((n - padded) / G) * G)
    padded, owned = padded + size, owned + size / G
  end
  return padded, owned
end

---------------------------------------------------------------- the estimate
-- estimate(cfg) replays model construction, the optimizer's state and cfg.steps (default 2)
-- training steps as train.lua runs them (zero_grad, loss, backward, all-reduce of the grads
-- under P > 1, AdamW). cfg.gc_next: the collector threshold when the step starts (then the
-- model and optimizer are taken as built, and one step is replayed by default).
function M.estimate(cfg)
  local c = M.config(cfg)
  local sim = new_sim(c, cfg.gc_next)
  local frame = sim:enter()
  local model = build_params(sim, c)
  local nparams = count_params(c)
  c.nparams, c.flat = nparams, nil
  local opt = {}
  if c.zero then
    -- ZeroAdamW: the parameters become views of one flat buffer (the separate ones freed), a flat
    -- gradient buffer and this rank's shard of it, and exp_avg / exp_avg_sq for the shard only
    local padded, owned = M.zero_layout(nparams, c.world)
    local pflat = sim:alloc(padded * F, 'parameters')
    sim:wrapped()
    for _, p in ipairs(model.params) do sim:unref(p.s); sim:ref(pflat); p.s = pflat end
    opt[1] = sim:alloc(padded * F, 'communication'); sim:wrapped()
    for k, cat in ipairs({ 'communication', 'optimizer', 'optimizer' }) do
      opt[k + 1] = sim:alloc(owned * F, cat)
      sim:wrapped()
    end
  else
    for _, p in ipairs(model.params) do
      for _ = 1, 2 do
        opt[#opt + 1] = sim:alloc(p.b, 'optimizer')
        sim:wrapped()
      end
    end
  end
  if cfg.gc_next then sim.gc_next = cfg.gc_next end
  sim.peak, sim.at_peak = 0, {}
  sim:mark_peak()
  for step = 1, cfg.steps or (cfg.gc_next and 1 or 2) do
    for _, p in ipairs(model.params) do
      if p.grad then sim:unref(p.grad); p.grad = nil end
    end
    sim.phase = 'forward'
    local outer = sim:enter()
    c.ids_s = sim:alloc(c.batch * c.n * 4, 'inputs')
    sim:hold(c.ids_s); sim:wrapped()
    local tgt = sim:alloc(c.batch * c.n * 4, 'inputs')
    sim:hold(tgt); sim:wrapped()
    local loss = forward_loss(sim, c, model)
    sim.phase = 'backward'
    sim:backward(loss)
    sim:leave(outer)
    for _, s in ipairs(sim.pending) do sim:unref(s) end -- the replay closures, dropped at the next sweep
    for _, s in ipairs(sim.swept) do sim:unref(s) end
    sim.pending, sim.swept = {}, {}
    sim.phase = 'optimizer'
    if c.zero and c.zero_stage ~= 1 then   -- ZeroAdamW stage 2 frees each grad once copied into its buffer
      for _, p in ipairs(model.params) do
        if p.grad then sim:unref(p.grad); p.grad = nil end
      end
    end
    if c.distributed and not c.zero then   -- dist.all_reduce_grads: its flat buffer, a grad for every parameter
      if not c.flat then c.flat = sim:alloc(nparams * F, 'communication') end
      for _, p in ipairs(model.params) do if not p.grad then p.grad = sim:alloc(p.b, 'gradients') end end
    end
  end
  local parts = {}
  for _, k in ipairs(M.PARTS) do parts[k] = sim.at_peak[k] or 0 end
  local untracked = sim.untracked + (sim.rope_table or 0)
  return { total = sim.peak, parts = parts, untracked = untracked, with_untracked = sim.peak + untracked,
           phase = sim.peak_phase, params = nparams, config = c }
end

-- the longest N (a multiple of cfg.step, default 1024) whose estimate (allocator peak plus the
-- kernels' untracked scratch) fits budget_bytes; 0 when even one step does not
function M.longest(cfg, budget)
  local step = cfg.step or 1024
  local function fits(N)
    local c = {}
    for k, v in pairs(cfg) do c[k] = v end
    c.seq = N
    return M.estimate(c).with_untracked <= budget
  end
  if not fits(step) then return 0 end
  local lo, hi = 1, 2
  while fits(hi * step) do
    lo, hi = hi, hi * 2
    if hi * step > 2 ^ 40 then break end
  end
  while hi - lo > 1 do
    local mid = math.floor((lo + hi) / 2)
    if fits(mid * step) then lo = mid else hi = mid end
  end
  local c = {}
  for k, v in pairs(cfg) do c[k] = v end
  c.seq = lo * step
  return lo * step, M.estimate(c)
end

---------------------------------------------------------------- command line
local function parse_bytes(s)
  local num, unit = tostring(s):match('^([%d%.]+)%s*(%a*)$')
  if not num then error('plan: cannot read the size ' .. tostring(s) .. ' (e.g. 20GiB, 512MiB)', 0) end
  local mult = ({ [''] = 1, b = 1, kib = 2 ^ 10, kb = 1e3, mib = MiB, mb = 1e6, gib = GiB, gb = 1e9, tib = 2 ^ 40,
                  k = 2 ^ 10, m = MiB, g = GiB })[unit:lower()]
  if not mult then error('plan: unknown size unit ' .. unit, 0) end
  return tonumber(num) * mult
end
M.parse_bytes = parse_bytes

local function fmt(b)
  if b >= GiB then return string.format('%.2f GiB', b / GiB) end
  if b >= MiB then return string.format('%.1f MiB', b / MiB) end
  return string.format('%.1f KiB', b / 1024)
end
M.format_bytes = fmt

function M.report(est)
  local c = est.config
  local lines = {}
  local function add(...) lines[#lines + 1] = string.format(...) end
  add('%s %s: dim %d, layers %d, heads %d/%d, hidden %d, vocab %d, %d parameters', c.model, c.preset, c.dim,
      c.layers, c.heads, c.kv_heads, c.hidden, c.vocab, est.params)
  add('N = %d, P = %d (%d tokens on this rank), batch %d, attention %s%s, checkpoint %s, tile %s', c.seq_total, c.sp,
      c.n, c.batch, c.attention, c.window and (' window ' .. c.window) or '', c.keep_attention and 'except attention' or c.checkpoint and 'on' or 'off',
      c.tile and tostring(c.tile) or 'off')
  if c.distributed or c.zero then
    add('%d ranks (data parallel %d x sequence parallel %d)%s', c.world, c.world / c.sp, c.sp,
        c.zero and (', AdamW state sharded over all of them (ZeRO stage %d, dist.ZeroAdamW)'):format(c.zero_stage) or '')
  end
  if c.device == 'cuda' then
    add('device cuda (%s kernels, %s GiB), matmul precision %s', c.kernels, string.format('%.1f', c.device_memory / GiB),
        c.precision)
  end
  if c.activations == 'bf16' then add('activations bf16 (computed in f32; weights, gradients and optimizer state f32)') end
  add('peak per rank (in the %s), by part:', est.phase)
  for _, k in ipairs(M.PARTS) do
    add('  %-14s %12s   %s', k, fmt(est.parts[k]), M.PART_HELP[k])
  end
  add('  %-14s %12s   (the allocator high-water mark, uly.memory().peak)', 'total', fmt(est.total))
  add('  %-14s %12s   %s', 'untracked', fmt(est.untracked), c.kernels == 'cuda'
      and "the CUDA kernels' largest stream-ordered temporaries (bf16 operand copies, score chunks)"
      or "kernel memory malloc'ed outside the allocator (reference attention dS, RoPE's cos/sin table)")
  add('  %-14s %12s', 'total + untracked', fmt(est.with_untracked))
  return table.concat(lines, '\n')
end

-- the usage: this file's header comment down to the Lua API
local function usage()
  local here = debug.getinfo(1, 'S').source:match('^@(.*)$')
  for line in io.lines(here) do
    if not line:match('^%-%-') or line:match('local plan = require') then break end
    print((line:gsub('^%-%- ?', '')))
  end
end

local function main(args)
  local cfg, budget = {}, nil
  local i = 1
  -- numbers: the least value each may take (tile and window 0 = off)
  local numeric = { seq = 1, sp = 1, dp = 1, batch = 1, tile = 0, window = 0, dim = 1, layers = 1, heads = 1,
                    kv_heads = 1, hidden = 1, vocab = 1, threads = 1, step = 1 }
  local flags = { checkpoint = true, zero = true, overlap = true }
  while i <= #args do
    if args[i] == '--help' or args[i] == '-h' then usage() return end
    local key = args[i]:match('^%-%-(.+)$')
    if not key then error('plan: unexpected argument ' .. args[i] .. ' (tools/plan.lua --help lists the options)', 0) end
    local v = args[i + 1]
    if v == nil then error('plan: --' .. key .. ' needs a value', 0) end
    if key == 'budget' then budget = parse_bytes(v)
    elseif key == 'checkpoint' and (v == '2' or v == 'except_attention') then cfg.checkpoint = 'except_attention'
    elseif flags[key] then
      if v ~= '0' and v ~= '1' and v ~= 'true' and v ~= 'false' then
        local choices = key == 'checkpoint' and "0, 1 or 2 (2: 'except_attention')" or '0 or 1'
        error(string.format("plan: --%s must be %s, got '%s'", key, choices, v), 0)
      end
      cfg[key] = v == '1' or v == 'true'
    elseif key == 'model' or key == 'preset' or key == 'attention' or key == 'device' or key == 'kernels'
      or key == 'precision' or key == 'activations' then cfg[key] = v
    elseif key == 'gpu-memory' then cfg.device_memory = parse_bytes(v)
    elseif numeric[key] then
      local n = tonumber(v)
      if not n or n ~= math.floor(n) or n < numeric[key] then
        error(string.format("plan: --%s must be an integer >= %d, got '%s'", key, numeric[key], v), 0)
      end
      cfg[key] = n
    else error('plan: unknown option --' .. key .. ' (tools/plan.lua --help lists the options)', 0) end
    i = i + 2
  end
  local est = M.estimate(cfg)
  print(M.report(est))
  if est.config.distributed and cfg.overlap == nil then
    print("(gradients reduced after backward: add --overlap 1 for train.lua's default, reduced as backward goes)")
  end
  if budget then
    local N, est = M.longest(cfg, budget)
    print(string.format('longest N fitting %s per rank (multiples of %d): %d%s', fmt(budget), cfg.step or 1024, N,
                        est and string.format(' (estimate %s + untracked %s)', fmt(est.total), fmt(est.untracked)) or ''))
  end
end

if ... ~= 'tools.plan' then
  local dir = (arg and arg[0] or ''):match('^(.*)tools/[^/]*$') or './'
  package.path = dir .. 'lua/?.lua;' .. dir .. 'lua/?/init.lua;' .. dir .. '?.lua;' .. package.path
  local ok, err = pcall(main, arg or {})
  if not ok then
    io.stderr:write((tostring(err):gsub('^[^%s:]+%.lua:%d+: ', '')), '\n')
    os.exit(1)
  end
end

return M
