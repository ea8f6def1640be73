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
