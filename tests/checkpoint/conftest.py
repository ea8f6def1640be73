"""Checkpoints shared by the checkpoint tests (each trained once per session)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # ckpt_runs, here and in the spawned ranks (importlib mode)
from ckpt_runs import DISTOPT_DP2, TP2_PP2, train  # noqa: E402

from mcore.testing.distributed import run_distributed  # noqa: E402


@pytest.fixture(scope="session")
def tp2pp2_run(tmp_path_factory):
    """20 iterations at TP=2 x PP=2 (4 processes), saving at 10 and 20: ``(save dir, 20 losses)``."""
    save = tmp_path_factory.mktemp("tp2pp2") / "ckpt"
    argv = [*TP2_PP2, "--train-iters", "20", "--save", str(save), "--save-interval", "10"]
    results = run_distributed(train, 4, argv, timeout=300)
    return save, results[-1]["losses"]


@pytest.fixture(scope="session")
def distopt_dp2_run(tmp_path_factory):
    """20 iterations at DP=2 with the distributed optimizer and ``--async-save``, saving at 10 and 20."""
    save = tmp_path_factory.mktemp("distopt") / "ckpt"
    argv = [*DISTOPT_DP2, "--train-iters", "20", "--save", str(save), "--save-interval", "10", "--async-save"]
    results = run_distributed(train, 2, argv, timeout=300)
    return save, results[-1]["losses"]
