-- lua/ulysses/gpu_peak.lua — a GPU's dense bf16 tensor-core peak (FLOP/s, f32 accumulation), the
-- denominator of MFU on cuda: the vendor's published figure for the data-centre GPUs this runs on
-- (matched by device name), else an estimate from multiprocessors x peak clock x the dense bf16
-- FLOPs a multiprocessor issues per clock on its architecture (compute capability). Pure Lua:
-- uly.cuda.peak_flops(dev) feeds it what the device reports.
local M = {}

-- published dense (no sparsity) bf16 peaks, TFLOP/s; the first entry whose words appear in a row
-- among the name's (lower-cased, split at anything not a letter or digit: "NVIDIA H100 80GB HBM3"
-- is nvidia h100 80gb hbm3) wins, so the specific forms (PCIe, NVL) come before the family
local published = {
  { 'h100 pcie', 756 }, { 'h100 nvl', 835 }, { 'h100', 989 }, { 'h800 pcie', 756 }, { 'h800', 989 },
  { 'h200 nvl', 835 }, { 'gh200', 989 }, { 'h200', 989 }, { 'h20', 148 },
  { 'a100', 312 }, { 'a800', 312 }, { 'a30', 165 }, { 'a10', 125 },
  { 'l40s', 362 }, { 'l40', 181 }, { 'l4', 121 },
  { 'b200', 2250 }, { 'gb200', 2500 },
}

-- dense bf16 FLOPs per multiprocessor per clock by compute capability (A100: 108 SMs x 1.41 GHz x
-- 2048 = 312 T; H100 SXM: 132 x 1.83 GHz x 4096 = 989 T; A10: 72 x 1.695 GHz x 1024 = 125 T)
local per_sm_clock = { ['8.0'] = 2048, ['8.6'] = 1024, ['8.7'] = 1024, ['8.9'] = 1024, ['9.0'] = 4096, ['10.0'] = 8192 }

-- whether the words of `phrase` appear one after another in the list `words`
local function contains_words(words, phrase)
  local want = {}
  for w in phrase:gmatch('%w+') do want[#want + 1] = w end
  for i = 1, #words - #want + 1 do
    local j = 1
    while j <= #want and words[i + j - 1] == want[j] do j = j + 1 end
    if j > #want then return true end
  end
  return false
end

-- peak(info): FLOP/s and where it came from; info = { name, compute_capability ('9.0'),
-- multiprocessors, clock_mhz } (what uly.cuda.devices() gives). nil and why when neither the
-- name nor the architecture is known.
function M.peak(info)
  if type(info) ~= 'table' then error('gpu_peak.peak: expected a device table (uly.cuda.devices()), got ' .. type(info), 2) end
  local words = {}
  for w in tostring(info.name or ''):lower():gmatch('%w+') do words[#words + 1] = w end
  for _, e in ipairs(published) do
    if contains_words(words, e[1]) then
      return e[2] * 1e12, ('%s bf16 dense peak (published, %d TFLOP/s)'):format(info.name, e[2])
    end
  end
  local rate = per_sm_clock[tostring(info.compute_capability)]
  local sms, mhz = tonumber(info.multiprocessors), tonumber(info.clock_mhz)
  if rate and sms and mhz and sms > 0 and mhz > 0 then
    local flops = sms * mhz * 1e6 * rate
    return flops, ('%s bf16 dense peak (estimated: %d SMs x %d MHz x %d, %.0f TFLOP/s)'):format(
      info.name, sms, mhz, rate, flops / 1e12)
  end
  return nil, ('no bf16 peak known for %s (compute capability %s): give it (train.lua --peak_gflops, bench/gpu.lua --peak)')
    :format(tostring(info.name), tostring(info.compute_capability))
end

return M
