"""The pretraining loader: Megatron's 'single' sampler semantics, resume, DP slices, the batch contract."""

from __future__ import annotations

import pytest
import torch

from mcore.data.builder import build_train_valid_test_datasets
from mcore.data.config import DataConfig
from mcore.data.loader import build_pretraining_data_loader
from mcore.data.samplers import PretrainingSampler


def _ids(sampler):
    return [batch for batch in sampler]


def test_sampler_slices_each_global_micro_batch():
    rank0 = PretrainingSampler(10, 0, micro_batch_size=2, data_parallel_rank=0, data_parallel_size=2)
    rank1 = PretrainingSampler(10, 0, micro_batch_size=2, data_parallel_rank=1, data_parallel_size=2)
    assert _ids(rank0) == [[0, 1], [4, 5]]  # [8, 9] is an incomplete global batch: dropped
    assert _ids(rank1) == [[2, 3], [6, 7]]
    assert len(rank0) == 2


def test_sampler_resumes_where_it_stopped():
    full = _ids(PretrainingSampler(100, 0, 3, 1, 4))
    resumed = _ids(PretrainingSampler(100, 24, 3, 1, 4))  # 2 global batches of 12 consumed
    assert resumed == full[2:]
    everything = sorted(i for r in range(4) for b in PretrainingSampler(100, 0, 3, r, 4) for i in b)
    assert everything == list(range(96))


def test_sampler_keeps_partial_last_batch_when_asked():
    assert _ids(PretrainingSampler(10, 0, 2, 0, 2, drop_last=False)) == [[0, 1], [4, 5], [8, 9]]
    assert _ids(PretrainingSampler(10, 0, 2, 1, 2, drop_last=False)) == [[2, 3], [6, 7]]


@pytest.mark.parametrize(
    "args, message",
    [
        ((0, 0, 1, 0, 1), "no samples"),
        ((10, 10, 1, 0, 1), "consumed_samples=10 leaves no samples"),
        ((10, 0, 0, 0, 1), "micro_batch_size=0"),
        ((10, 0, 1, 2, 2), r"data_parallel_rank=2 outside \[0, 2\)"),
    ],
)
def test_sampler_errors(args, message):
    with pytest.raises(ValueError, match=message):
        PretrainingSampler(*args)


def _train(toy_prefix, tokenizer, **flags):
    config = DataConfig(data_path=(toy_prefix,), **flags)
    return build_train_valid_test_datasets(config, tokenizer, 8, 1234, (64, 8, 4))[0]


def test_batch_contract(toy_prefix, toy_tokenizer):
    train = _train(toy_prefix, toy_tokenizer)
    loader = build_pretraining_data_loader(train, 0, 4, 0, 1, num_workers=0, pin_memory=False)
    batch = next(iter(loader))
    assert set(batch) == {"tokens", "labels", "loss_mask", "position_ids"}
    assert batch["tokens"].shape == (4, 8) and batch["tokens"].dtype == torch.int64
    assert batch["labels"].dtype == torch.int64 and batch["position_ids"].dtype == torch.int64
    assert batch["loss_mask"].dtype == torch.float32
    assert torch.equal(batch["tokens"][0], train[0]["tokens"])
    assert torch.equal(batch["tokens"][:, 1:], batch["labels"][:, :-1])


def test_attention_mask_only_with_reset_attention_mask(toy_prefix, toy_tokenizer):
    train = _train(toy_prefix, toy_tokenizer, reset_attention_mask=True)
    batch = next(iter(build_pretraining_data_loader(train, 0, 2, 0, 1, num_workers=0, pin_memory=False)))
    mask = batch["attention_mask"]
    assert mask.shape == (2, 1, 8, 8) and mask.dtype == torch.bool
    assert not mask[:, :, torch.arange(8), torch.arange(8)].any()  # a token always sees itself
    future = torch.ones(8, 8, dtype=torch.bool).triu(1)
    assert mask[:, 0][:, future].all()  # never the future


def test_workers_give_the_same_batches(toy_prefix, toy_tokenizer):
    train = _train(toy_prefix, toy_tokenizer)
    inline = list(build_pretraining_data_loader(train, 8, 2, 1, 2, num_workers=0, pin_memory=False))
    background = list(build_pretraining_data_loader(train, 8, 2, 1, 2, num_workers=2, pin_memory=False))
    assert len(inline) == len(background) == (len(train) - 8) // 4
    for a, b in zip(inline, background):
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(inline[0]["tokens"][0], train[10]["tokens"])  # consumed 8, rank 1 of 2, mbs 2


def test_no_dataset_no_loader():
    assert build_pretraining_data_loader(None, 0, 1, 0, 1, 0, False) is None
