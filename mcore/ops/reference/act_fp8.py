"""The fused producers of FP8 operands from the MLP's activation, forward and backward (the delayed
recipe's fused activation casts; kernels: ``backends/cuda/triton_kernels/act_fp8.py``).

The producers follow :mod:`mcore.ops.reference.norm_fp8`'s contract: bit for bit the unfused
activation, then :func:`~mcore.ops.reference.fp8.fp8_cast` with a given scale.
"""

from __future__ import annotations

import torch

from mcore.ops.reference.activations import bias_gelu, swiglu
from mcore.ops.reference.fp8 import fp8_cast

ACTIVATIONS = ("gelu", "gelu_tanh", "swiglu")
"""The activations :func:`act_fp8_forward` fuses: exact GeLU, tanh GeLU, SwiGLU (fc1 ``[gate; up]``)."""


def _activation(h: torch.Tensor, bias: torch.Tensor | None, kind: str) -> torch.Tensor:
    """The MLP's activation as :class:`mcore.models.transformer.mlp.MLP` computes it: ``bias_gelu(h, bias)`` or
    ``swiglu(h + bias)``."""
    if kind == "swiglu":
        return swiglu(h if bias is None else h + bias)
    return bias_gelu(h, bias, "tanh" if kind == "gelu_tanh" else "none")


def act_fp8_forward(
    h: torch.Tensor,
    bias: torch.Tensor | None,
    kind: str,
    fp8_dtype: torch.dtype,
    scale: torch.Tensor,
    amax_record: torch.Tensor | None = None,
    rowwise: bool = True,
    columnwise: bool = True,
):
    """``fp8_cast(act(h, bias), scale=scale, amax_record=...)`` -> ``(q, qT, scale_inv)``: fc2's input
    straight from fc1's output ``h [M, F]`` (SwiGLU: ``[M, 2F]`` -> ``[M, F]``); ``kind`` one of
    :data:`ACTIVATIONS`."""
    with torch.no_grad():
        y = _activation(h, bias, kind)
        return fp8_cast(
            y, fp8_dtype, scale=scale, rowwise=rowwise, columnwise=columnwise, amax_record=amax_record
        )


def act_fp8_backward(
    grad_output: torch.Tensor,
    h: torch.Tensor,
    bias: torch.Tensor | None,
    kind: str,
    fp8_dtype: torch.dtype,
    scale: torch.Tensor,
    amax_record: torch.Tensor | None = None,
    rowwise: bool = True,
    columnwise: bool = True,
):
    """The activation's backward, quantized: ``dh = d act(h, bias) / dh`` (autograd of the activation,
    in ``h``'s dtype: fc1's output gradient) as ``fp8_cast(dh, scale=scale, amax_record=...)``, with
    the bias gradient. Returns ``(q, qT, scale_inv, dbias)`` (``dbias`` None without a bias; it is
    summed from the unquantized ``dh``)."""
    with torch.enable_grad():
        hr = h.detach().requires_grad_(True)
        br = None if bias is None else bias.detach().requires_grad_(True)
        y = _activation(hr, br, kind)
        inputs = [hr] + ([br] if br is not None else [])
        grads = torch.autograd.grad(y, inputs, grad_output)
    dh = grads[0]
    q, qT, scale_inv = fp8_cast(
        dh, fp8_dtype, scale=scale, rowwise=rowwise, columnwise=columnwise, amax_record=amax_record
    )
    return q, qT, scale_inv, grads[1] if bias is not None else None
