"""A few DDP training steps on CPU that record what equivalence tests compare."""

from __future__ import annotations

import torch

from mcore.fp8.scaling import update_fp8_scales


def sgd_steps_on_main_grad(ddp, model, data: torch.Tensor, groups, lr: float = 0.05, on_step=None):
    """One step per ``data[step]`` (``[micro_batches, 2, batch, seq]``: tokens and labels of each
    micro-batch): ``zero_grad_buffer``, forward/backward of every micro-batch, ``finish_grad_sync``,
    the FP8 scale update, then plain SGD on ``main_grad``. Returns the per-token losses (stacked, in
    order) and ``{name: main_grad}`` after each step's ``finish_grad_sync``. ``on_step()``, when
    given, runs after each step's scale update, before the SGD update (e.g. to record FP8 state)."""
    losses, grads = [], []
    for step_data in data:
        ddp.zero_grad_buffer()
        for tokens, labels in step_data:
            loss = ddp(tokens, None, None, labels=labels)
            loss.mean().backward()
            losses.append(loss.detach())
        ddp.finish_grad_sync()
        update_fp8_scales(model, (groups.tp,))
        grads.append({n: p.main_grad.clone() for n, p in model.named_parameters()})
        if on_step is not None:
            on_step()
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(lr * p.main_grad)
    return torch.stack(losses), grads
