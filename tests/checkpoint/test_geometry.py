"""Box geometry of the checkpoint: any saved TP/DP cut of a logical tensor reassembles into any other."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from mcore.checkpoint.geometry import (
    Placement,
    copy_into,
    full_placement,
    overlaps,
    pieces,
    placement_from_spec,
    required_elements,
)
from mcore.tensor_parallel.sharding import ShardSpec


def _spec(shape, pdim, tp, rank, stacked=1):
    return ShardSpec("w", "w", tuple(shape), pdim, tp_rank=rank, tp_size=tp, num_stacked=stacked)


def _dp_cuts(numel, dp, gen):
    """``dp`` contiguous flat ranges covering [0, numel) with random (possibly empty) sizes."""
    cuts = sorted(torch.randint(0, numel + 1, (dp - 1,), generator=gen).tolist())
    bounds = [0, *cuts, numel]
    return [(bounds[i], bounds[i + 1]) for i in range(dp)]


def _saved_pieces(full, pdim, tp, stacked, dp, gen):
    out = []
    for rank in range(tp if pdim is not None else 1):  # a replicated tensor: TP rank 0 only
        spec = _spec(full.shape, pdim, tp, rank, stacked)
        local = spec.shard(full).contiguous().view(-1)
        for lo, hi in _dp_cuts(local.numel(), dp, gen):
            if lo < hi:
                out.append((placement_from_spec(spec, (lo, hi)), local[lo:hi].clone()))
    return out


CASES = [
    ((12, 6), 0, 1),  # column-parallel
    ((6, 12), 1, 1),  # row-parallel
    ((24, 4), 0, 2),  # SwiGLU fc1 [gate; up]
    ((12,), 0, 1),  # column-parallel bias
    ((12,), None, 1),  # replicated
    ((4, 6, 12), 2, 1),  # a 3-D tensor split along its last dim
]


@pytest.mark.parametrize("shape,pdim,stacked", CASES)
def test_any_tp_dp_cut_reassembles_into_any_other(shape, pdim, stacked):
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(shape, generator=gen)
    sizes = [1, 2, 6] if pdim is not None else [1, 2]
    for (tp_a, dp_a), (tp_b, dp_b) in itertools.product(itertools.product(sizes, (1, 3)), repeat=2):
        if pdim is not None and (shape[pdim] % (tp_a * stacked) or shape[pdim] % (tp_b * stacked)):
            continue
        saved = _saved_pieces(full, pdim, tp_a, stacked, dp_a, gen)
        assert sum(p.numel for p, _ in saved) == full.numel()
        for rank in range(tp_b):
            spec = _spec(shape, pdim, tp_b, rank, stacked)
            expected = spec.shard(full).contiguous().view(-1)
            for lo, hi in _dp_cuts(expected.numel(), dp_b, gen):
                wanted = placement_from_spec(spec, (lo, hi))
                dest = torch.full((hi - lo,), float("nan"))
                sources = [(p, t) for p, t in saved if overlaps(p, wanted)]
                written = copy_into(dest, wanted, sources)
                assert written == required_elements(wanted, shape) == hi - lo
                torch.testing.assert_close(dest, expected[lo:hi], rtol=0, atol=0)


def test_pieces_are_few_and_contiguous():
    spec = _spec((8, 10), 0, 2, 1, stacked=2)
    placement = placement_from_spec(spec, (7, 33))
    ps = pieces(placement)
    assert sum(math.prod(p.lengths) for p in ps) == 26
    assert len(ps) <= 6
    # the stacked halves land in the two logical row blocks of rank 1: rows 2-3 and 6-7
    rows = sorted({p.offsets[0] + i for p in ps for i in range(p.lengths[0])})
    assert rows == [2, 3, 6, 7]


def test_vocab_padding_rows_outside_the_saved_tensor_are_not_required():
    saved_full = torch.arange(8 * 3, dtype=torch.float32).view(8, 3)
    wanted = full_placement((12, 3))  # the new layout pads the vocabulary to 12 rows
    dest = torch.zeros(36)
    written = copy_into(dest, wanted, [(full_placement((8, 3)), saved_full.view(-1))])
    assert written == required_elements(wanted, (8, 3)) == 24
    assert torch.equal(dest.view(12, 3)[:8], saved_full) and not dest.view(12, 3)[8:].any()


def test_placement_json_round_trip():
    p = placement_from_spec(_spec((24, 4), 0, 2, 1, stacked=2), (3, 40))
    assert Placement.from_json(p.to_json()) == p
