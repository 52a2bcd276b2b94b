-- bench/util.lua — small helpers the benchmarks share (require 'bench.util' under bin/ulysses).
local M = {}

-- the median of a list of numbers (the list is not modified)
function M.median(list)
  local s = {}
  for i, v in ipairs(list) do s[i] = v end
  table.sort(s)
  local n = #s
  return n % 2 == 1 and s[(n + 1) / 2] or (s[n / 2] + s[n / 2 + 1]) / 2
end

return M
