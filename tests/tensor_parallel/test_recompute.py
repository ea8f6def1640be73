"""Recomputation replays the host, device and TP-tracker random streams (Megatron's CheckpointFunction)."""

import contextlib

import pytest
import torch
import torch.nn.functional as F

from mcore.backend import current_backend
from mcore.tensor_parallel.random import get_rng_tracker, model_parallel_seed
from mcore.tensor_parallel.recompute import checkpoint


def _block(x, w, scale):
    y = F.dropout(x @ w, p=0.5)  # default stream
    with get_rng_tracker().fork():  # TP stream
        y = F.dropout(torch.tanh(y), p=0.5)
    return y * scale


def _run(use_checkpoint: bool):
    model_parallel_seed(11, tp_rank=1)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 6, generator=gen).requires_grad_(True)
    w = torch.randn(6, 6, generator=gen).requires_grad_(True)
    y = checkpoint(_block, x, w, 3.0) if use_checkpoint else _block(x, w, 3.0)
    y.sum().backward()
    after = (current_backend().get_rng_state(), get_rng_tracker().get_states())
    return y.detach(), x.grad, w.grad, after


def test_checkpoint_gives_the_same_values_gradients_and_rng_position():
    y0, gx0, gw0, (dev0, trk0) = _run(False)
    y1, gx1, gw1, (dev1, trk1) = _run(True)
    assert torch.equal(y0, y1) and torch.equal(gx0, gx1) and torch.equal(gw0, gw1)
    assert torch.equal(dev0, dev1)
    assert all(torch.equal(trk0[k], trk1[k]) for k in trk0)


def test_checkpoint_without_grad_just_calls():
    with torch.no_grad():
        out = checkpoint(lambda a, b: a + b, torch.ones(2), torch.ones(2))
    assert torch.equal(out, torch.full((2,), 2.0))


# -- RecomputeWhenSaved (--recompute-modules layernorm / mlp_act) --------------------------------------

_CALLS = []


def _norm(x, ln_w):
    """The recomputable producer (it keeps ``x`` and its statistics, not its output), counting calls."""
    _CALLS.append(x.shape)
    return F.layer_norm(x, (x.shape[-1],), ln_w)


def _inputs():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 8, generator=gen).requires_grad_(True)
    w = torch.randn(8, 4, generator=gen).requires_grad_(True)
    ln_w = torch.randn(8, generator=gen).requires_grad_(True)
    return x, w, ln_w


def _norm_then_linear(recompute: bool, consumer=lambda y, w: y @ w):
    """(output, grads of x, w, ln_w, activation bytes kept, producer calls in backward)."""
    from mcore.tensor_parallel.recompute import RecomputeWhenSaved
    from mcore.testing.memory import SavedActivations

    x, w, ln_w = _inputs()
    with SavedActivations(exclude=(w, ln_w)) as saved:
        y = _norm(x, ln_w)
        with RecomputeWhenSaved(y, _norm, x, ln_w) if recompute else contextlib.nullcontext():
            z = consumer(y, w)
        del y
    kept = saved.nbytes()
    saved.clear()
    _CALLS.clear()
    (z * torch.arange(float(z.numel())).view_as(z)).sum().backward()
    return z.detach(), x.grad, w.grad, ln_w.grad, kept, len(_CALLS)


def test_recompute_when_saved_keeps_a_recipe_and_gives_the_same_gradients():
    *plain, kept_plain, calls_plain = _norm_then_linear(False)
    *recomputing, kept, calls = _norm_then_linear(True)
    for a, b in zip(plain, recomputing):
        assert torch.equal(a, b)
    assert kept_plain - kept == 5 * 8 * 4, "the matmul still keeps the norm output"
    assert calls_plain == 0 and calls == 1


def test_recompute_when_saved_rebuilds_saved_views():
    """The consumer saves views (a transpose, a slice): each is taken from the recomputed output."""

    def consumer(y, w):
        return y.t().t()[1:] @ w + (y[:, :4] * y[:, 4:]).sum(-1, keepdim=True)[1:]

    *plain, _, _ = _norm_then_linear(False, consumer)
    *recomputing, _, calls = _norm_then_linear(True, consumer)
    for a, b in zip(plain, recomputing):
        assert torch.equal(a, b)
    assert calls >= 1


def test_recompute_when_saved_passes_other_tensors_to_the_outer_hooks():
    """Tensors it does not replace, and the recipe's arguments, reach the hooks active outside."""
    from mcore.tensor_parallel.recompute import RecomputeWhenSaved

    x, w, ln_w = _inputs()
    outer = []

    def pack(t):
        outer.append(t.untyped_storage().data_ptr())
        return ("outer", t)

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda packed: packed[1]):
        y = _norm(x, ln_w)
        start = len(outer)
        with RecomputeWhenSaved(y, _norm, x, ln_w):
            u = torch.sin(w)  # saves w: passed on
            z = y @ u  # saves y (replaced: its arguments x and ln_w are passed on) and u (passed on)
    inside = outer[start:]
    ptr = lambda t: t.untyped_storage().data_ptr()  # noqa: E731
    assert ptr(y) not in inside
    assert sorted(inside) == sorted([ptr(w), ptr(x), ptr(ln_w), ptr(u)])
    z.sum().backward()
    torch.testing.assert_close(w.grad, torch.cos(w) * (_norm(x, ln_w).detach().t() @ torch.ones(5, 4)))


def test_nested_recipes_keep_only_the_innermost_argument():
    """A recipe whose argument is itself recomputable (the sequence-parallel gather of a norm
    output): the inner recipe's argument becomes the outer recipe; only ``x`` stays."""
    from mcore.tensor_parallel.recompute import RecomputeWhenSaved
    from mcore.testing.memory import SavedActivations

    def gather(t):  # stands in for the all-gather along the sequence
        return torch.cat([t, t * 2])

    results = []
    for recompute in (False, True):
        x, w, ln_w = _inputs()
        with SavedActivations(exclude=(w, ln_w)) as saved:
            y = _norm(x, ln_w)
            with RecomputeWhenSaved(y, _norm, x, ln_w) if recompute else contextlib.nullcontext():
                g = gather(y)
                with RecomputeWhenSaved(g, gather, y) if recompute else contextlib.nullcontext():
                    z = g @ w
            del y, g
        kept = saved.nbytes()
        saved.clear()
        z.sum().backward()
        results.append((kept, x.grad, w.grad, ln_w.grad))
    (kept_plain, *plain), (kept, *recomputing) = results
    for a, b in zip(plain, recomputing):
        assert torch.equal(a, b)
    assert kept_plain - kept == 4 * (10 * 8), "the gathered copy is still kept"


def test_recompute_when_saved_is_inactive_without_autograd_and_for_aliases():
    from mcore.tensor_parallel.recompute import RecomputeWhenSaved

    x, w, ln_w = _inputs()
    with torch.no_grad(), RecomputeWhenSaved(x * 2, _norm, x, ln_w) as ctx:
        assert not ctx._active
    view = x[1:]  # does not own its storage
    assert not RecomputeWhenSaved(view, lambda t: t[1:], x)._active
    same = x.view(40).view(5, 8)  # aliases its argument
    assert not RecomputeWhenSaved(same, lambda t: t.view(40).view(5, 8), x)._active


def test_recompute_when_saved_with_autograd_grad_and_inside_a_checkpoint():
    """No backward pass of its own: torch.autograd.grad works (device-graph capture uses it), and so
    does a full checkpoint around it (recorded in the checkpoint's backward replay)."""
    from mcore.tensor_parallel.recompute import RecomputeWhenSaved

    def body(x, w, ln_w, recompute):
        y = _norm(x, ln_w)
        with RecomputeWhenSaved(y, _norm, x, ln_w) if recompute else contextlib.nullcontext():
            return y @ w

    x, w, ln_w = _inputs()
    expected = torch.autograd.grad(body(x, w, ln_w, False).sum(), (x, w, ln_w))
    got = torch.autograd.grad(body(x, w, ln_w, True).sum(), (x, w, ln_w))
    for a, b in zip(expected, got):
        assert torch.equal(a, b)
    checkpoint(body, x, w, ln_w, True).sum().backward()
    for a, b in zip(expected, (x.grad, w.grad, ln_w.grad)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_recompute_when_saved_rejects_a_different_recomputation():
    from mcore.tensor_parallel.recompute import RecomputeWhenSaved

    x, w, _ = _inputs()
    y = torch.tanh(x)
    with RecomputeWhenSaved(y, lambda t: torch.tanh(t[:, :4]), x):
        z = y @ w
    with pytest.raises(RuntimeError, match=r"shape \(5, 4\), not the contiguous torch.float32 \(5, 8\)"):
        z.sum().backward()
