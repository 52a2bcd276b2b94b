-- spec/helpers.lua — shared spec tools: the replayable random seed, float64 references,
-- tolerant comparisons and the finite-difference gradient check every op's spec uses.
local uly = require 'ulysses'
local ffi = require 'ffi'

local M = {}

-- One seed per run: ULY_SEED=<n> replays a run; printed once so a failure can be replayed.
-- scripts/test.sh picks and prints one seed for the whole run; a spec file run on its own
-- prints the seed it chose.
local seed = tonumber(os.getenv('ULY_SEED') or '')
if not seed then
  seed = os.time() % 100000
  io.write(string.format('[spec seed %d: rerun with ULY_SEED=%d]\n', seed, seed))
end
M.seed = seed

-- reseed the library and Lua's own generator (call in before_each / at the top of a test)
function M.reseed(offset)
  uly.manual_seed(seed + (offset or 0))
  math.randomseed(seed + (offset or 0))
end

-- flat float64 copy of a tensor's values (row-major) and its element count
function M.values(t)
  local n = t:numel()
  local buf = ffi.new('double[?]', math.max(n, 1))
  assert(uly.C.uly_tensor_copy_to(t._h, buf, 4, n) == 0)
  return buf, n
end

-- max |a - b| / (atol + rtol |b|) over all elements must be <= 1; a, b tensors or flat arrays
function M.assert_close(actual, expected, rtol, atol, what)
  rtol, atol = rtol or 1e-5, atol or 1e-6
  local a, na = M.values(actual)
  local b, nb
  if uly.is_tensor(expected) then b, nb = M.values(expected)
  else b, nb = expected, #expected
    local arr = ffi.new('double[?]', math.max(nb, 1))
    for i = 1, nb do arr[i - 1] = expected[i] end
    b = arr
  end
  assert(na == nb, string.format('%s: %d elements vs %d expected', what or 'values', na, nb))
  for i = 0, na - 1 do
    local x, y = a[i], b[i]
    local ok = (x == y) or (x ~= x and y ~= y) or math.abs(x - y) <= atol + rtol * math.abs(y)
    if not ok then
      error(string.format('%s: element %d is %.9g, expected %.9g (rtol %g, atol %g)', what or 'values', i + 1, x,
                          y, rtol, atol), 2)
    end
  end
end

-- max |a - b| <= tol * (the largest |b|): agreement to a precision relative to the tensor's
-- scale (bf16 products against f32 ones, sums in another order), where elementwise rtol would
-- trip on values that cancel to near 0
function M.assert_within(actual, expected, tol, what)
  local a, n = M.values(actual)
  local b, nb = M.values(expected)
  assert(n == nb, string.format('%s: %d elements vs %d expected', what or 'values', n, nb))
  local scale, worst = 0, 0
  for i = 0, n - 1 do
    scale = math.max(scale, math.abs(b[i]))
    worst = math.max(worst, math.abs(a[i] - b[i]))
  end
  if not (worst <= tol * math.max(scale, 1e-30)) then
    error(string.format('%s: off by %.3g, more than %g of the largest value %.3g', what or 'values', worst, tol,
                        scale), 2)
  end
end

-- sum(y * w) in float64 for fixed weights w (a flat double array)
local function project(y, w)
  local v, n = M.values(y)
  local s = 0
  for i = 0, n - 1 do s = s + v[i] * w[i] end
  return s
end

--[[ Finite-difference gradient check.
  fn(inputs...) -> tensor; inputs: list of tensors (those with requires_grad are checked).
  Checks d/dx of L = sum(fn(x) * w) (w random, fixed) against autograd, by central differences
  in every coordinate for small inputs and along random directions for large ones.
  opts: eps (1e-2), rtol (2e-2), atol (2e-3), directions (6), max_coords (64) ]]
function M.gradcheck(fn, inputs, opts)
  opts = opts or {}
  local eps, rtol, atol = opts.eps or 1e-2, opts.rtol or 2e-2, opts.atol or 2e-3
  local y = fn(unpack(inputs))
  local n = y:numel()
  local w = ffi.new('double[?]', math.max(n, 1))
  for i = 0, n - 1 do w[i] = math.random() * 2 - 1 end
  local wt = uly.empty(y:shape())
  assert(uly.C.uly_tensor_copy_from(wt._h, w, 4, n) == 0)
  for _, x in ipairs(inputs) do if x.requires_grad then x:zero_grad() end end
  local L = (y * wt):sum()
  L:backward()
  for k, x in ipairs(inputs) do
    if x.requires_grad then
      local g = x.grad
      assert(g, string.format('input %d: no gradient was computed', k))
      local gv = M.values(g)
      local xn = x:numel()
      local base = M.values(x:detach():contiguous())
      -- perturb a detached copy through its data pointer, evaluating fn without grad
      local xd = x:detach():clone()
      local p = xd:data()
      local args = {}
      for j, other in ipairs(inputs) do args[j] = (j == k) and xd or other:detach() end
      local function L_at() return uly.no_grad(function() return project(fn(unpack(args)), w) end) end
      local function check_dir(dir, label)
        for i = 0, xn - 1 do p[i] = base[i] + eps * dir[i] end
        local lp = L_at()
        for i = 0, xn - 1 do p[i] = base[i] - eps * dir[i] end
        local lm = L_at()
        for i = 0, xn - 1 do p[i] = base[i] end
        local num = (lp - lm) / (2 * eps)
        local ana = 0
        for i = 0, xn - 1 do ana = ana + gv[i] * dir[i] end
        if math.abs(num - ana) > atol + rtol * math.max(math.abs(num), math.abs(ana)) then
          error(string.format('gradcheck: input %d %s: autograd gives %.7g, finite differences %.7g (seed %d)', k,
                              label, ana, num, M.seed), 3)
        end
      end
      local dir = ffi.new('double[?]', math.max(xn, 1))
      if xn <= (opts.max_coords or 64) then
        for c = 0, xn - 1 do
          for i = 0, xn - 1 do dir[i] = 0 end
          dir[c] = 1
          check_dir(dir, 'coordinate ' .. (c + 1))
        end
      else
        for r = 1, opts.directions or 6 do
          for i = 0, xn - 1 do dir[i] = math.random() * 2 - 1 end
          check_dir(dir, 'random direction ' .. r)
        end
      end
    end
  end
end

-- a tensor from a flat Lua list and a shape
function M.from_flat(list, shape, opts)
  local t = uly.empty(shape, opts)
  local n = #list
  local buf = ffi.new('double[?]', math.max(n, 1))
  for i = 1, n do buf[i - 1] = list[i] end
  assert(uly.C.uly_tensor_copy_from(t._h, buf, 4, n) == 0)
  return t
end

-- float64 values as a flat Lua list
function M.list(t)
  local v, n = M.values(t)
  local out = {}
  for i = 0, n - 1 do out[i + 1] = v[i] end
  return out
end

-- random token ids i32 [B, T] in [0, V) from Lua's generator (seeded by M.reseed)
function M.token_ids(B, T, V)
  local t = {}
  for b = 1, B do
    t[b] = {}
    for i = 1, T do t[b][i] = math.random(0, V - 1) end
  end
  return uly.tensor(t, { dtype = 'i32' })
end

-- a job run under `timeout` (exit status rc, output out) failed, and not by hanging until the
-- timeout ended it (124)
function M.assert_failed_not_hung(rc, out)
  local luassert = require 'luassert'   -- busted's assert (this module sees Lua's own)
  luassert.are_not.equal(0, rc, out)
  luassert.are_not.equal(124, rc, 'the job hung until the outer timeout:\n' .. out)
end

-- the message of fn()'s error; fails when fn does not raise one
function M.error_of(fn, ...)
  local ok, err = pcall(fn, ...)
  assert(not ok, 'expected an error')
  return tostring(err)
end

-- a string quoted for the shell
-- device 'cuda' for a spec: the CUDA backend (or its emulator) when ULY_TEST_DEVICE is 'cuda' or
-- 'emu' (an error, not a quiet fallback, when it does not load), else the host-memory
-- simulation; returns true for the real backend
function M.use_test_device()
  local mode = os.getenv('ULY_TEST_DEVICE')
  local real = mode == 'cuda' or mode == 'emu'
  -- full f32 GEMMs: a comparison with the CPU measures the kernels, not TF32's rounding (which
  -- AdamW's m / sqrt(v) turns into whole steps for parameters whose gradients are near 0)
  if real and uly.cuda.lib() then uly.cuda.tf32(false) end
  if not uly.cuda.backend() then
    if real then
      local ok, why = uly.cuda.ensure()
      assert(ok, 'ULY_TEST_DEVICE=' .. mode .. ' but the CUDA backend did not start: ' .. tostring(why))
    else
      assert(uly.cuda.simulate())
    end
  end
  return real
end

-- removes the simulated device's backend once the tensors it holds are garbage: compiled traces
-- and the Lua closures of graph nodes (checkpoints, grad_sync marks) let go over a few rounds
function M.reset_simulated_device()
  jit.flush()
  local held, pending
  repeat
    held, pending = uly.memory('cuda').allocated, uly.nn.checkpoint_pending()
    collectgarbage('collect')
    collectgarbage('collect')
  until uly.memory('cuda').allocated == held and uly.nn.checkpoint_pending() == pending
  uly.cuda.reset()
end

-- how a group of several ranks should move device tensors in this run: over NCCL ('device') when
-- every rank emulates its own GPU (ULY_EMU_GPUS=own, the emulator's NCCL over MPI), else staged
-- through host memory ('host': the simulation, or ranks sharing the one GPU of a GPU check)
function M.expected_device_path()
  local own = os.getenv('ULY_TEST_DEVICE') == 'emu' and os.getenv('ULY_EMU_GPUS') == 'own'
  return own and 'device' or 'host'
end

function M.shq(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end

-- a new empty temporary directory (remove it with M.rmtree)
function M.mkdtemp()
  local dir = os.tmpname()
  os.remove(dir)
  assert(os.execute('mkdir -p ' .. M.shq(dir)) == 0, 'cannot make ' .. dir)
  return dir
end
function M.rmtree(dir) if dir then os.execute('rm -rf ' .. M.shq(dir)) end end

-- whether a file can be opened for reading
function M.exists(path)
  local f = io.open(path, 'rb')
  if f then f:close() end
  return f ~= nil
end

-- a file's bytes (nil when it cannot be read), and bytes into a file
M.read_file = require('ulysses.paths').read_file
function M.write_file(path, s)
  local f = assert(io.open(path, 'wb'))
  f:write(s)
  f:close()
end

-- PyTorch's Python (Debian's python3-torch), for the specs that check against it; without the
-- sanitizer runtime a sanitizer pass preloads (torch does not import under it)
M.torch_python = 'env -u LD_PRELOAD /usr/bin/python3'
function M.has_torch()
  if M._has_torch == nil then
    M._has_torch = select(2, M.run(M.torch_python .. ' -c "import torch, numpy"')) == 0
  end
  return M._has_torch
end

-- a shell command's output (stdout and stderr) and exit status
function M.run(cmd)
  local p = assert(io.popen(cmd .. ' 2>&1; echo "exit=$?"'))
  local out = p:read('*a')
  p:close()
  return out, tonumber(out:match('exit=(%d+)%s*$'))
end

return M
