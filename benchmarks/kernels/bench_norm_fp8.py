"""The norm writing FP8 (``norm_fp8_forward``) against the norm kernel followed by the cast kernel.

For the 24L h2048 benchmark's norm inputs (tokens 8192; bf16; K = 2048, and 4096 for a wider
model), LayerNorm (with a bias) and RMSNorm, times on one GPU:

* ``unfused``: the norm forward kernel (writes ``y`` bf16 and the statistics), then
  ``fp8_cast(y, scale=..., columnwise=True, amax_record=...)`` (reads ``y``, writes ``q`` and
  ``q^T``, records the amax): the delayed recipe's path before the fusion;
* ``fused``: ``norm_fp8_forward`` (one kernel: the statistics, then ``q``/``q^T`` and the amax).

The fused kernel's bytes are checked equal to the unfused path's first. Bytes are the fewest the
work must move (``x`` read once, ``q`` and ``q^T`` written once: ``4 M K`` for bf16), so ``GB/s``
compares with the copy bandwidth measured in the same run. Times: medians of
``triton.testing.do_bench`` (L2 flushed between repetitions). ``--sweep`` also times row-block,
column-chunk and unroll choices of the fused kernel.

    python benchmarks/kernels/bench_norm_fp8.py [--sweep] [--json FILE]
"""

from __future__ import annotations

import argparse
import json

import torch

TOKENS = 8192
WIDTHS = (2048, 4096)
KINDS = ("LayerNorm", "RMSNorm")


def bench(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--sweep", action="store_true", help="also time tile choices of the fused kernel")
    args = parser.parse_args()

    from mcore.backends.cuda import ops as cuda_ops
    from mcore.backends.cuda.triton_kernels import fp8_cast, norm_fp8, norms

    dev = torch.device("cuda")
    fp8 = torch.float8_e4m3fn
    copy_src = torch.empty(1 << 29, dtype=torch.uint8, device=dev)
    copy_dst = torch.empty_like(copy_src)
    copy_gbs = 2 * copy_src.numel() / bench(lambda: copy_dst.copy_(copy_src)) / 1e6
    print(f"device {torch.cuda.get_device_name()}, copy bandwidth (read + write) {copy_gbs:.0f} GB/s")
    rows = []

    def record(shape, kind, path, ms, moved):
        row = {"shape": shape, "kind": kind, "path": path, "us": ms * 1e3, "GB/s": moved / ms / 1e6}
        row["copy_fraction"] = row["GB/s"] / copy_gbs
        rows.append(row)
        print(
            f"{shape:14s} {kind:9s} {path:34s} {row['us']:7.1f} us {row['GB/s']:6.0f} GB/s "
            f"({row['copy_fraction']:.0%} of copy)",
            flush=True,
        )

    for k in WIDTHS:
        x = torch.randn(TOKENS, k, device=dev, dtype=torch.bfloat16)
        weight = (1 + 0.1 * torch.randn(k, device=dev)).to(torch.bfloat16)
        scale = torch.tensor(60.0, device=dev)
        slot = torch.zeros(1, device=dev)
        moved = 4 * x.numel()  # x read (2 bytes an element), q and q^T written (1 + 1)
        shape = f"[{TOKENS}, {k}]"
        for kind in KINDS:
            bias = torch.randn(k, device=dev, dtype=torch.bfloat16) if kind == "LayerNorm" else None

            def norm(x=x, weight=weight, bias=bias, kind=kind):
                if kind == "LayerNorm":
                    return norms.layer_norm_fwd(x, weight, bias, 1e-5)
                return norms.rms_norm_fwd(x, weight, 1e-5, torch.bfloat16)

            def unfused(norm=norm, scale=scale, slot=slot):
                y = norm()[0]
                return fp8_cast.cast(y, fp8, scale=scale, columnwise=True, amax_record=slot)

            def fused(x=x, weight=weight, bias=bias, kind=kind, scale=scale, slot=slot, config=None):
                return norm_fp8.norm_fp8_fwd(
                    x,
                    weight,
                    bias,
                    1e-5,
                    kind,
                    fp8,
                    scale,
                    slot,
                    rowwise=True,
                    columnwise=True,
                    config=config,
                )

            slot_u, slot_f = torch.zeros(1, device=dev), torch.zeros(1, device=dev)
            want = (
                *fp8_cast.cast(norm()[0], fp8, scale=scale, columnwise=True, amax_record=slot_u),
                *norm()[1:],
            )
            got = cuda_ops.norm_fp8_forward(x, weight, bias, 1e-5, kind, fp8, scale, amax_record=slot_f)
            if kind == "RMSNorm":
                want = (*want[:3], None, want[3])
            equal = all(
                (g is None and w is None)
                or (
                    g is not None
                    and w is not None
                    and torch.equal(g.reshape(-1).view(torch.uint8), w.reshape(-1).view(torch.uint8))
                )
                for g, w in zip((*got, slot_f), (*want, slot_u), strict=True)
            )
            verdict = "equal to" if equal else "DIFFER FROM"
            print(f"{shape} {kind}: the fused bytes {verdict} the unfused path's", flush=True)
            y = norm()[0]
            record(shape, kind, "norm kernel alone (writes y)", bench(norm), 4 * x.numel())
            cast_alone = bench(
                lambda y=y, s=scale, r=slot: fp8_cast.cast(y, fp8, scale=s, columnwise=True, amax_record=r)
            )
            record(shape, kind, "fp8_cast alone (reads y)", cast_alone, moved)
            record(shape, kind, "unfused: norm + fp8_cast", bench(unfused), moved)
            record(shape, kind, "fused: norm_fp8_forward", bench(fused), moved)
            if args.sweep and kind == "LayerNorm":
                warps = norm_fp8._fwd_config(k, None)["num_warps"]
                as_first_run = {
                    "BLOCK_M": 32,
                    "STAT_GROUP": 1,
                    "STAT_UNROLL": 2,
                    "PREFETCH": False,
                    "BLOCK_K": 64 * warps,
                }
                default_bk = norm_fp8._fwd_config(k, None)["BLOCK_K"]
                sweep = {
                    "as first measured (BM 32, group 1, no prefetch, 64 elements a thread)": as_first_run,
                    "group 1, prefetch": {"STAT_GROUP": 1},
                    "group 2, prefetch": {"STAT_GROUP": 2},
                    "no prefetch": {"PREFETCH": False},
                    f"BK {2 * default_bk}": {"BLOCK_K": 2 * default_bk},
                    "BM 16": {"BLOCK_M": 16},
                    "BM 64": {"BLOCK_M": 64},
                }
                for label, cfg in sweep.items():
                    record(shape, kind, f"sweep {label}", bench(lambda c=cfg: fused(config=c)), moved)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_GB/s": copy_gbs, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
