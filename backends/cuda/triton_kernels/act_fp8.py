"""The MLP activation fused with its FP8 cast: fc2's input and fc1's output gradient written as FP8.

With the delayed recipe the scale of an FP8 operand is known before the kernel producing it runs, so
the activation kernel can write the operand itself (``q [M, N]`` and/or its transpose ``qT [N, M]``)
and record its amax, instead of writing a bf16 tensor that a cast kernel reads back:

* :func:`act_fp8_forward`: ``y = act(h + bias)`` (GeLU exact or tanh: ``h [M, F]``; SwiGLU:
  ``h [M, 2F] = [gate | up]`` -> ``y [M, F]``) quantized as ``fp8_cast(y, scale=...)``.
* :func:`act_fp8_backward`: ``dh = dy * act'(h + bias)`` (SwiGLU: ``[M, 2F]`` = ``[d gate | d up]``)
  quantized the same way, with the bias gradient ``dbias = dh.sum(0)``.

Bit for bit the unfused CUDA path (the kernels of :mod:`.activations`, then :func:`.fp8_cast.cast`):
the activation uses the same fp32 math (:func:`.activations._gelu_and_grad`, the SwiGLU expressions of
``_swiglu_fwd_kernel``/``_swiglu_bwd_kernel``) and rounds its output to ``h.dtype`` exactly where the
unfused kernel writes it; that value, back in fp32, is scaled, clamped to the FP8 range and rounded
to nearest even as ``_cast_kernel`` does, and its ``|.|`` goes into the recorded amax.

The bias gradient sums what the unfused path sums, in fp32: for GeLU the unrounded fp32 ``dh`` (as
``_bias_gelu_bwd_kernel`` does), for SwiGLU ``dh`` rounded to ``h.dtype`` (the unfused path adds
the bias in a separate op, whose autograd sums the SwiGLU kernel's output); one rounding to the
bias dtype at the end. It is deterministic: each program keeps fp32 column sums of its rows and
writes them to a ``[row programs, N]`` buffer that :func:`._common.sum_partials` adds in a fixed
order (no float atomics). The order of the fp32 additions depends on the tiling, so ``dbias`` equals
the unfused kernel's bit for bit when both split the rows alike and sum the partials in the same
order (the interpreter test: two row programs, same tiles) and within fp32 rounding otherwise (the
unfused kernel's own tiling is autotuned per shape, so its additions have no fixed order either;
on an H100 the test's fp16/bf16 cases came out bit-identical, the fp32 ones not).

Grids: the forward walks ``[BLOCK_M, BLOCK_F]`` tiles, one a program (``PER_SM`` 0) or
grid-strided on at most ``PER_SM`` programs an SM, each program ending with one ``relaxed`` atomic on
the amax word when it records one (:func:`.fp8_cast._record_amax`); tile and grid are autotuned per
shape (``_FWD_CONFIGS``), every one giving the same bytes. The backward is persistent over ``[row
programs, column blocks]``, so that each program accumulates the bias partial sums of one column
block over its rows; again one atomic a program. Both store the transposed tile through ``tl.trans``
(coalesced along ``M``), as ``_cast_kernel`` does.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._common import (
    GridLaunch,
    balanced_programs,
    cached_launch,
    sm_count,
    sum_partials,
    use_autotune,
)
from .activations import _gelu_and_grad
from .fp8_cast import (
    _MANTISSA_BITS,
    _MIN_NORMAL_EXP,
    _TL_FP8,
    PROGRAMS_PER_SM,
    _abs_max_rows,
    _quantize_bytes,
    _record_amax,
    _store_tile_bytes,
    encode_in_int,
)

KINDS = ("gelu", "gelu_tanh", "swiglu")


@triton.jit
def _load_biased(ptr, B, cols, cmask, mask, HAS_BIAS: tl.constexpr, EVEN: tl.constexpr):
    """``h + bias`` rounded to ``h``'s dtype (a separate torch op in the reference), in fp32."""
    if EVEN:
        x = tl.load(ptr)
    else:
        x = tl.load(ptr, mask=mask, other=0.0)
    if HAS_BIAS:
        if EVEN:
            b = tl.load(B + cols)
        else:
            b = tl.load(B + cols, mask=cmask, other=0.0)
        x = (x.to(tl.float32) + b.to(tl.float32)[None, :]).to(ptr.dtype.element_ty)
    return x.to(tl.float32)


class Fp8Format(NamedTuple):
    """The constants of an FP8 output, passed to the kernels as one constexpr (``FP8_FORMAT``): the
    parameters of :func:`.fp8_cast._quantize_bytes`. Triton folds a constexpr's fields like separate
    constexprs: the kernels compile to the same PTX as with five parameters (compared for sm_90, bf16
    and fp32 inputs, with Triton 3.6 and 3.9)."""

    max: float  # the largest finite value (FP8_MAX)
    dtype: tl.dtype  # the Triton FP8 type (FP8)
    mantissa_bits: int  # MANTISSA_BITS
    min_normal_exp: int  # MIN_NORMAL_EXP
    encode_in_int: bool  # ENCODE_IN_INT: the bytes built by integer operations (fp32 input, interpreter)


@functools.cache  # one object a format: no host work per launch
def _fp8_format(fp8_dtype: torch.dtype, input_dtype: torch.dtype) -> Fp8Format:
    return Fp8Format(
        max=float(torch.finfo(fp8_dtype).max),
        dtype=_TL_FP8[fp8_dtype],
        mantissa_bits=_MANTISSA_BITS[fp8_dtype],
        min_normal_exp=_MIN_NORMAL_EXP[fp8_dtype],
        encode_in_int=encode_in_int(input_dtype),
    )


@triton.jit
def _quantize(x, scale, FP8_FORMAT: tl.constexpr):
    """:func:`.fp8_cast._quantize_bytes` with its constants from an :class:`Fp8Format`."""
    # the fields read off the constexpr in place: a local copy of it (``f = FP8_FORMAT``) is no
    # longer a constexpr, and ``f.dtype`` then fails to compile
    return _quantize_bytes(
        x, scale, FP8_FORMAT.max, FP8_FORMAT.dtype, FP8_FORMAT.mantissa_bits, FP8_FORMAT.min_normal_exp,
        FP8_FORMAT.encode_in_int,
    )  # fmt: skip


@triton.jit
def _column_sums(x, mask, EVEN: tl.constexpr):
    """``x.sum(0)`` over ``mask`` (all of ``x`` when ``EVEN``)."""
    if not EVEN:
        x = tl.where(mask, x, 0.0)
    return tl.sum(x, axis=0)


def _even(args) -> bool:
    """The tiles cover ``[M, F]`` exactly: the kernels drop their bounds masks."""
    return args["M"] % args["BLOCK_M"] == 0 and args["F"] % args["BLOCK_F"] == 0


@triton.heuristics({"EVEN": _even})
@triton.jit
def _act_fp8_fwd_kernel(
    H,
    B,
    Q,
    QT,
    SCALE,
    SCALE_INV,
    AMAX_RECORD,
    M,
    F,
    stride_h,
    SWIGLU: tl.constexpr,
    TANH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RECORD_AMAX: tl.constexpr,
    ROWWISE: tl.constexpr,
    COLUMNWISE: tl.constexpr,
    FP8_FORMAT: tl.constexpr,  # an Fp8Format
    BLOCK_M: tl.constexpr,
    BLOCK_F: tl.constexpr,
    PER_SM: tl.constexpr,  # sets the grid only: 0 one tile a program, else at most PER_SM programs an SM
    EVEN: tl.constexpr,  # M % BLOCK_M == F % BLOCK_F == 0: no bounds masks
):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    scale = tl.load(SCALE)
    if pid == 0:
        tl.store(SCALE_INV, tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale))
    tiles_f = tl.cdiv(F, BLOCK_F)
    running_amax = tl.zeros([BLOCK_M], dtype=tl.float32)
    for tile in range(pid, tl.cdiv(M, BLOCK_M) * tiles_f, programs):  # one tile a program: PER_SM 0
        rows = ((tile // tiles_f) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        cols = ((tile % tiles_f) * BLOCK_F + tl.arange(0, BLOCK_F)).to(tl.int64)
        cmask = cols < F
        mask = (rows < M)[:, None] & cmask[None, :]
        ptr = H + rows[:, None] * stride_h + cols[None, :]
        x = _load_biased(ptr, B, cols, cmask, mask, HAS_BIAS, EVEN)
        if SWIGLU:  # _swiglu_fwd_kernel: silu(gate) rounded to the dtype before the product
            u = _load_biased(ptr + F, B + F, cols, cmask, mask, HAS_BIAS, EVEN)
            a = (x * tl.sigmoid(x)).to(H.dtype.element_ty).to(tl.float32)
            y = a * u
        else:  # _bias_gelu_fwd_kernel
            y, _ = _gelu_and_grad(x, TANH, False)
        y = y.to(H.dtype.element_ty).to(tl.float32)  # what the unfused kernel writes
        if RECORD_AMAX:
            running_amax = _abs_max_rows(running_amax, y, mask, EVEN)
        q = _quantize(y, scale, FP8_FORMAT)
        _store_tile_bytes(Q, QT, q, rows, cols, M, F, F, ROWWISE, COLUMNWISE, EVEN)
    if RECORD_AMAX:
        _record_amax(AMAX_RECORD, running_amax)


@triton.heuristics({"EVEN": _even})
@triton.jit
def _act_fp8_bwd_kernel(
    DY,
    H,
    B,
    Q,
    QT,
    SCALE,
    SCALE_INV,
    AMAX_RECORD,
    DB,
    M,
    F,
    stride_dy,
    stride_h,
    SWIGLU: tl.constexpr,
    TANH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RECORD_AMAX: tl.constexpr,
    ROWWISE: tl.constexpr,
    COLUMNWISE: tl.constexpr,
    FP8_FORMAT: tl.constexpr,  # an Fp8Format
    BLOCK_M: tl.constexpr,
    BLOCK_F: tl.constexpr,
    PER_SM: tl.constexpr,  # sets the grid only
    NUM_STAGES: tl.constexpr,  # software pipelining of the row loop (1: none)
    EVEN: tl.constexpr,  # M % BLOCK_M == F % BLOCK_F == 0: no bounds masks
):
    # Persistent over [row programs, column blocks]: program (r, c) walks row blocks r, r + R, ... of
    # column block c, keeping fp32 bias partial sums of its rows and the rows' running amax.
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    n_dh = 2 * F if SWIGLU else F  # dh's width (SwiGLU: [d gate | d up])
    scale = tl.load(SCALE)
    if (pid_r == 0) & (pid_c == 0):
        tl.store(SCALE_INV, tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale))
    cols = (pid_c * BLOCK_F + tl.arange(0, BLOCK_F)).to(tl.int64)
    cmask = cols < F
    db = tl.zeros([BLOCK_F], dtype=tl.float32)
    db_up = tl.zeros([BLOCK_F], dtype=tl.float32)
    running_amax = tl.zeros([BLOCK_M], dtype=tl.float32)
    # NUM_STAGES > 1: the next row blocks' loads are issued (cp.async into shared memory) while this
    # one is computed and stored, hiding the erf/exp arithmetic behind the memory traffic
    for start in tl.range(pid_r * BLOCK_M, M, tl.num_programs(0) * BLOCK_M, num_stages=NUM_STAGES):
        rows = (start + tl.arange(0, BLOCK_M)).to(tl.int64)
        mask = (rows < M)[:, None] & cmask[None, :]
        if EVEN:
            dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :]).to(tl.float32)
        else:
            dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        ptr = H + rows[:, None] * stride_h + cols[None, :]
        x = _load_biased(ptr, B, cols, cmask, mask, HAS_BIAS, EVEN)
        if SWIGLU:  # _swiglu_bwd_kernel's math; the bias gradient sums its rounded output
            u = _load_biased(ptr + F, B + F, cols, cmask, mask, HAS_BIAS, EVEN)
            sig = tl.sigmoid(x)
            a = x * sig
            dg = dy * u * sig * (1.0 + x * (1.0 - sig))
            du = dy * a.to(H.dtype.element_ty).to(tl.float32)
            dg = dg.to(H.dtype.element_ty).to(tl.float32)
            du = du.to(H.dtype.element_ty).to(tl.float32)
            if HAS_BIAS:
                db += _column_sums(dg, mask, EVEN)
                db_up += _column_sums(du, mask, EVEN)
            if RECORD_AMAX:
                running_amax = _abs_max_rows(running_amax, dg, mask, EVEN)
                running_amax = _abs_max_rows(running_amax, du, mask, EVEN)
            q = _quantize(dg, scale, FP8_FORMAT)
            _store_tile_bytes(Q, QT, q, rows, cols, M, n_dh, F, ROWWISE, COLUMNWISE, EVEN)
            q = _quantize(du, scale, FP8_FORMAT)
            _store_tile_bytes(Q, QT, q, rows, cols + F, M, n_dh, n_dh, ROWWISE, COLUMNWISE, EVEN)
        else:  # _bias_gelu_bwd_kernel's math; the bias gradient sums the unrounded fp32 dh
            _, d = _gelu_and_grad(x, TANH, True)
            dx = dy * d
            if HAS_BIAS:
                db += _column_sums(dx, mask, EVEN)
            dx = dx.to(H.dtype.element_ty).to(tl.float32)  # what the unfused kernel writes
            if RECORD_AMAX:
                running_amax = _abs_max_rows(running_amax, dx, mask, EVEN)
            q = _quantize(dx, scale, FP8_FORMAT)
            _store_tile_bytes(Q, QT, q, rows, cols, M, n_dh, F, ROWWISE, COLUMNWISE, EVEN)
    if RECORD_AMAX:
        _record_amax(AMAX_RECORD, running_amax)
    if HAS_BIAS:
        tl.store(DB + pid_r * n_dh + cols, db, mask=cmask)
        if SWIGLU:
            tl.store(DB + pid_r * n_dh + F + cols, db_up, mask=cmask)


_FWD_CONFIGS = [
    {"BLOCK_M": bm, "BLOCK_F": bf, "num_warps": w, "PER_SM": per_sm}
    for bm, bf, w in ((64, 128, 4), (32, 128, 4), (64, 64, 4), (128, 64, 8), (64, 128, 8))
    for per_sm in (0, PROGRAMS_PER_SM)
]
"""The forward's tiles and grids, autotuned at the first call of a shape with many rows (see
``GridLaunch``). Grids (2026-11-25, H100, the amax recorded with the relaxed atomic): exact GeLU bf16
[8192, 8192] is fastest one tile a program (32x128 4 warps 103.7 us, against 111.3 grid-strided on 16
programs an SM; the same tile and grid with the ``acq_rel`` atomic took 108.7 and 112.7); SwiGLU
[8192, 2 x 4096] took 91.0 us one tile a program against 77.8 grid-strided (both autotuned over the
tiles), so both grids are tuned over. The tiles (before the grid was tuned, all grid-strided):
the four fastest of ``bench_act_fp8.py --sweep --kinds gelu`` on an H100 (exact GeLU, bf16 [8192,
8192], amax recorded): 32x128 4 warps 113.1 us, 128x64 8 warps 113.3, 64x64 4 warps 113.6, 64x128 8
warps 117.2; and the previous fixed tile, 64x128 4 warps, 126.9 (tuned before the GeLU math changed;
slower: 128x128 8 warps 142.1, 32x256 8 warps 127.6, 64x256 8 warps 126.5). A second H100 sweep the
same day (``--sweep --kinds gelu,swiglu``): GeLU autotuned 111.5 us (32x128 4 warps 111.6, 128x64 8
warps 111.3, 64x64 4 warps 112.5, 64x128 4 warps 126.5); SwiGLU [8192, 2 x 8192] autotuned 77.8 us,
[4096, 2 x 14336] 131.7 us (64x128 4 warps 131.6, 64x64 4 warps 131.9); 32x64 4 warps (140.5 us GeLU)
and 16x128 4 warps (280.5 us) were slower everywhere and are not tuned over."""

FWD_DEFAULT = {"BLOCK_M": 64, "BLOCK_F": 128, "num_warps": 4, "PER_SM": 0}
"""The forward's tile without autotuning (few rows, the interpreter, MCORE_TRITON_AUTOTUNE=0): the
previous fixed tile, the one SwiGLU was measured with, one a program."""

_BWD_CONFIGS = [
    {"BLOCK_M": bm, "BLOCK_F": bf, "num_warps": w, "PER_SM": per_sm, "NUM_STAGES": stages}
    for bm, bf, w, per_sm, stages in (
        *(
            (bm, bf, w, per_sm, 1)
            for bm, bf, w in ((64, 128, 8), (32, 128, 4), (128, 64, 8), (64, 64, 4))
            for per_sm in (8, 16)
        ),
        (32, 128, 4, 24, 1),
        (64, 64, 4, 16, 3),
        (64, 64, 4, 24, 3),
        (64, 64, 4, 8, 4),
        (128, 64, 8, 8, 3),
    )
]
"""The backward's tiles, autotuned at the first call of a shape with many rows (see ``GridLaunch``).
``NUM_STAGES`` pipelines the row loop (``tl.range(..., num_stages=)``: the next row blocks' loads in
flight while this one's erf/exp arithmetic and stores run). On an H100 (a sweep of
every tile x ``PER_SM`` 8/16/24 x stages 1-4, bytes checked equal to stages 1; 2026-11-25): exact GeLU
[8192, 8192] best 163.5 us with 64x64 / 4 warps / 24 per SM / 3 stages (best without pipelining 186.2,
the previous list's autotuned 185.3; 64x64/16 per SM/3 stages 164.5 and 187.7 in two runs, so both
grids are tuned over); SwiGLU [8192, 2 x 8192] 128.4 us and [4096, 2 x 14336] 221.0 us, both best
without pipelining (it gained nothing there: within 1%). Older measurements of the first eight: tanh
GeLU 173 us; 32x64 and 16x128 tiles lost for every kind. In the 24L h2048 training step the 24
backward calls went from ~4.7 to 4.00 ms (166.7 us each)."""

BWD_DEFAULT = {"BLOCK_M": 64, "BLOCK_F": 64, "num_warps": 4, "PER_SM": PROGRAMS_PER_SM, "NUM_STAGES": 1}
"""The backward's tile without autotuning (few rows, the interpreter, MCORE_TRITON_AUTOTUNE=0): the
fastest for GeLU on an H100 (250 us) and within 2% of the fastest for SwiGLU (253 us)."""


def _bytes(t: torch.Tensor | None, placeholder: torch.Tensor) -> torch.Tensor:
    """An FP8 output as the uint8 view the kernels store into (see :func:`_store_fp8`)."""
    return placeholder if t is None else t.view(torch.uint8)


def _outputs(m: int, n: int, fp8_dtype, rowwise: bool, columnwise: bool, device):
    q = torch.empty((m, n), dtype=fp8_dtype, device=device) if rowwise else None
    qt = torch.empty((n, m), dtype=fp8_dtype, device=device) if columnwise else None
    scale_inv = torch.empty((), dtype=torch.float32, device=device)
    return q, qt, scale_inv


def _fwd_launch(tag, m: int, f: int, record_amax: bool, device: torch.device, config: dict | None):
    if config is None:  # the training path: built once per shape
        key = (_act_fp8_fwd_kernel, tag, m, f, record_amax, device, use_autotune(m))
        return cached_launch(key, lambda: _build_fwd_launch(tag, m, f, record_amax, device, None))
    return _build_fwd_launch(tag, m, f, record_amax, device, config)


def _build_fwd_launch(tag, m: int, f: int, record_amax: bool, device, config: dict | None) -> GridLaunch:
    sms = sm_count(device)

    def grid(cfg):  # one tile a program, or at most PER_SM programs an SM (module docstring)
        tiles = triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(f, cfg["BLOCK_F"])
        return (min(tiles, cfg["PER_SM"] * sms) if cfg["PER_SM"] else tiles,)

    # Autotuning runs every config several times into the same outputs: harmless, as a run stores
    # the same bytes whatever its tile and only max-es the same values into the amax record.
    return GridLaunch(
        _act_fp8_fwd_kernel, (*tag, record_amax), m, _FWD_CONFIGS, FWD_DEFAULT, key=["M", "F"], grid=grid,
        parts=lambda cfg: 0, config=config,
    )  # fmt: skip


def act_fp8_forward(
    h: torch.Tensor,
    bias: torch.Tensor | None,
    kind: str,
    fp8_dtype: torch.dtype,
    scale: torch.Tensor,
    amax_record: torch.Tensor | None = None,
    rowwise: bool = True,
    columnwise: bool = True,
    config: dict | None = None,
):
    """The op ``act_fp8_forward`` on ``h [M, F]`` (SwiGLU ``[M, 2F]``, unit stride on the last dim):
    ``(q [M, F], qT [F, M], scale_inv)``; see :func:`mcore.ops.reference.act_fp8_forward`."""
    swiglu = kind == "swiglu"
    m = h.shape[0]
    f = h.shape[1] // 2 if swiglu else h.shape[1]
    q, qt, scale_inv = _outputs(m, f, fp8_dtype, rowwise, columnwise, h.device)
    tag = (kind, bias is not None, h.dtype, fp8_dtype, rowwise, columnwise)
    launch = _fwd_launch(tag, m, f, amax_record is not None, h.device, config)
    launch(
        h, h if bias is None else bias, _bytes(q, scale_inv), _bytes(qt, scale_inv),
        scale, scale_inv, scale_inv if amax_record is None else amax_record, m, f, h.stride(0),
        SWIGLU=swiglu, TANH=kind == "gelu_tanh", HAS_BIAS=bias is not None,
        RECORD_AMAX=amax_record is not None, ROWWISE=rowwise, COLUMNWISE=columnwise,
        FP8_FORMAT=_fp8_format(fp8_dtype, h.dtype),
    )  # fmt: skip
    return q, qt, scale_inv


def _bwd_launch(tag, m: int, f: int, device: torch.device, config: dict | None) -> GridLaunch:
    if config is None:  # the training path: built once per shape
        key = (_act_fp8_bwd_kernel, tag, m, f, device, use_autotune(m))
        return cached_launch(key, lambda: _build_bwd_launch(tag, m, f, device, None))
    return _build_bwd_launch(tag, m, f, device, config)


def _build_bwd_launch(tag, m: int, f: int, device: torch.device, config: dict | None) -> GridLaunch:
    sms = sm_count(device)

    def grid(cfg):
        n_cb = triton.cdiv(f, cfg["BLOCK_F"])
        return balanced_programs(triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(sms * cfg["PER_SM"], n_cb)), n_cb

    return GridLaunch(
        _act_fp8_bwd_kernel, tag, m, _BWD_CONFIGS, BWD_DEFAULT, key=["F"], grid=grid,
        parts=lambda cfg: grid(cfg)[0], config=config,
    )  # fmt: skip


def act_fp8_backward(
    grad_output: torch.Tensor,
    h: torch.Tensor,
    bias: torch.Tensor | None,
    kind: str,
    fp8_dtype: torch.dtype,
    scale: torch.Tensor,
    amax_record: torch.Tensor | None = None,
    rowwise: bool = True,
    columnwise: bool = True,
    config: dict | None = None,
):
    """The op ``act_fp8_backward``: ``grad_output [M, F]`` and fc1's output ``h [M, F]`` (SwiGLU
    ``[M, 2F]``) -> ``(q, qT, scale_inv, dbias)`` of ``dh`` (``[M, F]``, SwiGLU ``[M, 2F]``); see
    :func:`mcore.ops.reference.act_fp8_backward`."""
    swiglu = kind == "swiglu"
    m, n_dh = h.shape
    f = n_dh // 2 if swiglu else n_dh
    q, qt, scale_inv = _outputs(m, n_dh, fp8_dtype, rowwise, columnwise, h.device)
    has_bias = bias is not None
    launch = _bwd_launch((kind, has_bias, h.dtype, fp8_dtype, rowwise, columnwise), m, f, h.device, config)
    part = (
        torch.empty((1, launch.max_parts, n_dh), dtype=torch.float32, device=h.device) if has_bias else None
    )
    parts = launch(
        grad_output, h, bias if has_bias else h, _bytes(q, scale_inv), _bytes(qt, scale_inv),
        scale, scale_inv, scale_inv if amax_record is None else amax_record, scale_inv if part is None else part,
        m, f, grad_output.stride(0), h.stride(0),
        SWIGLU=swiglu, TANH=kind == "gelu_tanh", HAS_BIAS=has_bias, RECORD_AMAX=amax_record is not None,
        ROWWISE=rowwise, COLUMNWISE=columnwise, FP8_FORMAT=_fp8_format(fp8_dtype, h.dtype),
    )  # fmt: skip
    dbias = sum_partials(part, parts, [bias.dtype])[0] if has_bias else None
    return q, qt, scale_inv, dbias
