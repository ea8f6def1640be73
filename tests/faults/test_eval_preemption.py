"""SIGTERM with --exit-signal-handler during an evaluation: the evaluation stops after the step that saw
it (the ranks agree per evaluation step, as training does per iteration), the run saves and exits 0,
instead of finishing every evaluation step while the launcher's grace period runs out.

One process, the tiny GPT of tests/checkpoint/ckpt_runs.py (hidden 32, sequence 16), 2 iterations."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "checkpoint"))
from ckpt_runs import argv, tiny_datasets_with_valid_provider  # noqa: E402


def test_sigterm_during_evaluation_stops_it_saves_and_exits_zero(tmp_path, capsys):
    from mcore.training.gpt import forward_step, model_provider
    from mcore.training.pretrain import pretrain

    calls = {"eval": 0}

    def forward_step_signalling(data_iterator, model):
        if not model.training:
            calls["eval"] += 1
            if calls["eval"] == 1:
                os.kill(os.getpid(), signal.SIGTERM)  # the preemption notice, at the first evaluation step
        return forward_step(data_iterator, model)

    flags = ["--train-iters", "4", "--eval-interval", "2", "--eval-iters", "50", "--save", str(tmp_path / "ckpt"),
             "--exit-signal-handler", "--num-layers", "1"]  # fmt: skip
    result = pretrain(
        model_provider, forward_step_signalling, tiny_datasets_with_valid_provider, argv=argv(*flags)
    )
    out = capsys.readouterr().out
    assert result.exit_reason == "signal" and result.state.iteration == 2
    assert calls["eval"] == 4  # the 4 micro-batches of one step of 50, and no final evaluation
    assert result.state.consumed_valid_samples == 1 * 4  # what was read: the resume continues from there
    assert "validation evaluation stopped after 1 of 50 iterations" in out
    assert "exiting: SIGTERM received (--exit-signal-handler), checkpoint saved at iteration 2" in out
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
