-- spec/support/summary.lua — busted output handler: busted's plain terminal output, then a
-- closing line "N passed, N failed" (failures + errors count as failed). When the environment
-- names ULY_SUMMARY_FILE, the two counts are also appended there for scripts/test.sh to add up.
return function(options)
  local busted = require 'busted'
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
