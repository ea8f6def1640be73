"""The input embedding: vocab-parallel word embeddings, optional learned positions, dropout.

Output is ``[s, b, h]`` (Megatron's layout inside the transformer), or ``[s/p, b, h]`` with sequence
parallelism. Parameter names: ``word_embeddings.weight`` (``[Vp/p, h]``, split by vocabulary rows),
``position_embeddings.weight`` (``[max_position_embeddings, h]``, replicated; learned_absolute
only) and ``tokentype_embeddings.weight`` (``[num_tokentypes, h]``, replicated; BERT's segment A/B).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from mcore.models.transformer.build_context import BuildContext
from mcore.models.transformer.model_config import ModelConfig
from mcore.tensor_parallel.layers import VocabParallelEmbedding
from mcore.tensor_parallel.mappings import scatter_to_sequence_parallel_region
from mcore.tensor_parallel.random import get_rng_tracker
from mcore.tensor_parallel.sharding import NormalInit, ParamLayout, make_parameter


class PositionEmbedding(torch.nn.Module):
    """Learned absolute positions: a replicated ``[max_position_embeddings, h]`` table."""

    def __init__(self, config: ModelConfig, ctx: BuildContext):
        super().__init__()
        layout = ParamLayout(
            (config.max_position_embeddings, config.hidden_size), init=NormalInit(config.init_method_std)
        )
        self.weight = make_parameter(layout, ctx.tp_size, dtype=ctx.params_dtype, device=ctx.device)

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(position_ids, self.weight)


class TokentypeEmbedding(torch.nn.Module):
    """BERT's token types (segment A/B): a replicated ``[num_tokentypes, h]`` table."""

    def __init__(self, config: ModelConfig, ctx: BuildContext, num_tokentypes: int):
        super().__init__()
        layout = ParamLayout((num_tokentypes, config.hidden_size), init=NormalInit(config.init_method_std))
        self.weight = make_parameter(layout, ctx.tp_size, dtype=ctx.params_dtype, device=ctx.device)

    def forward(self, tokentype_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokentype_ids, self.weight)


class LanguageModelEmbedding(torch.nn.Module):
    """``dropout(word_embeddings[ids] + position_embeddings[positions])`` -> ``[s, b, h]``.

    With sequence parallelism and no learned positions the word-embedding partial sums are
    reduce-scattered straight to ``[s/p, b, h]`` (one collective instead of an all-reduce and a
    split); with learned positions the sum is all-reduced, the positions added, then scattered.
    Dropout on sequence shards draws from the TP RNG stream (each rank a different part).
    """

    def __init__(self, config: ModelConfig, ctx: BuildContext, vocab_size: int, num_tokentypes: int = 0):
        super().__init__()
        self.ctx = ctx
        self.hidden_dropout = config.hidden_dropout
        self.fp32_residual_connection = config.fp32_residual_connection
        self.learned_positions = config.position_embedding_type == "learned_absolute"
        # Token types, like learned positions, are added to the whole [b, s, h] sum before the scatter.
        self.reduce_scatter_embeddings = (
            ctx.sequence_parallel and not self.learned_positions and num_tokentypes == 0
        )
        self.word_embeddings = VocabParallelEmbedding(
            vocab_size,
            config.hidden_size,
            tp_group=ctx.tp_group,
            init_method=NormalInit(config.init_method_std),
            reduce_scatter_embeddings=self.reduce_scatter_embeddings,
            params_dtype=ctx.params_dtype,
            device=ctx.device,
        )
        self.position_embeddings = PositionEmbedding(config, ctx) if self.learned_positions else None
        self.tokentype_embeddings = None
        if num_tokentypes > 0:
            self.tokentype_embeddings = TokentypeEmbedding(config, ctx, num_tokentypes)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        tokentype_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``input_ids [b, s]``, ``position_ids [b, s]`` (default ``0..s-1``), ``tokentype_ids [b, s]``
        (with a token-type table; default all 0) -> ``[s, b, h]``."""
        embeddings = self.word_embeddings(input_ids)
        if not self.reduce_scatter_embeddings:
            if self.position_embeddings is not None:
                if position_ids is None:
                    position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None, :]
                embeddings = embeddings + self.position_embeddings(position_ids)
            if self.tokentype_embeddings is not None:
                if tokentype_ids is None:
                    tokentype_ids = torch.zeros_like(input_ids)
                embeddings = embeddings + self.tokentype_embeddings(tokentype_ids)
            embeddings = embeddings.transpose(0, 1).contiguous()  # [b, s, h] -> [s, b, h]
            if self.ctx.sequence_parallel:
                embeddings = scatter_to_sequence_parallel_region(embeddings, self.ctx.tp_group)
        if self.fp32_residual_connection:
            embeddings = embeddings.float()
        p = self.hidden_dropout if self.training else 0.0
        if p == 0.0:
            return embeddings
        rng = get_rng_tracker().fork() if self.ctx.sequence_parallel else contextlib.nullcontext()
        with rng:
            return F.dropout(embeddings, p=p, training=True)
