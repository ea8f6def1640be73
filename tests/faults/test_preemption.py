"""Preemption: SIGTERM with ``--exit-signal-handler`` saves a checkpoint that resumes exactly.

Real jobs on CPU: 2 ranks at TP=2 with Megatron's defaults that matter here (dropout 0.1, two
DataLoader workers per rank), started by ``python -m torch.distributed.run`` or one process per rank
as ``srun`` does. A launcher's SIGTERM reaches the DataLoader workers too (torchrun's agent signals
each rank's whole process group; Slurm signals every process of the step): the workers must ignore
it and the training process must finish its step, save and stop.

Each test then checks that the checkpoint resumes exactly: iterations N+1, N+2 after loading the
signalled run's checkpoint of iteration N (fresh processes) equal those of a run that never stopped
(one such run serves the module's tests).
"""

from __future__ import annotations

import re
import signal
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fault_runs import (  # noqa: E402
    DROPOUT_WORKERS,
    TP2,
    descendants,
    iterations_logged,
    kill_all,
    results,
    signal_all,
    start_ranks,
    start_torchrun,
    wait_for,
)

from mcore.checkpoint.format import read_tracker  # noqa: E402
from mcore.testing.distributed import run_distributed  # noqa: E402

pytestmark = pytest.mark.slow

RUN = [*TP2, *DROPOUT_WORKERS, "--train-iters", "1000", "--log-interval", "1"]


def _signalled_run(tmp_path: Path, launch: str, targets: str) -> tuple[str, list, int, float]:
    """Start a job, SIGTERM it once it trains, wait for it; ``(output, exit codes, iteration saved,
    seconds from the signal to the end)``."""
    save = tmp_path / "ckpt"
    flags = [*RUN, "--save", str(save), "--exit-signal-handler"]
    log = tmp_path / "job.log"
    if launch == "torchrun":
        procs = [start_torchrun(flags, tmp_path, log)]
        logs = [log]
    else:
        procs = start_ranks(flags, tmp_path)
        logs = [tmp_path / f"rank{r}.log" for r in range(2)]
    try:
        wait_for(lambda: iterations_logged(logs[-1]) >= 3, "3 logged iterations", procs)
        job = [pid for p in procs for pid in (p.pid, *descendants(p.pid))]
        assert len(job) >= (7 if launch == "torchrun" else 6), job  # ranks and their 2 workers each
        signalled_at = time.monotonic()
        signal_all(job if targets == "every process" else [procs[0].pid], signal.SIGTERM)
        codes = [p.wait(timeout=60) for p in procs]
        took = time.monotonic() - signalled_at
        print(f"{launch}, SIGTERM to {targets}: the job ended {took:.1f} s after the signal")
    finally:
        kill_all(procs)
    output = "".join(path.read_text(errors="replace") for path in logs)
    iteration = read_tracker(save)
    return output, codes, iteration, took


# The losses of a run that never stopped, shared by the module's tests: RUN to a later --exit-interval
# trains the same first iterations (the schedule and the samples follow --train-iters 1000), so one
# run serves every saved iteration up to its length. Extra iterations cost milliseconds, a launch seconds.
_STRAIGHT: list[float] = []
_STRAIGHT_MARGIN = 4


def _straight_losses(iterations: int) -> list[float]:
    """The first ``iterations`` losses of RUN without a stop (2 fresh ranks), run once per module
    (again, longer, only if a test needs more than the last run made)."""
    if len(_STRAIGHT) < iterations:
        from ckpt_runs import train

        until = iterations + _STRAIGHT_MARGIN
        losses = run_distributed(train, 2, [*RUN, "--exit-interval", str(until)], timeout=60)[-1]["losses"]
        assert len(losses) == until, len(losses)  # --exit-interval stops there
        _STRAIGHT[:] = losses
    return _STRAIGHT[:iterations]


def _assert_resumes_exactly(tmp_path: Path, iteration: int) -> None:
    from ckpt_runs import train

    until = ["--exit-interval", str(iteration + 2)]
    straight = _straight_losses(iteration + 2)
    resumed = run_distributed(train, 2, [*RUN, *until, "--load", str(tmp_path / "ckpt")], timeout=60)[-1]
    assert len(resumed["losses"]) == 2
    assert resumed["losses"] == straight[iteration:]  # bit for bit


def _assert_clean_stop(output: str, iteration) -> None:
    assert isinstance(iteration, int) and 1 <= iteration < 1000, output[-3000:]
    assert (
        f"exiting: SIGTERM received (--exit-signal-handler), checkpoint saved at iteration {iteration}"
        in output
    ), output[-3000:]
    assert "killed by signal" not in output and "Traceback" not in output.split("exiting:")[0], output[-3000:]


@pytest.mark.parametrize("targets", ["the agent", "every process"])
def test_sigterm_under_torchrun_saves_and_resumes_exactly(tmp_path, targets):
    output, codes, iteration, took = _signalled_run(tmp_path, "torchrun", targets)
    _assert_clean_stop(output, iteration)
    # Every rank returned from pretrain and exited normally: torchrun's agent logs a worker's non-zero
    # exit as a failure. The agent itself re-raises the SIGTERM it got (torch's SignalException:
    # exit status 1); that status is torch's, not the job's.
    assert [r["exit_reason"] if r else None for r in results(tmp_path)] == ["signal", "signal"], output[
        -3000:
    ]
    assert not re.search(r"exitcode\s*:\s*-?[1-9]", output), output[-3000:]
    assert took < 30, f"the save took {took:.1f} s: torchrun SIGKILLs its workers 30 s after SIGTERM"
    _assert_resumes_exactly(tmp_path, iteration)


def test_sigterm_to_every_process_of_an_srun_style_job_exits_zero_and_resumes_exactly(tmp_path):
    output, codes, iteration, _ = _signalled_run(tmp_path, "srun", "every process")
    _assert_clean_stop(output, iteration)
    assert codes == [0, 0], output[-3000:]
    _assert_resumes_exactly(tmp_path, iteration)
