"""Causal attention forward+backward time per SDPA backend (and flash-attn when installed).

The 24L h2048 s2048 mbs4 config's attention: ``q, k, v [4, 16, 2048, 128]`` bf16, causal. Prints
one line per backend: milliseconds per forward+backward (median of ``triton.testing.do_bench``) and
TFLOP/s with the causal FLOPs ``3.5 * 4 * b * n * s^2 * d / 2`` (forward 2 GEMMs, backward 5).

    python benchmarks/kernels/bench_attention_backends.py [--batch 4 --heads 16 --seq 2048 --dim 128]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--dim", type=int, default=128)
    args = p.parse_args()
    import triton.testing

    shape = (args.batch, args.heads, args.seq, args.dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    flops = 3.5 * 4 * args.batch * args.heads * args.seq**2 * args.dim / 2
    ref = None
    for name, backend in [
        ("flash", SDPBackend.FLASH_ATTENTION),
        ("cudnn", SDPBackend.CUDNN_ATTENTION),
        ("efficient", SDPBackend.EFFICIENT_ATTENTION),
    ]:

        def step(backend=backend):
            with sdpa_kernel([backend]):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            out.backward(dout)
            return out

        try:
            out = step()
            err = None if ref is None else (out - ref).abs().max().item()
            ref = out.detach() if ref is None else ref
            ms = triton.testing.do_bench(step, warmup=10, rep=50)
            print(
                json.dumps(
                    {
                        "backend": name,
                        "ms": round(ms, 3),
                        "tflops": round(flops / ms / 1e9, 1),
                        "max_abs_diff_vs_flash": err,
                    }
                )
            )
        except Exception as e:  # a backend that refuses this shape or device
            print(json.dumps({"backend": name, "error": f"{type(e).__name__}: {str(e)[:200]}"}))


if __name__ == "__main__":
    main()
