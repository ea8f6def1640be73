"""Training jobs for the fault tests, started as real processes (torchrun, or one process per rank as
``srun`` starts them), and the helpers that watch, signal and kill them.

Run as a script (``python fault_runs.py FLAGS...``) it is one rank of a job: it trains the tiny GPT of
``tests/checkpoint/ckpt_runs.py`` with Megatron's flags and writes ``rank<R>.json`` (exit reason,
iteration, losses) into ``$FAULT_RESULT_DIR`` when ``pretrain`` returns.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "checkpoint"))  # ckpt_runs: the tiny model and dataset

from mcore.testing.distributed import free_port  # noqa: E402

# Megatron's defaults where they matter here: dropout 0.1 and two background data workers.
DROPOUT_WORKERS = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--num-workers", "2"]
TP2 = ["--tensor-model-parallel-size", "2"]
BOUND_S = 50.0  # every wait of a fault test ends by then: a failure, never a hang


def job_env(tmp_path: Path) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FAULT_RESULT_DIR": str(tmp_path)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
    return env


def start_torchrun(flags: list[str], tmp_path: Path, log: Path, nproc: int = 2) -> subprocess.Popen:
    """``python -m torch.distributed.run`` with ``nproc`` ranks of this script, output into ``log``."""
    command = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "1", "--nproc-per-node", str(nproc),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
        str(HERE / "fault_runs.py"), *flags,
    ]  # fmt: skip
    with open(log, "w") as out:
        return subprocess.Popen(command, env=job_env(tmp_path), stdout=out, stderr=subprocess.STDOUT)


def start_ranks(flags: list[str], tmp_path: Path, nproc: int = 2, **env_extra) -> list[subprocess.Popen]:
    """One process per rank, launched as Slurm's ``srun`` does (``SLURM_PROCID``...); ``rank<R>.log``."""
    env = {
        **job_env(tmp_path),
        **env_extra,
        "SLURM_NTASKS": str(nproc),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    procs = []
    for r in range(nproc):
        with open(tmp_path / f"rank{r}.log", "w") as out:
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(HERE / "fault_runs.py"), *flags],
                    env={**env, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)},
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            )
    return procs


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (from /proc), children before grandchildren."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
    out, queue = [], [pid]
    while queue:
        for child in children.get(queue.pop(0), []):
            out.append(child)
            queue.append(child)
    return out


def wait_for(predicate, what: str, procs=(), bound_s: float = BOUND_S) -> None:
    """Poll ``predicate`` until it holds; fail naming ``what`` on the deadline or when a process of
    ``procs`` ended first."""
    deadline = time.monotonic() + bound_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {bound_s:.0f} s waiting for {what}")
        if any(p.poll() is not None for p in procs):
            raise AssertionError(f"a process ended while waiting for {what}")
        time.sleep(0.05)


def iterations_logged(log: Path) -> int:
    return log.read_text(errors="replace").count(" iteration ") if log.exists() else 0


def signal_all(pids, sig=signal.SIGTERM) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def kill_all(procs) -> None:
    """Clean-up: SIGKILL every process of the jobs (and their descendants) still alive."""
    for p in procs:
        if p.poll() is None:
            signal_all([*descendants(p.pid), p.pid], signal.SIGKILL)
            p.wait(timeout=10)


def results(tmp_path: Path, nproc: int = 2) -> list[dict | None]:
    out = []
    for r in range(nproc):
        path = tmp_path / f"rank{r}.json"
        out.append(json.loads(path.read_text()) if path.exists() else None)
    return out


def _inject_fault(kind: str, rank: int, step: int) -> None:
    """Make rank ``rank`` fail at training step ``step``, inside its forward pass: ``hang`` (sleeps,
    its heartbeat thread alive) or ``data-error`` (a DataError, as a damaged dataset would raise)."""
    import mcore.training.gpt as gpt
    from mcore.data.errors import DataError
    from mcore.distributed import watchdog

    real_forward_step = gpt.forward_step

    def forward_step(data_iterator, model):
        me = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
        current = watchdog._current.step if watchdog._current is not None else 0
        if me == rank and current == step:
            if kind == "hang":
                time.sleep(600)
            raise DataError(f"/data/corpus_text_document.bin: token id 70000 at sample {step} (injected)")
        return real_forward_step(data_iterator, model)

    gpt.forward_step = forward_step


def main(flags: list[str]) -> None:
    import torch

    torch.set_num_threads(1)
    from ckpt_runs import train

    if os.environ.get("FAULT_KIND"):
        _inject_fault(os.environ["FAULT_KIND"], int(os.environ["FAULT_RANK"]), int(os.environ["FAULT_STEP"]))

    result = train(flags)
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
    out = Path(os.environ["FAULT_RESULT_DIR"]) / f"rank{rank}.json"
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
