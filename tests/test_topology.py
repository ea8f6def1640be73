"""Rank arithmetic without processes."""

import pytest

from mcore.config.fields import ConfigError
from mcore.config.parallel import ParallelConfig
from mcore.distributed.topology import Topology, rank_groups


def test_megatron_example_8_ranks():
    t = Topology.create(8, 0, tp=2, pp=2)
    assert t.dp == 2
    assert t.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert t.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert t.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert t.groups("tp-pp") == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert t.embedding_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_megatron_16_ranks_tp2_pp4():
    # Megatron's initialize_model_parallel docstring: 16 GPUs, tp=2, pp=4 -> dp=2.
    t = Topology.create(16, 0, tp=2, pp=4)
    assert t.dp == 2
    assert t.groups("tp")[:2] == [[0, 1], [2, 3]]
    assert t.groups("dp")[:2] == [[0, 2], [1, 3]]
    assert t.groups("pp") == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert t.embedding_groups()[0] == [0, 12]


def test_groups_partition_the_world():
    sizes = {"tp": 2, "cp": 2, "dp": 3, "pp": 2}
    for axes in ("tp", "cp", "dp", "pp", "tp-pp", "cp-dp", "tp-cp-dp-pp"):
        groups = rank_groups(sizes, "tp-cp-dp-pp", axes)
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(24)), axes


def test_coordinates_and_alternative_order():
    t = Topology.create(8, 5, tp=2, pp=2, order="tp-pp-dp-cp")
    assert t.groups("pp")[0] == [0, 2]
    assert t.coordinate("tp") == 1 and t.coordinate("pp") == 0 and t.coordinate("dp") == 1


def test_invalid_layout_names_every_factor():
    with pytest.raises(ConfigError) as err:
        Topology.create(6, 0, tp=4, pp=1)
    msg = str(err.value)
    assert (
        "world_size=6" in msg
        and "tensor_model_parallel_size=4" in msg
        and "pipeline_model_parallel_size=1" in msg
    )


def test_parallel_config_validation():
    with pytest.raises(ConfigError, match="sequence-parallel needs tensor_model_parallel_size > 1"):
        ParallelConfig(sequence_parallel=True)
    with pytest.raises(ConfigError, match="tensor_model_parallel_size=0"):
        ParallelConfig(tensor_model_parallel_size=0)
    with pytest.raises(ConfigError, match="virtual_pipeline_model_parallel_size=2 needs"):
        ParallelConfig(virtual_pipeline_model_parallel_size=2)
    with pytest.raises(ConfigError, match="parallel_order"):
        ParallelConfig(parallel_order="tp-dp-pp")
    cfg = ParallelConfig(pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=2)
    assert cfg.virtual_stages(8) == 2
    with pytest.raises(ConfigError, match="num_layers=6"):
        cfg.virtual_stages(6)


def test_layers_per_virtual_stage_with_uneven_stages_is_refused():
    cfg = ParallelConfig(
        pipeline_model_parallel_size=2,
        num_layers_per_virtual_pipeline_stage=1,
        decoder_first_pipeline_num_layers=3,
    )
    with pytest.raises(ConfigError, match="give --virtual-pipeline-model-parallel-size"):
        cfg.virtual_stages(8)


# -- the expert grid (MoE parallel folding) ---------------------------------------------------------


def _expert_coords(rank, etp, ep, edp):
    """Brute force for the default order: etp fastest, then ep, edp, pp."""
    return rank % etp, (rank // etp) % ep, (rank // (etp * ep)) % edp, rank // (etp * ep * edp)


EXPERT_LAYOUTS = [
    # (world, tp, cp, pp, ep, etp)
    (1, 1, 1, 1, 1, None),
    (2, 1, 1, 1, 2, None),
    (4, 1, 1, 1, 4, None),
    (4, 2, 1, 1, 2, 1),
    (4, 2, 1, 1, 2, None),
    (4, 1, 1, 2, 2, None),
    (8, 2, 1, 2, 2, 1),
    (8, 2, 2, 1, 4, 1),
    (8, 1, 2, 1, 2, 2),
    (16, 2, 2, 2, 4, 1),
    (16, 4, 1, 2, 2, 2),
    (24, 2, 1, 2, 3, 2),
    (32, 2, 2, 2, 8, 1),
]


@pytest.mark.parametrize("world,tp,cp,pp,ep,etp", EXPERT_LAYOUTS)
def test_expert_grid_matches_megatron_rank_generator(world, tp, cp, pp, ep, etp):
    t = Topology.create(world, 0, tp=tp, cp=cp, pp=pp, ep=ep, etp=etp)
    etp_size = tp if etp is None else etp
    assert (t.ep, t.etp) == (ep, etp_size)
    assert t.etp * t.ep * t.edp * t.pp == world
    # every expert axis partitions the world, groups are sorted by the in-group coordinate
    for axes in ("etp", "ep", "edp", "pp", "etp-ep", "etp-ep-pp"):
        groups = t.expert_groups(axes)
        assert sorted(r for g in groups for r in g) == list(range(world)), axes
    # pipeline stages are the dense ones (Megatron asserts this)
    assert t.expert_groups("pp") == t.groups("pp")
    for rank in range(world):
        c_etp, c_ep, c_edp, c_pp = _expert_coords(rank, t.etp, t.ep, t.edp)
        assert t.expert_coordinate("etp", rank) == c_etp
        assert t.expert_coordinate("ep", rank) == c_ep
        assert t.expert_coordinate("edp", rank) == c_edp
        assert t.expert_coordinate("pp", rank) == c_pp == t.coordinate("pp", rank)
        # groups hold exactly the ranks that agree on every other coordinate
        mine = (c_etp, c_ep, c_edp, c_pp)
        for axes, varying in (("ep", {1}), ("edp", {2}), ("etp", {0}), ("etp-ep-pp", {0, 1, 3})):
            expected = [
                r
                for r in range(world)
                if all(
                    a == b
                    for k, (a, b) in enumerate(zip(_expert_coords(r, t.etp, t.ep, t.edp), mine))
                    if k not in varying
                )
            ]
            assert t.expert_group_of(axes, rank) == expected, (axes, rank)
        # tp-ep (the all-gather dispatcher) holds the etp and ep peers: etp*ep ranks of one stage
        tp_ep = t.expert_group_of("etp-ep", rank)
        assert len(tp_ep) == t.etp * t.ep and {t.coordinate("pp", r) for r in tp_ep} == {c_pp}


def test_expert_grid_worked_examples():
    # docstring example: 8 ranks, tp=2, dp=4 dense; etp=1, ep=4 -> edp=2
    t = Topology.create(8, 0, tp=2, ep=4, etp=1)
    assert t.edp == 2
    assert t.expert_groups("ep") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert t.expert_groups("edp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # etp = tp = 2, ep = 2: etp fastest, then ep
    t = Topology.create(8, 0, tp=2, ep=2)
    assert t.expert_groups("etp") == t.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert t.expert_groups("ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert t.expert_groups("edp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert t.expert_groups("etp-ep") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # ep=1, etp=tp: the expert grid is the dense one (edp spans dp x cp)
    t = Topology.create(8, 0, tp=2, cp=2)
    assert t.expert_groups("edp") == t.groups("cp-dp")
    assert t.expert_groups("etp-ep-pp") == t.groups("tp-pp")


def test_expert_grid_refusals_name_every_factor():
    with pytest.raises(ConfigError) as err:
        Topology.create(4, 0, tp=2, ep=4)
    msg = str(err.value)
    for part in (
        "expert_tensor_parallel_size=2",
        "expert_model_parallel_size=4",
        "world_size=4",
        "pipeline_model_parallel_size=1",
        "tensor_model_parallel_size=2",
        "context_parallel_size=1",
    ):
        assert part in msg, part
    with pytest.raises(ConfigError, match="expert_model_parallel_size=0"):
        Topology.create(4, 0, ep=0)
    with pytest.raises(ConfigError, match="expert_tensor_parallel_size=3 x expert_model_parallel_size=1"):
        Topology.create(4, 0, etp=3)
    # pp not last: the two grids would disagree on pipeline stages
    with pytest.raises(ConfigError, match="parallel_order='tp-cp-pp-dp'"):
        Topology.create(8, 0, tp=1, pp=2, cp=2, ep=4, order="tp-cp-pp-dp")
    assert Topology.create(8, 0, pp=2, cp=2, ep=2, order="tp-cp-pp-dp").edp == 2  # same stages: fine
    with pytest.raises(ValueError, match="not an expert axis"):
        Topology.create(2, 0).expert_groups("cp")


def test_parallel_config_expert_flags():
    from mcore.config.cli import parse_config

    cfg = parse_config(
        {"parallel": ParallelConfig},
        ["--expert-model-parallel-size", "4", "--expert-tensor-parallel-size", "1"],
    )["parallel"]
    assert (cfg.expert_model_parallel_size, cfg.expert_tensor_parallel_size) == (4, 1)
    assert ParallelConfig(tensor_model_parallel_size=2).expert_tensor_parallel == 2
    with pytest.raises(ConfigError, match="expert_model_parallel_size=0"):
        ParallelConfig(expert_model_parallel_size=0)
    with pytest.raises(ConfigError, match="expert_tensor_parallel_size=0"):
        ParallelConfig(expert_tensor_parallel_size=0)


def test_single_process_groups_have_expert_defaults():
    from mcore.distributed.groups import ProcessGroups

    g = ProcessGroups.single()
    assert (g.ep_size, g.ep_rank, g.etp_size, g.etp_rank, g.edp_size, g.edp_rank) == (1, 0, 1, 0, 1, 0)
    assert g.ep is None and g.edp is None and g.expert_mp is None and g.tp_dp_cp is None
