#!/usr/bin/env python3
"""bench/peers/torch_sdpa.py — the peer for bench/gpu.lua's attention table: cuDNN's fused
attention (and PyTorch's GEMM) on the GPU, called through PyTorch (the GPU image has it; no
binding code of ours). Prints one JSON object per line:
  attention N H D: {"kind": "attention", "N", "H", "D", "backend", "dtype", "fwd_s", "fwd_bwd_s"}
  gemm M N K dtype: {"kind": "gemm", "M", "N", "K", "dtype", "s"}
or {"error": why} when torch, CUDA or the cuDNN backend is missing. Causal attention, batch 1,
bf16 (cuDNN's fused attention takes fp16/bf16 only). Median of `reps` timed runs after a warm-up.
Usage: torch_sdpa.py attention N H D [reps]   |   torch_sdpa.py gemm M N K f32|bf16 [reps]"""
import json
import statistics
import sys


def fail(why):
    print(json.dumps({"error": why}))
    sys.exit(0)


try:
    import torch
except Exception as e:  # noqa: BLE001 - any import failure means no peer
    fail("no torch: %s" % e)
if not torch.cuda.is_available():
    fail("torch sees no CUDA device")


def timed(fn, reps):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def attention(n, h, d, reps):
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except Exception:  # noqa: BLE001
        fail("this torch has no torch.nn.attention.sdpa_kernel")
    q, k, v = (torch.randn(1, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn(1, h, n, d, device="cuda", dtype=torch.bfloat16)
    F = torch.nn.functional.scaled_dot_product_attention
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
        try:
            with sdpa_kernel(backend):
                fwd = timed(lambda: F(q, k, v, is_causal=True), reps)
                both = timed(lambda: F(q, k, v, is_causal=True).backward(g), reps)
            print(json.dumps({"kind": "attention", "N": n, "H": h, "D": d, "backend": str(backend).split(".")[-1],
                              "dtype": "bf16", "fwd_s": fwd, "fwd_bwd_s": both}))
            return
        except Exception as e:  # noqa: BLE001 - try the next backend
            last = str(e).splitlines()[0][:160]
    fail("no fused attention backend ran: %s" % last)


def gemm(m, n, k, dtype, reps):
    dt = torch.bfloat16 if dtype == "bf16" else torch.float32
    torch.backends.cuda.matmul.allow_tf32 = True
    a, b = torch.randn(m, k, device="cuda", dtype=dt), torch.randn(k, n, device="cuda", dtype=dt)
    s = timed(lambda: a @ b, reps)
    print(json.dumps({"kind": "gemm", "M": m, "N": n, "K": k, "dtype": dtype, "s": s}))


if __name__ == "__main__":
    args = sys.argv[1:]
    if len(args) >= 4 and args[0] == "attention":
        attention(int(args[1]), int(args[2]), int(args[3]), int(args[4]) if len(args) > 4 else 3)
    elif len(args) >= 5 and args[0] == "gemm":
        gemm(int(args[1]), int(args[2]), int(args[3]), args[4], int(args[5]) if len(args) > 5 else 3)
    else:
        fail("usage: torch_sdpa.py attention N H D [reps] | gemm M N K f32|bf16 [reps]")
