"""Self-attention: fused QKV projection, RoPE or ALiBi, grouped-query core attention, output projection.

Shapes (``p`` TP ranks): ``n`` query heads, ``g`` query groups (key/value heads), ``r = n/g``,
``d = kv_channels``; locally ``n_p = n/p`` and ``g_p = g/p`` (whole groups per rank).

``linear_qkv`` (column-parallel) holds the logical weight ``[(n + 2g) d, h]`` in Megatron's
per-group packed layout: ``g`` blocks of ``(r + 2) d`` rows, block ``j`` = the ``r`` query heads
``j r .. j r + r - 1``, then key head ``j``, then value head ``j``. Rank ``t`` holds the contiguous
rows of groups ``t g_p .. (t+1) g_p - 1``, i.e. the same layout with ``g_p`` groups, so its output
``[s, b, (n_p + 2 g_p) d]`` views as ``[s, b, g_p, (r + 2) d]`` and splits into Q, K, V.
With ``g = n`` (no GQA) this is GPT-2's per-head ``[q, k, v]`` layout (Megatron checkpoint version 2+).

``linear_proj`` (row-parallel) is ``[h, n d]``: rank ``t`` holds the columns of its heads.

Inference (key/value cache). ``SelfAttention.forward`` takes an optional ``inference_context``: any
object with ``update_kv(layer_number, key, value) -> (keys, values)`` (for instance
:class:`mcore.inference.kv_cache.KVCache`). The layer hands it this step's keys and values
``[s_new, b, g_p, d]`` (after RoPE) and attends over what it returns, ``[s_past + s_new, b, g_p, d]``;
the causal mask of the attention op is aligned at the end, so the new queries see every cached key.
Positions come from ``position_ids``, which the caller sets to the tokens' absolute positions.

QK layernorm (``--qk-layernorm``, Megatron's placement, Qwen3): after the split and before RoPE,
``q_h = norm(q_h; w_q)`` and ``k_j = norm(k_j; w_k)`` for every query head ``h`` and key head ``j``,
over its ``d`` channels, with the model's ``--normalization`` and epsilon; ``q_layernorm.weight`` and
``k_layernorm.weight`` are ``[d]`` (+ ``.bias`` for LayerNorm), shared by all heads, so replicated over
TP; each rank applies them to its own heads, so their gradients are summed over TP (their layouts say
``sequence_parallel=True``, the flag :func:`mcore.distributed.finalize.finalize_model_grads` reads).
``--qk-layernorm-full-width`` (OLMoE) normalizes all ``n d`` query channels of a token together
(weight ``[n d]``) and all ``g d`` key channels (``[g d]``): it needs TP=1. The norm sits in
:meth:`SelfAttention.forward_from_split`, which every path (plain, FP8 fused norm and QKV) goes through.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from mcore.backend import get_ops
from mcore.models.transformer.build_context import BuildContext
from mcore.models.transformer.context_parallel import context_parallel_attention
from mcore.models.transformer.model_config import ModelConfig
from mcore.models.transformer.norms import Norm
from mcore.models.transformer.positions import alibi_bias, alibi_slopes
from mcore.models.transformer.spec import build_module
from mcore.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from mcore.tensor_parallel.random import get_rng_tracker
from mcore.tensor_parallel.recompute import checkpoint
from mcore.tensor_parallel.sharding import init_method_normal, scaled_init_method_normal


class CoreAttention(torch.nn.Module):
    """``softmax(Q K^T / sqrt(d) + bias, causal, mask) V`` with attention dropout, via the op table.

    The softmax is computed in fp32 by the op. Dropout acts on probabilities of this rank's heads, so
    it draws from the TP RNG stream (different on every TP rank, Megatron's convention).
    """

    def __init__(self, config: ModelConfig, ctx: BuildContext, layer_number: int = 1, causal: bool = True):
        super().__init__()
        # Decoders mask the future (Megatron's AttnMaskType.causal); encoders (BERT, the T5 encoder) and
        # cross-attention see every position not masked by ``attention_mask`` (AttnMaskType.padding).
        # A spec chooses: ``ModuleSpec(CoreAttention, params={"causal": False})``.
        self.causal = causal
        self.dropout = config.attention_dropout
        self.scale = 1.0 / math.sqrt(config.kv_channels)
        # Context parallelism: the sequence is split over ctx.cp_group (zigzag layout).
        self.cp_group = ctx.cp_group if ctx is not None and ctx.cp_size > 1 else None
        self.cp_comm_type = getattr(ctx, "cp_comm_type", "p2p")

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        attention_bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``query [s, b, n_p, d]``, ``key``/``value [s_k, b, g_p, d]`` -> ``[s, b, n_p d]``.

        ``attention_mask``: bool, broadcastable to ``[b, n_p, s, s_k]``, True = masked (in addition to the
        causal mask when ``causal``). ``attention_bias``: additive, ``[1, n_p, s, s]`` (ALiBi).
        """
        s, b, n, d = query.shape
        p = self.dropout if self.training else 0.0
        if self.cp_group is not None:
            out = context_parallel_attention(
                query,
                key,
                value,
                self.cp_group,
                self.cp_comm_type,
                causal=self.causal,
                scale=self.scale,
                attention_mask=attention_mask,
                attention_bias=attention_bias,
                dropout_p=p,
            )
            return out.reshape(s, b, n * d)
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, heads, s, d]
        rng = get_rng_tracker().fork() if p > 0.0 else contextlib.nullcontext()
        with rng:
            out = get_ops().attention(
                q,
                k,
                v,
                causal=self.causal,
                mask=attention_mask,
                bias=attention_bias,
                dropout_p=p,
                scale=self.scale,
            )
        return out.permute(2, 0, 1, 3).reshape(s, b, n * d)


@dataclass
class SelfAttentionSubmodules:
    """Which classes build the three parts of :class:`SelfAttention`."""

    linear_qkv: Any = ColumnParallelLinear
    core_attention: Any = CoreAttention
    linear_proj: Any = RowParallelLinear


class SelfAttention(torch.nn.Module):
    """Multi-head / grouped-query / multi-query causal self-attention, split over TP by query groups.

    Parameters: ``linear_qkv.weight [(n_p + 2 g_p) d, h]`` (+ ``.bias`` with bias or
    ``--add-qkv-bias``), ``linear_proj.weight [h, n_p d]`` (+ replicated ``.bias``).
    """

    def __init__(
        self,
        config: ModelConfig,
        ctx: BuildContext,
        layer_number: int = 1,
        submodules: SelfAttentionSubmodules | None = None,
    ):
        super().__init__()
        submodules = submodules or SelfAttentionSubmodules()
        n, g, d, h = (
            config.num_attention_heads,
            config.num_query_groups,
            config.kv_channels,
            config.hidden_size,
        )
        self.layer_number = layer_number
        self.heads_per_group = n // g
        self.num_heads = n // ctx.tp_size
        self.num_groups = g // ctx.tp_size
        self.head_dim = d
        self.recompute_core_attention = "core_attn" in config.selective_recompute_modules
        self.linear_qkv = build_module(
            submodules.linear_qkv,
            h,
            (n + 2 * g) * d,
            tp_group=ctx.tp_group,
            bias=config.add_bias_linear or config.add_qkv_bias,
            gather_output=False,
            sequence_parallel=ctx.sequence_parallel,
            init_method=init_method_normal(config.init_method_std),
            gradient_accumulation_fusion=config.gradient_accumulation_fusion,
            **ctx.fp8_kwargs(layer_number),
            params_dtype=ctx.params_dtype,
            device=ctx.device,
        )
        self.core_attention = build_module(submodules.core_attention, config, ctx, layer_number=layer_number)
        self.linear_proj = build_module(
            submodules.linear_proj,
            n * d,
            h,
            tp_group=ctx.tp_group,
            bias=config.add_bias_linear,
            input_is_parallel=True,
            skip_bias_add=True,
            sequence_parallel=ctx.sequence_parallel,
            init_method=scaled_init_method_normal(config.init_method_std, config.num_layers),
            gradient_accumulation_fusion=config.gradient_accumulation_fusion,
            **ctx.fp8_kwargs(layer_number),
            params_dtype=ctx.params_dtype,
            device=ctx.device,
        )
        self.qk_full_width = config.qk_layernorm_full_width
        if config.qk_layernorm:
            q_width, k_width = (n * d, g * d) if self.qk_full_width else (d, d)
            self.q_layernorm = _qk_norm(config, ctx, q_width)
            self.k_layernorm = _qk_norm(config, ctx, k_width)
        else:
            self.q_layernorm = self.k_layernorm = None
        if config.position_embedding_type == "alibi":
            first = ctx.tp_rank * self.num_heads
            slopes = alibi_slopes(n)[first : first + self.num_heads]
            self.register_buffer("alibi_slopes", torch.tensor(slopes, device=ctx.device), persistent=False)
        else:
            self.alibi_slopes = None

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        rotary_freqs: torch.Tensor | None = None,
        inference_context=None,
        attention_bias: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[s, b, h]`` (``[s/p, b, h]`` with SP) -> (output of the same shape, the un-added proj bias).

        ``inference_context``: a key/value cache (see the module docstring), or None.
        ``attention_bias``: an additive score bias of this rank's heads, broadcastable to
        ``[b, n_p, s, s_k]`` (T5's relative positions), or None.
        """
        qkv, _ = self.linear_qkv(hidden_states)  # [s, b, (n_p + 2 g_p) d]
        return self.forward_from_qkv(qkv, attention_mask, rotary_freqs, inference_context, attention_bias)

    def forward_from_qkv(
        self,
        qkv: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        rotary_freqs: torch.Tensor | None = None,
        inference_context=None,
        attention_bias: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`forward` after the QKV projection: ``qkv [s, b, (n_p + 2 g_p) d]`` (``linear_qkv``'s
        output, or the fused norm and projection's, :mod:`mcore.fp8.producers`)."""
        s, b = qkv.shape[:2]
        groups, widths = self.qkv_split()
        query, key, value = torch.split(qkv.view(s, b, groups, sum(widths)), list(widths), dim=-1)
        return self.forward_from_split(
            query, key, value, attention_mask, rotary_freqs, inference_context, attention_bias
        )

    def qkv_split(self) -> tuple[int, tuple[int, int, int]]:
        """``(g_p, (r d, d, d))``: ``linear_qkv``'s output on this rank is ``g_p`` groups of ``[q | k | v]``
        columns of these widths (the module docstring's per-group layout)."""
        r, d = self.heads_per_group, self.head_dim
        return self.num_groups, (r * d, d, d)

    def _qk_norm(self, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``query [s, b, n_p, d]``, ``key [s, b, g_p, d]`` normalized per head (or over all heads)."""
        if not self.qk_full_width:
            return self.q_layernorm(query), self.k_layernorm(key)
        s, b = query.shape[:2]
        query = self.q_layernorm(query.reshape(s, b, -1)).view(query.shape)
        key = self.k_layernorm(key.reshape(s, b, -1)).view(key.shape)
        return query, key

    def forward_from_split(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        rotary_freqs: torch.Tensor | None = None,
        inference_context=None,
        attention_bias: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`forward_from_qkv` after the split: ``query [s, b, g_p, r d]``, ``key``/``value [s, b,
        g_p, d]`` (views of ``linear_qkv``'s output, or the fused norm and projection's parts,
        :class:`~mcore.fp8.fused.OutputSplit`)."""
        s, b = query.shape[:2]
        query = query.reshape(s, b, self.num_heads, self.head_dim)
        if self.q_layernorm is not None:
            query, key = self._qk_norm(query, key)
        if rotary_freqs is not None:
            ops = get_ops()
            query = ops.rotary_embedding(query, rotary_freqs)
            key = ops.rotary_embedding(key, rotary_freqs)
        if inference_context is not None:
            key, value = inference_context.update_kv(self.layer_number, key, value)
        bias = None if self.alibi_slopes is None else alibi_bias(self.alibi_slopes, s, key.shape[0])
        if attention_bias is not None:
            bias = attention_bias if bias is None else bias + attention_bias
        if self.recompute_core_attention and self.training:
            context = checkpoint(self.core_attention, query, key, value, attention_mask, bias)
        else:
            context = self.core_attention(query, key, value, attention_mask, bias)
        return self.linear_proj(context)


def _qk_norm(config: ModelConfig, ctx: BuildContext, width: int) -> Norm:
    """A q/k norm over ``width`` channels whose gradient is summed over TP (each rank has other heads)."""
    norm = Norm(config, ctx, hidden_size=width)
    for param in norm.parameters():
        param.shard_layout = dataclasses.replace(param.shard_layout, sequence_parallel=ctx.tp_size > 1)
    return norm
