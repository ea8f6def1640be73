"""pretrain's layout checks for expert parallelism, before any communication (no processes)."""

import pytest

from mcore.config.fields import ConfigError
from mcore.training.pretrain import check_expert_layout
from mcore.training.run_config import parse_run_config

BASE = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
        "--max-position-embeddings", "8", "--micro-batch-size", "1", "--lr", "1e-3", "--train-iters", "1"]  # fmt: skip
MOE = ["--num-experts", "4"]


def test_expert_parallelism_needs_experts_and_a_tiling_layout():
    with pytest.raises(
        ConfigError, match="expert_model_parallel_size=2, expert_tensor_parallel_size=None need --num-experts"
    ):
        check_expert_layout(parse_run_config([*BASE, "--expert-model-parallel-size", "2"]), 2)
    with pytest.raises(
        ConfigError, match="expert_tensor_parallel_size=1 x expert_model_parallel_size=4 = 4 does not divide"
    ):
        check_expert_layout(parse_run_config([*BASE, *MOE, "--expert-model-parallel-size", "4"]), 2)
    check_expert_layout(parse_run_config([*BASE, *MOE, "--expert-model-parallel-size", "4"]), 8)
    check_expert_layout(parse_run_config(BASE), 3)  # a dense model without expert flags: nothing to check
