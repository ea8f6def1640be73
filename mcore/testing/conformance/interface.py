"""The backend interface checks: the :class:`~mcore.backend.DeviceBackend` protocol's attributes and
methods, the optional interfaces behind claimed capabilities, the device RNG (and the tensor-parallel
RNG tracker on it), and ``memory_stats()``."""

from __future__ import annotations

import torch

from mcore.backend import BackendBase, DeviceBackend
from mcore.ops.registry import OP_NAMES
from mcore.testing.conformance.compare import ConformanceError


def check_interface(backend: DeviceBackend) -> None:
    """The protocol's attributes and methods, and the device placement of new tensors."""
    if not isinstance(backend, DeviceBackend):
        raise ConformanceError(f"{backend!r} does not satisfy mcore.backend.DeviceBackend")
    for attr, kind in (("name", str), ("device_type", str), ("dist_backend", str), ("priority", int)):
        if not isinstance(getattr(backend, attr), kind):
            raise ConformanceError(f"{backend.name}.{attr} must be a {kind.__name__}")
    ok, why = backend.is_available()
    if not (ok is True and isinstance(why, str) and why):
        raise ConformanceError(f"is_available() must return (True, reason) here, got {(ok, why)!r}")
    device = backend.device(0)
    if not isinstance(device, torch.device) or device.type != torch.device(backend.device_type).type:
        raise ConformanceError(f"device(0) = {device!r} does not have device_type {backend.device_type!r}")
    backend.set_device(0)
    backend.synchronize()
    caps = backend.capabilities()
    if not isinstance(caps, frozenset) or not all(isinstance(c, str) for c in caps):
        raise ConformanceError(f"capabilities() must be a frozenset of str, got {caps!r}")
    missing = [name for name in OP_NAMES if not callable(getattr(backend.ops, name, None))]
    if missing:
        raise ConformanceError(f"op table lacks {missing}")
    for dtype in (torch.bfloat16, torch.float16):
        peak = backend.peak_flops(dtype)
        if peak is not None and not (isinstance(peak, float) and peak > 0):
            raise ConformanceError(f"peak_flops({dtype}) must be None or a positive float, got {peak!r}")
    if torch.ones(2, device=device).device.type != device.type:
        raise ConformanceError(f"tensors created on {device} land elsewhere")
    check_optional_interfaces(backend)


OPTIONAL_INTERFACES: dict[str, tuple[str, ...]] = {
    "compile_layers": ("compile_layer",),
    "device_graphs": ("graph", "graph_pool", "side_stream"),
}
"""Capability -> the methods a backend claiming it implements (:class:`mcore.backend.LayerCompiler`,
:class:`mcore.backend.DeviceGraphs`)."""

_DEFAULTS_THAT_REFUSE = ("compile_layer", "graph")
"""Methods whose :class:`~mcore.backend.BackendBase` default raises: a claim needs an override."""


def check_optional_interfaces(backend: DeviceBackend) -> None:
    """A claimed capability comes with its methods; the per-backend set-up methods, where present,
    are callable (:class:`mcore.backend.BackendHooks`)."""
    caps = backend.capabilities()
    for capability, methods in OPTIONAL_INTERFACES.items():
        if capability not in caps:
            continue
        for method in methods:
            impl = getattr(type(backend), method, None)
            if not callable(getattr(backend, method, None)) or (
                method in _DEFAULTS_THAT_REFUSE and impl is getattr(BackendBase, method)
            ):
                raise ConformanceError(
                    f"{backend.name} claims capability {capability!r} but does not implement {method}()"
                )
    for method in ("register_ops", "on_activate", "configure", "process_group_options", "on_shutdown"):
        if hasattr(backend, method) and not callable(getattr(backend, method)):
            raise ConformanceError(f"{backend.name}.{method} must be a method (mcore.backend.BackendHooks)")


def check_rng(backend: DeviceBackend) -> None:
    """Device RNG: state round-trip, seeding, and the TP tracker's streams on top of it."""
    from mcore.tensor_parallel.random import RNGStatesTracker

    device = backend.device(0)
    backend.manual_seed(1234)
    state = backend.get_rng_state()
    if not (isinstance(state, torch.Tensor) and state.device.type == "cpu" and state.dtype == torch.uint8):
        raise ConformanceError("get_rng_state() must return a CPU uint8 tensor (a ByteTensor)")
    first = torch.rand(64, device=device)
    backend.set_rng_state(state)
    if not torch.equal(torch.rand(64, device=device), first):
        raise ConformanceError("set_rng_state(get_rng_state()) does not replay the same random numbers")
    backend.manual_seed(1234)
    if not torch.equal(torch.rand(64, device=device), first):
        raise ConformanceError("manual_seed(s) does not reproduce the stream of seed s")
    backend.manual_seed(4321)
    if torch.equal(torch.rand(64, device=device), first):
        raise ConformanceError("manual_seed with another seed gave the same random numbers")

    tracker = RNGStatesTracker(backend)
    backend.manual_seed(7)
    tracker.add("stream", 99)
    before = backend.get_rng_state()
    with tracker.fork("stream"):
        inside = torch.rand(16, device=device)
    if not torch.equal(backend.get_rng_state(), before):
        raise ConformanceError("the RNG tracker's fork() did not restore the default stream")
    with tracker.fork("stream"):
        again = torch.rand(16, device=device)
    if torch.equal(inside, again):
        raise ConformanceError("a tracker stream did not advance between forks")
    backend.manual_seed(99)
    if not torch.equal(torch.rand(16, device=device), inside):
        raise ConformanceError("a tracker stream seeded with s must draw what manual_seed(s) draws")


def check_memory_stats(backend: DeviceBackend) -> None:
    """``memory_stats()`` keys and invariants; ``reset_peak_memory_stats()`` works."""
    keep = torch.empty(1 << 20, device=backend.device(0))
    stats = backend.memory_stats()
    required = {"allocated", "reserved", "peak_allocated"}
    if not required <= set(stats):
        raise ConformanceError(f"memory_stats() lacks {sorted(required - set(stats))}")
    for key in required:
        if not (isinstance(stats[key], int) and stats[key] >= 0):
            raise ConformanceError(f"memory_stats()[{key!r}] must be a non-negative int, got {stats[key]!r}")
    if stats["peak_allocated"] < stats["allocated"]:
        raise ConformanceError(f"peak_allocated {stats['peak_allocated']} < allocated {stats['allocated']}")
    if stats["allocated"] and stats["reserved"] < stats["allocated"]:
        raise ConformanceError(f"reserved {stats['reserved']} < allocated {stats['allocated']}")
    backend.reset_peak_memory_stats()
    after = backend.memory_stats()
    if after["peak_allocated"] < after["allocated"]:
        raise ConformanceError("after reset_peak_memory_stats(), peak_allocated < allocated")
    del keep
