"""Cross-attention: queries from the decoder stream, keys and values from the encoder output.

Shapes (``p`` TP ranks): ``n`` heads, ``d = kv_channels``, locally ``n_p = n/p``. As megatron-core's
``CrossAttention`` (which requires ``num_query_groups == num_attention_heads``):

* ``linear_q`` (column-parallel) ``[n d, h]``: rank ``t`` holds the rows of heads ``t n_p .. (t+1) n_p - 1``;
* ``linear_kv`` (column-parallel) ``[2 n d, h]`` in the per-head packed layout: ``n`` blocks of
  ``2 d`` rows, block ``j`` = key head ``j`` then value head ``j``; rank ``t`` holds whole blocks,
  so its output ``[s_k, b, 2 n_p d]`` views as ``[s_k, b, n_p, 2 d]`` and splits into K and V;
* ``linear_proj`` (row-parallel) ``[h, n d]``.

The keys and values depend only on the encoder output, so generation computes them once per layer
and caches them: an ``inference_context`` with ``cross_kv(layer_number, compute) -> (key, value)``
(:class:`mcore.inference.kv_cache.EncoderDecoderCache`) returns the cached pair, calling
``compute()`` on the first step only.

With sequence parallelism both inputs arrive as ``[s/p, b, h]``; the column-parallel projections
all-gather them along the sequence, and the row-parallel ``linear_proj`` reduce-scatters the output.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from mcore.config.fields import check
from mcore.models.transformer.attention import CoreAttention
from mcore.models.transformer.build_context import BuildContext
from mcore.models.transformer.model_config import ModelConfig
from mcore.models.transformer.spec import ModuleSpec, build_module
from mcore.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from mcore.tensor_parallel.recompute import checkpoint
from mcore.tensor_parallel.sharding import init_method_normal, scaled_init_method_normal


@dataclass
class CrossAttentionSubmodules:
    """Which classes build the four parts of :class:`CrossAttention` (megatron-core's names)."""

    linear_q: Any = ColumnParallelLinear
    linear_kv: Any = ColumnParallelLinear
    core_attention: Any = field(default_factory=lambda: ModuleSpec(CoreAttention, params={"causal": False}))
    linear_proj: Any = RowParallelLinear


class CrossAttention(torch.nn.Module):
    """Multi-head attention of the decoder stream over the encoder output (no causal mask).

    Parameters: ``linear_q.weight [n_p d, h]``, ``linear_kv.weight [2 n_p d, h]`` (+ biases with
    bias), ``linear_proj.weight [h, n_p d]`` (+ replicated ``.bias``).
    """

    def __init__(
        self,
        config: ModelConfig,
        ctx: BuildContext,
        layer_number: int = 1,
        submodules: CrossAttentionSubmodules | None = None,
    ):
        super().__init__()
        submodules = submodules or CrossAttentionSubmodules()
        n, d, h = config.num_attention_heads, config.kv_channels, config.hidden_size
        check(
            config.num_query_groups == n,
            f"cross-attention needs num_query_groups == num_attention_heads (got {config.num_query_groups} "
            f"and {n}); drop --group-query-attention for encoder-decoder models",
        )
        self.layer_number = layer_number
        self.num_heads = n // ctx.tp_size
        self.head_dim = d
        self.recompute_core_attention = "core_attn" in config.selective_recompute_modules
        common = dict(
            tp_group=ctx.tp_group,
            bias=config.add_bias_linear,
            sequence_parallel=ctx.sequence_parallel,
            gradient_accumulation_fusion=config.gradient_accumulation_fusion,
            **ctx.fp8_kwargs(layer_number),
            params_dtype=ctx.params_dtype,
            device=ctx.device,
        )
        init = init_method_normal(config.init_method_std)
        self.linear_q = build_module(
            submodules.linear_q, h, n * d, gather_output=False, init_method=init, **common
        )
        self.linear_kv = build_module(
            submodules.linear_kv, h, 2 * n * d, gather_output=False, init_method=init, **common
        )
        self.core_attention = build_module(submodules.core_attention, config, ctx, layer_number=layer_number)
        self.linear_proj = build_module(
            submodules.linear_proj,
            n * d,
            h,
            input_is_parallel=True,
            skip_bias_add=True,
            init_method=scaled_init_method_normal(config.init_method_std, config.num_layers),
            **common,
        )

    def key_value(self, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Encoder output ``[s_k, b, h]`` (``[s_k/p, b, h]`` with SP) -> key, value ``[s_k, b, n_p, d]``."""
        kv, _ = self.linear_kv(context)  # [s_k, b, 2 n_p d]
        s, b = kv.shape[:2]
        key, value = kv.view(s, b, self.num_heads, 2 * self.head_dim).split(self.head_dim, dim=-1)
        return key, value

    def forward(
        self,
        hidden_states: torch.Tensor,
        context: torch.Tensor | None,
        context_mask: torch.Tensor | None = None,
        inference_context=None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``hidden_states [s, b, h]`` attends over ``context [s_k, b, h]`` -> (``[s, b, h]``, proj bias).

        ``context_mask``: bool, broadcastable to ``[b, n_p, s, s_k]``, True = masked (encoder padding).
        ``context`` may be None when ``inference_context`` holds this layer's keys and values.
        """
        query, _ = self.linear_q(hidden_states)  # [s, b, n_p d]
        s, b = query.shape[:2]
        query = query.view(s, b, self.num_heads, self.head_dim)
        if inference_context is not None and hasattr(inference_context, "cross_kv"):
            key, value = inference_context.cross_kv(self.layer_number, lambda: self.key_value(context))
        else:
            key, value = self.key_value(context)
        if self.recompute_core_attention and self.training:
            out = checkpoint(self.core_attention, query, key, value, context_mask, None)
        else:
            out = self.core_attention(query, key, value, context_mask, None)
        return self.linear_proj(out)
