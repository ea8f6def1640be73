"""Tensor-parallel-aware RNG streams, built on the device backend's RNG state.

Dropout on a *replicated* activation must draw the same mask on every tensor-parallel rank, and
dropout on a *split* activation (attention heads, sequence-parallel shards) must draw different masks
on each. So there are two streams, as in Megatron:

* the default stream, seeded ``seed + 100 * pp_rank``: identical across tp ranks;
* the ``"model-parallel-rng"`` stream, seeded ``seed + 2718 + 100 * pp_rank + tp_rank``: different on
  every tp rank. Code that drops out split activations runs inside ``tracker.fork()``.

Weight initialization does not use these streams: every tensor is drawn whole from its own seeded
generator (see :mod:`mcore.tensor_parallel.sharding`), so weights do not depend on the layout.
"""

from __future__ import annotations

import contextlib
import random

import numpy as np
import torch

from mcore.backend import DeviceBackend, current_backend

MODEL_PARALLEL_RNG = "model-parallel-rng"
_TENSOR_PARALLEL_SEED_OFFSET = 2718


class RNGStatesTracker:
    """Named device-RNG states that code can switch into with :meth:`fork`.

    ``fork(name)`` saves the current device RNG state, installs the stream's state, runs the block,
    stores the advanced stream state and restores the original, so the default stream is untouched.
    """

    def __init__(self, backend: DeviceBackend | None = None):
        self.backend = backend or current_backend()
        self._states: dict[str, torch.Tensor] = {}
        self._seeds: set[int] = set()

    def reset(self) -> None:
        self._states.clear()
        self._seeds.clear()

    def add(self, name: str, seed: int) -> None:
        if seed in self._seeds:
            raise ValueError(f"seed {seed} already used by another RNG stream")
        if name in self._states:
            raise ValueError(f"RNG stream {name!r} already exists")
        self._seeds.add(seed)
        saved = self.backend.get_rng_state()
        self.backend.manual_seed(seed)
        self._states[name] = self.backend.get_rng_state()
        self.backend.set_rng_state(saved)

    def get_states(self) -> dict[str, torch.Tensor]:
        return {name: state.clone() for name, state in self._states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._states = {name: state.clone() for name, state in states.items()}

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        if name not in self._states:
            raise KeyError(f"RNG stream {name!r} was never added (call model_parallel_seed first)")
        saved = self.backend.get_rng_state()
        self.backend.set_rng_state(self._states[name])
        try:
            yield
        finally:
            self._states[name] = self.backend.get_rng_state()
            self.backend.set_rng_state(saved)


_tracker: RNGStatesTracker | None = None


def get_rng_tracker() -> RNGStatesTracker:
    """The process's tracker (one per process, like the device RNG it wraps)."""
    global _tracker
    if _tracker is None or _tracker.backend is not current_backend():
        _tracker = RNGStatesTracker()
    return _tracker


def model_parallel_seed(seed: int, tp_rank: int = 0, pp_rank: int = 0) -> RNGStatesTracker:
    """Seed Python, numpy, torch and the device, and set up the tensor-parallel stream."""
    backend = current_backend()
    stage_seed = seed + 100 * pp_rank
    random.seed(stage_seed)
    np.random.seed(stage_seed)
    torch.manual_seed(stage_seed)
    backend.manual_seed(stage_seed)
    tracker = get_rng_tracker()
    tracker.reset()
    tracker.add(MODEL_PARALLEL_RNG, stage_seed + _TENSOR_PARALLEL_SEED_OFFSET + tp_rank)
    return tracker


def get_all_rng_states() -> dict:
    """Every RNG state a resumed run needs (Python, numpy, torch, device, tracker)."""
    return {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "device": current_backend().get_rng_state(),
        "tracker": get_rng_tracker().get_states(),
    }


def set_all_rng_states(states: dict) -> None:
    random.setstate(states["random"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    current_backend().set_rng_state(states["device"])
    get_rng_tracker().set_states(states["tracker"])
