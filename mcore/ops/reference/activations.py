"""The MLP's activations and the residual add: bias-GeLU (exact and tanh), SwiGLU, bias-dropout-add
(kernels: ``backends/cuda/triton_kernels/activations.py``)."""

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


def bias_dropout_add(
    x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, p: float, training: bool
) -> torch.Tensor:
    """``residual + dropout(x + bias)``."""
    if bias is not None:
        x = x + bias
    return residual + F.dropout(x, p=p, training=training)
