"""Running a test module's kernel checks under Triton's CPU interpreter, in a child process.

The CUDA backend's Triton kernels are checked on CPU by running them with ``TRITON_INTERPRET=1``. The
variable must be set before Triton defines a kernel (it is read when ``@triton.jit`` runs), so a test
module that checks kernels re-runs itself, its ``__main__`` block, in a child process with the
variable set and one thread (the CI machine has two cores)::

    @needs_triton
    @interpreter_child()            # or interpreter_child("adam_fp8"): the child's arguments
    def test_my_kernels_under_the_interpreter():
        out = run_under_interpreter(__file__)
        assert "my checks: 12" in out

The children are the suite's slowest tests (minutes of interpreted kernels) and use one core each.
``tests/conftest.py`` therefore starts the children of the selected tests marked ``interpreter_child``
right after collection, one at a time and at the lowest CPU priority (:class:`BackgroundChildren`): they
fill the core a single-process test leaves idle and yield to everything else. When the test itself
runs, :func:`run_under_interpreter` takes the child's finished (or still running) result instead of
starting it again; the child, its arguments, its timeout and every check are the same either way.
Under pytest-xdist workers (pyproject's ``-n 2``) nothing is started in the background: every worker
collects every test but runs only its share, and the two workers already keep both cores busy, so each
child runs in the foreground when its test runs.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading
from dataclasses import dataclass, field

import pytest

HAS_TRITON = importlib.util.find_spec("triton") is not None

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="needs triton (its CPU interpreter)")
"""Skips a test where Triton is not installed (the ``test`` extra installs it, so CI runs them)."""

interpreter_child = pytest.mark.interpreter_child
"""Marks a test that calls ``run_under_interpreter(__file__, *args)``: the marker's arguments are those
``args``, so the child can be started in the background before the test runs."""

_TAIL = 6000
"""Characters of the child's stdout and stderr kept in a failure's message (the ends: the error)."""

DEFAULT_TIMEOUT = 600.0


def _command(script: str, args: tuple[str, ...]) -> list[str]:
    return [sys.executable, script, *args]


def _environment() -> dict[str, str]:
    return {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}


@dataclass
class _Child:
    """One child run: its key, and once done its exit status and output (or the timeout it hit)."""

    script: str
    args: tuple[str, ...]
    timeout: float
    done: threading.Event = field(default_factory=threading.Event)
    returncode: int | None = None
    stdout: str = ""
    stderr: str = ""
    timed_out: bool = False


class BackgroundChildren:
    """Runs queued interpreter children one after another, at the lowest CPU priority, in a daemon
    thread; :meth:`take` hands a test its child's result, waiting for it where it is still running."""

    def __init__(self) -> None:
        self._children: dict[tuple[str, tuple[str, ...]], _Child] = {}
        self._queue: list[_Child] = []
        self._lock = threading.Lock()
        self._running: subprocess.Popen | None = None
        self._stopped = False
        self._working = False

    def start(self, runs: list[tuple[str, tuple[str, ...], float]]) -> None:
        """Queue ``(script, args, timeout)`` runs and start the worker thread."""
        with self._lock:
            self._queue_runs(runs)
            if not self._queue or self._working:
                return
            self._working = True  # set and cleared under the lock: a queued child never waits unserved
        threading.Thread(target=self._work, name="interpreter-children", daemon=True).start()

    def _queue_runs(self, runs: list[tuple[str, tuple[str, ...], float]]) -> None:
        for script, args, timeout in runs:
            key = (os.path.abspath(script), tuple(args))
            if key not in self._children:
                child = _Child(key[0], key[1], timeout)
                self._children[key] = child
                self._queue.append(child)

    def _work(self) -> None:
        while True:
            with self._lock:
                if self._stopped or not self._queue:
                    self._working = False
                    return
                child = self._queue.pop(0)
                proc = subprocess.Popen(
                    _command(child.script, child.args),
                    env=_environment(),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
                os.setpriority(os.PRIO_PROCESS, proc.pid, 19)  # after the fork: no preexec_fn in a thread
                self._running = proc
            try:
                child.stdout, child.stderr = proc.communicate(timeout=child.timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                child.stdout, child.stderr = proc.communicate()
                child.timed_out = True
            child.returncode = proc.returncode
            with self._lock:
                self._running = None
            child.done.set()

    def take(self, script: str, args: tuple[str, ...]) -> _Child | None:
        """The queued child for ``(script, args)``, once done; None where it was never queued."""
        child = self._children.get((os.path.abspath(script), tuple(args)))
        if child is None:
            return None
        child.done.wait()
        return child

    def stop(self) -> None:
        """Drop what has not started and kill the running child (the session ends)."""
        with self._lock:
            self._stopped = True
            self._queue.clear()
            if self._running is not None:
                self._running.kill()


BACKGROUND = BackgroundChildren()
"""The session's children (started by ``tests/conftest.py``)."""


def run_under_interpreter(script: str, *args: str, timeout: float = DEFAULT_TIMEOUT) -> str:
    """Run ``python script *args`` with ``TRITON_INTERPRET=1`` and ``OMP_NUM_THREADS=1`` (or take
    that run from :data:`BACKGROUND`); return its stdout, or fail with the ends of its stdout and
    stderr when it exits non-zero or runs past ``timeout`` seconds."""
    child = BACKGROUND.take(script, args)
    if child is None:
        child = _Child(os.path.abspath(script), tuple(args), timeout)
        try:
            proc = subprocess.run(
                _command(script, args), env=_environment(), capture_output=True, text=True, timeout=timeout
            )
            child.returncode, child.stdout, child.stderr = proc.returncode, proc.stdout, proc.stderr
        except subprocess.TimeoutExpired as exc:
            child.timed_out, child.stdout, child.stderr = True, _text(exc.stdout), _text(exc.stderr)
    if child.timed_out or child.returncode != 0:
        what = f"ran past its {child.timeout:g} s" if child.timed_out else f"exited {child.returncode}"
        pytest.fail(
            f"{os.path.basename(script)} {' '.join(args)} under TRITON_INTERPRET=1 {what}:\n"
            f"{child.stdout[-_TAIL:]}\n{child.stderr[-_TAIL:]}",
            pytrace=False,
        )
    return child.stdout


def _text(data: str | bytes | None) -> str:
    if data is None:
        return ""
    return data.decode(errors="replace") if isinstance(data, bytes) else data
