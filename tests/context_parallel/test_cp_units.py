"""The zigzag layout, the batch slicing, the ring's block schedule and the CP loss as pure functions."""

from __future__ import annotations

import pytest
import torch

from mcore.config.fields import ConfigError
from mcore.config.parallel import ParallelConfig
from mcore.models.transformer.context_parallel.layout import (
    gathered_to_global,
    ring_schedule,
    slice_for_cp,
    zigzag_indices,
)
from mcore.training.cp_batch import masked_token_mean, slice_batch_for_cp


def test_zigzag_indices_pair_each_chunk_with_its_mirror():
    # 16 tokens, cp=4 -> chunks of 2; rank r keeps chunks r and 7 - r
    assert zigzag_indices(16, 0, 4).tolist() == [0, 1, 14, 15]
    assert zigzag_indices(16, 1, 4).tolist() == [2, 3, 12, 13]
    assert zigzag_indices(16, 3, 4).tolist() == [6, 7, 8, 9]
    assert zigzag_indices(8, 1, 2).tolist() == [2, 3, 4, 5]
    every = torch.cat([zigzag_indices(24, r, 3) for r in range(3)])
    assert sorted(every.tolist()) == list(range(24))  # a partition of the sequence
    with pytest.raises(ValueError, match=r"seq_length=12 is not divisible by 2 x context_parallel_size=8"):
        zigzag_indices(12, 0, 4)


def test_gathered_to_global_undoes_the_rank_major_concatenation():
    for s, cp in ((8, 2), (16, 4), (24, 3)):
        gathered = torch.cat([zigzag_indices(s, r, cp) for r in range(cp)])
        assert gathered.index_select(0, gathered_to_global(s, cp)).tolist() == list(range(s))


def test_slice_batch_for_cp_cuts_every_tensor_on_its_sequence_dim():
    tokens = torch.arange(16).reshape(2, 8)
    mask = torch.zeros(2, 1, 8, 8, dtype=torch.bool)
    mask[:, :, 5] = True
    batch = {
        "tokens": tokens,
        "labels": tokens + 1,
        "loss_mask": torch.ones(2, 8),
        "position_ids": torch.arange(8).expand(2, 8),
        "attention_mask": mask,
    }
    part = slice_batch_for_cp(batch, 1, 2)  # chunks 1 and 2 of 4: positions 2..5
    assert part["tokens"].tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert part["labels"].tolist() == [[3, 4, 5, 6], [11, 12, 13, 14]]
    assert part["position_ids"].tolist() == [[2, 3, 4, 5]] * 2  # global positions
    assert part["attention_mask"].shape == (2, 1, 4, 8) and part["attention_mask"][0, 0, 3].all()
    assert slice_batch_for_cp(batch, 0, 1) is batch
    assert torch.equal(slice_for_cp(tokens, 1, 0, 1), tokens)


def test_ring_schedule_visits_every_block_once_with_its_causal_kind():
    assert ring_schedule(0, 2) == [(0, "diagonal"), (1, "q_second_half")]
    assert ring_schedule(1, 2) == [(1, "diagonal"), (0, "kv_first_half")]
    assert ring_schedule(2, 4) == [
        (2, "diagonal"),
        (1, "kv_first_half"),
        (0, "kv_first_half"),
        (3, "q_second_half"),
    ]
    for cp in (2, 3, 4):
        for r in range(cp):
            assert sorted(src for src, _ in ring_schedule(r, cp)) == list(range(cp))


def _visible(cp: int, r: int, src: int, kind: str, chunk_len: int = 2) -> torch.Tensor:
    """The keys each of rank r's queries sees in src's block under the kind's rule ([2L, 2L] bool)."""
    two = 2 * chunk_len
    seen = torch.zeros(two, two, dtype=torch.bool)
    if kind == "diagonal":
        return torch.ones(two, two, dtype=torch.bool).tril()
    if kind == "kv_first_half":
        seen[:, :chunk_len] = True
    else:
        seen[chunk_len:, :] = True
    return seen


def test_ring_block_kinds_give_the_causal_mask_of_the_whole_sequence():
    for cp in (2, 3, 4):
        s = 4 * cp  # chunks of 2
        for r in range(cp):
            q_pos = zigzag_indices(s, r, cp)
            for src, kind in ring_schedule(r, cp):
                k_pos = zigzag_indices(s, src, cp)
                causal = q_pos[:, None] >= k_pos[None, :]
                assert torch.equal(_visible(cp, r, src, kind), causal), (cp, r, src, kind)


def test_cp_loss_without_a_group_is_the_masked_mean_and_never_nan():
    losses = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    loss, report = masked_token_mean(losses, torch.tensor([[1, 0, 1, 0]]))
    assert loss.item() == pytest.approx(2.0) and report.item() == pytest.approx(2.0)
    loss, _ = masked_token_mean(losses, torch.zeros(1, 4))
    assert loss.item() == 0.0


def test_cp_flags_are_validated():
    assert ParallelConfig(context_parallel_size=2, cp_comm_type="a2a").cp_comm_type == "a2a"
    with pytest.raises(ConfigError, match=r"cp_comm_type='a2a\+p2p'.*not built"):
        ParallelConfig(context_parallel_size=4, cp_comm_type="a2a+p2p")
    with pytest.raises(ConfigError, match=r"hierarchical-context-parallel-sizes=\[2, 2\]"):
        ParallelConfig(context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 2])
    with pytest.raises(ConfigError, match=r"cp_comm_type='ring' must be one of p2p, a2a, allgather"):
        ParallelConfig(cp_comm_type="ring")


def _model(**kw):
    from mcore.models.transformer.model_config import ModelConfig

    base = dict(num_layers=2, hidden_size=16, num_attention_heads=4, seq_length=16, attention_dropout=0.0)
    return ModelConfig(**{**base, **kw})


@pytest.mark.parametrize(
    ("model", "parallel", "extra", "message"),
    [
        ({"seq_length": 12}, {"context_parallel_size": 4}, {},
         r"seq_length=12 is not divisible by 2 x context_parallel_size=8"),
        ({}, {"context_parallel_size": 2, "tensor_model_parallel_size": 3, "sequence_parallel": True}, {},
         r"seq_length=16 / context_parallel_size=2 = 8 is not divisible by tensor_model_parallel_size=3"),
        ({}, {"context_parallel_size": 4, "tensor_model_parallel_size": 2, "cp_comm_type": "a2a"}, {},
         r"num_attention_heads=4 is not divisible by tensor_model_parallel_size=2 x context_parallel_size=4"),
        ({"attention_dropout": 0.1}, {"context_parallel_size": 2}, {}, r"attention_dropout=0.1"),
        ({"position_embedding_type": "alibi"}, {"context_parallel_size": 2}, {}, r"'alibi'"),
        ({}, {"context_parallel_size": 2}, {"reset_attention_mask": True}, r"--reset-attention-mask"),
        ({}, {"context_parallel_size": 2}, {"device_graph_impl": "local"}, r"--cuda-graph-impl local"),
    ],
)  # fmt: skip
def test_context_parallel_refusals_name_the_flags(model, parallel, extra, message):
    from mcore.models.transformer.context_parallel.checks import check_context_parallel

    with pytest.raises(ConfigError, match=message):
        check_context_parallel(_model(**model), ParallelConfig(**parallel), **extra)
    check_context_parallel(
        _model(**model), ParallelConfig(**{**parallel, "context_parallel_size": 1}), **extra
    )


def test_bert_t5_and_generation_refuse_context_parallelism():
    from mcore.distributed.groups import ProcessGroups
    from mcore.distributed.topology import Topology
    from mcore.inference.generation import TextGenerator
    from mcore.training import bert, t5

    groups = ProcessGroups(topology=Topology.create(2, 0, cp=2))
    for provider, family in ((bert.model_provider, "BERT"), (t5.model_provider, "T5")):
        with pytest.raises(
            ConfigError, match=rf"context_parallel_size=2: context parallelism is not built for {family}"
        ):
            provider(None, groups, 64)
    with pytest.raises(
        ValueError, match=r"context_parallel_size=2: generation does not run with context parallel"
    ):
        TextGenerator(torch.nn.Linear(1, 1), groups, 64)


def test_mcore_generate_refuses_context_parallelism(capsys):
    from mcore.inference.generate import main

    assert main(["--load", "/nonexistent", "--context-parallel-size", "2", "--prompt", "hi"]) == 2
    assert (
        "context_parallel_size=2: generation does not run with context parallelism" in capsys.readouterr().err
    )
