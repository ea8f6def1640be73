"""The device backend: the one object through which the core reaches hardware.

A backend plugin supplies an object that satisfies :class:`DeviceBackend`. The core asks it for the
device of a local rank, the torch.distributed backend name, RNG state, memory statistics, peak FLOP/s
and capabilities, and calls kernels through its op table (``backend.ops``). The core asks for
capabilities (``"bf16" in backend.capabilities()``), never for vendor names.

:class:`BackendBase` implements the parts every backend shares on top of ``torch.get_device_module``,
so a plugin for a PyTorch device type (``cuda``, ``npu``, ``xpu``, a PrivateUse1 device) is a few lines.

The active backend is process state (like ``torch.distributed``'s default group): set once by
:func:`mcore.plugins.manager.select_backend`, read through :func:`current_backend` and
:func:`get_ops`. Before any selection the CPU backend with the reference ops is active, so
single-device code and tests work without set-up.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from mcore.ops.registry import OpTable, reference_table


@runtime_checkable
class DeviceBackend(Protocol):
    """What the core needs from a device backend."""

    name: str
    """Name used by ``--device-backend`` (``"cpu"``, ``"cuda"``, ``"npu"``, a plugin's name)."""
    device_type: str
    """torch device type of tensors (``"cpu"``, ``"cuda"``, ``"npu"``)."""
    dist_backend: str
    """torch.distributed backend name (gloo, or the vendor's collective library)."""
    priority: int
    """``auto`` picks the available backend with the highest priority (accelerators above cpu)."""
    ops: OpTable
    """The resolved op table (reference ops plus this backend's overrides)."""

    def is_available(self) -> tuple[bool, str]:
        """``(True, why)`` if this process can use the backend, else ``(False, reason)``."""

    def device(self, local_rank: int = 0) -> torch.device:
        """The device this local rank computes on."""

    def set_device(self, local_rank: int) -> None:
        """Make the local rank's device current (before process groups are created)."""

    def synchronize(self) -> None:
        """Wait for all queued work on the current device."""

    def manual_seed(self, seed: int) -> None:
        """Seed the device RNG of the current device."""

    def get_rng_state(self) -> torch.Tensor:
        """The device RNG state (a CPU ByteTensor)."""

    def set_rng_state(self, state: torch.Tensor) -> None:
        """Restore a state returned by :meth:`get_rng_state`."""

    def memory_stats(self) -> dict[str, int]:
        """Bytes: ``allocated``, ``reserved``, ``peak_allocated`` (zeros where unknown); optionally
        ``peak_reserved``."""

    def reset_peak_memory_stats(self) -> None:
        """Restart ``peak_allocated`` from the current allocation."""

    def capabilities(self) -> frozenset[str]:
        """Feature strings such as ``bf16``, ``fp16``, ``fused_rms_norm``, ``flash_attention``."""

    def peak_flops(self, dtype: torch.dtype) -> float | None:
        """Dense peak FLOP/s of one device for ``dtype`` matmuls (for MFU), or None if unknown."""


class BackendBase:
    """Shared implementation for backends of a torch device type with a ``torch.<type>`` module."""

    name: str = ""
    device_type: str = "cpu"
    dist_backend: str = "gloo"
    priority: int = 0
    _capabilities: frozenset[str] = frozenset()

    def __init__(self) -> None:
        self.ops: OpTable = reference_table()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} device={self.device_type} dist={self.dist_backend}>"

    def _module(self) -> Any:
        return torch.get_device_module(self.device_type)

    def is_available(self) -> tuple[bool, str]:
        module = getattr(torch, self.device_type, None)
        if module is None or not module.is_available():
            return False, f"torch reports no {self.device_type} device"
        return True, f"{module.device_count()} {self.device_type} device(s)"

    def device(self, local_rank: int = 0) -> torch.device:
        return torch.device(self.device_type, local_rank % max(1, self._module().device_count()))

    def set_device(self, local_rank: int) -> None:
        self._module().set_device(self.device(local_rank))

    def synchronize(self) -> None:
        self._module().synchronize()

    def manual_seed(self, seed: int) -> None:
        self._module().manual_seed(seed)

    def get_rng_state(self) -> torch.Tensor:
        return self._module().get_rng_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        self._module().set_rng_state(state)

    def memory_stats(self) -> dict[str, int]:
        module = self._module()
        return {
            "allocated": int(module.memory_allocated()),
            "reserved": int(module.memory_reserved()),
            "peak_allocated": int(module.max_memory_allocated()),
            "peak_reserved": int(getattr(module, "max_memory_reserved", lambda: 0)()),
        }

    def reset_peak_memory_stats(self) -> None:
        self._module().reset_peak_memory_stats()

    def capabilities(self) -> frozenset[str]:
        return self._capabilities

    def peak_flops(self, dtype: torch.dtype) -> float | None:
        return None


_current: DeviceBackend | None = None


def current_backend() -> DeviceBackend:
    """The selected backend; the CPU backend with reference ops until one is selected."""
    global _current
    if _current is None:
        from mcore.backends.cpu import CPUBackend

        _current = CPUBackend()
    return _current


def set_current_backend(backend: DeviceBackend | None) -> DeviceBackend | None:
    """Make ``backend`` the active one (``None`` resets to the default); returns the previous one."""
    global _current
    previous, _current = _current, backend
    return previous


def get_ops() -> OpTable:
    """The active op table. Layers call kernels through it: ``get_ops().rms_norm(x, w, eps)``."""
    return current_backend().ops
