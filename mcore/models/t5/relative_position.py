"""T5's relative position bias (Raffel et al., 2020), as Hugging Face's and megatron-core's T5 compute it.

The score of query ``i`` and key ``j`` in head ``h`` gets ``table[bucket(j - i), h]`` added; the table
``relative_attention_bias.weight`` is ``[num_buckets, n]``, one per stack (the encoder's buckets are
bidirectional, the decoder's causal). :func:`relative_position_bucket` maps distances to buckets.
"""

from __future__ import annotations

import math

import torch

from mcore.models.transformer.build_context import BuildContext
from mcore.models.transformer.model_config import ModelConfig
from mcore.tensor_parallel.mappings import scatter_to_tensor_model_parallel_region
from mcore.tensor_parallel.sharding import NormalInit, ParamLayout, make_parameter


def relative_position_bucket(
    relative_position: torch.Tensor, bidirectional: bool, num_buckets: int, max_distance: int
) -> torch.Tensor:
    """T5's bucket of ``relative_position = key_position - query_position`` (int64, same shape).

    Bidirectional: half the buckets for keys after the query, half before. In each half (``B``
    buckets), distances ``< B/2`` get a bucket each; larger ones share ``B/2`` logarithmically sized
    buckets up to ``max_distance``, beyond which all share the last. Causal: only keys at or before
    the query count (later ones fall in bucket 0, and the causal mask hides them).
    """
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0).long() * num_buckets
        distance = relative_position.abs()
    else:
        distance = -torch.clamp(relative_position, max=0)
    max_exact = num_buckets // 2
    is_small = distance < max_exact
    # distance 0 would give log(0) here; torch.where picks the exact bucket for it anyway
    large = (
        max_exact
        + (
            torch.log(distance.float().clamp(min=1) / max_exact)
            / math.log(max_distance / max_exact)
            * (num_buckets - max_exact)
        ).long()
    )
    large = torch.clamp(large, max=num_buckets - 1)
    return buckets + torch.where(is_small, distance, large)


class _BiasTable(torch.nn.Module):
    """The ``[num_buckets, n]`` table (a module so that its name is ``relative_attention_bias.weight``)."""

    def __init__(self, num_buckets: int, num_heads: int, config: ModelConfig, ctx: BuildContext):
        super().__init__()
        layout = ParamLayout((num_buckets, num_heads), init=NormalInit(config.init_method_std))
        self.weight = make_parameter(layout, ctx.tp_size, dtype=ctx.params_dtype, device=ctx.device)


class RelativePositionEmbedding(torch.nn.Module):
    """T5's relative position bias: ``bias[h, i, j] = table[bucket(j - i), h]`` for query ``i``, key ``j``.

    The table is replicated over TP; each rank adds the bias of its own heads (the scatter's backward
    all-gathers the heads' gradients, so every rank's table gradient is complete).
    """

    def __init__(self, config: ModelConfig, ctx: BuildContext, bidirectional: bool):
        super().__init__()
        self.bidirectional = bidirectional
        self.num_buckets = config.relative_attention_num_buckets
        self.max_distance = config.relative_attention_max_distance
        self.tp_group = ctx.tp_group
        self.relative_attention_bias = _BiasTable(self.num_buckets, config.num_attention_heads, config, ctx)

    def forward(self, query_length: int, key_length: int, query_offset: int = 0) -> torch.Tensor:
        """The bias of this rank's heads ``[1, n_p, s_q, s_k]``; queries sit at ``query_offset + i``."""
        weight = self.relative_attention_bias.weight
        query = torch.arange(query_offset, query_offset + query_length, device=weight.device)
        key = torch.arange(key_length, device=weight.device)
        buckets = relative_position_bucket(
            key[None, :] - query[:, None], self.bidirectional, self.num_buckets, self.max_distance
        )
        bias = torch.nn.functional.embedding(buckets, weight)  # [s_q, s_k, n]
        bias = scatter_to_tensor_model_parallel_region(bias, self.tp_group)  # [s_q, s_k, n_p]
        return bias.permute(2, 0, 1)[None]


__all__ = ["RelativePositionEmbedding", "relative_position_bucket"]
