"""How far each step's amax runs ahead of the delayed recipe's scales (the FP8 linears' saturation).

Runs ``train_throughput.py`` with the given flags (``--fp8-recipe delayed``) and, at every step end,
before the scales are updated, prints for four FP8 linears and each role (input, weight, output
gradient) ``amax_this_step * scale / fp8_max``: above 1, that role's largest elements were
saturated this step by that factor. First it checks the cast kernel against the reference at four
shapes (q, q^T, recorded amax, scale_inv).

    python benchmarks/fp8_delayed_diag.py --device-backend cuda --bf16 --no-log-memory $BIG $PA \\
        --fp8-format hybrid --fp8-recipe delayed --warmup 5 --iters 20
"""

from __future__ import annotations

import sys

import torch
import train_throughput  # benchmarks/, next to this file

import mcore.training.trainer as trainer_module
from mcore.fp8 import scaling as fp8
from mcore.ops import reference


def check_cast_kernel() -> None:
    from mcore.backends.cuda.triton_kernels import fp8_cast

    for shape in [(8192, 8192), (8192, 2048), (2048, 8192), (300, 5000)]:
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16) * 3
        x[17, 33] = 1234.0
        scale = torch.tensor(0.25, device="cuda")
        for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            rec, rec_ref = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
            got = fp8_cast.cast(x, dtype, scale=scale, rowwise=True, columnwise=True, amax_record=rec)
            want = reference.fp8_cast(
                x, dtype, scale=scale, rowwise=True, columnwise=True, amax_record=rec_ref
            )
            same = [torch.equal(g.view(torch.uint8), w.view(torch.uint8)) for g, w in zip(got[:2], want[:2])]
            print(f"cast {shape} {dtype}: q {same[0]}, qT {same[1]}, amax {rec.item()} / {rec_ref.item()}")


def main() -> int:
    check_cast_kernel()
    rows = []
    update = trainer_module.DelayedScaleUpdate.__call__

    def recording_update(self, groups=()):
        names = [name for name, _ in fp8.delayed_states(self.model)]
        row = []
        for i in (0, 1, len(self.states) // 2, len(self.states) - 1):
            name, state = names[i], self.states[i]
            limits = [fp8.fp8_max(state.config.fwd_dtype)] * 2 + [fp8.fp8_max(state.config.bwd_dtype)]
            ratio = [a * s / m for a, s, m in zip(state.pending_amax.tolist(), state.scale.tolist(), limits)]
            row.append(f"{name.split('decoder.')[-1]} {[round(r, 3) for r in ratio]}")
        rows.append(row)
        return update(self, groups)

    trainer_module.DelayedScaleUpdate.__call__ = recording_update
    rc = train_throughput.main(sys.argv[1:])
    for step, row in enumerate(rows):
        print("step", step, "; ".join(row))
    return rc


if __name__ == "__main__":
    sys.exit(main())
