"""The step's first weight gradient written over ``main_grad`` instead of added to a zeroed one.

With gradient-accumulation fusion the FP8 linears' weight-gradient GEMM (``torch._scaled_mm``, no
beta) cannot add into ``main_grad``: it writes ``dW`` to a temporary that is then added. But right
after :meth:`~mcore.distributed.ddp.DistributedDataParallel.zero_grad_buffer` a weight's
``main_grad`` is zero until its first gradient of the step arrives, so that first GEMM may write its
result straight into ``main_grad``: no add, and the buffer's zeroing can skip those regions. Only
later gradients of the same step (the other micro-batches) add.

The invariant: **the main_grad of an opted-in weight is zero from zero_grad_buffer until its first
gradient of the step is written, not added.** Its memory meanwhile holds stale values (the previous
step's gradient), which nothing may read or add to. Two attributes on the parameter carry it:

* ``param.overwrites_first_grad`` (the opt-in): the layer that owns the weight writes its first
  gradient of a step with the overwriting form (:func:`take_first_write`). Written in the owner's
  forward, like ``grad_added_to_main_grad``: the FP8 linears with the FP8 weight gradient, in eager
  mode (a compiled backward is traced once and cannot look at the flag), through
  :func:`mcore.tensor_parallel.layers.fusion_main_grad`; the MoE experts' grouped weights, whose
  gradient the grouped GEMM returns and the backward then writes over ``main_grad``
  (:func:`mcore.tensor_parallel.weight_grad.grad_into_main_grad`), or, without gradient-accumulation
  fusion, the DDP hook does (:func:`opt_in_hook_writes`).
* ``param.main_grad_unwritten`` (the step's flag): set by ``zero_grad_buffer`` for the opted-in
  weights whose region it did not zero; cleared by the first write (:func:`take_first_write`) or by
  :func:`zero_if_unwritten`.

Every other path that could touch such a ``main_grad`` first calls :func:`zero_if_unwritten`, so a
stale value can never leak: a use of the weight that adds its gradient (a fusing layer's forward
without the overwriting form), and the gradient
reduction of its bucket (a weight that received no gradient in the step: an unused parameter, a
skipped layer).
"""

from __future__ import annotations

import torch

OPT_IN = "overwrites_first_grad"
UNWRITTEN = "main_grad_unwritten"


def opts_in(param: torch.nn.Parameter) -> bool:
    """Whether ``param``'s owner writes its first gradient of a step over ``main_grad``."""
    return bool(getattr(param, OPT_IN, False))


def set_opt_in(param: torch.nn.Parameter, overwrites: bool) -> None:
    """The owner's forward says whether its backward takes the first write (see the module docstring)."""
    if getattr(param, OPT_IN, False) != overwrites:
        setattr(param, OPT_IN, overwrites)


def opt_in_hook_writes(weights) -> None:
    """Opt ``weights`` in from their owner's forward (under autograd) when their gradient comes through
    autograd to the DDP hook, which then copies the step's first gradient over ``main_grad`` instead of
    adding it to a zeroed buffer: one pass over the region instead of three (zero, read, write)."""
    if not torch.is_grad_enabled():
        return
    for weight in weights:
        if getattr(weight, "main_grad", None) is not None and weight.requires_grad:
            set_opt_in(weight, True)


def is_unwritten(param: torch.nn.Parameter) -> bool:
    """Whether ``param.main_grad`` holds stale memory that stands for zero (no gradient yet this step)."""
    return bool(getattr(param, UNWRITTEN, False))


def take_first_write(param: torch.nn.Parameter) -> bool:
    """True (and the flag cleared) when the caller must write ``param``'s gradient over ``main_grad``
    (its first this step); False when it must add. Call it exactly once per gradient written."""
    if getattr(param, UNWRITTEN, False):
        setattr(param, UNWRITTEN, False)
        return True
    return False


def zero_if_unwritten(params) -> None:
    """Zero the ``main_grad`` of those ``params`` still unwritten (one multi-tensor zero) and clear
    their flags: afterwards their ``main_grad`` may be added to and read."""
    left = [p for p in params if getattr(p, UNWRITTEN, False)]
    if not left:
        return
    torch._foreach_zero_([p.main_grad for p in left])
    for p in left:
        setattr(p, UNWRITTEN, False)
