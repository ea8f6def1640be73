"""The CUDA backend's FP8 cast kernels under Triton's CPU interpreter.

A CPU-only check of ``backends/cuda/triton_kernels/fp8_cast.py`` through the CUDA dispatchers
``fp8_amax`` and ``fp8_cast``: the amax (NaN counted as inf; grid-strided blocks), the cast with the scale formed from an
amax in the kernel (margins, saturation, zero and non-finite amaxes), the transposed write alone or
with the row-major one, tiles that do not divide the shape, a strided input (``W^T`` as a view), a
given scale with the amax recorded into a slot (grid-strided tiles) of a larger buffer, against
:mod:`mcore.ops.reference`: the FP8 bytes, the scale inverse and the amax must be identical; the
cast with the bias gradient (``fp8_cast_dbias``): the cast's bytes and the fp32 column sums; the
cast of a packed QKV gradient from its three parts (``fp8_cast_packed``) against ``fp8_cast_dbias``
of the concatenation; the byte transpose (``fp8_transpose``, its own kernel module). The
kernels run on CPU tensors with ``TRITON_INTERPRET=1``, which must be on before Triton defines them,
so the checks run in a child process. It needs Triton installed (the ``test`` extra installs it, so
CI runs it); ``MCORE_TEST_BACKEND=cuda pytest tests/ops/test_scaled_linear.py`` is the GPU check.

By hand: ``OMP_NUM_THREADS=1 TRITON_INTERPRET=1 python tests/ops/test_fp8_cast_interpret.py``.
"""

from __future__ import annotations

import os
import sys

from mcore.testing.interpreter import interpreter_child, needs_triton, run_under_interpreter


@needs_triton
@interpreter_child()
def test_fp8_cast_kernels_under_the_interpreter():
    run_under_interpreter(__file__)


def _main() -> int:
    import torch
    from mcore.backends.cuda.fp8 import linear as cuda_fp8
    from mcore.backends.cuda.triton_kernels import fp8_cast as kernels

    from mcore.ops import reference

    assert os.environ.get("TRITON_INTERPRET") == "1"
    gen = torch.Generator().manual_seed(0)
    failures = []
    calls = {"amax": 0, "cast": 0, "cast_dbias": 0, "cast_packed": 0}
    for name in calls:  # count kernel launches: the dispatchers must not fall back to the reference
        original = getattr(kernels, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        setattr(kernels, name, counted)

    def same(what, got, want):
        if (got is None) != (want is None):
            failures.append(f"{what}: {got!r} vs {want!r}")
            return
        if got is None:
            return
        ok = got.dtype == want.dtype and got.shape == want.shape
        ok = ok and torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))
        print(what, "ok" if ok else "DIFFERS")
        if not ok:
            failures.append(what)

    cfg = {"BLOCK_M": 32, "BLOCK_K": 16, "num_warps": 4}  # several ragged tiles on small shapes
    # few programs (the interpreter's 4 "SMs" x 1) and small amax blocks: the grid-strided loops of
    # both kernels take several iterations, with a ragged last block
    kernels.PROGRAMS_PER_SM, kernels.AMAX_BLOCK = 1, 64
    real_cast, real_cast_dbias, real_cast_packed = kernels.cast, kernels.cast_dbias, kernels.cast_packed
    kernels.cast = lambda *a, **k: real_cast(*a, **k, config=cfg)
    # several row splits of one program each (PER_SM 1) and both ways of keeping the column sums
    dbias_cfg = {**cfg, "PER_SM": 1, "SUM_2D": True}
    kernels.cast_dbias = lambda *a, **k: real_cast_dbias(*a, **k, config=dbias_cfg)
    kernels.cast_packed = lambda *a, **k: real_cast_packed(*a, **k, config=dbias_cfg)

    for shape in ((37, 50), (64, 32), (1, 16)):
        for dtype in (torch.bfloat16, torch.float32):
            x = (torch.randn(*shape, generator=gen) * 4).to(dtype)
            x[0, -1] = 30.0
            what = f"{tuple(shape)} {str(dtype)[6:]}"
            same(f"amax {what}", cuda_fp8.fp8_amax(x), reference.fp8_amax(x))
            for fp8_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                for margin in (0, 3):
                    for amax in (30.0, 11.0, 0.0, float("inf")):  # exact, saturating, the two guards
                        a = torch.tensor(amax)
                        for rowwise, columnwise in ((True, True), (True, False), (False, True)):
                            args = dict(amax=a, margin=margin, rowwise=rowwise, columnwise=columnwise)
                            got = cuda_fp8.fp8_cast(x, fp8_dtype, **args)
                            want = reference.fp8_cast(x, fp8_dtype, **args)
                            tag = f"cast {what} {str(fp8_dtype)[6:]} m{margin} amax {amax} {rowwise}/{columnwise}"
                            for part, g, w in zip(("q", "qT", "scale_inv"), got, want):
                                same(f"{tag} {part}", g, w)
            # a transposed view (the weight's W^T), a given scale, the amax recorded into a slot
            for source in (x, x.t()):
                slot_got, slot_want = torch.full((3,), 2.0), torch.full((3,), 2.0)
                scale = torch.full((3,), 9.5)[1]
                got = cuda_fp8.fp8_cast(
                    source, torch.float8_e4m3fn, scale=scale, columnwise=True, amax_record=slot_got[1:2]
                )
                want = reference.fp8_cast(
                    source, torch.float8_e4m3fn, scale=scale, columnwise=True, amax_record=slot_want[1:2]
                )
                for part, g, w in zip(("q", "qT", "scale_inv"), got, want):
                    same(f"scaled {what} strides {source.stride()} {part}", g, w)
                same(f"recorded amax {what} strides {source.stride()}", slot_got, slot_want)

    # fp8_cast_dbias: fp8_cast's bytes (the same dispatcher arguments) and the column sums, fp32
    # partials of several row splits (the interpreter's 4 "SMs" over 2-4 column bands) summed in order
    for shape, sum_2d in (((37, 50), True), ((300, 20), True), ((300, 20), False), ((1, 16), False)):
        dbias_cfg["SUM_2D"] = sum_2d
        for dtype in (torch.bfloat16, torch.float32):
            x = (torch.randn(*shape, generator=gen) * 4).to(dtype)
            for source in (x, x.t()):
                what = f"dbias {tuple(source.shape)} strides {source.stride()} {str(dtype)[6:]} 2d {sum_2d}"
                for kwargs in (
                    dict(amax=torch.tensor(11.0), margin=1, columnwise=True),
                    dict(scale=torch.tensor(9.5), rowwise=False, columnwise=True),
                    dict(scale=torch.tensor(9.5), rowwise=True, columnwise=False),
                ):
                    slot_got, slot_want = torch.zeros(1), torch.zeros(1)
                    record = {"amax_record": slot_got} if "scale" in kwargs else {}
                    want_record = {"amax_record": slot_want} if "scale" in kwargs else {}
                    fp8_dtype = torch.float8_e5m2
                    *got, dbias = cuda_fp8.fp8_cast_dbias(source, fp8_dtype, **kwargs, **record)
                    want = cuda_fp8.fp8_cast(source, fp8_dtype, **kwargs, **want_record)
                    tag = f"{what} {kwargs}"
                    for part, g, w in zip(("q", "qT", "scale_inv"), got, want):
                        same(f"{tag} {part}", g, w)
                    same(f"{tag} recorded amax", slot_got, slot_want)
                    exact = source.double().sum(0)
                    err = (dbias.double() - exact).abs().max().item()
                    # fp32 accumulation, one rounding to the output dtype: within one ulp of the exact sum
                    # and fp32 summation error
                    bound = torch.finfo(dtype).eps * exact.abs() + 1e-6 * source.double().abs().sum(0)
                    bound = bound.max().item()
                    ok = dbias.dtype == dtype and dbias.shape == exact.shape and err <= bound
                    print(f"{tag} dbias", "ok" if ok else f"DIFFERS by {err} (bound {bound})")
                    if not ok:
                        failures.append(f"{tag} dbias: error {err}, dtype {dbias.dtype}, shape {dbias.shape}")

    # fp8_cast_packed: the QKV output gradient as dq, dk, dv (widths that the 64/128-wide tuned bands
    # divide, read here in 16-wide bands): fp8_cast_dbias's bytes, amax and column sums (bit for bit:
    # the same bands and row splits) on the concatenation, with and without the bias gradient; a part
    # with a row stride wider than itself (a view into a larger buffer); GQA's wider query part
    for groups, widths in ((2, (64, 64, 64)), (1, (128, 64, 64))):
        for dtype in (torch.bfloat16, torch.float32):
            rows = 37
            parts = [(torch.randn(rows, groups * w, generator=gen) * 4).to(dtype) for w in widths]
            wide = torch.zeros(rows, groups * widths[2] + 16, dtype=dtype)
            wide[:, : groups * widths[2]] = parts[2]
            parts[2] = wide[:, : groups * widths[2]]  # row stride > width
            parts[1][0, 3] = 1e5  # saturates
            packed = reference.pack_columns(parts, groups)
            for dbias in (True, False):
                for kwargs in (
                    dict(scale=torch.tensor(9.5), rowwise=True, columnwise=True),
                    dict(scale=torch.tensor(9.5), rowwise=False, columnwise=True),
                    dict(amax=torch.tensor(11.0), margin=1, rowwise=True, columnwise=False),
                ):
                    slot_got, slot_want = torch.zeros(1), torch.zeros(1)
                    record = {"amax_record": slot_got} if "scale" in kwargs else {}
                    want_record = {"amax_record": slot_want} if "scale" in kwargs else {}
                    tag = f"packed g{groups} {widths} {str(dtype)[6:]} dbias {dbias} {kwargs}"
                    got = cuda_fp8.fp8_cast_packed(
                        parts, groups, torch.float8_e5m2, dbias=dbias, **kwargs, **record
                    )
                    want = cuda_fp8.fp8_cast_dbias(packed, torch.float8_e5m2, **kwargs, **want_record)
                    for part, g, w in zip(("q", "qT", "scale_inv"), got, want):
                        same(f"{tag} {part}", g, w)
                    same(f"{tag} recorded amax", slot_got, slot_want)
                    if dbias:
                        same(f"{tag} dbias", got[3], want[3])
                    elif got[3] is not None:
                        failures.append(f"{tag}: a dbias without dbias=True")

    x = torch.randn(40, 24, generator=gen)
    x[3, 5] = float("nan")
    got = cuda_fp8.fp8_amax(x)
    print("amax with a NaN", got.item())
    if got.item() != float("inf"):
        failures.append(f"amax with a NaN: {got.item()} (want inf)")
    _, _, scale_inv = cuda_fp8.fp8_cast(x, torch.float8_e4m3fn, amax=got)
    if scale_inv.item() != 1.0:
        failures.append(f"a NaN amax: the scale inverse is {scale_inv.item()}, not 1")

    # the integer encoding of the FP8 bytes (every tile here, fp32 tiles on the GPU): signed zeros,
    # NaNs of both signs, subnormals and the smallest normals, ties between grid points, the largest
    # finite values and beyond (saturated), for both formats
    for fp8_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        tiny = 2.0 ** (-9 if fp8_dtype == torch.float8_e4m3fn else -16)  # the smallest subnormal
        big = torch.finfo(fp8_dtype).max
        special = [0.0, -0.0, float("nan"), -float("nan"), tiny, -tiny, 0.5 * tiny, 1.5 * tiny,
                   3 * tiny, 64 * tiny, 1.0 + 1 / 16, 1.0 + 3 / 16, -(2.0 + 1 / 8), big, -big, 2 * big,
                   -float("inf"), 1e-30]  # fmt: skip
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.tensor(special * 3).reshape(6, 9).to(dtype)
            args = dict(scale=torch.tensor(1.0), rowwise=True, columnwise=True)
            got = cuda_fp8.fp8_cast(x, fp8_dtype, **args)
            want = reference.fp8_cast(x, fp8_dtype, **args)
            for part, g, w in zip(("q", "qT"), got, want):
                same(f"special values {str(dtype)[6:]} {str(fp8_dtype)[6:]} {part}", g, w)

    # fp8_transpose: the byte transpose, tiles that divide the shape and ragged ones, a single row
    # or column, a row-strided view (a column slice); and the fallback for a non-contiguous row
    from mcore.backends.cuda.triton_kernels import fp8_transpose as transpose_kernels

    real_transpose = transpose_kernels.transpose

    def counted_transpose(q):
        calls["transpose"] += 1
        return real_transpose(q)

    calls["transpose"] = 0
    transpose_kernels.transpose = counted_transpose
    for shape in ((256, 128), (40, 72), (1, 300), (130, 1)):
        for fp8_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            q = (torch.randn(*shape, generator=gen) * 64).to(fp8_dtype)
            same(
                f"fp8_transpose {shape} {str(fp8_dtype)[6:]}",
                cuda_fp8.fp8_transpose(q),
                reference.fp8_transpose(q),
            )
    sliced = (torch.randn(64, 200, generator=gen) * 64).to(torch.float8_e4m3fn)[:, 8:136]
    same("fp8_transpose of a column slice", cuda_fp8.fp8_transpose(sliced), reference.fp8_transpose(sliced))
    before = calls["transpose"]
    strided = sliced.t()  # rows not contiguous: the reference copy
    same(
        "fp8_transpose of a transposed view",
        cuda_fp8.fp8_transpose(strided),
        reference.fp8_transpose(strided),
    )
    if calls["transpose"] != before:
        failures.append("fp8_transpose launched the kernel on rows that are not contiguous")

    print("kernel launches", calls)
    if not all(calls.values()):
        failures.append(f"the dispatchers fell back to the reference: {calls}")
    if failures:
        print("FAILED:", *failures[:20], sep="\n  ")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_main())
