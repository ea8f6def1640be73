"""Megatron's data pipeline reproduced exactly (golden values from megatron-core): split matrices,
GPTDataset indices, blending."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from mcore.config.fields import ConfigError
from mcore.data.builder import build_train_valid_test_datasets
from mcore.data.config import DataConfig
from mcore.data.gpt_dataset import GPTDataset, GPTDatasetConfig, build_ltor_masks_and_position_ids
from mcore.data.indexed_dataset import IndexedDataset
from mcore.data.indices import build_blending_indices, build_sample_index
from mcore.data.splits import parse_blend, parse_split, split_matrix, split_ranges

from .conftest import toy_lengths


def test_toy_corpus_is_the_documented_one():
    lens = toy_lengths()
    assert lens[:20].tolist() == [13, 16, 1, 4, 4, 8, 10, 20, 19, 5, 7, 13, 2, 7, 8, 15, 18, 6, 14, 9]
    assert int(lens.sum()) == 10462


@pytest.mark.parametrize(
    "split, matrix",
    [
        ("969,30,1", [(0, 0.969), (0.969, 0.999), (0.999, 1.0)]),
        ("969, 30, 1", [(0, 0.969), (0.969, 0.999), (0.999, 1.0)]),
        ("949,50,1", [(0, 0.949), (0.949, 0.999), (0.999, 1.0)]),
        ("99,1", [(0, 0.99), (0.99, 1.0), None]),
        ("99/1", [(0, 0.99), (0.99, 1.0), None]),
        ("1,0,0", [(0, 1.0), None, None]),
    ],
)
def test_split_matrices(split, matrix):
    assert split_matrix(parse_split(split)) == matrix


def test_split_ranges():
    ranges = split_ranges(split_matrix(parse_split("969,30,1")), 1000)
    assert [(int(r[0]), int(r[-1]) + 1) for r in ranges] == [(0, 969), (969, 999), (999, 1000)]
    assert all(r.dtype == np.int32 for r in ranges)
    train, valid, test = split_ranges(split_matrix(parse_split("969,30,1")), 100)
    assert (len(train), len(valid), len(test)) == (97, 3, 0)  # test [100, 100): empty
    assert [len(r) for r in split_ranges(split_matrix(parse_split("949,50,1")), 100)] == [95, 5, 0]


def test_bad_split_strings():
    with pytest.raises(ConfigError, match="has 4 numbers"):
        parse_split("1,2,3,4")
    with pytest.raises(ConfigError, match="positive number"):
        parse_split("0,0,0")


@pytest.mark.parametrize(
    "split, token",
    [("100,-5,5", "-5"), ("100,abc,5", "abc"), ("-1", "-1"), ("90,nan,10", "nan"), ("90,inf", "inf")],
)
def test_negative_or_non_numeric_split_is_refused_naming_the_flag(split, token):
    # Megatron's regex reads "100,-5,5" as 100,5,5 (and "100,abc,5" as 100,5): a silent misreading
    with pytest.raises(ConfigError, match=rf"--split '{split}': '{token}' is not a"):
        parse_split(split)


def test_parse_blend():
    assert parse_blend(["a"]) == (["a"], None)
    assert parse_blend(["a", "b", "c"]) == (["a", "b", "c"], None)
    assert parse_blend(["0.3", "a", "0.7", "b"]) == (["a", "b"], [0.3, 0.7])
    assert parse_blend(["a", "b"]) == (["a", "b"], None)  # "a" is not a number: all prefixes
    with pytest.raises(ConfigError, match="weight -1 for 'b' must be a positive number"):
        parse_blend(["1", "a", "-1", "b"])


def _gpt_config(tokenizer, **kw) -> GPTDatasetConfig:
    split = kw.pop("split", "969,30,1")
    return GPTDatasetConfig(
        random_seed=1234,
        sequence_length=8,
        tokenizer=tokenizer,
        split=split,
        split_matrix=split_matrix(parse_split(split)),
        **kw,
    )


def _splits(prefix, tokenizer, sizes=(120, 10, 5), **kw):
    config = _gpt_config(tokenizer, **kw)
    ds = IndexedDataset(prefix)
    ranges = split_ranges(config.split_matrix, len(ds))
    names = ("train", "valid", "test")
    return [
        None if r is None else GPTDataset(ds, prefix, r, n, s, config)
        for r, n, s in zip(ranges, sizes, names)
    ]


def test_gpt_dataset_indices(toy_prefix, toy_tokenizer):
    train, valid, test = _splits(toy_prefix, toy_tokenizer)

    assert (
        len(train) == 1258 and train.sample_index.shape == (1259, 2) and train.sample_index.dtype == np.int32
    )
    assert train.document_index[:24].tolist() == [
        40, 394, 219, 677, 881, 886, 373, 348, 143, 474, 108, 122,
        326, 939, 501, 630, 248, 906, 29, 670, 310, 222, 410, 60,
    ]  # fmt: skip
    assert train.sample_index[:6].tolist() == [[0, 0], [0, 8], [2, 3], [2, 11], [3, 6], [3, 14]]
    assert train.shuffle_index.dtype == np.uint32
    assert train.shuffle_index[:12].tolist() == [235, 97, 242, 686, 1084, 817, 327, 341, 635, 1177, 874, 117]

    sample = train[0]
    assert sample["tokens"].tolist() == list(range(263, 271))
    assert sample["labels"].tolist() == list(range(264, 272))
    assert sample["loss_mask"].tolist() == [1.0] * 8 and sample["loss_mask"].dtype == torch.float32
    assert sample["position_ids"].tolist() == list(range(8)) and sample["position_ids"].dtype == torch.int64
    assert sample["tokens"].dtype == torch.int64 and "attention_mask" not in sample

    assert len(valid) == 46
    assert valid.document_index[:24].tolist() == [
        976, 979, 973, 970, 997, 977, 972, 992, 983, 982, 991, 993,
        969, 971, 996, 995, 987, 974, 985, 994, 980, 978, 986, 998,
    ]  # fmt: skip
    assert valid.sample_index[:6].tolist() == [[0, 0], [1, 0], [1, 8], [2, 3], [2, 11], [3, 0]]
    assert valid.shuffle_index[:12].tolist() == [42, 22, 0, 21, 30, 10, 41, 18, 35, 3, 4, 38]

    assert test.document_index.tolist() == [999, 999, 999]  # 16 tokens, needs 41: 3 epochs
    assert test.sample_index.tolist() == [[0, 0], [0, 8], [1, 0], [1, 8], [2, 0], [2, 8]]
    assert test.shuffle_index.tolist() == [2, 1, 3, 0, 4]


def test_one_epoch_count(toy_prefix, toy_tokenizer):
    train, valid, test = _splits(toy_prefix, toy_tokenizer, sizes=(300, None, None), split="1,0,0")
    assert valid is None and test is None
    assert len(train) == (10462 - 1) // 8 == 1307


def test_reset_flags_sample(toy_prefix, toy_tokenizer):
    (train, _, _) = _splits(
        toy_prefix, toy_tokenizer, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True
    )
    wanted = [378, 379, 380, 381, 382, 0, 967, 968]
    found = [train[i] for i in range(len(train)) if train[i]["tokens"].tolist() == wanted]
    assert found, "the section 8.3 sample with an EOD at position 5 is missing"
    sample = found[0]
    assert sample["labels"].tolist() == [379, 380, 381, 382, 0, 967, 968, 969]
    assert sample["loss_mask"].tolist() == [1, 1, 1, 1, 1, 0, 1, 1]
    assert sample["position_ids"].tolist() == [0, 1, 2, 3, 4, 5, 0, 1]
    mask = sample["attention_mask"]
    assert mask.dtype == torch.bool and mask.shape == (1, 8, 8)
    causal = ~torch.ones(8, 8, dtype=torch.bool).tril()
    assert torch.equal(mask[0, :6], causal[:6])
    assert mask[0, 6].int().tolist() == [1, 1, 1, 1, 1, 1, 0, 1]
    assert mask[0, 7].int().tolist() == [1, 1, 1, 1, 1, 1, 0, 0]


def _megatron_masks_loop(tokens, eod, reset_pos, reset_att, eod_mask):
    """Megatron's per-EOD loop, written out, as the reference for the vectorized version."""
    n = tokens.numel()
    att = torch.tril(torch.ones(n, n)).unsqueeze(0)
    loss = torch.ones(n)
    if eod_mask:
        loss[tokens == eod] = 0.0
    pos = torch.arange(n)
    prev = 0
    for i in pos[tokens == eod].tolist():
        if reset_att:
            att[0, i + 1 :, : i + 1] = 0
        if reset_pos:
            pos[i + 1 :] -= i + 1 - prev
            prev = i + 1
    return att < 0.5, loss, pos


@pytest.mark.parametrize(
    "flags", [(False, False, False), (True, True, True), (True, False, True), (False, True, False)]
)
def test_masks_match_megatron_loop(flags):
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        tokens = torch.randint(0, 4, (16,), generator=gen)
        want = _megatron_masks_loop(tokens, 0, *flags)
        got = build_ltor_masks_and_position_ids(tokens, 0, flags[0], flags[1], flags[2], True)
        for a, b in zip(want, got):
            assert torch.equal(a, b)


def test_blending_vector():
    dataset_index, sample_index = build_blending_indices([0.3, 0.7], 20)
    assert dataset_index.dtype == np.int16 and sample_index.dtype == np.int64
    assert dataset_index.tolist() == [1, 0, 1, 1, 0, 1, 1, 0, 1, 1, 0, 1, 1, 1, 0, 1, 1, 0, 1, 1]
    assert sample_index.tolist() == [0, 0, 1, 2, 1, 3, 4, 2, 5, 6, 3, 7, 8, 9, 4, 10, 11, 5, 12, 13]


def test_blending_through_the_builder(toy_prefix, toy_tokenizer):
    config = DataConfig(data_path=("0.3", toy_prefix, "0.7", toy_prefix), split="969,30,1")
    train, _, _ = build_train_valid_test_datasets(config, toy_tokenizer, 8, 1234, (20, 10, 5))
    assert [d.num_samples for d in train.datasets] == [7, 15]  # ceil(ceil(20 w) * 1.005)
    assert len(train) == 20
    assert train.dataset_index.tolist() == [1, 0, 1, 1, 0, 1, 1, 0, 1, 1, 0, 1, 1, 1, 0, 1, 1, 0, 1, 1]
    want = [0, 0, 1, 2, 1, 3, 4, 2, 5, 6, 3, 7, 8, 9, 4, 10, 11, 5, 12, 13]
    assert train.dataset_sample_index.tolist() == want
    assert train[0]["tokens"].tolist() == list(range(263, 271))  # component 1, sample 0


@pytest.mark.exclusive  # timed: under pytest-xdist no other test runs meanwhile
def test_sample_index_scales_to_a_million_documents():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 2000, size=1_000_000).astype(np.int32)
    documents = np.arange(1_000_000, dtype=np.int32)
    np.random.RandomState(0).shuffle(documents)
    start = time.perf_counter()
    index = build_sample_index(lengths, documents, 4096, 1, int(lengths.sum()))
    elapsed = time.perf_counter() - start
    assert index.shape == ((int(lengths.sum()) - 1) // 4096 + 1, 2)
    assert elapsed < 5.0, f"sample index for 1e6 documents took {elapsed:.2f} s"
