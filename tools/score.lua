-- tools/score.lua — how well a trained model predicts given sequences: each input's log-likelihood,
-- bits per token and perplexity under a model from a run directory, checkpoint or safetensors file
-- (uly.pretrained.load), read through its context window by sliding windows.
--
--   bin/ulysses tools/score.lua SOURCE [FILE ...] [--text STRING ...] [--split valid] [--strands both] [--stride S] [--batch B]
--     [--per_token OUT.tsv] [--device cpu|cuda] [--precision auto|f32|bf16] [--kind text|dna] [--data H5]
--
-- FILE: for a text model the whole file is one sequence (its bytes); for a DNA model a FASTA or
-- GenBank file, one sequence per record (gzip, xz and bzip2 read as such, as datasets/prepare.lua
-- reads them). --text scores a string given on the command line (repeatable); --split valid the
-- whole validation split of the training data file as one sequence (train.lua evaluates a few
-- batches of it).
-- What is scored: text, every token after the first (the first has nothing before it); DNA, every
-- base of a record, the first seen after the record separator '|' that the training data puts
-- between records.
-- Windows: a sequence that fits the context length T is one forward pass. A longer one is read in
-- windows of T: the first scores all its tokens, each later window starts S tokens on (--stride,
-- default T/2; the last ends at the sequence's end) and scores only the tokens after the previous
-- window's, so every token is scored once, with at least T - S tokens before it (or all there are).
-- --strands both scores each DNA record and --text also as its reverse complement (the other
-- strand read 5' to 3'), in a row of its own named NAME [rc].
-- --per_token writes every scored token as a tab-separated line: input, position (1-based in the
-- input's tokens), token, nats (its negative log-likelihood).
local uly = require 'ulysses'
local ffi = require 'ffi'
local cli = require 'ulysses.cli'

local TOOL = 'tools/score.lua'
local FLAGS = cli.flags({
  { 'text', {}, 'a string to score' },
  { 'split', '', 'valid | train: score that split of the training data file (--data, else the one the checkpoint names)' },
  { 'strands', 'forward', 'forward | both: DNA records and --text also as their reverse complement (a row NAME [rc] each)' },
  { 'stride', 0, 'tokens between window starts for sequences longer than the context (0 = half the context)' },
  { 'batch', 8, 'windows per forward pass' },
  { 'per_token', '', 'write each scored token (input, position, token, nats) to this TSV file' },
}, uly.pretrained.LOAD_FLAGS)
local USAGE = 'bin/ulysses tools/score.lua SOURCE [FILE ...] [--text STRING ...] [--flag value ...]\n'
  .. '  SOURCE: a train.lua run directory, a checkpoint (.h5) or a safetensors file'

local function fail(msg) cli.fail(TOOL, msg) end
local clean = cli.clean

local cfg, inputs = cli.parse(TOOL, arg, FLAGS, USAGE)
if #inputs == 0 then fail('no model given: the first argument is a run directory, checkpoint or safetensors file (--help)') end
if #inputs == 1 and #cfg.text == 0 and cfg.split == '' then
  fail('nothing to score: give files after the model, --text STRING, or --split valid')
end
if cfg.split ~= '' and cfg.split ~= 'valid' and cfg.split ~= 'train' then
  fail("--split must be valid or train, got '" .. cfg.split .. "'")
end
if cfg.strands ~= 'forward' and cfg.strands ~= 'both' then
  fail("--strands must be forward or both, got '" .. cfg.strands .. "'")
end
if cfg.batch < 1 or cfg.batch % 1 ~= 0 then fail('--batch must be an integer >= 1, got ' .. cfg.batch) end
if cfg.stride < 0 or cfg.stride % 1 ~= 0 then fail('--stride must be an integer >= 0, got ' .. cfg.stride) end

local model, info = uly.pretrained.load_for_tool(TOOL, inputs[1], cfg)
local codec, T = info.codec, model.config.seq
local S = cfg.stride > 0 and cfg.stride or math.max(1, math.floor(T / 2))
if S > T then fail(string.format('--stride %d is longer than the context %d: tokens between windows would go unscored', S, T)) end

-- the sequences: {name, p (int32 tokens), n}
local seqs = {}
local function add(name, src, n, lead)
  local p = ffi.new('int32_t[?]', n + (lead and 1 or 0))
  local k = 0
  if lead then p[0] = lead; k = 1 end
  for i = 0, n - 1 do p[k + i] = src[i] end
  seqs[#seqs + 1] = { name = name, p = p, n = n + k, lead = k }
  -- --strands both: the reverse complement too (A<->T, C<->G, N as it is), after the same separator
  if lead and cfg.strands == 'both' then
    local rc = ffi.new('int32_t[?]', n + 1)
    rc[0] = lead
    for i = 0, n - 1 do
      local t = src[n - 1 - i]
      rc[1 + i] = t <= 3 and 3 - t or t
    end
    seqs[#seqs + 1] = { name = name .. ' [rc]', p = rc, n = n + 1, lead = 1 }
  end
end
local SEP = codec.kind == 'dna' and uly.data.DNA.SEP or nil
if cfg.strands == 'both' and not SEP then fail('--strands both: a DNA model only (this one reads text)') end
local prepare = dofile((require 'ulysses.ffi').root .. '/datasets/prepare.lua')
local NOT_INPUT = {
  directory = 'is a directory: give the files in it',
  hdf5 = 'is an HDF5 file (a dataset or checkpoint), not a sequence: the model comes first; --split valid scores its '
    .. 'training data',
  safetensors = 'is a safetensors file of weights, not a sequence: the model comes first',
}
for i = 2, #inputs do
  local ok_k, what = pcall(prepare.sniff, inputs[i])
  if not ok_k then fail((clean(what):gsub('^prepare: ', ''))) end
  if NOT_INPUT[what] then fail(inputs[i] .. ' ' .. NOT_INPUT[what]) end
  local ok_r, buf, recs = pcall(prepare.read_tokens, codec.kind, { inputs[i] })
  if not ok_r then fail((clean(buf):gsub('^prepare: ', ''))) end
  if recs then
    for _, r in ipairs(recs) do add(inputs[i] .. ':' .. r.name, buf.p + r.start, r.len, SEP) end
  else
    add(inputs[i], buf.p, buf.n)
  end
end
if cfg.split ~= '' then   -- the split as one sequence, as the trainer's evaluation reads it
  if not info.data_path then
    fail('--split ' .. cfg.split .. ': the data the model was trained on is not found (give --data FILE)')
  end
  local f = uly.h5.open(info.data_path, 'r')
  local ok_s, toks = pcall(f.read, f, cfg.split)   -- u8 tokens read as i32
  f:close()
  if not ok_s then fail(string.format('--split %s: %s', cfg.split, clean(toks))) end
  if toks:numel() < 2 then fail(string.format('--split %s: %s holds %d tokens of it', cfg.split, info.data_path, toks:numel())) end
  add(info.data_path .. ':' .. cfg.split, ffi.cast('int32_t *', toks:data()), toks:numel())
end
for i, s in ipairs(cfg.text) do
  local ok_e, t = pcall(codec.encode, codec, s)
  if not ok_e then fail(string.format('--text %d: %s', i, clean(t))) end
  add('--text ' .. i, ffi.cast('int32_t *', t:data()), t:numel(), SEP)
end

local per_token
if cfg.per_token ~= '' then
  local err
  per_token, err = io.open(cfg.per_token, 'w')
  if not per_token then fail('--per_token: ' .. tostring(err)) end
  per_token:write('input\tposition\ttoken\tnats\n')
end

-- windows {start (0-based), len (inputs), first (first target scored, 0-based offset in the window)}
local function windows_of(n)
  local targets = n - 1
  if targets <= T then return { { start = 0, len = targets, first = 0 } } end
  local out, done, s = {}, 0, 0   -- done: targets scored so far (targets 1..done)
  while done < targets do
    local last = s + T             -- this window's last target (0-based token index)
    out[#out + 1] = { start = s, len = T, first = done - s }
    done = last
    s = math.min(s + S, targets - T)
  end
  return out
end

-- a token for the TSV: DNA letters as they are, text bytes with tab, newline, backslash and
-- control bytes escaped (\t, \n, \\, \xHH)
local function shown(tok)
  local c = codec:decode({ tok })
  if codec.kind == 'dna' then return c end
  if c == '\t' then return '\\t' elseif c == '\n' then return '\\n' elseif c == '\\' then return '\\\\' end
  if tok < 32 or tok >= 127 then return string.format('\\x%02X', tok) end
  return c
end

local device = model:parameters()[1]:device()
local function score(seq)
  local total, count = 0, 0
  if seq.n < 2 then return total, count end   -- nothing to predict
  local wins = windows_of(seq.n)
  for b = 1, #wins, cfg.batch do
    local group = {}
    for j = b, math.min(b + cfg.batch - 1, #wins) do group[#group + 1] = wins[j] end
    local B, L = #group, group[1].len
    local x = uly.empty({ B, L }, { dtype = 'i32' })
    local y = uly.empty({ B, L }, { dtype = 'i32' })
    local xp, yp = ffi.cast('int32_t *', x:data()), ffi.cast('int32_t *', y:data())
    for r, w in ipairs(group) do
      ffi.copy(xp + (r - 1) * L, seq.p + w.start, L * 4)
      ffi.copy(yp + (r - 1) * L, seq.p + w.start + 1, L * 4)
    end
    local losses = uly.no_grad(function()
      return model:loss(x:to(device), y:to(device), { reduction = 'none' }):to { dtype = 'f64', device = 'cpu' }:contiguous()
    end)
    local lp = ffi.cast('double *', losses:data())
    for r, w in ipairs(group) do
      for k = w.first, L - 1 do
        local v = lp[(r - 1) * L + k]
        total, count = total + v, count + 1
        if per_token then
          local pos = w.start + k + 2 - seq.lead   -- the target's place among the input's own tokens
          per_token:write(string.format('%s\t%d\t%s\t%.6f\n', seq.name, pos, shown(yp[(r - 1) * L + k]), v))
        end
      end
    end
  end
  return total, count
end

print(info.summary)
print(string.format('windows of %d tokens, stride %d; %s', T, S, info.kind == 'dna'
                    and 'every base of a record or --text scored, the first after the record separator'
                        .. (cfg.split ~= '' and ' (--split: every token after the first)' or '')
                    or 'every token after the first scored'))
local width = 5
for _, s in ipairs(seqs) do width = math.max(width, #s.name) end
print(string.format('%-' .. width .. 's  %10s  %14s  %10s  %10s  %10s', 'input', 'tokens', 'nats', 'nats/token',
                    'bits/token', 'perplexity'))
local all_total, all_count = 0, 0
local function row(name, total, count)
  if count == 0 then
    print(string.format('%-' .. width .. 's  %10d  %14s  %10s  %10s  %10s', name, 0, '-', '-', '-', '-'))
    return
  end
  local m = total / count
  print(string.format('%-' .. width .. 's  %10d  %14.4f  %10.5f  %10.5f  %10.4f', name, count, total, m, m / math.log(2), math.exp(m)))
end
for _, s in ipairs(seqs) do
  local total, count = score(s)
  row(s.name, total, count)
  all_total, all_count = all_total + total, all_count + count
end
if #seqs > 1 then row('all', all_total, all_count) end
if per_token then
  per_token:close()
  print('per-token scores: ' .. cfg.per_token)
end
