"""Megatron mixture-of-experts checkpoints in and out, against the real megatron-core.

One 4-process launch (:mod:`megatron_moe_runs`): megatron-core's GPTModel with the local MoE spec (4
SwiGLU experts, top 2, a gated shared expert, QK layernorm) trains 2 Adam iterations at TP=2 x EP=2
(ETP=2, SP, DP=2 for the dense parameters), saves ``--ckpt-format torch`` (``mp_rank_TT_EEE``, each EP
rank's ``local_experts.0/1``, the chained [dense, experts] optimizer state) and ``torch_dist``
(megatron-core's ``dist_checkpointing`` of the model and the optimizer: experts on the global-expert
axis), and trains 2 more;
``mcore-export-megatron``'s code writes the ``torch`` checkpoint back at TP=1 x EP=1 and megatron-core
loads the export (strict). Then mcore

* loads both formats at TP=1 x EP=1 with Megatron's logits (fp32, 1e-5);
* resumes training (optimizer state and schedule loaded; TP=1 x EP=1 x DP=4, in the same launch) and
  gives Megatron's 2 continued losses (the second one depends on the loaded Adam state: measured
  once, it differs by 2e-3 with ``--no-load-optim``);
* reads the Adam state of the ``torch_dist`` checkpoint (the chained optimizer's sharded state) equal
  to the ``torch`` one;
* resumes from the same model trained with megatron-core's DistributedOptimizer at TP=1 x EP=2 x DP=4
  (expert DP=2) and saved as ``--ckpt-format torch`` with ``distrib_optim.pt`` (the chained [dense,
  experts] buffers) with Megatron's continued losses, in the same launch;
* gives megatron-core's logits on its own export, which reads back bitwise;
* reads the export rewritten as EP=2 rank files with TEGroupedMLP's ``linear_fcK.weightN`` names.

The DeepSeek-V3 family's Megatron checkpoints too, in one more (one-process) launch: megatron-core's
GPTModel from the local spec with multi-latent attention (YaRN, the q/kv latent norms), the first
layer dense, a sigmoid group-limited router with scaling, expert bias and a shared expert, and one MTP
depth (``mtp.layers.0.transformer_layer.*``), saved as Megatron-LM saves it, loads into mcore with
equal logits and MTP loss; ``mcore-export-megatron`` writes it back and megatron-core loads the export
(strict) with equal logits, MTP loss and expert bias (the stand-ins MLA needs on CPU:
``megatron_mla_runs``).
"""

from __future__ import annotations

import os
import re
import shutil
import sys

import pytest
import torch

pytest.importorskip("megatron.core")

sys.path.insert(0, os.path.dirname(__file__))
import megatron_mla_runs as mla_runs  # noqa: E402
import megatron_moe_runs as mm  # noqa: E402
import megatron_runs as mr  # noqa: E402

from mcore.checkpoint import CheckpointError, load_logical_model_state  # noqa: E402
from mcore.checkpoint.megatron.args import check_supported  # noqa: E402
from mcore.checkpoint.megatron.write import export_to_megatron  # noqa: E402
from mcore.distributed.groups import ProcessGroups  # noqa: E402
from mcore.inference.loading import build_model_chunk, model_config_from_run_config  # noqa: E402
from mcore.testing.distributed import run_distributed  # noqa: E402

V = 256
TOL = 1e-5


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    """``(dir, result)``: megatron-core's TP=2 x EP=2 checkpoints, logits, losses and export."""
    out = tmp_path_factory.mktemp("megatron_moe")
    return out, run_distributed(mm.megatron_side, 4, str(out), timeout=400)[0]


def _mcore_logits(ckpt: str, ids: torch.Tensor) -> torch.Tensor:
    state, meta = load_logical_model_state(ckpt)
    cfg = model_config_from_run_config(meta["run_config"], hidden_dropout=0.0, attention_dropout=0.0)
    assert cfg.num_experts == 4 and cfg.moe_shared_expert_gate and cfg.qk_layernorm
    model = build_model_chunk(cfg, ProcessGroups.single(), V, state, device=torch.device("cpu"))
    with torch.no_grad():
        return model(ids)[..., :V]


def test_a_tp2_ep2_megatron_checkpoint_loads_at_tp1_ep1_and_resumes(megatron, tmp_path):
    out, result = megatron
    ref = torch.load(out / "logits.pt")
    assert sorted(p.name for p in (out / "torch" / "iter_0000002").iterdir()) == [
        "mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"
    ]  # fmt: skip
    for fmt in ("torch", "torch_dist"):
        diff = (_mcore_logits(str(out / fmt), ref["ids"]) - ref["logits"][..., :V]).abs().max().item()
        print(f"megatron-core TP2xEP2 {fmt} -> mcore TP1xEP1: max |dlogits| = {diff:.2e}")
        assert diff < TOL, fmt

    # the chained optimizer state of all four rank files: mcore continues with Megatron's losses
    print(f"Megatron continued {result['continued']}; mcore (TP1 x EP1 x DP4) {result['mcore_continued']}")
    assert torch.allclose(
        torch.tensor(result["mcore_continued"]), torch.tensor(result["continued"]), atol=TOL
    )


def _adam_state(load: str) -> dict:
    """``{name: (step, exp_avg, exp_avg_sq, fp32 param)}`` of mcore's per-parameter optimizer at TP=1
    x EP=1, loaded from ``load``."""
    from mcore.checkpoint import CheckpointConfig, load_checkpoint
    from mcore.checkpoint.checkpoint_args import checkpoint_model_flags
    from mcore.models.transformer.model_config import ModelConfig
    from mcore.optimizer import build_optimizer
    from mcore.optimizer.config import OptimizerConfig, PrecisionConfig

    groups = ProcessGroups.single()
    cfg = ModelConfig(**{**checkpoint_model_flags(load), "hidden_dropout": 0.0, "attention_dropout": 0.0})
    model = build_model_chunk(cfg, groups, V, None, device=torch.device("cpu"))
    optimizer = build_optimizer(OptimizerConfig(), PrecisionConfig(), [model], groups, lr=1e-3)
    assert load_checkpoint(CheckpointConfig(load=load), [model], optimizer, None, groups)["iteration"] == 2
    return {
        e.key: (e.state["step"], e.state["exp_avg"], e.state["exp_avg_sq"], optimizer.master_of(e))
        for e in optimizer.main_params
    }


def test_torch_dist_adam_state_equals_the_torch_one(megatron):
    """megatron-core's chained optimizer in torch_dist (``chained_0.`` dense, ``chained_1.`` experts on the
    global-expert axis; the steps in common.pt) reads as the torch format's, which the resume checks."""
    out, _ = megatron
    torch_state, dist_state = _adam_state(str(out / "torch")), _adam_state(str(out / "torch_dist"))
    assert torch_state.keys() == dist_state.keys()
    assert any("mlp.experts." in key for key in torch_state)
    for key, (step, *tensors) in torch_state.items():
        assert step == dist_state[key][0] == mm.SAVED_AT, key
        assert tensors[0].abs().sum() > 0, key  # trained moments, not zeros
        for ours, want in zip(dist_state[key][1:], tensors):
            assert torch.equal(ours, want), key


def test_distributed_optimizer_state_of_an_moe_checkpoint_resumes(megatron, tmp_path):
    """``--use-distributed-optimizer`` at TP=1 x EP=2 x DP=4 (expert DP=2): each rank file's
    ``distrib_optim.pt`` holds the chained [dense, experts] buffers (EP rank 1's dense entry None);
    mcore resumes from it with Megatron's continued losses."""
    out, result = megatron
    iter_dir = out / "distopt" / "torch" / "iter_0000002"
    assert sorted(p.name for p in iter_dir.iterdir()) == ["mp_rank_00_000", "mp_rank_00_001"]
    states = [
        torch.load(iter_dir / d / "distrib_optim.pt", weights_only=False)
        for d in sorted(os.listdir(iter_dir))
    ]
    assert [[s is None for s in state] for state in states] == [[False, False], [True, False]]
    ours = _adam_state(str(out / "distopt" / "torch"))
    experts = [key for key in ours if "mlp.experts." in key]
    assert experts
    for key, (step, exp_avg, *_) in ours.items():
        assert step == mm.SAVED_AT, key
        for e in range(4) if key in experts else [None]:  # every expert's moments: both EP ranks' files
            assert (exp_avg if e is None else exp_avg.reshape(4, -1)[e]).abs().sum() > 0, (key, e)
    theirs = result["distopt"]
    print(
        f"Megatron (distributed optimizer) continued {theirs['continued']}; mcore {theirs['mcore_continued']}"
    )
    assert torch.allclose(
        torch.tensor(theirs["mcore_continued"]), torch.tensor(theirs["continued"]), atol=TOL
    )

    copy = tmp_path / "distopt"
    shutil.copytree(out / "distopt" / "torch", copy)
    (copy / "iter_0000002" / "mp_rank_00_001" / "distrib_optim.pt").unlink()
    assert load_logical_model_state(str(copy))[0]  # the weights still load
    with pytest.raises(
        CheckpointError, match=r"mp_rank_00_001/distrib_optim\.pt is missing.*--no-load-optim"
    ):
        _adam_state(str(copy))


def test_megatron_core_loads_mcore_export_of_it(megatron, tmp_path):
    out, result = megatron
    export = out / "export"
    ours = _mcore_logits(str(out / "torch"), torch.load(out / "logits.pt")["ids"])
    assert (result["export_logits"][..., :V] - ours).abs().max() < TOL  # mcore -> Megatron
    back, _ = load_logical_model_state(str(export))
    original, _ = load_logical_model_state(str(out / "torch"))
    assert back.keys() == original.keys()
    assert all(torch.equal(back[k], original[k]) for k in original)

    with pytest.raises(CheckpointError, match="num_experts=4: mixture-of-experts models are written"):
        export_to_megatron(str(out / "torch"), str(tmp_path / "dist"), "torch_dist", tp=1, pp=1)

    # The export laid out as Megatron saves it at EP=2 (mp_rank_00_EEE, each holding its 2 local experts;
    # EP rank 1 with TEGroupedMLP's grouped linear_fcK.weightN names) reads the same.
    ep2 = _as_expert_parallel(export, tmp_path / "ep2")
    again, _ = load_logical_model_state(str(ep2))
    assert again.keys() == original.keys()
    assert all(torch.equal(again[k], original[k]) for k in original)
    shutil.rmtree(next(ep2.glob("iter_*")) / "mp_rank_00_001")
    with pytest.raises(
        CheckpointError, match=r"mp_rank_00_001/model_optim_rng\.pt is missing.*expert_model_parallel_size=2"
    ):
        load_logical_model_state(str(ep2))


def _as_expert_parallel(src, dst):
    """``src`` (EP=1, TP=1, PP=1) rewritten as megatron-core's EP=2 rank files."""
    shutil.copytree(src, dst)
    iter_dir = next(dst.glob("iter_*"))
    data = torch.load(iter_dir / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
    shutil.rmtree(iter_dir / "mp_rank_00")
    data["args"].expert_model_parallel_size = 2
    for e in range(2):
        model = {}
        for key, value in data["model"].items():
            match = re.search(r"local_experts\.(\d+)\.(linear_fc[12])\.(weight|_extra_state)$", key)
            if match is None:
                model[key] = value  # dense tensors: replicated over EP
                continue
            n, fc, kind = int(match.group(1)), match.group(2), match.group(3)
            if n // 2 != e:
                continue
            base = key[: match.start()]
            if e == 1 and kind == "weight":  # TEGroupedMLP's spelling
                model[f"{base}{fc}.weight{n % 2}"] = value
            elif kind == "weight":
                model[f"{base}local_experts.{n % 2}.{fc}.weight"] = value
        folder = iter_dir / f"mp_rank_00_{e:03d}"
        folder.mkdir()
        torch.save({**data, "model": model}, folder / "model_optim_rng.pt")
    return dst


V_MLA = mr.FAMILIES[mla_runs.FAMILY]["vocab_size"]
V_MLA_BUILD = mr.FAMILIES["moe"]["vocab_size"]


def _mla_side(tmp: str) -> dict:
    """Rank function (one process): megatron-core saves the DeepSeek-V3-style model under ``tmp/mla``
    (with its logits), mcore exports it to ``tmp/mla-export``, megatron-core loads the export."""
    return {"mla": mla_runs.save_and_reload(os.path.join(tmp, "mla"), os.path.join(tmp, "mla-export"))}


@pytest.fixture(scope="module")
def megatron_mla(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("megatron-core-mla")
    return {"tmp": tmp, **run_distributed(_mla_side, 1, str(tmp), timeout=300)[0]}


def _mcore_outputs(ckpt: str, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """mcore's logits (eval) and per-depth MTP losses (training mode, labels = the inputs)."""
    state, meta = load_logical_model_state(ckpt)
    cfg = model_config_from_run_config(meta["run_config"], hidden_dropout=0.0, attention_dropout=0.0)
    assert cfg.multi_latent_attention and cfg.mtp_num_layers == 1 and cfg.q_lora_rank == 16
    assert cfg.moe_router_enable_expert_bias and cfg.rotary_scaling_factor == 4.0
    model = build_model_chunk(cfg, ProcessGroups.single(), V_MLA_BUILD, state, device=torch.device("cpu"))
    with torch.no_grad():
        logits = model(ids)[..., :V_MLA]
    model.train()
    model(ids, labels=ids)
    return logits, model.mtp.step_losses


def test_a_megatron_mla_mtp_checkpoint_loads_and_exports_back(megatron_mla):
    tmp_path = megatron_mla["tmp"]
    out, export = tmp_path / "mla", tmp_path / "mla-export"
    theirs = megatron_mla["mla"]
    saved, loaded = theirs["saved"], theirs["loaded"]
    logits, mtp = _mcore_outputs(str(out / "torch"), saved["ids"])
    assert (logits - saved["logits"][..., :V_MLA]).abs().max() < 1e-5  # Megatron -> mcore
    assert torch.allclose(mtp, saved["mtp"], rtol=1e-5, atol=0), (mtp, saved["mtp"])
    assert (loaded["logits"][..., :V_MLA] - logits).abs().max() < 1e-5  # mcore -> Megatron
    assert torch.allclose(loaded["mtp"], mtp, rtol=1e-5, atol=0)
    assert [b.tolist() for b in theirs["bias"]] == [pytest.approx([0.3, -0.2, 0.1, -0.4])] * 2
    back, _ = load_logical_model_state(str(export))
    original, _ = load_logical_model_state(str(out / "torch"))
    assert back.keys() == original.keys() and any(k.startswith("mtp.layers.0.mtp_model_layer.") for k in back)
    assert all(torch.equal(back[k], original[k]) for k in original)

    with pytest.raises(
        CheckpointError, match="target-tensor-model-parallel-size 2 with multi_latent_attention"
    ):
        export_to_megatron(str(out / "torch"), str(tmp_path / "tp2"), "torch", tp=2, pp=1)
    with pytest.raises(CheckpointError, match="mtp_num_layers=1: multi-latent attention and multi-token"):
        export_to_megatron(str(out / "torch"), str(tmp_path / "dist"), "torch_dist", tp=1, pp=1)
    args = mla_runs._args()
    args.num_experts = None  # (a MoE torch_dist checkpoint is refused for its experts first)
    with pytest.raises(
        CheckpointError, match="args.multi_latent_attention=True: multi-latent attention is read"
    ):
        check_supported(args, "ckpt")  # the torch_dist reader
    args.tensor_model_parallel_size = 2
    with pytest.raises(
        CheckpointError, match="tensor_model_parallel_size=2: multi-latent attention checkpoints"
    ):
        check_supported(args, "ckpt", moe=True)


def test_megatron_mla_and_mtp_names_of_the_te_spec_and_later_versions():
    """Transformer Engine's spec fuses the latent norms into the up projections; megatron-core after
    0.16 names an MTP depth's layer ``mtp_model_layer``: both map to mcore's names."""
    from mcore.checkpoint.megatron.names import COLUMN, REPLICATED, SWIGLU, Target, map_name

    def target(key):
        return map_name(key, 2, swiglu=True, tied=False)

    attn = "decoder.layers.1.self_attention."
    assert target(attn + "linear_q_up_proj.layer_norm_weight") == Target(
        "decoder.layers.3.self_attention.q_layernorm.weight", REPLICATED
    )
    assert target(attn + "linear_kv_up_proj.layer_norm_weight").name.endswith(".kv_layernorm.weight")
    assert target(attn + "linear_kv_up_proj.weight").split == COLUMN
    for layer in ("transformer_layer", "mtp_model_layer"):  # MTP depths keep their own numbers
        got = target(f"mtp.layers.0.{layer}.mlp.linear_fc1.weight")
        assert got == Target("mtp.layers.0.mtp_model_layer.mlp.linear_fc1.weight", SWIGLU)
    assert target("mtp.layers.1.eh_proj.weight") == Target("mtp.layers.1.eh_proj.weight", COLUMN)
