"""The CUDA backend's ``fp8_quantize_flat`` / ``fp8_dequantize_flat`` kernels under Triton's CPU interpreter.

Through the CUDA dispatchers (counted: they must launch the kernels, not fall back to the reference),
with tiles of 64 elements, against the per-weight code ``Fp8ParamGather`` ran before the ops (one
``fp8_quantize`` and one copy per piece; one multiply and one copy per run), bit for bit: bf16 and
fp32 parameters; pieces that start and end inside 16-element blocks and tiles, span several tiles, are
empty, or are absent for a weight; a saturating scale; every FP8 byte value dequantized (the NaN bytes
too: the interpreter decodes them as 480; a NaN's bits are not compared, PyTorch's differ by
device), products that are ties between two bf16 values (round to even) and products that need
rounding, with a strided ``scale_inv`` (``[W, 4][:, 0]``, as the gatherer's); a list without runs (no
launch); every byte and parameter outside the runs untouched. Then the conformance suite's cases of
both ops with the dispatchers as the backend's ops.
The kernels run on CPU tensors with ``TRITON_INTERPRET=1``, which must be on before Triton defines
them, so the checks run in a child process.

By hand: ``OMP_NUM_THREADS=1 TRITON_INTERPRET=1 python tests/ops/test_fp8_flat_interpret.py``.
"""

from __future__ import annotations

import os
import sys

from mcore.testing.interpreter import interpreter_child, needs_triton, run_under_interpreter


@needs_triton
@interpreter_child()
def test_fp8_flat_kernels_under_the_interpreter():
    out = run_under_interpreter(__file__)
    assert "fp8_flat checks: 12" in out, out


def _old_quantize(params, data, scales, ranges) -> None:
    """``Fp8ParamGather.quantize_shards``'s loop before the op."""
    from mcore.ops import reference

    for start, end, i in ranges:
        if end > start:
            data[start:end].copy_(reference.fp8_quantize(params[start:end], scales[i], data.dtype))


def _old_dequantize(params, data, scale_inv, ranges) -> None:
    """``Fp8ParamGather.after_gather``'s loop before the op (``scale_inv [W, 4]``, weight ``i``'s at ``[i, 0]``)."""
    for start, end, i in ranges:
        if end > start:
            params[start:end].copy_(data[start:end].float() * scale_inv[i, 0])


def _main() -> int:
    import types

    import torch
    from mcore.backends.cuda import ops as cuda_ops
    from mcore.backends.cuda.triton_kernels import fp8_flat

    from mcore.ops.flat import FlatFp8Weights
    from mcore.testing import conformance

    assert os.environ.get("TRITON_INTERPRET") == "1"
    fp8_flat.BLOCK = 64  # several tiles per run, full and partial, on a few hundred elements
    launches = {"fp8_quantize_flat": 0, "fp8_dequantize_flat": 0}
    for name in launches:
        original = getattr(fp8_flat, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            launches[_name] += 1
            return _original(*args, **kwargs)

        setattr(fp8_flat, name, counted)

    gen = torch.Generator().manual_seed(0)
    failures, checks = [], 0
    n = 400
    # (start, end, weight): inside blocks and tiles, over several tiles, empty, weight 3 absent
    ranges = ((5, 37, 0), (37, 37, 2), (40, 203, 1), (203, 210, 2), (250, 399, 4))
    scales = torch.tensor([40.0, 96.0, 2000.0, 1.0, 0.5])  # weight 2: saturates
    for dtype in (torch.bfloat16, torch.float32):
        params = (torch.randn(n, generator=gen) * 3).to(dtype)
        params[41:44] = 0.0
        params[206] = 1e-6  # below e4m3's smallest subnormal once scaled: a zero byte
        sentinel = torch.full((n,), 0x5A, dtype=torch.uint8)
        for runs in (ranges, ()):
            tag = f"fp8_quantize_flat {dtype} runs={len(runs)}"
            data = sentinel.clone().view(torch.float8_e4m3fn)
            cuda_ops.fp8_quantize_flat(params, FlatFp8Weights(data, runs, scales, torch.zeros(5)))
            want = sentinel.clone().view(torch.float8_e4m3fn)
            _old_quantize(params, want, scales, runs)
            checks += 1
            if not torch.equal(data.view(torch.uint8), want.view(torch.uint8)):
                bad = (data.view(torch.uint8) != want.view(torch.uint8)).nonzero().flatten()
                failures.append(f"{tag}: bytes differ at {bad[:8].tolist()}")
            print(tag, "ok" if torch.equal(data.view(torch.uint8), want.view(torch.uint8)) else "DIFFERS")

        scale_inv = torch.ones(5, 4)
        # 1/96, 3e-3: products to round into bf16; 1 + 2^-5: exact 9-bit products, ties in bf16
        scale_inv[:, 0] = torch.tensor([0.5, 1 / 96, 3e-3, 1.0, 1.03125])
        gathered = torch.arange(n, dtype=torch.int64).remainder(256).to(torch.uint8)  # every byte value
        gathered = gathered.view(torch.float8_e4m3fn)
        for runs in (ranges, ()):
            tag = f"fp8_dequantize_flat {dtype} runs={len(runs)}"
            start = (torch.randn(n, generator=gen) * 7).to(dtype)
            got, want = start.clone(), start.clone()
            cuda_ops.fp8_dequantize_flat(got, gathered, scale_inv[:, 0], runs)
            _old_dequantize(want, gathered, scale_inv, runs)
            checks += 1
            # NaN's bits aside (both NaN; PyTorch's differ by device): the same bits
            bits = torch.int32 if dtype == torch.float32 else torch.int16
            nan = want.isnan()
            same = torch.equal(got.isnan(), nan) and torch.equal(got[~nan].view(bits), want[~nan].view(bits))
            if not same:
                bad = ((got.view(bits) != want.view(bits)) & ~(got.isnan() & nan)).nonzero().flatten()
                failures.append(f"{tag}: parameters differ (first indices {bad[:8].tolist()})")
            if runs and dtype == torch.bfloat16:  # the case has NaN bytes and ties
                exact = gathered[250:399].float() * 1.03125
                ties = (exact.view(torch.int32) & 0xFFFF) == 0x8000
                if not (want.isnan().any() and ties.sum() > 4):
                    failures.append(f"{tag}: the case lacks NaN bytes or ties ({int(ties.sum())})")
            print(tag, "ok" if same else "DIFFERS")

    # the conformance suite's cases, with the CUDA dispatchers as the backend's ops (BLOCK 64)
    class Ops(dict):
        def provider(self, name):
            return "cuda:triton"

    table = {name: getattr(cuda_ops, name) for name in launches}
    backend = types.SimpleNamespace(ops=Ops(table), device=lambda index=0: torch.device("cpu"))
    for case in conformance.OP_CASES:
        if case.op in table:
            for dtype in case.dtypes:
                checks += 1
                try:
                    conformance.check_op(backend, case, dtype)
                    print(case.name, dtype, "ok")
                except conformance.ConformanceError as err:
                    failures.append(str(err))
    if launches != {"fp8_quantize_flat": 6, "fp8_dequantize_flat": 6}:
        failures.append(f"kernel calls {launches}: a dispatcher fell back to the reference")
    print("fp8_flat checks:", checks)
    if failures:
        print("FAILED:\n" + "\n".join(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(_main())
