-- spec/json_spec.lua — lua/ulysses/json.lua, the JSON reader and string encoder that uly.log
-- (JSON Lines) and uly.safetensors (headers) share: values, escapes, what it refuses and where.
local json = require 'ulysses.json'

describe('ulysses.json', function()
  it('decodes objects, arrays, strings, numbers, true, false and null', function()
    assert.are.same({ a = { 1, -2.5, 3e2, 0.5e-3, { b = true, c = false } }, ['q"\\/'] = 'x\ty', e = {} },
                    json.decode(' { "a" : [1, -2.5, 3E2, 5e-4, {"b": true, "c": false}], "q\\"\\\\\\/" : "x\\ty", "e": {} } '))
    assert.are.same({}, json.decode('[]'))
    assert.are.equal(-0.25, json.decode('-0.25'))
    local v, err = json.decode('null')
    assert.is_nil(v)
    assert.is_nil(err)
    assert.are.equal('del \127 kept', json.decode('"del \127 kept"'))
    local a = json.decode('[1, null, 3]')
    assert.are.equal(1, a[1])
    assert.is_nil(a[2])
    assert.are.equal(3, a[3])
  end)

  it('turns \\u escapes into UTF-8, surrogate pairs included', function()
    assert.are.equal('\195\169 \226\152\131 \240\159\152\128', json.decode('"\\u00e9 \\u2603 \\ud83d\\ude00"'))
    assert.are.equal('\0', json.decode('"\\u0000"'))
  end)

  it('encodes any string so that decoding gives it back', function()
    local s = 'quote " backslash \\ newline \n tab \t nul \0 bell \7 del \127 utf8 \195\169'
    local enc = json.string(s)
    assert.is_nil(enc:find('[%z\1-\31]'), 'no raw control characters: ' .. enc)
    assert.are.equal(s, json.decode(enc))
  end)

  it('refuses malformed text, saying at which character and what is wrong', function()
    for bad, what in pairs {
      ['{"a": 1'] = 'expected "," or "}"', ['{"a" 1}'] = 'expected ":"', ['{"a": "x}'] = 'unterminated string',
      ['{"a": 1} x'] = 'text after the value', ['{"a": 1, "a": 2}'] = 'key "a" appears twice',
      ['{"a": "\\q"}'] = 'bad escape \\q', ['{"a": "\\ud800"}'] = 'unpaired surrogate',
      [string.rep('[', 40) .. string.rep(']', 40)] = 'nested deeper than 32', ['{"a": -}'] = 'unexpected "-"',
      ['"tab\there"'] = 'control character in a string', ['{1: 2}'] = 'expected a string key', [''] = 'unexpected end',
    } do
      local v, err = json.decode(bad)
      assert.is_nil(v, bad)
      assert.matches(what, err, 1, true)
      assert.matches('^at character %d+: ', err)
    end
    local _, err = json.decode('{"a": [1, 2,, 3]}')
    assert.are.equal('at character 13: unexpected ","', err)
  end)
end)
