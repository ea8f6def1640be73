"""The fused producer of FP8 operands from a norm (the delayed recipe's fused norm cast) and the
norm's backward from its statistics (kernels: ``backends/cuda/triton_kernels/norm_fp8.py``).

Each fused producer (here and in :mod:`mcore.ops.reference.act_fp8`) equals an unfused composition
of the reference ops bit for bit: the producer's output is rounded to the input dtype exactly as
the unfused op writes it, then quantized as ``fp8_cast`` with a given ``scale`` quantizes it (and
records its amax into ``amax_record``). A backend serves them with one kernel that writes the FP8 operand(s) instead of the bf16 tensor: the FP8 linears of
:mod:`mcore.fp8.fused` never materialize the norm's or activation's output.
``x [M, K]`` is 2-D; ``q [M, K]`` and ``qT [K, M]`` are returned where ``rowwise``/``columnwise``.
"""

from __future__ import annotations

import torch

from mcore.ops.reference._common import _wide
from mcore.ops.reference.fp8 import fp8_cast
from mcore.ops.reference.norms import layer_norm, rms_norm


def _norm(x, weight, bias, eps, kind):
    return layer_norm(x, weight, bias, eps) if kind == "LayerNorm" else rms_norm(x, weight, eps)


def norm_fp8_forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    kind: str,
    fp8_dtype: torch.dtype,
    scale: torch.Tensor,
    amax_record: torch.Tensor | None = None,
    rowwise: bool = True,
    columnwise: bool = True,
):
    """``fp8_cast(norm(x), scale=scale, amax_record=...)`` and the norm's statistics, for backward.

    ``kind``: ``"LayerNorm"`` (:func:`layer_norm`, ``bias`` may be None) or ``"RMSNorm"``
    (:func:`rms_norm`, ``bias`` None). Returns ``(q, qT, scale_inv, mean, rstd)``: ``mean [M]``
    (None for RMSNorm) and ``rstd [M] = 1 / sqrt(var + eps)`` (RMSNorm: ``1 / sqrt(mean(x^2) + eps)``)
    in fp32, as :func:`norm_backward` takes them.
    """
    with torch.no_grad():
        xw = _wide(x)
        if kind == "LayerNorm":
            mean = xw.mean(-1)
            rstd = torch.rsqrt((xw - mean[:, None]).pow(2).mean(-1) + eps)
        else:
            mean, rstd = None, torch.rsqrt(xw.pow(2).mean(-1) + eps)
        y = _norm(x, weight, bias, eps, kind)
        q, qT, scale_inv = fp8_cast(
            y, fp8_dtype, scale=scale, rowwise=rowwise, columnwise=columnwise, amax_record=amax_record
        )
    return q, qT, scale_inv, mean.float() if mean is not None else None, rstd.float()


def norm_backward(
    grad_output: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    kind: str,
    mean: torch.Tensor | None,
    rstd: torch.Tensor,
    residual_grad: torch.Tensor | None = None,
):
    """The norm's backward on 2-D ``grad_output, x [M, K]``: ``(dx, dweight, dbias)`` as autograd of
    :func:`layer_norm` / :func:`rms_norm` gives them (``dbias`` None without a bias), with
    ``residual_grad`` (the residual stream's gradient, ``[M, K]``) added to ``dx`` (a pre-norm
    layer's two uses of ``x``). ``mean``/``rstd`` are :func:`norm_fp8_forward`'s statistics; this
    reference recomputes them (a kernel reads them instead of reducing ``x`` again)."""
    with torch.enable_grad():
        xr = x.detach().requires_grad_(True)
        wr = weight.detach().requires_grad_(True)
        br = None if bias is None else bias.detach().requires_grad_(True)
        y = _norm(xr, wr, br, eps, kind)
        inputs = [xr, wr] + ([br] if br is not None else [])
        outputs, output_grads = [y], [grad_output]
        if residual_grad is not None:
            # The residual reaches ``x`` through autograd, as in the unfused layer: it arrives first
            # (its node is the newest) and the norm's contributions are added to it in autograd's
            # order, so dx is bit-identical to the unfused composition's (RMSNorm uses ``x`` twice).
            outputs.append(xr.view_as(xr))
            output_grads.append(residual_grad)
        grads = torch.autograd.grad(outputs, inputs, output_grads)
    return grads[0], grads[1], grads[2] if bias is not None else None
