"""An example mcore device-backend plugin: the template for a third party's accelerator.

Everything a plugin needs is in this module:

1. ``MCORE_PLUGIN_API_VERSION``: the plugin API this was written for (mcore refuses another major).
2. A backend object satisfying :class:`mcore.backend.DeviceBackend`: name, device type,
   torch.distributed backend, priority, availability with a reason, RNG, memory statistics,
   capabilities, and its own set-up methods (:class:`mcore.backend.BackendHooks`): here
   ``register_ops``, which replaces ops of the table with this plugin's kernels. mcore calls these
   methods for this backend only, when it is selected.
3. One hook implementation (``@hookimpl``): ``mcore_backends`` supplies the backend object.
4. The entry point in ``pyproject.toml`` (group ``mcore.backends``) that makes mcore find it.

This backend computes on the host, so it subclasses :class:`mcore.backend.CPUBackend` (the core's
default backend, whose RNG and memory methods work for CPU tensors; a device backend subclasses
:class:`mcore.backend.BackendBase` instead). Its priority is below the built-in CPU backend's, so
``--device-backend auto`` never picks it: select it by name (``--device-backend example``).
"""

from __future__ import annotations

import os

from mcore.backend import CPUBackend
from mcore.plugins import hookimpl

MCORE_PLUGIN_API_VERSION = "1.2"
NAME = "example"


class ExampleBackend(CPUBackend):
    name = NAME
    priority = -10  # below mcore's cpu backend: never the ``auto`` choice
    _capabilities = frozenset({"fp32", "bf16", "fp16", "fused_rms_norm", "fused_swiglu", "flash_attention"})

    def is_available(self) -> tuple[bool, str]:
        return True, f"example backend on the CPU ({os.cpu_count()} cores)"

    def register_ops(self, registry) -> None:
        """Serve three ops with this plugin's kernels; the rest stay mcore's reference ops."""
        from mcore_example_backend import ops

        for op_name, fn in ops.EXAMPLE_OPS.items():
            registry.override(op_name, fn, provider=NAME)


@hookimpl
def mcore_backends():
    return [ExampleBackend()]
