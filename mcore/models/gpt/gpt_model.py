"""The GPT model (GPT-2/3 and Llama-style), buildable as a whole or as one pipeline-stage chunk.

Parameter names (Megatron-core's local-spec ``GPTModel`` names)::

    embedding.word_embeddings.weight                    [Vp/p, h]         vocab rows (first stage)
    embedding.position_embeddings.weight                [max_pos, h]      replicated (learned_absolute)
    decoder.layers.{i}.input_layernorm.weight / .bias   [h]               replicated (RMSNorm: no bias)
    decoder.layers.{i}.self_attention.linear_qkv.weight [(n+2g)d/p, h]    column, per-group packed
    decoder.layers.{i}.self_attention.linear_qkv.bias   [(n+2g)d/p]       with bias or --add-qkv-bias
    decoder.layers.{i}.self_attention.linear_proj.weight [h, nd/p]        row
    decoder.layers.{i}.self_attention.linear_proj.bias  [h]               replicated
    decoder.layers.{i}.pre_mlp_layernorm.weight / .bias [h]               replicated
    decoder.layers.{i}.mlp.linear_fc1.weight / .bias    [F/p, h] / [2F/p, h] column; SwiGLU [gate_t; up_t]
    decoder.layers.{i}.mlp.linear_fc2.weight            [h, F/p]          row
    decoder.layers.{i}.mlp.linear_fc2.bias              [h]               replicated
    decoder.final_layernorm.weight / .bias              [h]               replicated (last stage)
    output_layer.weight                                 [Vp/p, h]         vocab rows (untied, or the
                                                                          tied copy on a last stage)

``{i}`` in ``state_dict()``/``named_parameters()`` is local to the chunk; the logical names in
:meth:`GPTModel.sharded_parameters` use global layer numbers (``layer_offset + i``).

Pipeline stages. A stage chunk is ``GPTModel(..., pre_process=<first>, post_process=<last>,
layer_offset=<global index of its first layer>, num_layers=<layers in it>)``. The first chunk
embeds tokens; the others get their input through :meth:`GPTModel.set_input_tensor` (Megatron's
contract: the schedule calls it before ``forward``). Non-last chunks return hidden states
``[s, b, h]`` (``[s/p, b, h]`` with sequence parallelism) to send on.

Tied embeddings (default; ``--untie-embeddings-and-output-weights`` unties). With the whole model on
one stage the output layer multiplies by ``embedding.word_embeddings.weight``; there is no
``output_layer.weight``. When the last stage is not the first, it keeps its own
``output_layer.weight``, a copy of the word embedding: it has the same logical name
(``embedding.word_embeddings.weight``, ``ShardSpec.tied_copy=True``) and therefore the same initial
values, drawn from the same seed (Megatron instead zero-fills it and all-reduces from the first
stage). Both copies stay equal if their gradients are summed over ``groups.embedding`` before the
optimizer step, which the pipeline schedule does with :meth:`GPTModel.shared_embedding_or_output_weight`
(the word embedding on the first stage, the copy on the last), as Megatron does.
"""

from __future__ import annotations

import torch

from mcore.config.fields import check
from mcore.data.token_ids import TokenIdRange
from mcore.distributed.groups import ProcessGroups
from mcore.fp8.config import Fp8Config
from mcore.models.transformer.attention import CoreAttention, SelfAttention, SelfAttentionSubmodules
from mcore.models.transformer.block import TransformerBlock
from mcore.models.transformer.embeddings import LanguageModelEmbedding
from mcore.models.transformer.language_module import (
    LanguageModule,
    chunk_layer_count,
    mark_tied_output_copy,
    vocab_output_layer,
)
from mcore.models.transformer.layer import TransformerLayer, TransformerLayerSubmodules
from mcore.models.transformer.mla.attention import rotary_embedding_for, self_attention_or_mla
from mcore.models.transformer.mlp import MLP, MLPSubmodules
from mcore.models.transformer.model_config import ModelConfig
from mcore.models.transformer.moe.moe_layer import mlp_or_moe
from mcore.models.transformer.mtp.block import MultiTokenPredictionBlock
from mcore.models.transformer.norms import Norm
from mcore.models.transformer.spec import ModuleSpec
from mcore.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from mcore.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from mcore.tensor_parallel.output_loss import output_layer_cross_entropy


def gpt_layer_spec() -> ModuleSpec:
    """The GPT transformer layer: norm, self-attention (QKV, core attention, proj; multi-latent
    attention with ``--multi-latent-attention``:
    :func:`~mcore.models.transformer.mla.attention.self_attention_or_mla`), norm, MLP (an
    MoE layer where ``--num-experts`` and ``--moe-layer-freq`` put one:
    :func:`~mcore.models.transformer.moe.moe_layer.mlp_or_moe`)."""
    return ModuleSpec(
        TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=ModuleSpec(Norm),
            self_attention=ModuleSpec(
                self_attention_or_mla,
                params={
                    "standard": ModuleSpec(
                        SelfAttention,
                        submodules=SelfAttentionSubmodules(
                            linear_qkv=ColumnParallelLinear,
                            core_attention=CoreAttention,
                            linear_proj=RowParallelLinear,
                        ),
                    )
                },
            ),
            pre_mlp_layernorm=ModuleSpec(Norm),
            mlp=ModuleSpec(
                mlp_or_moe,
                params={
                    "dense": ModuleSpec(
                        MLP,
                        submodules=MLPSubmodules(
                            linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear
                        ),
                    )
                },
            ),
        ),
    )


class GPTModel(LanguageModule):
    """A decoder-only transformer language model, or one pipeline chunk of it.

    The sharding, sequence-parallel and tied-embedding methods (:meth:`sharded_parameters`,
    :meth:`sequence_parallel_parameters`, :meth:`all_reduce_sequence_parallel_grads`,
    :meth:`shared_embedding_or_output_weight`, :meth:`set_input_tensor`) come from
    :class:`~mcore.models.transformer.language_module.LanguageModule`.

    Args:
        config: the model flags.
        groups: process groups; the model uses ``groups.tp`` (and the TP size and rank).
        vocab_size: the *padded* vocabulary size, from
            :func:`mcore.models.transformer.model_config.padded_vocab_size` (a multiple of the TP size).
        pre_process: this chunk embeds tokens (the first pipeline stage).
        post_process: this chunk has the final norm and output layer (the last stage).
        layer_offset: global index of this chunk's first layer.
        num_layers: layers in this chunk (default: ``config.num_layers - layer_offset``).
        sequence_parallel: split activations along the sequence outside TP regions
            (``--sequence-parallel``; needs TP > 1).
        params_dtype: parameter dtype (fp32; bf16/fp16 for mixed precision).
        device: where to create the parameters (default: ``groups.device``, this rank's device).
        seed: initialization seed (``--seed``); weights depend only on it, not on the layout.
        layer_spec: the transformer-layer spec (default :func:`gpt_layer_spec`).
        fp8: the FP8 flags (``--fp8-format`` ...): the transformer layers' linears run in FP8
            (:mod:`mcore.fp8.linear`); the backend must have the ``fp8`` capability.
        cp_comm_type: ``--cp-comm-type`` when ``groups`` has context parallelism: the chunk then takes
            each sequence's zigzag-local tokens and ``position_ids`` (their global positions).

    Raises:
        ConfigError: the model does not split over TP (messages name the values).
    """

    def __init__(
        self,
        config: ModelConfig,
        groups: ProcessGroups,
        vocab_size: int,
        *,
        pre_process: bool = True,
        post_process: bool = True,
        layer_offset: int = 0,
        num_layers: int | None = None,
        sequence_parallel: bool = False,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
        seed: int = 1234,
        layer_spec: ModuleSpec | None = None,
        fp8: Fp8Config | None = None,
        cp_comm_type: str = "p2p",
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
            fp8=fp8,
            cp_comm_type=cp_comm_type,
        )
        check(
            config.position_embedding_type != "relative",
            "position_embedding_type='relative' is T5's relative position bias: GPT takes "
            "learned_absolute, rope, alibi or none",
        )
        self.layer_offset = layer_offset
        self.num_layers = chunk_layer_count(layer_offset, num_layers, config.num_layers)

        if pre_process:
            self.embedding = LanguageModelEmbedding(config, self.ctx, vocab_size)
        if config.position_embedding_type == "rope":
            self.rotary_pos_emb = rotary_embedding_for(config)  # MLA: its d_r channels, YaRN
        self.decoder = TransformerBlock(
            config,
            self.ctx,
            layer_spec or gpt_layer_spec(),
            num_layers=self.num_layers,
            layer_offset=layer_offset,
            post_process=post_process,
        )
        if post_process:
            self.output_layer = vocab_output_layer(
                config, self.ctx, vocab_size, bias=False, pre_process=pre_process
            )
            # The labels' vocabulary check (the inputs' is the embedding's): a label appears in no
            # input when it is a sample's last token. -100 is the loss's ignore index.
            self.token_id_range = TokenIdRange(vocab_size, "label", ignore_index=-100)
        self.mtp = None
        if config.mtp_num_layers:
            self._build_mtp(vocab_size, layer_spec or gpt_layer_spec())
        self._finish_build(seed)

    def _build_mtp(self, vocab_size: int, layer_spec: ModuleSpec) -> None:
        """Multi-token prediction (:mod:`mcore.models.transformer.mtp.block`) on the last stage, with the
        word embedding it shares: on a last stage that is not the first, a copy of the table (the tied
        output weight itself, or with untied weights a copy whose gradient is summed with the first
        stage's over ``groups.embedding``, as the tied output copy's is)."""
        untied = not self.config.share_embeddings_and_output_weights
        if self.pre_process and not self.post_process and untied:
            self.embedding.word_embeddings.weight.shared_embedding = True  # the MTP copy's original
        if not self.post_process:
            return
        if not self.pre_process:
            self.embedding = LanguageModelEmbedding(self.config, self.ctx, vocab_size)
            if untied:
                mark_tied_output_copy(self.embedding.word_embeddings.weight)
            else:  # the output layer's weight is the table's copy already: look up in it
                self.embedding.word_embeddings.weight = self.output_layer.weight
        self.mtp = MultiTokenPredictionBlock(self.config, self.ctx, layer_spec)

    def _mtp(self, hidden_states, tokens, labels, loss_mask, attention_mask, rotary_freqs, weight):
        """The MTP depths' losses joined to ``hidden_states``' backward (ignored by generation/export)."""
        if tokens is None:
            raise ValueError(
                "--mtp-num-layers: the last pipeline stage needs the input tokens (pass tokens=)"
            )
        return self.mtp(
            hidden_states,
            tokens,
            labels,
            loss_mask,
            lambda ids: self.embedding(ids),
            lambda h: self.output_layer(h, weight=weight)[0],
            attention_mask,
            rotary_freqs,
        )

    def _layer_offsets(self) -> dict[str, int]:
        return {"decoder": self.layer_offset}

    def forward(
        self,
        tokens: torch.Tensor | None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        label_smoothing: float = 0.0,
        inference_context=None,
        loss_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run this chunk.

        Args:
            tokens: ``[b, s]`` int64 ids (used on the first chunk only).
            position_ids: ``[b, s]`` positions (default ``0..s-1``), for learned positions and RoPE.
                (Megatron's GPTModel ignores them for RoPE; here RoPE follows them, as Hugging Face
                does, which matters only with ``--reset-position-ids`` or a KV cache.)
            attention_mask: optional bool ``[b, 1, s, s]``, True = masked, applied on top of the
                causal mask (e.g. to separate documents).
            labels: ``[b, s]`` target ids (on the last chunk).
            label_smoothing: label smoothing of the loss.
            inference_context: a key/value cache for generation (``update_kv(layer_number, key,
                value)``, e.g. :class:`mcore.inference.kv_cache.KVCache`): each layer appends this
                call's keys and values and attends over all of them. Give ``position_ids`` (the
                tokens' absolute positions) with it.
            loss_mask: ``[b, s]`` (last chunk, with ``--mtp-num-layers``): the positions the
                multi-token-prediction losses count (shifted per depth); None: all.

        Returns:
            last chunk with labels: per-token fp32 loss ``[b, s]``;
            last chunk without labels: this rank's vocabulary slice of the logits ``[b, s, Vp/p]``;
            other chunks: hidden states ``[s, b, h]`` (``[s/p, b, h]`` with sequence parallelism).
        """
        if position_ids is None and self.ctx.cp_size > 1:
            # each CP rank holds the zigzag chunks of the sequence: 0..s-1 would be the wrong positions
            raise ValueError(
                "with context parallelism the model needs position_ids (the tokens' global positions)"
            )
        hidden_states = self.embedding(tokens, position_ids) if self.pre_process else self._received_input()

        rotary_freqs = None
        if self.config.position_embedding_type == "rope":
            seq_len = self._full_sequence_length(hidden_states)
            rotary_freqs = self.rotary_pos_emb(seq_len, position_ids, device=hidden_states.device)

        hidden_states = self.decoder(
            hidden_states, attention_mask, rotary_freqs, inference_context=inference_context
        )
        if not self.post_process:
            return hidden_states

        weight = self.output_weight()
        if self.mtp is not None and labels is not None and inference_context is None and self.training:
            hidden_states = self._mtp(
                hidden_states, tokens, labels, loss_mask, attention_mask, rotary_freqs, weight
            )
        if labels is not None:
            labels = self.token_id_range.observe(labels)
        if labels is not None and self.config.output_layer_loss_chunks > 0:
            loss = output_layer_cross_entropy(  # the logits only ever exist one chunk at a time
                self.output_layer,
                hidden_states,
                labels.transpose(0, 1).contiguous(),
                num_chunks=self.config.output_layer_loss_chunks,
                weight=weight,
                label_smoothing=label_smoothing,
            )  # [s, b]
            return loss.transpose(0, 1).contiguous()
        logits, _ = self.output_layer(hidden_states, weight=weight)  # [s, b, Vp/p]
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        loss = vocab_parallel_cross_entropy(
            logits,
            labels.transpose(0, 1).contiguous(),
            self.groups.tp,
            label_smoothing,
            overwrite_logits=self.config.cross_entropy_loss_fusion,
        )  # [s, b]
        return loss.transpose(0, 1).contiguous()
