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

import torch

from mcore.config.fields import check
from mcore.distributed.groups import ProcessGroups
from mcore.models.t5.relative_position import RelativePositionEmbedding, relative_position_bucket
from mcore.models.t5.t5_layers import (
    T5Block,
    T5CoreAttention,
    T5Layer,
    t5_decoder_layer_spec,
    t5_encoder_layer_spec,
)
from mcore.models.transformer.build_context import BuildContext
from mcore.models.transformer.embeddings import LanguageModelEmbedding
from mcore.models.transformer.language_module import LanguageModule, chunk_layer_count, vocab_output_layer
from mcore.models.transformer.model_config import ModelConfig
from mcore.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

# -- the model --------------------------------------------------------------------------------------


class T5Model(LanguageModule):
    """An encoder-decoder transformer language model (T5), or one pipeline chunk of it.

    Args:
        config: the model flags (``--encoder-num-layers``, ``--decoder-num-layers``, ...).
        groups: process groups; the model uses ``groups.tp``.
        vocab_size: the padded vocabulary size (:func:`mcore.models.transformer.model_config.padded_vocab_size`).
        pre_process: this chunk embeds tokens.
        post_process: this chunk has the output layer (and the loss).
        add_encoder, add_decoder: this chunk holds (part of) the encoder / decoder.
        encoder_layer_offset, encoder_num_layers: the encoder layers of this chunk (default: from
            the offset to ``config.encoder_num_layers``); the decoder's likewise.
        sequence_parallel, params_dtype, device, seed: as :class:`mcore.models.gpt.gpt_model.GPTModel`.

    The sharding, sequence-parallel and tied-embedding methods come from
    :class:`~mcore.models.transformer.language_module.LanguageModule`; :meth:`set_input_tensor` is T5's own
    (a decoder chunk takes two tensors).

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
        super().__init__(
            config,
            groups,
            vocab_size,
            pre_process=pre_process,
            post_process=post_process,
            sequence_parallel=sequence_parallel,
            params_dtype=params_dtype,
            device=device,
        )
        tp = groups.tp_size
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
        encoder_num_layers = chunk_layer_count(
            encoder_layer_offset, encoder_num_layers, config.encoder_num_layers, "encoder"
        )
        decoder_num_layers = chunk_layer_count(
            decoder_layer_offset, decoder_num_layers, config.decoder_num_layers, "decoder"
        )
        self.add_encoder, self.add_decoder = add_encoder, add_decoder
        self.encoder_layer_offset, self.decoder_layer_offset = encoder_layer_offset, decoder_layer_offset
        self.relative = config.position_embedding_type == "relative"
        self.encoder_hidden_state: torch.Tensor | None = None

        if pre_process:
            self.embedding = LanguageModelEmbedding(config, self.ctx, vocab_size)
        if self.relative and add_encoder:
            self.encoder_relative_pos_emb = RelativePositionEmbedding(config, self.ctx, bidirectional=True)
        if self.relative and add_decoder:
            self.decoder_relative_pos_emb = RelativePositionEmbedding(config, self.ctx, bidirectional=False)
        self.encoder = self._stack_chunk(
            add_encoder,
            t5_encoder_layer_spec,
            encoder_layer_offset,
            encoder_num_layers,
            config.encoder_num_layers,
        )
        self.decoder = self._stack_chunk(
            add_decoder,
            t5_decoder_layer_spec,
            decoder_layer_offset,
            decoder_num_layers,
            config.decoder_num_layers,
        )
        if post_process:
            check(add_decoder, "post_process (the output layer) needs add_decoder")
            self.lm_head = T5LMHead(config, self.ctx, vocab_size, pre_process)
        self._finish_build(seed)

    def _stack_chunk(self, add: bool, layer_spec, offset: int, count: int, total: int) -> T5Block | None:
        """Layers ``[offset, offset + count)`` of a stack of ``total`` (None without ``add``); the
        stack's final norm on the chunk with its last layer."""
        if not add:
            return None
        return T5Block(
            self.config,
            self.ctx,
            layer_spec(self.config),
            num_layers=count,
            layer_offset=offset,
            final_norm=offset + count == total,
        )

    def _layer_offsets(self) -> dict[str, int]:
        return {"encoder": self.encoder_layer_offset, "decoder": self.decoder_layer_offset}

    def _output_linear(self) -> torch.nn.Module:
        return self.lm_head.output_layer

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

    def encode(self, encoder_input_ids: torch.Tensor | None, encoder_attn_mask=None) -> torch.Tensor:
        """Encoder output ``[s_e, b, h]`` (``[s_e/p, b, h]`` with SP) of this chunk's encoder layers."""
        hidden_states = self._stage_input(encoder_input_ids, "encoder")
        bias = None
        if self.relative:
            s = self._full_sequence_length(hidden_states)
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
            s = self._full_sequence_length(hidden_states)
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
        return self.lm_head(hidden_states, self.output_weight(), lm_labels)


class T5LMHead(torch.nn.Module):
    """The output layer (megatron-core's ``T5LMHead``): ``logits = x W^T (+ b)``, vocab-parallel.

    Tied: ``W`` is the word embedding (passed in; a post_process chunk without the embedding holds a
    copy named ``embedding.word_embeddings.weight``) and there is a bias ``output_layer.bias``
    ``[Vp/p]``; untied: its own ``output_layer.weight`` and no bias.
    """

    def __init__(self, config: ModelConfig, ctx: BuildContext, vocab_size: int, pre_process: bool):
        super().__init__()
        self.tp_group = ctx.tp_group
        self.output_layer = vocab_output_layer(
            config, ctx, vocab_size, bias=config.share_embeddings_and_output_weights, pre_process=pre_process
        )

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
