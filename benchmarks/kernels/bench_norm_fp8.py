"""The norm in front of an FP8 linear (``norm_fp8_forward``, the delayed recipe) on one GPU.

Against the unfused CUDA path it replaces: the norm forward kernel (``layer_norm_fwd`` /
``rms_norm_fwd``) writing ``y`` in bf16, then ``fp8_cast`` reading it back and writing ``q`` and
``q^T`` with the given scale, the amax recorded. ``norm_fp8_forward`` runs the norm kernel for the
row statistics only, then a cast that normalises each tile itself (``norm_fp8.py``), so ``y`` is
never written. Also timed apart: the norm kernel writing ``y`` (``norm``) and the statistics alone
(``stats``). The fused and unfused bytes (``q``, ``q^T``, the statistics, the recorded amax) are
checked identical before timing. Times: ``triton.testing.do_bench_cudagraph`` medians, in us.

Shapes: LayerNorm and RMSNorm on [8192, 2048] (the 24L h2048 GPT, 4 x 2048 tokens) and [4096, 4096]
(a Llama-style h4096, 4096 tokens), bf16 in, e4m3 out.

    python benchmarks/kernels/bench_norm_fp8.py [--sweep] [--json FILE]

``--sweep`` times the normalising cast's tile configurations (``CAST_CONFIG``: rows, columns, warps,
programs an SM) on the first two shapes, with the bytes of each checked.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

SHAPES = [
    ("LayerNorm", 8192, 2048),
    ("RMSNorm", 8192, 2048),
    ("LayerNorm", 4096, 4096),
    ("RMSNorm", 4096, 4096),
]
"""(kind, M, K)."""

EPS = 1e-5


def _time_us(fn) -> float:
    import triton.testing

    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=200) * 1000


def _unfused(x, w, b, kind, scale, amax_record):
    from mcore.backends.cuda.triton_kernels import fp8_cast, norms

    if kind == "RMSNorm":
        (y, rstd), mean = norms.rms_norm_fwd(x, w, EPS, x.dtype), None
    else:
        y, mean, rstd = norms.layer_norm_fwd(x, w, b, EPS)
    q, qt, scale_inv = fp8_cast.cast(
        y, torch.float8_e4m3fn, scale=scale, rowwise=True, columnwise=True, amax_record=amax_record
    )
    return q, qt, scale_inv, mean, rstd


def _same(got, want) -> bool:
    """Equal bytes, part by part (None where both are None)."""
    for g, w in zip(got, want, strict=True):
        if (g is None) != (w is None):
            return False
        if g is not None and not torch.equal(
            g.reshape(-1).view(torch.uint8), w.reshape(-1).view(torch.uint8)
        ):
            return False
    return True


def _bench_shape(kind: str, m: int, k: int, gen: torch.Generator, sweep: bool) -> dict:
    """One shape's record: the bytes checked, then the times (and the sweep's best configurations)."""
    from mcore.backends.cuda.triton_kernels import norm_fp8, norms

    dev = gen.device
    x = (torch.randn(m, k, device=dev, generator=gen) * 2 + 0.5).to(torch.bfloat16)
    w = (1 + 0.3 * torch.randn(k, device=dev, generator=gen)).to(torch.bfloat16)
    b = (0.2 * torch.randn(k, device=dev, generator=gen)).to(torch.bfloat16) if kind == "LayerNorm" else None
    scale = torch.tensor(100.0, device=dev)
    slot_unfused, slot_fused = torch.zeros(1, device=dev), torch.zeros(1, device=dev)

    def fused(config=None):
        return norm_fp8.norm_fp8_fwd(
            x, w, b, EPS, kind, torch.float8_e4m3fn, scale, slot_fused, config=config
        )

    def unfused():
        return _unfused(x, w, b, kind, scale, slot_unfused)

    def norm_only():
        return (
            norms.rms_norm_fwd(x, w, EPS, x.dtype)
            if kind == "RMSNorm"
            else norms.layer_norm_fwd(x, w, b, EPS)
        )

    def stats_only():
        return norms.rms_norm_stats(x, EPS) if kind == "RMSNorm" else norms.layer_norm_stats(x, EPS)

    want = unfused()
    if not (_same(fused(), want) and torch.equal(slot_fused, slot_unfused)):
        raise SystemExit(f"{kind} [{m}, {k}]: norm_fp8_forward's bytes differ from the unfused path's")
    rec = {
        "kind": kind,
        "m": m,
        "k": k,
        "unfused_us": round(_time_us(unfused), 1),
        "fused_us": round(_time_us(fused), 1),
        "norm_us": round(_time_us(norm_only), 1),
        "stats_us": round(_time_us(stats_only), 1),
        "config": norm_fp8.CAST_CONFIG,
    }
    if sweep:
        rows = []
        for bm, bk, warps, per_sm in itertools.product((32, 64, 128), (64, 128, 256), (2, 4, 8), (4, 16)):
            if not 8 <= bm * bk // (32 * warps) <= 128:
                continue
            cfg = {"BLOCK_M": bm, "BLOCK_K": bk, "num_warps": warps, "PER_SM": per_sm}
            if not _same(fused(dict(cfg)), want):
                raise SystemExit(f"{kind} [{m}, {k}] {cfg}: bytes differ from the unfused path's")
            rows.append((round(_time_us(lambda cfg=cfg: fused(dict(cfg))), 1), cfg))
        rec["sweep_top"] = sorted(rows, key=lambda r: r[0])[:8]
    return rec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sweep", action="store_true", help="time the normalising cast's tile configurations"
    )
    parser.add_argument("--json", default=None, help="write the records here, one JSON object a line")
    args = parser.parse_args()
    gen = torch.Generator(device=torch.device("cuda")).manual_seed(0)
    records = []
    for index, (kind, m, k) in enumerate(SHAPES):
        rec = _bench_shape(kind, m, k, gen, args.sweep and index < 2)
        print(json.dumps(rec), flush=True)
        records.append(rec)
    if args.json:
        with open(args.json, "w") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in records)


if __name__ == "__main__":
    main()
