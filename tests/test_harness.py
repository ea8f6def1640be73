"""The multi-process harness itself: results, per-rank errors, groups built on real processes."""

import pytest
import torch
import torch.distributed as dist

from mcore.config.parallel import ParallelConfig
from mcore.distributed.groups import initialize_parallel
from mcore.testing.distributed import DistributedTestError, run_distributed


def _allreduce_rank():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return dist.get_rank(), t.item()


def _fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("boom on purpose")
    return dist.get_rank()


def _groups_tp2_pp2():
    groups = initialize_parallel(ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2))
    t = torch.tensor([float(groups.rank)])
    dist.all_reduce(t, group=groups.tp)
    s = torch.tensor([float(groups.rank)])
    dist.all_reduce(s, group=groups.pp)
    return (
        groups.tp_rank,
        groups.pp_rank,
        groups.dp_rank,
        t.item(),
        s.item(),
        groups.is_first_stage,
        groups.is_last_stage,
        groups.next_stage_rank,
        groups.embedding_ranks,
    )


def test_results_come_back_in_rank_order():
    assert run_distributed(_allreduce_rank, 2) == [(0, 1.0), (1, 1.0)]


def test_rank_exception_is_reraised_with_rank():
    with pytest.raises(DistributedTestError, match=r"rank 1 of 2 failed:[\s\S]*boom on purpose"):
        run_distributed(_fail_on_rank_one, 2)


def test_process_groups_on_four_ranks():
    out = run_distributed(_groups_tp2_pp2, 4)
    # order tp-cp-dp-pp with tp=2, pp=2, dp=1: ranks 0,1 are stage 0; 2,3 stage 1.
    assert [o[:3] for o in out] == [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0)]
    assert [o[3] for o in out] == [1.0, 1.0, 5.0, 5.0]
    assert [o[4] for o in out] == [2.0, 4.0, 2.0, 4.0]
    assert [o[5] for o in out] == [True, True, False, False]
    assert [o[6] for o in out] == [False, False, True, True]
    assert [o[7] for o in out] == [2, 3, 0, 1]
    assert out[0][8] == (0, 2)


def test_launch_environment_from_torchrun_and_slurm():
    from mcore.distributed.groups import LaunchEnv

    assert LaunchEnv.from_environ({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1"}) == LaunchEnv(
        3, 8, 1, "torchrun"
    )
    slurm = {"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "5"}
    assert LaunchEnv.from_environ(slurm) == LaunchEnv(5, 16, 5, "slurm")
    assert LaunchEnv.from_environ({}) == LaunchEnv(0, 1, 0, "none")
