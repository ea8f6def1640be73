"""The weight gradient ``dW = dY^T X`` of a linear in the activations' dtype, accumulated into
``main_grad`` with gradient-accumulation fusion: shared by the bf16 parallel linears
(:mod:`mcore.tensor_parallel.layers`) and the FP8 linear with ``--no-fp8-wgrad``
(:mod:`mcore.fp8.linear`)."""

from __future__ import annotations

import torch

from mcore.backend import get_ops

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
