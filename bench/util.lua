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

-- a shell prefix that runs a peer program (PyTorch) with the environment this process had before
-- the ulysses package set OMP_WAIT_POLICY / OPENBLAS_NUM_THREADS for itself
function M.peer_env()
  local names = require('ulysses.ffi').env_set or {}
  if #names == 0 then return '' end
  local parts = { 'env' }
  for _, n in ipairs(names) do parts[#parts + 1] = '-u ' .. n end
  return table.concat(parts, ' ') .. ' '
end

return M
