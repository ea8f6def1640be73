"""Megatron mixture-of-experts checkpoints in and out (``--ckpt-format torch``, EP=1), against the
real megatron-core: its GPTModel with the local MoE spec (4 SwiGLU experts, top 2, a gated shared
expert, QK layernorm) saved at TP=1 loads into mcore with equal logits; ``mcore-export-megatron``
writes it back (``mlp.experts.local_experts.N.*``) and megatron-core loads the export (strict) with
mcore's logits; the same checkpoint rewritten as Megatron's EP=2 rank files (``mp_rank_00_EEE``, local
and grouped expert names) reads the same tensors. One spawned process runs megatron-core's side."""

from __future__ import annotations

import os
import re
import shutil
import sys

import pytest
import torch

pytest.importorskip("megatron.core")

sys.path.insert(0, os.path.dirname(__file__))
import megatron_runs as mr  # noqa: E402

from mcore.checkpoint import CheckpointError, load_logical_model_state  # noqa: E402
from mcore.checkpoint.megatron.write import export_to_megatron  # noqa: E402
from mcore.distributed.groups import ProcessGroups  # noqa: E402
from mcore.inference.loading import build_model_chunk, model_config_from_run_config  # noqa: E402
from mcore.testing.distributed import run_distributed  # noqa: E402

V = mr.FAMILIES["moe"]["vocab_size"]


def _megatron_side(out: str, export: str) -> torch.Tensor:
    """Rank function (one process): megatron-core saves the MoE model under ``out`` (with its
    logits), mcore exports that checkpoint to ``export``, megatron-core loads the export (strict);
    returns the loaded model's logits."""
    mr.save_megatron_checkpoints(out, "moe", 1, 1)
    export_to_megatron(os.path.join(out, "torch"), export, "torch", tp=1, pp=1)
    return mr.megatron_load_logits(export, "moe", "torch")


def _mcore_logits(ckpt: str, ids: torch.Tensor) -> torch.Tensor:
    state, meta = load_logical_model_state(ckpt)
    cfg = model_config_from_run_config(meta["run_config"], hidden_dropout=0.0, attention_dropout=0.0)
    assert cfg.num_experts == 4 and cfg.moe_shared_expert_gate and cfg.qk_layernorm
    model = build_model_chunk(cfg, ProcessGroups.single(), V, state, device=torch.device("cpu"))
    with torch.no_grad():
        return model(ids)[..., :V]


def test_a_megatron_moe_checkpoint_loads_and_exports_back(tmp_path):
    out, export = tmp_path / "megatron", tmp_path / "export"
    theirs = run_distributed(_megatron_side, 1, str(out), str(export), timeout=240)[0]
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
