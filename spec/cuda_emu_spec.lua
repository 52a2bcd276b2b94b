-- spec/cuda_emu_spec.lua — checks of the CUDA emulator itself (kernels/cuda/emu/), on rules a
-- kernel could break unseen until it runs on a GPU: setmaxnreg's register pool (a warpgroup that
-- grows waits until another shrinks), dynamic shared memory over 48 KiB only once allowed, a
-- wgmma's product and its operands unchanged from issue to wait (spec/support/emu_rules.cpp,
-- built here against the emulator).
local helpers = require 'helpers'
local base = require 'ulysses.ffi'

local root = base.root
local emu_dir = root .. '/build'   -- the Release build's emulator
-- the compiler and the program run without the sanitizer pass's preloaded runtime (it would report
-- the compiler's own leaks)
local plain = 'env -u LD_PRELOAD -u ASAN_OPTIONS '

describe('the CUDA emulator', function()
  it('moves setmaxnreg registers through the block\'s pool, stops where a GPU would wait forever, and refuses '
     .. 'shared memory a kernel was not allowed, and checks a wgmma\'s product and operands', function()
    if not helpers.exists(emu_dir .. '/libulysses_cuemu.so') then pending('no ' .. emu_dir .. '/libulysses_cuemu.so') return end
    local _, has_cxx = helpers.run('command -v c++')
    if has_cxx ~= 0 then pending('no C++ compiler') return end
    local dir = helpers.mkdtemp()
    local exe = dir .. '/emu_rules'
    local out, rc = helpers.run((plain .. 'c++ -std=c++17 -I%s/kernels/cuda/emu -I%s/kernels/cuda/emu/include -I%s/core/include %s ' ..
      '-L%s -lulysses_cuemu -Wl,-rpath,%s -o %s'):format(root, root, root,
      helpers.shq(root .. '/spec/support/emu_rules.cpp'), helpers.shq(emu_dir), helpers.shq(emu_dir), helpers.shq(exe)))
    assert.are.equal(0, rc, out)
    out, rc = helpers.run(plain .. helpers.shq(exe) .. ' balanced')
    assert.are.equal(0, rc, out)
    assert.truthy(out:find('^done\n'), out)
    -- the producer never gives its registers back: both consumers wait; asking 240 each: the second waits
    for mode, live in pairs { ['no-shrink'] = 256, ['too-much'] = 128 } do
      out, rc = helpers.run(plain .. helpers.shq(exe) .. ' ' .. mode)
      assert.are_not.equal(0, rc, mode .. ': ' .. out)
      assert.truthy(out:find(('cuda emulator: deadlock in block 0: %d live threads wait .* or at a setmaxnreg that not ' ..
                              'all of a warpgroup\'s threads reach or whose increase no decrease makes room for'):format(live)),
                    mode .. ': ' .. out)
    end
    out, rc = helpers.run(plain .. helpers.shq(exe) .. ' mixed')
    assert.are_not.equal(0, rc, out)
    assert.truthy(out:find('cuda emulator: the threads of warpgroup 0 ask setmaxnreg.inc 232 and .inc 224 at once'), out)
    -- 64 KiB of dynamic shared memory: refused (cudaErrorInvalidValue, nothing run) until allowed
    out, rc = helpers.run(plain .. helpers.shq(exe) .. ' smem')
    assert.are.equal(0, rc, out)
    assert.are.equal('refused 1 ran 1\nexit=0\n', out)
    -- a wgmma with A and B through descriptors: the product; an operand written between its issue
    -- and its wait (a row of A that only another warp's lanes take, an element of B) stops it
    out, rc = helpers.run(plain .. helpers.shq(exe) .. ' wgmma')
    assert.are.equal(0, rc, out)
    assert.are.equal('wgmma ok\nexit=0\n', out)
    for mode, operand in pairs { ['wgmma-a-late'] = 'A', ['wgmma-b-late'] = 'B' } do
      out, rc = helpers.run(plain .. helpers.shq(exe) .. ' ' .. mode)
      assert.are_not.equal(0, rc, mode .. ': ' .. out)
      assert.truthy(out:find("cuda emulator: a wgmma's " .. operand .. ' tile changed between its issue and its wait', 1, true),
                    mode .. ': ' .. out)
    end
    helpers.rmtree(dir)
  end)
end)
