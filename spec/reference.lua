-- spec/reference.lua — plain-Lua float64 reference helpers shared by the op specs
-- (spec/ops_*_spec.lua): shape arithmetic on row-major flat lists, the flat-list equivalents of
-- Tensor:permute / Tensor:narrow, right-aligned broadcasting, list maps, sums and max |x|, and
-- leaf() for gradient inputs.
-- Usage: local R = require 'reference'. Helpers that only one spec needs stay in that spec.
local R = {}

function R.numel(shape)
  local n = 1
  for _, s in ipairs(shape) do n = n * s end
  return n
end

-- row-major (contiguous) strides of `shape`, in elements
function R.strides_of(shape)
  local st, s = {}, 1
  for d = #shape, 1, -1 do st[d] = s; s = s * shape[d] end
  return st
end

-- 0-based multi-index of flat position p (0-based) in `shape`
function R.unravel(p, shape)
  local idx = {}
  for d = #shape, 1, -1 do
    idx[d] = p % shape[d]
    p = (p - idx[d]) / shape[d]
  end
  return idx
end

-- values of list (row-major, `shape`) permuted like Tensor:permute(perm) (perm 1-based)
function R.permute_list(list, shape, perm)
  local st = R.strides_of(shape)
  local oshape = {}
  for d = 1, #perm do oshape[d] = shape[perm[d]] end
  local out = {}
  for p = 0, R.numel(oshape) - 1 do
    local idx = R.unravel(p, oshape)
    local src = 0
    for d = 1, #perm do src = src + idx[d] * st[perm[d]] end
    out[p + 1] = list[src + 1]
  end
  return out, oshape
end

-- values of list narrowed like Tensor:narrow(dim, start, len) (start 1-based)
function R.narrow_list(list, shape, dim, start, len)
  local st = R.strides_of(shape)
  local oshape = { unpack(shape) }
  oshape[dim] = len
  local out = {}
  for p = 0, R.numel(oshape) - 1 do
    local idx = R.unravel(p, oshape)
    local src = 0
    for d = 1, #shape do src = src + (idx[d] + (d == dim and start - 1 or 0)) * st[d] end
    out[p + 1] = list[src + 1]
  end
  return out, oshape
end

-- right-aligned broadcast of the leading na dims of shape sa with the leading nb dims of sb
-- (default: all of them): returns the broadcast shape and, for each of its positions in
-- row-major order, the 0-based offsets oa[p], ob[p] of the matching elements of row-major
-- lists of shapes sa and sb (a size-1 dim repeats; trailing dims not broadcast stay at 0)
function R.broadcast(sa, sb, na, nb)
  na, nb = na or #sa, nb or #sb
  local nd = math.max(na, nb)
  local shape = {}
  for d = 1, nd do
    local da, db = d - (nd - na), d - (nd - nb)
    local xa, xb = da >= 1 and sa[da] or 1, db >= 1 and sb[db] or 1
    assert(xa == xb or xa == 1 or xb == 1, 'reference: shapes do not broadcast')
    shape[d] = xa == 1 and xb or xa
  end
  local sta, stb = R.strides_of(sa), R.strides_of(sb)
  local oa, ob = {}, {}
  for p = 0, R.numel(shape) - 1 do
    local idx = R.unravel(p, shape)
    local ia, ib = 0, 0
    for d = 1, nd do
      local da, db = d - (nd - na), d - (nd - nb)
      if da >= 1 and sa[da] ~= 1 then ia = ia + idx[d] * sta[da] end
      if db >= 1 and sb[db] ~= 1 then ib = ib + idx[d] * stb[db] end
    end
    oa[p + 1], ob[p + 1] = ia, ib
  end
  return shape, oa, ob
end

-- largest |x| over a list (0 for an empty one)
function R.max_abs(list)
  local m = 0
  for _, x in ipairs(list) do m = math.max(m, math.abs(x)) end
  return m
end

-- f applied to every element of list
function R.map(list, f)
  local out = {}
  for i, v in ipairs(list) do out[i] = f(v) end
  return out
end

-- sum of a list, in order
function R.lsum(v) local s = 0 for _, x in ipairs(v) do s = s + x end return s end

-- a fresh leaf tensor with t's values that records gradients (t itself is left alone)
function R.leaf(t) return t:detach():clone():requires_grad_(true) end

return R
