"""A linear layer's GEMMs: the weight gradient added to its buffer, and the FP8 ``scaled_linear``
family.

Every FP8 GEMM is written "NT": ``out = (a * a_scale_inv) @ (b * b_scale_inv)^T`` with both operands
``[rows, K]``, contraction dim last (row-major), which is the layout ``torch._scaled_mm`` takes
without a copy (``b^T`` is then column-major). A linear ``y = x W^T`` needs::

  forward  y  [M, N] = nt(x_q  [M, K], W_q  [N, K])
  dgrad    dx [M, K] = nt(dy_q [M, N], W_qT [K, N])
  wgrad    dW [N, K] = nt(dy_qT [N, M], x_qT [K, M])

``M`` tokens, ``K`` input and ``N`` output features. Scales follow Transformer Engine's convention:
``q = saturate(x * scale)`` stores the tensor, ``x ~= q * scale_inv`` reads it back. A scale is a
0-dim fp32 tensor (per-tensor scaling) or ``[rows, 1]`` (per-row scaling: one scale per row of the
NT operand, i.e. per output element of the GEMM along that side).
"""

from __future__ import annotations

import torch


def accumulate_weight_grad(
    main_grad: torch.Tensor, grad_output_2d: torch.Tensor, input_2d: torch.Tensor
) -> None:
    """``main_grad += grad_output_2d^T input_2d`` in place: a linear layer's weight gradient added to
    its gradient buffer (gradient-accumulation fusion).

    ``main_grad [out, in]``, ``grad_output_2d [T, out]``, ``input_2d [T, in]`` (``T`` tokens). Same
    dtypes: one GEMM with ``beta=1``. An fp32 ``main_grad`` for bf16/fp16 activations: the product
    in the activations' dtype, then added, which is what autograd followed by the DDP hook computes
    (a backend with an in-place mixed-precision GEMM does better: one kernel, no rounding of the
    product, see the CUDA backend).
    """
    if main_grad.dtype == grad_output_2d.dtype == input_2d.dtype:
        main_grad.addmm_(grad_output_2d.t(), input_2d)
    else:
        main_grad.add_(grad_output_2d.t() @ input_2d)


def _dequantize(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    return q.float() * scale_inv


def scaled_mm_nt(
    a: torch.Tensor, b: torch.Tensor, a_scale_inv: torch.Tensor, b_scale_inv: torch.Tensor
) -> torch.Tensor:
    """``(a * a_scale_inv) @ (b * b_scale_inv)^T`` in fp32: the emulated FP8 GEMM.

    ``a [M, K]``, ``b [N, K]`` fp8; scale inverses 0-dim or ``[M, 1]`` / ``[N, 1]``. The fp8 values are
    exact in fp32 and so are their products with power-of-two scales; the sums are fp32, like the
    tensor cores' fp32 accumulation (up to summation order).
    """
    return _dequantize(a, a_scale_inv) @ _dequantize(b, b_scale_inv).t()


def scaled_linear_forward(
    x_q: torch.Tensor,
    w_q: torch.Tensor,
    x_scale_inv: torch.Tensor,
    w_scale_inv: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``y = x W^T + bias`` from FP8 operands: ``x_q [M, K]``, ``w_q [N, K]`` -> ``y [M, N]`` in
    ``out_dtype`` (the bias, in any float dtype, added in fp32 before the final rounding)."""
    y = scaled_mm_nt(x_q, w_q, x_scale_inv, w_scale_inv)
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def scaled_linear_dgrad(
    dy_q: torch.Tensor,
    w_qT: torch.Tensor,
    dy_scale_inv: torch.Tensor,
    w_scale_inv: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The input gradient ``dx = dy W``: ``dy_q [M, N]``, ``w_qT [K, N]`` (the weight transposed,
    contraction dim last) -> ``dx [M, K]`` in ``out_dtype``."""
    return scaled_mm_nt(dy_q, w_qT, dy_scale_inv, w_scale_inv).to(out_dtype)


def scaled_linear_wgrad(
    dy_qT: torch.Tensor,
    x_qT: torch.Tensor,
    dy_scale_inv: torch.Tensor,
    x_scale_inv: torch.Tensor,
    out_dtype: torch.dtype,
    main_grad: torch.Tensor | None = None,
    accumulate: bool = True,
) -> torch.Tensor:
    """The weight gradient ``dW = dy^T x``: ``dy_qT [N, M]``, ``x_qT [K, M]`` -> ``dW [N, K]``.

    With ``main_grad`` (gradient-accumulation fusion) the product, rounded to ``main_grad.dtype``, is
    added into it in place (``accumulate=True``) or overwrites it (``accumulate=False``: the first
    gradient of a step into a ``main_grad`` that was not zeroed, see :mod:`mcore.distributed.ddp`), and
    ``main_grad`` is returned; otherwise ``dW`` in ``out_dtype``. The two forms agree bit for bit on a
    zero ``main_grad`` (``0 + x == x``), so a backend may serve the overwrite as a GEMM that writes
    ``main_grad`` directly.
    """
    dw = scaled_mm_nt(dy_qT, x_qT, dy_scale_inv, x_scale_inv)
    if main_grad is None:
        return dw.to(out_dtype)
    if accumulate:
        return main_grad.add_(dw.to(main_grad.dtype))
    return main_grad.copy_(dw.to(main_grad.dtype))
