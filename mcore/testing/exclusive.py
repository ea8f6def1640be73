"""Tests that must run while no other test runs, when pytest-xdist runs the suite in several workers.

A test that times something or waits on a deadline (a heartbeat noticed within seconds, three
iterations logged before a bound, a save before torchrun's 30 s grace period ends) is only as reliable
as the CPU it gets. Serially it has the machine to itself; with two xdist workers on the 2-core CI
machine, a four-rank test of the other worker could take its share. Such tests carry the ``exclusive``
mark (``tests/conftest.py`` also names whole files), and the workers share a readers-writer lock:

- every other test holds the lock shared while it runs (set-up, call and tear-down);
- an exclusive test holds it exclusively, from the first exclusive test of a run of consecutive ones
  to the last, so the other worker finishes the test it is in and then waits.

The lock is two ``flock`` files in the directory the workers share (the parent of each worker's
``--basetemp``). A writer first takes the turnstile, so that a reader arriving while the writer waits
queues behind it instead of starving it; readers pass through the turnstile and take the lock shared.
Without xdist workers every call is a no-op.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path


class WorkerLock:
    """The readers-writer lock of one worker: :meth:`shared`, :meth:`exclusive`, :meth:`release`."""

    def __init__(self, directory: str | os.PathLike) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self._turnstile = os.open(directory / "mcore-exclusive.turnstile", os.O_RDWR | os.O_CREAT, 0o644)
        self._lock = os.open(directory / "mcore-exclusive.lock", os.O_RDWR | os.O_CREAT, 0o644)
        self.held: str | None = None  # None, "shared" or "exclusive"

    def shared(self) -> None:
        if self.held == "shared":
            return
        self.release()
        fcntl.flock(self._turnstile, fcntl.LOCK_EX)  # behind a waiting writer
        try:
            fcntl.flock(self._lock, fcntl.LOCK_SH)
        finally:
            fcntl.flock(self._turnstile, fcntl.LOCK_UN)
        self.held = "shared"

    def exclusive(self) -> None:
        if self.held == "exclusive":
            return
        self.release()
        fcntl.flock(self._turnstile, fcntl.LOCK_EX)  # no new reader from now on
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX)  # the readers in a test finish it
        finally:
            fcntl.flock(self._turnstile, fcntl.LOCK_UN)
        self.held = "exclusive"

    def release(self) -> None:
        if self.held is not None:
            fcntl.flock(self._lock, fcntl.LOCK_UN)
            self.held = None

    def close(self) -> None:
        self.release()
        os.close(self._turnstile)
        os.close(self._lock)
