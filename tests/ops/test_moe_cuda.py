"""The CUDA backend's MoE ops (``mcore.backends.cuda.moe``) without a GPU: the conformance cases run
through its dispatchers on CPU tensors, with ``torch._grouped_mm``'s CPU implementation standing in
for the CUDA kernel (``GROUPED_MM_ON_CPU``), so the autograd.Function's forward, input and weight
gradients (2-D x 2-D with offsets), its zero-token experts and N=0 path, and the fallbacks are checked
in CI. On a GPU the conformance suite runs the same cases on CUDA tensors."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from mcore.backends.cuda import moe

from mcore.ops import reference
from mcore.ops.registry import OpRegistry
from mcore.testing.conformance.op_cases import MOE_CASES
from mcore.testing.conformance.op_checks import check_op


def _cpu_grouped_mm_works() -> bool:
    try:
        x = torch.zeros(2, 8, dtype=torch.bfloat16)
        torch._grouped_mm(
            x, torch.zeros(1, 8, 8, dtype=torch.bfloat16), offs=torch.tensor([2], dtype=torch.int32)
        )
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return True


needs_cpu_grouped_mm = pytest.mark.skipif(
    not _cpu_grouped_mm_works(), reason="this torch has no CPU torch._grouped_mm"
)


@pytest.fixture
def kernel_calls(monkeypatch):
    """The CUDA dispatchers allowed on CPU tensors; records each ``torch._grouped_mm`` call's shapes."""
    monkeypatch.setattr(moe, "GROUPED_MM_ON_CPU", True)
    calls, real = [], torch._grouped_mm

    def spy(a, b, **kwargs):
        calls.append((a.dim(), b.dim()))
        return real(a, b, **kwargs)

    monkeypatch.setattr(torch, "_grouped_mm", spy)
    return calls


def _cuda_table_on_cpu() -> SimpleNamespace:
    registry = OpRegistry(reference.REFERENCE_OPS)
    for name, fn in moe.MOE_OPS.items():
        registry.override(name, fn, provider="cuda-moe-on-cpu")
    return SimpleNamespace(ops=registry.freeze(), device=lambda index: torch.device("cpu"), device_type="cpu")


@needs_cpu_grouped_mm
def test_moe_conformance_through_the_cuda_dispatchers(kernel_calls):
    backend = _cuda_table_on_cpu()
    for case in MOE_CASES:
        for dtype in case.dtypes:
            before = len(kernel_calls)
            check_op(backend, case, dtype)
            used = kernel_calls[before:]
            if case.name == "grouped_gemm_empty_expert" and dtype == torch.bfloat16:
                assert used == [(2, 3), (2, 3), (2, 2)], "forward, dgrad (2-D x 3-D), wgrad (2-D x 2-D)"
            elif case.op == "grouped_gemm":
                assert used == [], f"{case.name} {dtype}: the kernel cannot serve it (fp32, unaligned or N=0)"


def test_grouped_gemm_falls_back_off_the_kernel():
    x, w = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(2, 8, 8, dtype=torch.bfloat16)
    assert not moe.grouped_mm_fits(x, w)  # CPU tensors without the test flag
    counts = torch.tensor([1, 3])
    torch.testing.assert_close(moe.grouped_gemm(x, w, counts), reference.grouped_gemm(x, w, counts))


def test_permute_by_sort_equals_masked_select():
    gen = torch.Generator().manual_seed(0)
    routing_map = torch.rand(9, 5, generator=gen) > 0.6
    tokens, probs = torch.randn(9, 4, generator=gen), torch.rand(9, 5, generator=gen)
    n = int(routing_map.sum())
    got = moe.moe_permute(tokens, routing_map, probs, num_out_tokens=n)
    want = reference.moe_permute(tokens, routing_map, probs)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_moe_ops_on_the_gpu():
    """The conformance cases on CUDA tensors through the cuda backend's table, and a 64-expert bf16
    grouped GEMM (empty experts included) through the kernel against a float64 loop."""
    from mcore.plugins.manager import select_backend

    backend = select_backend("cuda", activate=False)
    assert backend.ops.provider("grouped_gemm") == "cuda:torch-grouped-mm"
    for case in MOE_CASES:
        for dtype in case.dtypes:
            check_op(backend, case, dtype)
    gen = torch.Generator().manual_seed(0)
    counts = torch.randint(0, 64, (64,), generator=gen)
    counts[::7] = 0
    x = torch.randn(int(counts.sum()), 256, generator=gen).to("cuda", torch.bfloat16).requires_grad_()
    w = (torch.randn(64, 512, 256, generator=gen) / 16).to("cuda", torch.bfloat16).requires_grad_()
    assert moe.grouped_mm_fits(x, w)
    dy = torch.randn(x.shape[0], 512, generator=gen).to("cuda", torch.bfloat16)
    y = backend.ops.grouped_gemm(x, w, counts.cuda())
    y.backward(dy)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y64 = reference.grouped_gemm(x64, w64, counts)
    y64.backward(dy.double())
    for got, want in ((y, y64), (x.grad, x64.grad), (w.grad, w64.grad)):
        assert ((got.double() - want).norm() / want.norm()).item() < 1e-2
    assert torch.equal(w.grad[::7].float().cpu(), torch.zeros(10, 512, 256))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_empty_experts_get_zero_weight_grads():
    """The weight gradient of experts without a row is exactly zero, with the allocator's free memory
    poisoned with NaN first (the backward relies on the kernel writing zeros, not on a masking pass)."""
    counts = torch.tensor([16, 0, 32, 0, 8, 24, 0, 8], device="cuda")
    x = torch.randn(int(counts.sum()), 256, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(x.shape[0], 512, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        weight = torch.randn(8, 512, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        poison = torch.full((8, 512, 256), float("nan"), device="cuda", dtype=torch.bfloat16)
        del poison
        moe.GroupedMM.apply(x, weight, counts).backward(dy)
        assert not torch.isnan(weight.grad).any()
        assert torch.count_nonzero(weight.grad[counts == 0]) == 0
