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
