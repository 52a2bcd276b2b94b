-- spec/repl_spec.lua — bin/ulysses: the prompt evaluates expressions and statements, continues
-- multi-line input, prints tensors readably, survives errors (from a pipe or file: in order with
-- the results, an unfinished statement at the end reported, exit 1); script and -e modes work.
local function run(cmd, input)
  local tmp = os.tmpname()
  if input then
    local f = assert(io.open(tmp, 'w'))
    f:write(input)
    f:close()
    cmd = cmd .. ' < ' .. tmp
  end
  local p = assert(io.popen(cmd .. ' 2>&1; echo "exit=$?"'))
  local out = p:read('*a')
  p:close()
  os.remove(tmp)
  return out
end

describe('bin/ulysses', function()
  it('evaluates expressions, statements and multi-line blocks, and keeps going after an error', function()
    local out = run('bin/ulysses', table.concat({
      'x = uly.ones(2, 3)',
      'x:sum()',
      'x:matmul(x)',
      'for i = 1, 2 do',
      '  io.write("line", i, "\\n")',
      'end',
      'uly.tensor{{1.5, -2}, {3, 4}}',
      '1 + 41',
      'uly.ones(2) *',   -- an expression that goes on on the next line
      '7',
      '= 6 * 7 + 1',      -- the Lua 5.1 prompt's `=`
      'x:sofmax(1)',      -- misspelt: the nearest method or function as a hint
      'uly.rnadn(2)',
    }, '\n') .. '\n')
    assert.truthy(out:find('\n43\n', 1, true), out)
    assert.truthy(out:find("attempt to call method 'sofmax' (a nil value) (did you mean :softmax?)", 1, true), out)
    assert.truthy(out:find("attempt to call field 'rnadn' (a nil value) (did you mean uly.randn?)", 1, true), out)
    assert.truthy(out:find('tensor(6.) f32[]', 1, true), out)
    assert.truthy(out:find('matmul: inner dimensions differ: f32[2, 3] @ f32[2, 3]', 1, true), out)
    assert.truthy(out:find('line1\nline2', 1, true), out)
    assert.truthy(out:find('[ 3.0000,  4.0000]]) f32[2, 2]', 1, true), out)
    assert.truthy(out:find('\n42\n', 1, true), out)
    assert.truthy(out:find('tensor([7., 7.]) f32[2]', 1, true), out)
    assert.truthy(out:find('exit=1', 1, true), out)   -- input from a file, and the matmul failed
  end)

  it('from a pipe or file: keeps results and errors in order, reports an unfinished statement, exits 1 on errors', function()
    local out = run('bin/ulysses', 'print("first")\nerror("second")\nprint("third")\ny = {\n  1,\n')
    local first, second, third = out:find('first', 1, true), out:find('second', 1, true), out:find('third', 1, true)
    assert.truthy(first and second and third and first < second and second < third, out)
    assert.truthy(out:find("unfinished input at end of input: stdin:2: unexpected symbol near '<eof>' (the statement "
                           .. "from 'y = {')", 1, true), out)
    assert.truthy(out:find('exit=1', 1, true), out)
    -- an unfinished statement alone fails the run; input that all succeeds exits 0
    out = run('bin/ulysses', 'for i = 1, 2 do\n  print(i)\n')
    assert.truthy(out:find("unfinished input at end of input: stdin:2: 'end' expected (to close 'for' at line 1) "
                           .. "near '<eof>' (the statement from 'for i = 1, 2 do')", 1, true), out)
    assert.truthy(out:find('exit=1', 1, true), out)
    out = run('bin/ulysses', 'x = 1\nprint(x + 1)\nfor i = 1, 2 do\nend\n')
    assert.truthy(out:find('\n2\n', 1, true), out)
    assert.truthy(out:find('exit=0', 1, true), out)
  end)

  it('runs a script with arguments and reports its errors with a non-zero exit', function()
    local path = os.tmpname() .. '.lua'
    local f = assert(io.open(path, 'w'))
    f:write("local uly = require 'ulysses'\nprint(arg[1], uly.arange(tonumber(arg[1])):numel())\n")
    f:close()
    local out = run('bin/ulysses ' .. path .. ' 5')
    assert.truthy(out:find('5\t5', 1, true), out)
    assert.truthy(out:find('exit=0', 1, true), out)
    f = assert(io.open(path, 'w'))
    f:write("local uly = require 'ulysses'\nlocal y = uly.ones(2):view(3)\n")
    f:close()
    out = run('bin/ulysses ' .. path)
    assert.truthy(out:find(':2: view: shape [3] has 3 elements but f32[2] has 2', 1, true), out)
    assert.truthy(out:find('exit=1', 1, true), out)
    os.remove(path)
  end)

  it('runs code given with -e', function()
    local out = run("bin/ulysses -e 'print(uly.tensor{1, 2, 3}:sum():item())'")
    assert.truthy(out:find('^6\n'), out)
  end)

  it('completes names with Tab: variables, uly and its submodules, fields, and methods after a colon', function()
    local uly = require 'ulysses'
    local repl = require 'ulysses.repl'
    local env = setmetatable({ uly = uly, x = uly.randn(2, 3), lin = uly.nn.Linear(2, 3), xylo = 1 }, { __index = _G })
    local function c(text) return table.concat(repl.complete(text, env), ' ') end
    assert.are.equal('uly.cross_entropy', c('uly.cross'))
    assert.are.equal('uly.nn.Linear', c('uly.nn.Lin'))
    assert.are.equal('uly.pretrained', c('uly.pre'))            -- loaded on first use, offered before
    assert.are.equal('uly.optim.AdamW', c('uly.optim.Ad'))
    assert.are.equal('x:reshape', c('x:resh'))
    assert.are.equal('x.grad', c('x.gr'))
    assert.are.equal('x xpcall xylo', c('x'))                    -- the prompt's variables and the globals
    assert.are.equal('print', c('prin'))
    assert.are.equal('lin:parameters', c('lin:parameters'))      -- a class's methods; after ':' only functions
    assert.are.equal('lin.weight', c('lin.wei'))                 -- an object's own fields
    assert.are.equal('', c('lin:weig'))
    assert.falsy(c('lin.'):find('lin._', 1, true))               -- internals only when asked for
    assert.truthy(c('lin._'):find('lin._children', 1, true))
    assert.are.equal('', c('nothing.here'))
    assert.are.equal('', c('x.shape.len'))                       -- no calls: a method's result is not looked into
    assert.are.equal('', c('.'))
  end)

  it('completes with Tab at a terminal (readline)', function()
    if os.execute('command -v script >/dev/null 2>&1') ~= 0
      or not pcall(function() require('ffi').load('readline.so.8') end) then
      pending('no script(1) or no libreadline.so.8 here')
      return
    end
    -- (a pseudo-terminal: Tab completes in the line readline edits, then the line runs)
    local home = require('helpers').mkdtemp()   -- (readline's history file goes there)
    local out = run("(printf 'uly.cross_ent\\t\\n'; sleep 1; printf 'x = uly.ones(2)\\n'; sleep 1; printf 'x:nume\\t()\\n'; "
                    .. "sleep 1) | TERM=xterm HOME=" .. home .. " timeout 30 script -qec bin/ulysses /dev/null")
    require('helpers').rmtree(home)
    assert.truthy(out:find('function: 0x', 1, true), out)
    assert.truthy(out:find('x:numel()', 1, true), out)
    assert.truthy(out:find('[\r\n]2\r?\n'), out)   -- x:numel() ran
  end)
end)
