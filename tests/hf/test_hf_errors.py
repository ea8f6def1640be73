"""Bad inputs to import and export get one clear error that names the problem, and leave nothing behind."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from mcore.distributed.groups import ProcessGroups
from mcore.hf import ConversionError, export_to_hf, import_from_hf
from mcore.hf.export import main as export_main
from mcore.hf.importer import main as import_main
from mcore.inference.loading import build_model_chunk, gather_logical_state
from mcore.models.transformer.model_config import ModelConfig

sys.path.insert(0, str(Path(__file__).parent))  # hf_runs (importlib mode)
from hf_runs import make_gpt2_tokenizer  # noqa: E402

CFG = ModelConfig(
    num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, max_position_embeddings=32
)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A random GPT-2-style model's logical state, its run config (with a GPT-2 BPE) and its export."""
    root = tmp_path_factory.mktemp("hf_errors")
    flags = make_gpt2_tokenizer(str(root / "tokenizer"))
    tokenizer = {"tokenizer_type": flags[1], "vocab_file": flags[3], "merge_file": flags[5]}
    single = ProcessGroups.single()
    state = gather_logical_state([build_model_chunk(CFG, single, 300, device=torch.device("cpu"))], single)
    run_config = {"model": dataclasses.asdict(CFG), "tokenizer": tokenizer}
    report = export_to_hf(state, run_config, str(root / "hf"))
    assert report.vocab_size == 300
    return {"root": root, "state": state, "run_config": run_config, "hf": str(root / "hf")}


def variant(source, tmp_path, edit_config=None, drop=()) -> str:
    """A copy of the exported directory with ``config.json`` edited or files removed."""
    path = tmp_path / "variant"
    shutil.copytree(source["hf"], path)
    if edit_config is not None:
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps(edit_config(config)))
    for name in drop:
        os.remove(path / name)
    return str(path)


def test_import_needs_a_model_directory(source, tmp_path):
    with pytest.raises(ConversionError, match="not a directory"):
        import_from_hf(str(tmp_path / "nowhere"), str(tmp_path / "ckpt"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConversionError, match=r"not a Hugging Face model directory \(no config.json\)"):
        import_from_hf(str(tmp_path / "empty"), str(tmp_path / "ckpt"))
    with pytest.raises(ConversionError, match="no weights"):
        import_from_hf(variant(source, tmp_path, drop=["model.safetensors"]), str(tmp_path / "ckpt"))
    assert not (tmp_path / "ckpt").exists()


def test_import_refuses_an_unsupported_architecture(source, tmp_path, capsys):
    # (BERT has its own path and message: tests/bert/test_bert_hf.py)
    mamba = variant(
        source, tmp_path, lambda c: {**c, "architectures": ["MambaForCausalLM"], "model_type": "mamba"}
    )
    with pytest.raises(
        ConversionError, match=r"unsupported architecture \['MambaForCausalLM'\] \(model_type 'mamba'\)"
    ):
        import_from_hf(mamba, str(tmp_path / "ckpt"))
    assert import_main(["--hf-dir", mamba, "--save", str(tmp_path / "ckpt")]) == 2
    assert "unsupported architecture" in capsys.readouterr().err
    assert not (tmp_path / "ckpt").exists()


def test_import_refuses_a_tokenizer_of_another_size(source, tmp_path):
    bigger = variant(source, tmp_path, lambda c: {**c, "vocab_size": 312})
    with pytest.raises(
        ConversionError, match="the tokenizer has 300 tokens but config.json says vocab_size=312"
    ):
        import_from_hf(bigger, str(tmp_path / "ckpt"))
    with pytest.raises(ConversionError, match="transformer.wte.weight has 300 rows but vocab_size=312"):
        import_from_hf(bigger, str(tmp_path / "ckpt"), use_tokenizer=False)
    assert not (tmp_path / "ckpt").exists()


def test_import_refuses_missing_tensors_and_impossible_layouts(source, tmp_path):
    from safetensors.torch import load_file, save_file

    broken = variant(source, tmp_path)
    weights = load_file(os.path.join(broken, "model.safetensors"))
    del weights["transformer.h.1.mlp.c_fc.weight"]
    save_file(weights, os.path.join(broken, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConversionError, match="has no tensor 'transformer.h.1.mlp.c_fc.weight'"):
        import_from_hf(broken, str(tmp_path / "ckpt"))
    with pytest.raises(
        ConversionError, match="num_attention_heads=4 is not divisible by tensor_model_parallel_size=3"
    ):
        import_from_hf(source["hf"], str(tmp_path / "ckpt"), tensor_model_parallel_size=3)
    with pytest.raises(
        ConversionError, match="num_layers=2 is not divisible by pipeline_model_parallel_size=4"
    ):
        import_from_hf(source["hf"], str(tmp_path / "ckpt"), pipeline_model_parallel_size=4)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "something").write_text("x")
    with pytest.raises(ConversionError, match="not empty"):
        import_from_hf(source["hf"], str(tmp_path / "full"))
    assert not (tmp_path / "ckpt").exists()


def test_import_command_prints_the_megatron_flags(source, tmp_path, capsys):
    assert import_main(["--hf-dir", source["hf"], "--save", str(tmp_path / "ckpt")]) == 0
    out = capsys.readouterr().out
    assert "logit parity" in out
    assert (
        "--num-layers 2 --hidden-size 64 --ffn-hidden-size 256 --num-attention-heads 4 --seq-length 32" in out
    )
    assert (
        f"--tokenizer-type GPT2BPETokenizer --vocab-file {tmp_path / 'ckpt' / 'tokenizer' / 'vocab.json'}"
        in out
    )
    assert out.rstrip().endswith(f"--load {tmp_path / 'ckpt'} --finetune")


def test_export_errors(source, tmp_path, capsys):
    assert export_main(["--load", str(tmp_path / "no_ckpt"), "--save", str(tmp_path / "hf")]) == 2
    assert f"--load {tmp_path / 'no_ckpt'}: no such directory" in capsys.readouterr().err
    # what --load names instead of a checkpoint is said: a file, a Hugging Face directory (and the fix)
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "hf_dir").mkdir()
    (tmp_path / "hf_dir" / "config.json").write_text("{}")
    for name, says in (("notes.txt", "is a file, not a checkpoint"), ("hf_dir", "mcore-import-hf --hf-dir")):
        assert export_main(["--load", str(tmp_path / name), "--save", str(tmp_path / "hf")]) == 2
        assert says in capsys.readouterr().err
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "file").write_text("x")
    with pytest.raises(ConversionError, match="not empty"):
        export_to_hf(source["state"], source["run_config"], str(tmp_path / "busy"))
    moved = {
        **source["run_config"],
        "tokenizer": {**source["run_config"]["tokenizer"], "vocab_file": "/gone/vocab.json"},
    }
    with pytest.raises(ConversionError, match="cannot load the checkpoint's tokenizer"):
        export_to_hf(source["state"], moved, str(tmp_path / "hf"))
    # With the vocabulary size given, the export goes on without tokenizer files.
    report = export_to_hf(source["state"], moved, str(tmp_path / "hf"), vocab_size=300)
    assert "tokenizer.json" not in report.files and report.parity.ok
    assert sorted(p for p in os.listdir(tmp_path) if p.startswith(".")) == []
