"""The NPU backend's MoE adapters against the SIMULATED torch_npu: the simulated kernels follow the CANN
documentation's formulas (NPU ``sorted_indices`` convention, no autograd of their own), the adapters
call them the documented way (``npu_grouped_matmul`` group_type 0 and 2 with counts, the routing-map
permute/unpermute and their ``_grad`` ops) and fall back where the kernels do not apply. The numbers
against the reference are the conformance suite's (test_simulated_npu_conformance.py)."""

from __future__ import annotations

import pytest
import torch
from mcore.backends.npu.ops import build_npu_ops

from mcore.ops import reference


def _spy(module, name):
    calls, original = [], getattr(module, name)

    def wrapper(*args, **kwargs):
        calls.append((args, kwargs))
        return original(*args, **kwargs)

    setattr(module, name, wrapper)
    return calls


def _routing(t=6, e=4, k=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    index = torch.rand(t, e, generator=gen).topk(k, dim=-1).indices
    routing_map = torch.zeros(t, e, dtype=torch.bool).scatter_(1, index, True)
    return torch.rand(t, e, generator=gen) * routing_map, routing_map


def test_simulated_permute_follows_the_cann_formulas(simulated_npu):
    probs, rmap = _routing()
    tokens = torch.randn(6, 8, requires_grad=True)
    permuted, pprobs, npu_idx = simulated_npu.npu_moe_token_permute_with_routing_map(
        tokens, rmap, probs=probs, num_out_tokens=12
    )
    assert npu_idx.dtype == torch.int32 and permuted.grad_fn is None  # no autograd of its own
    ours = torch.arange(6).expand(4, 6).masked_select(rmap.t())  # Megatron's: token of each row
    assert torch.equal(npu_idx.long(), torch.argsort(ours, stable=True))  # sortedIndicesOut = argSort(...)
    for i in range(12):
        assert torch.equal(permuted[npu_idx[i]], tokens.detach()[i // 2])
    assert torch.equal(pprobs, probs.t().masked_select(rmap.t()))
    out, *_ = simulated_npu._npu_moe_token_unpermute_with_routing_map(
        permuted, npu_idx, [6, 8], probs=probs, routing_map=rmap
    )
    torch.testing.assert_close(out, tokens.detach() * probs.sum(-1, keepdim=True))
    with pytest.raises(RuntimeError, match="same number"):
        ragged = rmap.clone()
        ragged[0] = True
        simulated_npu.npu_moe_token_permute_with_routing_map(tokens, ragged)


def test_simulated_grouped_matmul_forms_and_checks(simulated_npu):
    x, w = torch.randn(5, 8, dtype=torch.bfloat16), torch.randn(3, 8, 4, dtype=torch.bfloat16)
    counts = torch.tensor([2, 0, 3])
    (y,) = simulated_npu.npu_grouped_matmul(
        [x], [w], group_list=counts, split_item=3, group_type=0, group_list_type=1
    )
    (y0,) = simulated_npu.npu_grouped_matmul(
        [x], [w], group_list=counts.cumsum(0), split_item=3, group_type=0
    )
    torch.testing.assert_close(y, y0)
    torch.testing.assert_close(y[2:].float(), (x[2:].float() @ w[2].float()).bfloat16().float())
    dy = torch.randn(5, 4, dtype=torch.bfloat16)
    (dw,) = simulated_npu.npu_grouped_matmul(
        [x.t()], [dy], group_list=counts, split_item=3, group_type=2, group_list_type=1
    )
    assert dw.shape == (3, 8, 4) and not dw[1].any()
    with pytest.raises(RuntimeError, match="sum to the grouped axis"):
        simulated_npu.npu_grouped_matmul(
            [x], [w], group_list=torch.tensor([2, 0, 2]), split_item=3, group_type=0, group_list_type=1
        )
    with pytest.raises(NotImplementedError, match="bias"):
        simulated_npu.npu_grouped_matmul(
            [x], [w], bias=[torch.zeros(4)], group_list=counts, split_item=3, group_type=0
        )
    with pytest.raises(TypeError, match="lists"):
        simulated_npu.npu_grouped_matmul(x, w, group_list=counts, split_item=3, group_type=0)


def test_adapters_call_the_training_kernels(simulated_npu):
    ops = build_npu_ops(simulated_npu)
    gmm = _spy(simulated_npu, "npu_grouped_matmul")
    permute_grad = _spy(simulated_npu, "npu_moe_token_permute_with_routing_map_grad")
    unpermute_grad = _spy(simulated_npu, "npu_moe_token_unpermute_with_routing_map_grad")
    probs, rmap = _routing()
    probs.requires_grad_()
    tokens = torch.randn(6, 16, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(4, 16, 16, dtype=torch.bfloat16, requires_grad=True)
    permuted, pprobs, idx = ops["moe_permute"](tokens, rmap, probs, 12)
    assert idx.dtype == torch.int64 and torch.equal(idx, reference.moe_permute(tokens, rmap)[2])
    y = ops["grouped_gemm"](permuted, w, rmap.sum(0))
    out = ops["moe_unpermute"](y, idx, (6, 16), probs=probs, routing_map=rmap)
    (out.float().sum() + pprobs.sum()).backward()
    forward, dgrad, wgrad = (kwargs for _, kwargs in gmm)
    assert forward["group_type"] == dgrad["group_type"] == 0 and wgrad["group_type"] == 2
    assert all(k["split_item"] == 3 and k["group_list_type"] == 1 for _, k in gmm)
    assert gmm[0][0][1][0].shape == (4, 16, 16) and gmm[2][0][0][0].shape == (16, 12)  # W^T; dy^T for dW
    assert len(permute_grad) == 1 and permute_grad[0][0][1] is not None  # the probs' gradient too
    assert len(unpermute_grad) == 1 and unpermute_grad[0][1]["probs"] is probs
    assert tokens.grad is not None and w.grad is not None and probs.grad is not None


def test_adapters_fall_back_where_the_kernels_do_not_apply(simulated_npu):
    ops = build_npu_ops(simulated_npu)
    calls = [
        _spy(simulated_npu, name)
        for name in (
            "npu_grouped_matmul",
            "npu_moe_token_permute_with_routing_map",
            "_npu_moe_token_unpermute_with_routing_map",
        )
    ]
    probs, rmap = _routing()
    ragged = rmap.clone()
    ragged[0, :] = False  # a map cut to this rank's experts: rows route 0..k experts
    tokens = torch.randn(6, 8)
    for routing_map in (ragged, torch.zeros_like(rmap)):  # ... and a rank that receives no token
        got = ops["moe_permute"](tokens, routing_map, probs)
        want = reference.moe_permute(tokens, routing_map, probs)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
        rows = torch.randn(want[0].shape[0], 8)
        out = ops["moe_unpermute"](rows, want[2], (6, 8), probs=probs, routing_map=routing_map)
        assert torch.equal(
            out, reference.moe_unpermute(rows, want[2], (6, 8), probs=probs, routing_map=routing_map)
        )
    x, w = torch.randn(3, 8), torch.randn(2, 4, 8)  # fp32: the reference
    torch.testing.assert_close(
        ops["grouped_gemm"](x, w, torch.tensor([1, 2])), reference.grouped_gemm(x, w, torch.tensor([1, 2]))
    )
    empty = ops["grouped_gemm"](torch.zeros(0, 8, dtype=torch.bfloat16), w.bfloat16(), torch.tensor([0, 0]))
    assert empty.shape == (0, 4)
    assert calls == [[], [], []]


def test_scaled_grouped_gemm_calls_the_per_token_quantized_matmul(simulated_npu):
    """int8 operands go to ``npu_grouped_matmul``'s documented per-token form (``scale`` bf16 for a bf16
    output, fp32 for fp16; ``per_token_scale`` fp32; an expert with no token) and equal the reference;
    FP8 operands (not documented for the op) and fp32 outputs run the reference; the simulator refuses
    an undocumented scale/output pair."""
    calls = _spy(simulated_npu, "npu_grouped_matmul")
    ops = build_npu_ops(simulated_npu)
    gen = torch.Generator().manual_seed(0)
    counts = torch.tensor([4, 0, 7])
    a = torch.randint(-127, 128, (11, 32), generator=gen, dtype=torch.int8)
    b = torch.randint(-127, 128, (3, 16, 32), generator=gen, dtype=torch.int8)
    sa, sb = torch.rand(11, generator=gen) * 1e-2, torch.rand(3, 16, generator=gen) * 1e-2
    for out_dtype in (torch.bfloat16, torch.float16):
        got = ops["scaled_grouped_gemm"](a, b, sa, sb, counts, out_dtype)
        want = reference.scaled_grouped_gemm(a, b, sa, sb, counts, out_dtype)
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-3)
    assert [c[1]["scale"][0].dtype for c in calls] == [torch.bfloat16, torch.float32]
    assert all(c[1]["group_type"] == 0 and c[1]["per_token_scale"][0].dtype == torch.float32 for c in calls)
    fp8 = (
        a.float().to(torch.float8_e4m3fn),
        b.float().to(torch.float8_e4m3fn),
        sa,
        sb,
        counts,
        torch.bfloat16,
    )
    ops["scaled_grouped_gemm"](*fp8)
    ops["scaled_grouped_gemm"](a, b, sa, sb, counts, torch.float32)
    assert len(calls) == 2
    with pytest.raises(TypeError, match="scale bf16 with output_dtype bf16"):
        simulated_npu.npu_grouped_matmul(
            [a], [b.transpose(1, 2)], scale=[sb], per_token_scale=[sa], group_list=counts,
            split_item=3, group_type=0, group_list_type=1, output_dtype=torch.bfloat16,
        )  # fmt: skip
