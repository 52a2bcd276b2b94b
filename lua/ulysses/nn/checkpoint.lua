-- lua/ulysses/nn/checkpoint.lua — autograd nodes whose backward is Lua: activation
-- checkpointing, tiled computation (nn.chunked) and backward hooks (nn.on_backward).
-- nn.checkpoint(fn, x, ...) runs fn
-- without recording its graph (its activations are freed at once) and returns a tensor whose
-- backward replays fn on the saved inputs with the random generator rewound to where the forward
-- found it (so dropout draws the same masks), then backpropagates through the replay. Memory per
-- checkpointed segment: its inputs and output instead of every intermediate.
-- nn.checkpoint_except_attention(fn, x, ...) is the same but keeps each flash attention's output
-- and log-sum-exp (lua/ulysses/attention_keep.lua), so the replay runs everything except
-- attention's forward again: on long sequences attention is most of a block's time, and keeping
-- its output costs one more tensor of the input's size per segment.
--
-- What a replay reads must be what the forward read: the tensor arguments (nn.chunked: x and the
-- `with` tensors) have their versions recorded, and a backward after one of them was written in
-- place is an error, as for any op's saved tensor. Not caught: tensors reached otherwise (the
-- parameters inside fn, tensors in table arguments) written in place before backward, e.g. an
-- optimizer step between forward and backward: the replay then uses their new values.
-- When no tensor argument requires grad, the segment is still recorded (its output requires
-- grad), so that the parameters used inside fn receive their gradients.
--
-- The backward hook is a C callback into Lua (core/custom.c), so the C call that starts a
-- backward must not come from JIT-compiled code: Tensor:backward is kept interpreted.
return function(nn, U)
  -- Interpreted, never compiled: this function and every function inside it (jit.off's second
  -- argument). The segments' explicit collections must find the segment's temporaries dead, and a
  -- compiled trace through these wrappers, which inlines the segment's function, can keep them
  -- reachable from its stack slots: the million-token DNA step then peaked at 7.66 GiB where the
  -- planner (which replays the collections) says 5.91; 262,144 tokens 1.8 GiB against 1.49, and
  -- 1.49 with these interpreted. They run once per segment, around much work in C.
  jit.off(true, true)
  local ffi = require 'ffi'
  local attention_keep = require 'ulysses.attention_keep'

  -- id -> replay closure, until the C node is freed; the ids handed out; the C callback. One set
  -- per process, not per load of this module: the C side's queue of freed ids is process-wide, so
  -- a second load with ids of its own (busted loads the package afresh for every spec file; a
  -- REPL user may reload it) would drop the first load's replays when its nodes are freed
  local registry = debug.getregistry()
  local shared = registry['ulysses.custom_ops'] or { pending = {}, next_id = 0 }
  registry['ulysses.custom_ops'] = shared
  local pending = shared.pending
  local released = ffi.new('int64_t[64]')
  -- bytes held by tensors, host and device together: segments run on either
  local held = require('ulysses.tensor').held_bytes

  local function sweep(C)
    while true do
      local n = C.uly_custom_released(released, 64)
      for i = 0, n - 1 do pending[tonumber(released[i])] = nil end
      if n < 64 then break end
    end
  end

  -- after the tensor wrapper's own collections, let go of the replays of graphs freed meanwhile
  -- (they hold the segment's inputs and, through fn, the model)
  require('ulysses.tensor').after_collect = function() sweep(U().C) end

  local function get_callback(C)   -- created on first use (one per process)
    if shared.callback then return shared.callback end
    shared.callback = ffi.cast('uly_custom_backward', function(id, g, gin)
      local replay = pending[tonumber(id)]
      if not replay then return C.uly_fail('checkpoint: nothing recorded for this segment (freed?)') end
      local ok, err = pcall(replay, g, gin)
      if ok then return 0 end
      return C.uly_fail(tostring(err))
    end)
    return shared.callback
  end

  -- the storage versions of a list of tensors, and the check that they are unchanged
  local function versions(list)
    local v = {}
    for k, t in ipairs(list) do v[k] = t:version() end
    return v
  end
  local function check_versions(name, list, labels, recorded)
    for k, t in ipairs(list) do
      local now = t:version()
      if now ~= recorded[k] then
        error(string.format('%s: %s %s was modified in place after the forward used it (version %d, expected %d); '
                            .. 'the replay in backward would read the new values: clone it before writing into it',
                            name, labels[k], t:describe(), now, recorded[k]), 0)
      end
    end
  end

  -- the C node for a segment: its tensor inputs, or, when none requires grad, one throwaway leaf
  -- that does (the parameters inside still need the replay); returns the output and whether the
  -- inputs were replaced (their grad_inputs then are not theirs)
  local function record(uly, C, T, inputs, y, id)
    local any = false
    for _, t in ipairs(inputs) do any = any or t.requires_grad end
    if not any then inputs = { uly.zeros(1, { device = y:device(), requires_grad = true }) } end
    local hs = ffi.new('uly_tensor *[?]', math.max(#inputs, 1))
    for k, t in ipairs(inputs) do hs[k - 1] = t._h end
    return T.wrap(C.uly_custom_op(#inputs, hs, y._h, get_callback(C), id)), not any
  end

  -- checkpoint(name, keep, fn, ...): nn.checkpoint, or with keep nn.checkpoint_except_attention.
  -- The segment's forward records onto its own tape (keep) or none, and goes on taking from the
  -- tape being replayed, if any (a segment nested in a replayed one); its replay takes from its
  -- tape and records onto none.
  local function checkpoint(name, keep, fn, ...)
    local uly = U()
    local C, T = uly.C, require 'ulysses.tensor'
    local args = { n = select('#', ...), ... }
    if not uly.is_grad_enabled() then return fn(...) end
    local tensors, where, labels = {}, {}, {}
    for i = 1, args.n do
      if uly.is_tensor(args[i]) then
        tensors[#tensors + 1] = args[i]
        where[#tensors], labels[#tensors] = i, 'argument ' .. i
      end
    end
    if #tensors > 4 then error(name .. ': at most 4 tensor arguments, got ' .. #tensors, 3) end
    local recorded = versions(tensors)
    local rng = uly.rng_state()
    local before = held()
    local tape = keep and attention_keep.new_tape() or nil
    local y = attention_keep.with(tape, attention_keep.replaying, uly.no_grad, fn, ...)
    -- the segment's temporaries are garbage now: free them before the next segment runs, or the
    -- peak would not go down (LuaJIT's collector does not see their C memory)
    if held() - before > 2 ^ 20 then collectgarbage() end
    if not uly.is_tensor(y) then error(name .. ': the function must return one tensor', 3) end
    sweep(C)
    shared.next_id = shared.next_id + 1
    local id = shared.next_id
    local anchored -- no input takes a gradient: gin[0] is the throwaway leaf's
    pending[id] = function(g_handle, gin)
      check_versions(name, tensors, labels, recorded)
      -- replay with the forward's random numbers, from detached copies of the inputs
      local now = uly.rng_state()
      uly.set_rng_state(rng)
      local replay_args = { n = args.n }
      local leaves = {}
      for i = 1, args.n do replay_args[i] = args[i] end
      for k, t in ipairs(tensors) do
        if not anchored and gin[k - 1] ~= nil then
          leaves[k] = t:detach():requires_grad_(true)
          replay_args[where[k]] = leaves[k]
        else
          replay_args[where[k]] = t:detach()
        end
      end
      local ok, out = pcall(attention_keep.with, nil, tape, uly.enable_grad, fn,
                            unpack(replay_args, 1, replay_args.n))
      if tape then tape.items = {} end   -- what the replay did not take back (it diverged)
      uly.set_rng_state(now)
      if not ok then error(out, 0) end
      C.uly_tensor_retain(g_handle)
      local g = T.wrap(g_handle)
      if out.requires_grad then out:backward(g) end   -- else fn used nothing that takes a gradient
      out = nil
      for k, leaf in pairs(leaves) do
        local gk = leaf.grad
        if gk then T.check(C.uly_tensor_accumulate_(gin[k - 1], gk._h)) end
      end
      leaves, replay_args = nil, nil
      collectgarbage()   -- the replayed segment's activations and gradients, before the next one
    end
    local out
    out, anchored = record(uly, C, T, tensors, y, id)
    return out
  end

  -- nn.checkpoint(fn, x1, ..., xn): y = fn(x1, ..., xn) (one tensor), recomputed in backward.
  -- Inputs that are tensors take gradients (at most 4); other arguments are passed through.
  -- Parameters used inside fn receive their gradients from the replay, also when no input
  -- requires grad (raw data); the tensor arguments must not be written in place before backward.
  function nn.checkpoint(fn, ...) return checkpoint('nn.checkpoint', false, fn, ...) end

  -- nn.checkpoint_except_attention(fn, x1, ..., xn): the same, but the flash attentions inside fn
  -- keep their outputs for the replay, which therefore does not run their forward again
  function nn.checkpoint_except_attention(fn, ...)
    return checkpoint('nn.checkpoint_except_attention', true, fn, ...)
  end

  -- nn.chunked(fn, x, {dim = 2, size = 1024, with = {t1, ...}, reduce = 'cat' | 'sum'}):
  -- fn applied to slices of x along dim (and the same slices of the `with` tensors, e.g. the
  -- targets), one slice at a time, never recording more than one slice's graph: 'cat' joins the
  -- slices' outputs along dim (a tiled MLP: the 4C-wide hidden activations of only one slice
  -- exist at once), 'sum' adds the slices' (scalar) outputs (a tiled loss: one slice's logits at
  -- once). Backward replays each slice (random generator rewound per slice) and backpropagates
  -- the matching slice of the incoming gradient. Same values and gradients as fn(x, ...) when fn
  -- works row by row along dim.
  function nn.chunked(fn, x, opts)
    local uly = U()
    local C, T = uly.C, require 'ulysses.tensor'
    opts = opts or {}
    local dim, size, with = opts.dim or 2, opts.size or 1024, opts.with or {}
    local reduce = opts.reduce or 'cat'
    if reduce ~= 'cat' and reduce ~= 'sum' then error("nn.chunked: reduce must be 'cat' or 'sum'", 2) end
    if type(size) ~= 'number' or size < 1 then error('nn.chunked: size must be a positive number of rows', 2) end
    local n = x:size(dim)
    local starts = {}
    for s0 = 1, n, size do starts[#starts + 1] = s0 end
    local function slice(t, s0) return t:narrow(dim, s0, math.min(size, n - s0 + 1)) end
    local function call(xs, s0, ...)
      local args = {}
      for k, w in ipairs(with) do args[k] = slice(w, s0) end
      return fn(xs, unpack(args))
    end
    if #starts <= 1 then return call(x, 1) end
    local recording = uly.is_grad_enabled()
    local read, labels = { x }, { 'x' }
    for k, w in ipairs(with) do read[k + 1], labels[k + 1] = w, 'with[' .. k .. ']' end
    local recorded = versions(read)
    -- forward, one slice at a time, without recording, into one preallocated output
    local rngs, out, total = {}, nil, nil
    uly.no_grad(function()
      for i, s0 in ipairs(starts) do
        rngs[i] = uly.rng_state()
        local before = held()
        local y = call(slice(x, s0), s0)
        if reduce == 'sum' then total = total and (total + y) or y:clone()
        else
          if not out then
            local shape = y:shape()
            shape[dim] = n
            out = uly.empty(shape, { device = y:device(), dtype = y:dtype() })
          end
          slice(out, s0):copy_(y)
        end
        y = nil
        if held() - before > 2 ^ 20 then collectgarbage() end
      end
    end)
    local result = reduce == 'sum' and total or out
    if not recording then return result end
    sweep(C)
    shared.next_id = shared.next_id + 1
    local id = shared.next_id
    local anchored -- x takes no gradient: gin[0] is the throwaway leaf's
    pending[id] = function(g_handle, gin)
      check_versions('nn.chunked', read, labels, recorded)
      local gx = (not anchored and gin[0] ~= nil) and gin[0] or nil   -- x's gradient buffer
      C.uly_tensor_retain(g_handle)
      local g = T.wrap(g_handle)
      local now = uly.rng_state()
      local ok, err = pcall(function()
        for i, s0 in ipairs(starts) do
          local before = held()
          uly.set_rng_state(rngs[i])
          local xs = slice(x, s0):detach()
          if gx ~= nil then xs = xs:contiguous():requires_grad_(true) end
          local y = uly.enable_grad(call, xs, s0)
          if y.requires_grad then y:backward(reduce == 'sum' and g or slice(g, s0):contiguous()) end
          if gx ~= nil and xs.grad then
            local h = C.uly_tensor_narrow(gx, dim - 1, s0 - 1, math.min(size, n - s0 + 1))
            local view = T.wrap(h)
            T.check(C.uly_tensor_accumulate_(view._h, xs.grad._h))
          end
          y, xs = nil, nil
          if held() - before > 2 ^ 20 then collectgarbage() end   -- this slice's graph
        end
      end)
      uly.set_rng_state(now)
      if not ok then error(err, 0) end
    end
    local y
    y, anchored = record(uly, C, T, { x }, result, id)
    return y
  end

  -- nn.on_backward(x, fn) -> x (a view) for the forward; in backward the gradient passes through
  -- unchanged and then fn() runs. Everything computed from x has finished its backward by then,
  -- so the gradients of parameters used only after x are final (dist.grad_sync's signal to start
  -- reducing a layer's gradients while backward goes on to the layers before it).
  function nn.on_backward(x, fn)
    local uly = U()
    local C, T = uly.C, require 'ulysses.tensor'
    if not uly.is_grad_enabled() or not x.requires_grad then return x end
    sweep(C)
    shared.next_id = shared.next_id + 1
    local id = shared.next_id
    pending[id] = function(g_handle, gin)
      if gin[0] ~= nil then T.check(C.uly_tensor_accumulate_(gin[0], g_handle)) end
      fn()
    end
    local hs = ffi.new('uly_tensor *[1]', x._h)
    return T.wrap(C.uly_custom_op(1, hs, x:detach()._h, get_callback(C), id))
  end

  -- number of segments whose replay is still held (for leak checks)
  function nn.checkpoint_pending()
    sweep(U().C)
    local n = 0
    for _ in pairs(pending) do n = n + 1 end
    return n
  end
end
