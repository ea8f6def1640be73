"""A user error found before the process groups exist (a bad flag) is printed once, by rank 0, not by
every rank of a torchrun job; every rank still exits with status 2."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize(("rank", "lines"), [("0", 1), ("1", 0)])
def test_a_flag_error_is_printed_by_rank_zero_only(monkeypatch, capsys, rank, lines):
    from mcore.training.gpt import forward_step, model_provider
    from mcore.training.pretrain import pretrain

    for key, value in {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as exit_:
        pretrain(model_provider, forward_step, argv=["--num-layers", "2", "--hiden-size", "8"])
    assert exit_.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "hiden" in line]
    assert len(err) == lines, err


def test_under_mcore_run_every_rank_hands_the_flag_error_over(monkeypatch, capsys, tmp_path):
    """Under ``mcore-run`` no rank prints the error: each writes it to the agent's error file, which
    mcore-run prints once (so a rank stopped by the agent before printing loses nothing)."""
    import json

    from mcore.training.gpt import forward_step, model_provider
    from mcore.training.pretrain import pretrain

    env = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MCORE_RUN": "1"}
    for key, value in {**env, "TORCHELASTIC_ERROR_FILE": str(tmp_path / "error.json")}.items():
        monkeypatch.setenv(key, value)
    for argv in (["--num-layers", "2", "--hiden-size", "8"], ["--num-layers", "2", "--hidden-size", "-8"]):
        with pytest.raises(SystemExit) as exit_:
            pretrain(model_provider, forward_step, argv=argv)
        assert exit_.value.code == 2
        assert capsys.readouterr().err == ""
        handed = json.loads((tmp_path / "error.json").read_text())
        assert handed["mcore"] == 2 and ("hiden" in handed["message"] or "-8" in handed["message"]), handed


def test_mcore_run_summary_line():
    """The line and status mcore-run ends a failed job with: a worker's handed-over line (its status,
    also when the agent stopped that worker), else the rank that failed by itself, not the ranks the
    agent stopped afterwards."""
    from types import SimpleNamespace as NS

    from mcore.distributed.launcher import summary

    def failure(code, data=None, ts=5):
        return NS(exitcode=code, error_file_data=data or {"message": "<NONE>"}, timestamp=ts)

    handed = {"message": "error (rank 1): missing data path 'x'", "mcore": 2}
    err = NS(name="/a/pretrain_gpt.py", failures={0: failure(-15, ts=1), 1: failure(-15, handed, ts=9)})
    assert summary(err) == ("error (rank 1): missing data path 'x'", 2)
    crash = NS(name="/a/pretrain_gpt.py", failures={0: failure(-15, ts=1), 1: failure(1, ts=3)})
    assert summary(crash) == (
        "error: pretrain_gpt.py failed: rank 1 exited with status 1 (its output is above)",
        1,
    )
    killed = NS(name="/a/pretrain_gpt.py", failures={0: failure(-9, ts=1)})
    assert summary(killed)[1] == 137 and "rank 0 was killed by SIGKILL" in summary(killed)[0]


def test_mcore_run_ends_a_failed_job_with_one_line(tmp_path):
    """A real 2-rank ``mcore-run`` launch of examples/pretrain_gpt.py with a missing --data-path: one
    error line naming the file, exit status 2, none of torchrun's ChildFailedError block."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from mcore.testing.distributed import free_port

    repo = Path(__file__).resolve().parents[2]
    flags = [
        "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
        "--max-position-embeddings", "8", "--micro-batch-size", "1", "--train-iters", "2", "--lr", "1e-3",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "64", "--data-path", str(tmp_path / "none_text_document"),
    ]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "mcore.distributed.launcher", "--nnodes", "1", "--nproc-per-node", "2",
         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
         str(repo / "examples" / "pretrain_gpt.py"), *flags],
        env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    both = proc.stdout + proc.stderr
    errors = [line for line in both.splitlines() if "error" in line.lower()]
    assert proc.returncode == 2, both[-3000:]
    assert len(errors) == 1 and "none_text_document" in errors[0], errors
    assert proc.stderr.strip() == errors[0], proc.stderr  # nothing else: no agent lines, no block
    assert "ChildFailedError" not in both and "Traceback" not in both
