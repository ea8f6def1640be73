"""The FP8 linears' per-tensor casts on one GPU: the Triton kernels against the previous Inductor path.

For each operand shape of the 24L h2048 benchmark's linears (tokens 8192; bf16), times the work one
current-scaling (tensorwise) cast does, all on the device:

* ``inductor``: the previous path: ``vector_norm(x, inf)`` for the amax, the scale arithmetic in
  eager element-wise ops (``scale_from_amax`` and its reciprocal), then the cast and its transpose as
  one Inductor kernel (``torch.compile`` of the reference, dynamic shapes);
* ``triton``: ``fp8_amax`` (one kernel) and ``fp8_cast(amax=...)`` (one kernel forming the scale,
  writing ``q`` and ``q^T``);
* ``triton-delayed``: ``fp8_cast(scale=..., amax_record=...)``: the delayed recipe, the amax taken
  during the cast (one kernel);

and, for the weights, the backward's transposed-only cast. Bytes are the fewest the work must move
(the input read once, each FP8 output written once), so ``GB/s`` compares with the copy bandwidth
measured in the same run. Times: medians of ``triton.testing.do_bench`` (L2 flushed).

    python benchmarks/kernels/bench_fp8_cast.py [--json FILE] [--sweep] [--dbias]

``--dbias`` times only the output gradient's cast with its bias gradient (``fp8_cast_dbias``,
each of its tuned block shapes) against the cast plus ``x.sum(0)``.
"""

from __future__ import annotations

import argparse
import json

import torch

TOKENS = 8192
SHAPES = {
    "x qkv/fc1 in [8192, 2048]": (TOKENS, 2048),
    "x fc2 in [8192, 8192]": (TOKENS, 8192),
    "dy qkv [8192, 6144]": (TOKENS, 6144),
    "dy fc1 [8192, 8192]": (TOKENS, 8192),
    "w fc1 [8192, 2048]": (8192, 2048),
}


def bench(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--sweep", action="store_true", help="also time tile shapes of the cast kernel")
    parser.add_argument(
        "--dbias", action="store_true", help="only the output gradient's cast with its bias gradient"
    )
    args = parser.parse_args()

    from mcore.backends.cuda.fp8 import linear as cuda_fp8

    from mcore.ops import reference

    dev = torch.device("cuda")
    fp8 = torch.float8_e4m3fn
    copy_src = torch.empty(1 << 29, dtype=torch.uint8, device=dev)
    copy_dst = torch.empty_like(copy_src)
    copy_ms = bench(lambda: copy_dst.copy_(copy_src))
    copy_gbs = 2 * copy_src.numel() / copy_ms / 1e6
    print(f"copy bandwidth (read + write) {copy_gbs:.0f} GB/s")

    def quantize_transpose(x, scale, dtype):  # the previous op fp8_quantize_transpose
        return reference.fp8_quantize(x, scale, dtype), reference.fp8_quantize(x.t(), scale, dtype)

    if args.dbias:
        rows = bench_dbias(copy_gbs)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        return
    compiled = torch.compile(quantize_transpose, dynamic=True, fullgraph=True)
    rows = []
    for name, (m, k) in SHAPES.items():
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        scale = torch.tensor(3.0, device=dev)
        record = torch.zeros(1, device=dev)

        def inductor(x=x):
            amax = torch.linalg.vector_norm(x, float("inf")).float()
            s = reference.fp8_scale_from_amax(amax, fp8, 0)
            s.reciprocal()
            return compiled(x, s, fp8)

        def triton_cast(x=x):
            return cuda_fp8.fp8_cast(x, fp8, amax=cuda_fp8.fp8_amax(x), columnwise=True)

        def triton_delayed(x=x, scale=scale, record=record):
            return cuda_fp8.fp8_cast(x, fp8, scale=scale, columnwise=True, amax_record=record)

        def triton_transpose_only(x=x, scale=scale):
            return cuda_fp8.fp8_cast(x, fp8, scale=scale, rowwise=False, columnwise=True)

        want = inductor()
        got = triton_cast()
        assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)), name
        assert torch.equal(got[1].view(torch.uint8), want[1].view(torch.uint8)), name
        nbytes = x.numel() * x.element_size()
        for label, fn, moved in (
            ("inductor", inductor, 2 * nbytes + 2 * x.numel()),  # amax read + cast read, q + qT
            ("triton", triton_cast, 2 * nbytes + 2 * x.numel()),
            ("triton-delayed", triton_delayed, nbytes + 2 * x.numel()),
            ("triton-transpose-only", triton_transpose_only, nbytes + x.numel()),
        ):
            ms = bench(fn)
            row = {"shape": name, "path": label, "ms": ms, "GB/s": moved / ms / 1e6, "copy_GB/s": copy_gbs}
            rows.append(row)
            print(
                f"{name:28s} {label:22s} {ms * 1e3:8.1f} us  {row['GB/s']:6.0f} GB/s ({row['GB/s'] / copy_gbs:.0%} of copy)"
            )
    if args.sweep:
        from mcore.backends.cuda.triton_kernels import fp8_cast as kernels

        for m, k in ((TOKENS, 2048), (TOKENS, 8192)):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            scale = torch.tensor(3.0, device=dev)
            for bm, bk, warps in ((64, 64, 4), (64, 128, 4), (128, 64, 4), (128, 128, 4), (128, 128, 8),
                                  (64, 256, 4), (64, 256, 8), (256, 64, 8), (128, 256, 8), (256, 128, 8)):  # fmt: skip
                cfg = {"BLOCK_M": bm, "BLOCK_K": bk, "num_warps": warps}
                ms = bench(
                    lambda x=x, scale=scale, cfg=cfg: kernels.cast(
                        x, fp8, scale=scale, columnwise=True, config=cfg
                    )
                )
                gbs = 2 * x.numel() * 2 / ms / 1e6
                print(f"sweep [{m}, {k}] {bm}x{bk} warps {warps}: {ms * 1e3:7.1f} us {gbs:6.0f} GB/s")
                rows.append(
                    {"shape": f"[{m}, {k}]", "path": f"sweep {bm}x{bk}/{warps}", "ms": ms, "GB/s": gbs}
                )
    if args.sweep:  # the amax-recording cast: programs per SM of its grid-strided loop
        from mcore.backends.cuda.triton_kernels import fp8_cast as kernels

        x = torch.randn(TOKENS, 8192, device=dev, dtype=torch.bfloat16)
        scale, record = torch.tensor(3.0, device=dev), torch.zeros(1, device=dev)
        default = kernels.PROGRAMS_PER_SM
        for per_sm in (2, 4, 8, 16, 10**6):
            kernels.PROGRAMS_PER_SM = per_sm
            ms = bench(lambda: kernels.cast(x, fp8, scale=scale, columnwise=True, amax_record=record))
            print(f"sweep recording cast [{TOKENS}, 8192] programs/SM {per_sm}: {ms * 1e3:7.1f} us")
            rows.append({"shape": f"[{TOKENS}, 8192]", "path": f"sweep record {per_sm}/SM", "ms": ms})
        kernels.PROGRAMS_PER_SM = default
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


def bench_dbias(copy_gbs: float) -> list[dict]:
    """``--dbias``: the QKV output gradient's delayed-recipe cast (e5m2, ``q`` and ``q^T``, the amax
    recorded) with its bias gradient: ``fp8_cast`` plus torch's ``x.sum(0)`` (the previous backward)
    against ``fp8_cast_dbias`` (tuned at its first call) and each of its block shapes."""
    rows = []
    for name, (m, k) in (("dy qkv [8192, 6144]", (TOKENS, 6144)), ("dy fc1 [8192, 8192]", (TOKENS, 8192))):
        rows += _bench_dbias_shape(name, m, k, copy_gbs)
    return rows


def _bench_dbias_shape(name: str, m: int, k: int, copy_gbs: float) -> list[dict]:
    from mcore.backends.cuda.fp8 import linear as cuda_fp8
    from mcore.backends.cuda.triton_kernels import fp8_cast as kernels

    dev, fp8, rows = torch.device("cuda"), torch.float8_e5m2, []
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    scale, record = torch.tensor(3.0, device=dev), torch.zeros(1, device=dev)
    args = dict(scale=scale, rowwise=True, columnwise=True, amax_record=record)
    q, qT, _ = cuda_fp8.fp8_cast(x, fp8, **args)
    q2, qT2, _, dbias = cuda_fp8.fp8_cast_dbias(x, fp8, **args)
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)), name
    assert torch.equal(qT.view(torch.uint8), qT2.view(torch.uint8)), name
    exact = x.double().sum(0)
    err = ((dbias.double() - exact).abs() / exact.abs().clamp(min=1.0)).max().item()
    print(f"{name}: bytes equal to fp8_cast, dbias max rel error {err:.2e} (bf16 eps 7.8e-3)")
    moved = x.numel() * x.element_size() + 2 * x.numel()  # x read once, q and qT written
    paths = [
        ("fp8_cast + sum(0)", lambda: (cuda_fp8.fp8_cast(x, fp8, **args), x.sum(0))),
        ("fp8_cast alone", lambda: cuda_fp8.fp8_cast(x, fp8, **args)),
        ("fp8_cast_dbias (tuned)", lambda: cuda_fp8.fp8_cast_dbias(x, fp8, **args)),
    ]
    for cfg in kernels._DBIAS_CONFIGS:
        label = "dbias {BLOCK_M}x{BLOCK_K}/{num_warps} 2d={SUM_2D} per_sm={PER_SM}".format(**cfg)
        paths.append((label, lambda cfg=cfg: kernels.cast_dbias(x, fp8, **args, config=cfg)))
    for label, fn in paths:
        ms = bench(fn)
        row = {"shape": name, "path": label, "ms": ms, "GB/s": moved / ms / 1e6, "copy_GB/s": copy_gbs}
        rows.append(row)
        print(f"{name:22s} {label:40s} {ms * 1e3:8.1f} us  {row['GB/s'] / copy_gbs:.0%} of copy")
    return rows


if __name__ == "__main__":
    main()
