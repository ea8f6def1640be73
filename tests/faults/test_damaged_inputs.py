"""Damaged inputs of the other formats end in one line naming the file, and nothing half-written is left:
a truncated Megatron torch_dist shard (.distcp), a truncated Hugging Face model.safetensors.

Single process, a 1-layer GPT of hidden 16."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch

from mcore.checkpoint import save_logical_model_checkpoint
from mcore.checkpoint.megatron.write import main as megatron_main
from mcore.distributed.groups import ProcessGroups
from mcore.hf import ConversionError, export_to_hf, import_from_hf
from mcore.inference.loading import build_model_chunk, gather_logical_state
from mcore.models.transformer.model_config import ModelConfig

TINY = ModelConfig(
    num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=8, max_position_embeddings=8
)
RUN = {"model": dataclasses.asdict(TINY), "tokenizer": {"tokenizer_type": "NullTokenizer", "vocab_size": 63}}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("damaged")
    single = ProcessGroups.single()
    state = gather_logical_state([build_model_chunk(TINY, single, 64, device=torch.device("cpu"))], single)
    save_logical_model_checkpoint(root / "ckpt", state, RUN, metadata={"tokenizer_vocab_size": 64})
    return root, state


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def test_a_truncated_distcp_shard_is_one_line_naming_it(tiny, tmp_path, capsys):
    root, _ = tiny
    dist = tmp_path / "dist"
    assert (
        megatron_main(["--load", str(root / "ckpt"), "--save", str(dist), "--ckpt-format", "torch_dist"]) == 0
    )
    shard = sorted(dist.rglob("*.distcp"))[0]
    _truncate(shard)
    capsys.readouterr()
    out = tmp_path / "again"
    assert megatron_main(["--load", str(dist), "--save", str(out), "--ckpt-format", "torch"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{shard}: truncated" in err, err
    assert not out.exists() or not any(p.name.startswith("iter_") for p in out.iterdir())


def test_a_truncated_safetensors_is_one_line_naming_it(tiny, tmp_path):
    _, state = tiny
    hf = tmp_path / "hf"
    export_to_hf(state, RUN, str(hf), check_parity=False)
    _truncate(hf / "model.safetensors")
    with pytest.raises(
        ConversionError, match=r"model.safetensors cannot be read \(truncated or damaged\?\)"
    ) as err:
        import_from_hf(str(hf), str(tmp_path / "ckpt"), check_parity=False)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "ckpt").exists() and not [p for p in os.listdir(tmp_path) if p.startswith(".")]


def test_a_megatron_checkpoint_naming_its_tokenizer_exports_without_vocab_size(tiny, tmp_path, capsys):
    from mcore.hf.export import main as export_main

    root, _ = tiny
    meg = tmp_path / "megatron"
    assert megatron_main(["--load", str(root / "ckpt"), "--save", str(meg), "--ckpt-format", "torch"]) == 0
    (pt,) = meg.rglob("model_optim_rng.pt")
    saved = torch.load(pt, weights_only=False)
    # export-megatron names the source run's tokenizer as Megatron-LM does (the round trip needs no flag)
    assert (saved["args"].tokenizer_type, saved["args"].vocab_size) == ("NullTokenizer", 63)
    del saved["args"].orig_vocab_size  # only the tokenizer tells the vocabulary now
    torch.save(saved, pt)
    assert export_main(["--load", str(meg), "--save", str(tmp_path / "hf"), "--no-parity-check"]) == 0
    assert '"vocab_size": 64' in (tmp_path / "hf" / "config.json").read_text()
    # mcore-generate reads the Megatron checkpoint directly (it said "convert them first").
    from mcore.inference.generate import load_generator

    generator, tokenizer = load_generator(str(meg), ProcessGroups.single(), device=torch.device("cpu"))
    assert tokenizer.vocab_size == 64 and generator is not None
    from mcore.checkpoint.inspect import main as inspect_main

    capsys.readouterr()
    assert inspect_main([str(meg)]) == 0  # and so does mcore-inspect-checkpoint
    assert "a Megatron-LM checkpoint (megatron-torch)" in capsys.readouterr().out
    saved["args"].tokenizer_type = None  # the vocabulary really is unknown: the flags that supply it
    saved["args"].vocab_size = saved["args"].padded_vocab_size = None
    torch.save(saved, pt)
    capsys.readouterr()
    assert export_main(["--load", str(meg), "--save", str(tmp_path / "hf2"), "--no-parity-check"]) == 2
    err = capsys.readouterr().err
    assert (
        "the checkpoint names no tokenizer" in err and "--vocab-size" in err and "--tokenizer-type" in err
    ), err


def test_export_megatron_to_a_full_disk_is_one_line_and_leaves_nothing(tiny, tmp_path, capsys, monkeypatch):
    import errno

    root, _ = tiny

    def full(obj, path, *args, **kwargs):
        Path(path).write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(torch, "save", full)
    out = tmp_path / "megatron"
    assert megatron_main(["--load", str(root / "ckpt"), "--save", str(out), "--ckpt-format", "torch"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: --save {out}: cannot write") and "No space left" in err, err
    assert not [p for p in out.rglob("*") if p.name.startswith("iter_")]


def test_a_load_or_data_path_that_names_something_else_says_what_it_is(tmp_path):
    """``--load`` of a file or a Hugging Face directory is refused (not a fresh start from random weights,
    as an empty first-run folder is); ``--data-path X.bin`` names the prefix to give instead."""
    from types import SimpleNamespace

    import numpy as np

    from mcore.checkpoint.format import CheckpointError
    from mcore.checkpoint.load import load_checkpoint
    from mcore.data.errors import DataError
    from mcore.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, bin_path, idx_path

    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    (tmp_path / "first_run").mkdir()
    for name, says in (("notes.txt", "is a file, not a checkpoint"), ("hf", "mcore-import-hf --hf-dir")):
        with pytest.raises(CheckpointError, match=says):
            load_checkpoint(SimpleNamespace(load=str(tmp_path / name), ckpt_step=None), [], None, None, None)
    fresh = load_checkpoint(
        SimpleNamespace(load=str(tmp_path / "first_run"), ckpt_step=None), [], None, None, None
    )
    assert fresh == {}

    prefix = str(tmp_path / "c_text_document")
    with IndexedDatasetBuilder(bin_path(prefix), dtype=np.uint16) as builder:
        builder.add_item(np.array([1, 2]))
        builder.end_document()
        builder.finalize(idx_path(prefix))
    with pytest.raises(DataError, match=f"give the prefix without the suffix: {prefix}$"):
        IndexedDataset(prefix + ".bin")
