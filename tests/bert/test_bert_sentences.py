"""``mcore-preprocess-data --split-sentences``: the rule-based splitter, Megatron's ``_sentence`` outputs
byte-identical to megatron-core's IndexedDatasetBuilder given the same sentences, and workers = 1 worker."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from mcore.data.indexed_dataset import IndexedDataset, bin_path, idx_path
from mcore.data.preprocess import main as preprocess_main
from mcore.data.sentences import split_sentences
from mcore.data.tokenizers import BertWordPieceTokenizer, train_wordpiece_vocab

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # megatron-core's builder on numpy 2

DOCS = [
    "Mr. Smith went to Washington. He met Dr. J. Doe on Jan. 5th! Was it raining? No.",
    'Pi is 3.14. See e.g. the U.S. Army report, p. 12. "Quoted sentence." Then (a bracket.) Done',
    "A line\nwith a break inside. Next paragraph.\n\nThird one...  Fourth?! fifth word.",
    "日本語の文です。次の文！最後？ And English after it.",
    "",
    "   ",
    "no final punctuation here",
    "Héllo wörld. Ünïcode çase. Ångström units.",
]


@pytest.mark.parametrize(
    "text, sentences",
    [
        ("  Hello there. How are you? I am fine!  ", ["  Hello there.", "How are you?", "I am fine!"]),
        ("Mr. Smith met Dr. J. Doe. He left.", ["Mr. Smith met Dr. J. Doe.", "He left."]),
        (
            "Pi is 3.14. See e.g. the U.S. Army. Ph.D. work.",
            ["Pi is 3.14.", "See e.g. the U.S. Army.", "Ph.D. work."],
        ),
        ('He said "Stop." Then (he left.) OK', ['He said "Stop."', "Then (he left.)", "OK"]),
        ("It costs approx. five. Or... maybe not.", ["It costs approx. five.", "Or... maybe not."]),
        ("A line\nbreak. Next.\n\nLast one?! yes.", ["A line\nbreak.", "Next.", "Last one?! yes."]),
        ("日本語です。次の文！最後？ok", ["日本語です。", "次の文！", "最後？", "ok"]),
        ("heading without period\n\nBody. End.", ["heading without period\n\nBody.", "End."]),
        ("", []),
        (" \n\t", []),
    ],
)
def test_splitter_rules(text, sentences):
    assert split_sentences(text) == sentences


@pytest.mark.parametrize("text", DOCS)
def test_keep_newlines_keeps_all_text_and_drops_only_the_gaps_without_it(text):
    kept = split_sentences(text, keep_newlines=True)
    assert "".join(kept) == text.rstrip() if text.strip() else kept == []
    assert [s.rstrip() for s in kept] == split_sentences(text)
    assert split_sentences("One.\n\nTwo.\nThree", keep_newlines=True) == ["One.\n\n", "Two.\n", "Three"]


@pytest.fixture(scope="module")
def vocab(tmp_path_factory) -> str:
    return train_wordpiece_vocab(DOCS * 10, 300, tmp_path_factory.mktemp("vocab"), lower_case=True)


def _run(vocab, inp, out, *extra):
    args = ["--input", str(inp), "--output-prefix", str(out), "--tokenizer-type", "BertWordPieceLowerCase",
            "--vocab-file", vocab, "--split-sentences", *extra]  # fmt: skip
    assert preprocess_main(args) == 0


def test_sentence_dataset_is_megatron_bytes_and_workers_agree(vocab, tmp_path):
    megatron_indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    import torch

    records = [{"text": d, "id": i} for i, d in enumerate(DOCS)] * 3
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    _run(vocab, inp, tmp_path / "w1" / "bert", "--workers", "1")
    _run(vocab, inp, tmp_path / "w2" / "bert", "--workers", "2", "--chunk-size", "2")
    assert sorted(os.listdir(tmp_path / "w1")) == [
        "bert_text_sentence.bin",
        "bert_text_sentence.idx",
        "bert_text_sentence.tokenizer.json",
    ]

    # What Megatron's tools/preprocess_data.py writes for these sentences: per JSON line one document
    # whose items are the non-empty tokenized sentences, through megatron-core's builder.
    tok = BertWordPieceTokenizer(vocab, lower_case=True)
    theirs = str(tmp_path / "theirs")
    builder = megatron_indexed.IndexedDatasetBuilder(bin_path(theirs), dtype=np.uint16)
    for record in records:
        ids = [tok.tokenize(s) for s in split_sentences(record["text"])]
        ids = [s for s in ids if s]
        flat = torch.tensor([t for s in ids for t in s], dtype=torch.int64)
        builder.add_document(flat, [len(s) for s in ids])
    builder.finalize(idx_path(theirs))
    ours = str(tmp_path / "w1" / "bert_text_sentence")
    for suffix in (".bin", ".idx"):
        expected = open(theirs + suffix, "rb").read()
        assert open(ours + suffix, "rb").read() == expected
        assert open(str(tmp_path / "w2" / "bert_text_sentence") + suffix, "rb").read() == expected
    ds = IndexedDataset(ours)
    assert len(ds.document_indices) == len(records) + 1
    first = split_sentences(DOCS[0])
    assert len(first) == 4 and [ds[i].tolist() for i in range(4)] == [tok.tokenize(s) for s in first]


def test_keep_newlines_reaches_the_tokens(tmp_path, bpe_text_files):
    """With a tokenizer that keeps whitespace (GPT-2 BPE), --keep-newlines puts the line breaks in the data."""
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"text": "One.\n\nTwo."}) + "\n", encoding="utf-8")
    vocab_json, merges = bpe_text_files
    common = ["--input", str(inp), "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab_json,
              "--merge-file", merges, "--split-sentences"]  # fmt: skip
    assert preprocess_main([*common, "--output-prefix", str(tmp_path / "a")]) == 0
    assert preprocess_main([*common, "--output-prefix", str(tmp_path / "b"), "--keep-newlines"]) == 0
    from mcore.data.tokenizers import GPT2BPETokenizer

    tok = GPT2BPETokenizer(vocab_json, merges)
    plain, kept = (
        IndexedDataset(str(tmp_path / "a_text_sentence")),
        IndexedDataset(str(tmp_path / "b_text_sentence")),
    )
    assert [tok.detokenize(plain[i].tolist()) for i in range(len(plain))] == ["One.", "Two."]
    assert [tok.detokenize(kept[i].tolist()) for i in range(len(kept))] == ["One.\n\n", "Two."]


@pytest.fixture(scope="module")
def bpe_text_files(tmp_path_factory):
    pytest.importorskip("tokenizers")
    from mcore.data.tokenizers import train_bpe_tokenizer

    return train_bpe_tokenizer(["One.\n\nTwo. Three.\n"] * 20, 300, tmp_path_factory.mktemp("bpe"))
