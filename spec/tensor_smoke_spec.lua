-- spec/tensor_smoke_spec.lua — a first end-to-end check: construct, compute, backward.
local uly = require 'ulysses'
local helpers = require 'helpers'

describe('smoke', function()
  it('matmul + sum gradient equals row sums broadcast', function()
    helpers.reseed()
    local a = uly.randn(3, 4, { requires_grad = true })
    local b = uly.randn(4, 5)
    a:matmul(b):sum():backward()
    local expected = b:sum(2):view(1, 4):expand(3, 4)
    helpers.assert_close(a.grad, expected, 1e-5, 1e-6)
  end)
  it('gradcheck of a small composition', function()
    helpers.reseed(1)
    local a = uly.randn(3, 4, { requires_grad = true })
    local b = uly.randn(4, 5, { requires_grad = true })
    helpers.gradcheck(function(x, y) return x:matmul(y):gelu('tanh') end, { a, b })
  end)
end)
