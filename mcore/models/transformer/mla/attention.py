"""Multi-latent attention (DeepSeek-V2/V3; megatron-core's ``MLASelfAttention``), split over TP by heads.

Shapes: ``n`` heads (``n_p = n/p`` on each of ``p`` TP ranks), ``d_n = qk_head_dim``, ``d_r =
qk_pos_emb_head_dim``, ``d_q = d_n + d_r``, ``d_v = v_head_dim``, ``c_q = q_lora_rank``,
``c_kv = kv_lora_rank``. Parameters (megatron-core's names, so its checkpoints map)::

    linear_q_down_proj.weight  [c_q, h]              replicated  (with --q-lora-rank)
    q_layernorm.weight         [c_q]                 replicated  (with --q-lora-rank and --qk-layernorm)
    linear_q_up_proj.weight    [n d_q / p, c_q]      column      (with --q-lora-rank)
    linear_q_proj.weight       [n d_q / p, h]        column      (without: DeepSeek-V2-Lite)
    linear_kv_down_proj.weight [c_kv + d_r, h]       replicated  (HF kv_a_proj_with_mqa)
    kv_layernorm.weight        [c_kv]                replicated  (with --qk-layernorm)
    linear_kv_up_proj.weight   [n (d_n + d_v) / p, c_kv]  column, per head [k_nope_j; v_j]
    linear_proj.weight         [h, n d_v / p]        row

Per token ``x`` (``[s, b, h]``; ``[s/p, b, h]`` with SP)::

    q = up_q(norm_q(down_q(x)))  -> per head [q_nope (d_n) | q_pe (d_r)]
    (the latent norms norm_q / norm_kv exist with ``--qk-layernorm``, as in megatron-core, whose MLA
    spec puts IdentityOp there otherwise; DeepSeek's models have them)
    [c | k_pe] = down_kv(x);  kv = up_kv(norm_kv(c)) -> per head [k_nope (d_n) | v (d_v)]
    q_pe, k_pe = mscale * rope(q_pe), mscale * rope(k_pe)   (k_pe: one head, shared by all heads)
    out = proj(softmax([q_nope|q_pe] . [k_nope|k_pe] * scale) v),
    scale = m(s, mscale_all_dim)^2 / sqrt(d_q)   (:mod:`mcore.models.transformer.mla.config`)

RoPE channel order: DeepSeek's and Megatron's MLA (``mla_rotary_interleaved``) rotate the pairs
``(2i, 2i+1)`` of the ``d_r`` channels; the ``rotary_embedding`` op rotates halves, so the channels
are first reordered ``[0, 2, 4, .., 1, 3, ..]`` (same order for q and k: the dot product is unchanged).

Down projections are replicated (each rank projects its own tokens; under SP their weight gradients
are partial and summed over TP, ``ParamLayout.sequence_parallel``); the shared ``k_pe`` enters every
rank's heads, so it is all-gathered along the sequence with SP (gradient: reduce-scatter) or copied
(gradient: all-reduce) without.

Value head dim: the ``attention`` op takes one head dim for q, k and v (flash kernels and the NPU
fused attention require it), so V is zero-padded to ``d_q`` (or Q and K to ``d_v`` when ``d_v >
d_q``: zero channels change no score) and the output sliced back to ``d_v``. Exact; the cost is the
padded channels' FLOPs in ``P V`` (DeepSeek-V3: 192 vs 128).

Recompute ``mla_up_proj`` (selective): the up projections and RoPE are recomputed in backward instead
of keeping the ``[s, b, n_p, 3 d_q]`` query/key/value the core attention saves
(:class:`~mcore.tensor_parallel.recompute.RecomputeWhenSaved`).

Generation: the cache (``inference_context.update_kv``) stores the normed latent ``c`` ``[s, b,
c_kv]`` and the rotated ``k_pe`` ``[s, b, 1, d_r]``: ``(c_kv + d_r)`` numbers per token and layer
instead of ``2 n (d_q)``; the keys and values of all cached tokens are up-projected at each step.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from mcore.backend import get_ops
from mcore.models.transformer.attention import CoreAttention
from mcore.models.transformer.build_context import BuildContext
from mcore.models.transformer.model_config import ModelConfig
from mcore.models.transformer.norms import Norm
from mcore.models.transformer.positions import RotaryEmbedding, YarnRotaryEmbedding, yarn_mscale
from mcore.models.transformer.spec import build_module
from mcore.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from mcore.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)
from mcore.tensor_parallel.recompute import RecomputeWhenSaved, checkpoint
from mcore.tensor_parallel.sharding import init_method_normal, scaled_init_method_normal


class ReplicatedLinear(ColumnParallelLinear):
    """``y = x W^T`` with ``W`` whole on every TP rank (MLA's down projections).

    A :class:`ColumnParallelLinear` of a one-rank group (so FP8 and gradient-accumulation fusion work
    as in the dense path) whose weight layout says *replicated*; with sequence parallelism each rank
    applies it to its own tokens, so the layout is marked ``sequence_parallel`` (gradient summed over TP).
    """

    def __init__(self, input_size: int, output_size: int, *, sequence_parallel: bool = False, **kwargs: Any):
        kwargs.pop("tp_group", None)
        super().__init__(input_size, output_size, tp_group=None, **kwargs)
        layout = self.weight.shard_layout
        self.weight.shard_layout = dataclasses.replace(
            layout, partition_dim=None, sequence_parallel=sequence_parallel
        )


@dataclass
class MLASelfAttentionSubmodules:
    """Which classes build the parts of :class:`MLASelfAttention` (megatron-core's names)."""

    linear_q_proj: Any = ColumnParallelLinear
    linear_q_down_proj: Any = ReplicatedLinear
    linear_q_up_proj: Any = ColumnParallelLinear
    linear_kv_down_proj: Any = ReplicatedLinear
    linear_kv_up_proj: Any = ColumnParallelLinear
    core_attention: Any = CoreAttention
    linear_proj: Any = RowParallelLinear


def mla_softmax_scale(config: ModelConfig) -> float:
    """``m(s, mscale_all_dim)^2 / sqrt(qk_head_dim + qk_pos_emb_head_dim)`` (m: 1 with plain rope)."""
    m = (
        yarn_mscale(config.rotary_scaling_factor, config.mscale_all_dim)
        if config.mla_rope_type == "yarn"
        else 1.0
    )
    return m * m / math.sqrt(config.q_head_dim)


def mla_rope_mscale(config: ModelConfig) -> float:
    """The factor on the rotated channels: ``m(s, mscale) / m(s, mscale_all_dim)`` (YaRN), else 1."""
    if config.mla_rope_type != "yarn":
        return 1.0
    s = config.rotary_scaling_factor
    return yarn_mscale(s, config.mscale) / yarn_mscale(s, config.mscale_all_dim)


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """``[..., d]`` channels ``[0, 2, 4, .., 1, 3, ..]``: DeepSeek's pair-wise RoPE as rotate-half."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class MLASelfAttention(torch.nn.Module):
    """Multi-latent self-attention (see the module docstring); the call signature of
    :class:`~mcore.models.transformer.attention.SelfAttention` (``rotary_freqs``: angles of the
    ``d_r`` channels, ``[s, b|1, 1, d_r]``)."""

    def __init__(
        self,
        config: ModelConfig,
        ctx: BuildContext,
        layer_number: int = 1,
        submodules: MLASelfAttentionSubmodules | None = None,
    ):
        super().__init__()
        sub = submodules or MLASelfAttentionSubmodules()
        n, h = config.num_attention_heads, config.hidden_size
        self.layer_number = layer_number
        self.num_heads = n // ctx.tp_size
        self.dn, self.dr, self.dv = config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim
        self.kv_lora_rank, self.q_lora_rank = config.kv_lora_rank, config.q_lora_rank
        self.tp_group, self.sequence_parallel = ctx.tp_group, ctx.sequence_parallel
        self.recompute_up_proj = "mla_up_proj" in config.selective_recompute_modules
        self.recompute_core_attention = "core_attn" in config.selective_recompute_modules
        self.rope_mscale = mla_rope_mscale(config)
        init = init_method_normal(config.init_method_std)
        common = dict(
            bias=False,
            init_method=init,
            gradient_accumulation_fusion=config.gradient_accumulation_fusion,
            **ctx.fp8_kwargs(layer_number),
            params_dtype=ctx.params_dtype,
            device=ctx.device,
        )
        column = dict(tp_group=ctx.tp_group, gather_output=False, sequence_parallel=ctx.sequence_parallel)
        dq = config.q_head_dim
        if self.q_lora_rank is None:
            self.linear_q_proj = build_module(sub.linear_q_proj, h, n * dq, **column, **common)
        else:
            self.linear_q_down_proj = build_module(
                sub.linear_q_down_proj, h, self.q_lora_rank, sequence_parallel=ctx.sequence_parallel, **common
            )
            self.linear_q_up_proj = build_module(
                sub.linear_q_up_proj, self.q_lora_rank, n * dq, **column, **common
            )
        self.linear_kv_down_proj = build_module(
            sub.linear_kv_down_proj,
            h,
            self.kv_lora_rank + self.dr,
            sequence_parallel=ctx.sequence_parallel,
            **common,
        )
        self.linear_kv_up_proj = build_module(
            sub.linear_kv_up_proj, self.kv_lora_rank, n * (self.dn + self.dv), **column, **common
        )
        self.q_layernorm = self.kv_layernorm = None  # megatron-core: IdentityOp without --qk-layernorm
        if config.qk_layernorm and self.q_lora_rank is not None:
            self.q_layernorm = Norm(config, ctx, hidden_size=self.q_lora_rank)
        if config.qk_layernorm:
            self.kv_layernorm = Norm(config, ctx, hidden_size=self.kv_lora_rank)
        self.core_attention = build_module(sub.core_attention, config, ctx, layer_number=layer_number)
        self.core_attention.scale = mla_softmax_scale(config)
        self.linear_proj = build_module(
            sub.linear_proj,
            n * self.dv,
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

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        rotary_freqs: torch.Tensor | None = None,
        inference_context=None,
        attention_bias: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[s, b, h]`` (``[s/p, b, h]`` with SP) -> (output of the same shape, the un-added proj bias)."""
        if attention_bias is not None:
            raise ValueError("multi-latent attention takes no additive attention bias")
        q_in = hidden_states
        if self.q_lora_rank is not None:
            q_in, _ = self.linear_q_down_proj(hidden_states)  # [s(/p), b, c_q]
            if self.q_layernorm is not None:
                q_in = self.q_layernorm(q_in)
        kv_combined, _ = self.linear_kv_down_proj(hidden_states)  # [s(/p), b, c_kv + d_r]
        kv_c, k_pe = torch.split(kv_combined, [self.kv_lora_rank, self.dr], dim=-1)
        if self.kv_layernorm is not None:
            kv_c = self.kv_layernorm(kv_c)
        if self.sequence_parallel:  # every rank's heads read every token's k_pe
            k_pe = gather_from_sequence_parallel_region(k_pe, self.tp_group, tensor_parallel_output_grad=True)
        else:
            k_pe = copy_to_tensor_model_parallel_region(k_pe, self.tp_group)
        k_pe = self._rope(k_pe.unsqueeze(2), rotary_freqs)  # [s, b, 1, d_r]
        if inference_context is not None:  # the latent cache: c and the rotated k_pe
            kv_c, k_pe = inference_context.update_kv(self.layer_number, kv_c, k_pe)
        args = (q_in, kv_c, k_pe, rotary_freqs)
        qkv = self.up_projection(*args)  # [s_k, b, n_p, 3 d]
        s = rotary_freqs.shape[0]  # the queries (fewer than the keys when generating with a cache)
        if self.recompute_up_proj and self.training and torch.is_grad_enabled():
            with RecomputeWhenSaved(qkv, self.up_projection, *args):
                context = self._core(qkv, s, attention_mask)
        else:
            context = self._core(qkv, s, attention_mask)
        return self.linear_proj(context)

    def _rope(self, x: torch.Tensor, freqs: torch.Tensor | None) -> torch.Tensor:
        if freqs is None:
            raise ValueError("multi-latent attention needs RoPE angles (rotary_freqs)")
        out = get_ops().rotary_embedding(deinterleave(x), freqs)
        return out * self.rope_mscale if self.rope_mscale != 1.0 else out

    def up_projection(
        self, q_in: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, freqs: torch.Tensor
    ) -> torch.Tensor:
        """Query, key and value ``[s, b, n_p, 3 d]`` (``d = max(d_q, d_v)``, zero padded) from the
        query input (``c_q`` normed, or ``x``), the normed latent ``[s_k, b, c_kv]`` and the rotated
        ``k_pe [s_k, b, 1, d_r]``; ``freqs``: the ``s`` queries' angles. With fewer queries than keys
        (generation) the query rows are zero-padded at the front to ``s_k`` so the three pack together."""
        q, _ = (self.linear_q_proj if self.q_lora_rank is None else self.linear_q_up_proj)(q_in)
        s, b = q.shape[:2]
        q = q.view(s, b, self.num_heads, self.dn + self.dr)
        kv, _ = self.linear_kv_up_proj(kv_c)
        sk = kv.shape[0]
        kv = kv.view(sk, b, self.num_heads, self.dn + self.dv)
        q_nope, q_pe = torch.split(q, [self.dn, self.dr], dim=-1)
        k_nope, value = torch.split(kv, [self.dn, self.dv], dim=-1)
        q_pe = self._rope(q_pe, freqs)
        query = torch.cat((q_nope, q_pe), dim=-1)
        key = torch.cat((k_nope, k_pe.expand(sk, b, self.num_heads, self.dr)), dim=-1)
        d = max(self.dn + self.dr, self.dv)
        query, key, value = (
            F.pad(t, (0, d - t.shape[-1])) if t.shape[-1] < d else t for t in (query, key, value)
        )
        if s == sk:
            return torch.cat((query, key, value), dim=-1)
        return torch.cat((F.pad(query, (0, 0, 0, 0, 0, 0, sk - s, 0)), key, value), dim=-1)  # generation

    def _core(self, qkv: torch.Tensor, s: int, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """Core attention on the packed ``[s_k, b, n_p, 3 d]`` for the last ``s`` queries -> ``[s, b, n_p d_v]``."""
        query, key, value = qkv.chunk(3, dim=-1)
        query = query[query.shape[0] - s :]
        if self.recompute_core_attention and self.training:
            out = checkpoint(self.core_attention, query, key, value, attention_mask, None)
        else:
            out = self.core_attention(query, key, value, attention_mask, None)
        d = qkv.shape[-1] // 3
        out = out.view(s, out.shape[1], self.num_heads, d)[..., : self.dv]
        return out.reshape(s, out.shape[1], self.num_heads * self.dv)


def self_attention_or_mla(config: ModelConfig, ctx: BuildContext, layer_number: int = 1, **kwargs: Any):
    """The self-attention slot of a layer spec: :class:`MLASelfAttention` with
    ``--multi-latent-attention`` (its submodules from ``kwargs["mla"]``, default
    :class:`MLASelfAttentionSubmodules`), else the spec ``kwargs["standard"]``."""
    standard, mla = kwargs.pop("standard"), kwargs.pop("mla", None)
    if config.multi_latent_attention:
        return MLASelfAttention(config, ctx, layer_number, submodules=mla)
    return build_module(standard, config, ctx, layer_number=layer_number, **kwargs)


def rotary_embedding_for(config: ModelConfig) -> torch.nn.Module:
    """The model's RoPE angle module: MLA's over ``qk_pos_emb_head_dim`` channels (YaRN with
    ``--rope-type yarn``, MLA's default), else plain RoPE over ``config.rotary_dim``."""
    if not config.multi_latent_attention:
        return RotaryEmbedding(config.rotary_dim, config.rotary_base)
    if config.mla_rope_type == "rope":
        return RotaryEmbedding(config.qk_pos_emb_head_dim, config.rotary_base)
    return YarnRotaryEmbedding(
        config.qk_pos_emb_head_dim,
        config.rotary_base,
        scaling_factor=config.rotary_scaling_factor,
        original_max_position_embeddings=config.original_max_position_embeddings,
        beta_fast=config.beta_fast,
        beta_slow=config.beta_slow,
    )
