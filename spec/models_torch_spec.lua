-- spec/models_torch_spec.lua — the GPT and Llama models against an independent implementation:
-- bench/peers/torch_models.py writes both again in PyTorch from their formulas (float64) and
-- computes the loss and every gradient for our weights and tokens; ours (f32) must agree to f32
-- accuracy. It checks the conventions no op-level spec can: the fused QKV's head order, GQA's
-- grouping, RoPE's pairs and angles, the norms' eps, GELU's tanh form, the tied head, the loss's
-- mean, what a sliding window and document ids hide, and greedy decoding through the KV cache. Runs where /usr/bin/python3 has torch and numpy (Debian: python3-torch); pending elsewhere.
local ffi = require 'ffi'
local uly = require 'ulysses'
local helpers = require 'helpers'
local GPT = require 'models.gpt'
local Llama = require 'models.llama'

local PEER = require('ulysses.ffi').root .. '/bench/peers/torch_models.py'


-- the model's config, parameters (uly.safetensors: the peer reads the format on its own) and
-- tokens into dir
local function write_case(dir, model, x, y, doc, greedy)
  local cfg = model.config
  local lines = { 'model=' .. cfg.model, 'batch=' .. x:size(1), 'seq=' .. x:size(2) }
  for _, k in ipairs { 'layers', 'heads', 'kv_heads', 'dim', 'eps', 'rope_theta', 'window' } do
    if cfg[k] then lines[#lines + 1] = string.format('%s=%.17g', k, cfg[k]) end
  end
  lines[#lines + 1] = 'tied=' .. (cfg.tied and 1 or 0)
  if greedy then lines[#lines + 1] = string.format('greedy=%d\nprompt=%d', greedy.n, greedy.prompt) end
  helpers.write_file(dir .. '/config.txt', table.concat(lines, '\n') .. '\n')
  uly.safetensors.save(dir .. '/model.safetensors', model)
  helpers.write_file(dir .. '/x.i32', ffi.string(x:data(), x:numel() * 4))
  helpers.write_file(dir .. '/y.i32', ffi.string(y:data(), y:numel() * 4))
  if doc then helpers.write_file(dir .. '/doc.i32', ffi.string(doc:data(), doc:numel() * 4)) end
end

-- a raw f64 file as a tensor of the given shape
local function read_f64(path, shape)
  local bytes = assert(helpers.read_file(path), 'the peer wrote no ' .. path)
  local t = uly.zeros(shape, { dtype = 'f64' })
  assert.are.equal(t:numel() * 8, #bytes, path .. ': size')
  ffi.copy(t:data(), bytes, #bytes)
  return t
end

local CASES = {
  { 'GPT (biases, tied head)', GPT, { preset = 'tiny', heads = 4 } },
  { 'GPT without biases', GPT, { preset = 'tiny', bias = false, eps = 1e-6 } },
  { 'Llama (GQA 4:2, own output)', Llama, { preset = 'tiny' } },
  { 'Llama (one K/V head, tied, rope_theta 500000, 3 layers)', Llama,
    { preset = 'tiny', kv_heads = 1, tied = true, rope_theta = 500000, layers = 3 } },
  { 'GPT with a sliding window of 5 (flash attention)', GPT, { preset = 'tiny', window = 5 } },
  { 'Llama with a window of 7 and documents (flash attention)', Llama, { preset = 'tiny', window = 7 },
    { 5, 6, 12 } },   -- document lengths of each sequence (T = 23)
}

-- document ids [B, T] (i32) from lengths, the second sequence's shifted by 2
local function documents(B, T, lengths)
  local ids = {}
  for b = 1, B do
    local row, doc, left = {}, 0, lengths[1] + (b == 2 and 2 or 0)
    for t = 1, T do
      if left == 0 then doc = doc + 1; left = lengths[doc % #lengths + 1] end
      row[t], left = doc, left - 1
    end
    ids[b] = row
  end
  return uly.tensor(ids, { dtype = 'i32' })
end

describe('models against PyTorch', function()
  for _, case in ipairs(CASES) do
    -- #release_only: the models' numbers, checked once (the sanitizer pass runs these code paths in
    -- models_spec and the op specs)
    it(case[1] .. ': the loss and every gradient of bench/peers/torch_models.py (float64) #release_only', function()
      if not helpers.has_torch() then
        pending('no PyTorch: /usr/bin/python3 cannot import torch and numpy (Debian: python3-torch)')
      end
      helpers.reseed(91)
      local model = case[2](case[3])
      -- weights off their init (norm gains 1, biases 0 would hide a swapped or missing one)
      uly.no_grad(function()
        for _, p in ipairs(model:parameters()) do p:copy_(p + uly.randn(p:shape()):mul(0.05)) end
      end)
      local B, T = 2, 23
      local x, y = helpers.token_ids(B, T, model.config.vocab), helpers.token_ids(B, T, model.config.vocab)
      local doc = case[4] and documents(B, T, case[4])
      local loss = model:loss(x, y, { doc = doc })
      loss:backward()
      local dir = helpers.mkdtemp()
      local greedy = not doc and { n = 12, prompt = 5 } or nil   -- greedy decoding too (no documents there)
      write_case(dir, model, x, y, doc, greedy)
      local out, code = helpers.run(helpers.torch_python .. ' ' .. helpers.shq(PEER) .. ' ' .. helpers.shq(dir))
      assert.are.equal(0, code, out)
      local theirs = read_f64(dir .. '/loss.f64', { 1 }):item()
      assert.is_true(math.abs(loss:item() - theirs) <= 1e-6 * math.abs(theirs),
                     string.format('loss %.9g, PyTorch (float64) %.9g', loss:item(), theirs))
      local count = 0
      for name, p in model:named_parameters() do
        local g = read_f64(dir .. '/' .. name .. '.grad.f64', p:shape())
        helpers.assert_within(p.grad, g, 2e-5, 'gradient of ' .. name)
        count = count + 1
      end
      assert.is_true(count >= 10, 'parameters compared: ' .. count)
      if greedy then   -- model:generate with its KV cache against whole forward passes in float64
        local theirs_ids = helpers.read_file(dir .. '/greedy.i32')
        local gaps = read_f64(dir .. '/greedy_gap.f64', { greedy.n })
        local ids = model:generate(x:narrow(1, 1, 1):narrow(2, 1, greedy.prompt):contiguous(),
                                   { max_new_tokens = greedy.n, temperature = 0 })
        assert.are.equal(greedy.n, #ids)
        local want, gap = ffi.cast('const int32_t *', theirs_ids), gaps:data()
        for i = 1, greedy.n do
          if ids[i] ~= want[i - 1] then   -- only a near tie may go either way (then the rest differs)
            assert.is_true(gap[i - 1] < 1e-4, string.format('greedy token %d: %d, PyTorch %d (top-2 gap %.3g)', i,
                                                            ids[i], want[i - 1], gap[i - 1]))
            break
          end
        end
      end
      helpers.rmtree(dir)
    end)
  end
end)
