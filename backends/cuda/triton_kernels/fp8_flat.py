"""The FP8 copies of many weights in one launch (ops ``fp8_quantize_flat``, ``fp8_dequantize_flat``).

``--fp8-param-gather`` keeps the FP8 weights of one DDP buffer in a flat FP8 buffer laid out like the
parameters (:mod:`mcore.fp8.param_gather`). Two element-wise maps between them run over
lists of ``(start, end, i)`` runs of that buffer space, ``i`` the weight the run belongs to:

* ``fp8_quantize_flat`` (tensorwise recipe, after the optimizer step): ``data[run] = saturate(
  params[run] * scales[i])`` over this rank's pieces;
* ``fp8_dequantize_flat`` (after a bucket's FP8 all-gather): ``params[run] = data[run] *
  scale_inv[i]`` over the parts of the bucket's weights other ranks own.

The per-weight form (one quantize and one copy, or one multiply and one copy, per weight and run) is a
few small launches per weight, ~200-400 a step on a 24-layer model: host-bound, the GPU idles
between them. Here one program handles one *tile*, at most :data:`BLOCK` consecutive buffer positions
of one run, and a tile table (first position, ``[lo, hi)`` inside the tile, weight index) built once
per run list and kept on the device makes each map a single launch. Tiles start on multiples of
:data:`ALIGN` (a run's first and last tiles are partial and masked; full tiles are unmasked and
vectorise). The weight's scale is read from device memory: nothing waits for the host.

Bytes are those of the reference, bit for bit: the quantization is the FP8 cast kernels'
:func:`~.fp8_cast._quantize_bytes` (so also ``fp8_quantize``'s); the dequantization decodes the e4m3
byte exactly (with NaN bytes set to NaN: Triton's interpreter decodes them as 480), multiplies in fp32
and rounds to bf16 to nearest even with integer operations (the interpreter's bf16 conversion
truncates; on the GPU the integer form costs nothing in a memory-bound kernel). A NaN stays a NaN
(its bits are not PyTorch's on every device: bf16 0x7FFF here, as the GPU's conversion writes it;
PyTorch's CPU conversion writes 0xFFFF). Bytes moved per element: quantize reads 2 (bf16) and writes
1; dequantize reads 1 and writes 2. The block size and warps are not tuned on a GPU.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import triton
import triton.language as tl

from mcore.ops.flat import FlatFp8Weights

from .fp8_cast import _MANTISSA_BITS, _MIN_NORMAL_EXP, _TL_FP8, _quantize_bytes, encode_in_int

BLOCK = 1024
ALIGN = 16
"""Tiles start on multiples of 16 elements (32 bytes of bf16, 16 of FP8): 16-byte vector accesses."""
NUM_WARPS = 4


@functools.lru_cache(maxsize=256)
def _tiles(ranges: tuple[tuple[int, int, int], ...], block: int, device: str) -> tuple:
    """The device tile table of ``ranges``: (first buffer position ``[T]`` int64, ``[lo, hi)`` pairs
    ``[2T]`` int32, weight index ``[T]`` int32); empty runs have no tile. Cached per run list."""
    starts, bounds, index = [], [], []
    for start, end, i in ranges:
        if end <= start:
            continue
        first = np.arange(start - start % ALIGN, end, block, dtype=np.int64)
        lo = np.maximum(start - first, 0)
        hi = np.minimum(end - first, block)
        starts.append(first)
        bounds.append(np.stack([lo, hi], axis=1).reshape(-1))
        index.append(np.full(len(first), i, dtype=np.int32))

    def to_device(parts, dtype):
        array = np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)
        return torch.from_numpy(array.astype(dtype)).to(device)

    return to_device(starts, np.int64), to_device(bounds, np.int32), to_device(index, np.int32)


@triton.jit
def _tile(tile_start_ptr, tile_bounds_ptr, tile_index_ptr, ALIGN: tl.constexpr, BLOCK: tl.constexpr):
    """This program's tile: its buffer offsets, its mask (None for a full tile, through ``full``),
    whether it is full, and its weight index."""
    tile = tl.program_id(0)
    first = tl.multiple_of(tl.load(tile_start_ptr + tile), ALIGN)
    lo = tl.load(tile_bounds_ptr + 2 * tile)
    hi = tl.load(tile_bounds_ptr + 2 * tile + 1)
    index = tl.load(tile_index_ptr + tile)
    r = tl.arange(0, BLOCK)
    return first + r, (r >= lo) & (r < hi), (lo == 0) & (hi == BLOCK), index


@triton.jit
def _quantize_flat_kernel(
    param_ptr, fp8_ptr, scale_ptr, scale_stride, tile_start_ptr, tile_bounds_ptr, tile_index_ptr,
    FP8_MAX: tl.constexpr, FP8: tl.constexpr, MANTISSA_BITS: tl.constexpr, MIN_NORMAL_EXP: tl.constexpr,
    ENCODE_IN_INT: tl.constexpr, ALIGN: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    offs, mask, full, index = _tile(tile_start_ptr, tile_bounds_ptr, tile_index_ptr, ALIGN, BLOCK)
    scale = tl.load(scale_ptr + index * scale_stride)
    if full:
        x = tl.load(param_ptr + offs).to(tl.float32)
        q = _quantize_bytes(x, scale, FP8_MAX, FP8, MANTISSA_BITS, MIN_NORMAL_EXP, ENCODE_IN_INT)
        tl.store(fp8_ptr + offs, q)
    else:
        x = tl.load(param_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        q = _quantize_bytes(x, scale, FP8_MAX, FP8, MANTISSA_BITS, MIN_NORMAL_EXP, ENCODE_IN_INT)
        tl.store(fp8_ptr + offs, q, mask=mask)


@triton.jit
def _dequantized(b, scale_inv, OUT_BF16: tl.constexpr):
    """e4m3 bytes ``b`` (uint8) times ``scale_inv`` in fp32, then as the output's storage: fp32, or the
    bf16 bit pattern (int16) rounded to nearest even (NaN as 0x7FFF, the GPU conversion's NaN)."""
    x = b.to(tl.float8e4nv, bitcast=True).to(tl.float32)  # exact: every e4m3 value is an fp32
    x = tl.where((b & 0x7F) == 0x7F, float("nan"), x)  # e4m3fn's NaN bytes (the interpreter: 480)
    y = x * scale_inv
    # one return: Triton 3.6 compiles both returns of a constexpr branch and refuses their two types
    if OUT_BF16:
        bits = y.to(tl.int32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # arithmetic shift: the top half
        y = tl.where(y == y, rounded, 0x7FFF).to(tl.int16)
    return y


@triton.jit
def _dequantize_flat_kernel(
    param_ptr, fp8_ptr, scale_inv_ptr, scale_stride, tile_start_ptr, tile_bounds_ptr, tile_index_ptr,
    OUT_BF16: tl.constexpr, ALIGN: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    offs, mask, full, index = _tile(tile_start_ptr, tile_bounds_ptr, tile_index_ptr, ALIGN, BLOCK)
    scale_inv = tl.load(scale_inv_ptr + index * scale_stride)
    if full:
        tl.store(param_ptr + offs, _dequantized(tl.load(fp8_ptr + offs), scale_inv, OUT_BF16))
    else:
        b = tl.load(fp8_ptr + offs, mask=mask, other=0)
        tl.store(param_ptr + offs, _dequantized(b, scale_inv, OUT_BF16), mask=mask)


def fp8_quantize_flat(params: torch.Tensor, fp8: FlatFp8Weights) -> None:
    """The reference ``fp8_quantize_flat`` in one launch (``params`` fp32, bf16 or fp16, each upcast to
    fp32 exactly; ``fp8.data`` e4m3 or e5m2; one device)."""
    tile_start, tile_bounds, tile_index = _tiles(tuple(fp8.ranges), BLOCK, str(params.device))
    tiles = tile_start.numel()
    if tiles == 0:
        return
    fp8_dtype = fp8.data.dtype
    _quantize_flat_kernel[(tiles,)](
        params, fp8.data.view(torch.uint8), fp8.scales, fp8.scales.stride(0), tile_start, tile_bounds,
        tile_index, FP8_MAX=float(torch.finfo(fp8_dtype).max), FP8=_TL_FP8[fp8_dtype],
        MANTISSA_BITS=_MANTISSA_BITS[fp8_dtype], MIN_NORMAL_EXP=_MIN_NORMAL_EXP[fp8_dtype],
        ENCODE_IN_INT=encode_in_int(params.dtype), ALIGN=ALIGN, BLOCK=BLOCK, num_warps=NUM_WARPS,
    )  # fmt: skip


def fp8_dequantize_flat(
    params: torch.Tensor,
    data: torch.Tensor,
    scale_inv: torch.Tensor,
    ranges: tuple[tuple[int, int, int], ...],
) -> None:
    """The reference ``fp8_dequantize_flat`` in one launch: ``params`` fp32 or bf16 (fp16's rounding is
    not written in integers here: its dispatcher runs the reference), ``data`` e4m3 (the weights'
    format), one device."""
    tile_start, tile_bounds, tile_index = _tiles(tuple(ranges), BLOCK, str(params.device))
    tiles = tile_start.numel()
    if tiles == 0:
        return
    out_bf16 = params.dtype == torch.bfloat16
    _dequantize_flat_kernel[(tiles,)](
        params.view(torch.int16) if out_bf16 else params, data.view(torch.uint8), scale_inv,
        scale_inv.stride(0), tile_start, tile_bounds, tile_index, OUT_BF16=out_bf16, ALIGN=ALIGN,
        BLOCK=BLOCK, num_warps=NUM_WARPS,
    )  # fmt: skip
