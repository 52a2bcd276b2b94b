-- spec/support/summary.lua — busted output handler: busted's plain terminal output, then a
-- closing line "N passed, N failed" (failures + errors count as failed). When the environment
-- names ULY_SUMMARY_FILE, the two counts are also appended there for scripts/test.sh to add up.
-- Under mpirun every rank runs the suite: rank 0 reports as above; the other ranks stay quiet
-- unless something fails on them, then they print each failure prefixed with their rank (and
-- exit non-zero, which fails the mpirun).
local mpi_rank = tonumber(os.getenv('OMPI_COMM_WORLD_RANK') or '0') or 0

-- what a rank other than 0 prints: only its failures and errors
local function quiet_rank(busted)
  local handler = require 'busted.outputHandlers.base'()
  local function report()
    local bad = {}
    for _, f in ipairs(handler.failures) do bad[#bad + 1] = { 'Failure', f } end
    for _, e in ipairs(handler.errors) do bad[#bad + 1] = { 'Error', e } end
    for _, b in ipairs(bad) do
      local f, trace = b[2], b[2].trace or {}
      io.stderr:write(string.format('rank %d: %s -> %s @ %s\n%s\n%s\n\n', mpi_rank, b[1], tostring(trace.short_src),
                                    tostring(trace.currentline), f.name, tostring(f.message)))
    end
    if #bad > 0 then
      io.stderr:write(string.format('rank %d: %d failed\n', mpi_rank, handler.failuresCount + handler.errorsCount))
    end
    io.stderr:flush()
    return nil, true
  end
  local subscribe = handler.subscribe
  handler.subscribe = function(self, opts)
    subscribe(self, opts)
    busted.subscribe({ 'suite', 'end' }, report)
  end
  return handler
end

return function(options)
  local busted = require 'busted'
  if mpi_rank ~= 0 then return quiet_rank(busted) end
  local handler = require 'busted.outputHandlers.plainTerminal'(options)

  local function closing_line()
    local passed = handler.successesCount
    local failed = handler.failuresCount + handler.errorsCount
    io.write(string.format('%d passed, %d failed\n', passed, failed))
    local path = os.getenv('ULY_SUMMARY_FILE')
    if path and path ~= '' then
      local f = io.open(path, 'a')
      if f then f:write(string.format('%d %d\n', passed, failed)) f:close() end
    end
    io.flush()
    return nil, true
  end

  local subscribe = handler.subscribe
  handler.subscribe = function(self, opts)
    subscribe(self, opts)
    busted.subscribe({ 'suite', 'end' }, closing_line)  -- after plainTerminal's own summary
  end
  return handler
end
