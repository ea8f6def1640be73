"""The CPU backend: gloo for torch.distributed, the reference ops, always available.

It is the test default: the whole suite, multi-process TP/PP/DP included, runs on it.
"""

from __future__ import annotations

import os

import torch

from mcore.backend import BackendBase
from mcore.plugins import hookimpl

MCORE_PLUGIN_API_VERSION = "1.0"


class CPUBackend(BackendBase):
    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    priority = 0
    # fp8 / fp8_rowwise: emulated by the reference ops (quantize, dequantize, fp32 matmul), so the CPU
    # suite runs the FP8 code paths; slower than bf16 here, never faster.
    _capabilities = frozenset({"bf16", "fp16", "fp32", "fp8", "fp8_rowwise"})

    def is_available(self) -> tuple[bool, str]:
        return True, f"always available ({os.cpu_count()} cores)"

    def device(self, local_rank: int = 0) -> torch.device:
        return torch.device("cpu")

    def set_device(self, local_rank: int) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def get_rng_state(self) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        torch.set_rng_state(state)

    def memory_stats(self) -> dict[str, int]:
        # CPU tensors come from the system allocator, which keeps no per-process statistics.
        return {"allocated": 0, "reserved": 0, "peak_allocated": 0}

    def reset_peak_memory_stats(self) -> None:
        pass


@hookimpl
def mcore_backends():
    return [CPUBackend()]
