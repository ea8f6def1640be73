"""T5: a transformer encoder and a decoder with cross-attention, buildable whole or as pipeline chunks.

Two variants, chosen by flags (both megatron-core's ``T5Model`` structure and parameter names):

* Megatron's T5 (the defaults): learned absolute positions (one table shared by the encoder and the
  decoder inputs), LayerNorm, GeLU, biases, the output layer tied to the word embeddings plus an
  output bias ``lm_head.output_layer.bias``; attention scores scaled by ``1/sqrt(d)``.
* Hugging Face T5 v1.1 / mT5: ``--position-embedding-type relative`` (T5's bucketed relative
  position bias, ``--relative-attention-num-buckets``/``--relative-attention-max-distance``; one
  bias table for the encoder (bidirectional buckets) and one for the decoder's self-attention
  (causal buckets), computed once per forward and added in every layer, as Hugging Face's first
  layer computes it and the others reuse it; cross-attention has none), ``--normalization RMSNorm``,
  ``--disable-bias-linear``, ``--geglu --openai-gelu`` (gated ``gelu_new``),
  ``--untie-embeddings-and-output-weights``. With relative positions the attention scores are NOT
  scaled (``Q K^T``, as Hugging Face T5, which folds ``1/sqrt(d)`` into the query initialization).

Data flow (``[s, b, h]`` inside; ``[s/p, b, h]`` with sequence parallelism)::

    enc = encoder(embed(encoder_input_ids) [+ positions], enc_mask [, encoder relative bias])
    dec = decoder(embed(decoder_input_ids) [+ positions], dec_mask (and causal) [, decoder bias],
                  cross-attention over enc with enc_dec_mask)
    logits = dec @ word_embeddings^T + lm bias     (tied)  |  dec @ lm_head.output_layer.weight^T

Masks are bool, True = masked (megatron-core's local-spec convention, as its ``pretrain_t5.py``
passes ``mask < 0.5``): ``encoder_attn_mask`` broadcastable to ``[b, 1, s_e, s_e]``,
``decoder_attn_mask`` to ``[b, 1, s_d, s_d]`` (applied on top of the causal mask),
``encoder_decoder_attn_mask`` to ``[b, 1, s_d, s_e]``; None masks nothing.

Parameter names (megatron-core's local-spec ``T5Model``)::

    embedding.word_embeddings.weight                     [Vp/p, h]   vocab rows (pre_process)
    embedding.position_embeddings.weight                 [max_pos, h] learned_absolute only
    encoder_relative_pos_emb.relative_attention_bias.weight [buckets, n]  relative; replicated
    decoder_relative_pos_emb.relative_attention_bias.weight [buckets, n]  relative; replicated
    encoder.layers.{i}.input_layernorm / self_attention.linear_qkv / .linear_proj
                      / pre_mlp_layernorm / mlp.linear_fc1 / mlp.linear_fc2   (as GPT's layers)
    encoder.final_layernorm                              (chunk with the last encoder layer)
    decoder.layers.{i}.input_layernorm / self_attention.* (causal)
                      / pre_cross_attn_layernorm
                      / cross_attention.linear_q [n d, h] / .linear_kv [2 n d, h] / .linear_proj
                      / pre_mlp_layernorm / mlp.*
    decoder.final_layernorm                              (chunk with the last decoder layer)
    lm_head.output_layer.weight                          [Vp/p, h]   untied, or the tied copy on a
                                                                     post_process chunk without embedding
    lm_head.output_layer.bias                            [Vp/p]      tied only (megatron-core's T5LMHead)

Pipeline chunks: ``add_encoder``/``add_decoder`` say which stack the chunk holds,
``encoder_layer_offset``/``encoder_num_layers`` and the decoder's pair which of its layers;
``pre_process`` embeds the tokens (of the encoder, or of the decoder on its first chunk);
``post_process`` has the output layer. :meth:`T5Model.set_input_tensor` follows megatron-core: a chunk
with the encoder takes the encoder's input hidden states; a decoder-only chunk takes
``[decoder hidden states, encoder output]`` (or ``[encoder output]`` when it embeds the decoder tokens).
With relative positions every chunk of a stack holds that stack's bias table (a copy per chunk,
like the tied embedding: the pipeline must sum their gradients).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Any

import torch

from mcore.config.fields import ConfigError, check
from mcore.distributed.groups import ProcessGroups
from mcore.models.attention import CoreAttention, SelfAttention, SelfAttentionSubmodules
from mcore.models.config import ModelConfig, check_tensor_parallel
from mcore.models.context import BuildContext
from mcore.models.cross_attention import CrossAttention, CrossAttentionSubmodules
from mcore.models.embeddings import LanguageModelEmbedding
from mcore.models.mlp import MLP, MLPSubmodules
from mcore.models.norms import Norm
from mcore.models.spec import ModuleSpec, build_module
from mcore.models.transformer_layer import TransformerLayer, TransformerLayerSubmodules
from mcore.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from mcore.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from mcore.tensor_parallel.mappings import (
    all_reduce_sequence_parallel_grads,
    scatter_to_tensor_model_parallel_region,
)
from mcore.tensor_parallel.recompute import checkpoint
from mcore.tensor_parallel.sharding import (
    NormalInit,
    ParamLayout,
    ShardSpec,
    build_shard_specs,
    init_method_normal,
    initialize_parameters,
    make_parameter,
)

WORD_EMBEDDINGS = "embedding.word_embeddings.weight"
_LOCAL_LAYER = re.compile(r"^(encoder|decoder)\.layers\.(\d+)\.")


# -- relative positions -----------------------------------------------------------------------------


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


# -- layers -----------------------------------------------------------------------------------------


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


def t5_encoder_layer_spec(config: ModelConfig) -> ModuleSpec:
    """Encoder layer: norm, bidirectional self-attention (padding mask), norm, MLP."""
    unscaled = config.position_embedding_type == "relative"
    return ModuleSpec(
        T5Layer,
        submodules=T5LayerSubmodules(
            input_layernorm=ModuleSpec(Norm),
            self_attention=ModuleSpec(
                SelfAttention,
                submodules=SelfAttentionSubmodules(
                    linear_qkv=ColumnParallelLinear,
                    core_attention=ModuleSpec(
                        T5CoreAttention, params={"causal": False, "unscaled": unscaled}
                    ),
                    linear_proj=RowParallelLinear,
                ),
            ),
            pre_mlp_layernorm=ModuleSpec(Norm),
            mlp=ModuleSpec(
                MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
            ),
        ),
    )


def t5_decoder_layer_spec(config: ModelConfig) -> ModuleSpec:
    """Decoder layer: norm, causal self-attention, norm, cross-attention to the encoder, norm, MLP."""
    unscaled = config.position_embedding_type == "relative"
    return ModuleSpec(
        T5Layer,
        submodules=T5LayerSubmodules(
            input_layernorm=ModuleSpec(Norm),
            self_attention=ModuleSpec(
                SelfAttention,
                submodules=SelfAttentionSubmodules(
                    linear_qkv=ColumnParallelLinear,
                    core_attention=ModuleSpec(T5CoreAttention, params={"causal": True, "unscaled": unscaled}),
                    linear_proj=RowParallelLinear,
                ),
            ),
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
            mlp=ModuleSpec(
                MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
            ),
        ),
    )


class T5Layer(TransformerLayer):
    """Pre-norm layer: self-attention, [cross-attention,] MLP, each ``x = x + dropout(part(norm(x)))``.

    Recomputation options act as in :class:`~mcore.models.transformer_layer.TransformerLayer`
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
        recompute = self.training and inference_context is None and torch.is_grad_enabled()
        recompute_norm = recompute and self.recompute_layernorm

        normed, residual = self._norm_and_residual(self.input_layernorm, hidden_states, recompute_norm)
        with self._recompute_norm_when_saved(recompute_norm, normed, self.input_layernorm, hidden_states):
            out, bias = self.self_attention(
                normed,
                attention_mask,
                None,
                inference_context=inference_context,
                attention_bias=attention_bias,
            )
        del normed
        hidden_states = self._bias_dropout_add(out, bias, residual)

        if self.cross_attention is not None:
            norm = self.pre_cross_attn_layernorm
            normed, residual = self._norm_and_residual(norm, hidden_states, recompute_norm)
            with self._recompute_norm_when_saved(recompute_norm, normed, norm, hidden_states):
                out, bias = self.cross_attention(
                    normed, context, context_mask, inference_context=inference_context
                )
            del normed
            hidden_states = self._bias_dropout_add(out, bias, residual)

        normed, residual = self._norm_and_residual(self.pre_mlp_layernorm, hidden_states, recompute_norm)
        with self._recompute_norm_when_saved(recompute_norm, normed, self.pre_mlp_layernorm, hidden_states):
            if recompute and self.recompute_mlp:
                out, bias = checkpoint(self._mlp_with_bias, normed), None
            else:
                out, bias = self.mlp(normed)
        del normed
        return self._bias_dropout_add(out, bias, residual)


class T5Block(torch.nn.Module):
    """Consecutive encoder or decoder layers (``layers.{i}``) and, on the stack's last chunk, its final norm.

    ``--recompute-granularity full`` checkpoints chunks of ``--recompute-num-layers`` layers
    (``uniform``) or the first that many layers (``block``), as
    :class:`~mcore.models.transformer_layer.TransformerBlock`.
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
        super().__init__()
        self.recompute_method = config.recompute_method if config.recompute_granularity == "full" else None
        self.recompute_num_layers = config.recompute_num_layers
        self.fp32_residual = config.fp32_residual_connection
        self.params_dtype = ctx.params_dtype
        self.layers = torch.nn.ModuleList(
            build_module(layer_spec, config, ctx, layer_number=layer_offset + i + 1)
            for i in range(num_layers)
        )
        self.final_layernorm = Norm(config, ctx) if final_norm else None

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


# -- the model --------------------------------------------------------------------------------------


class T5Model(torch.nn.Module):
    """An encoder-decoder transformer language model (T5), or one pipeline chunk of it.

    Args:
        config: the model flags (``--encoder-num-layers``, ``--decoder-num-layers``, ...).
        groups: process groups; the model uses ``groups.tp``.
        vocab_size: the padded vocabulary size (:func:`mcore.models.config.padded_vocab_size`).
        pre_process: this chunk embeds tokens.
        post_process: this chunk has the output layer (and the loss).
        add_encoder, add_decoder: this chunk holds (part of) the encoder / decoder.
        encoder_layer_offset, encoder_num_layers: the encoder layers of this chunk (default: from
            the offset to ``config.encoder_num_layers``); the decoder's likewise.
        sequence_parallel, params_dtype, device, seed: as :class:`mcore.models.gpt.GPTModel`.

    Raises:
        ConfigError: the model does not split over TP, or a chunk's layers are out of range.
    """

    def __init__(
        self,
        config: ModelConfig,
        groups: ProcessGroups,
        vocab_size: int,
        *,
        pre_process: bool = True,
        post_process: bool = True,
        add_encoder: bool = True,
        add_decoder: bool = True,
        encoder_layer_offset: int = 0,
        encoder_num_layers: int | None = None,
        decoder_layer_offset: int = 0,
        decoder_num_layers: int | None = None,
        sequence_parallel: bool = False,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
        seed: int = 1234,
    ):
        super().__init__()
        tp = groups.tp_size
        check_tensor_parallel(config, tp, sequence_parallel)
        check(
            vocab_size % tp == 0,
            f"padded vocab_size={vocab_size} is not divisible by tensor_model_parallel_size={tp}; "
            "compute it with padded_vocab_size()",
        )
        check(add_encoder or add_decoder, "a T5 chunk needs add_encoder or add_decoder")
        check(
            config.position_embedding_type in ("learned_absolute", "relative"),
            f"position_embedding_type={config.position_embedding_type!r}: T5 takes learned_absolute "
            "(Megatron's T5) or relative (Hugging Face T5)",
        )
        if sequence_parallel and config.decoder_seq_length is not None:
            check(
                config.decoder_seq_length % tp == 0,
                f"decoder_seq_length={config.decoder_seq_length} is not divisible by "
                f"tensor_model_parallel_size={tp} (sequence parallelism splits the sequence)",
            )
        encoder_num_layers = self._chunk_layers(
            "encoder", config.encoder_num_layers, encoder_layer_offset, encoder_num_layers
        )
        decoder_num_layers = self._chunk_layers(
            "decoder", config.decoder_num_layers, decoder_layer_offset, decoder_num_layers
        )
        self.config = config
        self.groups = groups
        self.vocab_size = vocab_size
        self.pre_process, self.post_process = pre_process, post_process
        self.add_encoder, self.add_decoder = add_encoder, add_decoder
        self.encoder_layer_offset, self.decoder_layer_offset = encoder_layer_offset, decoder_layer_offset
        self.sequence_parallel = sequence_parallel
        self.share_embeddings_and_output_weights = config.share_embeddings_and_output_weights
        self.relative = config.position_embedding_type == "relative"
        self.ctx = BuildContext(
            tp_group=groups.tp,
            tp_size=tp,
            tp_rank=groups.tp_rank,
            sequence_parallel=sequence_parallel,
            params_dtype=params_dtype,
            device=device if device is not None else groups.device,
            num_layers=config.num_layers,
        )
        self.input_tensor: torch.Tensor | None = None
        self.encoder_hidden_state: torch.Tensor | None = None

        if pre_process:
            self.embedding = LanguageModelEmbedding(config, self.ctx, vocab_size)
        if self.relative and add_encoder:
            self.encoder_relative_pos_emb = RelativePositionEmbedding(config, self.ctx, bidirectional=True)
        if self.relative and add_decoder:
            self.decoder_relative_pos_emb = RelativePositionEmbedding(config, self.ctx, bidirectional=False)
        self.encoder = None
        if add_encoder:
            self.encoder = T5Block(
                config,
                self.ctx,
                t5_encoder_layer_spec(config),
                num_layers=encoder_num_layers,
                layer_offset=encoder_layer_offset,
                final_norm=encoder_layer_offset + encoder_num_layers == config.encoder_num_layers,
            )
        self.decoder = None
        if add_decoder:
            self.decoder = T5Block(
                config,
                self.ctx,
                t5_decoder_layer_spec(config),
                num_layers=decoder_num_layers,
                layer_offset=decoder_layer_offset,
                final_norm=decoder_layer_offset + decoder_num_layers == config.decoder_num_layers,
            )
        if post_process:
            check(add_decoder, "post_process (the output layer) needs add_decoder")
            self.lm_head = T5LMHead(config, self.ctx, vocab_size, pre_process)
        if pre_process and self.share_embeddings_and_output_weights:
            self.embedding.word_embeddings.weight.shared_embedding = True

        self._shard_specs = build_shard_specs(self, groups.tp_rank, tp, self._logical_name)
        initialize_parameters(self, self._shard_specs, seed)

    @staticmethod
    def _chunk_layers(stack: str, total: int, offset: int, count: int | None) -> int:
        count = total - offset if count is None else count
        if not (0 <= offset and count >= 0 and offset + count <= total):
            raise ConfigError(
                f"{stack} layers [{offset}, {offset + count}) of this chunk are outside "
                f"{stack}_num_layers={total}"
            )
        return count

    # -- naming and sharding ------------------------------------------------------------------------

    def _logical_name(self, local_name: str) -> str:
        def shift(m: re.Match) -> str:
            offset = self.encoder_layer_offset if m.group(1) == "encoder" else self.decoder_layer_offset
            return f"{m.group(1)}.layers.{int(m.group(2)) + offset}."

        return _LOCAL_LAYER.sub(shift, local_name)

    def sharded_parameters(self) -> dict[str, ShardSpec]:
        """For every parameter (key: its ``named_parameters()`` name), its logical name (global layer
        numbers; a tied output copy maps to ``embedding.word_embeddings.weight``), shape and TP split:
        see :meth:`mcore.models.gpt.GPTModel.sharded_parameters`."""
        return dict(self._shard_specs)

    def sequence_parallel_parameters(self) -> list[torch.nn.Parameter]:
        """Parameters whose gradients must be summed over TP with sequence parallelism (norms, row biases)."""
        params = dict(self.named_parameters())
        return [params[name] for name, spec in self._shard_specs.items() if spec.sequence_parallel]

    def all_reduce_sequence_parallel_grads(self) -> None:
        """Sum the sequence-parallel parameters' gradients over TP (call after backward; no-op without SP)."""
        if self.sequence_parallel:
            all_reduce_sequence_parallel_grads(self.sequence_parallel_parameters(), self.groups.tp)

    def shared_embedding_or_output_weight(self) -> torch.nn.Parameter | None:
        """The tied word-embedding weight this chunk holds (the table with ``pre_process``, else the
        output copy on a ``post_process`` chunk); None when untied or when the chunk has neither."""
        if not self.share_embeddings_and_output_weights:
            return None
        if self.pre_process:
            return self.embedding.word_embeddings.weight
        if self.post_process:
            return self.lm_head.output_layer.weight
        return None

    # -- forward ------------------------------------------------------------------------------------

    def set_input_tensor(self, input_tensor: torch.Tensor | list[torch.Tensor] | None) -> None:
        """What a chunk gets from the previous pipeline stage (megatron-core's T5 contract).

        With the encoder: its input hidden states (one tensor). Decoder only: ``[decoder hidden
        states, encoder output]``, or ``[encoder output]`` on the chunk that embeds the decoder tokens.
        """
        tensors = list(input_tensor) if isinstance(input_tensor, (list, tuple)) else [input_tensor]
        if self.add_encoder:
            if len(tensors) != 1:
                raise ValueError(f"a T5 chunk with the encoder takes one input tensor, got {len(tensors)}")
            self.input_tensor = tensors[0]
        elif len(tensors) == 2:
            self.input_tensor, self.encoder_hidden_state = tensors
        elif len(tensors) == 1:
            self.input_tensor, self.encoder_hidden_state = None, tensors[0]
        else:
            raise ValueError(f"a decoder-only T5 chunk takes 1 or 2 input tensors, got {len(tensors)}")

    def _stage_input(self, ids: torch.Tensor | None, stack: str, position_offset: int = 0) -> torch.Tensor:
        """The embedded ``ids`` (pre_process), else the hidden states from the previous stage."""
        if self.pre_process:
            positions = None
            if not self.relative and position_offset:
                positions = torch.arange(position_offset, position_offset + ids.shape[1], device=ids.device)[
                    None
                ]
            return self.embedding(ids, positions)
        # a chunk with both stacks passes its input tensor to the encoder; its decoder has nothing to start from
        if self.input_tensor is None or (stack == "decoder" and self.add_encoder):
            raise RuntimeError(
                f"the T5 {stack} of a chunk without pre_process needs its input from set_input_tensor()"
            )
        return self.input_tensor

    def _full_length(self, hidden_states: torch.Tensor) -> int:
        return hidden_states.shape[0] * (self.ctx.tp_size if self.sequence_parallel else 1)

    def encode(self, encoder_input_ids: torch.Tensor | None, encoder_attn_mask=None) -> torch.Tensor:
        """Encoder output ``[s_e, b, h]`` (``[s_e/p, b, h]`` with SP) of this chunk's encoder layers."""
        hidden_states = self._stage_input(encoder_input_ids, "encoder")
        bias = None
        if self.relative:
            s = self._full_length(hidden_states)
            bias = self.encoder_relative_pos_emb(s, s)
        return self.encoder(hidden_states, encoder_attn_mask, bias)

    def decode(
        self,
        decoder_input_ids: torch.Tensor | None,
        encoder_hidden_states: torch.Tensor | None,
        decoder_attn_mask=None,
        encoder_decoder_attn_mask=None,
        inference_context=None,
    ) -> torch.Tensor:
        """Decoder hidden states ``[s_d, b, h]`` of this chunk's decoder layers.

        With ``inference_context`` (an :class:`~mcore.inference.kv_cache.EncoderDecoderCache`) the
        decoder tokens continue the cached ones: positions start at the cached length, and the
        cross-attention keys and values come from the cache after the first step.
        """
        offset = inference_context.length if inference_context is not None else 0
        hidden_states = self._stage_input(decoder_input_ids, "decoder", offset)
        bias = None
        if self.relative:
            s = self._full_length(hidden_states)
            bias = self.decoder_relative_pos_emb(s, offset + s, query_offset=offset)
        return self.decoder(
            hidden_states,
            decoder_attn_mask,
            bias,
            encoder_hidden_states,
            encoder_decoder_attn_mask,
            inference_context=inference_context,
        )

    def forward(
        self,
        encoder_input_ids: torch.Tensor | None,
        decoder_input_ids: torch.Tensor | None,
        encoder_attn_mask: torch.Tensor | None = None,
        decoder_attn_mask: torch.Tensor | None = None,
        encoder_decoder_attn_mask: torch.Tensor | None = None,
        lm_labels: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        output_encoder_hidden_only: bool = False,
        inference_context=None,
    ) -> torch.Tensor:
        """Run this chunk.

        Args:
            encoder_input_ids: ``[b, s_e]`` (used when this chunk embeds and runs the encoder).
            decoder_input_ids: ``[b, s_d]`` (used when this chunk embeds the decoder tokens).
            encoder_attn_mask, decoder_attn_mask, encoder_decoder_attn_mask: bool masks, True =
                masked (module docstring).
            lm_labels: ``[b, s_d]`` target ids (post_process chunk).
            encoder_hidden_states: the encoder output ``[s_e, b, h]``; given, the encoder is skipped.
            output_encoder_hidden_only: return the encoder output even if the chunk has the decoder.
            inference_context: a decoder key/value cache (generation), see :meth:`decode`.

        Returns:
            post_process with lm_labels: per-token fp32 loss ``[b, s_d]``;
            post_process without: this rank's vocabulary slice of the logits ``[b, s_d, Vp/p]``;
            an encoder-only chunk (or ``output_encoder_hidden_only``): the encoder output ``[s_e, b, h]``;
            other decoder chunks: decoder hidden states ``[s_d, b, h]``
            (``[s/p, b, h]`` with sequence parallelism).
        """
        if encoder_hidden_states is None:
            if self.add_encoder:
                encoder_hidden_states = self.encode(encoder_input_ids, encoder_attn_mask)
            else:
                encoder_hidden_states = self.encoder_hidden_state
        if not self.add_decoder or output_encoder_hidden_only:
            return encoder_hidden_states
        hidden_states = self.decode(
            decoder_input_ids,
            encoder_hidden_states,
            decoder_attn_mask,
            encoder_decoder_attn_mask,
            inference_context,
        )
        if not self.post_process:
            return hidden_states
        return self.lm_head(hidden_states, self._output_weight(), lm_labels)

    def _output_weight(self) -> torch.Tensor | None:
        if self.share_embeddings_and_output_weights and self.pre_process:
            return self.embedding.word_embeddings.weight
        return None


class T5LMHead(torch.nn.Module):
    """The output layer (megatron-core's ``T5LMHead``): ``logits = x W^T (+ b)``, vocab-parallel.

    Tied: ``W`` is the word embedding (passed in; a post_process chunk without the embedding holds a
    copy named ``embedding.word_embeddings.weight``) and there is a bias ``output_layer.bias``
    ``[Vp/p]``; untied: its own ``output_layer.weight`` and no bias.
    """

    def __init__(self, config: ModelConfig, ctx: BuildContext, vocab_size: int, pre_process: bool):
        super().__init__()
        tied = config.share_embeddings_and_output_weights
        self.tp_group = ctx.tp_group
        self.output_layer = ColumnParallelLinear(
            config.hidden_size,
            vocab_size,
            tp_group=ctx.tp_group,
            bias=tied,
            gather_output=False,
            sequence_parallel=ctx.sequence_parallel,
            init_method=init_method_normal(config.init_method_std),
            vocab_padded=True,
            skip_weight_param_allocation=tied and pre_process,
            gradient_accumulation_fusion=config.gradient_accumulation_fusion,
            params_dtype=ctx.params_dtype,
            device=ctx.device,
        )
        if tied:
            bias = self.output_layer.bias
            bias.shard_layout = replace(bias.shard_layout, vocab_padded=True)
        if tied and not pre_process:
            weight = self.output_layer.weight
            weight.shard_layout = replace(weight.shard_layout, logical_name=WORD_EMBEDDINGS)
            weight.shared_embedding = True

    def forward(
        self, hidden_states: torch.Tensor, weight: torch.Tensor | None, labels: torch.Tensor | None
    ) -> torch.Tensor:
        """``[s, b, h]`` -> logits ``[b, s, Vp/p]``, or with ``labels [b, s]`` the fp32 loss ``[b, s]``."""
        logits, _ = self.output_layer(hidden_states, weight=weight)  # [s, b, Vp/p]
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        loss = vocab_parallel_cross_entropy(logits, labels.transpose(0, 1).contiguous(), self.tp_group)
        return loss.transpose(0, 1).contiguous()


__all__ = [
    "RelativePositionEmbedding",
    "T5CoreAttention",
    "T5Layer",
    "T5LMHead",
    "T5Model",
    "relative_position_bucket",
    "t5_decoder_layer_spec",
    "t5_encoder_layer_spec",
]
