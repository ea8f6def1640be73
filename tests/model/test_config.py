"""ModelConfig defaults, flags and validation; construction-time refusals with the values named."""

from dataclasses import replace

import pytest

from mcore.config.cli import parse_config
from mcore.config.fields import ConfigError
from mcore.config.parallel import ParallelConfig
from mcore.distributed.groups import ProcessGroups
from mcore.distributed.topology import Topology
from mcore.models.gpt.gpt_model import GPTModel
from mcore.models.transformer.model_config import ModelConfig, padded_vocab_size, validate_model_parallel
from mcore.models.transformer.positions import alibi_slopes

BASE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16)


def test_padded_vocab_size_matches_megatron():
    assert [padded_vocab_size(50257, 128, tp) for tp in (1, 2, 4, 8)] == [50304, 50432, 50688, 51200]
    assert padded_vocab_size(100, 32, 4) == 128


def test_megatron_derived_defaults():
    cfg = ModelConfig(**BASE)
    assert (cfg.ffn_hidden_size, cfg.kv_channels, cfg.num_query_groups, cfg.max_position_embeddings) == (
        256,
        16,
        4,
        16,
    )
    assert cfg.add_bias_linear and cfg.share_embeddings_and_output_weights
    assert (
        ModelConfig(**{**BASE, "hidden_size": 4096, "num_attention_heads": 32}, swiglu=True).ffn_hidden_size
        == 10880
    )
    assert ModelConfig(**BASE, group_query_attention=True).num_query_groups == 1  # Megatron's default: MQA


def test_megatron_flags_parse():
    argv = (
        "--num-layers 2 --hidden-size 64 --num-attention-heads 8 --group-query-attention --num-query-groups 2 "
        "--position-embedding-type rope --normalization RMSNorm --layernorm-epsilon 1e-6 --swiglu "
        "--disable-bias-linear --untie-embeddings-and-output-weights --recompute-granularity full "
        "--recompute-method uniform --recompute-num-layers 1 --use-cpu-initialization --seq-length 32"
    )
    cfg = parse_config({"model": ModelConfig}, argv.split())["model"]
    assert cfg.num_query_groups == 2 and cfg.norm_epsilon == 1e-6 and not cfg.add_bias_linear
    assert not cfg.share_embeddings_and_output_weights and cfg.recompute_method == "uniform"


def test_unknown_position_embedding_on_the_command_line(capsys):
    with pytest.raises(SystemExit):
        parse_config(
            {"model": ModelConfig},
            [
                "--num-layers",
                "1",
                "--hidden-size",
                "8",
                "--num-attention-heads",
                "2",
                "--position-embedding-type",
                "xpos",
            ],
        )
    assert "invalid choice: 'xpos'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "changes,message",
    [
        (dict(position_embedding_type="xpos"), "position_embedding_type='xpos' is unknown"),
        (dict(normalization="BatchNorm"), "normalization='BatchNorm' is unknown"),
        (dict(num_attention_heads=6), "hidden_size=64 is not divisible by num_attention_heads=6"),
        (
            dict(group_query_attention=True, num_query_groups=3),
            "num_attention_heads=4 is not divisible by num_query_groups=3",
        ),
        (dict(num_query_groups=2), "num_query_groups=2 needs --group-query-attention"),
        (dict(seq_length=64, max_position_embeddings=32), "seq_length=64 exceeds max_position_embeddings=32"),
        (dict(position_embedding_type="rope", rotary_percent=0.3), "kv_channels=16 x rotary_percent=0.3"),
        (dict(recompute_granularity="full"), "needs --recompute-method"),
        (
            dict(recompute_method="block"),
            "recompute_method='block' applies only to recompute_granularity='full'",
        ),
        (dict(hidden_dropout=1.0), "hidden_dropout=1.0 must be in [0, 1)"),
        (dict(num_layers=None), "num_layers must be given (--num-layers)"),
    ],
)
def test_bad_model_configs_name_the_values(changes, message):
    with pytest.raises(ConfigError) as err:
        ModelConfig(**{**BASE, **changes})
    assert message in str(err.value)


@pytest.mark.parametrize(
    "changes,tp,message",
    [
        (
            dict(num_attention_heads=12, hidden_size=96),
            8,
            "num_attention_heads=12 is not divisible by tensor_model_parallel_size=8",
        ),
        (
            dict(num_attention_heads=8, group_query_attention=True, num_query_groups=2),
            4,
            "num_query_groups=2 is not divisible by tensor_model_parallel_size=4",
        ),
    ],
)
def test_model_does_not_split_over_tp(changes, tp, message):
    cfg = ModelConfig(**{**BASE, **changes})
    with pytest.raises(ConfigError, match=message):
        validate_model_parallel(cfg, ParallelConfig(tensor_model_parallel_size=tp))
    # The model refuses at construction, before building anything (a tp-sized topology, no processes).
    groups = ProcessGroups(topology=Topology.create(tp, 0, tp=tp))
    with pytest.raises(ConfigError, match=message):
        GPTModel(cfg, groups, padded_vocab_size(100, 128, tp))


def test_sequence_parallel_without_tp_is_refused():
    with pytest.raises(ConfigError, match="needs tensor_model_parallel_size > 1"):
        ParallelConfig(sequence_parallel=True)
    with pytest.raises(ConfigError, match=r"needs tensor_model_parallel_size > 1 \(got 1\)"):
        GPTModel(ModelConfig(**BASE), ProcessGroups.single(), 128, sequence_parallel=True)


def test_unpadded_vocab_and_layer_range_are_refused():
    groups = ProcessGroups(topology=Topology.create(2, 0, tp=2))
    with pytest.raises(
        ConfigError, match="padded vocab_size=101 is not divisible by tensor_model_parallel_size=2"
    ):
        GPTModel(ModelConfig(**BASE), groups, 101)
    with pytest.raises(ConfigError, match=r"layers \[1, 3\) of this chunk are outside num_layers=2"):
        GPTModel(ModelConfig(**BASE), ProcessGroups.single(), 128, layer_offset=1, num_layers=2)


def test_replace_keeps_resolved_values():
    cfg = replace(ModelConfig(**BASE), hidden_dropout=0.0)
    assert cfg.ffn_hidden_size == 256 and cfg.hidden_dropout == 0.0


def test_alibi_slopes():
    assert alibi_slopes(8) == [2.0 ** -(i + 1) for i in range(8)]
    # not a power of two: the 4-head slopes, then every other slope of 8 heads
    assert alibi_slopes(6) == [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8, 2.0**-1, 2.0**-3]
