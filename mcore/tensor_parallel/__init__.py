"""Tensor and sequence parallelism: collectives, parallel layers, cross-entropy, sharding, RNG, recompute."""

# cross_entropy: loss over vocab-parallel logits
from mcore.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

# layers: column/row-parallel linear and vocab-parallel embedding
from mcore.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

# mappings: autograd-aware TP/SP collectives (the only module that calls them)
from mcore.tensor_parallel.mappings import (
    all_reduce_sequence_parallel_grads,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)

# random: the TP-aware RNG tracker
from mcore.tensor_parallel.random import get_rng_tracker, model_parallel_seed

# recompute: activation checkpointing that replays the RNG streams
from mcore.tensor_parallel.recompute import checkpoint

# sharding: logical tensors, shard specs, layout-independent init
from mcore.tensor_parallel.sharding import (
    ParamLayout,
    ShardSpec,
    build_shard_specs,
    init_method_normal,
    initialize_parameters,
    scaled_init_method_normal,
)

__all__ = [
    "ColumnParallelLinear",
    "ParamLayout",
    "RowParallelLinear",
    "ShardSpec",
    "VocabParallelEmbedding",
    "all_reduce_sequence_parallel_grads",
    "build_shard_specs",
    "checkpoint",
    "copy_to_tensor_model_parallel_region",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "get_rng_tracker",
    "init_method_normal",
    "initialize_parameters",
    "model_parallel_seed",
    "reduce_from_tensor_model_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scaled_init_method_normal",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "vocab_parallel_cross_entropy",
]
