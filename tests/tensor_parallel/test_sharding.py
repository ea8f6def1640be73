"""ShardSpec cut/merge rules and layout-independent initialization (no processes)."""

import pytest
import torch

from mcore.tensor_parallel.sharding import (
    VOCAB_INIT_BLOCK_ROWS,
    NormalInit,
    ShardSpec,
    draw_local_shard,
    tensor_seed,
)


def _full(*shape):
    return torch.arange(int(torch.tensor(shape).prod()), dtype=torch.float32).view(*shape)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize(
    "shape,dim,stacked", [((8, 3), 0, 1), ((3, 8), 1, 1), ((16, 3), 0, 2), ((8,), 0, 1), ((5, 2), None, 1)]
)
def test_shard_then_merge_is_the_identity(tp, shape, dim, stacked):
    full = _full(*shape)
    spec = ShardSpec("w", "w", shape, dim, tp_rank=0, tp_size=tp, num_stacked=stacked)
    shards = [spec.for_rank(t).shard(full) for t in range(tp)]
    assert all(tuple(s.shape) == spec.local_shape for s in shards)
    assert torch.equal(spec.merge(shards), full)


def test_swiglu_fc1_rank_holds_its_gate_and_up_rows():
    # logical [gate; up] with F=4 rows each: rank t of 2 holds [gate rows 2t,2t+1 ; up rows 4+2t, 4+2t+1].
    full = _full(8, 1)
    spec = ShardSpec("fc1", "fc1", (8, 1), 0, tp_rank=1, tp_size=2, num_stacked=2)
    assert spec.chunks() == [(0, 2, 2), (2, 6, 2)]
    assert spec.shard(full).flatten().tolist() == [2.0, 3.0, 6.0, 7.0]
    shards = [spec.for_rank(t).shard(full) for t in range(2)]
    assert not torch.equal(torch.cat(shards), full)  # naive concatenation interleaves gate and up
    assert torch.equal(spec.merge(shards), full)


def test_main_replica_and_layer_number():
    rep = ShardSpec("decoder.layers.3.input_layernorm.weight", "x", (4,), None, tp_rank=1, tp_size=2)
    assert rep.layer_number == 3 and not rep.is_main_replica
    assert rep.for_rank(0).is_main_replica
    tied = ShardSpec("embedding.word_embeddings.weight", "output_layer.weight", (8, 2), 0, tied_copy=True)
    assert tied.layer_number is None and not tied.is_main_replica


def test_seeds_depend_on_name_and_block():
    assert tensor_seed(1, "a") == tensor_seed(1, "a")
    assert len({tensor_seed(1, "a"), tensor_seed(2, "a"), tensor_seed(1, "b"), tensor_seed(1, "a", 0)}) == 4


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_draw_is_the_same_logical_tensor_at_any_tp(tp):
    init, device = NormalInit(0.02), torch.device("cpu")
    whole = draw_local_shard(ShardSpec("w", "w", (16, 8), 0), init, 7, device)
    for dim, shape, stacked in ((0, (16, 8), 1), (0, (16, 8), 2), (1, (16, 8), 1)):
        spec = ShardSpec("w", "w", shape, dim, tp_size=tp, num_stacked=stacked)
        shards = [draw_local_shard(spec.for_rank(t), init, 7, device) for t in range(tp)]
        assert torch.equal(spec.merge(shards), whole)


def test_padded_vocab_rows_do_not_depend_on_the_padding():
    init, device = NormalInit(1.0), torch.device("cpu")
    rows = 3 * VOCAB_INIT_BLOCK_ROWS
    one = draw_local_shard(ShardSpec("emb", "emb", (rows, 4), 0, vocab_padded=True), init, 3, device)
    for tp, padded in ((2, rows + 2 * VOCAB_INIT_BLOCK_ROWS), (4, 4 * VOCAB_INIT_BLOCK_ROWS)):
        spec = ShardSpec("emb", "emb", (padded, 4), 0, tp_size=tp, vocab_padded=True)
        merged = spec.merge([draw_local_shard(spec.for_rank(t), init, 3, device) for t in range(tp)])
        assert merged.shape == (padded, 4)
        assert torch.equal(merged[:rows], one)
    # a size that is not a multiple of the block (make_vocab_size_divisible_by=1) keeps the prefix too
    odd = draw_local_shard(ShardSpec("emb", "emb", (rows - 5, 4), 0, vocab_padded=True), init, 3, device)
    assert torch.equal(odd, one[: rows - 5])
