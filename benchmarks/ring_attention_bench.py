"""Ring attention's overhead on one GPU: the CP=2 attention of one rank pair, emulated as sequential
blocks, against the unsplit causal attention of the whole sequence (the same work).

A causal sequence of ``--seq`` tokens is cut into 4 chunks (zigzag, as ``--context-parallel-size 2``
lays it out): rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2. Each rank's ring has two steps:

* step 0, its own keys: ``attention_with_lse`` causal over its two chunks (``sq == sk``);
* step 1, the other rank's keys: rank 0's chunk 3 sees both of rank 1's chunks, rank 1's chunks see
  rank 0's chunk 0 (``causal=False``); the partial merged into step 0's rows with ``attention_merge``.

The backward runs ``attention_with_lse_backward`` per block from the merged ``out``/``lse`` (the ``dq``
of a rank's rows summed). Both ranks' blocks run one after the other on one GPU; no communication.
The baseline is ``attention_with_lse`` + its backward over the whole sequence (one causal kernel
call each way). Prints one JSON line: milliseconds (median of CUDA-event-timed repeats) of each,
their ratio (``ring / unsplit``; the target is within 1.10), and the time in the merges. The shape
defaults to Llama-3-8B's attention at 32k: 32 query heads, 8 KV heads, head dim 128, bf16.

    python benchmarks/ring_attention_bench.py [--seq 32768 --heads 32 --kv-heads 8 --dim 128]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch


def _time(fn, warmup: int, repeats: int) -> float:
    """Median milliseconds of ``fn`` over ``repeats`` CUDA-event-timed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _rank_blocks(c: int):
    """Per rank: (its chunks, the other rank's chunks, step 1's query rows and key rows, local)."""
    return [
        ((0, 3), (1, 2), slice(c, 2 * c), slice(0, 2 * c)),
        ((1, 2), (0, 3), slice(0, 2 * c), slice(0, c)),
    ]


def _gather(t: torch.Tensor, chunks, c: int) -> torch.Tensor:
    return torch.cat([t[:, :, i * c : (i + 1) * c] for i in chunks], dim=2)


def make_ring(ops, q, k, v, dout, c: int):
    """The emulated CP=2 ring, forward and backward of both ranks, as one callable."""
    ranks = []
    for mine, theirs, rows, keys in _rank_blocks(c):
        ranks.append(
            (
                _gather(q, mine, c), _gather(k, mine, c), _gather(v, mine, c),
                _gather(k, theirs, c)[:, :, keys].contiguous(), _gather(v, theirs, c)[:, :, keys].contiguous(),
                _gather(dout, mine, c), rows,
            )
        )  # fmt: skip

    def ring():
        for ql, kl, vl, kr, vr, do, rows in ranks:
            out, lse = ops.attention_with_lse(ql, kl, vl, causal=True)
            qr = ql[:, :, rows]
            part = ops.attention_with_lse(qr, kr, vr, causal=False)
            merged = ops.attention_merge(out[:, :, rows], lse[:, :, rows], *part)
            out[:, :, rows], lse[:, :, rows] = merged
            dq, dk, dv = ops.attention_with_lse_backward(do, ql, kl, vl, out, lse, causal=True)
            dqr, dkr, dvr = ops.attention_with_lse_backward(
                do[:, :, rows], qr, kr, vr, out[:, :, rows], lse[:, :, rows], causal=False
            )
            dq[:, :, rows] += dqr

    # the merges alone, on inputs of the ring's shapes (rank 0 merges its late chunk's rows, rank 1 all)
    merge_inputs = []
    for ql, *_, rows in ranks:
        o = torch.randn_like(ql[:, :, rows])
        lse = torch.randn(o.shape[:3], device=o.device)
        merge_inputs.append((o, lse, o.clone(), lse.clone()))

    def merges_only():
        for inputs in merge_inputs:
            ops.attention_merge(*inputs)

    return ring, merges_only


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args()
    if args.seq % 4:
        p.error(f"--seq {args.seq} must be divisible by 4 (2 * context-parallel size 2)")
    from mcore.plugins.manager import select_backend

    ops = select_backend("cuda").ops
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(heads):
        shape = (args.batch, heads, args.seq, args.dim)
        return torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)

    q, k, v, dout = randn(args.heads), randn(args.kv_heads), randn(args.kv_heads), randn(args.heads)

    def unsplit():
        out, lse = ops.attention_with_lse(q, k, v, causal=True)
        ops.attention_with_lse_backward(dout, q, k, v, out, lse, causal=True)

    ring, merges = make_ring(ops, q, k, v, dout, args.seq // 4)
    unsplit_ms = _time(unsplit, args.warmup, args.repeats)
    ring_ms = _time(ring, args.warmup, args.repeats)
    merge_ms = _time(merges, args.warmup, args.repeats)
    flops = 3.5 * 4 * args.batch * args.heads * args.seq**2 * args.dim / 2  # causal fwd (2 GEMMs) + bwd (5)
    print(
        json.dumps(
            {
                "device": torch.cuda.get_device_name(),
                "torch": torch.__version__,
                "shape": {
                    "batch": args.batch,
                    "seq": args.seq,
                    "heads": args.heads,
                    "kv_heads": args.kv_heads,
                    "dim": args.dim,
                    "dtype": "bf16",
                },
                "providers": {
                    op: ops.provider(op)
                    for op in ("attention_with_lse", "attention_with_lse_backward", "attention_merge")
                },
                "unsplit_ms": round(unsplit_ms, 3),
                "ring_cp2_ms": round(ring_ms, 3),
                "ratio": round(ring_ms / unsplit_ms, 4),
                "merges_ms": round(merge_ms, 3),
                "unsplit_tflops": round(flops / unsplit_ms / 1e9, 1),
            }
        )  # fmt: skip
    )


if __name__ == "__main__":
    main()
