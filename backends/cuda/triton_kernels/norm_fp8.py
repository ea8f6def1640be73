"""LayerNorm/RMSNorm writing the FP8 operand of the next GEMM (the delayed recipe), and its backward.

:func:`norm_fp8_fwd` is the op ``norm_fp8_forward`` on a 2-D ``x [M, K]``: with the scale known
before the norm runs, the norm's kernel itself writes ``q = saturate(y * scale) [M, K]`` and/or its
transpose ``q^T [K, M]`` (the other GEMMs' NT operand) and records ``max |y|`` into the delayed
recipe's amax slot, so the bf16 ``y`` is never written nor read back (the unfused path writes
``y`` and :func:`.fp8_cast.cast` reads it: 2 x 32 MB more traffic at 8192 x 2048 bf16).

A program owns ``BLOCK_M`` rows (32: each transposed store writes 32 contiguous bytes, a whole
sector, of a ``q^T`` row; 64 rows measured slower, see :func:`_fwd_config`; the statistics' tile
fixes the warps, so more programs, not more warps, keep more loads in flight). A block of whole rows
does not fit registers at K = 2048-8192, so it works in two phases:

1. statistics: the rows are reduced ``STAT_M`` at a time in exactly the tile shape, warp count and
   arithmetic of the norm forward kernels (:mod:`.norms`), so ``mean``/``rstd`` are the bits those
   kernels save (a reduction's summation order follows the tile's register layout: another tile
   shape would round differently). ``STAT_GROUP`` tiles are loaded before any is reduced (their
   loads in flight together), the results collected in registers and written once;
2. chunks of ``BLOCK_K`` columns (the next one's load issued before this one's stores,
   ``PREFETCH``): ``x`` is read again (from L2), normalised as the norm kernel
   does, rounded to the norm's output dtype (``x.dtype`` for LayerNorm, ``promote(x, weight)``
   for RMSNorm: the bytes the unfused norm writes), then scaled, saturated and converted exactly
   as :func:`.fp8_cast._cast_kernel` does; each program keeps a per-row running ``max |y|`` and
   ends with one ``atomic_max`` into ``amax_record``.

So the q/q^T bytes, ``scale_inv``, the recorded amax and the statistics equal the unfused
composition ``fp8_cast(layer_norm(x), scale=..., amax_record=...)`` of this backend's kernels.

:func:`norm_bwd` is the op ``norm_backward``: the norm kernels' backward (:func:`.norms.layer_norm_bwd`,
:func:`.norms.rms_norm_bwd`) from the saved statistics, with the residual stream's gradient added
to ``dx`` in the same pass.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import norms
from ._common import INTERPRET, next_pow2
from .fp8_cast import _MANTISSA_BITS, _MIN_NORMAL_EXP, _TL_FP8, _round_to_fp8_grid

_TL_FLOAT = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

KINDS = ("LayerNorm", "RMSNorm")


@triton.jit
def _stat_tile(X, row, M, stride_x, cols_n, cmask_n, STAT_M: tl.constexpr):
    """Rows ``row .. row + STAT_M`` of ``x`` (whole rows, fp32) and their mask."""
    rows = row + tl.arange(0, STAT_M)
    mask = (rows < M)[:, None] & cmask_n[None, :]
    ptrs = X + rows.to(tl.int64)[:, None] * stride_x + cols_n[None, :]
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32), mask


@triton.jit
def _fold_stats(x, mask, N, eps, steps, step, mean_acc, rstd_acc, IS_RMS: tl.constexpr):
    """The statistics of one tile, exactly as the norm forward kernels compute them, placed in row
    ``step`` of the ``[BLOCK_M // STAT_M, STAT_M]`` accumulators."""
    if IS_RMS:
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)
    else:
        mean = tl.sum(x, axis=1) / N
        xc = tl.where(mask, x - mean[:, None], 0.0)
        rstd = tl.rsqrt(tl.sum(xc * xc, axis=1) / N + eps)
        mean_acc = tl.where(steps[:, None] == step, mean[None, :], mean_acc)
    rstd_acc = tl.where(steps[:, None] == step, rstd[None, :], rstd_acc)
    return mean_acc, rstd_acc


@triton.jit
def _norm_fp8_fwd_kernel(
    X,
    W,
    B,
    MEAN,
    RSTD,
    Q,
    QT,
    SCALE,
    SCALE_INV,
    AMAX_RECORD,
    M,
    N,
    stride_x,
    eps,
    IS_RMS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    OUT_DTYPE: tl.constexpr,  # the unfused norm's output dtype: y is rounded to it before the scale
    FP8_MAX: tl.constexpr,
    FP8: tl.constexpr,
    MANTISSA_BITS: tl.constexpr,
    MIN_NORMAL_EXP: tl.constexpr,
    ROUND_IN_FP32: tl.constexpr,
    RECORD_AMAX: tl.constexpr,
    ROWWISE: tl.constexpr,
    COLUMNWISE: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows a program owns (a multiple of STAT_M)
    BLOCK_K: tl.constexpr,  # columns of one normalise/cast/store chunk
    STAT_M: tl.constexpr,  # rows of one statistics tile: the norm forward kernel's BLOCK_M
    BLOCK_N: tl.constexpr,  # the whole (padded) row: the norm forward kernel's BLOCK_N
    STAT_UNROLL: tl.constexpr,  # statistics loop iterations unrolled
    STAT_GROUP: tl.constexpr,  # statistics tiles loaded together before they are reduced (1, 2, 4)
    PREFETCH: tl.constexpr,  # load the next column chunk before storing this one
):
    pid = tl.program_id(0)
    row0 = pid * BLOCK_M
    scale = tl.load(SCALE)
    if pid == 0:
        tl.store(SCALE_INV, tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale))

    # -- 1. statistics, STAT_M rows at a time, as _ln_fwd_kernel / _rms_fwd_kernel compute them.
    # STAT_GROUP tiles are loaded before any is reduced: a reduction ends in a barrier, which the
    # next tile's load would otherwise wait behind (one DRAM latency a row, with 1-2 programs an SM)
    cols_n = tl.arange(0, BLOCK_N)
    cmask_n = cols_n < N
    steps = tl.arange(0, BLOCK_M // STAT_M)
    mean_acc = tl.zeros([BLOCK_M // STAT_M, STAT_M], dtype=tl.float32)
    rstd_acc = tl.zeros([BLOCK_M // STAT_M, STAT_M], dtype=tl.float32)
    for step in tl.range(0, BLOCK_M // STAT_M, STAT_GROUP, loop_unroll_factor=STAT_UNROLL):
        x0, m0 = _stat_tile(X, row0 + step * STAT_M, M, stride_x, cols_n, cmask_n, STAT_M)
        if STAT_GROUP >= 2:
            x1, m1 = _stat_tile(X, row0 + (step + 1) * STAT_M, M, stride_x, cols_n, cmask_n, STAT_M)
        if STAT_GROUP >= 4:
            x2, m2 = _stat_tile(X, row0 + (step + 2) * STAT_M, M, stride_x, cols_n, cmask_n, STAT_M)
            x3, m3 = _stat_tile(X, row0 + (step + 3) * STAT_M, M, stride_x, cols_n, cmask_n, STAT_M)
        mean_acc, rstd_acc = _fold_stats(x0, m0, N, eps, steps, step, mean_acc, rstd_acc, IS_RMS)
        if STAT_GROUP >= 2:
            mean_acc, rstd_acc = _fold_stats(x1, m1, N, eps, steps, step + 1, mean_acc, rstd_acc, IS_RMS)
        if STAT_GROUP >= 4:
            mean_acc, rstd_acc = _fold_stats(x2, m2, N, eps, steps, step + 2, mean_acc, rstd_acc, IS_RMS)
            mean_acc, rstd_acc = _fold_stats(x3, m3, N, eps, steps, step + 3, mean_acc, rstd_acc, IS_RMS)
    rows = row0 + tl.arange(0, BLOCK_M)
    rmask = rows < M
    rstd = tl.reshape(rstd_acc, [BLOCK_M])
    tl.store(RSTD + rows, rstd, mask=rmask)
    if not IS_RMS:
        mean = tl.reshape(mean_acc, [BLOCK_M])
        tl.store(MEAN + rows, mean, mask=rmask)

    # -- 2. normalise, round, scale, cast and store, BLOCK_K columns at a time (x re-read from L2)
    rows64 = rows.to(tl.int64)
    running_amax = tl.zeros([BLOCK_M], dtype=tl.float32)
    x_ptrs = X + rows64[:, None] * stride_x
    if PREFETCH:  # the next chunk's load is issued before this chunk's stores (which it cannot pass)
        cols = tl.arange(0, BLOCK_K)
        x_next = tl.load(x_ptrs + cols[None, :], mask=rmask[:, None] & (cols < N)[None, :], other=0.0)
    for k0 in range(0, N, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        cmask = cols < N
        mask = rmask[:, None] & cmask[None, :]
        if PREFETCH:
            x = x_next.to(tl.float32)
            cols_nx = cols + BLOCK_K
            mask_nx = rmask[:, None] & (cols_nx < N)[None, :]
            x_next = tl.load(x_ptrs + cols_nx[None, :], mask=mask_nx, other=0.0)
        else:
            x = tl.load(x_ptrs + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
        if IS_RMS:
            n = (x * rstd[:, None]).to(X.dtype.element_ty).to(tl.float32)
            y = n * w[None, :]
        else:
            xc = tl.where(mask, x - mean[:, None], 0.0)
            y = xc * rstd[:, None] * w[None, :]
            if HAS_BIAS:
                b = tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)
                y += b[None, :]
        y = y.to(OUT_DTYPE).to(tl.float32)  # the bytes the unfused norm writes
        if RECORD_AMAX:  # padding rows/columns hold the bias: kept out of the amax
            y_abs = tl.where(y == y, tl.abs(y), float("inf"))
            running_amax = tl.maximum(running_amax, tl.max(tl.where(mask, y_abs, 0.0), axis=1))
        # from here _cast_kernel's arithmetic, bit for bit
        y = y * scale
        y = tl.where(y > FP8_MAX, FP8_MAX, tl.where(y < -FP8_MAX, -FP8_MAX, y))
        if ROUND_IN_FP32:
            y = _round_to_fp8_grid(y, MANTISSA_BITS, MIN_NORMAL_EXP)
        # Stored as their bytes (Q, QT are uint8 views): with both stores in one kernel, ptxas 12.9
        # (Triton's on Hopper) corrupts an FP8 tile's transposed store, not an 8-bit integer one
        # (triton-lang/triton#11111; seen here at M = 37, K = 64 on an H100)
        q = y.to(FP8, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
        cols64 = cols.to(tl.int64)
        if ROWWISE:
            tl.store(Q + rows64[:, None] * N + cols64[None, :], q, mask=mask)
        if COLUMNWISE:
            mask_t = cmask[:, None] & rmask[None, :]
            tl.store(QT + cols64[:, None] * M + rows64[None, :], tl.trans(q), mask=mask_t)
    if RECORD_AMAX:
        tl.atomic_max(AMAX_RECORD, tl.max(running_amax, axis=0))


def _fwd_config(n: int, config: dict | None) -> dict:
    """The launch: the statistics tile and warps are the norm forward kernel's (bit-equal statistics);
    ``BLOCK_M``, ``BLOCK_K``, ``STAT_GROUP``, ``STAT_UNROLL``, ``PREFETCH`` may be overridden (tests,
    the benchmark's sweep)."""
    stat = norms._fwd_config(n, None)
    block_n, stat_m, warps = stat["BLOCK_N"], stat["BLOCK_M"], stat["num_warps"]
    # 32 rows a program (32-byte transposed stores): on an H100 (LayerNorm, 8192 rows bf16, before
    # STAT_GROUP/PREFETCH) 72.5 us against 118.9 with 64 rows (one 4-warp program an SM) and 218 with
    # 128 at K = 2048; at K = 4096 153.6 / 151.1 / 272 us (benchmarks/README.md, FP8).
    cfg = {"BLOCK_M": max(32, stat_m), "STAT_UNROLL": 1, "PREFETCH": True, **(config or {})}
    if cfg["BLOCK_M"] % stat_m:
        raise ValueError(f"BLOCK_M {cfg['BLOCK_M']} is not a multiple of the statistics tile's {stat_m} rows")
    # 4 statistics tiles in flight (2 when a tile is more than 16 elements a thread, for registers)
    steps = cfg["BLOCK_M"] // stat_m
    per_thread = stat_m * block_n // (32 * warps)
    cfg.setdefault("STAT_GROUP", min(steps, 4 if per_thread <= 16 else 2))
    if cfg["STAT_GROUP"] not in (1, 2, 4) or steps % cfg["STAT_GROUP"]:
        raise ValueError(
            f"STAT_GROUP {cfg['STAT_GROUP']} is not 1, 2 or 4 dividing the {steps} statistics steps"
        )
    # 32 elements a thread in a chunk: ptxas (sm_90a) gives 150 registers a thread at K = 2048 and
    # 4096, against 208-236 with 64 (which the H100 run above used): 2 programs an SM, not 1, at 4096
    cfg.setdefault("BLOCK_K", min(block_n, max(16, next_pow2(32 * 32 * warps // cfg["BLOCK_M"]))))
    return {**cfg, "STAT_M": stat_m, "BLOCK_N": block_n, "num_warps": warps}


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
    config: dict | None = None,
):
    """The op ``norm_fp8_forward`` on ``x2 [M, K]`` (unit stride on K): ``(q, qT, scale_inv, mean, rstd)``."""
    m, n = x2.shape
    is_rms = kind == "RMSNorm"
    out_dtype = torch.promote_types(x2.dtype, weight.dtype) if is_rms else x2.dtype
    dev = x2.device
    q = torch.empty((m, n), dtype=fp8_dtype, device=dev) if rowwise else None
    qt = torch.empty((n, m), dtype=fp8_dtype, device=dev) if columnwise else None
    scale_inv = torch.empty((), dtype=torch.float32, device=dev)
    mean = None if is_rms else torch.empty((m,), dtype=torch.float32, device=dev)
    rstd = torch.empty((m,), dtype=torch.float32, device=dev)
    cfg = _fwd_config(n, config)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]),)
    _norm_fp8_fwd_kernel[grid](
        x2, weight, weight if bias is None else bias, rstd if mean is None else mean, rstd,
        scale_inv if q is None else q.view(torch.uint8), scale_inv if qt is None else qt.view(torch.uint8),
        scale, scale_inv, scale_inv if amax_record is None else amax_record,
        m, n, x2.stride(0), eps,
        IS_RMS=is_rms, HAS_BIAS=bias is not None, OUT_DTYPE=_TL_FLOAT[out_dtype],
        FP8_MAX=float(torch.finfo(fp8_dtype).max), FP8=_TL_FP8[fp8_dtype],
        MANTISSA_BITS=_MANTISSA_BITS[fp8_dtype], MIN_NORMAL_EXP=_MIN_NORMAL_EXP[fp8_dtype],
        ROUND_IN_FP32=INTERPRET, RECORD_AMAX=amax_record is not None, ROWWISE=rowwise, COLUMNWISE=columnwise,
        **cfg,
    )  # fmt: skip
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
