"""Megatron mixture-of-experts checkpoints in and out (``--ckpt-format torch``, EP=1), against the
real megatron-core: its GPTModel with the local MoE spec (4 SwiGLU experts, top 2, a gated shared
expert, QK layernorm) saved at TP=1 loads into mcore with equal logits; ``mcore-export-megatron``
writes it back (``mlp.experts.local_experts.N.*``) and megatron-core loads the export (strict) with
mcore's logits; the same checkpoint rewritten as Megatron's EP=2 rank files (``mp_rank_00_EEE``, local
and grouped expert names) reads the same tensors. The DeepSeek-V3 family's Megatron checkpoints too:
megatron-core's GPTModel from the local spec with multi-latent attention (YaRN, the q/kv latent
norms), the first layer dense, a sigmoid group-limited router with scaling, expert bias and a shared
expert, and one MTP depth (``mtp.layers.0.transformer_layer.*``), saved as Megatron-LM saves it, loads
into mcore with equal logits and MTP loss; ``mcore-export-megatron`` writes it back and megatron-core
loads the export (strict) with equal logits, MTP loss and expert bias. One spawned process runs
megatron-core's side of both (the stand-ins MLA needs on CPU: ``megatron_mla_runs``)."""

from __future__ import annotations

import os
import re
import shutil
import sys

import pytest
import torch

pytest.importorskip("megatron.core")

sys.path.insert(0, os.path.dirname(__file__))
import megatron_mla_runs as mm  # noqa: E402
import megatron_runs as mr  # noqa: E402

from mcore.checkpoint import CheckpointError, load_logical_model_state  # noqa: E402
from mcore.checkpoint.megatron.args import check_supported  # noqa: E402
from mcore.checkpoint.megatron.write import export_to_megatron  # noqa: E402
from mcore.distributed.groups import ProcessGroups  # noqa: E402
from mcore.inference.loading import build_model_chunk, model_config_from_run_config  # noqa: E402
from mcore.testing.distributed import run_distributed  # noqa: E402

V = mr.FAMILIES["moe"]["vocab_size"]
V_MLA = mr.FAMILIES[mm.FAMILY]["vocab_size"]


def _megatron_side(tmp: str) -> dict:
    """Rank function (one process): megatron-core saves the MoE model under ``tmp/megatron`` (with its
    logits), mcore exports that checkpoint to ``tmp/export``, megatron-core loads the export (strict);
    then the same for the DeepSeek-V3-style model (``tmp/mla``, ``tmp/mla-export``)."""
    out, export = os.path.join(tmp, "megatron"), os.path.join(tmp, "export")
    mr.save_megatron_checkpoints(out, "moe", 1, 1)
    export_to_megatron(os.path.join(out, "torch"), export, "torch", tp=1, pp=1)
    moe = mr.megatron_load_logits(export, "moe", "torch")
    return {"moe": moe, "mla": mm.save_and_reload(os.path.join(tmp, "mla"), os.path.join(tmp, "mla-export"))}


@pytest.fixture(scope="module")
def megatron_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("megatron-core")
    return {"tmp": tmp, **run_distributed(_megatron_side, 1, str(tmp), timeout=300)[0]}


def _mcore_logits(ckpt: str, ids: torch.Tensor) -> torch.Tensor:
    state, meta = load_logical_model_state(ckpt)
    cfg = model_config_from_run_config(meta["run_config"], hidden_dropout=0.0, attention_dropout=0.0)
    assert cfg.num_experts == 4 and cfg.moe_shared_expert_gate and cfg.qk_layernorm
    model = build_model_chunk(cfg, ProcessGroups.single(), V, state, device=torch.device("cpu"))
    with torch.no_grad():
        return model(ids)[..., :V]


def test_a_megatron_moe_checkpoint_loads_and_exports_back(megatron_runs, tmp_path):
    out, export = megatron_runs["tmp"] / "megatron", megatron_runs["tmp"] / "export"
    theirs = megatron_runs["moe"]
    ref = torch.load(out / "logits.pt")
    ours = _mcore_logits(str(out / "torch"), ref["ids"])
    assert (ours - ref["logits"][..., :V]).abs().max() < 1e-5  # Megatron -> mcore
    assert (theirs[..., :V] - ours).abs().max() < 1e-5  # mcore -> Megatron
    back, _ = load_logical_model_state(str(export))
    original, _ = load_logical_model_state(str(out / "torch"))
    assert back.keys() == original.keys()
    assert all(torch.equal(back[k], original[k]) for k in original)

    with pytest.raises(CheckpointError, match="num_experts=4: mixture-of-experts models are written"):
        export_to_megatron(str(out / "torch"), str(tmp_path / "dist"), "torch_dist", tp=1, pp=1)

    # Expert parallelism: the same checkpoint laid out as Megatron saves it at EP=2 (mp_rank_00_EEE, each
    # holding its 2 local experts; EP rank 1 with the grouped linear_fcK.weightN names) reads the same.
    ep2 = _as_expert_parallel(out / "torch", tmp_path / "ep2")
    again, _ = load_logical_model_state(str(ep2))
    assert again.keys() == original.keys()
    assert all(torch.equal(again[k], original[k]) for k in original)
    shutil.rmtree(next(ep2.glob("iter_*")) / "mp_rank_00_001")
    with pytest.raises(
        CheckpointError, match=r"mp_rank_00_001/model_optim_rng\.pt is missing.*expert_model_parallel_size=2"
    ):
        load_logical_model_state(str(ep2))


def _mcore_outputs(ckpt: str, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """mcore's logits (eval) and per-depth MTP losses (training mode, labels = the inputs)."""
    state, meta = load_logical_model_state(ckpt)
    cfg = model_config_from_run_config(meta["run_config"], hidden_dropout=0.0, attention_dropout=0.0)
    assert cfg.multi_latent_attention and cfg.mtp_num_layers == 1 and cfg.q_lora_rank == 16
    assert cfg.moe_router_enable_expert_bias and cfg.rotary_scaling_factor == 4.0
    model = build_model_chunk(cfg, ProcessGroups.single(), V, state, device=torch.device("cpu"))
    with torch.no_grad():
        logits = model(ids)[..., :V_MLA]
    model.train()
    model(ids, labels=ids)
    return logits, model.mtp.step_losses


def test_a_megatron_mla_mtp_checkpoint_loads_and_exports_back(megatron_runs):
    tmp_path = megatron_runs["tmp"]
    out, export = tmp_path / "mla", tmp_path / "mla-export"
    theirs = megatron_runs["mla"]
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
    args = mm._args()
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
