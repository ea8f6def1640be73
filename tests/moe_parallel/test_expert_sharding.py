"""Expert layouts: shapes, per-expert seeded init independent of ep/etp, shard/merge (no processes)."""

import pytest
import torch

from mcore.distributed.param_attrs import counts_in_grad_norm, is_expert_parallel
from mcore.tensor_parallel.sharding import (
    ParamLayout,
    ShardSpec,
    build_shard_specs,
    draw_local_shard,
    init_method_normal,
    make_parameter,
)

E, F, H = 8, 6, 4
FC1 = ParamLayout((E, 2 * F, H), partition_dim=1, num_stacked=2, init=init_method_normal(0.02), expert_dim=0)
FC2 = ParamLayout((E, H, F), partition_dim=2, init=init_method_normal(0.02), expert_dim=0)


def _spec(layout, ep_rank, ep, etp_rank, etp):
    return ShardSpec.from_layout(layout, "w", "decoder.layers.0.mlp.experts.w", etp_rank, etp, ep_rank, ep)


@pytest.mark.parametrize("layout", [FC1, FC2], ids=["fc1", "fc2"])
def test_expert_init_is_independent_of_ep_and_etp(layout):
    device = torch.device("cpu")
    full = draw_local_shard(_spec(layout, 0, 1, 0, 1), layout.init, 5, device)
    assert tuple(full.shape) == layout.global_shape
    for ep in (1, 2, 4):
        for etp in (1, 2):
            blocks = []
            for ep_rank in range(ep):
                specs = [_spec(layout, ep_rank, ep, t, etp) for t in range(etp)]
                shards = [draw_local_shard(s, layout.init, 5, device) for s in specs]
                for s, shard in zip(specs, shards):
                    assert tuple(shard.shape) == layout.local_shape(etp, ep) == s.local_shape
                    assert torch.equal(shard, s.shard(full))
                blocks.append(specs[0].merge(shards))
            assert torch.equal(torch.cat(blocks, dim=0), full), (ep, etp)
    # experts differ from each other, and another seed changes them
    assert not torch.equal(full[0], full[1])
    assert not torch.equal(full, draw_local_shard(_spec(layout, 0, 1, 0, 1), layout.init, 6, device))


def test_expert_parameters_are_marked_and_sized():
    p = make_parameter(FC1, 2, dtype=torch.float32, device=None, ep_size=4)
    assert tuple(p.shape) == (2, F, H) and p.expert_parallel and is_expert_parallel(p)
    dense = make_parameter(ParamLayout((H,)), 2, dtype=torch.float32, device=None)
    assert not is_expert_parallel(dense)
    plain = torch.nn.Parameter(torch.zeros(1))
    plain.expert_parallel = True
    assert is_expert_parallel(plain)
    assert counts_in_grad_norm(p, tp_rank=1)  # split over etp: every etp rank counts its slice
    with pytest.raises(ValueError, match="expert_model_parallel_size=3"):
        FC1.local_shape(1, 3)


def test_build_shard_specs_uses_ep_and_etp_coordinates():
    m = torch.nn.Module()
    m.fc1 = make_parameter(FC1, 1, dtype=torch.float32, device=None, ep_size=2)
    m.norm = make_parameter(ParamLayout((H,), partition_dim=0), 2, dtype=torch.float32, device=None)
    specs = build_shard_specs(m, 1, 2, ep_rank=1, ep_size=2, etp_rank=0, etp_size=1)
    fc1, norm = specs["fc1"], specs["norm"]
    assert (fc1.tp_rank, fc1.tp_size, fc1.ep_rank, fc1.ep_size, fc1.expert_dim) == (0, 1, 1, 2, 0)
    assert fc1.expert_range() == (4, 4) and fc1.num_experts == E and fc1.is_expert
    assert (norm.tp_rank, norm.tp_size, norm.ep_rank, norm.ep_size, norm.expert_dim) == (1, 2, 0, 1, None)
    assert fc1.for_rank(0, ep_rank=0).expert_range() == (0, 4)
