"""The experts' FP8 GEMMs: ``grouped_gemm`` (:mod:`mcore.ops.reference.moe`) on quantized operands
with per-row scales (kernels: ``backends/cuda/grouped_fp8.py`` on ``torch._scaled_grouped_mm``,
``backends/npu/moe_ops.py`` on ``npu_grouped_matmul``'s per-token quantization).

Like :mod:`mcore.ops.reference.linear`'s ``scaled_linear`` family every GEMM is "NT" (both operands
have the contraction dim last) and the scales are scale *inverses* (``x ~= q * scale_inv``). Rows are
grouped by expert in expert order, ``tokens_per_expert [E]`` (int64, any device, zeros allowed) gives
the group sizes. For the experts' linear ``y_e = x_e W_e^T`` (``x [N, K]``, ``W [E, M, K]``)::

  forward  y  [N, M]    = scaled_grouped_gemm(x_q [N, K], W_q [E, M, K], sx [N], sw [E, M])
  dgrad    dx [N, K]    = scaled_grouped_gemm(dy_q [N, M], W_qT [E, K, M], sdy [N], swT [E, K])
  wgrad    dW [E, M, K] = scaled_grouped_gemm_wgrad(dy_qT [M, N], x_qT [K, N], sdyT [E, M], sxT [E, K])

The scale layout is the rowwise recipe's, per output element along each side of the GEMM: one scale
per row of the 2-D operand (a token), per (expert, row) of the 3-D one; in the weight gradient, where
the contraction runs over the tokens of one expert, one per (expert, row) of each transposed operand
(its amax over that expert's tokens only). That is the layout ``torch._scaled_grouped_mm`` takes on
Hopper (float32 rowwise scales, int32 group offsets).

The operands may be ``float8_e4m3fn``, ``float8_e5m2`` or ``int8`` (the NPU's per-token quantized
GEMM); every such value is exact in fp32, so the reference's numerics -- dequantize each operand in
fp32, multiply in fp32, round once to ``out_dtype`` -- are what a kernel with fp32 accumulation gives
up to the order of the sums.
"""

from __future__ import annotations

import torch

QUANTIZED_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8)


def _counts(op: str, tokens_per_expert: torch.Tensor, experts: int, rows: int) -> list[int]:
    counts = [int(c) for c in tokens_per_expert.tolist()]
    if len(counts) != experts or sum(counts) != rows or min(counts, default=0) < 0:
        raise ValueError(
            f"{op}: tokens_per_expert {counts} must have one count >= 0 per expert ({experts}) "
            f"summing to the {rows} grouped rows"
        )
    return counts


def _check_quantized(op: str, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.dtype not in QUANTIZED_DTYPES:
            raise TypeError(f"{op}: {name} must be one of {QUANTIZED_DTYPES}, got {t.dtype}")


def scaled_grouped_gemm(
    a_q: torch.Tensor,
    b_q: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b_scale_inv: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``out[rows of e] = (a_q[rows of e] * a_scale_inv[rows of e, None]) @ (b_q[e] * b_scale_inv[e, :, None])^T``.

    Args:
        a_q: ``[N, K]`` quantized rows, grouped by expert (the forward's ``x_q``, the input
            gradient's ``dy_q``).
        b_q: ``[E, M, K]`` quantized, contraction dim last (the forward's ``W_q``, the input
            gradient's ``W_q^T`` per expert).
        a_scale_inv: ``[N]`` fp32, one per row of ``a_q``.
        b_scale_inv: ``[E, M]`` fp32, one per (expert, row) of ``b_q``.
        tokens_per_expert: ``[E]`` counts summing to ``N``.
        out_dtype: the result's dtype.

    Returns ``[N, M]`` in ``out_dtype`` (``N = 0``: an empty result).
    """
    op = "scaled_grouped_gemm"
    _check_quantized(op, a_q=a_q, b_q=b_q)
    if a_q.dim() != 2 or b_q.dim() != 3 or b_q.shape[2] != a_q.shape[1]:
        raise ValueError(f"{op}: a_q {tuple(a_q.shape)} must be [N, K] and b_q {tuple(b_q.shape)} [E, M, K]")
    if a_scale_inv.shape != a_q.shape[:1] or b_scale_inv.shape != b_q.shape[:2]:
        raise ValueError(
            f"{op}: a_scale_inv {tuple(a_scale_inv.shape)} must be [N] = {tuple(a_q.shape[:1])} and "
            f"b_scale_inv {tuple(b_scale_inv.shape)} [E, M] = {tuple(b_q.shape[:2])}"
        )
    counts = _counts(op, tokens_per_expert, b_q.shape[0], a_q.shape[0])
    a = a_q.float() * a_scale_inv.float()[:, None]
    b = b_q.float() * b_scale_inv.float()[:, :, None]
    pieces = [piece @ b[e].t() for e, piece in enumerate(torch.split(a, counts))]
    out = torch.cat(pieces) if pieces else a.new_zeros(0, b_q.shape[1])
    return out.to(out_dtype)


def scaled_grouped_gemm_wgrad(
    a_qT: torch.Tensor,
    b_qT: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b_scale_inv: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The weight gradient: ``out[e] = (a_qT[:, cols of e] * a_scale_inv[e, :, None]) @ (b_qT[:, cols of e] * b_scale_inv[e, :, None])^T``.

    Args:
        a_qT: ``[M, N]`` quantized, the output gradient transposed (``dy_q^T``), columns grouped by
            expert.
        b_qT: ``[K, N]`` quantized, the input transposed (``x_q^T``).
        a_scale_inv: ``[E, M]`` fp32, one per (expert, row of ``a_qT``): from the row's amax over that
            expert's columns.
        b_scale_inv: ``[E, K]`` fp32, likewise for ``b_qT``.
        tokens_per_expert: ``[E]`` counts summing to ``N``.
        out_dtype: the result's dtype.

    Returns ``[E, M, K]`` in ``out_dtype``; an expert with no token gets zeros.
    """
    op = "scaled_grouped_gemm_wgrad"
    _check_quantized(op, a_qT=a_qT, b_qT=b_qT)
    if a_qT.dim() != 2 or b_qT.dim() != 2 or a_qT.shape[1] != b_qT.shape[1]:
        raise ValueError(f"{op}: a_qT {tuple(a_qT.shape)} must be [M, N] and b_qT {tuple(b_qT.shape)} [K, N]")
    experts = a_scale_inv.shape[0] if a_scale_inv.dim() == 2 else -1
    if a_scale_inv.shape != (experts, a_qT.shape[0]) or b_scale_inv.shape != (experts, b_qT.shape[0]):
        raise ValueError(
            f"{op}: a_scale_inv {tuple(a_scale_inv.shape)} must be [E, M] and b_scale_inv "
            f"{tuple(b_scale_inv.shape)} [E, K] for a_qT {tuple(a_qT.shape)}, b_qT {tuple(b_qT.shape)}"
        )
    counts = _counts(op, tokens_per_expert, experts, a_qT.shape[1])
    a_parts = torch.split(a_qT.float(), counts, dim=1)
    b_parts = torch.split(b_qT.float(), counts, dim=1)
    out = torch.stack(
        [
            (a * a_scale_inv[e].float()[:, None]) @ (b * b_scale_inv[e].float()[:, None]).t()
            for e, (a, b) in enumerate(zip(a_parts, b_parts))
        ]
    ) if counts else a_qT.new_zeros(0, a_qT.shape[0], b_qT.shape[0], dtype=torch.float32)  # fmt: skip
    return out.to(out_dtype)
