"""GPTDataset caching (including the stale-data hazard), the empty-split hazard, and the builder's sources."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import mcore.data.gpt_dataset as gpt_module
from mcore.config.fields import ConfigError
from mcore.data.blended_dataset import BlendedDataset
from mcore.data.builder import build_train_valid_test_datasets, gpt_dataset_config
from mcore.data.config import DataConfig
from mcore.data.errors import DataError
from mcore.data.gpt_dataset import GPTDataset
from mcore.data.indexed_dataset import IndexedDataset
from mcore.data.mock_dataset import MockGPTDataset
from mcore.data.tokenizers import NullTokenizer

from .conftest import write_toy_dataset

SIZES = (120, 10, 5)


def _build(prefix, tokenizer, sizes=SIZES, **kw):
    return build_train_valid_test_datasets(DataConfig(data_path=(prefix,), **kw), tokenizer, 8, 1234, sizes)


def _cache_files(directory):
    return sorted(os.listdir(directory)) if os.path.isdir(directory) else []


def test_indices_are_cached_next_to_the_data(toy_prefix, toy_tokenizer, monkeypatch):
    train, valid, test = _build(toy_prefix, toy_tokenizer)
    cache_dir = os.path.join(toy_prefix, "cache", "GPTDataset_indices")
    files = _cache_files(cache_dir)
    assert len(files) == 12  # 3 splits x (description + 3 arrays)
    suffixes = {f.split("-", 1)[1] for f in files}
    assert "GPTDataset-train-description.txt" in suffixes and "GPTDataset-test-shuffle_index.npy" in suffixes

    # A second build must load, not rebuild.
    def refuse(*args, **kwargs):
        raise AssertionError("indices were rebuilt despite a cache hit")

    monkeypatch.setattr(gpt_module, "build_sample_index", refuse)
    train2, valid2, test2 = _build(toy_prefix, toy_tokenizer)
    for a, b in ((train, train2), (valid, valid2), (test, test2)):
        np.testing.assert_array_equal(a.document_index, b.document_index)
        np.testing.assert_array_equal(a.sample_index, b.sample_index)
        np.testing.assert_array_equal(a.shuffle_index, b.shuffle_index)
        assert a[0]["tokens"].tolist() == b[0]["tokens"].tolist()


def test_description_is_megatrons_plus_the_data_fingerprint(toy_prefix, toy_tokenizer):
    train, _, _ = _build(toy_prefix, toy_tokenizer, split="969,30,1")
    description = json.loads(train.unique_description)
    assert list(description) == [
        "class", "dataset_path", "num_samples", "index_split", "random_seed", "sequence_length",
        "split", "split_matrix", "tokenizer", "data_fingerprint",
    ]  # fmt: skip
    assert description["split_matrix"] == [[0, 0.969], [0.969, 0.999], [0.999, 1.0]]
    assert description["tokenizer"] == {"class": "Tok", "vocab": 1000}
    assert description["data_fingerprint"]["idx_size"] == os.path.getsize(toy_prefix + ".idx")
    cache_dir = os.path.join(toy_prefix, "cache", "GPTDataset_indices")
    name = next(f for f in _cache_files(cache_dir) if f.endswith("train-description.txt"))
    with open(os.path.join(cache_dir, name)) as f:
        assert f.read() == train.unique_description


def test_rewritten_data_is_not_served_stale_indices(tmp_path, toy_tokenizer):
    """Megatron's hazard: same path, same config, new data -> it reuses the old indices. We must not."""
    prefix = write_toy_dataset(str(tmp_path / "docs"), num_docs=100)
    small_train, _, _ = _build(prefix, toy_tokenizer, sizes=(None, None, None), split="1,0,0")
    write_toy_dataset(prefix, num_docs=1000)  # rewritten in place
    big_train, _, _ = _build(prefix, toy_tokenizer, sizes=(None, None, None), split="1,0,0")
    assert len(small_train) == (int(np.random.RandomState(0).randint(1, 21, 100).sum()) - 1) // 8
    assert len(big_train) == (10462 - 1) // 8
    assert big_train.document_index.max() > 99


def test_data_cache_path(toy_prefix, toy_tokenizer, tmp_path):
    cache = str(tmp_path / "cache")
    _build(toy_prefix, toy_tokenizer, data_cache_path=cache)
    assert len(_cache_files(cache)) == 12
    assert not os.path.exists(os.path.join(toy_prefix, "cache"))


def test_unwritable_cache_still_builds(toy_prefix, toy_tokenizer, tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    train, _, _ = _build(toy_prefix, toy_tokenizer, data_cache_path=str(blocker / "sub"))
    assert len(train) == 1258
    assert "cannot write the index cache" in caplog.text


def test_empty_split_is_an_error_not_a_hang(tmp_path, toy_tokenizer):
    prefix = write_toy_dataset(str(tmp_path / "docs"), num_docs=100)
    with pytest.raises(DataError) as err:
        _build(prefix, toy_tokenizer, sizes=(10, 10, 5), split="969,30,1")
    message = str(err.value)
    assert "the test split of" in message and "docs" in message
    assert "--split '969,30,1' gives it no sequences of 100" in message
    assert "5 test samples were requested" in message


def test_empty_split_with_no_samples_asked_is_empty(tmp_path, toy_tokenizer):
    prefix = write_toy_dataset(str(tmp_path / "docs"), num_docs=100)
    train, valid, test = _build(prefix, toy_tokenizer, sizes=(10, 10, 0), split="969,30,1")
    assert len(test) == 0 and len(train) >= 10


def test_padding_sample_has_no_loss(toy_prefix, toy_tokenizer):
    train, _, _ = _build(toy_prefix, toy_tokenizer)
    sample = train[None]
    assert sample["loss_mask"].sum() == 0 and sample["tokens"].shape == (8,)


def test_missing_data_path_names_it(tmp_path, toy_tokenizer):
    with pytest.raises(DataError, match=r"missing data path '.*nope'"):
        _build(str(tmp_path / "nope"), toy_tokenizer)


def test_no_mmap_reads_the_same(toy_prefix, toy_tokenizer):
    a, _, _ = _build(toy_prefix, toy_tokenizer)
    b, _, _ = _build(toy_prefix, toy_tokenizer, mmap_bin_files=False)
    assert all(a[i]["tokens"].tolist() == b[i]["tokens"].tolist() for i in range(0, len(a), 97))


def test_unweighted_blend_of_two_prefixes(tmp_path, toy_tokenizer):
    a = write_toy_dataset(str(tmp_path / "a"), num_docs=200)
    b = write_toy_dataset(str(tmp_path / "b"), num_docs=400)
    train, valid, _ = build_train_valid_test_datasets(
        DataConfig(data_path=(a, b), split="90,10,0"), toy_tokenizer, 8, 1234, (50, 5, 0)
    )
    assert isinstance(train, BlendedDataset) and len(train) == 50
    assert [d.num_samples for d in train.datasets] == [None, None]  # whole epochs, weighted by length
    assert abs(train.weights[1] / train.weights[0] - len(train.datasets[1]) / len(train.datasets[0])) < 1e-9


def test_weighted_blend_needs_sizes(toy_prefix, toy_tokenizer):
    with pytest.raises(ConfigError, match="the valid split needs a sample count"):
        build_train_valid_test_datasets(
            DataConfig(data_path=("1", toy_prefix, "1", toy_prefix)), toy_tokenizer, 8, 1, (10, None, 1)
        )


def test_blend_that_oversamples_a_component_is_an_error(toy_prefix, toy_tokenizer):
    config = gpt_dataset_config(DataConfig(data_path=(toy_prefix,)), toy_tokenizer, 8, 1234)
    ds = IndexedDataset(toy_prefix)
    small = GPTDataset(ds, toy_prefix, np.arange(0, 10, dtype=np.int32), None, "train", config)
    big = GPTDataset(ds, toy_prefix, np.arange(10, 900, dtype=np.int32), None, "train", config)
    with pytest.raises(
        DataError, match=r"asks \d+ samples of component 0 .* which has only \d+; raise --mid-level"
    ):
        BlendedDataset([small, big], [0.5, 0.5], 100, config)


def test_blended_indices_cached_only_with_cache_path(toy_prefix, toy_tokenizer, tmp_path):
    cache = str(tmp_path / "cache")
    build_train_valid_test_datasets(
        DataConfig(data_path=("0.5", toy_prefix, "0.5", toy_prefix), data_cache_path=cache),
        toy_tokenizer, 8, 1234, SIZES,
    )  # fmt: skip
    assert any("BlendedDataset-train-dataset_index.npy" in f for f in _cache_files(cache))


def test_per_split_paths(tmp_path, toy_tokenizer):
    a = write_toy_dataset(str(tmp_path / "a"), num_docs=300)
    b = write_toy_dataset(str(tmp_path / "b"), num_docs=50)
    train, valid, test = build_train_valid_test_datasets(
        DataConfig(train_data_path=(a,), valid_data_path=("1", a, "1", b)), toy_tokenizer, 8, 1, (30, 6, 0)
    )
    assert test is None
    assert isinstance(train, GPTDataset) and len(train.indices) == 300  # the whole dataset, not --split
    assert isinstance(valid, BlendedDataset) and len(valid) == 6


def test_mock_data():
    tokenizer = NullTokenizer(1000)
    train, valid, test = build_train_valid_test_datasets(
        DataConfig(mock_data=True, split="99,1,0"), tokenizer, 64, 1234, (16, 4, None)
    )
    assert isinstance(train, MockGPTDataset) and test is None
    assert len(train) >= 16 and len(valid) >= 4
    sample = train[3]
    assert sample["tokens"].shape == (64,) and int(sample["tokens"].max()) <= 1000
    text = train.dataset.get(0)
    assert text[-1] == tokenizer.eod and text[:3].tolist() == [1, 2, 3]


def test_no_source_is_a_config_error(toy_tokenizer):
    with pytest.raises(ConfigError, match="no training data"):
        build_train_valid_test_datasets(DataConfig(), toy_tokenizer, 8, 1, SIZES)
