"""Megatron-LM's Adam state read from its checkpoints, against the real megatron-core: ``--ckpt-format
torch`` (``model_optim_rng.pt``'s ``optimizer``; ``distrib_optim.pt`` with ``--use-distributed-optimizer``)
and ``torch_dist`` (model-space ``optimizer.state.*`` tensors; the distributed optimizer's bucket-space
``dp_reshardable`` buckets, Megatron-LM's default).

megatron-core trains a tiny GPT (4 layers, hidden 64, tied embeddings, vocabulary padded to 256) at
TP=2 for 3 Adam iterations on gloo (fp32 and ``--bf16``, with and without its distributed optimizer), saves in both formats, and trains 3 more
(:mod:`megatron_optim_runs`). mcore, from either format,

* loads each checkpoint at TP=1 into its per-parameter optimizer: ``exp_avg``, ``exp_avg_sq``, the
  fp32 main parameters and the Adam step equal Megatron's own per-parameter state (read through its
  optimizer objects), mapped by name (TP shards concatenated);
* resumes training from it (``pretrain``, optimizer state and schedule loaded) at TP=1 with the
  per-parameter optimizer, and at DP=2 with the distributed one, and gives Megatron's losses of the 3
  continued iterations; with ``--no-load-optim`` (fresh Adam moments) they differ, so the comparison
  sees the state;
* refuses, naming the file, a missing ``distrib_optim.pt``, SGD state and bucket-space torch_dist
  state whose buckets do not fit the args' grad-buffer layout, when (and only when) a run asks for the
  optimizer state.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys

import pytest
import torch

pytest.importorskip("megatron.core")

sys.path.insert(0, os.path.dirname(__file__))
import megatron_optim_runs as mo  # noqa: E402

from mcore.checkpoint import CheckpointConfig, CheckpointError, load_checkpoint  # noqa: E402
from mcore.checkpoint.megatron.detect import check_megatron_load, read_any_metadata  # noqa: E402
from mcore.checkpoint.megatron.names import COLUMN, QKV, REPLICATED, ROW, VOCAB, map_name  # noqa: E402
from mcore.distributed.groups import ProcessGroups  # noqa: E402
from mcore.testing.distributed import run_distributed  # noqa: E402

LOSS_TOL = 1e-5
ITER_DIR = f"iter_{mo.SAVED_AT:07d}"


VARIANTS = [  # (name, Megatron's distributed optimizer, --bf16)
    ("per_param", False, False),
    ("distributed", True, False),
    ("per_param_bf16", False, True),
    ("distributed_bf16", True, True),
]


@pytest.fixture(scope="module")
def megatron_runs(tmp_path_factory):
    """``{variant: (dir, losses)}``: megatron-core's checkpoints of iteration 3 (``dir/torch``,
    ``dir/torch_dist``), its per-parameter reference state (``dir/reference_tp<r>.pt``) and its losses."""
    out = tmp_path_factory.mktemp("megatron")
    results = run_distributed(mo.train_variants, 2, str(out), mo.FAMILY, VARIANTS, timeout=400)
    return {name: (out / name, results[0][name]) for name, _, _ in VARIANTS}


@functools.cache
def megatron_reference(path) -> dict:
    return torch.load(path)


def megatron_whole(out, name: str, kind: str) -> torch.Tensor:
    """Megatron's state ``kind`` of parameter ``name``, its TP=2 shards joined as mcore's TP=1 tensor."""
    shards = [megatron_reference(out / f"reference_tp{r}.pt")[name][kind] for r in range(2)]
    split = map_name(name, 0, swiglu=False, tied=True).split
    if split == REPLICATED:
        return shards[0]
    assert split in (COLUMN, QKV, VOCAB, ROW)
    return torch.cat(shards, dim=1 if split == ROW else 0)


FORMATS = [  # (variant, checkpoint directory): the bucket-space layout exists for the distributed optimizer
    *((name, fmt) for fmt in ("torch", "torch_dist") for name, _, _ in VARIANTS),
    *((name, "torch_dist_bucket_space") for name, distributed, _ in VARIANTS if distributed),
]


def load_into_per_param_optimizer(load: str, bf16: bool = False):
    """mcore's model and per-parameter optimizer at TP=1, loaded from ``load``."""
    from mcore.checkpoint.checkpoint_args import checkpoint_model_flags
    from mcore.inference.loading import build_model_chunk
    from mcore.models.transformer.model_config import ModelConfig
    from mcore.optimizer import build_optimizer
    from mcore.optimizer.config import OptimizerConfig, PrecisionConfig

    groups = ProcessGroups.single()
    cfg = ModelConfig(**{**checkpoint_model_flags(load), "hidden_dropout": 0.0, "attention_dropout": 0.0})
    dtype = torch.bfloat16 if bf16 else torch.float32
    model = build_model_chunk(cfg, groups, 256, None, device=torch.device("cpu"), params_dtype=dtype)
    optimizer = build_optimizer(OptimizerConfig(), PrecisionConfig(bf16=bf16), [model], groups, lr=mo.LR)
    state = load_checkpoint(CheckpointConfig(load=load), [model], optimizer, None, groups)
    assert state["iteration"] == mo.SAVED_AT
    return model, optimizer


@pytest.mark.parametrize("kind,fmt", FORMATS)
def test_adam_state_equals_megatron_by_name(megatron_runs, kind, fmt):
    out, _ = megatron_runs[kind]
    bf16 = kind.endswith("bf16")
    dtype = torch.bfloat16 if bf16 else torch.float32
    _, optimizer = load_into_per_param_optimizer(str(out / fmt), bf16)

    reference = megatron_reference(out / "reference_tp0.pt")
    assert {e.key for e in optimizer.main_params} == set(reference)
    for entry in optimizer.main_params:
        shape = tuple(entry.model_param.shape)
        assert entry.state["step"] == mo.SAVED_AT, entry.key
        assert entry.model_param.dtype == dtype
        for name, ours in (
            ("exp_avg", entry.state["exp_avg"]),
            ("exp_avg_sq", entry.state["exp_avg_sq"]),
            ("param", optimizer.master_of(entry)),  # fp32 (bf16: Megatron's fp32 main parameters)
        ):
            want = megatron_whole(out, entry.key, name)
            assert torch.equal(ours.view(shape), want), f"{entry.key} {name}"


TO_TP1 = ("per_param", 1, ["--micro-batch-size", "4"])
TO_DISTOPT_DP2 = ("distributed", 2, ["--micro-batch-size", "2", "--use-distributed-optimizer"])


def test_bucket_space_saved_at_dp2_equals_the_model_space_state(tmp_path):
    """Megatron at DP=2 stores each bucket's two DP shards as pieces of one tensor (a parameter cut
    where the first shard ends): read from there, every parameter's state equals the same run's
    ``fully_reshardable`` (model-space) save, which the tests above check against Megatron's own."""
    assert run_distributed(mo.train_save_dp_layouts, 2, str(tmp_path), mo.FAMILY, timeout=300) == [2, 2]
    states = []
    for sharding in ("fully_reshardable", "dp_reshardable"):
        _, optimizer = load_into_per_param_optimizer(str(tmp_path / sharding))
        states.append(
            {
                e.key: (e.state["step"], e.state["exp_avg"], e.state["exp_avg_sq"], optimizer.master_of(e))
                for e in optimizer.main_params
            }
        )
    model_space, bucket_space = states
    assert model_space.keys() == bucket_space.keys()
    for key, (step, *tensors) in model_space.items():
        assert step == bucket_space[key][0] == mo.SAVED_AT, key
        assert tensors[0].abs().sum() > 0, key  # trained moments, not zeros
        for ours, want in zip(bucket_space[key][1:], tensors):
            assert torch.equal(ours, want), key


@pytest.mark.parametrize(
    "kind,world,extra,fmt",
    [
        pytest.param(*TO_TP1, "torch", id="megatron-tp2-to-tp1-torch"),
        pytest.param(*TO_TP1, "torch_dist", id="megatron-tp2-to-tp1-torch_dist"),
        pytest.param(*TO_DISTOPT_DP2, "torch", id="megatron-distopt-tp2-to-distopt-dp2-torch"),
        pytest.param(*TO_DISTOPT_DP2, "torch_dist", id="megatron-distopt-tp2-to-distopt-dp2-torch_dist"),
        pytest.param(
            *TO_DISTOPT_DP2,
            "torch_dist_bucket_space",
            id="megatron-distopt-tp2-to-distopt-dp2-torch_dist_bucket_space",
        ),
    ],
)
def test_resumed_losses_match_megatron(megatron_runs, tmp_path, kind, world, extra, fmt):
    out, megatron = megatron_runs[kind]
    result = run_distributed(mo.mcore_resume, world, str(out / fmt), str(tmp_path / "s"), extra, timeout=300)
    losses, want = result[0]["losses"], megatron["continued"]
    print(f"{kind} {fmt}: mcore {losses} Megatron {want}")
    assert result[0]["iteration"] == mo.TRAIN_ITERS
    assert len(losses) == mo.CONTINUE
    assert torch.allclose(torch.tensor(losses), torch.tensor(want), rtol=0, atol=LOSS_TOL)
    if (
        kind == "per_param" and fmt == "torch"
    ):  # the control: a fresh Adam state gives other losses after the first step
        fresh = run_distributed(
            mo.mcore_resume,
            1,
            str(out / "torch"),
            str(tmp_path / "f"),
            [*extra, "--no-load-optim"],
            timeout=300,
        )[0]["losses"]
        assert abs(fresh[0] - want[0]) < LOSS_TOL  # the same weights
        assert abs(fresh[-1] - want[-1]) > 100 * LOSS_TOL


def test_missing_distrib_optim_is_named_only_when_the_state_is_asked_for(megatron_runs, tmp_path):
    out, _ = megatron_runs["distributed"]
    copy = tmp_path / "ckpt"
    shutil.copytree(out / "torch" / ITER_DIR, copy)
    (copy / "mp_rank_01" / "distrib_optim.pt").unlink()
    meta = read_any_metadata(copy)
    assert check_megatron_load(copy, meta, load_optim=False)  # the weights still load
    with pytest.raises(CheckpointError, match=r"mp_rank_01/distrib_optim\.pt is missing.*--no-load-optim"):
        check_megatron_load(copy, meta, load_optim=True)


def test_sgd_state_is_refused_naming_the_checkpoint(megatron_runs, tmp_path):
    out, _ = megatron_runs["per_param"]
    copy = tmp_path / "ckpt"
    shutil.copytree(out / "torch" / ITER_DIR, copy)
    for sub in ("mp_rank_00", "mp_rank_01"):
        path = copy / sub / "model_optim_rng.pt"
        data = torch.load(path, weights_only=False)
        data["args"].optimizer = "sgd"
        torch.save(data, path)
    meta = read_any_metadata(copy)
    with pytest.raises(CheckpointError, match=rf"{copy}: the optimizer state is 'sgd'.*--no-load-optim"):
        check_megatron_load(copy, meta, load_optim=True)


def test_bucket_space_state_that_does_not_fit_the_args_is_refused_naming_it(megatron_runs, tmp_path):
    """Buckets of another grad-buffer layout (here: args claiming 1000-element buckets with
    --overlap-grad-reduce) are refused, naming the checkpoint, only when the state is asked for."""
    out, _ = megatron_runs["distributed"]
    copy = tmp_path / "ckpt"
    shutil.copytree(out / "torch_dist_bucket_space" / ITER_DIR, copy)
    common = torch.load(copy / "common.pt", weights_only=False)
    common["args"].overlap_grad_reduce = True
    common["args"].ddp_bucket_size = 1000
    torch.save(common, copy / "common.pt")
    meta = read_any_metadata(copy)
    assert check_megatron_load(copy, meta, load_optim=False)  # the weights still load
    with pytest.raises(
        CheckpointError, match=rf"{copy}: no parameter order fits the distributed optimizer's"
    ):
        check_megatron_load(copy, meta, load_optim=True)
