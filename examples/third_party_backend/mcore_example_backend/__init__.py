"""An example mcore device-backend plugin: the template for a third party's accelerator.

Everything a plugin needs is in this module:

1. ``MCORE_PLUGIN_API_VERSION``: the plugin API this was written for (mcore refuses another major).
2. A backend object satisfying :class:`mcore.backend.DeviceBackend` (here a subclass of
   :class:`mcore.backend.BackendBase`): name, device type, torch.distributed backend, priority,
   availability with a reason, RNG, memory statistics, capabilities.
3. Hook implementations (``@hookimpl``): ``mcore_backends`` supplies the backend object,
   ``mcore_register_ops`` overrides ops of the table for it.
4. The entry point in ``pyproject.toml`` (group ``mcore.backends``) that makes mcore find it.

This backend computes on the CPU and communicates with gloo; its priority is below the built-in CPU
backend's, so ``--device-backend auto`` never picks it: select it by name
(``--device-backend example``).
"""

from __future__ import annotations

import os

import torch

from mcore.backend import BackendBase
from mcore.plugins import hookimpl

MCORE_PLUGIN_API_VERSION = "1.0"
NAME = "example"


class ExampleBackend(BackendBase):
    name = NAME
    device_type = "cpu"
    dist_backend = "gloo"
    priority = -10  # below mcore's cpu backend: never the ``auto`` choice
    _capabilities = frozenset({"fp32", "bf16", "fp16", "fused_rms_norm", "fused_swiglu", "flash_attention"})

    def is_available(self) -> tuple[bool, str]:
        return True, f"example backend on the CPU ({os.cpu_count()} cores)"

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
        return {"allocated": 0, "reserved": 0, "peak_allocated": 0}

    def reset_peak_memory_stats(self) -> None:
        pass


@hookimpl
def mcore_backends():
    return [ExampleBackend()]


@hookimpl
def mcore_register_ops(backend, registry):
    if backend.name != NAME:  # override ops only for the backend this plugin serves
        return
    from mcore_example_backend import ops

    for op_name, fn in ops.EXAMPLE_OPS.items():
        registry.override(op_name, fn, provider=NAME)
