# bench/peers/torch_models.py — the GPT and Llama of models/ written again in PyTorch, from their
# formulas (functional, float64), to check ours against an independent implementation: the loss
# and every parameter's gradient for weights and tokens that spec/models_torch_spec.lua writes.
#
#   GPT:   h = wte[x] + wpe[:T]; per block h += attn(LN1(h)); h += proj(gelu_tanh(fc(LN2(h))));
#          logits = LN_f(h) wte^T (tied)
#   Llama: h = tok[x]; per layer h += attn(RMS1(h)) with RoPE (interleaved pairs, angle
#          t theta^(-2i/D)) on q and k and grouped K/V heads (query head h reads K/V head
#          h // (H / Hkv)); h += w2(silu(w1 x) * w3 x) of RMS2(h); logits = RMS_f(h) output
#          (or tok^T when tied)
#   attention: softmax(q k^T / sqrt(D)) v where query i sees key j iff j <= i (causal), and
#          i - window <= j with a window, and doc[b, i] == doc[b, j] with document ids (the
#          masks of core/include/uly.h); a Linear's weight is [in, out] as in models/
#   loss: mean cross-entropy over all B T positions
#
# usage: python3 bench/peers/torch_models.py DIR
#   reads  DIR/config.txt (key=value lines), DIR/model.safetensors (the parameters by name, as
#          uly.safetensors.save writes them: read here with json and numpy, from the format's
#          description), DIR/x.i32 and DIR/y.i32 ([B, T] token ids), DIR/doc.i32 ([B, T]
#          document ids) if there is one
#   writes DIR/loss.f64 and DIR/<name>.grad.f64 (raw f64); with greedy=N in the config also
#          DIR/greedy.i32, N tokens that greedy decoding appends to the first prompt= tokens of x's
#          first row (each from a whole forward pass over the prefix, no cache), and
#          DIR/greedy_gap.f64, each step's gap between the two largest logits
import json
import math
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F


def read_config(d):
    cfg = {}
    for line in open(f'{d}/config.txt'):
        k, v = line.strip().split('=', 1)
        cfg[k] = v if k == 'model' else float(v) if '.' in v or 'e' in v else int(v)
    return cfg


def read_params(d):
    """DIR/model.safetensors: u64 header length, JSON header, little-endian data"""
    raw = open(f'{d}/model.safetensors', 'rb').read()
    n = int.from_bytes(raw[:8], 'little')
    header = json.loads(raw[8:8 + n])
    header.pop('__metadata__', None)
    data = raw[8 + n:]
    params = {}
    for name, e in header.items():
        begin, end = e['data_offsets']
        if e['dtype'] == 'F32':
            w = np.frombuffer(data[begin:end], dtype='<f4')
        elif e['dtype'] == 'BF16':
            w = (np.frombuffer(data[begin:end], dtype='<u2').astype(np.uint32) << 16).view(np.float32)
        else:
            raise SystemExit(f'{name}: dtype {e["dtype"]} is not a parameter dtype here')
        w = w.astype(np.float64).reshape(e['shape'])
        params[name] = torch.from_numpy(w).requires_grad_()
    return params


def hidden(T, window, doc):
    """[B or 1, 1, T, T]: True where query i must not see key j"""
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    mask = j > i
    if window is not None:
        mask = mask | (j < i - window)
    mask = mask[None, None]
    if doc is not None:
        mask = mask | (doc[:, None, :, None] != doc[:, None, None, :])
    return mask


def attention(q, k, v, window, doc):
    """q [B, T, H, D], k and v [B, T, Hkv, D] -> [B, T, H * D]"""
    B, T, H, D = q.shape
    k = k.repeat_interleave(H // k.shape[2], dim=2)
    v = v.repeat_interleave(H // v.shape[2], dim=2)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
    s = q @ k.transpose(-1, -2) / math.sqrt(D)
    s = s.masked_fill(hidden(T, window, doc), float('-inf'))
    return (s.softmax(-1) @ v).transpose(1, 2).reshape(B, T, H * D)


def rope(x, theta):
    """x [B, T, H, D]: pair (x[2i], x[2i+1]) at position t rotated by t theta^(-2i/D)"""
    T, D = x.shape[1], x.shape[3]
    freq = theta ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * freq[None, :]
    c, s = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)


def rmsnorm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def self_attention(P, pre, a, cfg, heads, kv_heads, theta=None):
    B, T, C = a.shape
    D = C // heads
    qkv = a @ P[pre + 'wqkv.weight']
    if pre + 'wqkv.bias' in P:
        qkv = qkv + P[pre + 'wqkv.bias']
    qkv = qkv.view(B, T, heads + 2 * kv_heads, D)
    q, k, v = qkv[:, :, :heads], qkv[:, :, heads:heads + kv_heads], qkv[:, :, heads + kv_heads:]
    if theta is not None:
        q, k = rope(q, theta), rope(k, theta)
    y = attention(q, k, v, cfg.get('window'), cfg.get('doc')) @ P[pre + 'proj.weight']
    return y + P[pre + 'proj.bias'] if pre + 'proj.bias' in P else y


def linear(P, pre, x):
    y = x @ P[pre + 'weight']
    return y + P[pre + 'bias'] if pre + 'bias' in P else y


def gpt(P, x, cfg):
    T, C, eps = x.shape[1], cfg['dim'], cfg['eps']
    h = P['wte.weight'][x] + P['wpe.weight'][:T]
    for l in range(1, cfg['layers'] + 1):
        b = f'blocks.{l}.'
        a = F.layer_norm(h, (C,), P[b + 'norm1.weight'], P[b + 'norm1.bias'], eps)
        h = h + self_attention(P, b + 'attn.', a, cfg, cfg['heads'], cfg['heads'])
        m = F.layer_norm(h, (C,), P[b + 'norm2.weight'], P[b + 'norm2.bias'], eps)
        h = h + linear(P, b + 'mlp.proj.', F.gelu(linear(P, b + 'mlp.fc.', m), approximate='tanh'))
    h = F.layer_norm(h, (C,), P['ln_f.weight'], P['ln_f.bias'], eps)
    return h @ P['wte.weight'].t()


def llama(P, x, cfg):
    eps, theta = cfg['eps'], cfg['rope_theta']
    h = P['tok_embeddings.weight'][x]
    for l in range(1, cfg['layers'] + 1):
        b = f'layers.{l}.'
        a = rmsnorm(h, P[b + 'norm1.weight'], eps)
        h = h + self_attention(P, b + 'attn.', a, cfg, cfg['heads'], cfg['kv_heads'], theta)
        m = rmsnorm(h, P[b + 'norm2.weight'], eps)
        h = h + (F.silu(m @ P[b + 'mlp.w1.weight']) * (m @ P[b + 'mlp.w3.weight'])) @ P[b + 'mlp.w2.weight']
    h = rmsnorm(h, P['norm.weight'], eps)
    return h @ (P['tok_embeddings.weight'].t() if cfg['tied'] else P['output.weight'])


def main(d):
    cfg, P = read_config(d), read_params(d)
    x = torch.from_numpy(np.fromfile(f'{d}/x.i32', dtype='<i4').astype(np.int64)).view(cfg['batch'], cfg['seq'])
    y = torch.from_numpy(np.fromfile(f'{d}/y.i32', dtype='<i4').astype(np.int64)).view(cfg['batch'], cfg['seq'])
    if os.path.exists(f'{d}/doc.i32'):
        cfg['doc'] = torch.from_numpy(np.fromfile(f'{d}/doc.i32', dtype='<i4')).view(cfg['batch'], cfg['seq'])
    logits = (gpt if cfg['model'] == 'gpt' else llama)(P, x, cfg)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    loss.backward()
    np.array([loss.item()], dtype='<f8').tofile(f'{d}/loss.f64')
    for name, p in P.items():
        p.grad.numpy().astype('<f8').tofile(f'{d}/{name}.grad.f64')
    if cfg.get('greedy'):
        seq, gaps = x[:1, :cfg['prompt']], []
        cfg.pop('doc', None)
        with torch.no_grad():
            for _ in range(cfg['greedy']):
                last = (gpt if cfg['model'] == 'gpt' else llama)(P, seq, cfg)[0, -1]
                top = last.topk(2).values
                gaps.append((top[0] - top[1]).item())
                seq = torch.cat([seq, last.argmax().view(1, 1)], dim=1)
        seq[0, cfg['prompt']:].numpy().astype('<i4').tofile(f'{d}/greedy.i32')
        np.array(gaps, dtype='<f8').tofile(f'{d}/greedy_gap.f64')


if __name__ == '__main__':
    main(sys.argv[1])
