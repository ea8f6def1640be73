"""A lost, hung or failing rank ends the job with ONE line that names it, not N tracebacks.

Without help, a rank that dies mid-step leaves its peers with a raw ``Connection reset by peer`` from
the collective library, a stopped rank leaves them waiting until ``--distributed-timeout-minutes``, and
a user error on one rank (a bad flag value, a damaged dataset) is followed by every other rank's
traceback. The :class:`Watchdog` gives each rank a heartbeat thread over a torch.distributed store
(the rendezvous store: torchrun's agent, or rank 0's ``MASTER_ADDR:MASTER_PORT`` server; nothing
device-specific), and the job one place to report its first failure:

* every ``interval_s`` each rank bumps ``hb/<rank>`` (and publishes the step it is in);
* it watches the ranks it communicates with (its tp, pp, dp and cp groups): a peer whose counter has
  not moved for ``silent_after_s`` was killed, stopped or lost its host. The watchdog names it (rank,
  the groups it shares, the step) and ends this process: detected in seconds, not at the timeout;
* the first rank that fails *claims* the job's failure (``failed``, an atomic counter): it prints the
  one line and stores it; every other rank, on seeing the claim (its heartbeat thread polls it, or its
  own collective failed), exits with a short line pointing at that rank instead of a traceback;
* a collective that fails in the training process (:meth:`Watchdog.end_job`) is explained from the
  heartbeats: a peer that went silent left; if every peer still beats, the ones at an earlier step
  hang inside it (the collective timed out after ``--distributed-timeout-minutes``).

Exit statuses: 2 for a user error (as a single process), 1 for anything else.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from mcore.distributed.launcher import hand_to_launcher, under_launcher

logger = logging.getLogger(__name__)

USER_ERROR_EXIT = 2
FAILURE_EXIT = 1
_PREFIX = "mcore/watchdog"
_AXES = ("tp", "pp", "dp", "cp")
_STORE_RETRY_S = 5.0
# Messages of the collective library when a peer connection broke or a wait timed out.
_COMMUNICATION_FAILURES = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Connection refused",
    "Broken pipe",
    "Timed out waiting",
    "Socket Timeout",
    "timed out",
)


class CommunicationError(RuntimeError):
    """A collective or point-to-point exchange that failed because of another rank (raised by
    mcore's own communication code, e.g. the pipeline's ``PipelineCommunicationError``)."""


def is_communication_failure(err: BaseException) -> bool:
    """Whether ``err`` is a collective or point-to-point failure (not a bug of this rank's code)."""
    if isinstance(err, (CommunicationError, getattr(dist, "DistError", ()))):
        return True
    return isinstance(err, RuntimeError) and any(s in str(err) for s in _COMMUNICATION_FAILURES)


def _first_line(err: BaseException) -> str:
    """``Type: message`` of ``err``: its first line, without the collective library's source location
    and advice (``[.../pair.cc:537] Read error ...: Connection reset by peer. This is typically ...``)."""
    lines = str(err).strip().splitlines()
    text = re.sub(r"^\[[^\]]*:\d+\]\s*", "", lines[0] if lines else "")
    text = text.split(". This is typically")[0]
    return f"{type(err).__name__}: {text}".strip()


def _job_store() -> dist.Store:
    """A client of the job's rendezvous store of its own (thread-safe use from the heartbeat thread)."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if host and port:
        return dist.TCPStore(
            host, int(port), is_master=False, timeout=timedelta(seconds=30), wait_for_workers=False
        )
    return dist.distributed_c10d._get_default_store()


class Watchdog:
    """Heartbeats and the job's first-failure report (see the module docstring).

    Args:
        store: the job's store (a :class:`torch.distributed.Store` every rank reaches).
        groups: this rank's :class:`~mcore.distributed.groups.ProcessGroups`.
        silent_after_s: a watched peer whose heartbeat is older than this is reported lost.
        timeout_s: ``--distributed-timeout-minutes`` in seconds (named in a timeout's line).
        interval_s: heartbeat period.
        generation: distinguishes successive jobs in one process group (each ``pretrain`` call).
        out: where the lines go (stderr).
    """

    def __init__(
        self,
        store: dist.Store,
        groups,
        *,
        silent_after_s: float,
        timeout_s: float,
        interval_s: float = 1.0,
        generation: int = 1,
    ):
        self.store = dist.PrefixStore(f"{_PREFIX}/{generation}/", store)
        self.groups = groups
        self.rank, self.world_size = groups.rank, groups.world_size
        self.silent_after_s, self.timeout_s, self.interval_s = silent_after_s, timeout_s, interval_s
        topology = groups.topology
        self.axes_of: dict[int, list[str]] = {}
        for axis in _AXES:
            for peer in topology.group_of(axis):
                if peer != self.rank:
                    self.axes_of.setdefault(peer, []).append(axis)
        self.step = 0
        self._published_step = -1
        self._seen: dict[int, tuple[int, float]] = {}  # peer -> (counter, when it last moved)
        self._ending = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._store_down = False
        self._lost: set[int] = set()
        self._store_hosted_here = self.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"

    # -- life cycle ---------------------------------------------------------------------------------

    @classmethod
    def for_job(cls, groups, parallel_config) -> Watchdog | None:
        """The watchdog of a multi-process job (None for one process or ``--heartbeat-timeout-seconds 0``)."""
        silent_after = parallel_config.heartbeat_timeout_seconds
        if groups.world_size == 1 or not dist.is_initialized() or not silent_after:
            return None
        store = _job_store()
        generation = store.add(f"{_PREFIX}/calls/{groups.rank}", 1)
        return cls(
            store,
            groups,
            silent_after_s=float(silent_after),
            timeout_s=parallel_config.distributed_timeout_minutes * 60.0,
            generation=generation,
        )

    def start(self) -> Watchdog:
        self._try(self._beat)
        self._thread = threading.Thread(target=self._run, name="mcore-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self, reason: str = "finished") -> None:
        """Leave (peers do not report this rank as lost; ``reason`` tells them why) and join the thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if not self._ending.is_set():
            self._try(lambda: self.store.set(f"left/{self.rank}", reason))

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- the heartbeat thread -----------------------------------------------------------------------

    def _try(self, op, default=None):
        """``op()``, or ``default`` once the store failed (it is not asked again: each failed request
        makes the store client log a warning with a C++ stack)."""
        if self._store_down:
            return default
        try:
            return op()
        except Exception:  # noqa: BLE001 - a store that went away is judged by _run / explain
            self._store_down = True
            return default

    def _beat(self) -> None:
        self.store.add(f"hb/{self.rank}", 1)
        if self.step != self._published_step:
            self._published_step = self.step
            self.store.set(f"step/{self.rank}", str(self.step))

    def _run(self) -> None:
        down_since = next_try = None
        while not self._stop.wait(self.interval_s):
            if self._ending.is_set():  # the training thread reports; keep beating: peers see it alive
                self._try(self._beat)
                continue
            now = time.monotonic()
            if self._store_down:
                down_since = down_since or now
                if now - down_since > self.silent_after_s and self._take_over():
                    self._end(self._store_lost_line(), FAILURE_EXIT, claim=False)
                if next_try is not None and now < next_try:
                    continue
                self._store_down = False  # ask a store that failed again, every few seconds
            ok = self._try(lambda: (self._beat(), True)[1], False)
            claimed = ok and self._try(lambda: self.store.add("failed", 0) > 0, False)
            lost = self._try(lambda: self._silent_peers(self.silent_after_s), []) if ok else []
            if self._store_down:
                next_try = now + _STORE_RETRY_S
                continue
            down_since = None
            if self._stop.is_set() or not (claimed or lost) or not self._take_over():
                continue
            self._end(None if claimed else self._lost_line(lost, None), FAILURE_EXIT)

    def _silent_peers(self, older_than_s: float) -> list[tuple[int, float]]:
        """Watched peers whose heartbeat has not moved for ``older_than_s`` and that did not leave."""
        now = time.monotonic()
        silent = []
        for peer in self.axes_of:
            count = self.store.add(f"hb/{peer}", 0)
            previous = self._seen.get(peer)
            if previous is None or previous[0] != count:
                self._seen[peer] = (count, now)
            elif now - previous[1] > older_than_s and not self.store.check([f"left/{peer}"]):
                silent.append((peer, now - previous[1]))
        return silent

    # -- reports ------------------------------------------------------------------------------------

    def _describe_peer(self, peer: int) -> str:
        axes = self.axes_of.get(peer, [])
        return f"rank {peer} ({'/'.join(axes)} group of rank {self.rank})" if axes else f"rank {peer}"

    def _store_lost_line(self, err: BaseException | None = None) -> str:
        cause = f" [{_first_line(err)}]" if err is not None else ""
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            return f"error: step {self.step}: the launcher's store does not answer: the agent is gone{cause}"
        return (
            f"error: step {self.step}: {self._describe_peer(0)}, which hosts the job's store "
            f"(MASTER_ADDR:MASTER_PORT), does not answer: it left the job (killed, stopped, or its host "
            f"is lost){cause}"
        )

    def _lost_line(self, lost: list[tuple[int, float]], err: BaseException | None) -> str:
        self._lost.update(p for p, _ in lost)
        who = ", ".join(f"{self._describe_peer(p)}, silent for {s:.0f} s" for p, s in lost)
        cause = f" [{_first_line(err)}]" if err is not None else ""
        return (
            f"error: step {self.step}: {who}: it left the job (killed, stopped, or its host is lost); "
            f"the {'/'.join(self.axes_of.get(lost[0][0], ['job']))} collectives cannot go on{cause}"
        )

    def _peer_steps(self) -> dict[int, int]:
        steps = {}
        for peer in self.axes_of:
            value = self._try(lambda p=peer: self.store.get(f"step/{p}"))
            if value is not None:
                steps[peer] = int(value)
        return steps

    def explain(self, err: BaseException, probe_s: float | None = None) -> str:
        """The one line for a communication failure of this rank's training thread: which peer left
        (its heartbeat stops within ``probe_s``), or which peers are behind (they hang in the step)."""
        probe_s = probe_s if probe_s is not None else max(5.0 * self.interval_s, 3.0)
        deadline = time.monotonic() + probe_s
        lost: list = []
        while time.monotonic() < deadline and not lost:
            time.sleep(self.interval_s / 2)
            lost = self._try(lambda: self._silent_peers(probe_s * 0.6), None)
            if self._store_down and not self._store_hosted_here:
                return self._store_lost_line(err)
        if lost:
            return self._lost_line(lost, err)
        for peer in sorted(self.axes_of):
            reason = self._try(
                lambda p=peer: (
                    self.store.get(f"left/{p}").decode() if self.store.check([f"left/{p}"]) else None
                )
            )
            if reason and reason.startswith("failed:"):
                return (
                    f"error: step {self.step}: {self._describe_peer(peer)} failed and left the job "
                    f"({reason.removeprefix('failed:').strip()}; its traceback is in its output)"
                )
        timed_out = "timed out" in str(err).lower() or "within" in str(err)
        what = (
            f"a collective timed out after {self.timeout_s:g} s (--distributed-timeout-minutes)"
            if timed_out
            else "a collective failed"
        )
        # Alive (still beating) and not failing itself: a peer that hangs outside the collective.
        hung = [
            p
            for p in sorted(self.axes_of)
            if not self._try(
                lambda p=p: self.store.check([f"ending/{p}"]) or self.store.check([f"left/{p}"]), True
            )
        ]
        if hung:
            steps = self._peer_steps()
            who = ", ".join(f"{self._describe_peer(p)}, at step {steps.get(p, '?')}" for p in hung)
            return (
                f"error: step {self.step}: {what}: {who}: alive but not taking part (it hangs) "
                f"[{_first_line(err)}]"
            )
        return f"error: step {self.step}: {what} on rank {self.rank} [{_first_line(err)}]"

    def _claim(self, line: str | None, code: int) -> bool:
        """Record this rank's failure as the job's, if it is the first; True when it was."""
        first = self._try(lambda: self.store.add("failed", 1) == 1, True)
        if first and line is not None:
            self._try(lambda: self.store.set("failed/line", f"{code}|{self.rank}|{line}"))
        return first

    def _claimed_by(self) -> tuple[int, int, str] | None:
        if not self._try(lambda: self.store.check(["failed/line"]), False):
            return None
        value = self._try(lambda: self.store.get("failed/line").decode())
        if not value:
            return None
        code, rank, line = value.split("|", 2)
        return int(code), int(rank), line

    def _take_over(self) -> bool:
        """Whether this thread ends the process (the first of the training and heartbeat threads)."""
        with self._lock:
            if self._ending.is_set():
                return False
            self._ending.set()
            return True

    def _end(self, line: str | None, code: int, claim: bool = True) -> None:
        """Print the job's line (or, when another rank claimed the job's failure first, a short line
        pointing at it) and end this process. ``line=None``: another rank's failure is known to come
        first. ``claim=False``: print ``line`` without claiming (the store is unreachable)."""
        first = claim and line is not None and self._claim(line, code)
        if first or (line is not None and not claim):
            _say(line, code)
        else:
            found = self._claimed_by()
            deadline = time.monotonic() + 2.0  # the claimer writes its line right after its claim
            while found is None and time.monotonic() < deadline:
                time.sleep(0.1)
                found = self._claimed_by()
            if found is not None:
                code, rank, _ = found
                if not under_launcher():  # mcore-run prints the claimer's line alone
                    logger.error(f"rank {self.rank}: stopping: rank {rank} reported the job's error")
            elif line is not None:
                _say(line, code)
        self._leave()
        sys.stdout.flush()
        os._exit(code)

    def _leave(self) -> None:
        self._try(lambda: self.store.set(f"left/{self.rank}", "failed"))
        if self._store_hosted_here:
            # The other ranks read the failure through this process's store: let them see it first.
            deadline = time.monotonic() + 2.0 * self.interval_s + 1.0
            others = [f"left/{r}" for r in range(self.world_size) if r != self.rank and r not in self._lost]
            while time.monotonic() < deadline and not self._try(lambda: self.store.check(others), False):
                time.sleep(0.1)

    def end_job(self, err: BaseException, *, user_error: bool = False, message: str | None = None) -> None:
        """End this process after ``err`` escaped the training loop, when it is a user error
        (``message`` printed once per job, exit 2) or a communication failure (one line naming the
        lost or hung rank, exit 1); a short line instead when another rank reported first. Returns for
        any other exception (the caller re-raises it).
        """
        if not (user_error or is_communication_failure(err)):
            return
        if not self._take_over():
            while True:  # the heartbeat thread is ending the process
                time.sleep(1.0)
        if user_error:
            self._end(message or f"error (rank {self.rank}): {err}", USER_ERROR_EXIT)
        if self._try(lambda: self.store.add("failed", 0), 0) > 0:
            self._end(None, FAILURE_EXIT)  # another rank's failure came first
        self._try(lambda: self.store.set(f"ending/{self.rank}", _first_line(err)))
        self._end(self.explain(err), FAILURE_EXIT)


def _say(line: str, code: int) -> None:
    """Print the job's line, or hand it to ``mcore-run`` (which prints it once for the job)."""
    if not hand_to_launcher(line, code):
        logger.error(line)


_current: Watchdog | None = None


@contextlib.contextmanager
def watch_job(groups, parallel_config, user_errors: tuple[type[BaseException], ...] = ()):
    """Run the body under a :class:`Watchdog` (a no-op for one process): a communication failure or a
    ``user_errors`` exception escaping it ends the process with the job's one line (see
    :meth:`Watchdog.end_job`); any other exception is re-raised after telling the peers this rank
    failed (they name it instead of their broken connection)."""
    watchdog = Watchdog.for_job(groups, parallel_config)
    if watchdog is None:
        yield None
        return
    set_current(watchdog)
    watchdog.start()
    reason = "finished"
    try:
        yield watchdog
    except BaseException as err:
        if isinstance(err, Exception):
            user = isinstance(err, user_errors)
            watchdog.end_job(
                err, user_error=user, message=f"error (rank {groups.rank}): {err}" if user else None
            )
        reason = f"failed: {_first_line(err)}"
        raise
    finally:
        watchdog.stop(reason)
        set_current(None)


def note_step(step: int) -> None:
    """Tell the running watchdog (if any) which training step this rank is in (named in reports)."""
    if _current is not None:
        _current.step = step


def set_current(watchdog: Watchdog | None) -> None:
    global _current
    _current = watchdog
