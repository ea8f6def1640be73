"""Expert parallelism through the real ``pretrain`` loop: every layout gives the single-process losses
and gradient norms (dropout off), and an EP=2 checkpoint resumes bit-exactly at EP=2 and loads at
EP=4, TP=2 x PP=2 and one process.

One 4-rank launch trains every layout in a row (tiny model, 3-4 iterations each); the single-process
references run in the test's own process.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from moe_runs import VARIANTS, run_case, run_cases  # noqa: E402

from mcore.testing.distributed import run_distributed  # noqa: E402

ITERS = ["--train-iters", "3"]
EP2, EP4 = ["--expert-model-parallel-size", "2"], ["--expert-model-parallel-size", "4"]
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
ALLGATHER = ["--moe-token-dispatcher-type", "allgather"]
DISTOPT = ["--use-distributed-optimizer"]

# name -> (variant, layout flags)
LAYOUTS = {
    "ep2": ("dropless", EP2),
    "ep4-allgather": ("dropless", [*EP4, *ALLGATHER]),
    "tp2-sp-ep2": ("dropless", [*TP2_SP, *EP2, "--expert-tensor-parallel-size", "1"]),
    "tp2-sp-ep2-etp2-allgather": ("dropless", [*TP2_SP, *EP2, *ALLGATHER]),
    "pp2-ep2": ("dropless", ["--pipeline-model-parallel-size", "2", *EP2]),
    "pp2-vp2-ep2": (
        "four-layers",
        ["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2", *EP2],
    ),
    "ep2-distopt-overlap": ("dropless", [*EP2, *DISTOPT, "--overlap-grad-reduce", "--overlap-param-gather"]),
    "capacity-ep2": ("capacity", EP2),
    "capacity-ep4-allgather": ("capacity", [*EP4, *ALLGATHER]),
    "sigmoid-bias-shared-ep2": ("sigmoid-bias-shared", EP2),
}

# checkpoint: 4 iterations at EP=2 with the distributed optimizer, saved at 2; then continue from 2
# (the sigmoid router with expert bias: the bias, a persistent buffer, must come back too)
CKPT_ITERS = ["--train-iters", "4", "--lr-decay-style", "constant", *VARIANTS["sigmoid-bias-shared"]]


def _ckpt_cases(save: str) -> list[tuple[str, list[str]]]:
    load = ["--load", save, "--ckpt-step", "2", *CKPT_ITERS]
    return [
        ("save-ep2", [*CKPT_ITERS, *EP2, *DISTOPT, "--save", save, "--save-interval", "2"]),
        ("resume-ep2", [*load, *EP2, *DISTOPT]),
        ("load-ep4", [*load, *EP4]),
        ("load-tp2-pp2", [*load, *TP2_SP, "--pipeline-model-parallel-size", "2", *DISTOPT, *ALLGATHER]),
    ]


def _compare(got: dict, want: dict, what: str) -> None:
    assert len(got["losses"]) == len(want["losses"]) > 0, what
    assert got["losses"] == pytest.approx(want["losses"], rel=2e-5, abs=0), what
    assert got["grad_norms"] == pytest.approx(want["grad_norms"], rel=1e-4), what


def test_expert_parallel_layouts_and_checkpoints_match_one_process(tmp_path):
    refs = {
        name: run_case([*ITERS, *flags], str(tmp_path / f"ref-{name}.jsonl"))
        for name, flags in VARIANTS.items()
    }
    cases = [(name, [*ITERS, *VARIANTS[variant], *flags]) for name, (variant, flags) in LAYOUTS.items()]
    cases += _ckpt_cases(str(tmp_path / "ckpt"))
    results = run_distributed(run_cases, 4, cases, str(tmp_path), timeout=900)
    last = results[-1]  # the last rank logs (the last pipeline stage)
    for name, (variant, _) in LAYOUTS.items():
        _compare(last[name], refs[variant], name)
    # capacity dropping is on (the dropless model computes something else) and drops alike everywhere
    assert refs["capacity"]["losses"] != pytest.approx(refs["dropless"]["losses"], rel=1e-6)

    straight = last["save-ep2"]["losses"]
    assert len(straight) == 4 and last["save-ep2"]["iteration"] == 4
    assert last["resume-ep2"]["losses"] == straight[2:]  # bit for bit
    for name in ("load-ep4", "load-tp2-pp2"):
        assert last[name]["losses"] == pytest.approx(straight[2:], rel=2e-5, abs=0), name
    one = run_case(["--load", str(tmp_path / "ckpt"), "--ckpt-step", "2", *CKPT_ITERS])
    assert one["losses"] == pytest.approx(straight[2:], rel=2e-5, abs=0)
    _check_saved_experts(tmp_path / "ckpt" / "iter_0000002")


def _check_saved_experts(iter_dir: Path) -> None:
    """The EP=2 checkpoint: experts under their logical names with the global expert axis, written once
    per ep rank; the inspector shows them; a model with another expert count is refused by name."""
    import io

    import torch

    from mcore.checkpoint.compat import check_compatible
    from mcore.checkpoint.format import CheckpointError, read_metadata
    from mcore.checkpoint.geometry import full_placement
    from mcore.checkpoint.inspect import describe
    from mcore.checkpoint.reader import ShardReader

    meta = read_metadata(iter_dir)
    assert meta["layout"]["expert_model_parallel_size"] == 2
    name = "decoder.layers.1.mlp.experts.linear_fc1.weight"
    params = [r for r in meta["records"] if r["name"] == name and r["kind"] == "param"]
    assert [r["global_shape"] for r in params] == [[4, 32, 16]] * 2  # [E, 2F, H], one block per ep rank
    assert sorted(r["boxes"][0][0][0] for r in params) == [0, 2] and {r["expert_dim"] for r in params} == {0}
    assert sorted(r["file"] for r in params) == [
        "model_experts_tp00_ep000_pp000.pt",
        "model_experts_tp00_ep001_pp000.pt",
    ]
    # distributed optimizer: the expert moments sharded over edp=2 cover each ep rank's block once
    moments = [r for r in meta["records"] if r["name"] == name and r["kind"] == "exp_avg"]
    assert sum(r["numel"] for r in moments) == 4 * 32 * 16
    # the router's expert bias (a buffer, moved by the token counts) is stored once, and has moved
    bias = [r for r in meta["records"] if r["name"] == "decoder.layers.1.mlp.router.expert_bias"]
    assert [r["kind"] for r in bias] == ["buffer"]
    stored = ShardReader(iter_dir, meta).tensor(bias[0])
    assert stored.shape == (4,) and stored.abs().sum() > 0
    out = io.StringIO()
    assert describe(iter_dir, out=out) == 0
    text = out.getvalue()
    assert "ep=2 etp=1" in text and f"{name}" in text and "experts: 4 on dim 0" in text
    with pytest.raises(
        CheckpointError, match=r"num_experts mismatch .* the checkpoint has 4 experts, this model has 8"
    ):
        ShardReader(iter_dir, meta).fill(name, "param", full_placement((8, 32, 16)), torch.empty(8 * 32 * 16))
    wanted = {"model": {**meta["run_config"]["model"], "num_experts": 8}}
    with pytest.raises(CheckpointError, match=rf"{iter_dir}.*num_experts: the checkpoint has 4, this run 8"):
        check_compatible(iter_dir, meta, wanted)
