"""The CUDA backend's Triton ``moe_unpermute`` (``backends/cuda/triton_kernels/moe_unpermute.py``)
under Triton's CPU interpreter, against the reference's forward and gradients: weighted and not,
a token no row comes back to (dropped by capacity), a hidden size not a power of two and larger
than one block, bf16 and fp32, and no row at all (a rank that received no token);
``moe_permute``'s backward, which sums each token's row gradients with the same kernel; and the
routing kernel (``triton_kernels/moe_router.py``: every score function, the scaling factor, expert
bias, tied logits, 64 experts, no token) against the reference's probs, map and logits gradient.

By hand: ``OMP_NUM_THREADS=1 TRITON_INTERPRET=1 python tests/ops/test_moe_unpermute_interpret.py``.
"""

from __future__ import annotations

import sys

from mcore.testing.interpreter import interpreter_child, needs_triton, run_under_interpreter


@needs_triton
@interpreter_child(timeout=300)
def test_moe_unpermute_kernels_under_the_interpreter():
    run_under_interpreter(__file__, timeout=300)


def _case(dtype, hidden: int, weighted: bool, empty: bool, gen):
    import torch
    from mcore.backends.cuda import moe

    from mcore.ops import reference

    tokens, experts = 9, 4
    scores = torch.rand(tokens, experts, generator=gen)
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, scores.topk(2, -1).indices, True)
    routing_map[4] = False  # token 4: every row dropped
    if empty:
        routing_map[:] = False
    probs = torch.rand(tokens, experts, generator=gen) * routing_map
    *_, sorted_indices = reference.moe_permute(torch.zeros(tokens, 1), routing_map)
    rows = torch.randn(sorted_indices.numel(), hidden, generator=gen).to(dtype)
    dout = torch.randn(tokens, hidden, generator=gen).to(dtype)
    results = []
    for fn in (moe.moe_unpermute, reference.moe_unpermute):
        r = rows.clone().requires_grad_(True)
        p = probs.clone().requires_grad_(True) if weighted else None
        out = fn(r, sorted_indices, (tokens, hidden), probs=p, routing_map=routing_map)
        out.backward(dout)
        results.append((out, r.grad, None if p is None else p.grad))
    assert moe._triton_fits(rows, sorted_indices, None)
    tokens = torch.randn(tokens, hidden, generator=gen).to(dtype)
    d_permuted = torch.randn(sorted_indices.numel(), hidden, generator=gen).to(dtype)
    for i, fn in enumerate((moe.moe_permute, reference.moe_permute)):
        t = tokens.clone().requires_grad_(True)
        permuted, _, _ = fn(t, routing_map, None, int(routing_map.sum()))
        permuted.backward(d_permuted)
        results[i] = (*results[i], permuted, t.grad)
    return results


def _main() -> int:
    import torch

    gen = torch.Generator().manual_seed(0)
    failures = 0
    for dtype, hidden, weighted, empty in (
        (torch.bfloat16, 1100, True, False),
        (torch.float32, 48, True, False),
        (torch.bfloat16, 64, False, False),
        (torch.bfloat16, 32, True, True),
    ):
        got, want = _case(dtype, hidden, weighted, empty, gen)
        names = ("out", "d_rows", "d_probs", "permute", "permute d_tokens")
        tol = 1e-5 if dtype == torch.float32 else 2**-7
        checks = [(n, g, w) for n, g, w in zip(names, got, want, strict=True) if n != "d_probs"]
        if weighted:
            checks.append(("d_probs", got[2], want[2]))
        for name, got, want in checks:
            ok = got.dtype == want.dtype and torch.allclose(got.float(), want.float(), rtol=tol, atol=tol)
            print(f"moe_unpermute {dtype} h={hidden} weighted={weighted} empty={empty} {name}: "
                  f"{'ok' if ok else 'MISMATCH'}")  # fmt: skip
            failures += not ok
    return failures + _routing_cases(gen)


_ROUTING_CASES = [
    # tokens, experts, topk, score function, pre_softmax, scaling factor, expert bias
    (37, 8, 2, "softmax", False, None, False),
    (37, 8, 2, "softmax", True, 2.5, False),
    (37, 8, 3, "sigmoid", False, None, True),
    (37, 8, 1, "sigmoid", False, 1.5, False),
    (21, 64, 8, "softmax", False, None, False),
    (0, 8, 2, "softmax", False, None, False),
]


def _routing_cases(gen) -> int:
    import torch
    from mcore.backends.cuda import moe

    from mcore.ops import reference

    failures = 0
    for case in (*_ROUTING_CASES, "ties"):
        t, e, k, score, pre, scale, bias = _ROUTING_CASES[0] if case == "ties" else case
        logits = torch.randn(t, e, generator=gen)
        if case == "ties":  # equal logits: the lowest experts win, as torch.topk picks them
            logits[:5] = 0.25
        kwargs = dict(score_function=score, pre_softmax=pre, scaling_factor=scale)
        kwargs["expert_bias"] = torch.randn(e, generator=gen) * 0.1 if bias else None
        dprobs = torch.randn(t, e, generator=gen)
        results = []
        for fn in (moe.moe_topk_routing, reference.moe_topk_routing):
            x = logits.clone().requires_grad_(True)
            probs, routing_map = fn(x, k, **kwargs)
            (probs * dprobs).sum().backward()
            results.append((probs, routing_map, x.grad, type(probs.grad_fn).__name__))
        (probs, routing_map, grad, node), (want_probs, want_map, want_grad, _) = results
        ok = node == "TopKRoutingBackward"  # the kernel served it
        if case == "ties":  # torch.topk's choice among equal values is its own (on CPU not the lowest)
            ok = ok and torch.equal(routing_map[:5], torch.arange(e).expand(5, e) < k)
            ok = ok and torch.allclose(probs[:5].sum(-1), torch.ones(5))  # softmax over k equal logits
            probs, routing_map, grad, want_probs, want_map, want_grad = (
                x[5:] for x in (probs, routing_map, grad, want_probs, want_map, want_grad)
            )
        ok = (
            ok
            and torch.equal(routing_map, want_map)
            and torch.allclose(probs, want_probs, rtol=1e-5, atol=1e-6)
            and torch.allclose(grad, want_grad, rtol=1e-5, atol=1e-6)
        )
        print(f"moe_topk_routing {case}: {'ok' if ok else 'MISMATCH'}")
        failures += not ok
    return failures


if __name__ == "__main__":  # the interpreter run, a subprocess of the test
    sys.exit(_main())
