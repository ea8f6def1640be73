"""Exact resume and resharding, with real training runs on CPU processes (gloo).

* 20 iterations straight == 10, save, fresh processes, load, 10 more: bit for bit, at TP=2 x PP=2 and
  at DP=2 with the distributed optimizer (saved with ``--async-save``).
* A TP=2 x PP=2 checkpoint loaded at TP=1, TP=4, PP=4 and PP=2 x VP=2 x DP=2 with the distributed
  optimizer (and a distributed-optimizer checkpoint loaded at TP=2 without it) continues like the run
  that never changed layout: the first loss is the loaded model on the next batch (a forward pass at
  the new layout), the following ones check the optimizer state (fp32 master, moments, step).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from ckpt_runs import DISTOPT_DP2, TP2_PP2, train  # noqa: E402

from mcore.checkpoint.format import read_tracker  # noqa: E402
from mcore.testing.distributed import run_distributed  # noqa: E402

pytestmark = pytest.mark.slow


def test_resume_is_bit_exact_at_tp2_pp2(tp2pp2_run):
    save, straight = tp2pp2_run
    assert len(straight) == 20 and read_tracker(save) == 20
    resumed = run_distributed(
        train, 4, [*TP2_PP2, "--train-iters", "20", "--load", str(save), "--ckpt-step", "10"]
    )
    assert resumed[-1]["losses"] == straight[10:]  # bit for bit
    assert resumed[-1]["iteration"] == 20 and resumed[-1]["consumed"] == 80


def test_resume_is_bit_exact_with_the_distributed_optimizer_and_async_save(distopt_dp2_run):
    save, straight = distopt_dp2_run
    assert read_tracker(save) == 20  # the last background save was committed before the run ended
    meta = json.loads((save / "iter_0000010" / "metadata.json").read_text())
    assert meta["layout"]["use_distributed_optimizer"] and meta["layout"]["data_parallel_size"] == 2
    assert {"optim_tp00_pp000_dp000.pt", "optim_tp00_pp000_dp001.pt"} <= set(meta["files"])
    # every data-parallel rank wrote a piece of the optimizer state: flat ranges of the local tensor
    pieces = [r for r in meta["records"] if r["kind"] == "exp_avg" and r["file"].endswith("dp001.pt")]
    assert pieces and all(r["numel"] == r["flat_range"][1] - r["flat_range"][0] for r in pieces)
    resumed = run_distributed(
        train, 2, [*DISTOPT_DP2, "--train-iters", "20", "--load", str(save), "--ckpt-step", "10"]
    )
    assert resumed[-1]["losses"] == straight[10:]


# load iteration 10, train 3 iterations (the same 20-iteration LR schedule), exit
CONTINUE_FROM_10 = ["--train-iters", "20", "--exit-interval", "13", "--ckpt-step", "10", "--load"]
RESHARD_LAYOUTS = {
    "tp1_pp1": (1, []),
    "tp4_pp1": (4, ["--tensor-model-parallel-size", "4"]),
    "tp1_pp4": (4, ["--pipeline-model-parallel-size", "4"]),
    "pp2_vp2_dp2_distopt": (
        4,
        ["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2", *DISTOPT_DP2],
    ),
}


def _assert_continues(losses, expected):
    # step 1 is the loaded weights at the new layout on the next batch; the later steps also need the
    # optimizer state (fp32 masters, moments, step counts) carried over. Only the summation order
    # differs between layouts: within a few float32 ulps.
    assert len(losses) == len(expected)
    assert losses == pytest.approx(expected, rel=1e-6, abs=0)


@pytest.mark.parametrize("layout", sorted(RESHARD_LAYOUTS))
def test_tp2_pp2_checkpoint_continues_at_another_layout(tp2pp2_run, layout):
    save, straight = tp2pp2_run
    nprocs, extra = RESHARD_LAYOUTS[layout]
    results = run_distributed(train, nprocs, [*extra, *CONTINUE_FROM_10, str(save)])
    _assert_continues(results[-1]["losses"], straight[10:13])


def test_distributed_optimizer_checkpoint_continues_without_it_at_tp2(distopt_dp2_run):
    save, straight = distopt_dp2_run
    results = run_distributed(train, 2, ["--tensor-model-parallel-size", "2", *CONTINUE_FROM_10, str(save)])
    _assert_continues(results[-1]["losses"], straight[10:13])


def test_bf16_resume_is_bit_exact_and_keeps_the_fp32_masters(tmp_path):
    from mcore.checkpoint import load_logical_model_state

    save = tmp_path / "ckpt"
    run = ["--bf16", *DISTOPT_DP2, "--train-iters", "6"]
    straight = run_distributed(train, 2, [*run, "--save", str(save), "--save-interval", "3"])
    resumed = run_distributed(train, 2, [*run, "--load", str(save), "--ckpt-step", "3"])
    assert resumed[-1]["losses"] == straight[-1]["losses"][3:]
    weights, meta = load_logical_model_state(save)
    masters, _ = load_logical_model_state(save, use_fp32_master=True)
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    assert weights[name].dtype == torch.bfloat16 and masters[name].dtype == torch.float32
    assert torch.equal(masters[name].bfloat16(), weights[name])
    assert any(r["kind"] == "main_param" for r in meta["records"])


PRECISION_AWARE = [
    "--bf16",
    "--use-precision-aware-optimizer",
    "--main-grads-dtype", "bf16",
    "--exp-avg-dtype", "bf16",
    "--exp-avg-sq-dtype", "bf16",
]  # fmt: skip


def test_resume_is_bit_exact_with_the_precision_aware_optimizer(tmp_path):
    """The fp32 masters stored as bf16 parameter + 16-bit remainder are saved as fp32 and restored
    exactly (saving used to fail: the entry has no fp32 tensor of its own)."""
    save = tmp_path / "ckpt"
    common = [*PRECISION_AWARE, "--train-iters", "8", "--save", str(save)]
    straight = run_distributed(train, 1, [*common, "--save-interval", "4"])[0]["losses"]
    resumed = run_distributed(train, 1, [*common, "--load", str(save), "--ckpt-step", "4"])[0]["losses"]
    assert len(straight) == 8 and resumed == straight[4:]
