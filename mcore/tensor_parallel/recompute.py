"""Activation recomputation that replays the same random numbers (Megatron's ``CheckpointFunction``).

``checkpoint(fn, *args)`` runs ``fn`` without keeping its intermediate activations and runs it again
during backward. Dropout inside ``fn`` must draw the same masks both times, so the forward records
the host (torch) RNG state, the device RNG state and every stream of the TP RNG tracker, and the
recompute installs them before calling ``fn`` and restores the backward-time states afterwards.

:class:`RecomputeWhenSaved` serves cheap functions whose *output* is what the next op saves (a
norm before a linear layer, the MLP activation before ``linear_fc2``; Megatron's
``CheckpointWithoutOutput`` use): while the consumer runs, autograd saves a recipe instead of the
output, and the output is recomputed when backward unpacks it.
"""

from __future__ import annotations

import weakref
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


# The saved-tensor hooks active when a RecomputeWhenSaved context opens: it passes every tensor it
# does not replace on to them (an activation counter, CPU offloading), since only the innermost
# pair of hooks is called. Private in torch (dynamo uses it); without it nothing is chained.
_top_saved_tensor_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


class _Recipe:
    """What autograd keeps in place of a recomputable tensor: the recomputation and the view of it."""

    __slots__ = ("source", "size", "stride", "offset")

    def __init__(self, source: RecomputeWhenSaved, tensor: torch.Tensor):
        self.source = source
        self.size, self.stride, self.offset = tensor.size(), tensor.stride(), tensor.storage_offset()


class _OuterPacked:
    """A tensor packed by the saved-tensor hooks that were active outside."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value


def compiled_recompute_region(function: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
    """``function(*args)`` as a recompute region of a traced graph: what :class:`RecomputeWhenSaved`
    does in eager mode, for code under ``torch.compile`` (where saved-tensor hooks do not apply). The
    partitioner keeps ``args`` and recomputes the output in the compiled backward; ``function`` must
    draw no random numbers."""
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, preserve_rng_state=False)


class RecomputeWhenSaved:
    """Inside this context, autograd saves ``output`` as a recipe; backward recomputes it.

    ``output = function(*args)`` must be cheap and draw no random numbers (a norm, the MLP
    activation), and ``args`` should be tensors that backward keeps anyway (the residual stream the
    norm's own backward reads, fc1's output that the activation's backward reads)::

        y = norm(x)                                    # computed as usual, with autograd
        with RecomputeWhenSaved(y, norm, x):
            z, _ = linear(y)                           # saves a recipe, not y
        del y                                          # y's memory is free now

    Every tensor that an op inside the context saves for backward and that lies in ``output``'s
    storage (``output`` itself or a view of it) is replaced by a recipe holding ``function``,
    ``args`` and the view's geometry. When backward unpacks it, ``function(*args)`` runs again
    without autograd and the view is taken from the fresh result; the recomputation is shared by
    the views unpacked while it is alive. No separate backward pass runs (unlike a checkpoint), so
    it composes with ``torch.autograd.grad``, device-graph capture (the recomputation is captured
    with the backward) and outer recomputation. ``function`` may be a collective (the sequence-
    parallel all-gather of a linear layer's input): every rank unpacks at the same point of its
    backward.

    Tensors it does not replace go to the saved-tensor hooks that were active outside it, if any,
    and so do the recipe's tensor arguments: they are kept *as if saved* there. Contexts nest
    that way: the all-gather's recipe inside a linear layer keeps the local norm output, which the
    enclosing norm context turns into a recipe of its own.

    The context does nothing without autograd (``torch.no_grad``, evaluation), under
    ``torch.compile`` (compute ``output`` with :func:`compiled_recompute_region` there: the
    partitioner then recomputes it in the compiled backward), and when ``output`` does not own its storage
    (a view, or an alias of an argument): then it is saved as usual.
    """

    def __init__(self, output: torch.Tensor, function: Callable[..., torch.Tensor], *args: Any):
        self.function, self.args = function, args
        self._saved_args: tuple | None = None  # the arguments as the outer hooks packed them
        self._outer = None
        self._hooks = None
        self._latest: weakref.ref | None = None
        self._active = torch.is_grad_enabled() and not torch.compiler.is_compiling()
        if not self._active:
            return
        storage = output.untyped_storage()
        self._ptr, self._dtype, self._shape = storage.data_ptr(), output.dtype, output.shape
        self._active = (
            output.is_contiguous()
            and output.storage_offset() == 0
            and storage.nbytes() == output.numel() * output.element_size()
            and not any(
                isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() == self._ptr for a in args
            )
        )

    def __enter__(self) -> RecomputeWhenSaved:
        if self._active:
            self._outer = _top_saved_tensor_hooks(False) if _top_saved_tensor_hooks is not None else None
            self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._hooks is not None:
            self._hooks.__exit__(*exc)
            self._hooks = None
        self.args = None  # the recipes hold the arguments as packed, or nothing needs them

    def _pack(self, tensor: torch.Tensor) -> Any:
        if tensor.dtype == self._dtype and tensor.untyped_storage().data_ptr() == self._ptr:
            if self._saved_args is None:
                self._saved_args = tuple(self._pack_outer(a) for a in self.args)
            return _Recipe(self, tensor)
        return self._pack_outer(tensor)

    def _pack_outer(self, value: Any) -> Any:
        if self._outer is None or not isinstance(value, torch.Tensor):
            return value
        return _OuterPacked(self._outer[0](value))

    def _unpack(self, packed: Any) -> Any:
        if isinstance(packed, _Recipe):
            return self._recomputed().as_strided(packed.size, packed.stride, packed.offset)
        if isinstance(packed, _OuterPacked):
            return self._outer[1](packed.value)
        return packed

    def _recomputed(self) -> torch.Tensor:
        output = self._latest() if self._latest is not None else None
        if output is None:
            args = tuple(self._unpack(a) for a in self._saved_args)
            with torch.no_grad():
                output = self.function(*args)
            if output.shape != self._shape or output.dtype != self._dtype or not output.is_contiguous():
                raise RuntimeError(
                    f"recomputing {getattr(self.function, '__qualname__', self.function)} gave a "
                    f"{output.dtype} tensor of shape {tuple(output.shape)}, not the contiguous "
                    f"{self._dtype} {tuple(self._shape)} computed in forward"
                )
            self._latest = weakref.ref(output)
        return output
