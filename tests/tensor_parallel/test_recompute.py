"""Recomputation replays the host, device and TP-tracker random streams (Megatron's CheckpointFunction)."""

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


# -- CheckpointWithoutOutput (--recompute-modules layernorm / mlp_act) ---------------------------------


def _norm_then_linear(x, w, ln_w, use_ckpt: bool, nested: bool = False):
    """``tanh(layer_norm(x)) @ w``; the norm output is what the matmul saves (and what is discarded)."""
    from mcore.tensor_parallel.recompute import CheckpointWithoutOutput

    def body(x, w):
        norm = lambda t: torch.tanh(F.layer_norm(t, (t.shape[-1],), ln_w))  # noqa: E731
        if not use_ckpt:
            return norm(x) @ w
        ckpt = CheckpointWithoutOutput()
        y = ckpt.checkpoint(norm, x)
        z = y @ w
        ckpt.discard_output_and_register_recompute(z)
        _norm_then_linear.discarded = y.untyped_storage().nbytes() == 0 if torch.is_grad_enabled() else None
        return z

    return checkpoint(body, x, w) if nested else body(x, w)


def _grads(use_ckpt: bool, nested: bool = False):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 8, generator=gen).requires_grad_(True)
    w = torch.randn(8, 4, generator=gen).requires_grad_(True)
    ln_w = torch.randn(8, generator=gen).requires_grad_(True)
    z = _norm_then_linear(x, w, ln_w, use_ckpt, nested)
    (z * torch.arange(20.0).view(5, 4)).sum().backward()
    return z.detach(), x.grad, w.grad, ln_w.grad


def test_checkpoint_without_output_frees_the_output_and_gives_the_same_gradients():
    plain = _grads(False)
    discarding = _grads(True)
    assert _norm_then_linear.discarded, "the norm output's storage was not freed"
    for a, b in zip(plain, discarding):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_checkpoint_without_output_inside_a_full_checkpoint():
    """The no-grad forward of the outer checkpoint does not discard; its backward replay does."""
    plain = _grads(False)
    nested = _grads(True, nested=True)
    assert _norm_then_linear.discarded  # set by the replay in backward
    for a, b in zip(plain, nested):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_checkpoint_without_output_keeps_outputs_that_alias_an_input_and_no_grad_calls():
    from mcore.tensor_parallel.recompute import CheckpointWithoutOutput

    x = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(4, 4, requires_grad=True)
    ckpt = CheckpointWithoutOutput()
    y = ckpt.checkpoint(lambda t: t.view(12).view(3, 4), x)
    z = y @ w
    ckpt.discard_output_and_register_recompute(z)
    assert y.untyped_storage().nbytes() == x.untyped_storage().nbytes()  # not freed: it is x
    z.sum().backward()
    torch.testing.assert_close(x.grad, w.sum(1).expand(3, 4))
    with torch.no_grad():
        ckpt = CheckpointWithoutOutput()
        y = ckpt.checkpoint(torch.tanh, x)
        ckpt.discard_output_and_register_recompute(y @ w)
        assert torch.equal(y, torch.tanh(x))


def test_checkpoint_without_output_replays_random_numbers():
    """A function that draws random numbers (dropout, on the default and the TP stream) recomputes
    the same output (``preserve_rng_state=True``, the default)."""
    from mcore.tensor_parallel.recompute import CheckpointWithoutOutput

    def run(discard: bool):
        model_parallel_seed(5, tp_rank=0)
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(4, 6, generator=gen).requires_grad_(True)
        w = torch.randn(6, 3, generator=gen).requires_grad_(True)
        if discard:
            ckpt = CheckpointWithoutOutput()
            y = ckpt.checkpoint(_block, x, torch.eye(6), 1.0)
            z = y @ w
            ckpt.discard_output_and_register_recompute(z)
        else:
            z = _block(x, torch.eye(6), 1.0) @ w
        z.sum().backward()
        return z.detach(), x.grad, w.grad

    for a, b in zip(run(False), run(True)):
        assert torch.equal(a, b)
