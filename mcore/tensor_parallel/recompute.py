"""Activation recomputation that replays the same random numbers (Megatron's ``CheckpointFunction``).

``checkpoint(fn, *args)`` runs ``fn`` without keeping its intermediate activations and runs it again
during backward. Dropout inside ``fn`` must draw the same masks both times, so the forward records
the host (torch) RNG state, the device RNG state and every stream of the TP RNG tracker, and the
recompute installs them before calling ``fn`` and restores the backward-time states afterwards.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mcore.backend import current_backend
from mcore.tensor_parallel.random import get_rng_tracker


def _rng_snapshot() -> tuple[torch.Tensor, torch.Tensor, dict]:
    return torch.get_rng_state(), current_backend().get_rng_state(), get_rng_tracker().get_states()


def _rng_restore(snapshot: tuple[torch.Tensor, torch.Tensor, dict]) -> None:
    host, device, tracker = snapshot
    torch.set_rng_state(host)
    current_backend().set_rng_state(device)
    get_rng_tracker().set_states(tracker)


class _CheckpointFunction(torch.autograd.Function):
    """Forward: run ``fn`` under no_grad, keep inputs and RNG states. Backward: replay, then backprop."""

    @staticmethod
    def forward(ctx, run_function, *args):
        ctx.run_function = run_function
        ctx.rng = _rng_snapshot()
        with torch.no_grad():
            outputs = run_function(*args)
        tensor_index = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        ctx.tensor_index = tensor_index
        ctx.others = [None if isinstance(a, torch.Tensor) else a for a in args]
        ctx.save_for_backward(*(args[i] for i in tensor_index))
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("recompute checkpoints do not support torch.autograd.grad(); use backward()")
        args = list(ctx.others)
        for i, saved in zip(ctx.tensor_index, ctx.saved_tensors):
            args[i] = saved.detach().requires_grad_(saved.requires_grad)
        backward_rng = _rng_snapshot()
        _rng_restore(ctx.rng)
        try:
            with torch.enable_grad():
                outputs = ctx.run_function(*args)
        finally:
            _rng_restore(backward_rng)
        if isinstance(outputs, torch.Tensor):
            outputs = (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads) if isinstance(o, torch.Tensor) and o.requires_grad]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        input_grads = tuple(a.grad if isinstance(a, torch.Tensor) else None for a in args)
        return (None, *input_grads)


def checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)``, recomputed in backward instead of storing its activations.

    Tensor arguments are saved (not the activations inside ``function``); non-tensor arguments
    (``None``, numbers) are passed through. Returns what ``function`` returns (a tensor or a tuple of
    tensors). Without autograd (evaluation, ``torch.no_grad``) it simply calls ``function``.
    """
    if not torch.is_grad_enabled():
        return function(*args)
    return _CheckpointFunction.apply(function, *args)
