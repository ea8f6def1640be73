"""Token ids outside the vocabulary: refused when the dataset is opened (naming the file and the id)
and, for data that bypass that check, by the embedding on every batch (TP=1 and TP=2), on the
device and without a host sync."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mcore.data.builder import build_train_valid_test_datasets
from mcore.data.config import DataConfig
from mcore.data.errors import DataError
from mcore.data.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetBuilder,
    bin_path,
    check_token_ids,
    idx_path,
)
from mcore.testing.distributed import run_distributed

from .conftest import ToyTokenizer, write_toy_dataset


def _write(prefix: str, documents: list[list[int]]) -> str:
    with IndexedDatasetBuilder(bin_path(prefix), dtype=np.uint16) as builder:
        for doc in documents:
            builder.add_document(doc, [len(doc)])
        builder.finalize(idx_path(prefix))
    return prefix


def test_a_dataset_of_another_tokenizer_fails_at_open_naming_the_file_and_the_id(tmp_path, toy_tokenizer):
    # ids of a 1200-token vocabulary read with the 1000-token tokenizer: id 1100 is the first one out
    prefix = _write(str(tmp_path / "other"), [[5, 17, 1100, 3, 1199, 0], [9, 0]])
    config = DataConfig(data_path=[prefix], split="100,0,0")
    with pytest.raises(DataError) as err:
        build_train_valid_test_datasets(config, toy_tokenizer, 4, 1234, (8, 0, 0))
    message = str(err.value)
    assert f"{prefix}.bin: token id 1100 at token 2 (byte offset 4)" in message
    assert "outside the tokenizer's vocabulary [0, 1000)" in message


def test_the_sample_check_reads_a_bounded_spread_of_a_large_file(tmp_path):
    """A large file is sampled (64 windows spread over it, the last tokens included), not read whole."""
    n = 64 * 4096 * 4
    tokens = np.arange(n) % 1000
    tokens[-1] = 1000  # the very last token is out of range
    prefix = _write(str(tmp_path / "big"), [tokens.tolist()])
    dataset = IndexedDataset(prefix)
    with pytest.raises(DataError, match=rf"token id 1000 at token {n - 1} \(byte offset {2 * (n - 1)}\)"):
        check_token_ids(dataset, 1000)
    check_token_ids(dataset, 1001)  # in range: nothing to say
    # an id between the sampled windows is left to the per-batch device check
    tokens[-1] = 0
    tokens[4096 * 2 + 10] = 5000
    check_token_ids(IndexedDataset(_write(str(tmp_path / "gap"), [tokens.tolist()])), 1000)


def test_in_range_data_opens(tmp_path, toy_tokenizer):
    prefix = write_toy_dataset(str(tmp_path / "docs"))
    config = DataConfig(data_path=[prefix], split="100,0,0")
    train, _, _ = build_train_valid_test_datasets(config, toy_tokenizer, 4, 1234, (8, 0, 0))
    assert len(train) >= 8


class _SmallTokenizer(ToyTokenizer):
    vocab_size = 500


def _tiny_gpt(groups, vocab=128):
    from mcore.models.config import ModelConfig
    from mcore.models.gpt import GPTModel

    cfg = ModelConfig(
        num_layers=1,
        hidden_size=16,
        num_attention_heads=2,
        seq_length=8,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    return GPTModel(cfg, groups, vocab)


def test_a_batch_with_an_id_out_of_range_fails_at_tp1():
    from mcore.distributed.groups import ProcessGroups

    model = _tiny_gpt(ProcessGroups.single())
    ids = torch.randint(0, 128, (2, 8))
    assert torch.isfinite(model(ids, labels=ids).float()).all()  # in range: unaffected
    ids[1, 3] = 130
    with pytest.raises(RuntimeError, match=r"token id out of range: every input id must be in \[0, 128\)"):
        model(ids, labels=ids)
    ids[1, 3] = -1
    with pytest.raises(RuntimeError, match=r"token id out of range"):
        model(ids)


def _tp2_rank():
    from mcore.config.parallel import ParallelConfig
    from mcore.distributed.groups import initialize_parallel

    groups = initialize_parallel(ParallelConfig(tensor_model_parallel_size=2))
    model = _tiny_gpt(groups)
    ids = torch.arange(16).reshape(2, 8)
    ok = bool(torch.isfinite(model(ids, labels=ids).float()).all())
    ids[0, 0] = 200  # owned by no rank: the vocab-parallel embedding would give zeros silently
    try:
        model(ids, labels=ids)
    except RuntimeError as err:
        return ok, str(err)
    return ok, None


def test_a_batch_with_an_id_out_of_range_fails_at_tp2():
    for ok, message in run_distributed(_tp2_rank, 2, timeout=120):
        assert ok
        assert message is not None and "token id out of range: every input id must be in [0, 128)" in message
