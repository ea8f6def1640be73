"""The weight gradient ``dW = dY^T X`` of a linear in the activations' dtype, accumulated into
``main_grad`` with gradient-accumulation fusion: shared by the bf16 parallel linears
(:mod:`mcore.tensor_parallel.layers`) and the FP8 linear with ``--no-fp8-wgrad``
(:mod:`mcore.fp8.linear`)."""

from __future__ import annotations

import torch

from mcore.backend import get_ops
from mcore.tensor_parallel.first_grad import take_first_write

# ``main_grad += grad_output_2d^T input_2d`` in place (the backend's ``accumulate_weight_grad``), as
# an operator for compiled graphs: Inductor lowers an ``addmm_`` on a graph input to an out-of-place
# GEMM plus a copy into the input (one more pass over the gradient than the fusion saves), but calls
# an opaque operator that mutates its argument in place. Eager code calls the op table directly. A plain library definition, not
# ``torch.library.custom_op``: its Python wrapper adds ~25 us per call, this ~2 (measured on a host).
_LIBRARY = torch.library.Library("mcore", "FRAGMENT")
_LIBRARY.define("accumulate_weight_grad_(Tensor(a!) main_grad, Tensor grad_output_2d, Tensor input_2d) -> ()")


def _accumulate_weight_grad_impl(main_grad, grad_output_2d, input_2d) -> None:
    get_ops().accumulate_weight_grad(main_grad, grad_output_2d, input_2d)


def _accumulate_weight_grad_fake(main_grad, grad_output_2d, input_2d) -> None:
    return None


_LIBRARY.impl("accumulate_weight_grad_", _accumulate_weight_grad_impl, "CompositeExplicitAutograd")
torch.library.register_fake("mcore::accumulate_weight_grad_", _accumulate_weight_grad_fake, lib=_LIBRARY)


def weight_grad(ctx, weight: torch.Tensor, grad_2d: torch.Tensor, input_2d: torch.Tensor) -> torch.Tensor:
    """``dW = dY^T X``: accumulated into ``ctx.main_grad`` (returning the placeholder, or None for a
    shared weight, ``ctx.zero_placeholder``, as
    :class:`~mcore.tensor_parallel.layers._LinearWithGradAccumulationFusion` describes), or returned
    when ``ctx.main_grad`` is None."""
    if ctx.main_grad is None:
        return grad_2d.t().matmul(input_2d)
    if torch.compiler.is_compiling():
        torch.ops.mcore.accumulate_weight_grad_.default(ctx.main_grad, grad_2d, input_2d)
    else:
        get_ops().accumulate_weight_grad(ctx.main_grad, grad_2d, input_2d)
    return None if ctx.zero_placeholder else torch.empty_like(weight)


class _GradIntoMainGrad(torch.autograd.Function):
    """``forward(weight) = weight``; backward writes or adds the gradient that reaches it into
    ``main_grad`` and hands autograd a placeholder (see :func:`grad_into_main_grad`)."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, main_grad: torch.Tensor) -> torch.Tensor:
        ctx.weight, ctx.main_grad = weight, main_grad
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if take_first_write(ctx.weight):  # the step's first gradient: over the stale memory
            # An element-wise kernel rather than copy_: captured in a device graph, a same-dtype
            # copy_ becomes a memcpy node, which ran 1.5x slower than this on an H200 for the
            # 512 MiB of an expert weight's gradient (397 against 254 us, benchmarks/README.md).
            torch.mul(grad, 1, out=ctx.main_grad)
        else:
            ctx.main_grad.add_(grad)
        return torch.empty_like(ctx.weight), None


def grad_into_main_grad(weight: torch.Tensor, main_grad: torch.Tensor | None) -> torch.Tensor:
    """``weight`` for a GEMM op whose backward returns ``dW`` (no accumulating form, as the grouped
    GEMM of the MoE experts): the gradient is written (the step's first, see
    :mod:`~mcore.tensor_parallel.first_grad`) or added into ``main_grad`` inside the backward pass, and
    the weight's ``.grad`` is a placeholder the DDP hook discards. ``main_grad`` is what
    :func:`~mcore.tensor_parallel.layers.fusion_main_grad` returned with ``overwrites_first=True``
    (None: no fusion, ``weight`` itself is returned).

    The DDP hook could do the same write or add (it does without fusion); doing it in the backward
    keeps ``dW`` a temporary of that backward, so a captured device graph of the layer
    (:mod:`mcore.models.transformer.layer_graphs`) reuses its memory instead of holding every layer's
    ``dW`` as a static output."""
    if main_grad is None:
        return weight
    return _GradIntoMainGrad.apply(weight, main_grad)
