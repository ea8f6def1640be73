"""The CUDA backend's ``norm_fp8_forward`` and ``norm_backward`` kernels, under Triton's CPU interpreter.

``norm_fp8_forward`` (``backends/cuda/triton_kernels/norm_fp8.py``: the norm's statistics, then its
output formed tile by tile and written as FP8, transposed or not, the amax recorded) must give
exactly the bytes of the unfused path of the same backend: the norm forward kernel (``norms.layer_norm_fwd`` / ``rms_norm_fwd``) then the cast
kernel (``fp8_cast.cast(..., scale=..., amax_record=...)``): q, q^T, the scale inverse, the recorded
amax, mean and rstd. Both kinds, with and without a bias, bf16/fp32 (and RMSNorm's fp32 weight on
bf16 rows: an fp32 output), e4m3 and e5m2, rowwise/columnwise subsets, rows not a multiple of the
row block, several cast tiles with a ragged last one; and close to :mod:`mcore.ops.reference`
(within one FP8 step). ``norm_backward`` must equal autograd through the backend's own norm op
(``layer_norm``/``rms_norm`` and their ``*_with_residual`` forms), bit for bit and in its dtypes.

The kernels run on CPU tensors with ``TRITON_INTERPRET=1`` (set before Triton defines them), so the
checks run in a child process. The same checks run on a GPU (real tile shapes, training-sized rows)
with ``MCORE_TEST_BACKEND=cuda``, as do the conformance cases of both ops on the selected backend.

By hand: ``OMP_NUM_THREADS=1 TRITON_INTERPRET=1 python tests/ops/test_norm_fp8_interpret.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from mcore.testing import conformance
from mcore.testing.interpreter import interpreter_child, needs_triton, run_under_interpreter

BACKEND = os.environ.get("MCORE_TEST_BACKEND", "cpu")


@needs_triton
@interpreter_child()
def test_norm_fp8_kernels_under_the_interpreter():
    run_under_interpreter(__file__)


@pytest.mark.skipif(BACKEND != "cuda", reason="the GPU run of these checks (MCORE_TEST_BACKEND=cuda)")
def test_norm_fp8_kernels_on_the_gpu():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, __file__, "--device", "cuda"], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]


@pytest.mark.parametrize(
    "case",
    [c for c in conformance.OP_CASES if c.op in ("norm_fp8_forward", "norm_backward")],
    ids=lambda c: c.name,
)
def test_norm_fp8_conformance_cases(case):
    """Both ops' conformance cases on the selected backend (the reference on CPU, the kernels on CUDA)."""
    from mcore.plugins.manager import select_backend

    backend = select_backend(BACKEND, activate=False)
    if case.capability is not None and case.capability not in backend.capabilities():
        pytest.skip(f"backend {backend.name!r} does not claim {case.capability}")
    for dtype in case.dtypes:
        conformance.check_op(backend, case, dtype)


def _main(device: str) -> int:
    from mcore.backends.cuda import ops as cuda_ops
    from mcore.backends.cuda.fp8 import linear as cuda_fp8
    from mcore.backends.cuda.triton_kernels import fp8_cast, norm_fp8, norms

    from mcore.ops import reference

    interpret = device == "cpu"
    assert interpret == (os.environ.get("TRITON_INTERPRET") == "1")
    gen = torch.Generator().manual_seed(0)
    failures: list[str] = []
    calls = {"fwd": 0, "bwd": 0}
    fused_fwd, fused_bwd = norm_fp8.norm_fp8_fwd, norm_fp8.norm_bwd

    def counted_fwd(*args, **kwargs):
        calls["fwd"] += 1
        return fused_fwd(*args, **kwargs)

    def counted_bwd(*args, **kwargs):
        calls["bwd"] += 1
        return fused_bwd(*args, **kwargs)

    norm_fp8.norm_fp8_fwd, norm_fp8.norm_bwd = counted_fwd, counted_bwd
    if interpret:  # both cast kernels' grid-strided loops (amax recorded) over several small tiles
        fp8_cast.PROGRAMS_PER_SM = 1
        small = {"BLOCK_M": 16, "BLOCK_K": 16, "num_warps": 4}
        real_cast = fp8_cast.cast
        fp8_cast.cast = lambda *a, **k: real_cast(*a, **k, config=small)
        norm_fp8.CAST_CONFIG = small

    def same(what, got, want):
        if (got is None) != (want is None):
            failures.append(f"{what}: {got!r} vs {want!r}")
            return
        if got is None:
            return
        ok = got.dtype == want.dtype and got.shape == want.shape
        ok = ok and torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))
        if not ok:
            failures.append(what)

    def close_to_reference(what, got, want, x_dtype):
        # The interpreter converts fp32 to bf16/fp16 by truncation (the GPU rounds to nearest), so
        # there outputs rounded through 16 bits differ from the reference's in more places (each by one step).
        fraction = 0.1 if interpret and x_dtype != torch.float32 else 0.01
        try:
            conformance.fp8_step_close(got, want, what, max_fraction=fraction)
        except AssertionError as err:
            failures.append(str(err))

    # on the GPU: every combination at small shapes, bf16 at training-sized ones (real tile shapes:
    # one 2048-wide row a statistics step on 4 warps, 4096 on 8)
    if interpret:
        shapes = {(37, 40): (torch.bfloat16, torch.float32), (70, 64): (torch.bfloat16, torch.float32)}
    else:
        every = (torch.bfloat16, torch.float32, torch.float16)
        shapes = {
            (37, 40): every,
            (37, 64): every,  # K a multiple of 16: the shape where the FP8 transposed store broke
            (300, 1000): (torch.bfloat16, torch.float32),
            (8192, 2048): (torch.bfloat16,),
            (4100, 4096): (torch.bfloat16,),
        }
    variants = [  # (fp8 dtype, scale: the largest outputs saturate, rowwise, columnwise)
        (fp8_dtype, scale_value, rowwise, columnwise)
        for fp8_dtype, scale_value in ((torch.float8_e4m3fn, 120.0), (torch.float8_e5m2, 9000.0))
        for rowwise, columnwise in ((True, True), (True, False), (False, True))
    ]
    if not interpret:  # each variant is one more compilation of each kernel
        variants = [variants[0], variants[-1]]
    for (m, n), dtypes in shapes.items():
        for dtype in dtypes:
            x = (torch.randn(m, n, generator=gen) * 2 + 0.5).to(dtype).to(device)
            for kind, has_bias, w_dtype in (
                ("LayerNorm", True, dtype),
                ("LayerNorm", False, dtype),
                ("RMSNorm", False, dtype),
                ("RMSNorm", False, torch.float32),  # bf16 rows, fp32 weight: an fp32 output
            ):
                if w_dtype != dtype and dtype != torch.bfloat16:
                    continue
                weight = (1 + 0.3 * torch.randn(n, generator=gen)).to(w_dtype).to(device)
                bias = (0.2 * torch.randn(n, generator=gen)).to(dtype).to(device) if has_bias else None
                eps = 1e-5
                for fp8_dtype, scale_value, rowwise, columnwise in variants:
                    scale = torch.tensor(scale_value, device=device)
                    tag = (
                        f"[{m}, {n}] {str(dtype)[6:]} {kind} bias={has_bias} w={str(w_dtype)[6:]} "
                        f"{str(fp8_dtype)[6:]} {rowwise}/{columnwise}"
                    )
                    slot_f = torch.tensor([5.0, 0.5, 5.0], device=device)
                    slot_u = slot_f.clone()
                    got = cuda_ops.norm_fp8_forward(
                        x, weight, bias, eps, kind, fp8_dtype, scale, amax_record=slot_f[1:2],
                        rowwise=rowwise, columnwise=columnwise,
                    )  # fmt: skip
                    if kind == "LayerNorm":
                        y, mean, rstd = norms.layer_norm_fwd(x, weight, bias, eps)
                    else:
                        out_dtype = torch.promote_types(dtype, w_dtype)
                        (y, rstd), mean = norms.rms_norm_fwd(x, weight, eps, out_dtype), None
                    unfused = (
                        *cuda_fp8.fp8_cast(
                            y, fp8_dtype, scale=scale, rowwise=rowwise, columnwise=columnwise,
                            amax_record=slot_u[1:2],
                        ),
                        mean,
                        rstd,
                    )  # fmt: skip
                    for part, g, u in zip(("q", "qT", "scale_inv", "mean", "rstd"), got, unfused):
                        same(f"{tag} {part} vs unfused", g, u)
                    same(f"{tag} amax record vs unfused", slot_f, slot_u)
                    if slot_f[0].item() != 5.0 or slot_f[2].item() != 5.0:
                        failures.append(f"{tag}: wrote outside the amax slot")
                    if m * n > 1 << 20:  # the reference (on CPU) at the small shapes only
                        continue
                    ref = reference.norm_fp8_forward(
                        x.cpu(), weight.cpu(), None if bias is None else bias.cpu(), eps, kind,
                        fp8_dtype, scale.cpu(), rowwise=rowwise, columnwise=columnwise,
                    )  # fmt: skip
                    for part, g, r in zip(("q", "qT"), got, ref):
                        if (g is None) != (r is None):
                            failures.append(f"{tag} {part}: {g!r} vs reference {r!r}")
                        elif g is not None:
                            close_to_reference(f"{tag} {part} vs reference", g, r, dtype)
                    for part, g, r in zip(("mean", "rstd"), got[3:], ref[3:]):
                        if (g is None) != (r is None) or (
                            g is not None and not torch.allclose(g.cpu(), r, rtol=1e-5, atol=1e-6)
                        ):
                            failures.append(f"{tag} {part} vs reference")

                # the backward from the saved statistics, with and without the residual's gradient
                *_, mean, rstd = cuda_ops.norm_fp8_forward(
                    x, weight, bias, eps, kind, torch.float8_e4m3fn, scale
                )
                out_dtype = dtype if kind == "LayerNorm" else torch.promote_types(dtype, w_dtype)
                dy = torch.randn(m, n, generator=gen).to(out_dtype).to(device)
                for residual in (False, True):
                    dres = torch.randn(m, n, generator=gen).to(dtype).to(device) if residual else None
                    tag = f"backward [{m}, {n}] {str(dtype)[6:]} {kind} bias={has_bias} w={str(w_dtype)[6:]} res={residual}"
                    got = cuda_ops.norm_backward(
                        dy, x, weight, bias, eps, kind, mean, rstd, residual_grad=dres
                    )
                    leaves = [x.detach().requires_grad_(), weight.detach().requires_grad_()]
                    if bias is not None:
                        leaves.append(bias.detach().requires_grad_())
                    if kind == "LayerNorm":
                        outs = cuda_ops.layer_norm_with_residual(
                            leaves[0], leaves[1], leaves[2] if bias is not None else None, eps
                        )
                    else:
                        outs = cuda_ops.rms_norm_with_residual(leaves[0], leaves[1], eps)
                    if residual:
                        torch.autograd.backward(outs, (dy, dres))
                    else:
                        outs[0].backward(dy)
                    want = (leaves[0].grad, leaves[1].grad, leaves[2].grad if bias is not None else None)
                    for part, g, w in zip(("dx", "dweight", "dbias"), got, want, strict=True):
                        same(f"{tag} {part} vs the norm op's autograd", g, w)
                    if m * n > 1 << 20:
                        continue
                    ref = reference.norm_backward(
                        dy.cpu(), x.cpu(), weight.cpu(), None if bias is None else bias.cpu(), eps, kind,
                        mean.cpu() if mean is not None else None, rstd.cpu(),
                        None if dres is None else dres.cpu(),
                    )  # fmt: skip
                    for part, g, r in zip(("dx", "dweight", "dbias"), got, ref):
                        if (g is None) != (r is None):
                            failures.append(f"{tag} {part}: {g!r} vs reference {r!r}")
                        elif g is not None:
                            tol = 1e-4 if dtype == torch.float32 and g.dtype == torch.float32 else 5e-2
                            scale_r = r.float().abs().max().item() + 1e-6
                            err = (g.cpu().float() - r.float()).abs().max().item() / scale_r
                            if g.dtype != r.dtype or err > tol:
                                failures.append(
                                    f"{tag} {part} vs reference: {g.dtype}/{r.dtype}, rel err {err:.3g}"
                                )
            print(f"[{m}, {n}] {str(dtype)[6:]} done, {len(failures)} failures so far", flush=True)

    print("kernel launches", calls)
    if not (calls["fwd"] and calls["bwd"]):
        failures.append(f"the dispatchers fell back to the reference: {calls}")
    if failures:
        print(f"FAILED ({len(failures)}):", *failures[:30], sep="\n  ")
        return 1
    print("all equal")
    return 0


if __name__ == "__main__":
    device = sys.argv[sys.argv.index("--device") + 1] if "--device" in sys.argv else "cpu"
    sys.exit(_main(device))
