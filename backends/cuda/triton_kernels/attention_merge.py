"""``attention_merge`` in one pass: two key blocks' partial attentions merged through their
log-sum-exps (:func:`mcore.ops.reference.attention_merge`), reading each ``out`` once and writing the
merged ``out`` and ``lse`` once (the reference's eager version makes fp32 copies of both outputs and
several element-wise passes).

Per row (``(b, n, s)``): ``m = max(lse_a, lse_b)`` (0 if both are -inf), ``w_x = exp(lse_x - m)``,
``t = w_a + w_b``; ``lse = m + log t`` (-inf when ``t == 0``), ``out = (w_a out_a + w_b out_b) / t``
(0 when ``t == 0``), in fp32, ``out`` stored in its dtype. ``out_*`` are ``[b, n, s, d]`` with any
strides whose last is 1 (FlashAttention's output is a transposed view); ``lse_*`` ``[b, n, s]`` fp32,
any strides. No autograd: ring attention's autograd function calls it in its forward only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROWS = 16


@triton.jit
def _merge_kernel(
    oa, ob, o, la, lb, lo, total_rows, n_heads, seq, d,
    sa_b, sa_n, sa_s, sb_b, sb_n, sb_s, so_b, so_n, so_s,
    la_b, la_n, la_s, lb_b, lb_n, lb_s,
    ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    rmask = rows < total_rows
    s = rows % seq
    bn = rows // seq
    n = bn % n_heads
    b = bn // n_heads
    lse_a = tl.load(la + b * la_b + n * la_n + s * la_s, mask=rmask, other=float("-inf"))
    lse_b = tl.load(lb + b * lb_b + n * lb_n + s * lb_s, mask=rmask, other=float("-inf"))
    m = tl.maximum(lse_a, lse_b)
    m = tl.where(m == float("-inf"), 0.0, m)
    wa = tl.exp(lse_a - m)
    wb = tl.exp(lse_b - m)
    total = wa + wb
    has_keys = total > 0.0
    inv = tl.where(has_keys, 1.0 / tl.where(has_keys, total, 1.0), 0.0)
    lse = tl.where(has_keys, m + tl.log(tl.where(has_keys, total, 1.0)), float("-inf"))
    tl.store(lo + rows, lse, mask=rmask)
    cols = tl.arange(0, BLOCK_D)
    mask = rmask[:, None] & (cols < d)[None, :]
    xa = tl.load(oa + (b * sa_b + n * sa_n + s * sa_s)[:, None] + cols[None, :], mask=mask, other=0.0)
    xb = tl.load(ob + (b * sb_b + n * sb_n + s * sb_s)[:, None] + cols[None, :], mask=mask, other=0.0)
    out = xa.to(tl.float32) * (wa * inv)[:, None] + xb.to(tl.float32) * (wb * inv)[:, None]
    tl.store(
        o + (b * so_b + n * so_n + s * so_s)[:, None] + cols[None, :], out.to(o.dtype.element_ty), mask=mask
    )


def attention_merge(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The merged ``(out [b, n, s, d] in out_a's dtype and strides, lse [b, n, s] fp32)``."""
    b, n, s, d = out_a.shape
    out = torch.empty_like(out_a)
    lse = torch.empty(b, n, s, dtype=torch.float32, device=out_a.device)
    total = b * n * s
    if total == 0:
        return out, lse
    grid = (triton.cdiv(total, ROWS),)
    _merge_kernel[grid](
        out_a, out_b, out, lse_a, lse_b, lse, total, n, s, d,
        *out_a.stride()[:3], *out_b.stride()[:3], *out.stride()[:3], *lse_a.stride(), *lse_b.stride(),
        ROWS=ROWS, BLOCK_D=triton.next_power_of_2(d), num_warps=4,
    )  # fmt: skip
    return out, lse
