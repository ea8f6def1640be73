"""The device backend: the one object through which the core reaches hardware.

A backend plugin supplies an object that satisfies :class:`DeviceBackend`. The core asks it for the
device of a local rank, the torch.distributed backend name, RNG state, memory statistics, peak FLOP/s
and capabilities, and calls kernels through its op table (``backend.ops``). The core asks for
capabilities (``"bf16" in backend.capabilities()``), never for vendor names.

:class:`BackendBase` implements the parts every backend shares on top of ``torch.get_device_module``,
so a plugin for a PyTorch device type (``cuda``, ``npu``, ``xpu``, a PrivateUse1 device) is a few lines.
:class:`CPUBackend` is the default backend, part of the core: it computes on the host with the
reference ops and gloo; a backend whose tensors live on the host (a simulator, a tracer) subclasses it.

Beyond :class:`DeviceBackend`, a backend may offer optional interfaces, each behind a capability
string the core checks before calling it (:class:`LayerCompiler`: ``compile_layers``;
:class:`DeviceGraphs`: ``device_graphs``), and per-backend set-up methods (:class:`BackendHooks`)
that mcore calls for the selected backend only. :class:`BackendBase` gives every one of them a
documented default, so a subclass overrides only what it does differently.

The active backend is process state (like ``torch.distributed``'s default group): set once by
:func:`mcore.plugins.manager.select_backend`, read through :func:`current_backend` and
:func:`get_ops`. Before any selection the CPU backend with the reference ops is active, so
single-device code and tests work without set-up.
"""

from __future__ import annotations

import contextlib
import os
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


@runtime_checkable
class LayerCompiler(Protocol):
    """Optional, behind capability ``compile_layers`` (``--compile-layers``)."""

    def compile_layer(self, module: torch.nn.Module, **kwargs: Any) -> torch.nn.Module:
        """Compile one transformer layer in place and return it. Default (:class:`BackendBase`):
        raise ``NotImplementedError``; the core asks for the capability first."""


@runtime_checkable
class DeviceGraphs(Protocol):
    """Optional, behind capability ``device_graphs`` (``--cuda-graph-impl local``,
    :mod:`mcore.models.transformer.layer_graphs`)."""

    def graph(self) -> Any:
        """A new graph: ``with g.capture(pool): ...`` records the device work, ``g.replay()`` launches
        it again. Default: raise ``NotImplementedError``."""

    def graph_pool(self) -> Any:
        """A memory-pool handle that several captures share (passed to ``capture``). Default: None."""

    def side_stream(self) -> contextlib.AbstractContextManager:
        """A context manager running its work on a fresh stream (the warm-up before a capture).
        Default: a context that changes nothing."""


@runtime_checkable
class BackendHooks(Protocol):
    """Per-backend set-up, called by mcore for the selected backend only (never broadcast).

    Each method runs right before the pluggy hook of the same moment (:mod:`mcore.plugins.hookspecs`),
    which stays for plugins that act on every backend (a tracer wrapping ops, a profiler). A backend
    without these methods (one that implements only :class:`DeviceBackend`) is treated as having the
    defaults of :class:`BackendBase`, which do nothing.
    """

    def register_ops(self, registry: Any) -> None:
        """Replace ops of the table (``registry.override(name, fn, provider=...)``), before any
        ``mcore_register_ops`` hook. Default: none (the reference ops)."""

    def on_activate(self) -> None:
        """This backend became the current one (before ``mcore_backend_activated``); idempotent."""

    def configure(self, configs: dict[str, Any]) -> None:
        """Check the run's frozen configs (raise ``ConfigError`` naming the value) and set process
        settings that must precede torch.distributed (before ``mcore_configure``). Default: nothing."""

    def process_group_options(self, axis: str) -> Any:
        """``pg_options`` for the groups of ``axis`` (``"world"``, ``"tp"``, ...), or None for the
        defaults; a non-None answer wins over ``mcore_process_group_options``. Default: None."""

    def on_shutdown(self) -> None:
        """The run is over (before ``mcore_on_shutdown``): release what the backend holds."""


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

    # --- optional interfaces: defaults for a backend without the capability --------------------

    def compile_layer(self, module: torch.nn.Module, **kwargs: Any) -> torch.nn.Module:
        raise NotImplementedError(
            f"backend {self.name!r} cannot compile layers (capability 'compile_layers')"
        )

    def graph(self) -> Any:
        raise NotImplementedError(f"backend {self.name!r} has no device graphs (capability 'device_graphs')")

    def graph_pool(self) -> Any:
        return None

    def side_stream(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    # --- per-backend set-up (BackendHooks): nothing by default ----------------------------------

    def register_ops(self, registry: Any) -> None:
        pass

    def on_activate(self) -> None:
        pass

    def configure(self, configs: dict[str, Any]) -> None:
        pass

    def process_group_options(self, axis: str) -> Any:
        return None

    def on_shutdown(self) -> None:
        pass


class CPUBackend(BackendBase):
    """The default backend: the host CPU, gloo, the reference ops; always available.

    The whole test suite, multi-process TP/PP/DP included, runs on it. A backend whose tensors live on
    the host (a simulator, a tracer, a CPU kernel library) subclasses it: :class:`BackendBase`'s RNG
    and memory methods go through ``torch.get_device_module(device_type)``, which has no RNG or
    memory statistics for ``"cpu"``; these overrides use torch's global CPU generator instead.
    """

    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    priority = 0
    # fp8 / fp8_rowwise / fp8_grouped_gemm (the experts' scaled grouped GEMM): emulated by the reference
    # ops (quantize, dequantize, fp32 matmul), so the CPU suite runs the FP8 code paths; slower than
    # bf16 here, never faster.
    _capabilities = frozenset({"bf16", "fp16", "fp32", "fp8", "fp8_rowwise", "fp8_grouped_gemm"})

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


_current: DeviceBackend | None = None


def current_backend() -> DeviceBackend:
    """The selected backend; the CPU backend with reference ops until one is selected."""
    global _current
    if _current is None:
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
