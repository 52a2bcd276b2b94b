-- lua/ulysses/attention_keep.lua — flash attention's results kept across an activation-checkpoint
-- replay (nn.checkpoint_except_attention). While such a segment's forward runs, every
-- uly.flash_attention call appends its output and per-row log-sum-exp to the segment's tape;
-- when backward replays the segment, the same calls, in the same order, take them back
-- (uly_flash_attention_kept) instead of running attention's forward a second time. The replay
-- is the same function on the same inputs with the same random numbers, so the calls come in
-- the same order; each is still checked (shapes, device, dtype, scale, mask) and a kept output
-- written in place since (its storage's version moved) is not used: from the first mismatch on,
-- the rest of that replay recomputes, which is slower and equally right.
--
-- Two tapes can be live at once: the one being replayed (calls take from it) and the one being
-- recorded (calls append to it); a checkpointed segment nested in a replayed one does both.
local ffi = require 'ffi'

local M = { recording = nil, replaying = nil }

function M.new_tape() return { items = {}, pos = 0 } end

-- runs fn(...) with the given tapes live (nil: none), restoring the previous ones even on error
function M.with(recording, replaying, fn, ...)
  local prev_rec, prev_rep = M.recording, M.replaying
  M.recording, M.replaying = recording, replaying
  local res = { n = select('#', ...), pcall(fn, ...) }
  M.recording, M.replaying = prev_rec, prev_rep
  if not res[1] then error(res[2], 0) end
  return unpack(res, 2, res.n + 1)
end

-- what must match between a recorded call and its replay
local function signature(q, k, v, scale, m)
  local parts = { q:device(), q:dtype(), k:dtype(), v:dtype(), scale, m.causal, tonumber(m.window_left),
                  tonumber(m.window_right), tonumber(m.block_size), m.block_layout ~= nil and 1 or 0,
                  m.q_doc ~= nil and 1 or 0 }
  for _, t in ipairs({ q, k, v }) do parts[#parts + 1] = table.concat(t:shape(), 'x') end
  return table.concat(parts, ',')
end

-- uly.flash_attention's work while a tape is live: C, T = the library and the tensor wrapper;
-- q, k, v tensors; scale (0: default); m the uly_attn_mask
function M.call(C, T, q, k, v, scale, m)
  local sig = signature(q, k, v, scale, m)
  local item
  local tape = M.replaying
  if tape and not tape.diverged then
    tape.pos = tape.pos + 1
    local it = tape.items[tape.pos]
    tape.items[tape.pos] = nil        -- from here on the replayed graph's node holds what it needs
    if it and it.sig == sig and it.out._h ~= nil and C.uly_tensor_version(it.out._h) == it.version then
      item = it
    else
      tape.diverged = true
    end
  end
  local out, lse
  if item then
    out = T.wrap(C.uly_flash_attention_kept(q._h, k._h, v._h, scale, m, item.out._h, item.lse._h))
    lse = item.lse
  elseif M.recording then
    local h = ffi.new('uly_tensor *[1]')
    out = T.wrap(C.uly_flash_attention_keep(q._h, k._h, v._h, scale, m, h))
    lse = T.wrap(h[0])
  else
    return T.wrap(C.uly_flash_attention(q._h, k._h, v._h, scale, m))
  end
  local rec = M.recording
  if rec then
    local kept = item and item.out or out
    rec.items[#rec.items + 1] = { sig = sig, out = kept, lse = lse, version = C.uly_tensor_version(kept._h) }
  end
  return out
end

return M
