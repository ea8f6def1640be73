"""Shared helpers of the Triton kernels: device facts, block-size heuristics, dtype checks."""

from __future__ import annotations

import functools
import os

import torch
import triton

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
"""Triton's CPU interpreter is active (kernels run on CPU tensors, for debugging without a GPU)."""

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (a small number under the interpreter)."""
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def warps_for(elements: int, lo: int = 4, hi: int = 16) -> int:
    """Warps for a tile of ``elements``: about 16 elements a thread, between ``lo`` and ``hi`` warps."""
    warps = elements // (32 * 16)
    return int(min(hi, max(lo, next_pow2(warps) if warps > 0 else lo)))


def rows_2d(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[rows, last]`` with a unit stride on the last dim (a view when possible)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:
        return x.reshape(-1, x.shape[-1])
