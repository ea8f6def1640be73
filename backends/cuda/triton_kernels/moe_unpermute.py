"""``moe_unpermute``'s weighted sum back to the tokens, without fp32 copies of the rows and without atomics.

Forward, per token ``t`` (one program per token and block of ``H``)::

    out[t] = sum over the rows i routed from t of rows[i] * p_i          (fp32 registers, stored in rows' dtype)

The rows of a token are found through ``order`` (the rows sorted by token, stable) and ``offsets``
(``offsets[t] .. offsets[t+1]`` index ``order``), so the sum is a gather in a fixed order: the result
is deterministic (an ``index_add``/``scatter_add`` is not), and nothing the size of ``rows`` is
written in fp32 (the eager version materialises ``rows * p`` in fp32, twice the bytes of the rows).

Backward, per row ``i`` of token ``t_i`` (one program per row)::

    d rows[i] = dout[t_i] * p_i            (rows' dtype)
    d p_i     = <dout[t_i], rows[i]>       (fp32)

Layouts: ``rows [N, H]`` and ``dout [T, H]`` contiguous, ``row_probs [N]`` fp32 (or none: weight 1),
``sorted_indices [N]`` int64 (the token of each row), ``order [N]`` and ``offsets [T + 1]`` int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_H = 1024


@triton.jit
def _unpermute_fwd_kernel(
    rows, probs, order, offsets, out, hidden, HAS_PROBS: tl.constexpr, BLOCK: tl.constexpr
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cmask = cols < hidden
    start = tl.load(offsets + token)
    end = tl.load(offsets + token + 1)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in range(start, end):
        row = tl.load(order + j)
        x = tl.load(rows + row * hidden + cols, mask=cmask, other=0.0).to(tl.float32)
        if HAS_PROBS:
            x = x * tl.load(probs + row)
        acc += x
    tl.store(out + token * hidden + cols, acc.to(out.dtype.element_ty), mask=cmask)


@triton.jit
def _unpermute_bwd_kernel(
    dout, rows, probs, sorted_indices, d_rows, d_probs, hidden, HAS_PROBS: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    token = tl.load(sorted_indices + row)
    p = tl.load(probs + row) if HAS_PROBS else 1.0
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, hidden, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        cmask = cols < hidden
        g = tl.load(dout + token * hidden + cols, mask=cmask, other=0.0).to(tl.float32)
        if HAS_PROBS:
            x = tl.load(rows + row * hidden + cols, mask=cmask, other=0.0).to(tl.float32)
            acc += g * x
        tl.store(d_rows + row * hidden + cols, (g * p).to(d_rows.dtype.element_ty), mask=cmask)
    if HAS_PROBS:
        tl.store(d_probs + row, tl.sum(acc, axis=0))


def token_order(sorted_indices: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(order [N], offsets [T + 1])``: the rows sorted by token (stable) and where each token's rows
    start in that order; computed on the device without a host sync.

    The result is kept on ``sorted_indices`` (one order per permutation): the unpermute's forward
    computes it and the permute's backward, which needs the same order, reads it back. Keys are
    sorted as int32 (token ids < 2^31): a radix sort of half the passes of int64's."""
    cached = getattr(sorted_indices, "_mcore_token_order", None)
    if cached is not None and cached[0] == num_tokens:
        return cached[1], cached[2]
    keys = sorted_indices.to(torch.int32) if num_tokens < 2**31 else sorted_indices
    tokens_sorted, order = torch.sort(keys, stable=True)
    bounds = torch.arange(num_tokens + 1, device=sorted_indices.device, dtype=tokens_sorted.dtype)
    offsets = torch.searchsorted(tokens_sorted, bounds)
    sorted_indices._mcore_token_order = (num_tokens, order, offsets)
    return order, offsets


def unpermute_forward(
    rows: torch.Tensor,
    row_probs: torch.Tensor | None,
    order: torch.Tensor,
    offsets: torch.Tensor,
    num_tokens: int,
) -> torch.Tensor:
    """``out [T, H]`` in ``rows.dtype`` (see the module doc)."""
    hidden = rows.shape[1]
    out = rows.new_empty(num_tokens, hidden)
    if num_tokens == 0 or hidden == 0:
        return out
    block = min(BLOCK_H, triton.next_power_of_2(hidden))
    probs = row_probs if row_probs is not None else rows  # unused when HAS_PROBS is False
    grid = (num_tokens, triton.cdiv(hidden, block))
    _unpermute_fwd_kernel[grid](
        rows, probs, order, offsets, out, hidden, HAS_PROBS=row_probs is not None, BLOCK=block, num_warps=4
    )
    return out


def unpermute_backward(
    dout: torch.Tensor, rows: torch.Tensor, row_probs: torch.Tensor | None, sorted_indices: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(d_rows [N, H] in rows' dtype, d_probs [N] fp32 or None)``."""
    n, hidden = rows.shape
    d_rows = torch.empty_like(rows)
    d_probs = torch.empty(n, dtype=torch.float32, device=rows.device) if row_probs is not None else None
    if n == 0 or hidden == 0:
        return d_rows, None if d_probs is None else d_probs.zero_()
    block = min(BLOCK_H, triton.next_power_of_2(hidden))
    has_probs = row_probs is not None
    _unpermute_bwd_kernel[(n,)](
        dout, rows, row_probs if has_probs else rows, sorted_indices, d_rows, d_probs if has_probs else rows,
        hidden, HAS_PROBS=has_probs, BLOCK=block, num_warps=4,
    )  # fmt: skip
    return d_rows, d_probs


# --- row gather --------------------------------------------------------------------------------------

GATHER_BLOCK_ROWS, GATHER_BLOCK_H, GATHER_WARPS = 16, 512, 4
"""Tiles of 16 rows x 512 columns: on an H200, gathering 65,536 rows of 2048 bf16 from 8192 tokens
(OLMoE's top-8 permutation) took 91.6 us against ``index_select``'s 123.5 us (``do_bench``; 1 x 2048:
112.3 us, 4 x 1024: 101.2 us); a plain copy of the same output size takes 130 us."""


@triton.jit
def _gather_rows_kernel(src, index, out, n, hidden, BLOCK_ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    rmask = rows < n
    source = tl.load(index + rows, mask=rmask, other=0).to(tl.int64)
    mask = rmask[:, None] & (cols < hidden)[None, :]
    x = tl.load(src + source[:, None] * hidden + cols[None, :], mask=mask)
    tl.store(out + rows.to(tl.int64)[:, None] * hidden + cols[None, :], x, mask=mask)


def gather_rows(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``src.index_select(0, index)`` for a contiguous 2-D ``src`` (the rows of a permutation: many
    rows read several times, from L2): tiles of several rows, 16-byte accesses."""
    n, hidden = index.numel(), src.shape[1]
    out = src.new_empty(n, hidden)
    if n == 0 or hidden == 0:
        return out
    grid = (triton.cdiv(n, GATHER_BLOCK_ROWS), triton.cdiv(hidden, GATHER_BLOCK_H))
    _gather_rows_kernel[grid](
        src, index, out, n, hidden, BLOCK_ROWS=GATHER_BLOCK_ROWS, BLOCK=GATHER_BLOCK_H, num_warps=GATHER_WARPS
    )
    return out
