-- train.lua — the main job. For now (until the nn/optim/data issue lands) it trains a small
-- byte-level, one-block causal transformer written directly with tensor ops and autograd, on
-- an embedded default text (Genesis 1, King James Version), with Adam implemented here in a
-- few lines, then samples from it. Run: bin/ulysses train.lua [--steps N] [--seed S]
local uly = require 'ulysses'

local TEXT = [[
In the beginning God created the heaven and the earth. And the earth was without form, and void;
and darkness was upon the face of the deep. And the Spirit of God moved upon the face of the waters.
And God said, Let there be light: and there was light. And God saw the light, that it was good: and
God divided the light from the darkness. And God called the light Day, and the darkness he called
Night. And the evening and the morning were the first day. And God said, Let there be a firmament in
the midst of the waters, and let it divide the waters from the waters. And God made the firmament,
and divided the waters which were under the firmament from the waters which were above the
firmament: and it was so. And God called the firmament Heaven. And the evening and the morning were
the second day. And God said, Let the waters under the heaven be gathered together unto one place,
and let the dry land appear: and it was so. And God called the dry land Earth; and the gathering
together of the waters called he Seas: and God saw that it was good. And God said, Let the earth
bring forth grass, the herb yielding seed, and the fruit tree yielding fruit after his kind, whose
seed is in itself, upon the earth: and it was so. And the earth brought forth grass, and herb
yielding seed after his kind, and the tree yielding fruit, whose seed was in itself, after his
kind: and God saw that it was good. And the evening and the morning were the third day.
]]

-- flags
local cfg = { steps = 300, seed = 1337, batch = 16, seq = 64, dim = 64, heads = 4, lr = 3e-3, sample = 240 }
local i = 1
while i <= #arg do
  local key = arg[i]:match('^%-%-(%w+)$')
  if not key or cfg[key] == nil or not tonumber(arg[i + 1]) then
    io.stderr:write('usage: bin/ulysses train.lua [--steps N] [--seed S] [--batch B] [--seq T] [--dim C] '
                    .. '[--heads H] [--lr LR] [--sample N]\n')
    os.exit(2)
  end
  cfg[key] = tonumber(arg[i + 1])
  i = i + 2
end
uly.manual_seed(cfg.seed)
math.randomseed(cfg.seed)

local V, C, H, T, B = 256, cfg.dim, cfg.heads, cfg.seq, cfg.batch
local D = C / H
local bytes = { TEXT:byte(1, -1) }

-- parameters (GPT-2 style initialisation: N(0, 0.02), residual projections scaled down)
local function param(...) return uly.randn(...):scale(0.02):detach():requires_grad_() end
local P = {
  wte = param(V, C), wpe = param(T, C),
  ln1_w = uly.ones(C, { requires_grad = true }), ln1_b = uly.zeros(C, { requires_grad = true }),
  wqkv = param(C, 3 * C), wo = uly.randn(C, C):scale(0.02 / math.sqrt(2)):detach():requires_grad_(),
  ln2_w = uly.ones(C, { requires_grad = true }), ln2_b = uly.zeros(C, { requires_grad = true }),
  w1 = param(C, 4 * C), w2 = uly.randn(4 * C, C):scale(0.02 / math.sqrt(2)):detach():requires_grad_(),
  lnf_w = uly.ones(C, { requires_grad = true }), lnf_b = uly.zeros(C, { requires_grad = true }),
}

-- x: i32 [b, t] -> logits [b, t, V]
local function forward(x)
  local b, t = x:size(1), x:size(2)
  local h = uly.embedding(x, P.wte) + P.wpe:narrow(1, 1, t)                 -- [b, t, C]
  local a = uly.layernorm(h, P.ln1_w, P.ln1_b):matmul(P.wqkv)               -- [b, t, 3C]
  local q = a:narrow(3, 1, C):reshape(b, t, H, D)
  local k = a:narrow(3, C + 1, C):reshape(b, t, H, D)
  local v = a:narrow(3, 2 * C + 1, C):reshape(b, t, H, D)
  local att = uly.attention(q, k, v, { causal = true }):reshape(b, t, C)
  h = h + att:matmul(P.wo)
  h = h + uly.layernorm(h, P.ln2_w, P.ln2_b):matmul(P.w1):gelu('tanh'):matmul(P.w2)
  return uly.layernorm(h, P.lnf_w, P.lnf_b):matmul(P.wte:t())               -- tied embedding
end

local function batch()
  local xs, ys = {}, {}
  for r = 1, B do
    local s = math.random(1, #bytes - T - 1)
    local xr, yr = {}, {}
    for j = 0, T - 1 do xr[j + 1] = bytes[s + j]; yr[j + 1] = bytes[s + j + 1] end
    xs[r], ys[r] = xr, yr
  end
  return uly.tensor(xs, { dtype = 'i32' }), uly.tensor(ys, { dtype = 'i32' })
end

-- Adam, in tensor ops under no_grad
local state = {}
for name, p in pairs(P) do state[name] = { m = uly.zeros_like(p), v = uly.zeros_like(p) } end
local function adam_step(step, lr)
  local b1, b2, eps = 0.9, 0.95, 1e-8
  uly.no_grad(function()
    for name, p in pairs(P) do
      local g, s = p.grad, state[name]
      s.m:copy_(s.m * b1 + g * (1 - b1))
      s.v:copy_(s.v * b2 + (g * g) * (1 - b2))
      local mhat, vhat = s.m / (1 - b1 ^ step), s.v / (1 - b2 ^ step)
      p:copy_(p - (mhat / (vhat:sqrt() + eps)) * lr)
      p:zero_grad()
    end
  end)
end

local nparams = 0
for _, p in pairs(P) do nparams = nparams + p:numel() end
print(string.format('ulysses demo: 1-block causal transformer, %d parameters, C=%d H=%d T=%d B=%d, %d bytes of text',
                    nparams, C, H, T, B, #bytes))
local clock = uly.clock
local t0 = clock()
for step = 1, cfg.steps do
  local x, y = batch()
  local logits = forward(x)
  local loss = uly.cross_entropy(logits, y)
  loss:backward()
  local lr = cfg.lr * math.min(1, step / 20)
  adam_step(step, lr)
  if step == 1 or step % 25 == 0 or step == cfg.steps then
    local elapsed = clock() - t0
    print(string.format('step %4d  loss %.4f  lr %.2e  %.0f tok/s  mem %.1f MiB', step, loss:item(), lr,
                        step * B * T / math.max(elapsed, 1e-9), uly.memory().allocated / 2 ^ 20))
  end
end

-- sample with temperature 0.8 and top-k 20
local function sample(prompt, n)
  local ctx = { prompt:byte(1, -1) }
  uly.no_grad(function()
    for _ = 1, n do
      local window = {}
      for j = math.max(1, #ctx - T + 1), #ctx do window[#window + 1] = ctx[j] end
      local logits = forward(uly.tensor({ window }, { dtype = 'i32' }))
      local last = logits:select(2, -1):select(1, 1):scale(1 / 0.8)
      local probs = last:softmax(1):totable()
      local order = {}
      for c = 1, V do order[c] = c end
      table.sort(order, function(a, b2) return probs[a] > probs[b2] end)
      local total = 0
      for r = 1, 20 do total = total + probs[order[r]] end
      local u, acc = math.random() * total, 0
      local pick = order[1]
      for r = 1, 20 do
        acc = acc + probs[order[r]]
        if u <= acc then pick = order[r] break end
      end
      ctx[#ctx + 1] = pick - 1
    end
  end)
  return string.char(unpack(ctx))
end
print('sample: ' .. sample('And God said', cfg.sample):gsub('\n', ' '))
