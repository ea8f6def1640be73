"""The ops ``norm_fp8_forward`` and ``norm_backward`` of the fused FP8 producers (delayed recipe).

:func:`norm_fp8_fwd` is two kernels on ``x [M, K]``:

1. the norm forward kernel (:mod:`.norms`, its tile and warps) run for the row statistics only
   (``STORE_Y`` off: ``mean``/``rstd``, the bits it saves when it also writes ``y``);
2. :func:`_norm_cast_kernel`: :func:`.fp8_cast.cast`'s tiles, each normalised from ``x`` and the
   statistics before it is quantized: ``y`` is formed by the norm kernels' own expression
   (:func:`.norms.ln_normalize` / :func:`.norms.rms_normalize`) and rounded to the norm's output dtype,
   then quantized, stored (``q``/``q^T``) and its amax recorded by the cast kernel's helpers.

So the bytes are the unfused path's (norm kernel, then cast kernel; checked on an H100 by
``tests/ops/test_norm_fp8_interpret.py``), and the norm's output ``y`` in the activations' dtype is
never written nor read back: per call the pair moves ``x`` twice and the FP8 bytes once (8192 x 2048
bf16: 96 MB) instead of ``x``, ``y`` twice and the FP8 bytes (128 MB). On an H100
(``benchmarks/kernels/bench_norm_fp8.py``: bf16 -> e4m3 ``q`` and ``q^T``, amax recorded): LayerNorm
[8192, 2048] 48.8 -> 38.3 us, RMSNorm [4096, 4096] 48.2 -> 37.1 us. Apart, with ``x`` in L2 as in
those replays: the statistics 8.7 us, the normalising cast 26.5 us against 25.3 for the plain cast
of ``y``; with L2 flushed the statistics take 21.2 us (8192 one-row programs).

Why not one kernel: the statistics need whole rows before any element is quantized, and ``q^T``
needs many rows a program for coalesced stores (the cast's tiles are 128 rows). A kernel that owns
32 rows, reduces them in the norm kernel's tile and then re-reads them in column chunks (branch
``hn``, 2026-11-24) took 72.5 us against 77.1 us for the unfused pair at 8192 x 2048 (LayerNorm, bf16;
40% slower at 4096 columns): its 256 programs of 4 warps keep too few loads in flight. A row kernel
writing ``q`` then a transpose for ``q^T`` (``hn2``, 2026-11-25) took 38.8 + 15.7 us against ~23.5 +
~29 for the pair in the step, and its uint8 store changed the statistics' reduction order.

:func:`norm_bwd` is the op ``norm_backward``: the norm kernels' backward (:func:`.norms.layer_norm_bwd`,
:func:`.norms.rms_norm_bwd`) from the saved statistics, with the residual stream's gradient added
to ``dx`` in the same pass.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import fp8_cast, norms
from ._common import sm_count
from .fp8_cast import _abs_max_rows, _load_scale, _quantize_store_tile, _record_amax

KINDS = ("LayerNorm", "RMSNorm")

_TL_FLOAT = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

CAST_CONFIG = {"BLOCK_M": 64, "BLOCK_K": 64, "num_warps": 4}
"""The tile of :func:`_norm_cast_kernel` (``PER_SM`` may be added: programs an SM when the amax is
recorded). Swept on an H100 (2026-11-25; 93 configurations of 32-128 rows, 64-256 columns, 2-16
warps, 4/16 programs an SM or one a tile; the pair of kernels, bf16 -> e4m3 ``q`` and ``q^T``, amax
recorded): 38.4 us at LayerNorm [8192, 2048] and 37.2 at RMSNorm [4096, 4096], against 40.8 and 39.5
with the plain cast's 128 x 128 tile on 8 warps; every configuration gave the same bytes."""


@triton.jit
def _norm_cast_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    mean_ptr,
    rstd_ptr,
    q_ptr,
    qt_ptr,
    scale_in_ptr,
    scale_inv_ptr,
    amax_record_ptr,
    M,
    K,
    stride_xm,
    IS_RMS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    OUT_DTYPE: tl.constexpr,  # the norm's output dtype: y is rounded to it before the scale
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
    # fp8_cast._cast_kernel's loop; each tile of x is normalised (and rounded to the norm's output
    # dtype) where the cast kernel loads the norm's output
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    scale = _load_scale(scale_in_ptr, scale_inv_ptr, pid == 0, FROM_AMAX, FP8_LIMIT)
    tiles_k = tl.cdiv(K, BLOCK_K)
    running_amax = tl.zeros([BLOCK_M], dtype=tl.float32)
    for tile in range(pid, tl.cdiv(M, BLOCK_M) * tiles_k, programs):
        rows = ((tile // tiles_k) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        cols = ((tile % tiles_k) * BLOCK_K + tl.arange(0, BLOCK_K)).to(tl.int64)
        rmask = rows < M
        cmask = cols < K
        mask = rmask[:, None] & cmask[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        if IS_RMS:
            y = norms.rms_normalize(x, rstd, w, x_ptr.dtype.element_ty)
        else:
            mean = tl.load(mean_ptr + rows, mask=rmask, other=0.0)
            b = w
            if HAS_BIAS:
                b = tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
            y = norms.ln_normalize(x - mean[:, None], rstd, w, b, HAS_BIAS)
        y = y.to(OUT_DTYPE).to(tl.float32)  # the bytes the unfused norm writes, as the cast loads them
        if RECORD_AMAX:  # padding rows and columns hold the bias, not 0: masked out
            running_amax = _abs_max_rows(running_amax, y, mask, False)
        _quantize_store_tile(
            y, scale, q_ptr, qt_ptr, rows, cols, mask, M, K,
            FP8_MAX, FP8, MANTISSA_BITS, MIN_NORMAL_EXP, ENCODE_IN_INT, ROWWISE, COLUMNWISE,
        )  # fmt: skip
    if RECORD_AMAX:
        _record_amax(amax_record_ptr, running_amax)


def norm_cast(
    x2: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    kind: str,
    mean: torch.Tensor | None,
    rstd: torch.Tensor,
    fp8_dtype: torch.dtype,
    scale: torch.Tensor,
    amax_record: torch.Tensor | None = None,
    rowwise: bool = True,
    columnwise: bool = True,
    config: dict | None = None,
):
    """:func:`_norm_cast_kernel` on ``x2 [M, K]`` with its row statistics (``mean`` None for RMSNorm):
    ``(q, qT, scale_inv)`` of the norm's output, as :func:`.fp8_cast.cast` gives them for the
    output the norm kernel writes. ``config``: the tile (:data:`CAST_CONFIG`)."""
    m, k = x2.shape
    is_rms = kind == "RMSNorm"
    out_dtype = torch.promote_types(x2.dtype, weight.dtype) if is_rms else x2.dtype
    q, qt, scale_inv = fp8_cast._cast_outputs(x2, m, k, fp8_dtype, rowwise, columnwise)
    cfg = {**CAST_CONFIG, **(config or {})}
    per_sm = cfg.pop("PER_SM", fp8_cast.PROGRAMS_PER_SM)
    tiles = triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(k, cfg["BLOCK_K"])
    # as fp8_cast.cast: grid-strided when the amax is recorded (an atomic a program), else a tile each
    programs = min(tiles, per_sm * sm_count(x2.device)) if amax_record is not None else tiles
    constexprs = fp8_cast._cast_constexprs(out_dtype, fp8_dtype, 0, None, amax_record, rowwise, columnwise)
    _norm_cast_kernel[(programs,)](
        x2, weight, weight if bias is None else bias, rstd if mean is None else mean, rstd,
        q.view(torch.uint8) if q is not None else scale_inv,  # unused pointers still need a tensor
        qt.view(torch.uint8) if qt is not None else scale_inv,
        scale, scale_inv, amax_record if amax_record is not None else scale_inv,
        m, k, x2.stride(0),
        IS_RMS=is_rms, HAS_BIAS=bias is not None, OUT_DTYPE=_TL_FLOAT[out_dtype],
        **constexprs, **cfg,
    )  # fmt: skip
    return q, qt, scale_inv


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
    """The op ``norm_fp8_forward`` on ``x2 [M, K]`` (unit stride on K): ``(q, qT, scale_inv, mean, rstd)``,
    ``mean`` None for RMSNorm. ``y`` is rounded to the norm's output dtype (``x``'s for LayerNorm,
    ``promote(x, weight)`` for RMSNorm) before it is scaled, as the unfused norm writes it.
    ``config``: the cast tile (:data:`CAST_CONFIG`)."""
    if kind == "RMSNorm":
        mean, rstd = None, norms.rms_norm_stats(x2, eps)
    else:
        mean, rstd = norms.layer_norm_stats(x2, eps)
    q, qt, scale_inv = norm_cast(
        x2, weight, bias, kind, mean, rstd, fp8_dtype, scale, amax_record, rowwise, columnwise, config
    )
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
