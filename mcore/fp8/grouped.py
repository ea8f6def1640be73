"""The routed experts' grouped GEMM in FP8: quantize, then the op table's ``scaled_grouped_gemm`` /
``scaled_grouped_gemm_wgrad`` (:mod:`mcore.ops.reference.grouped_fp8` has the GEMMs' math).

For ``y[rows of e] = x[rows of e] W_e^T`` (``x [N, K]`` rows grouped by expert, ``W [E, M, K]``), every
operand is quantized with *current per-row scaling*, whatever ``--fp8-recipe`` the dense linears use:
one scale per row of each NT operand, ``scale = fp8_max / amax(row) / 2^margin``::

  forward  x_q: per token (amax over K)             W_q [E, M, K]: per (expert, output row)
  dgrad    dy_q: per token (amax over M)            W_q^T [E, K, M]: per (expert, input column)
  wgrad    dy_q^T [M, N]: per (expert, m), amax over that expert's tokens only
           x_q^T  [K, N]: per (expert, k), likewise

This is the layout the scaled grouped GEMMs take (``torch._scaled_grouped_mm`` on Hopper: float32
rowwise scales), and it needs no state: a per-tensor or delayed scale would have to be one number
for all experts of a layer (or per expert, with an amax history per expert and its reduction over
expert-parallel ranks), while a forward or input-gradient row's own scale depends only on that
token, whatever the expert-parallel layout (the weight gradient's column scales, as any current
scaling, on the tokens the expert receives on its rank). All operands are e4m3, the output gradient too, under both
``--fp8-format`` values: torch's scaled grouped GEMM takes e4m3 only, and per-row scales give each
gradient row its own range (the reason ``hybrid`` has e5m2 gradients for per-tensor scales).
``--no-fp8-wgrad`` does not apply to the experts (their weight gradient is always FP8).

Saved for backward: ``x`` and ``W`` in their own dtype (the backward needs them with other scales).
"""

from __future__ import annotations

import torch

from mcore.backend import get_ops
from mcore.fp8.scaling import _amax, scale_from_amax

EXPERT_FP8_DTYPE = torch.float8_e4m3fn
"""The experts' operand format, forward and backward (see the module doc)."""


def quantize_rows(t: torch.Tensor, margin: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``t [..., K]`` quantized with one scale per row (amax over the last dim):
    ``(q [..., K], scale_inv [...])``."""
    scale = scale_from_amax(_amax(t, dim=-1), EXPERT_FP8_DTYPE, margin)
    q = get_ops().fp8_quantize(t, scale, EXPERT_FP8_DTYPE)
    return q, scale.reciprocal().squeeze(-1)


def quantize_columns_per_expert(
    t: torch.Tensor, expert_of_row: torch.Tensor, experts: int, margin: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``t [N, C]`` (rows grouped by expert) quantized with one scale per (expert, column): the
    column's amax over that expert's rows. Returns the transposed ``q^T [C, N]`` (contiguous: the
    weight gradient's NT operand) and ``scale_inv [E, C]`` (1 for an expert without rows)."""
    # the max of |t| in t's own dtype is exact: no fp32 copy of t
    amax = t.new_zeros(experts, t.shape[1])
    index = expert_of_row[:, None].expand(-1, t.shape[1])
    amax.scatter_reduce_(0, index, t.abs(), reduce="amax", include_self=True)
    scale = scale_from_amax(amax.float(), EXPERT_FP8_DTYPE, margin)
    q = get_ops().fp8_quantize(t.t(), scale.index_select(0, expert_of_row).t(), EXPERT_FP8_DTYPE)
    return q, scale.reciprocal()


class Fp8GroupedGemm(torch.autograd.Function):
    """``y = grouped_gemm(x, weight, tokens_per_expert)`` with FP8 GEMMs (see the module doc)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, tokens_per_expert: torch.Tensor, margin: int):
        counts = tokens_per_expert.to(device=x.device, dtype=torch.int64)
        ctx.save_for_backward(x, weight, counts)
        ctx.margin = margin
        x_q, x_sinv = quantize_rows(x, margin)
        w_q, w_sinv = quantize_rows(weight, margin)
        return get_ops().scaled_grouped_gemm(x_q, w_q, x_sinv, w_sinv, counts, x.dtype)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, weight, counts = ctx.saved_tensors
        ops = get_ops()
        dy = dy.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dy_q, dy_sinv = quantize_rows(dy, ctx.margin)
            w_t_q, w_t_sinv = quantize_rows(weight.transpose(1, 2), ctx.margin)
            dx = ops.scaled_grouped_gemm(dy_q, w_t_q, dy_sinv, w_t_sinv, counts, x.dtype)
        if ctx.needs_input_grad[1]:
            experts = weight.shape[0]
            expert_of_row = torch.repeat_interleave(
                torch.arange(experts, device=x.device), counts, output_size=x.shape[0]
            )
            dy_qT, dy_sinv = quantize_columns_per_expert(dy, expert_of_row, experts, ctx.margin)
            x_qT, x_sinv = quantize_columns_per_expert(x, expert_of_row, experts, ctx.margin)
            dw = ops.scaled_grouped_gemm_wgrad(dy_qT, x_qT, dy_sinv, x_sinv, counts, weight.dtype)
        return dx, dw, None, None


EXPERTS_CAPABILITY = "fp8_grouped_gemm"
"""The backend capability that says its ``scaled_grouped_gemm`` ops run on FP8 units (CUDA: Hopper's
``torch._scaled_grouped_mm``; the CPU backend emulates them, as it emulates the dense FP8 GEMMs)."""


def experts_fp8_status(
    fp8, capabilities: frozenset[str], backend_name: str, etp_size: int
) -> tuple[bool, str]:
    """Whether the routed experts run FP8 (the layer runs FP8, the backend has
    :data:`EXPERTS_CAPABILITY`, no expert tensor parallelism) and the start-up line that says so."""
    if fp8 is None or not fp8.enabled:
        return False, ""
    if EXPERTS_CAPABILITY not in capabilities:
        return False, (
            f"--fp8-format {fp8.fp8_format}: the routed experts stay in the parameters' dtype (device backend "
            f"{backend_name!r} does not claim the scaled grouped GEMM capability '{EXPERTS_CAPABILITY}'); the dense "
            "linears run FP8"
        )
    if etp_size > 1:
        return False, (
            f"--fp8-format {fp8.fp8_format}: the routed experts stay in the parameters' dtype with "
            f"--expert-tensor-parallel-size {etp_size} (their FP8 row scales are not reduced over ETP); "
            "the dense linears run FP8"
        )
    return True, (
        f"--fp8-format {fp8.fp8_format}: the routed experts run FP8 (e4m3, current per-row scaling, "
        f"whatever --fp8-recipe {fp8.fp8_recipe} the dense linears use)"
    )


def fp8_grouped_gemm(x: torch.Tensor, weight: torch.Tensor, tokens_per_expert: torch.Tensor, margin: int = 0):
    """The experts' ``grouped_gemm`` in FP8 (``x [N, K]``, ``weight [E, M, K]`` -> ``[N, M]`` in
    ``x.dtype``); ``margin``: ``--fp8-margin``."""
    return Fp8GroupedGemm.apply(x, weight, tokens_per_expert, margin)


__all__ = [
    "EXPERTS_CAPABILITY",
    "EXPERT_FP8_DTYPE",
    "experts_fp8_status",
    "Fp8GroupedGemm",
    "fp8_grouped_gemm",
    "quantize_columns_per_expert",
    "quantize_rows",
]
