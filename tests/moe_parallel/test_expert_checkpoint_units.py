"""Checkpoint pieces of expert parallelism without processes: expert placements reshard between EP
sizes, and checkpoints written before expert parallelism read as ep=1, etp=tp."""

import torch

from mcore.checkpoint.geometry import copy_into, placement_from_spec
from mcore.checkpoint.load import saved_layout_value
from mcore.tensor_parallel.sharding import ShardSpec

E, F2, H = 4, 6, 2


def _spec(ep_rank, ep, tp_rank=0, tp=1):
    return ShardSpec(
        "x", "x", (E, F2, H), 1, tp_rank, tp, num_stacked=2, expert_dim=0, ep_rank=ep_rank, ep_size=ep
    )


def test_expert_placements_reshard_between_ep_and_etp_sizes():
    full = torch.arange(E * F2 * H, dtype=torch.float32).reshape(E, F2, H)
    saved = [(placement_from_spec(s), s.shard(full).reshape(-1)) for s in (_spec(r, 2) for r in range(2))]
    for ep in (1, 2, 4):
        for tp in (1, 3):
            for r in range(ep):
                for t in range(tp):
                    spec = _spec(r, ep, t, tp)
                    dest = torch.empty(spec.local_shape).reshape(-1)
                    assert copy_into(dest, placement_from_spec(spec), saved) == dest.numel()
                    assert torch.equal(dest.view(spec.local_shape), spec.shard(full)), (ep, tp, r, t)


def test_old_layouts_read_as_no_expert_parallelism():
    old = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1}
    assert saved_layout_value(old, "expert_model_parallel_size") == 1
    assert saved_layout_value(old, "expert_tensor_parallel_size") == 2
    assert saved_layout_value({**old, "expert_model_parallel_size": 4}, "expert_model_parallel_size") == 4
