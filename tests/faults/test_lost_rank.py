"""A lost, stopped or hung rank, or a user error on one rank, ends the job with ONE line naming it.

Real 2-rank jobs on CPU, launched one process per rank as ``srun`` does (rank 0 hosts the rendezvous
store, the hardest case: a lost rank 0 takes the store with it). What the surviving ranks print is
checked: one ``error: step N: ...`` line naming the rank and the group (tp/pp/dp) it shared, no
collective-library traceback, and an exit within seconds of the fault (the heartbeat watchdog,
``--heartbeat-timeout-seconds``), or at ``--distributed-timeout-minutes`` for a rank that hangs alive.
"""

from __future__ import annotations

import re
import signal
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fault_runs import iterations_logged, kill_all, start_ranks, wait_for  # noqa: E402

pytestmark = pytest.mark.slow

LAYOUTS = {
    "tp": ["--tensor-model-parallel-size", "2"],
    "pp": ["--pipeline-model-parallel-size", "2"],
    "dp": [],
}
BASE = ["--train-iters", "1000", "--log-interval", "1", "--heartbeat-timeout-seconds", "5"]


def _job(tmp_path, flags, **env):
    procs = start_ranks([*BASE, *flags], tmp_path, **env)
    logs = [tmp_path / f"rank{r}.log" for r in range(2)]
    return procs, logs


def _error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error")]


@pytest.mark.parametrize(
    ("axis", "victim", "how"),
    [("tp", 1, "killed"), ("pp", 1, "killed"), ("dp", 0, "killed"), ("dp", 1, "stopped")],
)
def test_a_lost_rank_is_named_in_one_line_within_seconds(tmp_path, axis, victim, how):
    flags = [*LAYOUTS[axis], "--distributed-timeout-minutes", "1"]
    procs, logs = _job(tmp_path, flags)
    survivor = 1 - victim
    try:
        wait_for(lambda: iterations_logged(logs[-1]) >= 3, "3 logged iterations", procs)
        lost_at = time.monotonic()
        procs[victim].send_signal(signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        code = procs[survivor].wait(timeout=40)
        took = time.monotonic() - lost_at
    finally:
        kill_all(procs)
    text = logs[survivor].read_text(errors="replace")
    print(f"{axis}, rank {victim} {how}: rank {survivor} ended after {took:.1f} s: {_error_lines(text)}")
    assert code == 1, text[-3000:]
    assert took < 20, f"{took:.1f} s: not the heartbeat but the 60 s timeout ended it"
    errors = _error_lines(text)
    assert len(errors) == 1, text[-3000:]
    assert re.match(r"error: step \d+: rank \d", errors[0]), errors[0]
    assert f"rank {victim} ({axis} group of rank {survivor})" in errors[0], errors[0]
    assert "left the job" in errors[0] or "does not answer" in errors[0], errors[0]
    assert "Traceback" not in text and "GLHF" not in text, text[-3000:]


def test_a_hung_rank_is_named_at_the_distributed_timeout(tmp_path):
    # rank 1 sleeps inside step 4's forward pass: alive (its heartbeat thread beats), not communicating
    flags = [*LAYOUTS["tp"], "--distributed-timeout-minutes", "0.1"]
    procs, logs = _job(tmp_path, flags, FAULT_KIND="hang", FAULT_RANK="1", FAULT_STEP="4")
    try:
        start = time.monotonic()
        code = procs[0].wait(timeout=45)
        took = time.monotonic() - start
    finally:
        kill_all(procs)
    text = logs[0].read_text(errors="replace")
    errors = _error_lines(text)
    print(f"hung rank: rank 0 ended after {took:.1f} s: {errors}")
    assert code == 1 and len(errors) == 1, text[-3000:]
    assert errors[0].startswith(
        "error: step 4: a collective timed out after 6 s (--distributed-timeout-minutes)"
    )
    assert "rank 1 (tp group of rank 0), at step 4: alive but not taking part" in errors[0], errors[0]
    assert "Traceback" not in text, text[-3000:]


def test_a_user_error_on_one_rank_is_printed_once_per_job(tmp_path):
    procs, logs = _job(tmp_path, LAYOUTS["tp"], FAULT_KIND="data-error", FAULT_RANK="1", FAULT_STEP="2")
    try:
        codes = [p.wait(timeout=45) for p in procs]
    finally:
        kill_all(procs)
    texts = [log.read_text(errors="replace") for log in logs]
    both = "".join(texts)
    print(f"user error: exit codes {codes}; {_error_lines(both)}")
    assert both.count("token id 70000") == 1, both[-3000:]
    assert "error (rank 1): /data/corpus_text_document.bin: token id 70000" in texts[1]
    assert "rank 0: stopping: rank 1 reported the job's error" in texts[0], texts[0][-3000:]
    assert "Traceback" not in both, both[-3000:]
    assert codes == [2, 2]
