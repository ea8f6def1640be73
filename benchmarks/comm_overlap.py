"""How much of each collective's device time runs beside compute kernels, from profiler traces.

Reads Chrome traces written by ``train_throughput.py --profile-steps N --profile-trace FILE`` (one a
rank: ``FILE.rank0.json``, ...). A kernel whose name contains ``--comm-pattern`` (``nccl`` by
default) is a collective; every other kernel is compute. The *main stream* is the stream with the
most compute kernels: collectives issued there (the synchronous ones) can only run between compute
kernels, while those on other streams (the asynchronous ones, e.g. the sequence-parallel backward's
all-gather and reduce-scatter) can run under them. For each kind of collective and stream class it
prints the count, the summed kernel time, and the part of that time during which some compute kernel
ran (the union of compute intervals on any stream). A collective's kernel time includes waiting for
its peers, so a rank that arrives early shows long collectives. ::

    python benchmarks/comm_overlap.py trace.rank0.json trace.rank1.json
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json

KINDS = ("AllGather", "ReduceScatter", "AllReduce", "Broadcast", "SendRecv", "Send", "Recv")


def merged_intervals(spans: list[tuple[float, float]]) -> list[list[float]]:
    """The union of ``[start, end)`` spans as disjoint sorted intervals."""
    merged: list[list[float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def covered(intervals: list[list[float]], starts: list[float], a: float, b: float) -> float:
    """Length of ``[a, b)`` inside ``intervals`` (disjoint, sorted; ``starts`` their starts)."""
    i, total = max(0, bisect.bisect_right(starts, a) - 1), 0.0
    while i < len(intervals) and intervals[i][0] < b:
        total += max(0.0, min(b, intervals[i][1]) - max(a, intervals[i][0]))
        i += 1
    return total


def overlap_table(trace: dict, pattern: str) -> dict[str, list[float]]:
    """``{"<kind> <main|side>-stream": [kernels, us, us beside compute]}`` for one trace."""
    kernels = [e for e in trace["traceEvents"] if e.get("cat") == "kernel" and e.get("ph") == "X"]
    is_comm = [pattern in e["name"].lower() for e in kernels]
    compute = [e for e, c in zip(kernels, is_comm) if not c]
    if not compute:
        return {}
    main = collections.Counter(e["args"].get("stream") for e in compute).most_common(1)[0][0]
    intervals = merged_intervals([(e["ts"], e["ts"] + e["dur"]) for e in compute])
    starts = [i[0] for i in intervals]
    table: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for e, comm in zip(kernels, is_comm):
        if not comm:
            continue
        kind = next((k for k in KINDS if k in e["name"]), e["name"][:40])
        where = "main-stream" if e["args"].get("stream") == main else "side-stream"
        row = table[f"{kind} {where}"]
        row[0] += 1
        row[1] += e["dur"]
        row[2] += covered(intervals, starts, e["ts"], e["ts"] + e["dur"])
    return dict(table)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="+")
    p.add_argument("--comm-pattern", default="nccl", help="lower-case substring of collective kernel names")
    a = p.parse_args(argv)
    for path in a.traces:
        with open(path) as f:
            table = overlap_table(json.load(f), a.comm_pattern)
        print(path)
        for name, (count, us, beside) in sorted(table.items()):
            share = beside / us if us else 0.0
            print(
                f"  {name:28s} {count:5d} kernels {us / 1e3:9.2f} ms, {beside / 1e3:8.2f} ms beside compute ({share:.0%})"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
