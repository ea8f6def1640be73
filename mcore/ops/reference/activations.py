"""The MLP's activations and the residual add: bias-GeLU (exact and tanh), SwiGLU, SwiGLU weighted
per row (the MoE experts'), bias-dropout-add (kernels: ``backends/cuda/triton_kernels/activations.py``
and ``swiglu.py``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class _BiasGeLU(torch.autograd.Function):
    """``gelu(x + bias)`` that keeps ``x`` and ``bias`` for backward (and recomputes the sum there).

    Keeping the inputs, as the backends' fused kernels do, and not the sum that autograd would keep
    means fc1's output is the activation's only saved tensor: ``--recompute-modules mlp_act``
    recomputes the activation's output from it at no extra memory.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, bias: torch.Tensor, approximate: str) -> torch.Tensor:
        ctx.save_for_backward(x, bias)
        ctx.approximate = approximate
        return F.gelu(x + bias, approximate=approximate)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        x, bias = ctx.saved_tensors
        grad_x = torch.ops.aten.gelu_backward(grad_output, x + bias, approximate=ctx.approximate)
        grad_bias = grad_x.reshape(-1, grad_x.shape[-1]).sum(0).to(bias.dtype)
        return grad_x, grad_bias, None


def bias_gelu(x: torch.Tensor, bias: torch.Tensor | None, approximate: str = "none") -> torch.Tensor:
    """``gelu(x + bias)``; ``approximate="tanh"`` is GPT-2's ``gelu_new``, ``"none"`` the exact erf form."""
    if bias is None:
        return F.gelu(x, approximate=approximate)
    return _BiasGeLU.apply(x, bias, approximate)


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a fused ``[..., 2f]`` input: ``silu(x[..., :f]) * x[..., f:]`` (gate first, then up)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class _WeightedSwiGLU(torch.autograd.Function):
    """``swiglu(x) * w`` that keeps only ``x`` and ``w`` for backward (and recomputes ``swiglu(x)``
    there): the experts' activation output is the tensor this op exists not to keep."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weights)
        with torch.no_grad():
            return _weighted(swiglu(x), weights, x.dtype)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        # autograd's steps through swiglu, written out (no autograd.grad: torch.compile traces this)
        x, weights = ctx.saved_tensors
        gate, up = x.chunk(2, dim=-1)
        silu = F.silu(gate)
        compute = torch.promote_types(grad_output.dtype, torch.float32)
        dy = grad_output.to(compute)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            # d/ds of (s.float() * w).to(dtype): dy * w, in s's dtype (the rounding passes the gradient)
            ds = (dy * weights.to(compute)[:, None]).to(x.dtype)
            grad_x = torch.cat((torch.ops.aten.silu_backward(ds * up, gate), ds * silu), dim=-1)
        if ctx.needs_input_grad[1]:
            grad_w = (dy * (silu * up).to(compute)).sum(-1).to(weights.dtype)
        return grad_x, grad_w


def _weighted(s: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    compute = torch.promote_types(s.dtype, torch.float32)
    return (s.to(compute) * weights.to(compute)[:, None]).to(dtype)


def weighted_swiglu(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``swiglu(x)`` with row ``n`` scaled by ``weights[n]``: the MoE experts' activation with each
    routed row's probability applied (Megatron's ``weighted_bias_swiglu``).

    Args:
        x: ``[N, 2F]`` fc1's output, gate first (as :func:`swiglu`); ``N`` may be 0.
        weights: ``[N]`` (fp32: the router's probabilities of each row's expert).

    Returns ``(swiglu(x) in x's dtype, widened to fp32, * weights[:, None])`` rounded to ``x``'s dtype
    ``[N, F]``. Differentiable w.r.t. ``x`` and ``weights``: ``dw[n] = sum_f dy[n, f] swiglu(x)[n, f]``
    (in at least fp32, returned in ``weights``' dtype). Backward keeps ``x`` and ``weights`` only and
    recomputes ``swiglu(x)``.
    """
    if x.dim() != 2 or weights.shape != (x.shape[0],) or x.shape[1] % 2:
        raise ValueError(
            f"weighted_swiglu: x {tuple(x.shape)} must be [N, 2F] and weights {tuple(weights.shape)} [N]"
        )
    return _WeightedSwiGLU.apply(x, weights)


def bias_dropout_add(
    x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, p: float, training: bool
) -> torch.Tensor:
    """``residual + dropout(x + bias)``."""
    if bias is not None:
        x = x + bias
    return residual + F.dropout(x, p=p, training=training)
