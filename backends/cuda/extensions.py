"""Optional NVIDIA libraries: detected, used when present, never required.

* ``triton``: the fused kernels of :mod:`mcore.backends.cuda.triton_kernels` (else: reference ops).
* ``flash_attn`` (>= 2.1, bottom-right causal alignment like the reference): attention when the
  call fits it (fp16/bf16, no mask or bias, head dim <= 256); else torch SDPA.
* ``apex``: its multi-tensor Adam (``amp_C.multi_tensor_adam``) serves ``adam_step`` when asked for
  with ``MCORE_CUDA_ADAM=apex``; torch's fused AdamW is the default (the same multi-tensor design,
  measured at the device's copy bandwidth in ``benchmarks/kernels``).
* ``transformer_engine``: detected and reported (``capabilities()`` and ``mcore-info``); its fused
  kernels live behind module classes (``te.RMSNorm``, ``te.DotProductAttention``) rather than
  functions of the op table's signatures, so the Triton kernels serve those ops.

Detection uses :func:`importlib.util.find_spec` and never imports a library, so it is cheap and
safe on a machine without a GPU; the import happens at the first call that uses the library.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os


@functools.cache
def installed(name: str) -> bool:
    """Whether the top-level module ``name`` can be imported (without importing it)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def triton_available() -> bool:
    return installed("triton")


@functools.cache
def flash_attn_func():
    """``flash_attn.flash_attn_func`` for flash-attn >= 2.1, else None."""
    if not installed("flash_attn") or os.environ.get("MCORE_CUDA_DISABLE_FLASH_ATTN") == "1":
        return None
    try:
        module = importlib.import_module("flash_attn")
        major, minor = (int(p) for p in module.__version__.split(".")[:2])
        if (major, minor) < (2, 1):
            return None
        return module.flash_attn_func
    except Exception:  # a broken install must not break attention: SDPA serves it
        return None


@functools.cache
def apex_multi_tensor_adam():
    """``(multi_tensor_applier, amp_C.multi_tensor_adam)`` when apex is installed and asked for."""
    if os.environ.get("MCORE_CUDA_ADAM", "torch") != "apex" or not installed("amp_C"):
        return None
    try:
        amp_c = importlib.import_module("amp_C")
        applier = importlib.import_module("apex.multi_tensor_apply").multi_tensor_applier
        return applier, amp_c.multi_tensor_adam
    except Exception:
        return None


def detected() -> dict[str, bool]:
    """Which optional libraries are installed (for capabilities and ``mcore-info``)."""
    return {
        "triton": installed("triton"),
        "flash_attn": installed("flash_attn"),
        "apex": installed("apex"),
        "transformer_engine": installed("transformer_engine"),
    }
