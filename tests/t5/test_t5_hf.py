"""Hugging Face T5 v1.1 <-> mcore T5: import, export and ``mcore-generate``, each checked against transformers.

A tiny ``T5ForConditionalGeneration`` (v1.1: gated-gelu, untied ``lm_head``) is built here from a
local config (nothing downloaded) and written as a Hugging Face directory. Then:

* ``mcore-import-hf`` turns it into an mcore checkpoint; its built-in parity check (encoder output and
  decoder logits within 1e-4 in fp32, equal greedy ``generate`` tokens) passes;
* ``mcore-export-hf`` writes it back: transformers loads it cleanly, the tensors equal the original
  ones, and the parity check passes again;
* ``mcore-generate`` on the imported checkpoint gives transformers' greedy tokens;
* Megatron's T5 variant is refused for export with one message that says why, writing nothing; a
  wrong mapping fails the parity check.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from mcore.distributed.groups import ProcessGroups
from mcore.hf.errors import ConversionError, ParityError
from mcore.hf.export import export_to_hf
from mcore.hf.export import main as export_main
from mcore.hf.importer import import_from_hf
from mcore.hf.t5 import check_t5_parity, t5_hf_to_mcore, t5_model_config_from_hf
from mcore.models.t5.t5_model import T5Model
from mcore.models.transformer.model_config import ModelConfig

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

VOCAB = 96
HF_CONFIG = dict(
    architectures=["T5ForConditionalGeneration"],
    model_type="t5",
    vocab_size=VOCAB,
    d_model=32,
    d_kv=8,
    d_ff=64,
    num_layers=2,
    num_decoder_layers=3,
    num_heads=4,
    relative_attention_num_buckets=8,
    relative_attention_max_distance=16,
    dropout_rate=0.0,
    layer_norm_epsilon=1e-6,
    feed_forward_proj="gated-gelu",
    tie_word_embeddings=False,
    is_encoder_decoder=True,
    pad_token_id=0,
    eos_token_id=1,
    decoder_start_token_id=0,
)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A T5 v1.1 directory as the Hub has them: config.json (tie_word_embeddings false) and weights
    with their own lm_head.weight."""
    root = tmp_path_factory.mktemp("t5_hf")
    torch.manual_seed(0)
    config = transformers.T5Config(**{k: v for k, v in HF_CONFIG.items() if k != "architectures"})
    model = transformers.T5ForConditionalGeneration(config)
    state = {k: v.detach().clone() for k, v in model.state_dict().items() if "embed_tokens" not in k}
    state["lm_head.weight"] = torch.randn(VOCAB, 32) * 0.5  # untied: its own values
    state["shared.weight"] = torch.randn(VOCAB, 32)
    save_file(state, str(root / "model.safetensors"), metadata={"format": "pt"})
    (root / "config.json").write_text(json.dumps(HF_CONFIG))
    return root


@pytest.fixture(scope="module")
def imported(hf_dir, tmp_path_factory):
    save = tmp_path_factory.mktemp("t5_ckpt") / "ckpt"
    report = import_from_hf(str(hf_dir), str(save), make_vocab_size_divisible_by=32, use_tokenizer=False)
    return save, report


def test_import_is_checked_for_parity(imported):
    _, report = imported
    parity = report.parity
    print(parity.describe())
    assert report.architecture == "T5ForConditionalGeneration"
    assert parity.encoder_max_abs_diff <= 1e-4 and parity.logits_max_abs_diff <= 1e-4
    assert parity.generate_equal and parity.hf_tokens and len(parity.hf_tokens[0]) >= 2
    assert "--position-embedding-type relative" in " ".join(report.flags)
    assert "--decoder-num-layers 3" in " ".join(report.flags)


def test_export_round_trip(imported, hf_dir, tmp_path, capsys):
    ckpt, _ = imported
    out = tmp_path / "exported"
    assert export_main(["--load", str(ckpt), "--save", str(out), "--vocab-size", str(VOCAB)]) == 0
    printed = capsys.readouterr().out
    assert "T5ForConditionalGeneration" in printed and "greedy generate equal" in printed
    original, exported = (
        load_file(str(hf_dir / "model.safetensors")),
        load_file(str(out / "model.safetensors")),
    )
    assert sorted(original) == sorted(exported)
    for name, tensor in original.items():
        assert torch.equal(tensor, exported[name]), name
    config = json.loads((out / "config.json").read_text())
    for key in (
        "d_model",
        "d_kv",
        "d_ff",
        "num_layers",
        "num_decoder_layers",
        "num_heads",
        "feed_forward_proj",
    ):
        assert config[key] == HF_CONFIG[key], key
    assert config["tie_word_embeddings"] is False and config["decoder_start_token_id"] == 0


def test_mcore_generate_matches_transformers(imported, hf_dir, capsys):
    from mcore.inference.generate import main as generate_main

    ckpt, report = imported
    prompt = [5, 17, 33, 8, 61, 2, 40]
    code = generate_main(
        ["--load", str(ckpt), "--prompt-ids", " ".join(map(str, prompt)), "--greedy", "--max-new-tokens", "6"]
    )
    assert code == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    model = transformers.T5ForConditionalGeneration.from_pretrained(str(hf_dir)).eval()
    with torch.no_grad():
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, use_cache=False)[
            0, 1:
        ].tolist()
    if 1 in expected:  # mcore prints the text before the end-of-sequence token
        expected = expected[: expected.index(1)]
    assert line.split("->")[1].split("(")[0].strip().strip("'") == " ".join(map(str, expected))


def test_megatron_variant_is_refused_for_export(tmp_path):
    cfg = ModelConfig(
        encoder_num_layers=1, decoder_num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=8
    )
    model = T5Model(cfg, ProcessGroups.single(), 128)
    state = {
        spec.name: p.detach() for spec, p in zip(model.sharded_parameters().values(), model.parameters())
    }
    out = tmp_path / "megatron_t5"
    with pytest.raises(ConversionError) as err:
        export_to_hf(state, {"model": dataclasses.asdict(cfg)}, str(out), vocab_size=100)
    message = str(err.value)
    assert "Megatron's T5 variant" in message and "learned_absolute" in message and "LayerNorm" in message
    assert "biases" in message and not out.exists()


def test_a_wrong_mapping_fails_the_parity_check(hf_dir):
    hf = json.loads((hf_dir / "config.json").read_text())
    cfg = t5_model_config_from_hf(hf, make_vocab_size_divisible_by=32)
    state = t5_hf_to_mcore(load_file(str(hf_dir / "model.safetensors")), cfg, 96)
    kv = state["decoder.layers.0.cross_attention.linear_kv.weight"]
    state["decoder.layers.0.cross_attention.linear_kv.weight"] = torch.cat(
        kv.chunk(2)[::-1]
    )  # [k; v] blocks moved
    with pytest.raises(ParityError, match="parity check FAILED"):
        check_t5_parity(cfg, state, VOCAB, str(hf_dir))


def test_tied_scaled_t5_is_refused_for_import(tmp_path):
    hf = {**HF_CONFIG, "tie_word_embeddings": True}
    with pytest.raises(ConversionError, match="d_model"):
        t5_model_config_from_hf(hf)
    with pytest.raises(ConversionError, match="feed_forward_proj='relu'"):
        t5_model_config_from_hf({**HF_CONFIG, "feed_forward_proj": "relu"})
    assert os.listdir(tmp_path) == []
