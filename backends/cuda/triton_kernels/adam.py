"""One-pass AdamW over flat buffers (the op ``adam_step_flat``; layout in :mod:`mcore.ops.flat`).

One program updates one *tile*: at most ``BLOCK`` consecutive elements of one segment. The tile
table (state offset, buffer offset, length, group) is built once per segment table and kept on the
device, so a step is a single launch whatever the number of parameters, and bucket padding or other
ranks' shards are never read.

Bytes per element (bf16 parameters): fp32 masters and moments read grad 4 + master 4 + m 4 + v 4 and
write master 4 + param 2 + m 4 + v 4 (30 B, bf16 grads 28 B); the precision-aware layout (bf16 grads,
int16 remainders, bf16 moments) reads 10 and writes 8 (18 B). The clipping coefficient and the skip
flag are read from device memory, so nothing waits for the host.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from mcore.ops.flat import FlatSegments

BLOCK = 4096
MAX_GROUPS = 4


@triton.jit
def _adam_flat_kernel(
    grad_ptr,
    param_ptr,
    master_ptr,
    rem_ptr,
    m_ptr,
    v_ptr,
    tile_state_ptr,
    tile_buffer_ptr,
    tile_len_ptr,
    tile_group_ptr,
    scale_ptr,
    skip_ptr,
    lr0,
    lr1,
    lr2,
    lr3,
    wd0,
    wd1,
    wd2,
    wd3,
    beta1,
    beta2,
    eps,
    bias1,
    bias2,
    HAS_MASTER: tl.constexpr,
    HAS_REM: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_SKIP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    tile = tl.program_id(0)
    state0 = tl.load(tile_state_ptr + tile)
    buffer0 = tl.load(tile_buffer_ptr + tile)
    length = tl.load(tile_len_ptr + tile)
    group = tl.load(tile_group_ptr + tile)
    lr = tl.where(group == 0, lr0, tl.where(group == 1, lr1, tl.where(group == 2, lr2, lr3)))
    wd = tl.where(group == 0, wd0, tl.where(group == 1, wd1, tl.where(group == 2, wd2, wd3)))

    offs = tl.arange(0, BLOCK)
    mask = offs < length
    if HAS_SKIP:  # a non-finite gradient norm: every load and store is masked off
        mask = mask & (tl.load(skip_ptr) == 0)
    s_offs = state0 + offs
    b_offs = buffer0 + offs

    g = tl.load(grad_ptr + b_offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        g = g * tl.load(scale_ptr)
    if HAS_MASTER:
        p = tl.load(master_ptr + s_offs, mask=mask, other=0.0)
    elif HAS_REM:
        hi = tl.load(param_ptr + b_offs, mask=mask, other=0.0).to(tl.int16, bitcast=True).to(tl.int32)
        rem = tl.load(rem_ptr + s_offs, mask=mask, other=0).to(tl.int32)
        p = ((hi << 16) + rem).to(tl.float32, bitcast=True)
    else:
        p = tl.load(param_ptr + b_offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + s_offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + s_offs, mask=mask, other=0.0).to(tl.float32)

    p = p * (1.0 - lr * wd)
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    denom = tl.sqrt_rn(v / bias2) + eps
    p = p - (lr / bias1) * (m / denom)

    tl.store(m_ptr + s_offs, m.to(m_ptr.dtype.element_ty), mask=mask)
    tl.store(v_ptr + s_offs, v.to(v_ptr.dtype.element_ty), mask=mask)
    if HAS_MASTER:
        tl.store(master_ptr + s_offs, p, mask=mask)
        tl.store(param_ptr + b_offs, p.to(param_ptr.dtype.element_ty), mask=mask)
    elif HAS_REM:
        bits = p.to(tl.int32, bitcast=True)
        hi = (bits + 0x8000) >> 16
        rem = bits - (hi << 16)
        tl.store(param_ptr + b_offs, hi.to(tl.int16).to(tl.bfloat16, bitcast=True), mask=mask)
        tl.store(rem_ptr + s_offs, rem.to(tl.int16), mask=mask)
    else:
        tl.store(param_ptr + b_offs, p.to(param_ptr.dtype.element_ty), mask=mask)


def _tiles(segments: FlatSegments, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The device tile table of ``segments`` (built once, cached on the table)."""
    key = ("cuda-adam-tiles", BLOCK, str(device))
    cached = segments.cache.get(key)
    if cached is not None:
        return cached
    state, buffer, length, group = [], [], [], []
    for seg in segments.segments:
        n = -(-seg.length // BLOCK)
        starts = np.arange(n, dtype=np.int64) * BLOCK
        state.append(seg.state_start + starts)
        buffer.append(seg.buffer_start + starts)
        length.append(np.minimum(BLOCK, seg.length - starts).astype(np.int32))
        group.append(np.full(n, seg.group, dtype=np.int32))

    def to_device(parts, dtype):
        array = np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)
        return torch.from_numpy(array.astype(dtype)).to(device)

    cached = (
        to_device(state, np.int64),
        to_device(buffer, np.int64),
        to_device(length, np.int32),
        to_device(group, np.int32),
    )
    segments.cache[key] = cached
    return cached


def adam_step_flat(
    grads: torch.Tensor,
    params: torch.Tensor,
    masters: torch.Tensor | None,
    remainders: torch.Tensor | None,
    exp_avgs: torch.Tensor,
    exp_avg_sqs: torch.Tensor,
    segments: FlatSegments,
    *,
    step: int,
    lrs,
    weight_decays,
    beta1: float,
    beta2: float,
    eps: float,
    grad_scale: torch.Tensor | None = None,
    skip: torch.Tensor | None = None,
) -> None:
    """The reference ``adam_step_flat`` in one Triton launch (up to :data:`MAX_GROUPS` groups)."""
    tile_state, tile_buffer, tile_len, tile_group = _tiles(segments, grads.device)
    tiles = tile_state.numel()
    if tiles == 0:
        return
    lrs = list(lrs) + [0.0] * (MAX_GROUPS - len(lrs))
    wds = list(weight_decays) + [0.0] * (MAX_GROUPS - len(weight_decays))
    dummy = exp_avgs  # a valid pointer for the arguments a constexpr switches off
    _adam_flat_kernel[(tiles,)](
        grads,
        params,
        masters if masters is not None else dummy,
        remainders if remainders is not None else dummy,
        exp_avgs,
        exp_avg_sqs,
        tile_state,
        tile_buffer,
        tile_len,
        tile_group,
        grad_scale if grad_scale is not None else dummy,
        skip.view(torch.uint8) if skip is not None else dummy,
        *[float(x) for x in lrs[:MAX_GROUPS]],
        *[float(x) for x in wds[:MAX_GROUPS]],
        float(beta1),
        float(beta2),
        float(eps),
        float(1.0 - beta1**step),
        float(1.0 - beta2**step),
        HAS_MASTER=masters is not None,
        HAS_REM=remainders is not None,
        HAS_SCALE=grad_scale is not None,
        HAS_SKIP=skip is not None,
        BLOCK=BLOCK,
        num_warps=8,
    )
