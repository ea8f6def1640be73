"""Activation recomputation that replays the same random numbers (Megatron's ``CheckpointFunction``).

``checkpoint(fn, *args)`` runs ``fn`` without keeping its intermediate activations and runs it again
during backward. Dropout inside ``fn`` must draw the same masks both times, so the forward records
the host (torch) RNG state, the device RNG state and every stream of the TP RNG tracker, and the
recompute installs them before calling ``fn`` and restores the backward-time states afterwards.

:class:`CheckpointWithoutOutput` (Megatron's class of that name) goes one step further for cheap
functions whose *output* is what the next op saves (a norm before a linear layer, the MLP
activation before ``linear_fc2``): the output's storage is freed once that consumer has saved it,
and refilled by recomputation in a gradient hook that runs before the consumer's backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint

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


class _CheckpointWithoutOutputFunction(torch.autograd.Function):
    """Forward: ``function(*args)`` under no_grad, keeping the tensor arguments and the RNG states.

    Backward: backpropagate through the recomputed ``function``. The recomputation normally ran
    already, in the gradient hook of :meth:`CheckpointWithoutOutput.discard_output_and_register_recompute`
    (it also refilled the discarded output); otherwise it runs here.
    """

    @staticmethod
    def forward(ctx, run_function, owner, *args):
        ctx.run_function = run_function
        ctx.rng = _rng_snapshot() if owner.preserve_rng_state else None
        ctx.recomputed = None
        with torch.no_grad():
            outputs = run_function(*args)
        ctx.tensor_index = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        ctx.others = [None if isinstance(a, torch.Tensor) else a for a in args]
        ctx.save_for_backward(*(args[i] for i in ctx.tensor_index))
        owner._ctx = ctx
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        if ctx.recomputed is None:  # the output was not discarded: recompute now
            ctx.recomputed = _rerun(ctx)
        args, outputs = ctx.recomputed
        ctx.recomputed = None
        pairs = [
            (o, g)
            for o, g in zip(outputs, grads)
            if isinstance(o, torch.Tensor) and o.requires_grad and g is not None
        ]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, *(a.grad if isinstance(a, torch.Tensor) else None for a in args))


def _rerun(ctx, saved_storages: set[int] | None = None) -> tuple[list, tuple]:
    """Run ``ctx.run_function`` again on the saved arguments with autograd, under the forward's RNG.

    ``saved_storages``: if given, receives the storage addresses of the tensors the recomputation
    saves for its own backward.
    """
    if not torch.autograd._is_checkpoint_valid():
        raise RuntimeError("recompute checkpoints do not support torch.autograd.grad(); use backward()")
    args = list(ctx.others)
    for i, saved in zip(ctx.tensor_index, ctx.saved_tensors):
        args[i] = saved.detach().requires_grad_(saved.requires_grad)
    if saved_storages is None:
        hooks = contextlib.nullcontext()
    else:

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved_storages.add(t.untyped_storage().data_ptr())
            return t

        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    backward_rng = None if ctx.rng is None else _rng_snapshot()
    if ctx.rng is not None:
        _rng_restore(ctx.rng)
    try:
        with torch.enable_grad(), hooks:
            outputs = ctx.run_function(*args)
    finally:
        if backward_rng is not None:
            _rng_restore(backward_rng)
    return args, (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)


def _same_layout(out: torch.Tensor, new: torch.Tensor, out_storage_bytes: int) -> bool:
    """``new``'s storage holds ``new`` exactly where ``out``'s held ``out``."""
    return (
        new.untyped_storage().nbytes() == out_storage_bytes
        and new.dtype == out.dtype
        and new.device == out.device
        and new.size() == out.size()
        and new.stride() == out.stride()
        and new.storage_offset() == out.storage_offset()
    )


class CheckpointWithoutOutput:
    """Run a function without keeping its graph, and free its output once the consumer saved it.

    Megatron-core's ``CheckpointWithoutOutput`` (``--recompute-modules layernorm``/``moe_act``). Use
    one object per call site and step::

        ckpt = CheckpointWithoutOutput()
        y = ckpt.checkpoint(norm, x)           # keeps x (and the RNG states), not norm's internals
        z, _ = linear(y)                       # the consumer saves y for its weight gradient
        ckpt.discard_output_and_register_recompute(z)   # y's storage is freed now

    In backward, a hook on ``z``'s gradient recomputes ``norm(x)`` and puts it into ``y``'s storage
    before ``linear``'s backward reads it, then backpropagates through the recomputed graph when
    ``y``'s gradient arrives. Every view of ``y`` saved by the consumer sees the refilled storage,
    and version counters are untouched: the recomputed memory is handed over to ``y``'s storage
    (``UntypedStorage._swap_data_ptr_``, as Megatron's zero-copy ``share_storage``), or copied into
    it where that is not possible. So the memory saved is ``y``
    itself (plus whatever ``function`` would have saved internally); ``function``'s tensor arguments
    are kept, which costs nothing when they are saved anyway (the residual stream, fc1's output).

    Rules for the caller: ``y`` must not be read after the discard except through the consumer's
    saved tensors, and ``z`` must be computed from ``y`` by the consumer, so that ``z``'s gradient
    is ready before the consumer's backward needs ``y``. Outputs that share storage with an
    argument are never discarded.

    ``preserve_rng_state=False`` skips recording and replaying the RNG states (host, device, TP
    tracker), which costs host time on every call: for functions that draw no random numbers.

    Without autograd (``torch.no_grad``, evaluation) ``checkpoint`` just calls ``function`` and the
    discard does nothing. Under ``torch.compile`` (a compiled layer, see the ``compile_layers``
    capability) the call becomes ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``,
    which dynamo traces as a recompute region: the partitioner then saves ``function``'s inputs and
    recomputes its output in the backward graph, the same saving with no storage tricks.
    """

    def __init__(self, preserve_rng_state: bool = True):
        self.preserve_rng_state = preserve_rng_state
        self._ctx = None
        self._outputs: tuple[torch.Tensor, ...] | None = None
        self._sizes: list[int] | None = None
        self._input_storages: set[int] = set()

    def checkpoint(self, function: Callable[..., Any], *args: Any) -> Any:
        """``function(*args)`` (one tensor or a tuple of tensors), recomputable without its output."""
        if not torch.is_grad_enabled():
            return function(*args)
        if torch.compiler.is_compiling():
            return torch.utils.checkpoint.checkpoint(
                function, *args, use_reentrant=False, preserve_rng_state=self.preserve_rng_state
            )
        if self._ctx is not None or self._outputs is not None:
            raise RuntimeError("a CheckpointWithoutOutput object checkpoints one call; create a new one")
        outputs = _CheckpointWithoutOutputFunction.apply(function, self, *args)
        self._outputs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
        self._input_storages = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        return outputs

    def discard_output_and_register_recompute(self, hook_tensor: torch.Tensor) -> None:
        """Free the output's storage now; refill it when ``hook_tensor``'s gradient is computed.

        Does nothing when ``checkpoint`` did not record a graph (no autograd, ``torch.compile``) or
        when ``hook_tensor`` does not require a gradient (no backward will need the output).
        """
        if self._outputs is None or self._ctx is None or not hook_tensor.requires_grad:
            self._outputs = None
            return
        self._sizes = []
        for out in self._outputs:
            storage = out.untyped_storage()
            self._sizes.append(storage.nbytes())
            if storage.data_ptr() not in self._input_storages:
                storage.resize_(0)
        hook_tensor.register_hook(self._recompute)

    def _recompute(self, grad: torch.Tensor) -> None:
        ctx = self._ctx
        if ctx is None:  # already refilled (the hook tensor's gradient was computed twice)
            return
        self._ctx = None
        saved_storages: set[int] = set()
        args, outputs = _rerun(ctx, saved_storages)
        keep = saved_storages | {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        with torch.no_grad():
            for out, size, new in zip(self._outputs, self._sizes, outputs):
                storage = out.untyped_storage()
                if storage.nbytes() == size:  # never discarded (aliases an argument)
                    continue
                # The backward through the recomputed graph needs ``new``'s autograd node, not its
                # values (unless that graph saved them), so ``new``'s memory can become ``out``'s.
                new_storage = new.untyped_storage()
                free_new = new_storage.data_ptr() not in keep
                if free_new and _same_layout(out, new, size) and hasattr(storage, "_swap_data_ptr_"):
                    storage._swap_data_ptr_(new_storage)  # zero-copy; version counters untouched
                    continue
                storage.resize_(size)
                # Write through a fresh alias: ``out``'s own version counter (and its saved views')
                # stays as the consumer recorded it.
                alias = torch.empty(0, dtype=out.dtype, device=out.device)
                alias.set_(storage, out.storage_offset(), out.size(), out.stride())
                alias.copy_(new.detach())
                if free_new:
                    new_storage.resize_(0)
        ctx.recomputed = (args, outputs)
        self._outputs = self._sizes = None
