"""Megatron-style phase timers: ``--timing-log-level``, ``--timing-log-option``, ``--log-timers-to-tensorboard``.

A timer measures the wall time of one phase of the training step, summed over the iterations of a
log interval. Each timer has a level; it runs only when ``--timing-log-level`` is at least that level
(the others cost nothing):

======================  =====  ============================================================
name                    level  what
======================  =====  ============================================================
``forward-backward``    1      the pipeline schedule: every micro-batch's forward and backward
``optimizer``           1      the optimizer step (unscale, clip, update, parameter gather)
``batch-generator``     2      taking the next micro-batch from the data iterator
======================  =====  ============================================================

A running timer waits for the device at start and stop (``backend.synchronize``), so that it counts the
device work of its phase, not only the time to queue it; that is why level 0, the default, runs no
timer at all: the training step then never waits for the device between log intervals.

At a log interval every rank reports its times (one all-gather over the world) and the logging rank
prints them as Megatron does, per iteration, in milliseconds::

    (min, max) time across ranks (ms):
        forward-backward ...............................: (41.23, 42.01)
        optimizer ......................................: (3.10, 3.22)

With ``--log-timers-to-tensorboard`` the maximum over ranks goes to TensorBoard as ``<name>-time``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

TIMER_LEVELS = {"forward-backward": 1, "optimizer": 1, "batch-generator": 2}
"""Every timer the training loop runs, and the ``--timing-log-level`` that turns it on."""


class _Timer:
    def __init__(self, synchronize: Callable[[], None]):
        self._synchronize = synchronize
        self.elapsed = 0.0
        self.ran = False
        self._start: float | None = None

    def start(self) -> None:
        self._synchronize()
        self._start = time.perf_counter()

    def stop(self) -> None:
        self._synchronize()
        self.elapsed += time.perf_counter() - self._start
        self._start = None
        self.ran = True


class Timers:
    """Named phase timers; ``timers("optimizer")`` is a context manager that times the phase when its
    level (:data:`TIMER_LEVELS`) is at most ``log_level``, and does nothing otherwise."""

    def __init__(
        self, log_level: int = 0, log_option: str = "minmax", synchronize: Callable[[], None] = None
    ):
        self.log_level, self.log_option = log_level, log_option
        self._synchronize = synchronize or (lambda: None)
        self._timers: dict[str, _Timer] = {}

    def active(self, name: str) -> bool:
        return TIMER_LEVELS[name] <= self.log_level

    @contextlib.contextmanager
    def __call__(self, name: str):
        if not self.active(name):
            yield
            return
        timer = self._timers.setdefault(name, _Timer(self._synchronize))
        timer.start()
        try:
            yield
        finally:
            timer.stop()

    def wrap_iterator(self, iterator, name: str = "batch-generator"):
        """``iterator`` (or each of a list of them, one per model chunk) with ``next`` timed as ``name``."""
        if iterator is None or not self.active(name):
            return iterator
        if isinstance(iterator, list):
            return [self.wrap_iterator(it, name) for it in iterator]
        return _TimedIterator(iterator, self, name)

    def names(self) -> list[str]:
        """The timers this job runs, in :data:`TIMER_LEVELS` order (the same on every rank)."""
        return [name for name in TIMER_LEVELS if self.active(name)]

    def collect(self, iterations: int, device: torch.device) -> dict[str, list[float | None]]:
        """Every rank's time per iteration (ms) of each timer since the last call, then reset.

        A collective over the world when any timer is on (every rank calls it at the same iterations).
        A rank where a timer did not run (a middle pipeline stage reads no data) reports None for it.
        """
        names = self.names()
        if not names:
            return {}
        local = torch.tensor(
            [
                1000.0 * t.elapsed / max(iterations, 1) if (t := self._timers.get(n)) and t.ran else -1.0
                for n in names
            ],
            dtype=torch.float64,
        ).to(device)
        for timer in self._timers.values():
            timer.elapsed, timer.ran = 0.0, False
        if dist.is_initialized() and dist.get_world_size() > 1:
            rows = [torch.empty_like(local) for _ in range(dist.get_world_size())]
            dist.all_gather(rows, local)
        else:
            rows = [local]
        table = torch.stack(rows).cpu().tolist()  # [rank][timer]
        return {name: [row[i] if row[i] >= 0 else None for row in table] for i, name in enumerate(names)}


class _TimedIterator:
    def __init__(self, iterator: Iterator, timers: Timers, name: str):
        self._iterator, self._timers, self._name = iterator, timers, name

    def __iter__(self):
        return self

    def __next__(self):
        with self._timers(self._name):
            return next(self._iterator)


def format_timers(times: dict[str, list[float | None]], option: str = "minmax") -> str | None:
    """Megatron's timer block (``--timing-log-option max | minmax | all``); None without timers."""
    if not times:
        return None
    header = {
        "max": "max time across ranks (ms):",
        "minmax": "(min, max) time across ranks (ms):",
        "all": "times across all ranks (ms):",
    }[option]
    lines = [header]
    for name, per_rank in times.items():
        ran = [v for v in per_rank if v is not None]
        if not ran:
            continue
        label = (name + " ").ljust(48, ".")
        if option == "max":
            lines.append(f"    {label}: {max(ran):.2f}")
        elif option == "minmax":
            lines.append(f"    {label}: ({min(ran):.2f}, {max(ran):.2f})")
        else:
            values = ", ".join("-" if v is None else f"{v:.2f}" for v in per_rank)
            lines.append(f"    {label}: {values}")
    return "\n".join(lines)


def timer_scalars(times: dict[str, list[float | None]]) -> dict[str, float]:
    """``{"<name>-time": max over ranks (ms)}``: Megatron's TensorBoard tags for the timers."""
    out = {}
    for name, per_rank in times.items():
        ran = [v for v in per_rank if v is not None]
        if ran:
            out[f"{name}-time"] = max(ran)
    return out
