"""FP8 casts: the quantize, the amax, current scaling's scale, Transformer Engine's per-tensor cast
(with its bias gradient, and of a column packing of several parts), and the byte transpose (kernels:
``backends/cuda/triton_kernels/fp8_cast.py``, ``fp8_transpose.py``).

Scales follow Transformer Engine's convention: ``q = saturate(x * scale)`` stores the tensor,
``x ~= q * scale_inv`` reads it back (see :mod:`mcore.ops.reference.linear` for the GEMMs that read it).
"""

from __future__ import annotations

import torch


def fp8_quantize(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """``saturate(x * scale)`` cast to ``fp8_dtype`` (``torch.float8_e4m3fn`` or ``float8_e5m2``).

    ``x [..., K]`` any float dtype; ``scale`` fp32, 0-dim or broadcastable (``[rows, 1]``). The
    product is formed in fp32 and clamped to the format's finite range (+-448 for e4m3, +-57344 for
    e5m2) before the round-to-nearest-even cast, as Transformer Engine's cast kernels do, so an amax
    that grew since the scale was chosen saturates instead of becoming NaN/inf. The result is
    contiguous (row-major) whatever the strides of ``x``: ``fp8_quantize(w.t(), ...)`` is the
    transposed operand.
    """
    limit = torch.finfo(fp8_dtype).max
    return (x.float() * scale).clamp(-limit, limit).to(fp8_dtype).contiguous()


def fp8_amax(x: torch.Tensor) -> torch.Tensor:
    """``max |x|`` over all elements as a 0-dim fp32 tensor (NaN where ``x`` has one; a backend may
    return inf instead: both give the scale 1 and are kept out of the delayed recipe's scales)."""
    return torch.linalg.vector_norm(x, float("inf")).float()


def fp8_scale_from_amax(amax: torch.Tensor, fp8_dtype: torch.dtype, margin: int) -> torch.Tensor:
    """Current scaling's ``scale = fp8_max / amax / 2^margin`` in fp32 (1 where ``amax`` is 0 or not
    finite), capped at fp32's largest value: the largest magnitude maps onto the format's largest."""
    amax = amax.float()
    scale = (torch.finfo(fp8_dtype).max / (2.0**margin)) / amax
    ok = (amax > 0) & torch.isfinite(amax)
    scale = torch.where(ok, scale, torch.ones_like(scale))
    return scale.clamp(max=torch.finfo(torch.float32).max)


def fp8_cast(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    *,
    scale: torch.Tensor | None = None,
    amax: torch.Tensor | None = None,
    margin: int = 0,
    rowwise: bool = True,
    columnwise: bool = False,
    amax_record: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """Transformer Engine's per-tensor quantize of a 2-D ``x [M, K]``: ``(q, q^T, scale_inv)``.

    The scale is either given (``scale``, 0-dim fp32: the delayed recipe) or formed from ``amax``
    (0-dim fp32, already reduced over the ranks that share the tensor: current scaling) as
    :func:`fp8_scale_from_amax` with ``margin``; exactly one of the two. ``rowwise`` returns
    ``q = fp8_quantize(x, scale) [M, K]`` (else None), ``columnwise`` the contiguous transpose
    ``q^T [K, M]`` (the NT operand of the other GEMMs; else None), and ``scale_inv = 1 / scale``.
    ``amax_record`` (a one-element fp32 tensor): ``max(amax_record, fp8_amax(x))`` is stored into it
    in place (the delayed recipe's amax, taken during the cast instead of in a pass of its own).
    """
    if (scale is None) == (amax is None):
        raise ValueError("fp8_cast takes exactly one of scale= and amax=")
    if amax is not None:
        scale = fp8_scale_from_amax(amax, fp8_dtype, margin)
    if amax_record is not None:
        torch.maximum(amax_record, fp8_amax(x).reshape(amax_record.shape), out=amax_record)
    q = fp8_quantize(x, scale, fp8_dtype) if rowwise else None
    qT = fp8_quantize(x.t(), scale, fp8_dtype) if columnwise else None
    return q, qT, scale.reciprocal()


def fp8_cast_dbias(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    *,
    scale: torch.Tensor | None = None,
    amax: torch.Tensor | None = None,
    margin: int = 0,
    rowwise: bool = True,
    columnwise: bool = False,
    amax_record: torch.Tensor | None = None,
):
    """:func:`fp8_cast` of an output gradient ``x [M, N]`` and its bias gradient ``x.sum(0)`` (in
    ``x.dtype``), from one read of ``x``: ``(q, qT, scale_inv, dbias)``."""
    q, qT, scale_inv = fp8_cast(
        x,
        fp8_dtype,
        scale=scale,
        amax=amax,
        margin=margin,
        rowwise=rowwise,
        columnwise=columnwise,
        amax_record=amax_record,
    )
    return q, qT, scale_inv, x.sum(0)


def pack_columns(parts: list[torch.Tensor], groups: int) -> torch.Tensor:
    """The column packing of ``parts`` (each ``[M, groups * w_i]``) into ``x [M, groups * W]``,
    ``W = sum(w_i)``: row ``m`` of ``x`` is, group after group, ``parts[0][m, j w_0 : (j+1) w_0]``, then
    ``parts[1][m, j w_1 : (j+1) w_1]``, ... -- a fused QKV projection's output ``[M, g (r+2) d]``
    (Megatron's per-group ``[q_j | k_j | v_j]``) from its Q ``[M, g r d]``, K and V ``[M, g d]``."""
    m = parts[0].shape[0]
    return torch.cat([p.reshape(m, groups, -1) for p in parts], dim=-1).reshape(m, -1)


def fp8_cast_packed(
    parts: list[torch.Tensor],
    groups: int,
    fp8_dtype: torch.dtype,
    *,
    dbias: bool,
    scale: torch.Tensor | None = None,
    amax: torch.Tensor | None = None,
    margin: int = 0,
    rowwise: bool = True,
    columnwise: bool = False,
    amax_record: torch.Tensor | None = None,
):
    """:func:`fp8_cast` (``dbias``: :func:`fp8_cast_dbias`) of ``x = pack_columns(parts, groups)``
    without materializing ``x``: ``(q [M, N], q^T [N, M], scale_inv, dbias [N] or None)`` of the
    packed ``x``. The output gradient of a fused QKV projection arrives as the attention's separate
    ``dq``, ``dk``, ``dv``; casting them where they lie saves writing and reading ``x`` (the
    concatenation autograd would otherwise make)."""
    x = pack_columns(parts, groups)
    kwargs = dict(
        scale=scale, amax=amax, margin=margin, rowwise=rowwise, columnwise=columnwise, amax_record=amax_record
    )
    if dbias:
        return fp8_cast_dbias(x, fp8_dtype, **kwargs)
    return (*fp8_cast(x, fp8_dtype, **kwargs), None)


def fp8_transpose(q: torch.Tensor) -> torch.Tensor:
    """``q [M, K] -> q^T [K, M]``, contiguous: the bytes of a 2-D FP8 tensor transposed (no rounding).

    The FP8 GEMMs of Hopper take both operands with the contraction dimension contiguous, so a weight
    quantized once as ``W_q [N, K]`` (``--fp8-param-gather``) and an input gathered as FP8 rows
    (sequence parallelism) need their transposes for the input and weight gradients. Copied as
    ``uint8``: copy kernels may not know the FP8 dtypes."""
    return q.view(torch.uint8).t().contiguous().view(q.dtype)
