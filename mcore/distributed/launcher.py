"""``mcore-run``: torchrun with a one-line failure report, and the workers' side of that report.

``torchrun`` (``torch.distributed.run``) ends every failed job with its own block: its launcher's
traceback and a ``ChildFailedError`` box of ~40 lines listing every rank, also when a worker already
said what was wrong in one line (a bad flag, a missing file) and exited with status 2. Every non-zero
worker exit takes that path (``launch_agent`` raises ``ChildFailedError``; ``torch.distributed.run``'s
``main`` lets it escape), so no exit status of the workers avoids it while staying non-zero.

``mcore-run`` takes torchrun's arguments unchanged and runs the same elastic agent; when the job fails
it prints ONE line and exits with the failing worker's status (2 for a user error, as a single
process; ``128 + n`` for a worker killed by signal ``n``):

* the job's error line, when a worker handed one over (:func:`hand_to_launcher`: the mcore error of a
  user mistake, or the watchdog's line naming a lost or hung rank). Under ``mcore-run`` the workers
  write that line into the agent's per-worker error file (``TORCHELASTIC_ERROR_FILE``) instead of
  printing it, so it is printed exactly once even when the agent stops the rank that would have
  printed it;
* else a line naming the rank and its exit status (a crash's traceback is above it, printed by the
  worker itself).

Under plain ``torchrun`` nothing changes for the workers: rank 0 (or the rank that saw the error
first) prints the line and torchrun adds its block.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time

LAUNCHER_ENV = "MCORE_RUN"
"""Set by ``mcore-run`` for its workers: hand the job's error line over instead of printing it."""


def _error_file() -> str | None:
    if os.environ.get(LAUNCHER_ENV) != "1":
        return None
    return os.environ.get("TORCHELASTIC_ERROR_FILE") or None


def under_launcher() -> bool:
    """Whether this worker runs under ``mcore-run`` (which prints the job's error line itself)."""
    return _error_file() is not None


def hand_to_launcher(line: str, status: int) -> bool:
    """Under ``mcore-run``: record ``line`` as this worker's error (the agent's error-file format,
    ``{"message": str, "timestamp": int}``, marked ``"mcore"`` with the ``status`` this worker exits
    with) and return True: the caller prints nothing. Else False."""
    path = _error_file()
    if path is None:
        return False
    try:
        with open(path, "w") as f:
            json.dump({"message": line, "timestamp": int(time.time()), "mcore": status}, f)
    except OSError:
        return False  # the launcher cannot get it: the caller prints it
    return True


def _failure_line(name: str, rank: int, failure) -> tuple[str, int]:
    """The one line for a failure the worker did not describe, and the launcher's exit status."""
    code = failure.exitcode
    if code < 0:
        try:
            how = f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"was killed by signal {-code}"
        status = 128 - code
    else:
        how, status = f"exited with status {code}", code
    return f"error: {name} failed: rank {rank} {how} (its output is above)", status


def _root_failure(failures: dict) -> tuple[int, object]:
    """The failure to report: one that handed over a line first, else one that exited by itself
    (a non-zero status, not the agent's SIGTERM to the others), earliest and lowest rank first."""

    def key(item):
        rank, failure = item
        handed = _handed_line(failure) is not None
        return (not handed, failure.exitcode <= 0, failure.timestamp, rank)

    return min(failures.items(), key=key)


def _handed_line(failure) -> str | None:
    data = failure.error_file_data
    return data["message"] if "mcore" in data and isinstance(data.get("message"), str) else None


def summary(err) -> tuple[str, int]:
    """``(line, exit status)`` for a ``ChildFailedError``."""
    rank, failure = _root_failure(err.failures)
    line = _handed_line(failure)
    if line:
        return line, int(
            failure.error_file_data["mcore"]
        )  # the worker's status, also if the agent stopped it
    return _failure_line(os.path.basename(err.name), rank, failure)


def main(argv: list[str] | None = None) -> None:
    """``mcore-run [torchrun's arguments] script.py [its flags]``."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args(argv)
    # The agent's own lines about the failure ("failed (exitcode: 2) local_rank: 1", "Sending process
    # ... closing signal SIGTERM") say what the summary line says.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    os.environ[LAUNCHER_ENV] = "1"  # the workers inherit the launcher's environment
    try:
        run(args)
    except ChildFailedError as err:
        line, status = summary(err)
        sys.stdout.flush()
        print(line, file=sys.stderr, flush=True)
        raise SystemExit(status) from None


if __name__ == "__main__":
    main()
