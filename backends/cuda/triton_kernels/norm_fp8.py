"""The ops ``norm_fp8_forward`` and ``norm_backward`` of the fused FP8 producers (delayed recipe).

:func:`norm_fp8_fwd` is the norm forward kernel (:func:`.norms.layer_norm_fwd` /
:func:`.norms.rms_norm_fwd`: the output ``y`` and the row statistics) followed by the cast kernel
(:func:`.fp8_cast.cast`: ``q``/``q^T`` with the given scale, the amax recorded in the same pass). So
its bytes are the unfused path's by construction, and what the fused path gains is around the
kernels: no bf16 norm output kept for backward, the residual stream's gradient added inside the
norm's backward, and one autograd node for norm and linear.

Why two kernels and not one: a single Triton kernel that normalises and writes ``q``/``q^T``
(branch ``hn``, 2026-11-24) was measured on an H100 at 72.5 us against 77.1 us for the pair at
8192 x 2048 (LayerNorm, bf16) and 40% slower at 8192 x 4096: to keep statistics equal to the norm
kernel's to the bit it reduced rows in that kernel's tile on its few warps, and it read ``x``
twice. Its GPU check also failed at fp32 [37, 64] (wrong ``q^T``/``rstd``). It is not used until it
is both faster and correct on the GPU.

:func:`norm_bwd` is the op ``norm_backward``: the norm kernels' backward (:func:`.norms.layer_norm_bwd`,
:func:`.norms.rms_norm_bwd`) from the saved statistics, with the residual stream's gradient added
to ``dx`` in the same pass.
"""

from __future__ import annotations

import torch

from . import fp8_cast, norms

KINDS = ("LayerNorm", "RMSNorm")


def norm_fp8_fwd(
    x2: torch.Tensor,
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
    """The op ``norm_fp8_forward`` on ``x2 [M, K]`` (unit stride on K): ``(q, qT, scale_inv, mean, rstd)``,
    ``mean`` None for RMSNorm. ``y`` is in the norm's output dtype (``x``'s for LayerNorm,
    ``promote(x, weight)`` for RMSNorm), as the unfused norm writes it."""
    if kind == "RMSNorm":
        y, rstd = norms.rms_norm_fwd(x2, weight, eps, torch.promote_types(x2.dtype, weight.dtype))
        mean = None
    else:
        y, mean, rstd = norms.layer_norm_fwd(x2, weight, bias, eps)
    q, qt, scale_inv = fp8_cast.cast(
        y, fp8_dtype, scale=scale, rowwise=rowwise, columnwise=columnwise, amax_record=amax_record
    )
    return q, qt, scale_inv, mean, rstd


def norm_bwd(
    dy2: torch.Tensor,
    x2: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    kind: str,
    mean: torch.Tensor | None,
    rstd: torch.Tensor,
    dres2: torch.Tensor | None = None,
):
    """The op ``norm_backward`` on ``[M, K]`` rows: ``(dx, dweight, dbias)`` from the norm kernels'
    backward, in the dtypes the norm op's autograd gives (``x``'s, ``weight``'s, ``bias``'s)."""
    if kind == "RMSNorm":
        dx, dw = norms.rms_norm_bwd(dy2, x2, weight, rstd, dres2=dres2)
        return dx, dw, None
    bias_dtype = None if bias is None else bias.dtype
    return norms.layer_norm_bwd(
        dy2, x2, weight, bias is not None, mean, rstd, bias_dtype=bias_dtype, dres2=dres2
    )
