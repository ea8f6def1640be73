"""The MoE grouped GEMM (op ``grouped_gemm``, the CUDA backend's ``torch._grouped_mm`` path) against a
dense GEMM of the same total FLOPs, forward, input gradient (dgrad) and weight gradient (wgrad).

For each expert projection, ``x [N, K]`` (N = tokens x top-k rows, grouped by expert with the counts a
top-k of random router logits gives) times ``weight [E, M, K]``: the grouped forward computes
``2 N K M`` FLOPs, as does the dense ``[N, K] x [K, M]`` product it is compared with; dgrad and wgrad
likewise. The ratio is grouped throughput / dense throughput (issue 39's target: >= 70%).

Shapes (bf16, 8192 tokens): OLMoE-1B-7B (64 experts, top-8, hidden 2048, expert FFN 1024: fc1 with
SwiGLU is ``[64, 2048, 2048]``, fc2 ``[64, 2048, 1024]``) and a Mixtral-shaped small model (8 experts,
top-2, FFN 5632: fc1 ``[8, 11264, 2048]``, fc2 ``[8, 2048, 5632]``). Times are medians of CUDA-event
timed calls after warm-up; the forward is timed through the op (offsets from the counts included),
dgrad and wgrad as the kernel calls its backward makes.

    python benchmarks/moe_grouped_gemm.py [--tokens 8192] [--iters 30] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

MODELS = {
    "olmoe": {"experts": 64, "topk": 8, "hidden": 2048, "ffn": 1024},
    "mixtral_small": {"experts": 8, "topk": 2, "hidden": 2048, "ffn": 5632},
}


def _time_ms(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _counts(tokens: int, experts: int, topk: int, gen: torch.Generator) -> torch.Tensor:
    """Tokens per expert from a top-k of random router logits (close to balanced, never exactly)."""
    logits = torch.randn(tokens, experts, generator=gen, device="cuda")
    chosen = logits.topk(topk, dim=-1).indices.flatten()
    return torch.bincount(chosen, minlength=experts)


def bench_projection(name: str, counts: torch.Tensor, m: int, k: int, iters: int) -> dict:
    """Grouped vs dense GEMM for ``x [N, k]`` by ``weight [E, m, k]``: fwd, dgrad, wgrad."""
    from mcore.backends.cuda.moe import grouped_gemm, grouped_mm_fits

    from mcore.ops import reference

    n, e = int(counts.sum()), counts.numel()
    x = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(e, m, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
    dy = torch.randn(n, m, device="cuda", dtype=torch.bfloat16)
    assert grouped_mm_fits(x, w), f"{name}: the kernel does not serve this shape"
    want = reference.grouped_gemm(x.float(), w.float(), counts)
    err = ((grouped_gemm(x, w, counts).float() - want).norm() / want.norm()).item()
    assert err < 1e-2, f"{name}: grouped GEMM off the reference by {err:.3g}"
    del want
    offs = torch.cumsum(counts, 0, dtype=torch.int32)

    dense_w = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    grouped = {
        "fwd": lambda: grouped_gemm(x, w, counts),  # the op: offsets from the counts, then the kernel
        "dgrad": lambda: torch._grouped_mm(dy, w, offs=offs),
        "wgrad": lambda: torch._grouped_mm(dy.t(), x, offs=offs),
    }
    dense = {
        "fwd": lambda: x @ dense_w.t(),
        "dgrad": lambda: dy @ dense_w,
        "wgrad": lambda: dy.t() @ x,
    }
    flops = 2.0 * n * k * m
    row = {"projection": name, "N": n, "K": k, "M": m, "experts": e, "min_count": int(counts.min())}
    total_g = total_d = 0.0
    for part in ("fwd", "dgrad", "wgrad"):
        tg, td = _time_ms(grouped[part], iters), _time_ms(dense[part], iters)
        total_g, total_d = total_g + tg, total_d + td
        row[part] = {
            "grouped_tflops": flops / tg / 1e9,
            "dense_tflops": flops / td / 1e9,
            "ratio": td / tg,
        }
    row["all"] = {"grouped_ms": total_g, "dense_ms": total_d, "ratio": total_d / total_g}
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--json", default=None, help="write the rows to this file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("moe_grouped_gemm.py needs a CUDA device")
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, {args.tokens} tokens, bf16")
    print(
        f"{'model/projection':<22}{'N':>7}{'K':>6}{'M':>6}  {'part':<6}{'grouped':>9}{'dense':>9}{'ratio':>8}"
    )
    for model, shape in MODELS.items():
        counts = _counts(args.tokens, shape["experts"], shape["topk"], gen)
        h, f = shape["hidden"], shape["ffn"]
        for proj, m, k in (("fc1", 2 * f, h), ("fc2", h, f)):
            row = bench_projection(f"{model}/{proj}", counts, m, k, args.iters)
            rows.append(row)
            for part in ("fwd", "dgrad", "wgrad"):
                r = row[part]
                print(
                    f"{row['projection']:<22}{row['N']:>7}{k:>6}{m:>6}  {part:<6}"
                    f"{r['grouped_tflops']:>9.1f}{r['dense_tflops']:>9.1f}{r['ratio']:>8.1%}"
                )
            a = row["all"]
            print(f"{'':<22}fwd+dgrad+wgrad: grouped {a['grouped_ms']:.3f} ms, dense {a['dense_ms']:.3f} ms, "
                  f"ratio {a['ratio']:.1%}")  # fmt: skip
    worst = min(r["all"]["ratio"] for r in rows)
    print(f"TFLOP/s columns; ratio = dense time / grouped time. Worst fwd+dgrad+wgrad ratio: {worst:.1%} "
          f"(target >= 70%: {'met' if worst >= 0.7 else 'NOT met'})")  # fmt: skip
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(rows, fh, indent=1)
    return rows


if __name__ == "__main__":
    main()
