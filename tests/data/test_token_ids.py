"""Token ids outside the vocabulary: refused when the dataset is opened (naming the file and the id)
and, for data that bypass that check, on every batch (TP=1 and TP=2): the embedding and the loss
record the ids' range on the device, without a host sync, and the trainer's check names the id
(the real-process jobs are in ``test_token_id_check_e2e.py``)."""

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
    from mcore.models.gpt.gpt_model import GPTModel
    from mcore.models.transformer.model_config import ModelConfig

    cfg = ModelConfig(
        num_layers=1,
        hidden_size=16,
        num_attention_heads=2,
        seq_length=8,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    return GPTModel(cfg, groups, vocab)


def _staged_error(model, where="iteration 7") -> str | None:
    """The DataError the trainer's check raises for what ``model`` saw, or None."""
    from mcore.training.token_id_check import TokenIdCheck

    check = TokenIdCheck([model], DataConfig(data_path=("/data/a_text_document",)))
    check.stage(where)
    try:
        check.check()
    except DataError as err:
        return str(err)
    return None


def test_a_batch_with_an_id_out_of_range_is_named_at_tp1():
    from mcore.distributed.groups import ProcessGroups

    model = _tiny_gpt(ProcessGroups.single())
    ids = torch.randint(0, 128, (2, 8), device=ProcessGroups.single().device)
    assert torch.isfinite(model(ids, labels=ids).float()).all()
    assert _staged_error(model) is None  # in range: nothing to say
    bad = ids.clone()
    bad[1, 3] = 130
    # no IndexError (nor, on an accelerator, a device-side assert): the id is looked up as 0
    assert torch.isfinite(model(bad, labels=ids).float()).all()
    message = _staged_error(model)
    assert message == (
        "token id 130 (input id) in the batch of iteration 7 is outside the padded vocabulary [0, 128) of "
        "the model; data: --data-path /data/a_text_document. The data was tokenized with a larger "
        "vocabulary than --tokenizer-type/--vocab-size give: check the dataset against its tokenizer"
    )
    bad[1, 3] = -1
    model(bad)
    assert "token id -1 (input id)" in _staged_error(model)


def test_a_label_out_of_range_is_named_and_the_ignore_index_is_not():
    """A sample's last token is a label only: the loss does not index out of bounds, the check names it."""
    from mcore.distributed.groups import ProcessGroups

    model = _tiny_gpt(ProcessGroups.single())
    ids = torch.randint(0, 128, (2, 8), device=ProcessGroups.single().device)
    labels = ids.clone()
    labels[0, -1] = -100  # the loss's ignore index
    assert torch.isfinite(model(ids, labels=labels).float()).all()
    assert _staged_error(model) is None
    labels[1, -1] = 300
    assert torch.isfinite(model(ids, labels=labels).float()).all()
    assert "token id 300 (label) in the batch of iteration 7" in _staged_error(model)


def _tp2_rank():
    from mcore.config.parallel import ParallelConfig
    from mcore.distributed.groups import initialize_parallel

    groups = initialize_parallel(ParallelConfig(tensor_model_parallel_size=2))
    model = _tiny_gpt(groups)
    ids = torch.arange(16).reshape(2, 8)
    ok = bool(torch.isfinite(model(ids, labels=ids).float()).all()) and _staged_error(model) is None
    ids[0, 0] = 200  # owned by no rank: the vocab-parallel embedding would give zeros silently
    model(ids, labels=ids)
    return ok, _staged_error(model)


def test_a_batch_with_an_id_out_of_range_is_named_at_tp2():
    for ok, message in run_distributed(_tp2_rank, 2, timeout=120):
        assert ok
        assert message is not None
        assert (
            "token id 200 (input id) in the batch of iteration 7 is outside the padded vocabulary [0, 128)"
            in message
        )
