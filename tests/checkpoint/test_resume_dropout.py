"""Exact resume with Megatron's default dropout (0.1), background data workers and validation.

10 iterations straight (saving at 5) == load iteration 5 in fresh processes + 5 iterations, bit for
bit, with ``--hidden-dropout 0.1 --attention-dropout 0.1 --num-workers 2`` and a validation every 3
iterations (one runs between the save and the end; the validation loader wraps around), at TP=2,
TP=2 with sequence parallelism, PP=2 and DP=2 with the distributed optimizer.

What this guards: every generator that draws is saved per rank and restored (Python, numpy, torch's
CPU generator, the device generator, the tensor-parallel stream), and nothing draws from them between
the restore and the next step: the data loaders draw their workers' seeds from their own generators
(:mod:`mcore.data.loader`), not from torch's default CPU generator that CPU dropout uses.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from ckpt_runs import DROPOUT_VALID_ARGV, train  # noqa: E402

from mcore.testing.distributed import run_distributed  # noqa: E402

pytestmark = pytest.mark.slow

LAYOUTS = {
    "tp2": ["--tensor-model-parallel-size", "2"],
    "tp2_sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
    "dp2_distopt": ["--use-distributed-optimizer"],
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_resume_with_dropout_and_data_workers_is_bit_exact(layout, tmp_path):
    save = tmp_path / "ckpt"
    run = [*LAYOUTS[layout], *DROPOUT_VALID_ARGV, "--train-iters", "10"]
    straight = run_distributed(train, 2, [*run, "--save", str(save), "--save-interval", "5"], True)[-1]
    resumed = run_distributed(train, 2, [*run, "--load", str(save), "--ckpt-step", "5"], True)[-1]
    assert len(straight["losses"]) == 10 and len(resumed["losses"]) == 5
    assert resumed["losses"] == straight["losses"][5:]  # bit for bit
    assert resumed["valid_loss"] == straight["valid_loss"]  # the final validation, after a wrap-around
