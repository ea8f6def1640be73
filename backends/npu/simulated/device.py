"""SIMULATED ``torch.npu`` device module: the torch_npu runtime API (device, streams, RNG, memory), on the CPU.

Simulated "NPU" tensors are ordinary CPU tensors (an in-process double cannot give PrivateUse1 real
kernels), so the RNG functions drive the CPU generator: that is the generator dropout on those
tensors draws from, which keeps the TP RNG tracker's save/fork/restore meaningful. Memory functions
return the CUDA-style statistics with zero bytes (the CPU allocator keeps none). The chip is
"Ascend910B2" (bf16 supported) unless :func:`mcore.backends.npu.simulated.install` is asked for a
910A, which has no bf16.
"""

from __future__ import annotations

import contextlib
import inspect
import types
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

_MEMORY_KEYS = (
    "allocated_bytes.all.current",
    "allocated_bytes.all.peak",
    "reserved_bytes.all.current",
    "reserved_bytes.all.peak",
    "active_bytes.all.current",
    "active_bytes.all.peak",
    "segment.all.current",
    "segment.all.peak",
)


@dataclass
class SimulatedNPUState:
    """What the simulated runtime remembers (inspected by tests)."""

    chip: str = "Ascend910B2"
    device_count: int = 8
    current_device: int = 0
    jit_compile: bool = False
    options: dict = field(default_factory=dict)
    synchronize_calls: int = 0
    transfer_to_npu_touched: bool = False

    @property
    def bf16(self) -> bool:
        return not self.chip.startswith("Ascend910A") and self.chip != "Ascend910"


def _index(state: SimulatedNPUState, device=None) -> int:
    if device is None:
        return state.current_device
    if isinstance(device, int):
        return device
    if isinstance(device, torch.device):
        return state.current_device if device.index is None else device.index
    text = str(device)
    if text in ("npu", "cpu"):
        return state.current_device
    if text.startswith("npu:"):
        return int(text.split(":", 1)[1])
    raise RuntimeError(f"simulated torch.npu: invalid device {device!r}")


class _Config:
    """``torch.npu.config``: write-only options, as the real ``_npuConfig`` is."""

    def __init__(self, state: SimulatedNPUState):
        object.__setattr__(self, "_state", state)

    def __setattr__(self, name, value):
        if name == "allow_internal_format":
            self._state.options["ALLOW_INTERNAL_FORMAT"] = "enable" if value else "disable"
            return
        raise AttributeError(f"simulated torch.npu.config has no option {name!r}")


class Stream:
    """A simulated stream: work on CPU tensors is already synchronous."""

    def __init__(self, device=None, priority: int = 0):
        self.device = device
        self.priority = priority

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def record_event(self, event=None):
        event = event or Event()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class Event:
    """A simulated event; ``elapsed_time`` measures host time between records (ms)."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.enable_timing = enable_timing
        self._time: float | None = None

    def record(self, stream=None) -> None:
        import time

        self._time = time.perf_counter()

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end_event: Event) -> float:
        if self._time is None or end_event._time is None:
            raise RuntimeError("simulated Event.elapsed_time: both events must be recorded")
        return (end_event._time - self._time) * 1000.0


def _functions(namespace: dict) -> dict[str, Callable]:
    """The functions defined in a builder below (its ``locals()``), by name: each becomes ``torch.npu.<name>``."""
    return {name: fn for name, fn in namespace.items() if inspect.isfunction(fn)}


def _device_functions(state: SimulatedNPUState) -> dict[str, Callable]:
    """Availability, the current device (and its context manager), synchronisation, device properties."""

    def is_available() -> bool:
        return state.device_count > 0

    def device_count() -> int:
        return state.device_count

    def set_device(device) -> None:
        index = _index(state, device)
        if index < 0:
            return
        if index >= state.device_count:
            raise RuntimeError(f"simulated torch.npu.set_device: invalid device {index}")
        state.current_device = index

    def current_device() -> int:
        return state.current_device

    @contextlib.contextmanager
    def device(index):
        previous = state.current_device
        set_device(index)
        try:
            yield
        finally:
            state.current_device = previous

    def synchronize(device=None) -> None:
        state.synchronize_calls += 1

    def get_device_name(device=None) -> str:
        return state.chip

    def get_device_properties(device=None):
        return types.SimpleNamespace(name=state.chip, total_memory=64 * 2**30)

    def is_bf16_supported(including_emulation: bool = False) -> bool:
        return state.bf16

    def _lazy_init() -> None:
        pass

    return _functions(locals())


def _rng_functions(state: SimulatedNPUState) -> dict[str, Callable]:
    """The device RNG: CPU's default generator stands in for every simulated device's."""

    def get_rng_state(device="npu") -> torch.Tensor:
        _index(state, device)
        return torch.get_rng_state()

    def set_rng_state(new_state: torch.Tensor, device="npu") -> None:
        _index(state, device)
        torch.set_rng_state(new_state)

    def get_rng_state_all() -> list[torch.Tensor]:
        return [torch.get_rng_state() for _ in range(state.device_count)]

    def set_rng_state_all(new_states) -> None:
        torch.set_rng_state(list(new_states)[state.current_device])

    def manual_seed(seed: int) -> None:
        torch.default_generator.manual_seed(int(seed))

    def initial_seed() -> int:
        return torch.default_generator.initial_seed()

    return _functions(locals())


def _memory_functions(state: SimulatedNPUState) -> dict[str, Callable]:
    """Allocator statistics (all zero: the tensors live in host memory) and a 64 GiB device."""

    def memory_stats(device=None) -> dict[str, int]:
        _index(state, device)
        return dict.fromkeys(_MEMORY_KEYS, 0)

    def memory_allocated(device=None) -> int:
        return memory_stats(device)["allocated_bytes.all.current"]

    def max_memory_allocated(device=None) -> int:
        return memory_stats(device)["allocated_bytes.all.peak"]

    def memory_reserved(device=None) -> int:
        return memory_stats(device)["reserved_bytes.all.current"]

    def max_memory_reserved(device=None) -> int:
        return memory_stats(device)["reserved_bytes.all.peak"]

    def reset_peak_memory_stats(device=None) -> None:
        _index(state, device)

    def memory_summary(device=None, abbreviated: bool = False) -> str:
        return "simulated NPU: no allocator statistics"

    def mem_get_info(device=None) -> tuple[int, int]:
        total = 64 * 2**30
        return total, total

    def empty_cache() -> None:
        pass

    return _functions(locals())


def _option_functions(state: SimulatedNPUState) -> dict[str, Callable]:
    """The compile mode and the CANN options, recorded in ``state``."""

    def set_compile_mode(jit_compile: bool = False) -> None:
        state.jit_compile = bool(jit_compile)
        state.options["jitCompile"] = "enable" if jit_compile else "disable"

    def is_jit_compile_false() -> bool:
        return not state.jit_compile

    def set_option(options: dict) -> None:
        state.options.update(options)

    return _functions(locals())


def _stream_functions(state: SimulatedNPUState) -> dict[str, Callable]:
    """Streams: every one is the host's single in-order stream."""

    def current_stream(device=None) -> Stream:
        return Stream(device)

    def default_stream(device=None) -> Stream:
        return Stream(device)

    @contextlib.contextmanager
    def stream(s):
        yield s

    def set_stream(s) -> None:
        pass

    return _functions(locals())


def build_device_module(state: SimulatedNPUState) -> types.ModuleType:
    """A fresh ``torch_npu.npu`` module bound to ``state``."""
    npu = types.ModuleType("torch_npu.npu", "SIMULATED torch.npu device module (CPU test double).")
    for group in (_device_functions, _rng_functions, _memory_functions, _option_functions, _stream_functions):
        for name, fn in group(state).items():
            setattr(npu, name, fn)
    npu.manual_seed_all = npu.manual_seed
    npu.seed = lambda: torch.default_generator.seed()
    npu.seed_all = npu.seed
    npu.default_generators = (torch.default_generator,)
    npu.Stream = Stream
    npu.Event = Event
    npu.config = _Config(state)
    npu.matmul = types.SimpleNamespace(allow_hf32=False)
    npu.conv = types.SimpleNamespace(allow_hf32=True)
    npu.SIMULATED = True
    npu._simulation = state
    return npu
