-- spec/train_demo_spec.lua — the README's main job (train.lua) really trains: the loss of the
-- embedded-text model falls well below its starting value, and it prints a sample.
describe('train.lua', function()
  it('lowers the loss on the embedded text and samples from the model', function()
    local p = assert(io.popen('bin/ulysses train.lua --steps 100 --sample 16 --seed 7 2>&1'))
    local out = p:read('*a')
    p:close()
    local losses = {}
    for l in out:gmatch('loss (%d+%.%d+)') do losses[#losses + 1] = tonumber(l) end
    assert.truthy(#losses >= 3, out)
    assert.truthy(losses[1] > 5.0, out)                    -- ~ln(256) at initialisation
    assert.truthy(losses[#losses] < losses[1] - 2.0, out)  -- learned the byte statistics and more
    assert.truthy(out:find('sample: And God said', 1, true), out)
  end)
end)
