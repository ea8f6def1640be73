"""Smoke test of mcore on real Ascend NPUs: the check to run after installing torch_npu.

mcore's CI has no NPU: it tests the NPU backend against a simulated torch_npu. This script runs the
same checks on your hardware, through the same code path a training run takes:

1. ``import mcore.adaptors.npu`` (activates NPU support; logs the patch table it applied);
2. ``--device-backend auto`` must now select the ``npu`` backend, and it must be available;
3. the backend conformance checks of :mod:`mcore.testing.conformance` on one NPU: the interface,
   RNG save/restore, memory statistics, and every op of the table (the CANN fused ops: RMSNorm,
   rotary, SwiGLU, fused attention with causal/padding/document masks and GQA, AdamW, ...) against
   mcore's reference computed on the CPU, forward and gradients, in fp32 and in fp16/bf16 where the
   chip has them;
4. unless ``--no-distributed``: a 2-process HCCL job (all-reduce, all-gather, reduce-scatter,
   broadcast, point-to-point) and 2 steps of a TP=2 GPT training run whose losses must match the CPU
   backend's within ``--training-rtol``.

Usage (one node with at least 2 NPUs)::

    python examples/npu_smoke.py                    # everything; exit status 0 if all checks pass
    python examples/npu_smoke.py --no-distributed   # one NPU only
    python examples/npu_smoke.py --simulated        # the CPU test double (what CI runs), no NPU needed

Report failures with the full output and ``pip show torch torch-npu`` plus the CANN version.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
import traceback

import torch


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--simulated", action="store_true", help="use the simulated torch_npu (no NPU needed)"
    )
    parser.add_argument("--no-distributed", action="store_true", help="skip the 2-process checks")
    parser.add_argument(
        "--training-rtol", type=float, default=1e-3, help="relative loss tolerance against the CPU backend"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")

    rank_setup = None
    if args.simulated:
        from mcore.backends.npu import simulated

        simulated.install()
        rank_setup = simulated.install
        print("NOTE: running on the SIMULATED torch_npu (a CPU test double), not on an NPU")

    import mcore.adaptors.npu  # noqa: F401  (activates NPU support, as a training script would)

    from mcore.plugins.manager import select_backend
    from mcore.testing import conformance

    backend = select_backend("auto")
    ok, why = backend.is_available()
    print(f"backend {backend.name}: {why}")
    print(f"capabilities: {', '.join(sorted(backend.capabilities()))}")
    for name, entry in backend.ops:
        print(f"  op {name:<22} {entry.provider}")
    if backend.name != "npu":
        print(f"FAIL: 'auto' selected {backend.name!r} after importing mcore.adaptors.npu")
        return 1

    checks: list[tuple[str, object]] = [
        ("interface", lambda: conformance.check_interface(backend)),
        ("rng save/restore", lambda: conformance.check_rng(backend)),
        ("memory statistics", lambda: conformance.check_memory_stats(backend)),
    ]
    caps = backend.capabilities()
    for case in conformance.OP_CASES:
        for dtype in case.dtypes:
            if dtype == torch.float32 or {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype] in caps:
                checks.append(
                    (
                        f"op {case.name} {str(dtype)[6:]}",
                        lambda c=case, d=dtype: conformance.check_op(backend, c, d),
                    )
                )
    if not args.no_distributed:
        checks.append(
            ("2-process HCCL collectives", lambda: conformance.check_collectives("npu", rank_setup))
        )
        checks.append(
            (
                "TP=2 training, 2 steps, losses vs CPU",
                lambda: print(
                    "    losses (npu, cpu):",
                    conformance.check_training("npu", rank_setup, args.training_rtol),
                ),
            )
        )

    failures = 0
    for label, check in checks:
        start = time.perf_counter()
        try:
            check()
        except Exception as err:  # report every check, then fail
            failures += 1
            print(f"FAIL {label}: {err}")
            if not isinstance(err, AssertionError):
                traceback.print_exc()
        else:
            print(f"ok   {label} ({time.perf_counter() - start:.2f}s)")
    print(
        f"\n{len(checks) - failures} of {len(checks)} checks passed"
        + (" (SIMULATED)" if args.simulated else "")
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
