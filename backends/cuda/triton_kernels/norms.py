"""Fused RMSNorm and LayerNorm (forward and backward) in Triton.

Layout: ``x [..., N]`` is viewed as ``[M, N]`` rows (unit stride on the last dim, any row stride).
A forward program normalises ``BLOCK_M`` whole rows (statistics in fp32) and saves ``rstd`` (and the
mean for LayerNorm) per row, so the backward never recomputes a reduction over ``x`` twice.

The backward is one pass over ``x`` and ``dy``: a persistent grid of 2-4 programs an SM (as many as
stay resident, balanced so that every program takes the same number of ``BLOCK_M``-row blocks),
program ``p`` taking blocks ``p, p + programs, ...`` (``STRIDED``; contiguous shares are the other
choice, measured 3% slower). A program loads the next row block before it reduces the current one
(``PREFETCH``: the loads stay in flight during the row reductions; x and dy are read once, so they
are loaded evict-first), writes ``dx`` and keeps ``dweight``/``dbias`` in fp32 registers, written
once as its row of a ``[programs, N]`` buffer; one small kernel (:func:`._common.sum_partials`)
sums those rows and casts them to the parameters' dtypes. Per call that moves ``x``, ``dy``, ``dx``
and the statistics, plus ``2 * programs * N * 4`` bytes (twice that for LayerNorm's two gradients)
of partial sums: 8192 x 2048 bf16 moves 100.7 MB plus 4.2 (RMSNorm) or 8.4 MB (LayerNorm).

Rounding follows :mod:`mcore.ops.reference`: RMSNorm rounds the normalised value to ``x.dtype``
before multiplying by the weight (output dtype ``promote(x, weight)``); LayerNorm rounds once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (
    GridLaunch,
    balanced_programs,
    cached_launch,
    next_pow2,
    row_range,
    rows_2d,
    sm_count,
    sum_partials,
    use_autotune,
)

MAX_N = 16384
"""The widest row a program keeps in registers; wider rows use the reference op."""


@triton.jit
def rms_normalize(x, rstd, w, X_DTYPE: tl.constexpr):
    """RMSNorm's output in fp32 from fp32 rows ``x [R, C]``, their ``rstd [R]`` and the weight ``w [C]``
    (fp32): the normalised value rounded to ``X_DTYPE`` (the rows' dtype), times the weight. The one
    expression of the forward kernel and of :mod:`.norm_fp8`'s cast, so their outputs agree bit for bit."""
    n = (x * rstd[:, None]).to(X_DTYPE).to(tl.float32)
    return n * w[None, :]


@triton.jit
def ln_normalize(xc, rstd, w, b, HAS_BIAS: tl.constexpr):
    """LayerNorm's output in fp32 from centred fp32 rows ``xc = x - mean`` ``[R, C]``, ``rstd [R]``, the
    weight ``w`` and bias ``b`` ``[C]`` (fp32): ``xc * rstd * w (+ b)``, shared as :func:`rms_normalize`."""
    y = xc * rstd[:, None] * w[None, :]
    if HAS_BIAS:
        y += b[None, :]
    return y


@triton.jit
def _rms_fwd_kernel(
    X,
    W,
    Y,
    RSTD,
    M,
    N,
    stride_x,
    stride_y,
    eps,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    STORE_Y: tl.constexpr = True,  # else the statistics only (:func:`rms_norm_stats`)
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    rmask = rows < M
    cmask = cols < N
    mask = rmask[:, None] & cmask[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)
    if STORE_Y:
        w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
        y = rms_normalize(x, rstd, w, X.dtype.element_ty)
        tl.store(Y + rows64[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=rmask)


@triton.jit
def _load_rows(A, B, rows, hi, cols, cmask, stride_a, stride_b, EVICT: tl.constexpr):
    """Rows ``rows`` (those below ``hi``) of ``A`` and ``B`` in their own dtype, and the tile mask.

    ``EVICT``: read once, so marked first to leave L2 (other data, dirty lines especially, stay).
    """
    mask = (rows < hi)[:, None] & cmask[None, :]
    rows64 = rows.to(tl.int64)
    pa = A + rows64[:, None] * stride_a + cols[None, :]
    pb = B + rows64[:, None] * stride_b + cols[None, :]
    if EVICT:
        a = tl.load(pa, mask=mask, other=0.0, eviction_policy="evict_first")
        b = tl.load(pb, mask=mask, other=0.0, eviction_policy="evict_first")
    else:
        a = tl.load(pa, mask=mask, other=0.0)
        b = tl.load(pb, mask=mask, other=0.0)
    return a, b, mask


@triton.jit
def _load_residual_grad(DRES, rows, stride, cols, mask):
    """The residual stream's gradient for these rows, in its own dtype (read once: evict-first)."""
    ptr = DRES + rows.to(tl.int64)[:, None] * stride + cols[None, :]
    return tl.load(ptr, mask=mask, other=0.0, eviction_policy="evict_first")


@triton.jit
def _rms_bwd_kernel(
    DY,
    X,
    W,
    RSTD,
    DX,
    DRES,
    DW,
    M,
    N,
    stride_dy,
    stride_x,
    stride_dx,
    stride_dres,
    HAS_DRES: tl.constexpr,  # add the residual stream's gradient DRES to dx
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PER_SM: tl.constexpr,  # programs per SM: sets the grid only
    PREFETCH: tl.constexpr,  # load the next row block before reducing this one
    EVICT: tl.constexpr,  # x and dy loads marked evict-first
    STRIDED: tl.constexpr,  # rows interleaved between programs (else a contiguous share each)
    DRES_EARLY: tl.constexpr = False,  # issue the DRES load before the row reductions, not after
):
    # A persistent program walks its row blocks; dw stays in fp32 registers and is written once,
    # as this program's row of the [programs, N] partial sums.
    lo, hi, step = row_range(tl.program_id(0), tl.num_programs(0), M, BLOCK_M, STRIDED)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    rows = lo + tl.arange(0, BLOCK_M)
    if PREFETCH:
        x_in, dy_in, mask = _load_rows(X, DY, rows, hi, cols, cmask, stride_x, stride_dy, EVICT)
        rstd = tl.load(RSTD + rows, mask=rows < hi, other=0.0)
    for _ in range(lo, hi, step):
        if PREFETCH:
            nrows = rows + step
            x_nx, dy_nx, mask_nx = _load_rows(X, DY, nrows, hi, cols, cmask, stride_x, stride_dy, EVICT)
            rstd_nx = tl.load(RSTD + nrows, mask=nrows < hi, other=0.0)
        else:
            x_in, dy_in, mask = _load_rows(X, DY, rows, hi, cols, cmask, stride_x, stride_dy, EVICT)
            rstd = tl.load(RSTD + rows, mask=rows < hi, other=0.0)
        if HAS_DRES and DRES_EARLY:
            dres = _load_residual_grad(DRES, rows, stride_dres, cols, mask)
        x = x_in.to(tl.float32)
        dy = dy_in.to(tl.float32)
        n = x * rstd[:, None]
        dw += tl.sum(dy * n.to(X.dtype.element_ty).to(tl.float32), axis=0)
        g = dy * w[None, :]
        c = tl.sum(g * n, axis=1) / N
        dx = (g - n * c[:, None]) * rstd[:, None]
        if HAS_DRES:
            if not DRES_EARLY:
                dres = _load_residual_grad(DRES, rows, stride_dres, cols, mask)
            dx += dres.to(tl.float32)
        tl.store(
            DX + rows.to(tl.int64)[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask
        )
        if PREFETCH:
            x_in, dy_in, mask, rstd = x_nx, dy_nx, mask_nx, rstd_nx
        rows += step
    tl.store(DW + tl.program_id(0) * N + cols, dw, mask=cmask)


@triton.jit
def _ln_fwd_kernel(
    X,
    W,
    B,
    Y,
    MEAN,
    RSTD,
    M,
    N,
    stride_x,
    stride_y,
    eps,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    STORE_Y: tl.constexpr = True,  # else the statistics only (:func:`layer_norm_stats`)
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    rmask = rows < M
    cmask = cols < N
    mask = rmask[:, None] & cmask[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1) / N
    xc = tl.where(mask, x - mean[:, None], 0.0)
    rstd = tl.rsqrt(tl.sum(xc * xc, axis=1) / N + eps)
    if STORE_Y:
        w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
        b = w
        if HAS_BIAS:
            b = tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)
        y = ln_normalize(xc, rstd, w, b, HAS_BIAS)
        tl.store(Y + rows64[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(MEAN + rows, mean, mask=rmask)
    tl.store(RSTD + rows, rstd, mask=rmask)


@triton.jit
def _ln_bwd_kernel(
    DY,
    X,
    W,
    MEAN,
    RSTD,
    DX,
    DRES,
    DW,
    DB,
    M,
    N,
    stride_dy,
    stride_x,
    stride_dx,
    stride_dres,
    HAS_BIAS: tl.constexpr,
    HAS_DRES: tl.constexpr,  # add the residual stream's gradient DRES to dx
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PER_SM: tl.constexpr,  # programs per SM: sets the grid only
    PREFETCH: tl.constexpr,  # load the next row block before reducing this one
    EVICT: tl.constexpr,  # x and dy loads marked evict-first
    STRIDED: tl.constexpr,  # rows interleaved between programs (else a contiguous share each)
    DRES_EARLY: tl.constexpr = False,  # issue the DRES load before the row reductions, not after
):
    lo, hi, step = row_range(tl.program_id(0), tl.num_programs(0), M, BLOCK_M, STRIDED)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_N], dtype=tl.float32)
    rows = lo + tl.arange(0, BLOCK_M)
    if PREFETCH:
        x_in, dy_in, mask = _load_rows(X, DY, rows, hi, cols, cmask, stride_x, stride_dy, EVICT)
        mean = tl.load(MEAN + rows, mask=rows < hi, other=0.0)
        rstd = tl.load(RSTD + rows, mask=rows < hi, other=0.0)
    for _ in range(lo, hi, step):
        if PREFETCH:
            nrows = rows + step
            x_nx, dy_nx, mask_nx = _load_rows(X, DY, nrows, hi, cols, cmask, stride_x, stride_dy, EVICT)
            mean_nx = tl.load(MEAN + nrows, mask=nrows < hi, other=0.0)
            rstd_nx = tl.load(RSTD + nrows, mask=nrows < hi, other=0.0)
        else:
            x_in, dy_in, mask = _load_rows(X, DY, rows, hi, cols, cmask, stride_x, stride_dy, EVICT)
            mean = tl.load(MEAN + rows, mask=rows < hi, other=0.0)
            rstd = tl.load(RSTD + rows, mask=rows < hi, other=0.0)
        if HAS_DRES and DRES_EARLY:
            dres = _load_residual_grad(DRES, rows, stride_dres, cols, mask)
        # Masked columns and rows load dy = 0 (and w = 0), so they add nothing to any sum below.
        dy = dy_in.to(tl.float32)
        xhat = (x_in.to(tl.float32) - mean[:, None]) * rstd[:, None]
        dw += tl.sum(dy * xhat, axis=0)
        if HAS_BIAS:
            db += tl.sum(dy, axis=0)
        g = dy * w[None, :]
        c1 = tl.sum(g * xhat, axis=1) / N
        c2 = tl.sum(g, axis=1) / N
        dx = (g - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
        if HAS_DRES:
            if not DRES_EARLY:
                dres = _load_residual_grad(DRES, rows, stride_dres, cols, mask)
            dx += dres.to(tl.float32)
        tl.store(
            DX + rows.to(tl.int64)[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask
        )
        if PREFETCH:
            x_in, dy_in, mask, mean, rstd = x_nx, dy_nx, mask_nx, mean_nx, rstd_nx
        rows += step
    tl.store(DW + tl.program_id(0) * N + cols, dw, mask=cmask)
    if HAS_BIAS:
        tl.store(DB + tl.program_id(0) * N + cols, db, mask=cmask)


def _fwd_config(n: int, config: dict | None) -> dict:
    # Measured on H100 (benchmarks/kernels --sweep): one 2048-wide row a program, 4 warps (16 elements
    # a thread) is the fastest forward; narrower rows take several rows a program.
    block_n = next_pow2(n)
    cfg = {"BLOCK_M": max(1, 2048 // block_n)}
    cfg.update(config or {})
    cfg.setdefault("num_warps", int(min(16, max(1, cfg["BLOCK_M"] * block_n // 512))))
    return {"BLOCK_N": block_n, **cfg}


def _bwd_configs(block_n: int, with_residual: bool = False) -> list[dict]:
    # Measured on H100 (8192 x 2048 bf16, benchmarks/kernels): prefetching always paid (-10%), and
    # interleaved rows beat contiguous shares (-3%); one program an SM, and row blocks of 2 on 16
    # warps, were much slower. The rest are within a few percent: the tuner picks among them. With
    # the residual's gradient, its load goes either before the row reductions (its latency hidden
    # under them, 2 more bytes an element held in registers) or after them.
    base = max(1, 2048 // block_n)
    out = []
    for bm in (base, 2 * base):
        for w in (2, 4, 8, 16):
            if 4 <= bm * block_n // (32 * w) <= 16 and not (bm > 1 and w == 16):
                out += [dict(_BWD_FIXED, BLOCK_M=bm, num_warps=w, PER_SM=per_sm) for per_sm in (2, 4)]
    if with_residual:
        out = [dict(cfg, DRES_EARLY=early) for cfg in out for early in (False, True)]
    return out


_BWD_FIXED = {"PREFETCH": True, "EVICT": True, "STRIDED": True}


def _bwd_default(block_n: int) -> dict:
    # The best at 8192 x 2048 (two 2048-wide rows a step on 8 warps, 2 programs an SM); wide rows
    # take one row a step (16 elements a thread).
    if block_n <= 2048:
        bm = 2 * max(1, 2048 // block_n)
        return dict(_BWD_FIXED, BLOCK_M=bm, num_warps=max(1, min(8, bm * block_n // 512)), PER_SM=2)
    return dict(_BWD_FIXED, BLOCK_M=1, num_warps=min(16, block_n // 512), PER_SM=2)


def _bwd_launch(kernel, tag: str, m: int, n: int, device: torch.device, config: dict | None):
    """The persistent backward's launch: up to ``SMs * PER_SM`` programs, tuned for big ``m``."""
    if config is None:  # the training path: built once per shape (the sweep passes explicit configs)
        key = (kernel, tag, m, n, device, use_autotune(m))
        return cached_launch(key, lambda: _build_bwd_launch(kernel, tag, m, n, device, None))
    return _build_bwd_launch(kernel, tag, m, n, device, config)


def _build_bwd_launch(kernel, tag: str, m: int, n: int, device: torch.device, config: dict | None):
    block_n = next_pow2(n)
    sms = sm_count(device)

    def programs(cfg) -> int:
        return balanced_programs(triton.cdiv(m, cfg["BLOCK_M"]), sms * cfg["PER_SM"])

    with_residual = tag.endswith("+res")
    default = _bwd_default(block_n)
    if with_residual:  # the tuner's choice for both norms on H100 (benchmarks/kernels/RESULTS.md)
        default = dict(default, DRES_EARLY=True)
    if config is not None and "programs_per_sm" in config:  # the sweep's older spelling
        config = {**config, "PER_SM": config.pop("programs_per_sm")}
    return GridLaunch(
        kernel, (tag, block_n), m, _bwd_configs(block_n, with_residual), default, key=["N"],
        grid=lambda cfg: (programs(cfg),), parts=programs, config=config,
    )  # fmt: skip


def rms_norm_fwd(x2: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype, config=None):
    m, n = x2.shape
    y = torch.empty((m, n), dtype=out_dtype, device=x2.device)
    rstd = torch.empty((m,), dtype=torch.float32, device=x2.device)
    cfg = _fwd_config(n, config)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]),)
    _rms_fwd_kernel[grid](x2, weight, y, rstd, m, n, x2.stride(0), y.stride(0), eps, **cfg)
    return y, rstd


def rms_norm_stats(x2: torch.Tensor, eps: float) -> torch.Tensor:
    """``rstd [M]`` of :func:`rms_norm_fwd` without writing ``y``: the same kernel and tile, so the same
    bits as long as Triton lays the row out as it does with the store (the reduction order follows the
    layout; checked on an H100 by ``tests/ops/test_norm_fp8_interpret.py``)."""
    m, n = x2.shape
    rstd = torch.empty((m,), dtype=torch.float32, device=x2.device)
    cfg = _fwd_config(n, None)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]),)
    _rms_fwd_kernel[grid](x2, x2, x2, rstd, m, n, x2.stride(0), 0, eps, STORE_Y=False, **cfg)
    return rstd


def rms_norm_bwd(
    dy2: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, config=None, dres2=None
):
    """``(dx, dweight)``: one persistent pass over ``x``/``dy``, then one small launch sums ``dweight``.

    ``dres2``: the gradient of the residual stream that forked off ``x`` (rows like ``x2``), added to
    ``dx`` in the same pass (one more read instead of a separate add kernel).
    """
    m, n = x2.shape
    dx = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    tag = "rms" if dres2 is None else "rms+res"
    launch = _bwd_launch(_rms_bwd_kernel, tag, m, n, x2.device, config)
    part = torch.empty((1, launch.max_parts, n), dtype=torch.float32, device=x2.device)
    dres_arg, dres_stride = (dx, 0) if dres2 is None else (dres2, dres2.stride(0))
    parts = launch(
        dy2, x2, weight, rstd, dx, dres_arg, part, m, n, dy2.stride(0), x2.stride(0), dx.stride(0), dres_stride,
        HAS_DRES=dres2 is not None, BLOCK_N=next_pow2(n),
    )  # fmt: skip
    (dw,) = sum_partials(part, parts, [weight.dtype])
    return dx, dw


def layer_norm_fwd(x2, weight, bias, eps: float, config=None):
    m, n = x2.shape
    y = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    mean = torch.empty((m,), dtype=torch.float32, device=x2.device)
    rstd = torch.empty((m,), dtype=torch.float32, device=x2.device)
    cfg = _fwd_config(n, config)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]),)
    _ln_fwd_kernel[grid](
        x2,
        weight,
        weight if bias is None else bias,
        y,
        mean,
        rstd,
        m,
        n,
        x2.stride(0),
        y.stride(0),
        eps,
        HAS_BIAS=bias is not None,
        **cfg,
    )
    return y, mean, rstd


def layer_norm_stats(x2: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean, rstd)`` ``[M]`` of :func:`layer_norm_fwd` without writing ``y``: the same bits, as
    :func:`rms_norm_stats`."""
    m, n = x2.shape
    mean = torch.empty((m,), dtype=torch.float32, device=x2.device)
    rstd = torch.empty((m,), dtype=torch.float32, device=x2.device)
    cfg = _fwd_config(n, None)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]),)
    _ln_fwd_kernel[grid](
        x2, x2, x2, x2, mean, rstd, m, n, x2.stride(0), 0, eps, HAS_BIAS=False, STORE_Y=False, **cfg
    )
    return mean, rstd


def layer_norm_bwd(dy2, x2, weight, has_bias: bool, mean, rstd, config=None, bias_dtype=None, dres2=None):
    """``(dx, dweight, dbias or None)``, the parameter gradients in ``weight.dtype`` and ``bias_dtype``
    (default fp32): one persistent pass over ``x``/``dy``, then one small launch sums both.
    ``dres2``: as in :func:`rms_norm_bwd`."""
    m, n = x2.shape
    dx = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    tag = "ln" if dres2 is None else "ln+res"
    launch = _bwd_launch(_ln_bwd_kernel, tag, m, n, x2.device, config)
    part = torch.empty((2 if has_bias else 1, launch.max_parts, n), dtype=torch.float32, device=x2.device)
    dres_arg, dres_stride = (dx, 0) if dres2 is None else (dres2, dres2.stride(0))
    parts = launch(
        dy2, x2, weight, mean, rstd, dx, dres_arg, part[0], part[-1], m, n, dy2.stride(0), x2.stride(0),
        dx.stride(0), dres_stride, HAS_BIAS=has_bias, HAS_DRES=dres2 is not None, BLOCK_N=next_pow2(n),
    )  # fmt: skip
    dtypes = [weight.dtype] + ([bias_dtype or torch.float32] if has_bias else [])
    grads = sum_partials(part, parts, dtypes)
    return dx, grads[0], (grads[1] if has_bias else None)


class RMSNormFunction(torch.autograd.Function):
    """``rms_norm(x)``; with ``with_residual``, ``(rms_norm(x), x)``: see :func:`rms_norm_with_residual`."""

    @staticmethod
    def forward(ctx, x, weight, eps, with_residual=False):
        x2 = rows_2d(x)
        out_dtype = torch.promote_types(x.dtype, weight.dtype)
        y, rstd = rms_norm_fwd(x2, weight, eps, out_dtype)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.x_shape = x.shape
        y = y.view(*x.shape[:-1], y.shape[-1])
        if not with_residual:
            return y
        ctx.set_materialize_grads(False)  # an unused output's gradient comes as None, not zeros
        return y, x.view_as(x)

    @staticmethod
    def backward(ctx, dy, dres=None):
        x2, weight, rstd = ctx.saved_tensors
        if dy is None:  # only the residual was used
            return dres, None, None, None
        dres2 = None if dres is None else rows_2d(dres)
        dx, dw = rms_norm_bwd(rows_2d(dy), x2, weight, rstd, dres2=dres2)
        dx = dx.view(ctx.x_shape) if ctx.needs_input_grad[0] else None
        return dx, (dw if ctx.needs_input_grad[1] else None), None, None


class LayerNormFunction(torch.autograd.Function):
    """``layer_norm(x)``; with ``with_residual``, ``(layer_norm(x), x)``: see :func:`rms_norm_with_residual`."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, with_residual=False):
        x2 = rows_2d(x)
        y, mean, rstd = layer_norm_fwd(x2, weight, bias, eps)
        ctx.save_for_backward(x2, weight, mean, rstd)
        ctx.has_bias = bias is not None
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.x_shape = x.shape
        y = y.view(x.shape)
        if not with_residual:
            return y
        ctx.set_materialize_grads(False)
        return y, x.view_as(x)

    @staticmethod
    def backward(ctx, dy, dres=None):
        x2, weight, mean, rstd = ctx.saved_tensors
        if dy is None:
            return dres, None, None, None, None
        dx, dw, db = layer_norm_bwd(
            rows_2d(dy),
            x2,
            weight,
            ctx.has_bias,
            mean,
            rstd,
            bias_dtype=ctx.bias_dtype,
            dres2=None if dres is None else rows_2d(dres),
        )
        dx = dx.view(ctx.x_shape) if ctx.needs_input_grad[0] else None
        dw = dw if ctx.needs_input_grad[1] else None
        db = db if (db is not None and ctx.needs_input_grad[2]) else None
        return dx, dw, db, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return RMSNormFunction.apply(x, weight, eps)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    return LayerNormFunction.apply(x, weight, bias, eps)


def rms_norm_with_residual(x: torch.Tensor, weight: torch.Tensor, eps: float):
    """``(rms_norm(x), x)``, the second a view of ``x`` for the residual connection of a pre-norm layer.

    Autograd would sum the two uses' gradients of ``x`` with one more kernel (read both, write the
    sum: 3 x 32 MB for an 8192 x 2048 bf16 ``x``); here the norm's backward adds the residual's
    gradient to ``dx`` as it writes it (one more read).
    """
    return RMSNormFunction.apply(x, weight, eps, True)


def layer_norm_with_residual(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float):
    """``(layer_norm(x), x)``: see :func:`rms_norm_with_residual`."""
    return LayerNormFunction.apply(x, weight, bias, eps, True)
