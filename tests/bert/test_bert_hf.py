"""BERT <-> Hugging Face: ``mcore-export-hf`` / ``mcore-import-hf`` with MLM and NSP logit parity.

A tiny BertModel (every tensor perturbed, so biases and norms are not their trivial init) is saved
as a logical checkpoint with a WordPiece ``vocab.txt`` tokenizer and

* exported to ``MegatronBertForPreTraining`` (``MegatronBertForMaskedLM`` with
  ``--bert-no-binary-head``): the export's own parity check (MLM and NSP logits, a padded batch with
  two token types, eager attention: MegatronBert has no sdpa) passes at fp32 <= 1e-4, and ``AutoModelForMaskedLM`` +
  ``pipeline("fill-mask")`` on the directory predict mcore's most likely token;
* imported back: the same logical tensors, exactly;
* Hugging Face-made ``MegatronBert*`` models (transformers' own random init, ``save_pretrained``)
  import with parity, the MaskedLM one folding its token-type row into the positions;
* the original post-LN ``BertForPreTraining`` is refused with one message naming
  ``MegatronBertForPreTraining``; a wrong tensor fails the parity check.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from mcore.checkpoint import load_logical_model_state, save_logical_model_checkpoint
from mcore.distributed.groups import ProcessGroups
from mcore.hf import export as hf_export
from mcore.hf import importer as hf_importer
from mcore.hf.bert import BertHeads
from mcore.hf.bert_io import check_bert_parity
from mcore.hf.errors import ParityError
from mcore.models.bert.bert_model import BertModel
from mcore.models.transformer.model_config import ModelConfig, padded_vocab_size

transformers = pytest.importorskip("transformers")

WORDS = "the cat sat on a mat dog ran to park big small red blue house tree runs ##s ##ed ##ing".split()
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, *"abcdefghijklmnopqrstuvwxyz", ".", ","]
MEGATRON_VOCAB = len(VOCAB) + 2  # Megatron's BERT tokenizer appends [BOS] and [EOS]
CONFIG = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=32, norm_epsilon=1e-12)


@pytest.fixture(scope="module")
def vocab_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("vocab") / "vocab.txt"
    path.write_text("".join(t + "\n" for t in VOCAB), encoding="utf-8")
    return str(path)


def _bert_checkpoint(root, vocab_file: str, binary_head: bool) -> tuple[str, dict, ModelConfig]:
    cfg = ModelConfig(**CONFIG)
    model = BertModel(
        cfg, ProcessGroups.single(), padded_vocab_size(MEGATRON_VOCAB), add_binary_head=binary_head
    )
    gen = torch.Generator().manual_seed(3)
    state = {}
    for local, spec in model.sharded_parameters().items():
        param = dict(model.named_parameters())[local].detach()
        state[spec.name] = param + 0.05 * torch.randn(param.shape, generator=gen)
    ckpt = os.path.join(root, "ckpt")
    run_config = {
        "model": dataclasses.asdict(cfg),
        "tokenizer": {"tokenizer_type": "BertWordPieceLowerCase", "vocab_file": vocab_file},
    }
    save_logical_model_checkpoint(ckpt, state, run_config, metadata={"tokenizer_vocab_size": MEGATRON_VOCAB})
    return ckpt, state, cfg


@pytest.fixture(scope="module", params=[True, False], ids=["binary-head", "no-binary-head"])
def exported(request, tmp_path_factory, vocab_file):
    root = tmp_path_factory.mktemp("bert")
    ckpt, state, cfg = _bert_checkpoint(str(root), vocab_file, request.param)
    out = str(root / "hf")
    report = hf_export.export_checkpoint(ckpt, out)
    return dict(binary_head=request.param, ckpt=ckpt, state=state, cfg=cfg, out=out, report=report, root=root)


def test_export_has_mlm_and_nsp_parity(exported):
    report = exported["report"]
    parity = report.parity
    assert parity.ok and parity.max_abs_diff <= 1e-4, parity.describe()
    expected = {"eager mlm"} | ({"eager nsp"} if exported["binary_head"] else set())
    assert set(parity.per_implementation) == expected
    config = json.load(open(os.path.join(exported["out"], "config.json")))
    arch = "MegatronBertForPreTraining" if exported["binary_head"] else "MegatronBertForMaskedLM"
    assert config["architectures"] == [arch] and config["model_type"] == "megatron-bert"
    assert config["vocab_size"] == MEGATRON_VOCAB and config["type_vocab_size"] == (
        2 if exported["binary_head"] else 1
    )
    assert {"vocab.txt", "tokenizer_config.json", "model.safetensors"} <= set(os.listdir(exported["out"]))


def test_fill_mask_pipeline_predicts_mcores_token(exported):
    out, cfg = exported["out"], exported["cfg"]
    model = transformers.AutoModelForMaskedLM.from_pretrained(out)
    assert type(model).__name__ == "MegatronBertForMaskedLM"
    fill = transformers.pipeline("fill-mask", model=out, top_k=1)
    text = "the cat [MASK] on the mat."
    best = fill(text)[0]
    ids = torch.tensor([fill.tokenizer(text)["input_ids"]])
    position = ids[0].tolist().index(VOCAB.index("[MASK]"))
    heads = BertHeads(exported["binary_head"], 2 if exported["binary_head"] else 0)
    ours = BertModel(
        cfg,
        ProcessGroups.single(),
        padded_vocab_size(len(VOCAB)),
        add_binary_head=heads.add_binary_head,
    ).eval()
    from mcore.inference.loading import load_logical_state

    load_logical_state(ours, exported["state"], MEGATRON_VOCAB)
    with torch.no_grad():
        logits, _ = ours(ids, torch.ones_like(ids))
    assert best["token"] == int(logits[0, position, :MEGATRON_VOCAB].argmax())
    assert fill.tokenizer.convert_ids_to_tokens(ids[0, 0].item()) == "[CLS]"


def test_import_of_the_export_gives_the_same_tensors(exported, capsys):
    ckpt2 = str(exported["root"] / "reimported")
    assert hf_importer.main(["--hf-dir", exported["out"], "--save", ckpt2]) == 0
    printed = capsys.readouterr().out
    assert ("--bert-no-binary-head" in printed) != exported["binary_head"]
    assert "--tokenizer-type BertWordPieceLowerCase --vocab-file" in printed
    state, metadata = load_logical_model_state(ckpt2)
    assert set(state) == set(exported["state"])
    padded = ("embedding.word_embeddings.weight", "output_layer.bias")  # rows past V: padding, not exported
    for name, tensor in exported["state"].items():
        rows = MEGATRON_VOCAB if name in padded else None
        assert torch.equal(state[name][:rows], tensor[:rows]), name
    assert metadata["run_config"]["tokenizer"]["tokenizer_type"] == "BertWordPieceLowerCase"


def _hf_made(root, arch: str, vocab_file: str) -> str:
    config = transformers.MegatronBertConfig(
        vocab_size=len(VOCAB),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=40,
        type_vocab_size=2,
    )
    torch.manual_seed(0)
    model = getattr(transformers, arch)(config)
    with torch.no_grad():  # random biases, norms and token types, so that every mapping matters
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    out = os.path.join(root, arch)
    model.save_pretrained(out)
    transformers.BertTokenizer(vocab_file).save_pretrained(out)
    return out


@pytest.mark.parametrize("arch", ["MegatronBertForPreTraining", "MegatronBertForMaskedLM"])
def test_import_of_a_hugging_face_model_has_parity(tmp_path, vocab_file, arch):
    hf_dir = _hf_made(str(tmp_path), arch, vocab_file)
    report = hf_importer.import_from_hf(hf_dir, str(tmp_path / "ckpt"))
    assert report.parity.ok and report.parity.max_abs_diff <= 1e-4, report.parity.describe()
    state, _ = load_logical_model_state(str(tmp_path / "ckpt"))
    assert ("binary_head.weight" in state) == (arch == "MegatronBertForPreTraining")
    # Without the binary head Megatron has no token types: row 0 is folded into the positions.
    assert ("embedding.tokentype_embeddings.weight" in state) == (arch == "MegatronBertForPreTraining")


def test_post_ln_bert_is_refused_with_the_class_to_use(tmp_path, capsys):
    config = transformers.BertConfig(
        vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=1, num_attention_heads=4
    )
    transformers.BertForPreTraining(config).save_pretrained(str(tmp_path / "bert"))
    capsys.readouterr()  # (transformers' progress bars)
    assert hf_importer.main(["--hf-dir", str(tmp_path / "bert"), "--save", str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "post-LN" in err and "MegatronBertForPreTraining" in err
    assert not (tmp_path / "ckpt").exists()


def test_parity_check_catches_a_wrong_tensor(exported):
    binary = exported["binary_head"]
    state = dict(exported["state"])
    name = "binary_head.weight" if binary else "lm_head.dense.weight"
    state[name] = state[name].flip(0)  # NSP classes swapped / LM-head features permuted
    with pytest.raises(ParityError, match="FAILED"):
        check_bert_parity(
            exported["cfg"], BertHeads(binary, 2 if binary else 0), state, MEGATRON_VOCAB, exported["out"]
        )
