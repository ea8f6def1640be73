"""The CUDA backend: NVIDIA GPUs through torch.cuda, NCCL for torch.distributed, fused ops.

Kernels it serves (see :mod:`mcore.backends.cuda.ops`): attention through torch's scaled-dot-product
attention (flash / memory-efficient kernels) and the Adam/AdamW step through torch's fused
multi-tensor kernel. Everything else falls back to the reference ops.
"""

from __future__ import annotations

import torch

from mcore.backend import BackendBase
from mcore.plugins import hookimpl

MCORE_PLUGIN_API_VERSION = "1.0"

# Dense bf16/fp16 tensor-core peaks (FLOP/s) by device-name fragment, for MFU.
_PEAK_BF16 = {
    "H100": 989e12,
    "H200": 989e12,
    "H800": 989e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "B200": 2250e12,
    "GB200": 2500e12,
}


class CUDABackend(BackendBase):
    name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"
    priority = 100

    def is_available(self) -> tuple[bool, str]:
        if not torch.cuda.is_available():
            build = torch.version.cuda
            why = "this torch build has no CUDA" if build is None else "no CUDA device is visible"
            return False, why
        return True, f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"

    def capabilities(self) -> frozenset[str]:
        caps = {"fp16", "fp32", "flash_attention", "fused_adam"}
        if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
            caps.add("bf16")
        return frozenset(caps)

    def peak_flops(self, dtype: torch.dtype) -> float | None:
        if not torch.cuda.is_available() or dtype not in (torch.bfloat16, torch.float16):
            return None
        name = torch.cuda.get_device_name()
        return next((peak for key, peak in _PEAK_BF16.items() if key in name), None)


@hookimpl
def mcore_backends():
    return [CUDABackend()]


@hookimpl
def mcore_register_ops(backend, registry):
    if backend.name != "cuda":
        return
    from mcore.backends.cuda import ops

    for name, fn in ops.CUDA_OPS.items():
        registry.override(name, fn, provider="cuda")
