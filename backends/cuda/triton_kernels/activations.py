"""Fused element-wise ops in Triton: bias-GeLU (exact and tanh) and bias-dropout-add (SwiGLU and its
weighted form: :mod:`.swiglu`).

All views are ``[M, N]`` rows with unit stride on the last dim. Forward kernels tile ``[BLOCK_M,
BLOCK_N]``. Backward kernels that owe a bias gradient run a persistent grid over row blocks per
column block and keep fp32 partial sums (``[row_programs, N]``, finished by one ``sum(0)``), so
``dbias`` costs no extra pass over the gradient.

Rounding follows :mod:`mcore.ops.reference`: ``x + bias`` is rounded to the input dtype before the
activation (it is a separate torch op there).

Dropout draws its mask in the kernel (Philox, ``tl.randint4x``) from a seed drawn from torch's
current device generator, so the TP-aware RNG tracker's forks govern it. The forward also stores the
mask packed 8 elements a byte (1/16 of a bf16 activation) and the backward reads it: regenerating it
there cost more time in integer arithmetic than the backward's memory traffic. The bias gradient
(with or without dropout) is one persistent column-sum pass over ``dy``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (
    INTERPRET,
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
from ._common import (
    tile_config as _tile_config,
)

_COLUMN_BWD_CONFIGS = [
    {"BLOCK_N": bn, "BLOCK_M": bm, "num_warps": w, "PER_SM": per_sm}
    for bn, bm, w in ((2048, 1, 8), (2048, 1, 4), (1024, 1, 4), (1024, 2, 8))
    for per_sm in (4, 8, 16)
]


def _column_bwd_launch(kernel, tag: str, m: int, n: int, device: torch.device, config: dict | None):
    """Persistent backward over ``[row programs, column blocks]`` with fp32 column partial sums."""
    if config is None:  # the training path: built once per shape (the sweep passes explicit configs)
        key = (kernel, tag, m, n, device, use_autotune(m))
        return cached_launch(key, lambda: _build_column_bwd_launch(kernel, tag, m, n, device, None))
    return _build_column_bwd_launch(kernel, tag, m, n, device, config)


def _build_column_bwd_launch(kernel, tag: str, m: int, n: int, device: torch.device, config: dict | None):
    sms = sm_count(device)
    default = {**_tile_config(n, None), "PER_SM": 4}
    configs = [c for c in _COLUMN_BWD_CONFIGS if c["BLOCK_N"] <= next_pow2(n)] or [default]

    def grid(cfg):
        n_cb = triton.cdiv(n, cfg["BLOCK_N"])
        rows = max(1, min(triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(sms * cfg["PER_SM"], n_cb)))
        return rows, n_cb

    if config is not None and "programs_per_sm" in config:
        config = {**config, "PER_SM": config.pop("programs_per_sm")}
    return GridLaunch(
        kernel, tag, m, configs, default, key=["N"], grid=grid, parts=lambda cfg: grid(cfg)[0], config=config
    )


# --- bias-GeLU ------------------------------------------------------------------------------------

_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)
_TANH_Z1 = tl.constexpr(1.5957691216057308)  # 2 * sqrt(2 / pi)
_TANH_Z3 = tl.constexpr(0.07135481627159)  # 2 * sqrt(2 / pi) * 0.044715
_PHI_T_MAX = tl.constexpr(5.5)
"""Past ``|t| = 5.5`` the normal CDF rounds to 1 in fp32 (``1 - Phi(5.5) = 1.9e-8``); below ``-5.5``
GeLU is taken as ``-0.0`` (``|t * Phi(t)| < 1.1e-7``), as torch's ``0.5 * (1 + erf)`` gives from
``t < -5.54`` on."""

# logit(Phi(t)) = t * P(t^2) on |t| <= 5.5: a weighted least-squares fit (iteratively reweighted
# towards minimax) of the absolute error of Phi = sigmoid(logit); coefficients of P, lowest first.
_PHI_C0 = tl.constexpr(1.5957711935043335)
_PHI_C1 = tl.constexpr(0.07265939563512802)
_PHI_C2 = tl.constexpr(-5.640992822009139e-05)
_PHI_C3 = tl.constexpr(-0.00011499103129608557)
_PHI_C4 = tl.constexpr(8.917079867387656e-06)
_PHI_C5 = tl.constexpr(-3.7161279919928347e-07)
_PHI_C6 = tl.constexpr(9.028683578549135e-09)
_PHI_C7 = tl.constexpr(-1.185566922412562e-10)
_PHI_C8 = tl.constexpr(6.413240706722168e-13)


_LOG2E = tl.constexpr(1.4426950408889634)
_MUFU = tl.constexpr(not INTERPRET)
"""Use the multi-function unit's ``ex2``/``rcp`` directly (inline PTX; the interpreter has none)."""


@triton.jit
def _exp(x):
    """``exp(x)`` as ``ex2.approx.ftz(x * log2 e)``: what ``tl.exp`` computes (2^-22 relative error of
    ``ex2``, plus the rounding of ``x * log2 e``), without the denormal-result fix-up ``tl.exp``'s
    non-``ftz`` ``ex2`` costs (a compare and two multiplies): results below 2^-126 flush to 0."""
    if _MUFU:
        return tl.inline_asm_elementwise(
            "ex2.approx.ftz.f32 $0, $1;", "=f,f", [x * _LOG2E], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return tl.exp(x)


@triton.jit
def _reciprocal(x):
    """``1 / x`` as ``rcp.approx.ftz`` (max 1 ulp error; ``div.full`` adds range fix-ups, ``div_rn``
    a Newton step and a slow path)."""
    if _MUFU:
        return tl.inline_asm_elementwise(
            "rcp.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return 1.0 / x


@triton.jit
def _sigmoid(z):
    """``1 / (1 + exp(-z))`` (:func:`_exp`, :func:`_reciprocal`); saturates to exactly 0 or 1 for
    large ``|z|`` (``exp`` overflows to inf, whose reciprocal is 0, or underflows to 0)."""
    return _reciprocal(1.0 + _exp(-z))


@triton.jit
def _normal_cdf(t):
    """``Phi(t) = sigmoid(t * P(t^2))`` (normal CDF; exact GeLU is ``t * Phi(t)``), 0 below -5.5.

    Cheaper than ``0.5 * (1 + erf(t / sqrt(2)))`` with libdevice's ``erff`` (two polynomial branches,
    both evaluated per warp, plus an ``exp``): one polynomial, one ``exp``, one reciprocal. Max
    absolute error against float64 over a dense sweep: see ``benchmarks/kernels/gelu_accuracy.py``."""
    tc = tl.minimum(tl.maximum(t, -_PHI_T_MAX), _PHI_T_MAX)  # NaN -> a bound; t * Phi keeps the NaN
    u = tc * tc
    p = _PHI_C8
    p = p * u + _PHI_C7
    p = p * u + _PHI_C6
    p = p * u + _PHI_C5
    p = p * u + _PHI_C4
    p = p * u + _PHI_C3
    p = p * u + _PHI_C2
    p = p * u + _PHI_C1
    p = p * u + _PHI_C0
    return tl.where(t < -_PHI_T_MAX, 0.0, _sigmoid(tc * p))


@triton.jit
def _gelu_and_grad(t, TANH: tl.constexpr, NEED_GRAD: tl.constexpr):
    """GeLU ``y = t * Phi(t)`` and, with ``NEED_GRAD``, ``dy/dt`` (else ``y`` again), in fp32.

    Exact (erf): ``Phi`` the normal CDF (:func:`_normal_cdf`), ``dy/dt = Phi + t * phi(t)`` with the
    density ``phi = exp(-t^2 / 2) / sqrt(2 pi)``. Tanh (``--openai-gelu``): ``0.5 * (1 + tanh(u)) =
    sigmoid(2u)`` with ``2u = z(t) = t * (Z1 + Z3 t^2)`` (``Z1 = 2 sqrt(2/pi)``, ``Z3 = 0.044715 Z1``),
    so ``y = t * s``, ``s = sigmoid(z) = 1 / (1 + e)``, ``e = exp(-z)``, and ``dy/dt = s + t * s (1 - s)
    z'(t)`` with ``1 - s = e * s``: one ``exp`` and
    one reciprocal, where ``tanh`` as ``1 - 2 / (exp(2u) + 1)`` then ``0.5 * (1 + tanh)`` adds a
    rounding and a subtraction."""
    if TANH:
        t2 = t * t
        e = _exp(-t * (_TANH_Z1 + _TANH_Z3 * t2))
        s = _reciprocal(1.0 + e)  # sigmoid(z)
        y = t * s
        if NEED_GRAD:  # 1 - s = e * s, without the cancellation of 1 - s where s is near 1
            dy = s + y * (e * s) * (_TANH_Z1 + 3.0 * _TANH_Z3 * t2)
        else:
            dy = y
    else:
        cdf = _normal_cdf(t)
        y = t * cdf
        if NEED_GRAD:
            dy = cdf + t * _INV_SQRT_2PI * _exp(-0.5 * t * t)
        else:
            dy = y
    return y, dy


@triton.jit
def _bias_gelu_fwd_kernel(
    X,
    B,
    Y,
    M,
    N,
    stride_x,
    stride_y,
    HAS_BIAS: tl.constexpr,
    TANH: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    mask = (rows < M)[:, None] & cmask[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_BIAS:
        b = tl.load(B + cols, mask=cmask, other=0.0)
        x = (x.to(tl.float32) + b.to(tl.float32)[None, :]).to(X.dtype.element_ty)
    y, _ = _gelu_and_grad(x.to(tl.float32), TANH, False)
    tl.store(Y + rows64[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _bias_gelu_bwd_kernel(
    DY,
    X,
    B,
    DX,
    DB,
    M,
    N,
    stride_dy,
    stride_x,
    stride_dx,
    HAS_BIAS: tl.constexpr,
    TANH: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PER_SM: tl.constexpr,  # sets the grid only
):
    pid_r = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    if HAS_BIAS:
        b = tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)
    db = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(pid_r * BLOCK_M, M, tl.num_programs(0) * BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        mask = (rows < M)[:, None] & cmask[None, :]
        rows64 = rows.to(tl.int64)
        x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
        if HAS_BIAS:
            x = (x.to(tl.float32) + b[None, :]).to(X.dtype.element_ty)
        dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        _, d = _gelu_and_grad(x.to(tl.float32), TANH, True)
        dx = dy * d
        tl.store(DX + rows64[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        if HAS_BIAS:
            db += tl.sum(tl.where(mask, dx, 0.0), axis=0)
    if HAS_BIAS:
        tl.store(DB + pid_r * N + cols, db, mask=cmask)


def bias_gelu_fwd(x2, bias, tanh: bool, config=None):
    m, n = x2.shape
    y = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    cfg = _tile_config(n, config)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]))
    _bias_gelu_fwd_kernel[grid](
        x2, x2 if bias is None else bias, y, m, n, x2.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, TANH=tanh, **cfg,
    )  # fmt: skip
    return y


def bias_gelu_bwd(dy2, x2, bias, tanh: bool, config=None):
    m, n = x2.shape
    dx = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    has_bias = bias is not None
    launch = _column_bwd_launch(_bias_gelu_bwd_kernel, ("gelu", has_bias, tanh), m, n, x2.device, config)
    db = torch.empty((launch.max_parts, n), dtype=torch.float32, device=x2.device) if has_bias else dx
    parts = launch(
        dy2, x2, x2 if bias is None else bias, dx, db, m, n, dy2.stride(0), x2.stride(0), dx.stride(0),
        HAS_BIAS=has_bias, TANH=tanh,
    )  # fmt: skip
    return dx, (db[:parts].sum(0).to(bias.dtype) if has_bias else None)


class BiasGeLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, tanh):
        x2 = rows_2d(x)
        ctx.save_for_backward(x2, bias)
        ctx.tanh = tanh
        ctx.x_shape = x.shape
        return bias_gelu_fwd(x2, bias, tanh).view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, bias = ctx.saved_tensors
        dx, db = bias_gelu_bwd(rows_2d(dy), x2, bias, ctx.tanh)
        return dx.view(ctx.x_shape), (db if ctx.needs_input_grad[1] else None), None


def bias_gelu(x: torch.Tensor, bias: torch.Tensor | None, approximate: str = "none") -> torch.Tensor:
    return BiasGeLUFunction.apply(x, bias, approximate == "tanh")


# --- bias-dropout-add -----------------------------------------------------------------------------


@triton.jit
def _keep01(r, p):
    """1 where the uniform draw from Philox's 32 random bits ``r`` keeps the element (``u >= p``)."""
    r = r.to(tl.int32, bitcast=True)
    u = tl.where(r < 0, -r - 1, r).to(tl.float32) * 4.6566127342e-10  # uniform in [0, 1)
    return (u >= p).to(tl.int32)


@triton.jit
def _keep_bits(seed, rows, q, N, p):
    """Dropout's keep bits ``k0..k7`` (int32 0/1, each ``[rows, q]``) of the columns ``8q + j``.

    Element ``(row, col)`` takes lane ``col % 4`` of the Philox call at counter
    ``row * cdiv(N, 4) + col // 4``: one call (``randint4x``) serves 4 neighbouring columns, and the
    mask depends only on the element, not on the tiling. Two calls (even and odd counters) give the
    8 bits of one mask byte in the same thread, so packing them is element-wise.
    """
    offs = rows[:, None] * ((N + 3) // 4) + 2 * q[None, :]
    a0, a1, a2, a3 = tl.randint4x(seed, offs)
    b0, b1, b2, b3 = tl.randint4x(seed, offs + 1)
    return (
        _keep01(a0, p), _keep01(a1, p), _keep01(a2, p), _keep01(a3, p),
        _keep01(b0, p), _keep01(b1, p), _keep01(b2, p), _keep01(b3, p),
    )  # fmt: skip


@triton.jit
def _pack8(k0, k1, k2, k3, k4, k5, k6, k7):
    """The mask byte: bit ``j`` is ``k_j`` (column ``8q + j``)."""
    b = k0 | (k1 << 1) | (k2 << 2) | (k3 << 3) | (k4 << 4) | (k5 << 5) | (k6 << 6) | (k7 << 7)
    return b.to(tl.uint8)


@triton.jit
def _spread8(k0, k1, k2, k3, k4, k5, k6, k7, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``[BLOCK_M, BLOCK_N // 8]`` x 8 -> ``[BLOCK_M, BLOCK_N]`` with column ``8q + j`` = ``k_j[:, q]``.

    Nested joins put the outermost join on the fastest axis, so the reshape reads them in
    bit-reversed order: ``k_j`` enters at position ``rev3(j)``. Joins add per-thread axes (no data
    movement); the reshape gives each thread 8 neighbouring columns.
    """
    t = tl.join(tl.join(tl.join(k0, k4), tl.join(k2, k6)), tl.join(tl.join(k1, k5), tl.join(k3, k7)))
    return tl.reshape(t, (BLOCK_M, BLOCK_N))


@triton.jit
def _unpack8(packed, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The keep mask ``[BLOCK_M, BLOCK_N]`` (bool) from its packed bytes ``[BLOCK_M, BLOCK_N // 8]``."""
    b = packed.to(tl.int32)
    keep = _spread8(
        b & 1, (b >> 1) & 1, (b >> 2) & 1, (b >> 3) & 1, (b >> 4) & 1, (b >> 5) & 1, (b >> 6) & 1, (b >> 7) & 1,
        BLOCK_M, BLOCK_N,
    )  # fmt: skip
    return keep != 0


@triton.jit
def _bda_fwd_kernel(
    X,
    B,
    R,
    Y,
    SEED,
    MASK,
    M,
    N,
    stride_x,
    stride_r,
    stride_y,
    stride_mask,
    p,
    scale,
    HAS_BIAS: tl.constexpr,
    DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols0 = tl.program_id(1) * BLOCK_N
    cols = cols0 + tl.arange(0, BLOCK_N)
    cmask = cols < N
    rmask = rows < M
    mask = rmask[:, None] & cmask[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_BIAS:
        b = tl.load(B + cols, mask=cmask, other=0.0)
        x = (x.to(tl.float32) + b.to(tl.float32)[None, :]).to(X.dtype.element_ty)
    t = x.to(tl.float32)
    if DROPOUT:
        q = cols0 // 8 + tl.arange(0, BLOCK_N // 8)
        k0, k1, k2, k3, k4, k5, k6, k7 = _keep_bits(tl.load(SEED), rows, q, N, p)
        qmask = rmask[:, None] & (q < (N + 7) // 8)[None, :]
        packed = _pack8(k0, k1, k2, k3, k4, k5, k6, k7)
        tl.store(MASK + rows64[:, None] * stride_mask + q[None, :], packed, mask=qmask)
        keep = _spread8(k0, k1, k2, k3, k4, k5, k6, k7, BLOCK_M, BLOCK_N) != 0
        t = tl.where(keep, t * scale, 0.0).to(X.dtype.element_ty).to(tl.float32)
    r = tl.load(R + rows64[:, None] * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + rows64[:, None] * stride_y + cols[None, :], (r + t).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _bda_bwd_load(
    DY,
    MASK,
    rows,
    hi,
    cols,
    cmask,
    q,
    qmask,
    stride_dy,
    stride_mask,
    DROPOUT: tl.constexpr,
    EVICT: tl.constexpr,
):
    """``dy`` and the packed mask of ``rows``; ``EVICT``: both read once, marked first to leave L2."""
    rmask = rows < hi
    rows64 = rows.to(tl.int64)
    pdy = DY + rows64[:, None] * stride_dy + cols[None, :]
    pmask = MASK + rows64[:, None] * stride_mask + q[None, :]
    if EVICT:
        dy = tl.load(pdy, mask=rmask[:, None] & cmask[None, :], other=0.0, eviction_policy="evict_first")
    else:
        dy = tl.load(pdy, mask=rmask[:, None] & cmask[None, :], other=0.0)
    if DROPOUT:
        if EVICT:
            packed = tl.load(
                pmask, mask=rmask[:, None] & qmask[None, :], other=0, eviction_policy="evict_first"
            )
        else:
            packed = tl.load(pmask, mask=rmask[:, None] & qmask[None, :], other=0)
    else:
        packed = tl.zeros([1, 1], dtype=tl.uint8)  # unused
    return dy, packed


@triton.jit
def _bda_bwd_kernel(
    DY,
    MASK,
    DX,
    DB,
    M,
    N,
    stride_dy,
    stride_mask,
    stride_dx,
    scale,
    DROPOUT: tl.constexpr,  # else only dbias = dy.sum(0) (dx is dy itself, not written)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PER_SM: tl.constexpr,  # sets the grid only
    PREFETCH: tl.constexpr,  # load the next tile before accumulating this one
    EVICT: tl.constexpr,  # dy and mask loads marked evict-first
    STRIDED: tl.constexpr,  # rows interleaved between programs (else a contiguous share each)
):
    # Persistent over [row programs, column blocks]: each program walks its row blocks of one
    # column block, accumulates dbias in a [BLOCK_M, BLOCK_N] fp32 tile (no cross-thread work in the
    # loop) and writes one reduced row of the [row programs, N] partial sums at the end.
    lo, hi, step = row_range(tl.program_id(0), tl.num_programs(0), M, BLOCK_M, STRIDED)
    cols0 = tl.program_id(1) * BLOCK_N
    cols = cols0 + tl.arange(0, BLOCK_N)
    cmask = cols < N
    q = cols0 // 8 + tl.arange(0, BLOCK_N // 8)
    qmask = q < (N + 7) // 8
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    rows = lo + tl.arange(0, BLOCK_M)
    if PREFETCH:
        dy_in, packed = _bda_bwd_load(
            DY, MASK, rows, hi, cols, cmask, q, qmask, stride_dy, stride_mask, DROPOUT, EVICT
        )
    for _ in range(lo, hi, step):
        if PREFETCH:
            dy_nx, packed_nx = _bda_bwd_load(
                DY, MASK, rows + step, hi, cols, cmask, q, qmask, stride_dy, stride_mask, DROPOUT, EVICT
            )
        else:
            dy_in, packed = _bda_bwd_load(
                DY, MASK, rows, hi, cols, cmask, q, qmask, stride_dy, stride_mask, DROPOUT, EVICT
            )
        dy = dy_in.to(tl.float32)
        if DROPOUT:
            dx = tl.where(_unpack8(packed, BLOCK_M, BLOCK_N), dy * scale, 0.0)
            mask = (rows < hi)[:, None] & cmask[None, :]
            tl.store(
                DX + rows.to(tl.int64)[:, None] * stride_dx + cols[None, :],
                dx.to(DX.dtype.element_ty),
                mask=mask,
            )
            acc += dx
        else:
            acc += dy
        if PREFETCH:
            dy_in, packed = dy_nx, packed_nx
        rows += step
    tl.store(DB + tl.program_id(0) * N + cols, tl.sum(acc, axis=0), mask=cmask)


_BDA_BWD_CONFIGS = [
    {
        "BLOCK_N": bn,
        "BLOCK_M": bm,
        "num_warps": w,
        "PER_SM": per_sm,
        "PREFETCH": True,
        "EVICT": True,
        "STRIDED": True,
    }
    for bn, bm, w in ((256, 16, 4), (512, 8, 4), (1024, 4, 4), (2048, 2, 8), (2048, 4, 8))
    for per_sm in (2, 4)
]
"""Measured on H100 (8192 x 2048 bf16): with dropout, 256-column blocks of 16 rows on 2 programs
an SM were the fastest (narrow blocks also keep the partial sums small); without (the bias gradient
alone), whole rows 4 at a time. Prefetching and interleaved rows paid in both."""


def _bda_bwd_launch(tag, m: int, n: int, device: torch.device, config: dict | None):
    if config is None:  # the training path: built once per shape (the sweep passes explicit configs)
        key = (_bda_bwd_kernel, tag, m, n, device, use_autotune(m))
        return cached_launch(key, lambda: _build_bda_bwd_launch(tag, m, n, device, None))
    return _build_bda_bwd_launch(tag, m, n, device, config)


def _build_bda_bwd_launch(tag, m: int, n: int, device: torch.device, config: dict | None):
    # The partial sums cost SMs * PER_SM * BLOCK_N * 4 bytes (written, then read once), whatever N:
    # narrow column blocks of many rows keep them small while each program still moves 8 KB a step.
    sms = sm_count(device)
    bn = max(8, min(256, next_pow2(n)))
    default = dict(_BDA_BWD_CONFIGS[0], BLOCK_N=bn, BLOCK_M=max(1, 4096 // bn))
    configs = [c for c in _BDA_BWD_CONFIGS if c["BLOCK_N"] <= next_pow2(n)] or [default]

    def grid(cfg):
        n_cb = triton.cdiv(n, cfg["BLOCK_N"])
        return balanced_programs(triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(sms * cfg["PER_SM"], n_cb)), n_cb

    return GridLaunch(
        _bda_bwd_kernel, tag, m, configs, default, key=["N"], grid=grid, parts=lambda cfg: grid(cfg)[0],
        config=config,
    )  # fmt: skip


def bda_fwd(x2, bias, r2, p: float, seed: torch.Tensor | None, config=None):
    """``(y, mask)``: ``mask`` is the dropout keep mask packed 8 columns a byte (None without dropout)."""
    m, n = x2.shape
    y = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    dropout = seed is not None
    mask = torch.empty((m, triton.cdiv(n, 8)), dtype=torch.uint8, device=x2.device) if dropout else None
    cfg = _tile_config(n, config)
    cfg["BLOCK_N"] = max(8, cfg["BLOCK_N"])
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]))
    _bda_fwd_kernel[grid](
        x2, x2 if bias is None else bias, r2, y, seed if dropout else x2, mask if dropout else y, m, n,
        x2.stride(0), r2.stride(0), y.stride(0), mask.stride(0) if dropout else 0,
        p, 1.0 / (1.0 - p) if dropout else 1.0, HAS_BIAS=bias is not None, DROPOUT=dropout, **cfg,
    )  # fmt: skip
    return y, mask


def bda_bwd(dy2, mask, p: float, bias_dtype: torch.dtype | None, config=None):
    """``(dx, dbias)`` of bias-dropout-add: ``dx = dy * keep / (1 - p)`` from the forward's packed
    ``mask`` (``dx`` is ``dy2`` itself when ``mask`` is None), ``dbias = dx.sum(0)`` in ``bias_dtype``
    (None: no bias, and no dbias). One pass over ``dy``, then one small launch for ``dbias``."""
    m, n = dy2.shape
    dropout = mask is not None
    if not dropout and bias_dtype is None:
        return dy2, None
    dx = torch.empty((m, n), dtype=dy2.dtype, device=dy2.device) if dropout else dy2
    launch = _bda_bwd_launch(("bda", dropout), m, n, dy2.device, config)
    part = torch.empty((1, launch.max_parts, n), dtype=torch.float32, device=dy2.device)
    parts = launch(
        dy2, mask if dropout else dy2, dx, part, m, n, dy2.stride(0), mask.stride(0) if dropout else 0,
        dx.stride(0), 1.0 / (1.0 - p) if dropout else 1.0, DROPOUT=dropout,
    )  # fmt: skip
    if bias_dtype is None:
        return dx, None
    (db,) = sum_partials(part, parts, [bias_dtype])
    return dx, db


class BiasDropoutAddFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, residual, p, dropout):
        x2, r2 = rows_2d(x), rows_2d(residual)
        seed = None
        if dropout:
            # Drawn from the current device generator (so RNG-tracker forks apply); stays on device.
            seed = torch.randint(0, 2**31 - 1, (1,), device=x.device, dtype=torch.int64)
        y, mask = bda_fwd(x2, bias, r2, p, seed)
        ctx.save_for_backward(mask)  # 1 bit an element (None without dropout)
        ctx.p, ctx.x_shape = p, x.shape
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        (mask,) = ctx.saved_tensors
        bias_dtype = ctx.bias_dtype if ctx.needs_input_grad[1] else None
        dx, db = bda_bwd(rows_2d(dy), mask, ctx.p, bias_dtype)
        dx = dx.view(ctx.x_shape) if mask is not None else dy
        return dx, db, dy, None, None


def bias_dropout_add(x, bias, residual, p: float, training: bool) -> torch.Tensor:
    return BiasDropoutAddFunction.apply(x, bias, residual, float(p), bool(training and p > 0.0))
