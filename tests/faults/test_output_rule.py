"""The output rule of every command that writes (mcore.utils.outputs): never an input, never a non-empty
foreign directory, a temporary name renamed when complete, a bad target found before the work starts.

Single process, no training: the refusals happen before any checkpoint is read."""

from __future__ import annotations

import dataclasses
import errno
import os
from pathlib import Path

import pytest
import torch

from mcore.checkpoint.megatron.write import main as megatron_main
from mcore.config.fields import ConfigError
from mcore.data.merge import main as merge_main
from mcore.distributed.groups import ProcessGroups
from mcore.hf import ConversionError, export_to_hf, import_from_hf
from mcore.hf.export import main as export_main
from mcore.inference.loading import build_model_chunk, gather_logical_state
from mcore.models.transformer.model_config import ModelConfig
from mcore.training.pretrain import check_save_dir
from mcore.utils.outputs import MARKER, OutputError, check_output_dir, staged_dir

TINY = ModelConfig(
    num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=8, max_position_embeddings=8
)


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _fake_training_checkpoint(root: Path) -> Path:
    ckpt = root / "ckpt"
    (ckpt / "iter_0000010").mkdir(parents=True)
    (ckpt / "iter_0000010" / "model_tp0_pp0.pt").write_bytes(b"weights")
    (ckpt / "iter_0000010" / "optim_tp0_pp0_dp0.pt").write_bytes(b"optimizer")
    (ckpt / "latest_checkpointed_iteration.txt").write_text("10")
    return ckpt


@pytest.mark.parametrize("where", ["same", "parent", "inside"])
def test_export_hf_overwrite_never_touches_the_checkpoint(tmp_path, capsys, where):
    ckpt = _fake_training_checkpoint(tmp_path)
    save = {"same": ckpt, "parent": tmp_path, "inside": ckpt / "hf"}[where]
    before = _tree(tmp_path)
    assert (
        export_main(["--load", str(ckpt), "--save", str(save), "--overwrite", "--overwrite-non-export"]) == 2
    )
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"--load {ckpt}" in err and err.startswith(f"error: --save {save}")
    assert _tree(tmp_path) == before


def test_export_megatron_and_merge_never_write_over_their_input(tmp_path, capsys):
    ckpt = _fake_training_checkpoint(tmp_path)
    before = _tree(tmp_path)
    assert megatron_main(["--load", str(ckpt), "--save", str(ckpt), "--ckpt-format", "torch"]) == 2
    assert f"--save {ckpt} is the input --load {ckpt}" in capsys.readouterr().err
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.bin").write_bytes(b"tokens")
    (data / "a.idx").write_bytes(b"index")
    before = _tree(tmp_path)
    assert merge_main(["--input", str(data / "a"), str(data / "a"), "--output-prefix", str(data / "a")]) == 1
    assert "--output-prefix" in capsys.readouterr().err
    assert _tree(tmp_path) == before


def test_import_hf_never_writes_into_its_input(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "vocab_size": 64}')
    with pytest.raises(ConversionError, match=r"--save .* lies inside the input --hf-dir"):
        import_from_hf(str(hf), str(hf / "ckpt"), check_parity=False)
    assert sorted(os.listdir(hf)) == ["config.json"]


@pytest.fixture(scope="module")
def tiny_state():
    single = ProcessGroups.single()
    state = gather_logical_state([build_model_chunk(TINY, single, 64, device=torch.device("cpu"))], single)
    run_config = {
        "model": dataclasses.asdict(TINY),
        "tokenizer": {"tokenizer_type": "NullTokenizer", "vocab_size": 63},
    }
    return state, run_config


def test_overwrite_replaces_only_an_earlier_export(tmp_path, tiny_state):
    state, run_config = tiny_state
    out = tmp_path / "hf"
    export_to_hf(state, run_config, str(out), check_parity=False)
    assert (out / MARKER).is_file() and (out / "model.safetensors").is_file()
    with pytest.raises(ConversionError, match="give --overwrite"):
        export_to_hf(state, run_config, str(out), check_parity=False)
    export_to_hf(state, run_config, str(out), check_parity=False, overwrite=True)
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("precious")
    with pytest.raises(ConversionError, match=r"not an earlier mcore-export-hf output \(it holds notes.txt\); "
                       r"--overwrite-non-export"):  # fmt: skip
        export_to_hf(state, run_config, str(foreign), check_parity=False, overwrite=True)
    assert (foreign / "notes.txt").read_text() == "precious"
    export_to_hf(state, run_config, str(foreign), check_parity=False, overwrite=True, replace_foreign=True)
    assert not (foreign / "notes.txt").exists() and (foreign / MARKER).is_file()
    assert sorted(p for p in os.listdir(tmp_path) if p.startswith(".")) == []


def test_a_full_disk_leaves_the_target_as_it_was(tmp_path, tiny_state, monkeypatch):
    state, run_config = tiny_state
    out = tmp_path / "hf"
    export_to_hf(state, run_config, str(out), check_parity=False)
    before = _tree(out)

    def full(tensors, path, metadata=None):  # safetensors raises its own error class, not OSError
        with open(path, "wb") as f:
            f.write(b"half")
        raise RuntimeError(f"Error while serializing: {os.strerror(errno.ENOSPC)}")

    monkeypatch.setattr("safetensors.torch.save_file", full)
    with pytest.raises(ConversionError, match=r"cannot write .*model.safetensors: .*No space left on device"):
        export_to_hf(state, run_config, str(out), check_parity=False, overwrite=True)
    assert _tree(out) == before
    assert sorted(p for p in os.listdir(tmp_path) if p.startswith(".")) == []


def test_staged_dir_is_renamed_only_when_complete(tmp_path):
    target = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with staged_dir(target, tool="t") as staging:
            Path(staging, "half").write_text("x")
            raise RuntimeError("killed")
    assert os.listdir(tmp_path) == []
    with staged_dir(target, tool="t") as staging:
        Path(staging, "whole").write_text("x")
    assert sorted(os.listdir(target)) == [MARKER, "whole"]
    assert check_output_dir("--save", target, tool="t", overwrite=True)


def test_save_under_a_file_or_read_only_is_found_before_training(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=r"^--save .*file/ckpt: cannot write .*: a file is in the way"):
        check_save_dir(str(tmp_path / "file" / "ckpt"), None)
    monkeypatch.setattr(os, "access", lambda path, mode: not str(path).startswith(str(tmp_path / "ro")))
    (tmp_path / "ro").mkdir()
    with pytest.raises(ConfigError, match=r"^--save .*: .*ro is not writable"):
        check_save_dir(str(tmp_path / "ro" / "ckpt"), None)
    monkeypatch.undo()
    check_save_dir(str(tmp_path / "ckpt"), str(tmp_path / "ckpt"))  # Megatron's resume: --save = --load
    with pytest.raises(ConfigError, match="lies inside the input --load"):
        check_save_dir(str(tmp_path / "ckpt" / "inner"), str(tmp_path / "ckpt"))
    with pytest.raises(OutputError, match="a file is in the way"):
        check_output_dir("--save", tmp_path / "file", tool="t")


@pytest.mark.parametrize(
    ("family", "tensor"),
    [("a BERT model", "lm_head.dense.weight"), ("a T5", "encoder.layers.0.mlp.linear_fc1.weight")],
)
def test_export_megatron_refuses_bert_and_t5_by_name_before_writing(tmp_path, capsys, family, tensor):
    from mcore.checkpoint import save_logical_model_checkpoint

    state = {"embedding.word_embeddings.weight": torch.zeros(8, 4), tensor: torch.zeros(4, 4)}
    save_logical_model_checkpoint(tmp_path / "ckpt", state, {"model": dataclasses.asdict(TINY)})
    out = tmp_path / "megatron"
    assert (
        megatron_main(["--load", str(tmp_path / "ckpt"), "--save", str(out), "--ckpt-format", "torch"]) == 2
    )
    err = capsys.readouterr().err
    assert f"the checkpoint is {family}" in err and "GPT models only" in err and len(err.splitlines()) == 1
    assert not out.exists()


def test_written_files_follow_the_umask(tmp_path, tiny_state):
    """model.safetensors (safetensors writes 0600) and a trained vocab.txt (mkstemp: 0600) get the mode
    of the other files, so a shared cluster's users can read them."""
    from mcore.data.tokenizers import train_wordpiece_vocab

    state, run_config = tiny_state
    old = os.umask(0o022)
    try:
        export_to_hf(state, run_config, str(tmp_path / "hf"), check_parity=False)
        vocab = train_wordpiece_vocab(["a b c d e f g"] * 4, 40, str(tmp_path / "wp"))
    finally:
        os.umask(old)
    for path in (tmp_path / "hf" / "model.safetensors", tmp_path / "hf" / "config.json", Path(vocab)):
        assert oct(path.stat().st_mode & 0o777) == "0o644", path


def test_generate_output_json_under_a_file_is_refused_before_loading(tmp_path, capsys):
    from mcore.inference.generate import main as generate_main

    (tmp_path / "file").write_text("x")
    out = tmp_path / "file" / "out.json"
    assert generate_main(["--load", str(tmp_path / "none"), "--prompt", "a", "--output-json", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: --output-json {out}: cannot write") and len(err.splitlines()) == 1, err
