"""The CUDA backend's FP8 grouped GEMMs on the GPU (``torch._scaled_grouped_mm``, Hopper): the
conformance cases through the cuda backend's table, a 64-expert call through the kernel against the
reference (empty experts and group sizes that are not multiples of 16 included, so the weight
gradient's aligned token blocks are exercised), and the FP8 experts' forward and gradients against
bf16. Skipped without a CUDA device of compute capability 9.x (CPU CI checks the wrappers with a
stand-in kernel: tests/moe/test_moe_fp8.py)."""

from __future__ import annotations

import os

import pytest
import torch

from mcore.ops import reference
from mcore.testing.conformance.op_cases import OP_CASES
from mcore.testing.conformance.op_checks import check_op

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9),
    reason="needs a Hopper GPU (torch._scaled_grouped_mm with rowwise scales)",
)


@pytest.fixture(scope="module")
def backend():
    from mcore.backends.cuda.grouped_fp8 import OPT_IN_ENV

    from mcore.plugins.manager import select_backend

    backend = select_backend("cuda", activate=False)
    # claimed only on request (slower than bf16 experts on an H200 with torch 2.11: see the backend)
    assert ("fp8_grouped_gemm" in backend.capabilities()) == (os.environ.get(OPT_IN_ENV) == "1")
    assert backend.ops.provider("scaled_grouped_gemm") == "cuda:scaled-grouped-mm"
    return backend


def test_conformance_cases_on_the_gpu(backend):
    for case in OP_CASES:
        if case.op.startswith("scaled_grouped_gemm"):
            for dtype in case.dtypes:
                check_op(backend, case, dtype)


def test_kernel_against_the_reference_with_empty_and_unaligned_experts(backend):
    gen = torch.Generator().manual_seed(0)
    e, k, m = 64, 256, 512
    counts = torch.randint(0, 40, (e,), generator=gen)
    counts[::7] = 0
    n = int(counts.sum())
    q = lambda *s: (torch.randn(*s, generator=gen) * 60).to(torch.float8_e4m3fn)  # noqa: E731
    s = lambda *s: torch.rand(*s, generator=gen) * 1e-2 + 1e-4  # noqa: E731
    for op, args in (
        ("scaled_grouped_gemm", (q(n, k), q(e, m, k), s(n), s(e, m))),
        ("scaled_grouped_gemm_wgrad", (q(m, n), q(k, n), s(e, m), s(e, k))),
    ):
        want = getattr(reference, op)(*args, counts, torch.float32)
        got = getattr(backend.ops, op)(*[a.cuda() for a in args], counts.cuda(), torch.bfloat16)
        err = ((got.float().cpu() - want).norm() / want.norm()).item()
        assert err < 1e-2, (op, err)
        if op.endswith("wgrad"):
            assert torch.equal(got[::7].float().cpu(), torch.zeros(10, m, k))


def test_fp8_experts_forward_and_gradients_near_bf16(backend):
    from mcore.backend import set_current_backend
    from mcore.fp8.grouped import fp8_grouped_gemm

    previous = set_current_backend(backend)
    try:
        gen = torch.Generator().manual_seed(1)
        counts = torch.tensor([100, 0, 37, 300, 5, 0, 64, 1])
        x = torch.randn(int(counts.sum()), 1024, generator=gen).to("cuda", torch.bfloat16).requires_grad_()
        w = (torch.randn(8, 2048, 1024, generator=gen) / 32).to("cuda", torch.bfloat16).requires_grad_()
        dy = torch.randn(x.shape[0], 2048, generator=gen).to("cuda", torch.bfloat16)
        y = fp8_grouped_gemm(x, w, counts.cuda())
        dx, dw = torch.autograd.grad(y, (x, w), dy)
        y0 = backend.ops.grouped_gemm(x, w, counts.cuda())
        dx0, dw0 = torch.autograd.grad(y0, (x, w), dy)
        for got, want in ((y, y0), (dx, dx0), (dw, dw0)):
            assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 0.06
        assert not dw[1].any() and not dw[5].any()
    finally:
        set_current_backend(previous)
