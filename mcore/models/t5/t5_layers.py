"""The T5 transformer layer (self-attention, optional cross-attention, MLP), its specs, and the block.

Parameter names inside a layer (megatron-core's): ``input_layernorm``, ``self_attention.*``
(:mod:`mcore.models.transformer.attention`), for the decoder ``pre_cross_attn_layernorm`` and
``cross_attention.*`` (:mod:`mcore.models.transformer.cross_attention`), ``pre_mlp_layernorm``, ``mlp.*``. In a
block: ``layers.{i}.*`` (``i`` local to the chunk) and ``final_layernorm`` on the stack's last chunk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mcore.models.transformer.attention import CoreAttention, SelfAttention, SelfAttentionSubmodules
from mcore.models.transformer.block import TransformerBlock
from mcore.models.transformer.build_context import BuildContext
from mcore.models.transformer.cross_attention import CrossAttention, CrossAttentionSubmodules
from mcore.models.transformer.layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    mark_bias_added_by_caller,
)
from mcore.models.transformer.mlp import MLP, MLPSubmodules
from mcore.models.transformer.model_config import ModelConfig
from mcore.models.transformer.norms import Norm
from mcore.models.transformer.spec import ModuleSpec, build_module
from mcore.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from mcore.tensor_parallel.recompute import checkpoint


class T5CoreAttention(CoreAttention):
    """:class:`CoreAttention` whose scores may be unscaled (``unscaled=True``: Hugging Face T5's ``Q K^T``)."""

    def __init__(
        self,
        config: ModelConfig,
        ctx: BuildContext,
        layer_number: int = 1,
        causal: bool = True,
        unscaled: bool = False,
    ):
        super().__init__(config, ctx, layer_number, causal=causal)
        if unscaled:
            self.scale = 1.0


@dataclass
class T5LayerSubmodules(TransformerLayerSubmodules):
    """A transformer layer's parts plus, for the decoder, the cross-attention and its norm."""

    pre_cross_attn_layernorm: Any = None
    cross_attention: Any = None


def _self_attention_spec(causal: bool, unscaled: bool) -> ModuleSpec:
    """Self-attention with T5's core attention (``unscaled``: HF T5 v1.1 has no 1/sqrt(d) factor)."""
    return ModuleSpec(
        SelfAttention,
        submodules=SelfAttentionSubmodules(
            linear_qkv=ColumnParallelLinear,
            core_attention=ModuleSpec(T5CoreAttention, params={"causal": causal, "unscaled": unscaled}),
            linear_proj=RowParallelLinear,
        ),
    )


def _mlp_spec() -> ModuleSpec:
    return ModuleSpec(
        MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    )


def t5_encoder_layer_spec(config: ModelConfig) -> ModuleSpec:
    """Encoder layer: norm, bidirectional self-attention (padding mask), norm, MLP."""
    unscaled = config.position_embedding_type == "relative"
    return ModuleSpec(
        T5Layer,
        submodules=T5LayerSubmodules(
            input_layernorm=ModuleSpec(Norm),
            self_attention=_self_attention_spec(causal=False, unscaled=unscaled),
            pre_mlp_layernorm=ModuleSpec(Norm),
            mlp=_mlp_spec(),
        ),
    )


def t5_decoder_layer_spec(config: ModelConfig) -> ModuleSpec:
    """Decoder layer: norm, causal self-attention, norm, cross-attention to the encoder, norm, MLP."""
    unscaled = config.position_embedding_type == "relative"
    return ModuleSpec(
        T5Layer,
        submodules=T5LayerSubmodules(
            input_layernorm=ModuleSpec(Norm),
            self_attention=_self_attention_spec(causal=True, unscaled=unscaled),
            pre_cross_attn_layernorm=ModuleSpec(Norm),
            cross_attention=ModuleSpec(
                CrossAttention,
                submodules=CrossAttentionSubmodules(
                    linear_q=ColumnParallelLinear,
                    linear_kv=ColumnParallelLinear,
                    core_attention=ModuleSpec(
                        T5CoreAttention, params={"causal": False, "unscaled": unscaled}
                    ),
                    linear_proj=RowParallelLinear,
                ),
            ),
            pre_mlp_layernorm=ModuleSpec(Norm),
            mlp=_mlp_spec(),
        ),
    )


class T5Layer(TransformerLayer):
    """Pre-norm layer: self-attention, [cross-attention,] MLP, each ``x = x + dropout(part(norm(x)))``.

    Recomputation options act as in :class:`~mcore.models.transformer.layer.TransformerLayer`
    (``layernorm`` also covers the cross-attention's norm; ``core_attn`` its core attention).
    """

    def __init__(
        self,
        config: ModelConfig,
        ctx: BuildContext,
        layer_number: int = 1,
        submodules: T5LayerSubmodules | None = None,
    ):
        submodules = submodules or T5LayerSubmodules()
        super().__init__(config, ctx, layer_number, submodules)
        self.pre_cross_attn_layernorm = None
        self.cross_attention = None
        if submodules.cross_attention is not None:
            self.pre_cross_attn_layernorm = build_module(submodules.pre_cross_attn_layernorm, config, ctx)
            self.cross_attention = build_module(
                submodules.cross_attention, config, ctx, layer_number=layer_number
            )
            mark_bias_added_by_caller(self.cross_attention)  # added in _residual_branch's bda
            # megatron-core's order: self-attention, cross-attention, MLP (parameter listings, checkpoints)
            order = ("input_layernorm", "self_attention", "pre_cross_attn_layernorm", "cross_attention")
            self._modules = {
                **{k: self._modules[k] for k in order},
                **{k: v for k, v in self._modules.items() if k not in order},
            }

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        attention_bias: torch.Tensor | None = None,
        context: torch.Tensor | None = None,
        context_mask: torch.Tensor | None = None,
        inference_context=None,
    ) -> torch.Tensor:
        """``hidden_states [s, b, h]``; ``context [s_e, b, h]`` is the encoder output (decoder layers)."""
        recompute = self._may_recompute(inference_context)
        hidden_states = self._self_attention_branch(
            hidden_states, recompute, attention_mask, None, inference_context, attention_bias=attention_bias
        )
        if self.cross_attention is not None:
            hidden_states = self._residual_branch(
                self.pre_cross_attn_layernorm,
                hidden_states,
                recompute,
                lambda normed: self.cross_attention(
                    normed, context, context_mask, inference_context=inference_context
                ),
            )
        return self._mlp_branch(hidden_states, recompute)


class T5Block(TransformerBlock):
    """Consecutive encoder or decoder layers (``layers.{i}``) and, on the stack's last chunk, its final norm.

    ``--recompute-granularity full`` checkpoints chunks of ``--recompute-num-layers`` layers
    (``uniform``) or the first that many layers (``block``), as
    :class:`~mcore.models.transformer.block.TransformerBlock`.
    """

    def __init__(
        self,
        config: ModelConfig,
        ctx: BuildContext,
        layer_spec: ModuleSpec,
        *,
        num_layers: int,
        layer_offset: int,
        final_norm: bool,
    ):
        # TransformerBlock's layers, recompute settings and final norm; only the forward differs
        # (cross-attention context and relative bias handed to every layer).
        super().__init__(
            config, ctx, layer_spec, num_layers=num_layers, layer_offset=layer_offset, post_process=final_norm
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        attention_bias: torch.Tensor | None = None,
        context: torch.Tensor | None = None,
        context_mask: torch.Tensor | None = None,
        inference_context=None,
    ) -> torch.Tensor:
        args = (attention_mask, attention_bias, context, context_mask)
        recompute = self.recompute_method is not None and self.training and torch.is_grad_enabled()
        n, k = len(self.layers), self.recompute_num_layers
        if inference_context is not None or not recompute:
            for layer in self.layers:
                hidden_states = layer(hidden_states, *args, inference_context=inference_context)
        elif self.recompute_method == "uniform":
            for start in range(0, n, k):
                hidden_states = checkpoint(self._run_layers(start, min(start + k, n)), hidden_states, *args)
        else:  # block
            for i, layer in enumerate(self.layers):
                hidden_states = (
                    checkpoint(layer, hidden_states, *args) if i < k else layer(hidden_states, *args)
                )
        if self.final_layernorm is not None:
            hidden_states = self.final_layernorm(hidden_states)
            if self.fp32_residual:
                hidden_states = hidden_states.to(self.params_dtype)
        return hidden_states

    def _run_layers(self, start: int, end: int):
        def run(hidden_states, *args):
            for layer in self.layers[start:end]:
                hidden_states = layer(hidden_states, *args)
            return hidden_states

        return run


__all__ = [
    "T5Block",
    "T5CoreAttention",
    "T5Layer",
    "T5LayerSubmodules",
    "t5_decoder_layer_spec",
    "t5_encoder_layer_spec",
]
