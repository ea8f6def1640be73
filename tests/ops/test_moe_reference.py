"""The MoE reference ops' semantics (Megatron's router, permute/unpermute, grouped GEMM), each against
an independent formula or loop, and their gradients by ``gradcheck`` in float64 on tiny shapes."""

from __future__ import annotations

import pytest
import torch

from mcore.ops import reference


def _logits(t=6, e=8, seed=0, dtype=torch.float64):
    return torch.randn(t, e, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _topk_set(row: torch.Tensor, k: int) -> set[int]:
    return set(torch.topk(row, k).indices.tolist())


def test_softmax_pre_and_post():
    logits = _logits()
    pre, pre_map = reference.moe_topk_routing(logits, 3, pre_softmax=True)
    post, post_map = reference.moe_topk_routing(logits, 3)
    full = torch.softmax(logits, -1)
    for t in range(logits.shape[0]):
        chosen = _topk_set(logits[t], 3)
        assert (
            set(pre_map[t].nonzero().flatten().tolist())
            == chosen
            == set(post_map[t].nonzero().flatten().tolist())
        )
        idx = sorted(chosen)
        torch.testing.assert_close(pre[t, idx], full[t, idx])  # no renormalisation
        torch.testing.assert_close(post[t, idx], torch.softmax(logits[t, idx], -1))
    assert (pre.sum(-1) < 1).all() and torch.allclose(post.sum(-1), torch.ones(6, dtype=torch.float64))
    assert ((pre != 0) == pre_map).all() and ((post != 0) == post_map).all()
    assert (pre_map.sum(-1) == 3).all() and pre_map.dtype == torch.bool


def test_probs_are_fp32_for_half_logits():
    probs, _ = reference.moe_topk_routing(_logits(dtype=torch.bfloat16), 2)
    assert probs.dtype == torch.float32


def test_sigmoid_renormalises_and_scales_and_topk1_does_not_renormalise():
    logits = _logits()
    probs, rmap = reference.moe_topk_routing(logits, 2, score_function="sigmoid", scaling_factor=2.5)
    s = torch.sigmoid(logits)
    for t in range(6):
        idx = sorted(_topk_set(logits[t], 2))
        torch.testing.assert_close(probs[t, idx], 2.5 * s[t, idx] / s[t, idx].sum())
    torch.testing.assert_close(probs.sum(-1), torch.full((6,), 2.5, dtype=torch.float64))
    one, _ = reference.moe_topk_routing(logits, 1, score_function="sigmoid")
    torch.testing.assert_close(one.max(-1).values, s.max(-1).values)


def test_expert_bias_only_chooses():
    logits = _logits()
    bias = torch.zeros(8, dtype=torch.float64)
    bias[5] = 10.0  # expert 5 always chosen, whatever its score
    probs, rmap = reference.moe_topk_routing(logits, 2, score_function="sigmoid", expert_bias=bias)
    s = torch.sigmoid(logits)
    assert rmap[:, 5].all()
    for t in range(6):
        idx = sorted(rmap[t].nonzero().flatten().tolist())
        other = max((e for e in range(8) if e != 5), key=lambda e: s[t, e].item())
        assert set(idx) == {5, other}
        torch.testing.assert_close(probs[t, idx], s[t, idx] / s[t, idx].sum())  # unbiased weights
    with pytest.raises(ValueError, match="expert_bias"):
        reference.moe_topk_routing(logits, 2, expert_bias=bias)


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_group_limited_routing_matches_brute_force(score_function):
    logits = _logits(t=16, e=8, seed=3)
    probs, rmap = reference.moe_topk_routing(
        logits, 4, score_function=score_function, pre_softmax=True, num_groups=4, group_topk=2
    )
    scores = torch.softmax(logits, -1) if score_function == "softmax" else torch.sigmoid(logits)
    for t in range(16):
        groups = scores[t].view(4, 2)
        group_score = groups.topk(2, -1).values.sum(-1)  # topk // group_topk = 2 per group
        best = set(group_score.topk(2).indices.tolist())
        allowed = [e for e in range(8) if e // 2 in best]
        want = set(sorted(allowed, key=lambda e: -scores[t, e].item())[:4])
        assert set(rmap[t].nonzero().flatten().tolist()) == want
    # it differs from plain top-k on some token (the test would not see group limits otherwise)
    _, plain = reference.moe_topk_routing(logits, 4, score_function=score_function, pre_softmax=True)
    assert (plain != rmap).any()


def test_routing_refuses_bad_arguments():
    logits = _logits()
    with pytest.raises(ValueError, match="topk=9"):
        reference.moe_topk_routing(logits, 9)
    with pytest.raises(ValueError, match="num_experts=8 is not divisible by num_groups=3"):
        reference.moe_topk_routing(logits, 2, num_groups=3, group_topk=1)
    with pytest.raises(ValueError, match="score_function='relu'"):
        reference.moe_topk_routing(logits, 2, score_function="relu")


def _routing(t=5, e=4, k=2, seed=0, empty_expert=None):
    probs, rmap = reference.moe_topk_routing(_logits(t, e, seed), k)
    if empty_expert is not None:  # move that expert's tokens elsewhere (keeps k per row)
        for row in range(t):
            if rmap[row, empty_expert]:
                free = [x for x in range(e) if not rmap[row, x] and x != empty_expert]
                rmap[row, empty_expert], rmap[row, free[0]] = False, True
        probs = probs * rmap
    return probs, rmap


def test_permute_is_expert_major_and_unpermute_inverts_it():
    probs, rmap = _routing(empty_expert=1)
    x = torch.randn(5, 3, dtype=torch.float64)
    permuted, pprobs, idx = reference.moe_permute(x, rmap, probs, num_out_tokens=10)
    want = [(e, t) for e in range(4) for t in range(5) if rmap[t, e]]
    assert idx.tolist() == [t for _, t in want] and idx.dtype == torch.int64
    torch.testing.assert_close(permuted, x[[t for _, t in want]])
    torch.testing.assert_close(pprobs, torch.stack([probs[t, e] for e, t in want]))
    # without probs: each token comes back once per expert it went to; with them: weighted by its probs
    back = reference.moe_unpermute(permuted, idx, x.shape)
    torch.testing.assert_close(back, x * rmap.sum(-1, keepdim=True))
    weighted = reference.moe_unpermute(permuted, idx, x.shape, probs=probs, routing_map=rmap)
    torch.testing.assert_close(weighted, x * probs.sum(-1, keepdim=True))
    no_probs = reference.moe_permute(x, rmap)
    assert no_probs[1] is None
    with pytest.raises(ValueError, match="num_out_tokens=3"):
        reference.moe_permute(x, rmap, num_out_tokens=3)


def test_unpermute_accumulates_half_rows_in_fp32():
    # 1 + 2^-8 rounds back to 1 in bf16: summing these rows in bf16 would return 1.0
    rows = torch.full((4, 2), 2**-8, dtype=torch.bfloat16)
    rows[0] = 1.0
    out = reference.moe_unpermute(rows, torch.zeros(4, dtype=torch.int64), (1, 2))
    assert out.dtype == torch.bfloat16
    assert out.float()[0, 0].item() == pytest.approx(1.0 + 3 * 2**-8, abs=2**-8)


def test_no_token_routed_locally():
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    probs = torch.zeros(3, 2, dtype=torch.float64, requires_grad=True)
    rmap = torch.zeros(3, 2, dtype=torch.bool)
    permuted, pprobs, idx = reference.moe_permute(x, rmap, probs)
    assert permuted.shape == (0, 4) and pprobs.shape == (0,) and idx.shape == (0,)
    w = torch.randn(2, 5, 4, dtype=torch.float64, requires_grad=True)
    y = reference.grouped_gemm(permuted, w, torch.zeros(2, dtype=torch.int64))
    assert y.shape == (0, 5)
    out = reference.moe_unpermute(y[:, :4], idx, (3, 4), probs=probs, routing_map=rmap)
    assert torch.equal(out, torch.zeros(3, 4, dtype=torch.float64))
    out.sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x)) and torch.equal(w.grad, torch.zeros_like(w))
    assert torch.equal(probs.grad, torch.zeros_like(probs))


def test_grouped_gemm_is_a_loop_over_experts_with_an_empty_one():
    counts = torch.tensor([3, 0, 2, 1])
    x = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 7, 5, dtype=torch.float64, requires_grad=True)
    y = reference.grouped_gemm(x, w, counts)
    starts = [0, 3, 3, 5, 6]
    for e in range(4):
        torch.testing.assert_close(y[starts[e] : starts[e + 1]], x[starts[e] : starts[e + 1]] @ w[e].t())
    y.backward(torch.randn_like(y))
    assert torch.equal(w.grad[1], torch.zeros(7, 5, dtype=torch.float64))
    with pytest.raises(ValueError, match="summing to x's 6 rows"):
        reference.grouped_gemm(x, w, torch.tensor([3, 0, 2, 2]))


def test_gradients_by_gradcheck():
    gc = torch.autograd.gradcheck
    logits = _logits(4, 6, seed=1).requires_grad_()
    bias = torch.linspace(-0.5, 0.5, 6, dtype=torch.float64)
    for kwargs in (
        {"pre_softmax": True},
        {},
        {"score_function": "sigmoid", "expert_bias": bias, "scaling_factor": 2.0},
        {"score_function": "sigmoid", "num_groups": 3, "group_topk": 1},
    ):
        assert gc(lambda z, kw=kwargs: reference.moe_topk_routing(z, 2, **kw)[0], (logits,))
    probs, rmap = _routing(empty_expert=2)
    probs = probs.detach().requires_grad_()
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    assert gc(lambda a, p: reference.moe_permute(a, rmap, p)[:2], (x, probs))
    _, _, idx = reference.moe_permute(x, rmap)
    rows = torch.randn(idx.numel(), 3, dtype=torch.float64, requires_grad=True)
    assert gc(lambda r, p: reference.moe_unpermute(r, idx, (5, 3), probs=p, routing_map=rmap), (rows, probs))
    counts = rmap.sum(0)
    w = torch.randn(4, 2, 3, dtype=torch.float64, requires_grad=True)
    assert gc(lambda r, ww: reference.grouped_gemm(r, ww, counts), (rows, w))
