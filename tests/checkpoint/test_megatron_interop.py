"""Megatron-LM checkpoints in and out, against the real megatron-core (the PyPI ``megatron-core``).

megatron-core builds a tiny GPT-2-like model and a Llama-style one (RoPE, RMSNorm, SwiGLU, GQA, QK layernorm) at
TP=2 x PP=2 on gloo and saves each as Megatron-LM does (``--ckpt-format torch`` and ``torch_dist``,
:mod:`megatron_runs`), with its logits. mcore then

* loads each at TP=1 (one process) and at TP=2 (two processes, through the training loop's loader)
  and gives the same logits (fp32, within 1e-5), and resumes training from it;
* exports an mcore checkpoint with ``mcore-export-megatron`` (torch at TP=1 and TP=2 x PP=2,
  torch_dist) and reads it back bitwise; megatron-core loads the exports into its own GPTModel with
  mcore's logits; transformers' ``convert_megatron_gpt2_checkpoint.py`` (from a 4.x wheel) converts
  the legacy-named export into a ``GPT2LMHeadModel`` with mcore's logits;
* refuses bad inputs with one line naming the arg, file or tensor.
"""

from __future__ import annotations

import os
import shutil
import subprocess
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

V = mr.FAMILIES["gpt"]["vocab_size"]
EXPORT_MEGATRON = os.path.join(os.path.dirname(sys.executable), "mcore-export-megatron")  # the console script
TOL = 1e-5


@pytest.fixture(scope="module")
def megatron_dir(tmp_path_factory):
    """``<dir>/<family>/{torch,torch_dist,logits.pt}``: both families saved by megatron-core at TP=2 x PP=2."""
    out = tmp_path_factory.mktemp("megatron")
    run_distributed(mr.save_megatron_families, 4, str(out), ["gpt", "llama"], 2, 2, timeout=240)
    return out


@pytest.fixture(scope="module")
def mcore_runs(megatron_dir, tmp_path_factory):
    """Per family: mcore's TP=2 load of the Megatron checkpoint and a 3-iteration resume (saved)."""
    runs = {}
    for family, fmt in (("gpt", "torch"), ("llama", "torch_dist")):
        save = tmp_path_factory.mktemp(f"mcore_{family}")
        load = str(megatron_dir / family / fmt)
        results = run_distributed(mr.mcore_logits_and_training, 2, load, str(save), family, 2, 1, timeout=240)
        runs[family] = {"save": save, **results[-1], "logits": results[0]["logits"]}
    return runs


def mcore_logits(ckpt: str, ids: torch.Tensor) -> torch.Tensor:
    """Logits of a checkpoint (any format mcore reads) in one process at TP=1."""
    state, meta = load_logical_model_state(ckpt)
    cfg = model_config_from_run_config(meta["run_config"], hidden_dropout=0.0, attention_dropout=0.0)
    model = build_model_chunk(cfg, ProcessGroups.single(), V, state, device=torch.device("cpu"))
    with torch.no_grad():
        return model(ids)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a[..., :V] - b[..., :V]).abs().max().item()


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_megatron_checkpoint_loads_at_tp1(megatron_dir, family, fmt):
    ref = torch.load(megatron_dir / family / "logits.pt")
    diff = max_diff(mcore_logits(str(megatron_dir / family / fmt), ref["ids"]), ref["logits"])
    print(f"{family} {fmt} TP2xPP2 -> TP1: max |dlogits| = {diff:.2e}")
    assert diff < TOL


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_megatron_checkpoint_loads_at_tp2_and_resumes(megatron_dir, mcore_runs, family):
    run = mcore_runs[family]
    ref = torch.load(megatron_dir / family / "logits.pt")["logits"]
    diff = max_diff(run["logits"], ref)
    print(f"{family} TP2xPP2 -> mcore TP2: max |dlogits| = {diff:.2e}; resumed losses {run['losses']}")
    assert diff < TOL
    assert run["loaded_iteration"] == mr.ITERATION  # a resume keeps Megatron's iteration and samples
    assert run["iteration"] == mr.ITERATION + mr.TRAIN_ITERS
    assert run["consumed"] == mr.ITERATION * 4 + mr.TRAIN_ITERS * 4
    losses = run["losses"]
    assert len(losses) == mr.TRAIN_ITERS and all(torch.isfinite(torch.tensor(losses)))
    assert min(losses[1:]) < losses[0]


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_round_trip_mcore_megatron_mcore_is_bitwise(mcore_runs, tmp_path, family):
    source = str(mcore_runs[family]["save"])
    original, _ = load_logical_model_state(source)
    layouts = [
        ("torch", 1, 1, "mcore"),
        ("torch", 2, 2, "mcore"),
        ("torch", 1, 1, "legacy"),
        ("torch_dist", 1, 1, "mcore"),
    ]
    for fmt, tp, pp, names in layouts:
        out = tmp_path / f"{fmt}_{tp}{pp}_{names}"
        if names == "legacy" and mr.FAMILIES[family]["qk_layernorm"]:
            with pytest.raises(CheckpointError, match="legacy model has no QK layernorm"):
                export_to_megatron(source, str(out), fmt, tp=tp, pp=pp, names=names)
            assert not out.exists()
            continue
        if tp > 1:  # docs/megatron_checkpoints.md's command
            subprocess.run(
                [EXPORT_MEGATRON, "--load", source, "--save", str(out), "--ckpt-format", fmt,
                 "--target-tensor-model-parallel-size", str(tp), "--target-pipeline-model-parallel-size", str(pp)],
                check=True,
            )  # fmt: skip
            assert sorted(p.name for p in next(out.glob("iter_*")).iterdir()) == [
                "mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"
            ]  # fmt: skip
        else:
            export_to_megatron(source, str(out), fmt, tp=tp, pp=pp, names=names)
        back, meta = load_logical_model_state(str(out))
        assert meta["iteration"] == mr.ITERATION + mr.TRAIN_ITERS
        assert sorted(back) == sorted(original), (fmt, tp, pp, names)
        for name, tensor in original.items():
            rows = (
                min(tensor.shape[0], back[name].shape[0])
                if "embeddings" in name or "output" in name
                else None
            )
            a, b = (tensor[:rows], back[name][:rows]) if rows else (tensor, back[name])
            assert torch.equal(a, b), (fmt, tp, pp, names, name)


def test_megatron_core_loads_the_exports(mcore_runs, tmp_path):
    cases = [("gpt", "torch"), ("llama", "torch"), ("llama", "torch_dist"), ("gpt", "torch_dist")]
    jobs = []
    for family, fmt in cases:
        out = tmp_path / f"{family}_{fmt}"
        export_to_megatron(str(mcore_runs[family]["save"]), str(out), fmt)
        jobs.append((str(out), family, fmt))
    theirs = run_distributed(mr.megatron_load_logits_many, 1, jobs, timeout=180)[0]
    for (family, fmt), logits in zip(cases, theirs):
        diff = max_diff(mcore_logits(str(mcore_runs[family]["save"]), mr.inputs(family)[0]), logits)
        print(f"mcore -> Megatron {fmt} ({family}) -> megatron-core GPTModel: max |dlogits| = {diff:.2e}")
        assert diff < TOL


# -- transformers' convert_megatron_gpt2_checkpoint.py (the CodeParrot blog's converter) ------------

HF_CONVERTER_WHEEL = "transformers-4.46.3-py3-none-any.whl"
"""The last transformers 4.x wheels (4.57.1 checked) no longer ship the converter; 4.46.3 does.
``.ci/run`` downloads it into ``.ci/wheels/`` (git-ignored)."""


def converter_script(tmp_path):
    import zipfile

    wheel = os.path.join(os.path.dirname(__file__), "..", "..", ".ci", "wheels", HF_CONVERTER_WHEEL)
    if not os.path.isfile(wheel):
        if os.environ.get("MCORE_SKIP_HF_CONVERTER") == "1":
            pytest.skip(f"{wheel} is missing and MCORE_SKIP_HF_CONVERTER=1 (a non-CI run)")
        pytest.fail(
            f"{wheel} is missing: .ci/run downloads it (pip download transformers==4.46.3 --no-deps "
            "-d .ci/wheels); set MCORE_SKIP_HF_CONVERTER=1 to skip this test outside CI"
        )
    member = "transformers/models/megatron_gpt2/convert_megatron_gpt2_checkpoint.py"
    with zipfile.ZipFile(wheel) as zf:
        path = tmp_path / "convert_megatron_gpt2_checkpoint.py"
        path.write_bytes(zf.read(member))
    return path


def test_blog_converter_on_an_export_gives_mcore_logits(mcore_runs, tmp_path):
    import importlib.util

    from transformers import GPT2Config, GPT2LMHeadModel

    spec = importlib.util.spec_from_file_location("convert_megatron_gpt2", converter_script(tmp_path))
    conv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conv)  # the script imports against the installed transformers

    source = str(mcore_runs["gpt"]["save"])
    out = tmp_path / "megatron"
    subprocess.run(
        [EXPORT_MEGATRON, "--load", source, "--save", str(out),
         "--ckpt-format", "torch", "--megatron-names", "legacy"],
        check=True,
    )  # fmt: skip
    step = int((out / "latest_checkpointed_iteration.txt").read_text())
    input_state = torch.load(
        out / f"iter_{step:07d}" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False
    )
    ds_args = input_state["args"]
    # the script's main(): the activation from the args, its fixed GPT-2 defaults (it then downloads a
    # tokenizer, which this offline test leaves out)
    act = "gelu_fast" if ds_args.bias_gelu_fusion else "gelu_new" if ds_args.openai_gelu else "gelu"
    config = GPT2Config(activation_function=act, layer_norm_epsilon=1e-5, scale_attn_weights=True)
    hf_state = conv.convert_megatron_checkpoint(None, input_state, config)
    model = GPT2LMHeadModel(config).eval()
    missing, unexpected = model.load_state_dict(hf_state, strict=False)
    assert not missing and all(k.endswith(("attn.bias", "attn.masked_bias")) for k in unexpected)
    ids = mr.inputs("gpt")[0]
    with torch.no_grad():
        hf = model(ids).logits
    diff = max_diff(hf, mcore_logits(source, ids))
    print(
        f"mcore -> Megatron torch (legacy names) -> convert_megatron_gpt2_checkpoint.py: max |dlogits| = {diff:.2e}"
    )
    assert diff < TOL


# -- bad inputs ------------------------------------------------------------------------------------


def _copy_with(src, dst, edit):
    shutil.copytree(src, dst)
    for root, _, files in os.walk(dst):
        for f in files:
            if f == "model_optim_rng.pt":
                path = os.path.join(root, f)
                data = torch.load(path, weights_only=False)
                edit(data)
                torch.save(data, path)
    return dst


def test_bad_megatron_checkpoints_get_one_clear_error(megatron_dir, tmp_path):
    src = megatron_dir / "llama" / "torch"

    moe = _copy_with(src, tmp_path / "moe", lambda d: setattr(d["args"], "num_experts", 8))
    with pytest.raises(CheckpointError, match=r"args\.num_experts=8: mixture-of-experts"):
        load_logical_model_state(moe)

    def add_expert(d):
        d["model"]["decoder.layers.0.mlp.experts.linear_fc1.weight0"] = torch.zeros(2, 2)

    experts = _copy_with(src, tmp_path / "experts", add_expert)
    with pytest.raises(CheckpointError, match=r"mlp\.experts\.linear_fc1\.weight0.*mixture-of-experts"):
        load_logical_model_state(experts)

    missing = tmp_path / "missing"
    shutil.copytree(src, missing)
    shutil.rmtree(missing / f"iter_{mr.ITERATION:07d}" / "mp_rank_01_001")
    with pytest.raises(CheckpointError, match=r"mp_rank_01_001/model_optim_rng\.pt is missing"):
        load_logical_model_state(missing)

    wrong = _copy_with(src, tmp_path / "wrong", lambda d: setattr(d["args"], "num_layers", 6))
    with pytest.raises(CheckpointError, match=r"args\.num_layers=6"):
        load_logical_model_state(wrong)


def test_mismatched_model_and_optimizer_request_are_refused(megatron_dir):
    from mcore.checkpoint import CheckpointConfig, load_checkpoint
    from mcore.models.transformer.model_config import ModelConfig

    load = str(megatron_dir / "gpt" / "torch")
    _, meta = load_logical_model_state(load)
    flags = {**meta["run_config"]["model"], "hidden_dropout": 0.0, "attention_dropout": 0.0}
    groups = ProcessGroups.single()
    other = build_model_chunk(ModelConfig(**{**flags, "ffn_hidden_size": 96}), groups, V, None)
    with pytest.raises(
        CheckpointError, match=r"shape mismatch for decoder\.layers\.0\.mlp\.linear_fc1\.weight"
    ):
        load_checkpoint(CheckpointConfig(load=load, no_load_optim=True), [other], None, None, groups)

    class _Optimizer:  # a run that asks for the optimizer state
        pass

    model = build_model_chunk(ModelConfig(**flags), groups, V, None)
    with pytest.raises(CheckpointError, match=r"Megatron-LM checkpoint .* --no-load-optim"):
        load_checkpoint(CheckpointConfig(load=load), [model], _Optimizer(), None, groups)


@pytest.mark.parametrize("version", [0, 1.0])
def test_old_checkpoint_versions_qkv_layouts(megatron_dir, tmp_path, version):
    """checkpoint_version 0 (``[3, np, hn]``) and 1.0 (``[np, hn, 3]``) fused QKV rows, per TP shard,
    read as the version-2 layout; a stored class whose module is not installed does not stop the load."""
    import argparse

    src = megatron_dir / "gpt" / "torch"
    heads = mr.FAMILIES["gpt"]["num_attention_heads"] // 2  # per TP rank

    def to_old(d):
        d["checkpoint_version"] = version
        d["args"].attention_backend = NotInstalled(1)
        for key, t in d["model"].items():
            if "linear_qkv" in key and isinstance(t, torch.Tensor):
                rest = t.shape[1:]
                v2 = t.view(heads, 3, t.shape[0] // (3 * heads), *rest)
                old = v2.transpose(0, 1) if version == 0 else v2.transpose(1, 2)
                d["model"][key] = old.reshape(t.shape).contiguous()

    NotInstalled.__module__ = "megatron_not_installed"
    sys.modules["megatron_not_installed"] = argparse  # present while saving, gone while loading
    argparse.NotInstalled = NotInstalled
    try:
        old_dir = _copy_with(src, tmp_path / "old", to_old)
    finally:
        del sys.modules["megatron_not_installed"], argparse.NotInstalled
    expected, _ = load_logical_model_state(src)
    got, meta = load_logical_model_state(old_dir)
    assert meta["megatron"]["checkpoint_version"] == version
    assert sorted(got) == sorted(expected)
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


class NotInstalled:
    def __init__(self, value):
        self.value = value
