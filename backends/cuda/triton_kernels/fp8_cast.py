"""FP8 casts for the FP8 linears: an amax reduction and one cast(-transpose) kernel per tensor.

Transformer Engine's current-scaling cast is two passes over a bf16 tensor ``x [M, K]``: the amax
``max |x|`` (one read), then the cast ``q = saturate(x * scale)`` with ``scale = fp8_max / amax /
2^margin`` (one read, the FP8 writes). Here each pass is one kernel:

* :func:`amax`: a grid-strided loop over blocks of ``x`` keeps a running ``max |x|`` in registers;
  each program ``atomic_max``-es it into one fp32 word (zeroed first), so the amax costs one read of
  ``x`` and no partial-results pass.
* :func:`cast`: ``[BLOCK_M, BLOCK_K]`` tiles, one per program (grid-strided when it records an
  amax). Each program forms the scale on the device from the amax (no separate scale kernels: the
  host never waits, and CUDA graphs capture it), casts its tiles and writes them to ``q [M, K]``
  (``rowwise``) and/or, transposed in registers and shared memory, to ``q^T [K, M]``
  (``columnwise``), both with coalesced stores; program 0 writes ``scale_inv``. With a given scale
  (the delayed recipe) it can record the amax into a running-max slot (``amax_record``) in the same
  pass, so delayed scaling needs no amax pass at all.

The arithmetic is :mod:`mcore.ops.reference`'s bit for bit: the scale is ``(1 / amax) *
(fp8_max / 2^margin)`` and its inverse ``1 / scale``, with correctly rounded fp32 reciprocals;
``x * scale`` is an fp32 product clamped to the format's finite range and rounded to nearest even.
A NaN in ``x`` counts as an infinite amax (the reference's NaN amax), which gives the same scale (1,
as for any amax that is not finite).

On the GPU the hardware conversion (``cvt.rn.satfinite``) rounds and clamps, except for tiles
loaded from fp32: there the kernels build the FP8 bytes with integer operations instead
(:func:`_fp8_bytes`, ``ENCODE_IN_INT``), because with such a tile stored row-major and transposed in
one kernel Triton 3.6's ptxas (12.9) corrupts the transposed store on Hopper (triton-lang/triton#11111;
measured on an H100: every cast of an fp32 tile of the shapes and tilings tried had a corrupt ``q^T``
with the conversion, with or without byte stores, a transpose before the conversion or transposed
addresses; none with the integer encoding, which costs ~10% at [8192, 8192] fp32). Under Triton's
CPU interpreter the conversion is not round-to-nearest-even (it rounds the mantissa half-up and
drops the carry into the exponent: 124.4 becomes 64 in e4m3), so the interpreter takes the integer
encoding too: the CPU tests run the exact code of the fp32 path.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._common import (
    INTERPRET,
    GridLaunch,
    balanced_programs,
    cached_launch,
    sm_count,
    sum_partials,
    use_autotune,
)

_TL_FP8 = {torch.float8_e4m3fn: tl.float8e4nv, torch.float8_e5m2: tl.float8e5}
_MANTISSA_BITS = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}
_MIN_NORMAL_EXP = {torch.float8_e4m3fn: -6, torch.float8_e5m2: -14}

AMAX_BLOCK = 8192
"""Elements one loop iteration of an :func:`amax` program reduces (16 KB of bf16)."""

PROGRAMS_PER_SM = 16
"""Programs per multiprocessor of the grid-strided loops, so that each program ends with one atomic
on the single amax word, not one per block or tile. Measured on an H100 (8192 x 8192 bf16, cast and
transpose recording the amax, the atomic then ``acq_rel``): 116 us with 2-4 programs per SM, 105 us
with 16, 107 us with one program per tile; the same cast without the record 99 us. With the atomic
``relaxed`` (:func:`_record_amax`; 2026-11-25, [8192, 2048] bf16 -> e4m3 ``q`` and ``q^T``, 128 x 128
tiles) the record costs ~0: 28.7 us with 16 programs an SM or one a tile, against 29.9 us with the
``acq_rel`` atomic and 27.7-29.0 us without a record (28.4 us for a bf16 copy of the same bytes)."""


@triton.jit
def _amax_kernel(x_ptr, amax_ptr, numel, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for block in range(pid, tl.cdiv(numel, BLOCK), programs):
        offs = tl.full([], BLOCK, tl.int64) * block + tl.arange(0, BLOCK)  # 64-bit offsets
        x = tl.load(x_ptr + offs, mask=offs < numel, other=0.0).to(tl.float32)
        acc = tl.maximum(acc, tl.where(x == x, tl.abs(x), float("inf")))  # NaN -> inf: not finite either way
    tl.atomic_max(amax_ptr, tl.max(acc, axis=0), sem="relaxed")  # read by later kernels only


@triton.jit
def _scale_from_amax(amax, FP8_LIMIT: tl.constexpr):
    # FP8_LIMIT = fp8_max / 2^margin, exact in fp32. The reference's ``limit / amax`` is torch's
    # ``amax.reciprocal() * limit`` (how a Python number divided by a tensor is evaluated): the
    # correctly rounded reciprocal, then one rounded product, not one correctly rounded quotient
    ok = (amax > 0.0) & (amax < float("inf"))
    scale = tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32), tl.where(ok, amax, 1.0)) * FP8_LIMIT
    scale = tl.where(ok, scale, 1.0)
    return tl.minimum(scale, 3.4028234663852886e38)


@triton.jit
def _load_scale(scale_in_ptr, scale_inv_ptr, publish, FROM_AMAX: tl.constexpr, FP8_LIMIT: tl.constexpr):
    """The cast's scale: the given one, or (``FROM_AMAX``) formed from the given amax
    (:func:`_scale_from_amax`); the program that ``publish``-es stores ``scale_inv = 1 / scale``."""
    scale = tl.load(scale_in_ptr)
    if FROM_AMAX:
        scale = _scale_from_amax(scale, FP8_LIMIT)
    if publish:
        tl.store(scale_inv_ptr, tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale))
    return scale


@triton.jit
def _round_to_fp8_grid(y, MANTISSA_BITS: tl.constexpr, MIN_NORMAL_EXP: tl.constexpr):
    """``y`` (fp32, within the format's range) rounded to nearest even onto the FP8 grid, in fp32:
    the grid step is ``2^(max(e, e_min) - mantissa_bits)`` for ``y``'s binary exponent ``e``."""
    exp = ((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    step_exp = tl.maximum(exp, MIN_NORMAL_EXP) - MANTISSA_BITS
    step = ((step_exp + 127) << 23).to(tl.float32, bitcast=True)
    inv_step = ((127 - step_exp) << 23).to(tl.float32, bitcast=True)
    t = y * inv_step  # exact (a power of two), |t| < 2^(MANTISSA_BITS + 1)
    magic = 12582912.0  # 1.5 * 2^23: adding and removing it rounds |t| < 2^22 to an integer, ties to even
    return ((t + magic) - magic) * step


@triton.jit
def _fp8_bytes(y, MANTISSA_BITS: tl.constexpr, MIN_NORMAL_EXP: tl.constexpr):
    """The FP8 bytes of fp32 ``y`` (within the format's finite range, or NaN), rounded to nearest even,
    built with integer operations: ``sign | exponent | mantissa`` of the value rounded onto the grid
    (:func:`_round_to_fp8_grid`); subnormals (below ``2^MIN_NORMAL_EXP``) as the integer
    ``|y| / 2^(MIN_NORMAL_EXP - MANTISSA_BITS)``; NaN as ``sign | 0x7F`` (as torch converts it). The
    exponent bias is ``1 - MIN_NORMAL_EXP`` (7 for e4m3, 15 for e5m2). The sign is taken before the
    rounding, whose magic-number addition turns -0 into +0."""
    sign = (y.to(tl.int32, bitcast=True) >> 24) & 0x80
    r = _round_to_fp8_grid(y, MANTISSA_BITS, MIN_NORMAL_EXP)
    bits = r.to(tl.int32, bitcast=True)
    exp = ((bits >> 23) & 0xFF) - 127
    mantissa = (bits >> (23 - MANTISSA_BITS)) & ((1 << MANTISSA_BITS) - 1)
    normal = ((exp + 1 - MIN_NORMAL_EXP) << MANTISSA_BITS) | mantissa
    subnormal = (tl.abs(r) * (2.0 ** (MANTISSA_BITS - MIN_NORMAL_EXP))).to(tl.int32)
    magnitude = tl.where(exp >= MIN_NORMAL_EXP, normal, subnormal)
    return (sign | tl.where(y == y, magnitude, 0x7F)).to(tl.uint8)


@triton.jit
def _cast_kernel(
    x_ptr,
    q_ptr,
    qt_ptr,
    scale_in_ptr,
    scale_inv_ptr,
    amax_record_ptr,
    M,
    K,
    stride_xm,
    stride_xk,
    FP8_LIMIT: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP8: tl.constexpr,
    MANTISSA_BITS: tl.constexpr,
    MIN_NORMAL_EXP: tl.constexpr,
    ENCODE_IN_INT: tl.constexpr,
    FROM_AMAX: tl.constexpr,
    RECORD_AMAX: tl.constexpr,
    ROWWISE: tl.constexpr,
    COLUMNWISE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    scale = _load_scale(scale_in_ptr, scale_inv_ptr, pid == 0, FROM_AMAX, FP8_LIMIT)
    tiles_k = tl.cdiv(K, BLOCK_K)
    # per row of the tile: max over the row is a reduction within warps (no shared memory, no barrier)
    running_amax = tl.zeros([BLOCK_M], dtype=tl.float32)
    for tile in range(pid, tl.cdiv(M, BLOCK_M) * tiles_k, programs):
        rows = ((tile // tiles_k) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        cols = ((tile % tiles_k) * BLOCK_K + tl.arange(0, BLOCK_K)).to(tl.int64)
        mask = (rows[:, None] < M) & (cols[None, :] < K)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xk, mask=mask, other=0.0)
        x = x.to(tl.float32)
        if RECORD_AMAX:
            running_amax = _abs_max_rows(running_amax, x, mask, False)
        _quantize_store_tile(
            x, scale, q_ptr, qt_ptr, rows, cols, mask, M, K,
            FP8_MAX, FP8, MANTISSA_BITS, MIN_NORMAL_EXP, ENCODE_IN_INT, ROWWISE, COLUMNWISE,
        )  # fmt: skip
    if RECORD_AMAX:
        _record_amax(amax_record_ptr, running_amax)


@triton.jit
def _max_nan(a, b):
    """``max(a, b)``, NaN if either is (``max.NaN``)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _abs_max_rows(running, x, mask, EVEN: tl.constexpr):
    """``running`` ``[BLOCK_M]`` maxed with the rows' ``max |x|`` (over ``mask`` unless ``EVEN``).

    A NaN counts as an infinite amax: ``max.NaN`` keeps it through the reductions (one instruction,
    ``|x|`` a free operand modifier) and :func:`_amax_value` turns it into ``inf`` once at the end."""
    a = tl.abs(x)
    if not EVEN:
        a = tl.where(mask, a, 0.0)
    return _max_nan(running, tl.reduce(a, 1, _max_nan))


@triton.jit
def _amax_value(running):
    """The amax of the ``running`` row maxima of :func:`_abs_max_rows`: ``inf`` where one was NaN."""
    a = tl.reduce(running, 0, _max_nan)
    return tl.where(a == a, a, float("inf"))


@triton.jit
def _record_amax(amax_record_ptr, running):
    """Max the amax of the ``running`` row maxima into the delayed recipe's record word.

    ``relaxed``: no program reads the word back, and the kernel's end orders the atomics before any
    later kernel reads it; the default ``acq_rel`` fences every program's atomic (1.2 us of a 29.9 us
    [8192, 2048] cast; 5 us of a 108.7 us GeLU [8192, 8192] forward run one tile a program: see
    ``PROGRAMS_PER_SM`` and :mod:`.act_fp8`)."""
    tl.atomic_max(amax_record_ptr, _amax_value(running), sem="relaxed")


@triton.jit
def _quantize_bytes(
    x,
    scale,
    FP8_MAX: tl.constexpr,
    FP8: tl.constexpr,
    MANTISSA_BITS: tl.constexpr,
    MIN_NORMAL_EXP: tl.constexpr,
    ENCODE_IN_INT: tl.constexpr,
):
    """``saturate(x * scale)`` of an fp32 tile in FP8, rounded to nearest even, as its bytes (uint8).

    On the GPU the conversion is ``cvt.rn.satfinite``: it rounds to nearest even and clamps to the
    finite range itself (``+-inf`` to ``+-FP8_MAX``, NaN stays NaN, as ``torch.clamp`` then the cast),
    so no compare-and-select is spent on the clamp. With ``ENCODE_IN_INT`` (tiles loaded from fp32,
    and the interpreter: see the module docstring) the clamp is done in fp32 and the bytes are built
    by :func:`_fp8_bytes`."""
    y = x * scale
    if ENCODE_IN_INT:
        # clamp keeps NaN (as torch.clamp does): the NaN check downstream still sees it
        y = tl.where(y > FP8_MAX, FP8_MAX, tl.where(y < -FP8_MAX, -FP8_MAX, y))
        return _fp8_bytes(y, MANTISSA_BITS, MIN_NORMAL_EXP)
    return y.to(FP8, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)


@triton.jit
def _store_tile_bytes(
    q_ptr,
    qt_ptr,
    q,
    rows,
    cols,
    M,
    K,
    cols_end,
    ROWWISE: tl.constexpr,
    COLUMNWISE: tl.constexpr,
    EVEN: tl.constexpr,
):
    """The FP8 bytes ``q [BLOCK_M, BLOCK_K]`` at ``(rows, cols)`` of ``q [M, K]`` and/or, transposed,
    of ``qT [K, M]``, masked to ``rows < M`` and ``cols < cols_end`` unless ``EVEN`` (the tile lies
    inside them; ``cols_end < K``: the columns of one part of a row, as SwiGLU's ``[d gate | d up]``).

    Stored as bytes (``q_ptr``/``qt_ptr`` are uint8 views): with an FP8 tile stored both row-major and
    transposed in one kernel, Triton 3.6's ptxas (12.9) corrupts the transposed store on Hopper
    (triton-lang/triton#11111); 8-bit integer stores are clean."""
    if ROWWISE:
        if EVEN:
            tl.store(q_ptr + rows[:, None] * K + cols[None, :], q)
        else:
            mask = (rows[:, None] < M) & (cols[None, :] < cols_end)
            tl.store(q_ptr + rows[:, None] * K + cols[None, :], q, mask=mask)
    if COLUMNWISE:
        if EVEN:
            tl.store(qt_ptr + cols[:, None] * M + rows[None, :], tl.trans(q))
        else:
            mask_t = (cols[:, None] < cols_end) & (rows[None, :] < M)
            tl.store(qt_ptr + cols[:, None] * M + rows[None, :], tl.trans(q), mask=mask_t)


@triton.jit
def _quantize_store_tile(
    x,
    scale,
    q_ptr,
    qt_ptr,
    rows,
    cols,
    mask,
    M,
    K,
    FP8_MAX: tl.constexpr,
    FP8: tl.constexpr,
    MANTISSA_BITS: tl.constexpr,
    MIN_NORMAL_EXP: tl.constexpr,
    ENCODE_IN_INT: tl.constexpr,
    ROWWISE: tl.constexpr,
    COLUMNWISE: tl.constexpr,
):
    """``q = saturate(x * scale)`` of one fp32 tile ``x [BLOCK_M, BLOCK_K]`` (rows ``rows``, columns
    ``cols`` of ``[M, K]``) stored to ``q [M, K]`` and/or transposed to ``qT [K, M]``: the one
    quantization (:func:`_quantize_bytes`, :func:`_store_tile_bytes`) that the cast kernels and the
    fused activation kernels share, so their FP8 bytes are the same by construction."""
    q = _quantize_bytes(x, scale, FP8_MAX, FP8, MANTISSA_BITS, MIN_NORMAL_EXP, ENCODE_IN_INT)
    _store_tile_bytes(q_ptr, qt_ptr, q, rows, cols, M, K, K, ROWWISE, COLUMNWISE, False)


@triton.jit
def _band_source(x_ptr, x1_ptr, x2_ptr, band_start, stride_xm, stride_x1m, stride_x2m, W0, W1, W2):
    """Where column band ``[band_start, band_start + BLOCK_K)`` of the packed ``x`` (groups of ``[W0 |
    W1 | W2]`` columns, :func:`mcore.ops.reference.pack_columns`) lies in its part: ``(pointer to the
    band's first column in row 0, the part's row stride)``. The band lies in one part of one group
    (``BLOCK_K`` divides every width; the host checks)."""
    width = W0 + W1 + W2
    group = band_start // width
    within = band_start - group * width
    if within < W0:
        src = x_ptr + (group * W0 + within)
        stride_m = stride_xm
    elif within < W0 + W1:
        src = x1_ptr + (group * W1 + within - W0)
        stride_m = stride_x1m
    else:
        src = x2_ptr + (group * W2 + within - W0 - W1)
        stride_m = stride_x2m
    return src, stride_m


@triton.jit
def _cast_dbias_kernel(
    x_ptr,
    x1_ptr,
    x2_ptr,
    q_ptr,
    qt_ptr,
    part_ptr,
    scale_in_ptr,
    scale_inv_ptr,
    amax_record_ptr,
    M,
    K,
    stride_xm,
    stride_xk,
    stride_x1m,
    stride_x2m,
    W0,
    W1,
    W2,
    PACKED: tl.constexpr,
    HAS_DBIAS: tl.constexpr,
    FP8_LIMIT: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP8: tl.constexpr,
    MANTISSA_BITS: tl.constexpr,
    MIN_NORMAL_EXP: tl.constexpr,
    ENCODE_IN_INT: tl.constexpr,
    FROM_AMAX: tl.constexpr,
    RECORD_AMAX: tl.constexpr,
    ROWWISE: tl.constexpr,
    COLUMNWISE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SUM_2D: tl.constexpr,
    PER_SM: tl.constexpr,
):
    """:func:`_cast_kernel` plus the column sums: program ``(c, r)`` of a ``[K / BLOCK_K, R]`` grid
    casts the row tiles ``r, r + R, ...`` of column band ``c`` and keeps their fp32 column sums in
    registers (``SUM_2D``: a tile-shaped fp32 sum, reduced over rows once at the end), then writes
    them to ``part[r, band]`` (``[R, K]`` fp32; no atomics: the partials are summed in a fixed order
    afterwards). ``PER_SM`` only sizes the grid (a key of the tuned configs).

    ``PACKED``: ``x`` is the column packing of three parts (``x_ptr``, ``x1_ptr``, ``x2_ptr``, unit
    column stride, groups of ``[W0 | W1 | W2]`` columns; :func:`_band_source`), read where they lie.
    Without ``HAS_DBIAS`` no column sums are kept or written (the packed cast of a bias-less linear)."""
    band = tl.program_id(0)
    split = tl.program_id(1)
    splits = tl.num_programs(1)
    scale = _load_scale(scale_in_ptr, scale_inv_ptr, (band == 0) & (split == 0), FROM_AMAX, FP8_LIMIT)
    cols = (band * BLOCK_K + tl.arange(0, BLOCK_K)).to(tl.int64)
    if PACKED:
        src, stride_m = _band_source(
            x_ptr, x1_ptr, x2_ptr, band * BLOCK_K, stride_xm, stride_x1m, stride_x2m, W0, W1, W2
        )
        src_cols = tl.arange(0, BLOCK_K).to(tl.int64)
    else:
        src, stride_m, src_cols = x_ptr, stride_xm, cols * stride_xk
    col_sum = tl.zeros([BLOCK_K], dtype=tl.float32)
    tile_sum = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    running_amax = tl.zeros([BLOCK_M], dtype=tl.float32)
    for tile_m in range(split, tl.cdiv(M, BLOCK_M), splits):
        rows = (tile_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        mask = (rows[:, None] < M) & (cols[None, :] < K)
        x = tl.load(src + rows[:, None] * stride_m + src_cols[None, :], mask=mask, other=0.0)
        x = x.to(tl.float32)
        if HAS_DBIAS:
            if SUM_2D:  # element-wise adds, one cross-warp reduction at the end
                tile_sum += x
            else:
                col_sum += tl.sum(x, axis=0)
        if RECORD_AMAX:
            running_amax = _abs_max_rows(running_amax, x, mask, False)
        _quantize_store_tile(
            x, scale, q_ptr, qt_ptr, rows, cols, mask, M, K,
            FP8_MAX, FP8, MANTISSA_BITS, MIN_NORMAL_EXP, ENCODE_IN_INT, ROWWISE, COLUMNWISE,
        )  # fmt: skip
    if HAS_DBIAS:
        if SUM_2D:
            col_sum = tl.sum(tile_sum, axis=0)
        tl.store(part_ptr + split.to(tl.int64) * K + cols, col_sum, mask=cols < K)
    if RECORD_AMAX:
        _record_amax(amax_record_ptr, running_amax)


def encode_in_int(dtype: torch.dtype) -> bool:
    """Whether the kernels build the FP8 bytes of tiles loaded as ``dtype`` with integer operations
    (``ENCODE_IN_INT``; module docstring): fp32 tiles, and every tile under the interpreter."""
    return INTERPRET or dtype == torch.float32


def amax(x: torch.Tensor) -> torch.Tensor:
    """``max |x|`` over all elements of a contiguous ``x``, as a 0-dim fp32 tensor (inf with a NaN)."""
    out = torch.zeros((), dtype=torch.float32, device=x.device)
    numel = x.numel()
    if numel:
        programs = min(triton.cdiv(numel, AMAX_BLOCK), PROGRAMS_PER_SM * sm_count(x.device))
        _amax_kernel[(programs,)](x, out, numel, BLOCK=AMAX_BLOCK, num_warps=8)
    return out


def _cast_outputs(x: torch.Tensor, m: int, k: int, fp8_dtype: torch.dtype, rowwise: bool, columnwise: bool):
    """The cast kernels' outputs: ``(q [m, k] or None, qT [k, m] or None, scale_inv)``."""
    q = torch.empty((m, k), dtype=fp8_dtype, device=x.device) if rowwise else None
    qt = torch.empty((k, m), dtype=fp8_dtype, device=x.device) if columnwise else None
    return q, qt, torch.empty((), dtype=torch.float32, device=x.device)


def _cast_constexprs(x_dtype, fp8_dtype, margin, amax, amax_record, rowwise, columnwise) -> dict:
    """The FP8 format and mode constexprs the cast kernels take (``x_dtype``: the tiles' dtype)."""
    fp8_max = float(torch.finfo(fp8_dtype).max)
    return dict(
        FP8_LIMIT=fp8_max / 2.0**margin,
        FP8_MAX=fp8_max,
        FP8=_TL_FP8[fp8_dtype],
        MANTISSA_BITS=_MANTISSA_BITS[fp8_dtype],
        MIN_NORMAL_EXP=_MIN_NORMAL_EXP[fp8_dtype],
        ENCODE_IN_INT=encode_in_int(x_dtype),
        FROM_AMAX=amax is not None,
        RECORD_AMAX=amax_record is not None,
        ROWWISE=rowwise,
        COLUMNWISE=columnwise,
    )


def cast(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    *,
    scale: torch.Tensor | None = None,
    amax: torch.Tensor | None = None,
    margin: int = 0,
    rowwise: bool = True,
    columnwise: bool = False,
    amax_record: torch.Tensor | None = None,
    config: dict | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """The op ``fp8_cast`` on a 2-D ``x [M, K]`` (any strides): see :func:`mcore.ops.reference.fp8_cast`."""
    m, k = x.shape
    q, qt, scale_inv = _cast_outputs(x, m, k, fp8_dtype, rowwise, columnwise)
    given = amax if amax is not None else scale
    cfg = {"BLOCK_M": 128, "BLOCK_K": 128, "num_warps": 8, **(config or {})}
    tiles = triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(k, cfg["BLOCK_K"])
    # one tile a program (more programs in flight) unless the amax is recorded (one atomic a program)
    grid = (min(tiles, PROGRAMS_PER_SM * sm_count(x.device)) if amax_record is not None else tiles,)
    _cast_kernel[grid](
        x,
        q.view(torch.uint8) if q is not None else scale_inv,  # unused pointers still need a tensor
        qt.view(torch.uint8) if qt is not None else scale_inv,
        given,
        scale_inv,
        amax_record if amax_record is not None else scale_inv,
        m,
        k,
        x.stride(0),
        x.stride(1),
        **_cast_constexprs(x.dtype, fp8_dtype, margin, amax, amax_record, rowwise, columnwise),
        **cfg,
    )
    return q, qt, scale_inv


_DBIAS_DEFAULT = {"BLOCK_M": 64, "BLOCK_K": 128, "num_warps": 4, "SUM_2D": True, "PER_SM": PROGRAMS_PER_SM}
_DBIAS_CONFIGS = [
    _DBIAS_DEFAULT,
    {"BLOCK_M": 64, "BLOCK_K": 128, "num_warps": 8, "SUM_2D": True, "PER_SM": PROGRAMS_PER_SM},
    {"BLOCK_M": 32, "BLOCK_K": 128, "num_warps": 4, "SUM_2D": True, "PER_SM": PROGRAMS_PER_SM},
    {"BLOCK_M": 128, "BLOCK_K": 128, "num_warps": 8, "SUM_2D": False, "PER_SM": PROGRAMS_PER_SM},
    {"BLOCK_M": 128, "BLOCK_K": 64, "num_warps": 4, "SUM_2D": True, "PER_SM": 8},
    {"BLOCK_M": 64, "BLOCK_K": 128, "num_warps": 4, "SUM_2D": True, "PER_SM": 4},
]
"""Block shapes of :func:`cast_dbias`, tuned at the first call with many rows (``use_autotune``)."""


def _dbias_launch(
    m: int, k: int, device: torch.device, config: dict | None, widths: tuple[int, ...] = ()
) -> GridLaunch:
    """The launch of :func:`_cast_dbias_kernel` for ``x [m, k]`` (``widths``: the packed parts' widths,
    :func:`cast_packed`; a config's ``BLOCK_K`` must divide each)."""

    def splits(cfg) -> int:
        cap = max(1, cfg["PER_SM"] * sm_count(device) // triton.cdiv(k, cfg["BLOCK_K"]))
        return balanced_programs(triton.cdiv(m, cfg["BLOCK_M"]), cap)

    def build() -> GridLaunch:
        # (an explicit ``config`` is the caller's to fit; without one, :func:`packed_block_fits` held)
        configs = [c for c in _DBIAS_CONFIGS if all(w % c["BLOCK_K"] == 0 for w in widths)] or [
            _DBIAS_DEFAULT
        ]
        default = _DBIAS_DEFAULT if _DBIAS_DEFAULT in configs else configs[0]
        return GridLaunch(
            _cast_dbias_kernel, "fp8_cast_dbias", m, configs, default,
            key=["M", "K", "W0", "W1", "W2", "PACKED", "HAS_DBIAS", "ROWWISE", "COLUMNWISE", "RECORD_AMAX"],
            grid=lambda cfg: (triton.cdiv(k, cfg["BLOCK_K"]), splits(cfg)), parts=splits, config=config,
        )  # fmt: skip

    # explicit block shapes (tests, the benchmark's sweep) are cached too: building a launch costs
    # host time that a timed loop would otherwise measure
    how = use_autotune(m) if config is None else tuple(sorted(config.items()))
    return cached_launch(("fp8_cast_dbias", m, k, widths, device, how), build)


@functools.cache
def packed_block_fits(widths: tuple[int, ...]) -> bool:
    """Whether :func:`cast_packed` has a block shape for parts of these widths (one dividing each)."""
    return any(all(w % c["BLOCK_K"] == 0 for w in widths) for c in _DBIAS_CONFIGS)


def _cast_dbias_launch(
    sources: list[torch.Tensor],
    widths: tuple[int, ...],
    m: int,
    k: int,
    fp8_dtype: torch.dtype,
    dbias: bool,
    scale: torch.Tensor | None,
    amax: torch.Tensor | None,
    margin: int,
    rowwise: bool,
    columnwise: bool,
    amax_record: torch.Tensor | None,
    config: dict | None,
):
    """Run :func:`_cast_dbias_kernel` on ``x [m, k]`` (one source, any strides) or on the packing of
    three sources (``widths``): ``(q, qT, scale_inv, dbias or None)``."""
    x = sources[0]
    q, qt, scale_inv = _cast_outputs(x, m, k, fp8_dtype, rowwise, columnwise)
    given = amax if amax is not None else scale
    launch = _dbias_launch(m, k, x.device, config, widths)
    part = torch.empty((1, launch.max_parts, k), dtype=torch.float32, device=x.device) if dbias else scale_inv
    packed = len(sources) == 3
    x1, x2 = (sources[1], sources[2]) if packed else (x, x)
    w0, w1, w2 = widths if packed else (k, 0, 0)
    parts = launch(
        x,
        x1,
        x2,
        q.view(torch.uint8) if q is not None else scale_inv,  # unused pointers still need a tensor
        qt.view(torch.uint8) if qt is not None else scale_inv,
        part,
        given,
        scale_inv,
        amax_record if amax_record is not None else scale_inv,
        m,
        k,
        x.stride(0),
        x.stride(1),
        x1.stride(0),
        x2.stride(0),
        w0,
        w1,
        w2,
        PACKED=packed,
        HAS_DBIAS=dbias,
        **_cast_constexprs(x.dtype, fp8_dtype, margin, amax, amax_record, rowwise, columnwise),
    )
    dbias_out = sum_partials(part, parts, [x.dtype])[0] if dbias else None
    return q, qt, scale_inv, dbias_out


def cast_dbias(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    *,
    scale: torch.Tensor | None = None,
    amax: torch.Tensor | None = None,
    margin: int = 0,
    rowwise: bool = True,
    columnwise: bool = False,
    amax_record: torch.Tensor | None = None,
    config: dict | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """The op ``fp8_cast_dbias`` on a 2-D ``x [M, K]`` (any strides): :func:`cast`'s ``(q, qT,
    scale_inv)``, the same bytes (one shared tile quantization), and ``x.sum(0)`` in ``x.dtype``.

    The column sums are fp32: each program of a ``[K / BLOCK_K, R]`` grid sums its row tiles of one
    column band into one row of ``part [R, K]``, then :func:`~._common.sum_partials` adds the ``R``
    rows in a fixed order and rounds to ``x.dtype`` (deterministic, no float atomics). ``R`` gives
    about ``PER_SM`` programs per SM with the same number of row tiles each; the block shape is tuned
    per shape at the first call with many rows (:data:`_DBIAS_CONFIGS`)."""
    m, k = x.shape
    return _cast_dbias_launch(
        [x], (), m, k, fp8_dtype, True, scale, amax, margin, rowwise, columnwise, amax_record, config
    )


def cast_packed(
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
    config: dict | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """The op ``fp8_cast_packed`` on three 2-D parts ``[M, groups * w_i]`` (unit column stride, one
    dtype): :func:`cast_dbias` of their packing (:func:`mcore.ops.reference.pack_columns`), each column
    band read from the part it lies in, so the packed ``x`` is never written. The bytes and the column
    sums are those of :func:`cast_dbias` on the packed ``x`` with the same block shape; the caller
    checks :func:`packed_block_fits`."""
    m = parts[0].shape[0]
    widths = tuple(p.shape[1] // groups for p in parts)
    k = groups * sum(widths)
    return _cast_dbias_launch(
        parts, widths, m, k, fp8_dtype, dbias, scale, amax, margin, rowwise, columnwise, amax_record, config
    )
