"""Shared fixtures of the data tests: the toy corpus of the golden GPTDataset indices and a small BPE vocabulary."""

from __future__ import annotations

import json
import os
from collections import OrderedDict

import numpy as np
import pytest

from mcore.data.indexed_dataset import IndexedDatasetBuilder, bin_path, idx_path

TOY_DOCS = 1000


class ToyTokenizer:
    """The section 8.3 tokenizer: vocab 1000, eod 0, no pad."""

    vocab_size = 1000
    eod = 0
    pad = None
    special_token_ids = frozenset({0})
    unique_identifiers = OrderedDict([("class", "Tok"), ("vocab", 1000)])


def toy_lengths(num_docs: int = TOY_DOCS) -> np.ndarray:
    return np.random.RandomState(0).randint(1, 21, size=num_docs)


def toy_document(d: int, length: int) -> list[int]:
    """Document d: ``[(d*7+j) % 999 + 1 for j in range(len-1)] + [0]`` (eod = 0)."""
    return [(d * 7 + j) % 999 + 1 for j in range(length - 1)] + [0]


def write_toy_dataset(prefix: str, num_docs: int = TOY_DOCS) -> str:
    os.makedirs(os.path.dirname(prefix), exist_ok=True)
    with IndexedDatasetBuilder(bin_path(prefix), dtype=np.uint16) as builder:
        for d, length in enumerate(toy_lengths(num_docs)):
            builder.add_document(toy_document(d, int(length)), [int(length)])
        builder.finalize(idx_path(prefix))
    return prefix


@pytest.fixture
def toy_tokenizer() -> ToyTokenizer:
    return ToyTokenizer()


@pytest.fixture
def toy_prefix(tmp_path) -> str:
    """A fresh copy of the 1000-document toy dataset (tests may write caches next to it)."""
    return write_toy_dataset(str(tmp_path / "docs"))


CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Megatron-LM trains large transformer language models with tensor and pipeline parallelism.",
    "def tokenize(text):\n    return [ord(c) for c in text]  # not a real tokenizer\n",
    "Héllo wörld, naïve café — “quotes” and emoji 🎉 and CJK 日本語テキスト.",
    "Numbers 12345 and 3.14159, dates 2024-01-01, and    extra   spaces\n\n\nnewlines.",
    "It's, don't, we'll, they've, I'm, she'd: contractions everywhere.",
] * 20


@pytest.fixture(scope="session")
def bpe_files(tmp_path_factory) -> tuple[str, str]:
    """vocab.json / merges.txt of a 500-token byte-level BPE trained on CORPUS."""
    pytest.importorskip("tokenizers", reason="the 'tokenizers' package is needed for BPE tests")
    from mcore.data.tokenizers import train_bpe_tokenizer

    return train_bpe_tokenizer(CORPUS, 500, tmp_path_factory.mktemp("bpe"))


def write_jsonl(path, records, raw_lines=()) -> str:
    """Write records as JSON Lines; ``raw_lines`` are appended verbatim (bytes)."""
    with open(path, "wb") as f:
        for record in records:
            f.write(json.dumps(record).encode("utf-8") + b"\n")
        for raw in raw_lines:
            f.write(raw)
    return os.fspath(path)
