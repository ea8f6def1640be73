"""Where the CUDA backend's Triton kernels may run: the device check every dispatcher makes before it
launches a kernel (the FP8 glue of :mod:`mcore.backends.cuda.fp8` and :mod:`mcore.backends.cuda.ops`
alike), and whether a ``torch.compile`` trace is running (then the dispatchers trace the reference)."""

from __future__ import annotations

import os

import torch

from . import extensions

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
"""Triton's CPU interpreter is on (read once, at import, as Triton reads it): the kernels run on CPU
tensors."""


def on_kernel_device(*tensors: torch.Tensor | None) -> bool:
    """All given tensors are on one CUDA device (or Triton's interpreter is on) and Triton is there."""
    if not extensions.triton_available():
        return False
    device = None
    for t in tensors:
        if t is None:
            continue
        if not (t.is_cuda or (INTERPRET and t.device.type == "cpu")):
            return False
        if device is None:
            device = t.device
        elif t.device != device:
            return False
    return True


def tracing() -> bool:
    """A ``torch.compile`` trace is running."""
    return torch.compiler.is_compiling()
