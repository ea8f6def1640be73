"""The NPU backend's context-parallel attention ops (``backends/npu/cp_ops.py``) and the SIMULATED
torch_npu kernels they call (``npu_fusion_attention``'s statistics, ``npu_fusion_attention_grad`` from
given statistics, ``npu_ring_attention_update``): what the adapters send, and that a causal sequence
cut into the ring's blocks gives the unsplit attention's results and gradients through them. The
conformance suite (test_simulated_npu_conformance.py) checks the ops against the reference too."""

from __future__ import annotations

import math

import pytest
import torch
from mcore.backends.npu.ops import build_npu_ops

from mcore.ops import reference

LSE_OPS = ("attention_with_lse", "attention_with_lse_backward", "attention_merge")


def _qkv(b=2, n=4, g=2, sq=8, sk=8, d=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(b, heads, s, d, generator=gen) for heads, s in ((n, sq), (g, sk), (g, sk))]


def _spy(module, name):
    calls = []
    original = getattr(module, name)

    def wrapper(*args, **kwargs):
        calls.append((args, kwargs))
        return original(*args, **kwargs)

    setattr(module, name, wrapper)
    return calls


def test_npu_backend_serves_the_cp_ops(simulated_npu):
    from mcore.plugins.manager import select_backend

    backend = select_backend("npu")
    assert all(backend.ops.provider(op) == "npu" for op in LSE_OPS)


def test_forward_call_conventions_and_lse_from_the_statistics(simulated_npu):
    ops = build_npu_ops(simulated_npu)
    calls = _spy(simulated_npu, "npu_fusion_attention")
    for (sq, sk, causal), mode in (((8, 8, True), 2), ((4, 8, True), 3), ((8, 4, False), None)):
        q, k, v = _qkv(n=8, g=2, sq=sq, sk=sk)
        out, lse = ops["attention_with_lse"](q, k, v, causal=causal, scale=0.3)
        args, kwargs = calls[-1]
        assert args[3:] == (8, "BNSD") and args[1].shape[1] == 2 and kwargs["scale"] == 0.3
        assert kwargs.get("sparse_mode") == mode and (mode is None) == ("atten_mask" not in kwargs)
        want_out, want_lse = reference.attention_with_lse(q, k, v, causal=causal, scale=0.3)
        torch.testing.assert_close(out, want_out)
        torch.testing.assert_close(lse, want_lse)
    # more queries than keys, causal: the first rows see no key and never reach the kernel
    q, k, v = _qkv(sq=12, sk=8)
    out, lse = ops["attention_with_lse"](q, k, v)
    assert calls[-1][0][0].shape[2] == 8 and calls[-1][1]["sparse_mode"] == 2
    assert torch.isneginf(lse[:, :, :4]).all() and (out[:, :, :4] == 0).all()
    torch.testing.assert_close(lse, reference.attention_with_lse(q, k, v)[1])


def _ring(ops, q, k, v, dout, causal_pairs):
    """Blocks (query rows, key rows, causal) merged per query chunk, then each block's backward."""
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:3], float("-inf"))
    for qs, ks, causal in causal_pairs:
        part = ops["attention_with_lse"](q[:, :, qs], k[:, :, ks], v[:, :, ks], causal=causal)
        out[:, :, qs], lse[:, :, qs] = ops["attention_merge"](out[:, :, qs], lse[:, :, qs], *part)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for qs, ks, causal in causal_pairs:
        g = ops["attention_with_lse_backward"](
            dout[:, :, qs], q[:, :, qs], k[:, :, ks], v[:, :, ks], out[:, :, qs], lse[:, :, qs], causal=causal
        )
        dq[:, :, qs] += g[0]
        dk[:, :, ks] += g[1]
        dv[:, :, ks] += g[2]
    return out, lse, dq, dk, dv


def test_ring_blocks_through_the_kernels_equal_unsplit_attention(simulated_npu):
    """Two chunks, starting from an empty (-inf) accumulator: every merge takes a -inf side."""
    ops = build_npu_ops(simulated_npu)
    grads = _spy(simulated_npu, "npu_fusion_attention_grad")
    updates = _spy(simulated_npu, "npu_ring_attention_update")
    q, k, v = _qkv(n=4, g=2, sq=16, sk=16)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(3))
    pairs = [
        (slice(0, 8), slice(0, 8), True),
        (slice(8, 16), slice(0, 8), False),
        (slice(8, 16), slice(8, 16), True),
    ]
    out, lse, dq, dk, dv = _ring(ops, q, k, v, dout, pairs)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want = reference.attention(*leaves)
    want.backward(dout)
    torch.testing.assert_close(out, want.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, reference.attention_with_lse(q, k, v)[1], rtol=1e-5, atol=1e-5)
    for got, leaf in zip((dq, dk, dv), leaves):
        torch.testing.assert_close(got, leaf.grad, rtol=1e-4, atol=1e-5)
    args, kwargs = grads[-1]
    assert args[4:] == (4, "BNSD") and kwargs["scale_value"] == pytest.approx(1 / math.sqrt(16))
    assert kwargs["softmax_max"].shape == (2, 4, 8, 8) and (kwargs["softmax_sum"] == 1).all()
    assert kwargs["attention_in"] is not None
    args, kwargs = updates[0]
    assert len(args) == 6 and kwargs == {}  # SBH by default in torch_npu and MindSpeed alike
    assert args[0].shape == (8, 2, 4 * 16) and args[1].shape == (2, 4, 8, 8)
    assert (args[1] == -1e30).all() and torch.isfinite(args[4]).all()  # the empty side's floor


def test_merge_of_two_rows_without_keys_is_zero_and_minus_inf(simulated_npu):
    ops = build_npu_ops(simulated_npu)
    out_a, out_b = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    lse_a, lse_b = torch.randn(1, 2, 4), torch.randn(1, 2, 4)
    lse_a[..., :2] = lse_b[..., 0] = float("-inf")
    out_a[..., :2, :] = out_b[..., 0, :] = 0
    got = ops["attention_merge"](out_a.bfloat16(), lse_a, out_b.bfloat16(), lse_b)
    want = reference.attention_merge(out_a.bfloat16(), lse_a, out_b.bfloat16(), lse_b)
    assert got[0].dtype == torch.bfloat16 and torch.isneginf(got[1][..., 0]).all()
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])


def test_simulated_ring_attention_update_formula_layouts_and_checks(simulated_npu):
    gen = torch.Generator().manual_seed(0)
    s, b, n, d = 4, 2, 3, 8
    outs = [torch.randn(s, b, n * d, generator=gen) for _ in range(2)]
    stats = [torch.rand(b, n, s, 1, generator=gen).expand(b, n, s, 8) + 0.5 for _ in range(4)]
    out, m, l_ = simulated_npu.npu_ring_attention_update(
        outs[0], stats[0], stats[1], outs[1], stats[2], stats[3]
    )
    lse = [(mx + torch.log(sm))[..., 0] for mx, sm in ((stats[0], stats[1]), (stats[2], stats[3]))]
    bnsd = [o.view(s, b, n, d).permute(1, 2, 0, 3) for o in outs]
    want_out, want_lse = reference.attention_merge(bnsd[0], lse[0], bnsd[1], lse[1])
    torch.testing.assert_close(out.view(s, b, n, d).permute(1, 2, 0, 3), want_out)
    torch.testing.assert_close((m + torch.log(l_))[..., 0], want_lse)
    assert m.shape == l_.shape == (b, n, s, 8)
    # TND: [T, N, D] with [T, N, 8] statistics and cumulative lengths
    tnd = [o.view(s, b, n, d).transpose(0, 1).reshape(s * b, n, d) for o in outs]
    tstats = [t.permute(0, 2, 1, 3).reshape(b * s, n, 8) for t in stats]
    out_t, *_ = simulated_npu.npu_ring_attention_update(
        tnd[0], tstats[0], tstats[1], tnd[1], tstats[2], tstats[3], actual_seq_qlen=torch.tensor([0, s, 2 * s]),
        input_layout="TND", input_softmax_layout="TND",
    )  # fmt: skip
    torch.testing.assert_close(out_t, want_out.transpose(1, 2).reshape(b * s, n, d))
    with pytest.raises(RuntimeError, match="last dimension to be 8"):
        simulated_npu.npu_ring_attention_update(
            outs[0], *[t[..., :4] for t in stats[:2]], outs[1], *[t[..., :4] for t in stats[2:]]
        )
    with pytest.raises(RuntimeError, match="float32"):
        simulated_npu.npu_ring_attention_update(outs[0], stats[0].double(), *stats[1:2], outs[1], *stats[2:])
    with pytest.raises(TypeError):
        simulated_npu.npu_ring_attention_update(*outs[:1], *stats[:2], outs[1], *stats[2:], layout="SBH")


def test_cp_ops_fall_back_where_the_kernels_cannot(simulated_npu):
    ops = build_npu_ops(simulated_npu)
    calls = _spy(simulated_npu, "npu_fusion_attention")
    q, k, v = (t.double() for t in _qkv())
    torch.testing.assert_close(
        ops["attention_with_lse"](q, k, v)[0], reference.attention_with_lse(q, k, v)[0]
    )
    q, k, v = _qkv(n=6, g=4)  # query heads not a multiple of K/V heads: the reference's error
    with pytest.raises(ValueError, match="multiple"):
        ops["attention_with_lse"](q, k, v)
    assert calls == []
