"""Interop with megatron-core itself (a test-only dependency; CPU is enough).

* its ``IndexedDataset`` reads what we write (our builder and our preprocessing tool), identically;
* we read what its ``IndexedDatasetBuilder`` writes, and our builder writes the same bytes;
* its GPTDataset / BlendedDataset builder, given the same data, split, sizes and seed, produces the same
  document, sample, shuffle and blending indices, the same samples, and the same cache description as
  ours (ours adds only the data fingerprint).

Needs ``pip install megatron-core==0.16.1`` (the last release for Python 3.10/3.11; wheels for 3.10-3.13).
The tests skip only when megatron-core is not installed; an installed one that fails to import fails
them. The import path is ``megatron.core.datasets.*``; importing it runs ``megatron/core/__init__.py``,
which loads much of megatron-core (about 6 s on CPU, with warnings about missing Transformer Engine and
Apex) but needs no GPU. (megatron-core 0.17+ needs Python >= 3.12, and 0.19.2's ``megatron/core``
imports ``triton`` unconditionally, so there ``triton`` must be installed too, even on CPU.)
"""

from __future__ import annotations

import importlib.metadata
import json
import warnings

import numpy as np
import pytest

from mcore.data.builder import build_train_valid_test_datasets
from mcore.data.config import DataConfig
from mcore.data.indexed_dataset import DTYPE_CODES, IndexedDataset, IndexedDatasetBuilder, bin_path, idx_path
from mcore.data.preprocess import main as preprocess_main

from .conftest import CORPUS, write_jsonl, write_toy_dataset

try:
    MEGATRON_CORE_VERSION = importlib.metadata.version("megatron-core")
except importlib.metadata.PackageNotFoundError:
    pytest.skip(
        "megatron-core is not installed (pip install megatron-core==0.16.1); the Megatron interop tests need it",
        allow_module_level=True,
    )

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.datasets import indexed_dataset as megatron_indexed

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module")
def megatron_gpt():
    """megatron-core's GPT dataset machinery; it needs the package's compiled C++ helpers."""
    from types import SimpleNamespace

    from megatron.core.datasets import helpers_cpp as helpers
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.utils import get_blend_from_list

    return SimpleNamespace(
        helpers=helpers,
        Builder=BlendedMegatronDatasetBuilder,
        GPTDataset=GPTDataset,
        GPTDatasetConfig=GPTDatasetConfig,
        get_blend_from_list=get_blend_from_list,
    )


def _assert_same_dataset(ours: IndexedDataset, theirs) -> None:
    assert len(ours) == len(theirs)
    assert np.dtype(theirs.index.dtype) == ours.dtype
    np.testing.assert_array_equal(ours.sequence_lengths, theirs.sequence_lengths)
    np.testing.assert_array_equal(ours.sequence_pointers, theirs.index.sequence_pointers)
    np.testing.assert_array_equal(ours.document_indices, theirs.document_indices)
    for i in range(len(ours)):
        np.testing.assert_array_equal(ours[i], theirs[i])
        if ours.sequence_lengths[i] > 2:
            np.testing.assert_array_equal(ours.get(i, 1, 2), theirs.get(i, offset=1, length=2))


def _documents(dtype, seed=0):
    rng = np.random.default_rng(seed)
    return [
        [rng.integers(0, 120, size=int(n)).astype(dtype) for n in rng.integers(0, 6, size=3)]
        for _ in range(9)
    ]


@pytest.mark.parametrize("code", sorted(DTYPE_CODES))
def test_megatron_reads_what_we_write(tmp_path, code):
    dtype = DTYPE_CODES[code]
    prefix = str(tmp_path / "ours")
    with IndexedDatasetBuilder(bin_path(prefix), dtype=dtype) as builder:
        for doc in _documents(dtype):
            builder.add_document(np.concatenate(doc), [len(s) for s in doc])
        builder.finalize(idx_path(prefix))
    _assert_same_dataset(IndexedDataset(prefix), megatron_indexed.IndexedDataset(prefix))


@pytest.mark.parametrize("code", sorted(DTYPE_CODES))
def test_we_read_what_megatron_writes_and_write_the_same_bytes(tmp_path, code):
    dtype = DTYPE_CODES[code].newbyteorder("=")
    theirs, ours = str(tmp_path / "theirs"), str(tmp_path / "ours")
    import torch

    megatron_builder = megatron_indexed.IndexedDatasetBuilder(bin_path(theirs), dtype=dtype.type)
    our_builder = IndexedDatasetBuilder(bin_path(ours), dtype=dtype)
    for doc in _documents(dtype, seed=code):
        for seq in doc:
            megatron_builder.add_item(torch.from_numpy(seq.copy()))
            our_builder.add_item(seq)
        megatron_builder.end_document()
        our_builder.end_document()
    megatron_builder.add_document(torch.tensor([], dtype=torch.int64), [])  # an empty document
    our_builder.add_document([], [])
    megatron_builder.finalize(idx_path(theirs))
    our_builder.finalize(idx_path(ours))
    _assert_same_dataset(IndexedDataset(theirs), megatron_indexed.IndexedDataset(theirs))
    for suffix in (".idx", ".bin"):
        assert open(ours + suffix, "rb").read() == open(theirs + suffix, "rb").read()


def test_merge_matches_megatron_add_index(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    for prefix, seed in ((a, 1), (b, 2)):
        with IndexedDatasetBuilder(bin_path(prefix), dtype=np.uint16) as builder:
            for doc in _documents(np.uint16, seed):
                builder.add_document(np.concatenate(doc), [len(s) for s in doc])
            builder.finalize(idx_path(prefix))
    theirs, ours = str(tmp_path / "theirs"), str(tmp_path / "ours")
    megatron_builder = megatron_indexed.IndexedDatasetBuilder(bin_path(theirs), dtype=np.uint16)
    our_builder = IndexedDatasetBuilder(bin_path(ours), dtype=np.uint16)
    for prefix in (a, b):
        megatron_builder.add_index(prefix)
        our_builder.add_index(prefix)
    megatron_builder.finalize(idx_path(theirs))
    our_builder.finalize(idx_path(ours))
    for suffix in (".idx", ".bin"):
        assert open(ours + suffix, "rb").read() == open(theirs + suffix, "rb").read()


def test_megatron_reads_preprocessed_output(bpe_files, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in CORPUS[:10]] + [{"text": ""}])
    vocab_path, merges_path = bpe_files
    args = ["--input", inp, "--output-prefix", str(tmp_path / "p"), "--tokenizer-type", "GPT2BPETokenizer"]
    assert (
        preprocess_main([*args, "--vocab-file", vocab_path, "--merge-file", merges_path, "--append-eod"]) == 0
    )
    prefix = str(tmp_path / "p_text_document")
    _assert_same_dataset(IndexedDataset(prefix), megatron_indexed.IndexedDataset(prefix))


# ---- GPTDataset / BlendedDataset indices -------------------------------------------------------------


def _megatron_build(mg, blend, split, sizes, tokenizer, seq_length=8, seed=1234, **flags):
    config = mg.GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=mg.get_blend_from_list(list(blend)),
        split=split,
        tokenizer=tokenizer,
        reset_position_ids=flags.get("reset_position_ids", False),
        reset_attention_mask=flags.get("reset_attention_mask", False),
        eod_mask_loss=flags.get("eod_mask_loss", False),
    )
    return mg.Builder(mg.GPTDataset, list(sizes), lambda: True, config).build()


def _compare_gpt(ours, theirs):
    assert len(ours) == len(theirs)
    np.testing.assert_array_equal(ours.document_index, theirs.document_index)
    np.testing.assert_array_equal(ours.sample_index, theirs.sample_index)
    assert ours.sample_index.dtype == theirs.sample_index.dtype
    np.testing.assert_array_equal(ours.shuffle_index, theirs.shuffle_index)
    assert ours.shuffle_index.dtype == theirs.shuffle_index.dtype
    megatron_description = json.loads(theirs.unique_description)
    our_description = json.loads(ours.unique_description)
    assert our_description.pop("data_fingerprint")
    assert our_description == megatron_description
    assert list(our_description) == list(megatron_description)


def _compare_samples(ours, theirs, step=7):
    for i in range(0, len(ours), step):
        a, b = ours[i], theirs[i]
        for key in ("tokens", "labels", "loss_mask", "position_ids"):
            assert a[key].tolist() == b[key].tolist(), (i, key)
        if "attention_mask" in a:
            assert a["attention_mask"].tolist() == b["attention_mask"].tolist()


@pytest.mark.parametrize(
    "split, sizes, flags",
    [
        ("969,30,1", (120, 10, 5), {}),
        ("969, 30, 1", (3000, 200, 50), {"reset_position_ids": True, "eod_mask_loss": True}),  # many epochs
        ("80,20", (1500, 400, None), {"reset_attention_mask": True}),  # separate final epoch in train
        ("1,0,0", (None, None, None), {}),
    ],
)
def test_gpt_dataset_matches_megatron(megatron_gpt, toy_prefix, toy_tokenizer, split, sizes, flags):
    ours = build_train_valid_test_datasets(
        DataConfig(data_path=(toy_prefix,), split=split, **flags), toy_tokenizer, 8, 1234, sizes
    )
    theirs = _megatron_build(megatron_gpt, [toy_prefix], split, sizes, toy_tokenizer, **flags)
    for a, b in zip(ours, theirs):
        assert (a is None) == (b is None)
        if a is not None:
            _compare_gpt(a, b)
            _compare_samples(a, b)


@pytest.mark.parametrize("blend", [("0.3", "A", "0.7", "B"), ("A", "B"), ("2", "A", "1", "B", "1", "A")])
def test_blends_match_megatron(megatron_gpt, tmp_path, toy_prefix, toy_tokenizer, blend):
    other = write_toy_dataset(str(tmp_path / "other"), num_docs=400)
    paths = tuple({"A": toy_prefix, "B": other}.get(v, v) for v in blend)
    sizes = (200, 30, 10)
    ours = build_train_valid_test_datasets(
        DataConfig(data_path=paths, split="90,8,2"), toy_tokenizer, 8, 7, sizes
    )
    theirs = _megatron_build(megatron_gpt, paths, "90,8,2", sizes, toy_tokenizer, seed=7)
    for a, b in zip(ours, theirs):
        np.testing.assert_array_equal(a.dataset_index, b.dataset_index)
        np.testing.assert_array_equal(a.dataset_sample_index, b.dataset_sample_index)
        for da, db in zip(a.datasets, b.datasets):
            _compare_gpt(da, db)
        for i in range(0, len(a), 11):
            assert a[i]["tokens"].tolist() == b[i]["tokens"].tolist()


def test_blending_indices_match_the_cpp_helper(megatron_gpt):
    helpers_cpp = megatron_gpt.helpers
    from mcore.data.indices import build_blending_indices, build_exhaustive_blending_indices

    rng = np.random.default_rng(0)
    for _ in range(20):
        k = int(rng.integers(1, 9))
        weights = rng.random(k)
        weights = (weights / weights.sum()).tolist()
        size = int(rng.integers(1, 5000))
        want_d, want_s = np.zeros(size, np.int16), np.zeros(size, np.int64)
        helpers_cpp.build_blending_indices(want_d, want_s, weights, k, size, False)
        got_d, got_s = build_blending_indices(weights, size)
        np.testing.assert_array_equal(got_d, want_d)
        np.testing.assert_array_equal(got_s, want_s)
        counts = rng.integers(1, 400, size=k).astype(np.int64)
        want_d, want_s = np.zeros(counts.sum(), np.int16), np.zeros(counts.sum(), np.int64)
        helpers_cpp.build_exhaustive_blending_indices(want_d, want_s, counts, k)
        got_d, got_s = build_exhaustive_blending_indices(counts.tolist())
        np.testing.assert_array_equal(got_d, want_d)
        np.testing.assert_array_equal(got_s, want_s)


def test_sample_index_matches_the_cpp_helper(megatron_gpt):
    helpers_cpp = megatron_gpt.helpers
    from mcore.data.indices import build_sample_index

    rng = np.random.default_rng(1)
    for _ in range(300):
        num_docs = int(rng.integers(1, 60))
        lengths = rng.integers(0, 30, size=num_docs).astype(np.int32)
        epochs = int(rng.integers(1, 4))
        documents = np.tile(np.arange(num_docs, dtype=np.int32), epochs)
        rng.shuffle(documents)
        seq, extra, drop = int(rng.integers(2, 20)), int(rng.integers(0, 2)), bool(rng.integers(0, 2))
        tokens = int(lengths.sum())
        if tokens * epochs - extra < 1:
            continue
        want = helpers_cpp.build_sample_idx_int32(lengths, documents, seq, epochs, tokens, drop, extra)
        got = build_sample_index(lengths, documents, seq, epochs, tokens, drop, extra)
        np.testing.assert_array_equal(got, want)
