"""One-pass AdamW over flat buffers (the op ``adam_step_flat``; layout in :mod:`mcore.ops.flat`).

One program updates one *tile*: at most ``BLOCK`` consecutive elements of one segment. The tile
table (state offset, buffer offset, length, group) is built once per segment table and kept on the
device, so a step is a single launch whatever the number of parameters, and bucket padding or other
ranks' shards are never read.

Bytes per element (bf16 parameters): fp32 masters and moments read grad 4 + master 4 + m 4 + v 4 and
write master 4 + param 2 + m 4 + v 4 (30 B, bf16 grads 28 B); the precision-aware layout (bf16 grads,
int16 remainders, bf16 moments) reads 10 and writes 8 (18 B). The clipping coefficient and the skip
flag are read from device memory, so nothing waits for the host.

``adam_step_flat_fp8`` (``--fp8-param-gather``, delayed recipe) is the same kernel with ``HAS_FP8``:
the tile table carries each tile's FP8 weight index (-1 outside the FP8 weights; segments are cut at
the pieces' boundaries), and a tile with an index quantizes the parameters it has just written with
the weight's scale (the FP8 cast kernels' :func:`_quantize_bytes`: their bytes, bit for bit) and
``atomic_max``-es their ``max |p|`` into the weight's amax. That adds 1 B per FP8 weight element (the
FP8 byte) to the step's 18-30 B, and one scale load and one atomic per tile; the separate
quantization after the step it replaces costs ~7 B per element (amax pass 2, quantize 2 + 1, copy
into the gathered buffer 1 + 1), and the per-forward cast without ``--fp8-param-gather`` 4 B per
forward (read 2, write ``W_q`` 1 and ``W_q^T`` 1). Tiles without an index run the plain step's code
(``HAS_FP8`` is a constexpr: ``adam_step_flat`` compiles without any of it).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from mcore.ops.flat import STATE_ALIGN, FlatFp8Weights, FlatSegments, bias_corrections, split_at_fp8_pieces

from .fp8_cast import _MANTISSA_BITS, _MIN_NORMAL_EXP, _TL_FP8, _amax_value, _quantize_bytes, encode_in_int

BLOCK = 1024
ALIGN = STATE_ALIGN
"""16 elements (32 bytes of bf16): full tiles use 16-byte vector accesses."""
MAX_GROUPS = 4
NUM_WARPS = 4
FP8_NUM_WARPS = 2
"""Warps a program of the plain step and of the FP8 step (``adam_step_flat_fp8``). Measured on an H100
(``do_bench``, 256 Mi elements, bf16 parameters with int16 remainders and bf16 moments, one FP8 weight
every 2.7-4 Mi elements): the plain step takes 1,637-1,644 us at every BLOCK/warps pair tried (2.94
TB/s of its 18 B an element). The FP8 step, with the amax atomic ``relaxed``: 1,888 us at 1024/2
(kept), 1,917 at 2048/2, 1,921 at 2048/4, 1,982 at 4096/4, 2,054 at 512/2, 2,071 at 1024/4, 2,338 at
4096/8; against 1,731 us for its 19 B at the plain step's bandwidth. With the atomic's default
``acq_rel`` ordering (a fence around every tile's atomic) the same tiles took 2,034-2,580 us."""


@triton.jit
def _adam_tile(
    grad_ptr, param_ptr, master_ptr, rem_ptr, m_ptr, v_ptr, s_offs, b_offs, mask, g_scale,
    lr, wd, beta1, beta2, eps, bias1, bias2,
    HAS_MASTER: tl.constexpr, HAS_REM: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """AdamW on one tile's elements; ``MASKED=False`` (a full tile) lets every access vectorise.
    Returns the parameters as written (in their own dtype): the FP8 tiles quantize them; elsewhere
    the value is unused and compiles away."""
    if MASKED:
        g = tl.load(grad_ptr + b_offs, mask=mask, other=0.0).to(tl.float32)
    else:
        g = tl.load(grad_ptr + b_offs).to(tl.float32)
    g = g * g_scale
    if HAS_MASTER:
        if MASKED:
            p = tl.load(master_ptr + s_offs, mask=mask, other=0.0)
        else:
            p = tl.load(master_ptr + s_offs)
    elif HAS_REM:
        if MASKED:
            hi = tl.load(param_ptr + b_offs, mask=mask, other=0.0)
            rem = tl.load(rem_ptr + s_offs, mask=mask, other=0)
        else:
            hi = tl.load(param_ptr + b_offs)
            rem = tl.load(rem_ptr + s_offs)
        hi = hi.to(tl.int16, bitcast=True).to(tl.int32)
        p = ((hi << 16) + rem.to(tl.int32)).to(tl.float32, bitcast=True)
    else:
        if MASKED:
            p = tl.load(param_ptr + b_offs, mask=mask, other=0.0).to(tl.float32)
        else:
            p = tl.load(param_ptr + b_offs).to(tl.float32)
    if MASKED:
        m = tl.load(m_ptr + s_offs, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + s_offs, mask=mask, other=0.0).to(tl.float32)
    else:
        m = tl.load(m_ptr + s_offs).to(tl.float32)
        v = tl.load(v_ptr + s_offs).to(tl.float32)

    p = p * (1.0 - lr * wd)
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    denom = tl.sqrt_rn(v / bias2) + eps
    p = p - (lr / bias1) * (m / denom)

    tl.store(m_ptr + s_offs, m.to(m_ptr.dtype.element_ty), mask=mask)
    tl.store(v_ptr + s_offs, v.to(v_ptr.dtype.element_ty), mask=mask)
    if HAS_MASTER:
        tl.store(master_ptr + s_offs, p, mask=mask)
        written = p.to(param_ptr.dtype.element_ty)
        tl.store(param_ptr + b_offs, written, mask=mask)
    elif HAS_REM:
        bits = p.to(tl.int32, bitcast=True)
        hi = (bits + 0x8000) >> 16
        rem = bits - (hi << 16)
        written = hi.to(tl.int16).to(tl.bfloat16, bitcast=True)
        tl.store(param_ptr + b_offs, written, mask=mask)
        tl.store(rem_ptr + s_offs, rem.to(tl.int16), mask=mask)
    else:
        written = p.to(param_ptr.dtype.element_ty)
        tl.store(param_ptr + b_offs, written, mask=mask)
    return written


@triton.jit
def _fp8_tile(
    written, fp8_ptr, fp8_scale_ptr, fp8_amax_ptr, index, b_offs, mask,
    FP8_MAX: tl.constexpr, FP8: tl.constexpr, MANTISSA_BITS: tl.constexpr,
    MIN_NORMAL_EXP: tl.constexpr, ENCODE_IN_INT: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """The FP8 copy of one tile of FP8 weight ``index``: ``saturate(p * scale)`` of the parameters as
    written (the FP8 cast kernels' quantization, so the bytes are theirs and the reference's), and
    ``max |p|`` atomically maxed into the weight's amax (a NaN counts as inf, as the cast kernels')."""
    x = written.to(tl.float32)
    scale = tl.load(fp8_scale_ptr + index)
    q = _quantize_bytes(x, scale, FP8_MAX, FP8, MANTISSA_BITS, MIN_NORMAL_EXP, ENCODE_IN_INT)
    a = tl.abs(x)
    if MASKED:
        tl.store(fp8_ptr + b_offs, q, mask=mask)
        a = tl.where(mask, a, 0.0)
    else:
        tl.store(fp8_ptr + b_offs, q)
    # relaxed: nothing in the kernel reads the amax back, and the kernel's end orders the atomics
    # before any reader; the default acq_rel fences each tile's stores (+7% on the step, H100)
    tl.atomic_max(fp8_amax_ptr + index, _amax_value(a), sem="relaxed")


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
    tile_bounds_ptr,
    tile_group_ptr,
    tile_fp8_ptr,
    fp8_ptr,
    fp8_scale_ptr,
    fp8_amax_ptr,
    scale_ptr,
    skip_ptr,
    bias_ptr,
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
    BIAS_ON_DEVICE: tl.constexpr,
    ALIGNED: tl.constexpr,
    ALIGN: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_FP8: tl.constexpr = False,
    FP8_MAX: tl.constexpr = 448.0,
    FP8: tl.constexpr = None,
    MANTISSA_BITS: tl.constexpr = 3,
    MIN_NORMAL_EXP: tl.constexpr = -6,
    ENCODE_IN_INT: tl.constexpr = False,
):
    tile = tl.program_id(0)
    state0 = tl.load(tile_state_ptr + tile)
    buffer0 = tl.load(tile_buffer_ptr + tile)
    if ALIGNED:  # every tile starts on a multiple of ALIGN in both spaces: 16-byte accesses
        state0 = tl.multiple_of(state0, ALIGN)
        buffer0 = tl.multiple_of(buffer0, ALIGN)
    lo = tl.load(tile_bounds_ptr + 2 * tile)
    hi = tl.load(tile_bounds_ptr + 2 * tile + 1)
    group = tl.load(tile_group_ptr + tile)
    lr = tl.where(group == 0, lr0, tl.where(group == 1, lr1, tl.where(group == 2, lr2, lr3)))
    wd = tl.where(group == 0, wd0, tl.where(group == 1, wd1, tl.where(group == 2, wd2, wd3)))
    g_scale = 1.0
    if HAS_SCALE:
        g_scale = tl.load(scale_ptr)
    run = True
    if HAS_SKIP:  # a non-finite gradient norm: nothing is read or written
        run = tl.load(skip_ptr) == 0
    if BIAS_ON_DEVICE:  # the step counter lives on the device: its corrections are read from there
        bias1 = tl.load(bias_ptr)
        bias2 = tl.load(bias_ptr + 1)
    fp8_index = -1
    if HAS_FP8:  # the FP8 weight this tile belongs to, or -1
        fp8_index = tl.load(tile_fp8_ptr + tile)
    offs = tl.arange(0, BLOCK)
    s_offs = state0 + offs
    b_offs = buffer0 + offs
    full = (lo == 0) & (hi == BLOCK)
    if run:
        if full:
            written = _adam_tile(
                grad_ptr, param_ptr, master_ptr, rem_ptr, m_ptr, v_ptr, s_offs, b_offs, None, g_scale,
                lr, wd, beta1, beta2, eps, bias1, bias2, HAS_MASTER, HAS_REM, False,
            )  # fmt: skip
            if HAS_FP8:
                if fp8_index >= 0:
                    _fp8_tile(
                        written, fp8_ptr, fp8_scale_ptr, fp8_amax_ptr, fp8_index, b_offs, None,
                        FP8_MAX, FP8, MANTISSA_BITS, MIN_NORMAL_EXP, ENCODE_IN_INT, False,
                    )  # fmt: skip
        else:
            mask = (offs >= lo) & (offs < hi)
            written = _adam_tile(
                grad_ptr, param_ptr, master_ptr, rem_ptr, m_ptr, v_ptr, s_offs, b_offs, mask, g_scale,
                lr, wd, beta1, beta2, eps, bias1, bias2, HAS_MASTER, HAS_REM, True,
            )  # fmt: skip
            if HAS_FP8:
                if fp8_index >= 0:
                    _fp8_tile(
                        written, fp8_ptr, fp8_scale_ptr, fp8_amax_ptr, fp8_index, b_offs, mask,
                        FP8_MAX, FP8, MANTISSA_BITS, MIN_NORMAL_EXP, ENCODE_IN_INT, True,
                    )  # fmt: skip
    elif HAS_FP8:  # a skipped step: the FP8 copy of the unchanged parameters, nothing else touched
        if fp8_index >= 0:
            mask = (offs >= lo) & (offs < hi)
            p = tl.load(param_ptr + b_offs, mask=mask, other=0.0)
            _fp8_tile(
                p, fp8_ptr, fp8_scale_ptr, fp8_amax_ptr, fp8_index, b_offs, mask,
                FP8_MAX, FP8, MANTISSA_BITS, MIN_NORMAL_EXP, ENCODE_IN_INT, True,
            )  # fmt: skip


def _tiles(
    segments: FlatSegments, device: torch.device, fp8_ranges: tuple[tuple[int, int, int], ...] | None = None
) -> tuple:
    """The device tile table of ``segments`` (built once, cached on the table).

    A tile covers ``BLOCK`` consecutive buffer positions and updates positions ``[lo, hi)`` of them.
    When every segment's state index differs from its buffer index by a multiple of :data:`ALIGN`,
    tiles start on multiples of ``ALIGN`` (a segment's first and last tiles are then partial), so
    the kernel may assume aligned starts and use vector accesses on every full tile; otherwise tiles
    start at the segment start. Returns (state start, buffer start, [lo, hi] pairs, group, FP8 weight
    index) and whether the tiles are aligned.

    With ``fp8_ranges`` (``adam_step_flat_fp8``) the segments are first cut at the FP8 pieces'
    boundaries (:func:`mcore.ops.flat.split_at_fp8_pieces`), so each tile lies in one FP8 piece (its
    index) or in none (-1); two tiles meeting inside an aligned block mask disjoint positions of it.
    Without, the index column is None.
    """
    key = ("cuda-adam-tiles", BLOCK, ALIGN, str(device), fp8_ranges)
    cached = segments.cache.get(key)
    if cached is not None:
        return cached
    aligned = all((seg.state_start - seg.buffer_start) % ALIGN == 0 for seg in segments.segments)
    if fp8_ranges is None:
        runs = [(seg, -1) for seg in segments.segments]
    else:
        runs = split_at_fp8_pieces(segments, fp8_ranges)
    state, buffer, bounds, group, fp8_index = [], [], [], [], []
    for seg, index in runs:
        first = seg.buffer_start - (seg.buffer_start % ALIGN if aligned else 0)
        end = seg.buffer_start + seg.length
        starts = np.arange(first, end, BLOCK, dtype=np.int64)
        lo = np.maximum(seg.buffer_start - starts, 0)
        hi = np.minimum(end - starts, BLOCK)
        state.append(starts + (seg.state_start - seg.buffer_start))
        buffer.append(starts)
        bounds.append(np.stack([lo, hi], axis=1).reshape(-1))
        group.append(np.full(len(starts), seg.group, dtype=np.int32))
        fp8_index.append(np.full(len(starts), index, dtype=np.int32))

    def to_device(parts, dtype):
        array = np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)
        return torch.from_numpy(array.astype(dtype)).to(device)

    cached = (
        to_device(state, np.int64),
        to_device(buffer, np.int64),
        to_device(bounds, np.int32),
        to_device(group, np.int32),
        to_device(fp8_index, np.int32) if fp8_ranges is not None else None,
        aligned,
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
    step: int | torch.Tensor,
    lrs,
    weight_decays,
    beta1: float,
    beta2: float,
    eps: float,
    grad_scale: torch.Tensor | None = None,
    skip: torch.Tensor | None = None,
) -> None:
    """The reference ``adam_step_flat`` in one Triton launch (up to :data:`MAX_GROUPS` groups).

    A ``step`` tensor (the optimizer's device counter of applied updates) gives the bias corrections
    as two fp32 values in device memory (float64 ``pow`` on the device, then rounded, as the host
    rounds its doubles), read by every program: no host read."""
    _launch(
        grads, params, masters, remainders, exp_avgs, exp_avg_sqs, segments, None, step=step, lrs=lrs,
        weight_decays=weight_decays, beta1=beta1, beta2=beta2, eps=eps, grad_scale=grad_scale, skip=skip,
    )  # fmt: skip


def adam_step_flat_fp8(
    grads: torch.Tensor,
    params: torch.Tensor,
    masters: torch.Tensor | None,
    remainders: torch.Tensor | None,
    exp_avgs: torch.Tensor,
    exp_avg_sqs: torch.Tensor,
    segments: FlatSegments,
    fp8: FlatFp8Weights,
    *,
    step: int | torch.Tensor,
    lrs,
    weight_decays,
    beta1: float,
    beta2: float,
    eps: float,
    grad_scale: torch.Tensor | None = None,
    skip: torch.Tensor | None = None,
) -> None:
    """The reference ``adam_step_flat_fp8`` in one launch: :func:`adam_step_flat`'s kernel, whose tiles
    in an FP8 weight's piece also quantize the parameters they just wrote and max their amax.

    Bytes per FP8 weight element, beside the plain step's (module docstring): the FP8 byte written
    (1 B; the scale and the atomic amax are one word per tile). The separate quantization after the
    step it replaces read the parameter twice (an amax pass and the quantize, 2 + 2 B), wrote a
    temporary FP8 tensor and copied it into the gathered buffer (1 + 1 + 1 B): ~7 B per element.
    A skipped step (a non-finite gradient norm) reads the FP8 pieces' parameters (2 B) and writes
    their bytes (1 B); every other tile does nothing.
    """
    fp8.amax.zero_()  # the tiles atomic-max into it (|p| >= 0: exact on zeroed memory)
    _launch(
        grads, params, masters, remainders, exp_avgs, exp_avg_sqs, segments, fp8, step=step, lrs=lrs,
        weight_decays=weight_decays, beta1=beta1, beta2=beta2, eps=eps, grad_scale=grad_scale, skip=skip,
    )  # fmt: skip


def _launch(
    grads, params, masters, remainders, exp_avgs, exp_avg_sqs, segments, fp8, *, step, lrs, weight_decays,
    beta1, beta2, eps, grad_scale, skip,
) -> None:  # fmt: skip
    """One launch of the kernel over the tile table (with ``fp8``: the FP8 tiles' table and constexprs)."""
    ranges = fp8.ranges if fp8 is not None else None
    tile_state, tile_buffer, tile_bounds, tile_group, tile_fp8, aligned = _tiles(
        segments, grads.device, ranges
    )
    tiles = tile_state.numel()
    if tiles == 0:
        return
    bias1, bias2 = bias_corrections(step, beta1, beta2)
    bias_on_device = isinstance(step, torch.Tensor)
    if bias_on_device:
        bias = torch.stack([bias1, bias2]).to(device=grads.device, dtype=torch.float32)
        bias1 = bias2 = 1.0  # placeholders: the kernel reads ``bias``
    lrs = list(lrs) + [0.0] * (MAX_GROUPS - len(lrs))
    wds = list(weight_decays) + [0.0] * (MAX_GROUPS - len(weight_decays))
    dummy = exp_avgs  # a valid pointer for the arguments a constexpr switches off
    fp8_constexprs = {}
    if fp8 is not None:
        fp8_dtype = fp8.data.dtype
        fp8_constexprs = dict(
            HAS_FP8=True,
            FP8_MAX=float(torch.finfo(fp8_dtype).max),
            FP8=_TL_FP8[fp8_dtype],
            MANTISSA_BITS=_MANTISSA_BITS[fp8_dtype],
            MIN_NORMAL_EXP=_MIN_NORMAL_EXP[fp8_dtype],
            ENCODE_IN_INT=encode_in_int(params.dtype),
        )
    _adam_flat_kernel[(tiles,)](
        grads,
        params,
        masters if masters is not None else dummy,
        remainders if remainders is not None else dummy,
        exp_avgs,
        exp_avg_sqs,
        tile_state,
        tile_buffer,
        tile_bounds,
        tile_group,
        tile_fp8 if fp8 is not None else dummy,
        fp8.data.view(torch.uint8) if fp8 is not None else dummy,
        fp8.scales if fp8 is not None else dummy,
        fp8.amax if fp8 is not None else dummy,
        grad_scale if grad_scale is not None else dummy,
        skip.view(torch.uint8) if skip is not None else dummy,
        bias if bias_on_device else dummy,
        *[float(x) for x in lrs[:MAX_GROUPS]],
        *[float(x) for x in wds[:MAX_GROUPS]],
        float(beta1),
        float(beta2),
        float(eps),
        float(bias1),
        float(bias2),
        HAS_MASTER=masters is not None,
        HAS_REM=remainders is not None,
        HAS_SCALE=grad_scale is not None,
        HAS_SKIP=skip is not None,
        BIAS_ON_DEVICE=bias_on_device,
        ALIGNED=aligned,
        ALIGN=ALIGN,
        BLOCK=BLOCK,
        num_warps=FP8_NUM_WARPS if fp8 is not None else NUM_WARPS,
        **fp8_constexprs,
    )
