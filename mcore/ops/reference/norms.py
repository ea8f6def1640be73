"""LayerNorm and RMSNorm over the last dim, alone and with their residual stream (kernels:
``backends/cuda/triton_kernels/norms.py``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mcore.ops.reference._common import _wide


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim: ``(x - mean) / sqrt(var + eps) * weight + bias``; stats in fp32."""
    y = F.layer_norm(_wide(x), (x.shape[-1],), _wide(weight), None if bias is None else _wide(bias), eps)
    return y.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim: ``x / sqrt(mean(x^2) + eps) * weight``; the statistic in fp32."""
    xw = _wide(x)
    y = xw * torch.rsqrt(xw.pow(2).mean(-1, keepdim=True) + eps)
    return y.to(x.dtype) * weight


def layer_norm_with_residual(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(layer_norm(x), x)``: a pre-norm layer's norm output and its residual stream.

    One op for both uses of ``x`` lets a backend add the residual's gradient to the norm's input
    gradient inside the norm's backward pass; here autograd adds the two.
    """
    return layer_norm(x, weight, bias, eps), x


def rms_norm_with_residual(
    x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x), x)``: see :func:`layer_norm_with_residual`."""
    return rms_norm(x, weight, eps), x
