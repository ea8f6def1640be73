"""The CUDA backend's ``weighted_swiglu`` (Triton forward and one-pass backward) on the GPU, and what
its ``moe_unpermute`` keeps without probs (the MoE layer's combine since the experts weight their rows).

On the GPU: the kernels against the reference op run on the same CUDA tensors, bf16 and fp32, outputs
and both gradients, at a ragged shape, a wide row (several column blocks in the backward's loop) and
OLMoE's expert width; the autograd node keeps ``x`` and the weights only. The unpermute check runs on
CPU tensors too (the dispatcher's non-Triton path), so CI checks it without a GPU.

On a GPU: ``MCORE_TEST_BACKEND=cuda python -m pytest -q tests/ops/test_weighted_swiglu_cuda.py``.
"""

from __future__ import annotations

import pytest
import torch
from mcore.backends.cuda import moe
from mcore.backends.cuda import ops as cuda_ops

from mcore.ops import reference

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _saved(fn, *args):
    """The output of ``fn(*args)`` and ``(shape, storage bytes)`` of each tensor its autograd graph keeps."""
    kept = []

    def pack(t):
        kept.append((tuple(t.shape), t.untyped_storage().nbytes()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return out, kept


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize(("rows", "ffn"), [(37, 300), (9, 2500), (4096, 1024)])
def test_weighted_swiglu_kernels_match_the_reference(dtype, rows, ffn):
    pytest.importorskip("triton")
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 2 * ffn, generator=gen) * 2).to("cuda", dtype)
    w = torch.rand(rows, generator=gen).cuda()
    w[0] = 0.0  # a padded row
    dy = torch.randn(rows, ffn, generator=gen).to("cuda", dtype)
    results = []
    for fn in (cuda_ops.weighted_swiglu, reference.weighted_swiglu):
        xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
        out, shapes = _saved(fn, xa, wa)
        out.backward(dy)
        results.append((out, xa.grad, wa.grad, type(out.grad_fn).__name__, sorted(shapes)))
    (out, dx, dw, node, shapes), (ref, ref_dx, ref_dw, _, ref_shapes) = results
    assert node == "WeightedSwiGLUFunctionBackward", node  # the kernel, not the fallback
    # x and the weights, not swiglu(x)
    assert [s for s, _ in shapes] == [s for s, _ in ref_shapes] == [(rows,), (rows, 2 * ffn)]
    assert out.dtype == dx.dtype == dtype and dw.dtype == torch.float32
    # the same roundings as the reference (silu and the product in x's dtype), so element by element
    # within two steps of bf16 (a sigmoid one fp32 ulp apart can flip a rounding)
    tol = dict(rtol=2**-6, atol=1e-5) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out, ref, **tol)
    torch.testing.assert_close(dx, ref_dx, **tol)
    # dw sums a row: a flipped rounding of one term moves it by that term's ulp; norm-wise in bf16
    rel = ((dw - ref_dw).norm() / ref_dw.norm()).item()
    assert rel < (1e-3 if dtype == torch.bfloat16 else 1e-6), rel
    assert bool((dx[0] == 0).all())  # a zero weight passes no gradient to its row


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_unweighted_unpermute_keeps_only_the_indices(device):
    """Without probs the rows' gradient is a gather of the output's: the rows [N, H] are not kept."""
    tokens, hidden, topk = 6, 32, 2
    routing_map = torch.zeros(tokens, 4, dtype=torch.bool)
    routing_map[torch.arange(tokens), torch.arange(tokens) % 4] = True
    routing_map[torch.arange(tokens), (torch.arange(tokens) + 1) % 4] = True
    routing_map = routing_map.to(device)
    *_, sorted_indices = reference.moe_permute(torch.zeros(tokens, 1, device=device), routing_map)
    rows = torch.randn(tokens * topk, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    for fn in (moe.moe_unpermute, reference.moe_unpermute):
        out, kept = _saved(fn, rows, sorted_indices, (tokens, hidden), None, routing_map)
        # the indices (the reference's expanded to [N, H]: a view of N int64s)
        assert kept and all(nbytes <= 8 * tokens * topk for _, nbytes in kept), (fn.__module__, kept)
        (grad,) = torch.autograd.grad(out, rows, torch.ones_like(out))
        assert torch.equal(grad, torch.ones_like(rows))
