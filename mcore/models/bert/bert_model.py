"""Megatron's BERT: a bidirectional encoder with a masked-LM head and a binary (NSP/SOP) head.

Buildable as a whole or as one pipeline-stage chunk, on the same transformer layers as GPT
(:func:`bert_layer_spec`: GPT's pre-LN layer with ``CoreAttention(causal=False)``). Megatron-core's
``BertModel`` with the local layer spec is the reference, and so are its parameter names::

    embedding.word_embeddings.weight                [Vp/p, h]   vocab rows (first stage)
    embedding.position_embeddings.weight            [max_pos, h] replicated (learned_absolute)
    embedding.tokentype_embeddings.weight           [T, h]      replicated (T = num_tokentypes > 0)
    encoder.layers.{i}.*                            GPT's decoder.layers.{i}.* (see mcore.models.gpt.gpt_model)
    encoder.final_layernorm.weight / .bias          [h]         replicated (last stage)
    lm_head.dense.weight / .bias                    [h, h] / [h] replicated
    lm_head.layer_norm.weight / .bias               [h]         replicated
    output_layer.bias                               [Vp/p]      vocab rows
    output_layer.weight                             [Vp/p, h]   only untied, or the tied copy on a
                                                                last stage that is not the first
    pooler.dense.weight / .bias                     [h, h] / [h] replicated (with the binary head)
    binary_head.weight / .bias                      [2, h] / [2] replicated (with the binary head)

The computation (``x`` the embeddings ``[s, b, h]``, pad = ``padding_mask == 0``)::

    e      = dropout(word[ids] + pos[0..s-1] + tokentype[types])
    y      = final_layernorm(layers(e, key mask = pad))          bidirectional; a pad key is masked
                                                                  for every query (HF's [b,1,1,s])
    logits = layer_norm(gelu(y W_d^T + b_d)) E^T + b_out         E tied to the word embeddings
    pooled = tanh(y[0] W_p^T + b_p)                              the first ([CLS]) token
    binary = pooled W_b^T + b_b                                  [b, 2]

Sequence parallelism: the LM head's dense and norm run on the ``[s/p, b, h]`` shards (their gradients
are summed over TP like the layers' norms); the pooler all-gathers the sequence and every TP rank
runs it and the binary head whole (their gradients are complete on every rank).

Loss: with ``lm_labels`` the per-token vocab-parallel cross-entropy ``[b, s]`` (fp32). Positions whose
label is negative (Megatron's BERT dataset writes -1 where nothing is predicted) get loss 0 and no
gradient, at every TP size (Megatron computes a meaningless value there that its loss mask removes).

Token types follow Megatron's ``pretrain_bert.py``: 2 with the binary head, none without
(``--bert-no-binary-head``); ``num_tokentypes`` overrides it.
"""

from __future__ import annotations

import torch

from mcore.config.fields import check
from mcore.distributed.groups import ProcessGroups
from mcore.fp8.config import Fp8Config
from mcore.models.bert.bert_heads import BertLMHead, Pooler, ReplicatedLinear
from mcore.models.transformer.attention import CoreAttention, SelfAttention, SelfAttentionSubmodules
from mcore.models.transformer.block import TransformerBlock
from mcore.models.transformer.embeddings import LanguageModelEmbedding
from mcore.models.transformer.language_module import LanguageModule, chunk_layer_count, vocab_output_layer
from mcore.models.transformer.layer import TransformerLayer, TransformerLayerSubmodules
from mcore.models.transformer.mlp import MLP, MLPSubmodules
from mcore.models.transformer.model_config import ModelConfig
from mcore.models.transformer.norms import Norm
from mcore.models.transformer.positions import RotaryEmbedding
from mcore.models.transformer.spec import ModuleSpec
from mcore.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from mcore.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

BERT_POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope")


def bert_layer_spec() -> ModuleSpec:
    """The BERT encoder layer: GPT's pre-LN layer whose core attention is not causal (padding mask only)."""
    return ModuleSpec(
        TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=ModuleSpec(Norm),
            self_attention=ModuleSpec(
                SelfAttention,
                submodules=SelfAttentionSubmodules(
                    linear_qkv=ColumnParallelLinear,
                    core_attention=ModuleSpec(CoreAttention, params={"causal": False}),
                    linear_proj=RowParallelLinear,
                ),
            ),
            pre_mlp_layernorm=ModuleSpec(Norm),
            mlp=ModuleSpec(
                MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
            ),
        ),
    )


class BertModel(LanguageModule):
    """Megatron's BERT (pre-LN encoder, MLM head, optional binary head), or one pipeline chunk of it.

    Args:
        config: the model flags (``--apply-residual-connection-post-layernorm`` takes each layer's
            residual after its norm, as Megatron does).
        groups: process groups; the model uses ``groups.tp``.
        vocab_size: the *padded* vocabulary size (:func:`mcore.models.transformer.model_config.padded_vocab_size`).
        pre_process, post_process, layer_offset, num_layers, sequence_parallel, params_dtype,
            device, seed: as :class:`mcore.models.gpt.gpt_model.GPTModel`.
        add_binary_head: the pooler and the NSP/SOP head (``--bert-no-binary-head`` removes them).
        num_tokentypes: rows of the token-type table; ``None``: 2 with the binary head, 0 without
            (Megatron's ``pretrain_bert.py``).
        layer_spec: the encoder-layer spec (default :func:`bert_layer_spec`).
        fp8: the FP8 flags: the encoder layers' linears run in FP8 as GPT's do; the LM head, pooler
            and binary head stay in the parameter dtype (megatron-core's are plain linears too).

    The sharding, sequence-parallel and tied-embedding methods and :meth:`set_input_tensor` come from
    :class:`~mcore.models.transformer.language_module.LanguageModule`, as GPT's.

    Raises:
        ConfigError: the model does not split over TP, or a setting BERT does not support.
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
        add_binary_head: bool = True,
        num_tokentypes: int | None = None,
        layer_spec: ModuleSpec | None = None,
        fp8: Fp8Config | None = None,
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
        )
        check(
            config.position_embedding_type in BERT_POSITION_EMBEDDING_TYPES,
            f"--position-embedding-type {config.position_embedding_type}: BERT supports "
            f"{' or '.join(BERT_POSITION_EMBEDDING_TYPES)} (as megatron-core's BertModel)",
        )
        check(
            config.output_layer_loss_chunks == 0,
            f"--output-layer-loss-chunks {config.output_layer_loss_chunks}: BERT's output layer has a "
            "bias, which the chunked output-layer loss does not support; leave it at 0",
        )
        self.layer_offset = layer_offset
        self.num_layers = chunk_layer_count(layer_offset, num_layers, config.num_layers)
        if num_tokentypes is None:
            num_tokentypes = 2 if add_binary_head else 0
        check(num_tokentypes >= 0, f"num_tokentypes={num_tokentypes} must be >= 0")
        self.add_binary_head = add_binary_head
        self.num_tokentypes = num_tokentypes

        if pre_process:
            self.embedding = LanguageModelEmbedding(config, self.ctx, vocab_size, num_tokentypes)
        if config.position_embedding_type == "rope":
            self.rotary_pos_emb = RotaryEmbedding(config.rotary_dim, config.rotary_base)
        self.encoder = TransformerBlock(
            config,
            self.ctx,
            layer_spec or bert_layer_spec(),
            num_layers=self.num_layers,
            layer_offset=layer_offset,
            post_process=post_process,
        )
        if post_process:
            self.lm_head = BertLMHead(config, self.ctx)
            self.output_layer = vocab_output_layer(
                config, self.ctx, vocab_size, bias=True, pre_process=pre_process
            )
            if add_binary_head:
                self.pooler = Pooler(config, self.ctx)
                self.binary_head = ReplicatedLinear(
                    config.hidden_size, 2, self.ctx, init_std=config.init_method_std
                )
        self._finish_build(seed)

    def _layer_offsets(self) -> dict[str, int]:
        return {"encoder": self.layer_offset}

    @staticmethod
    def attention_mask(padding_mask: torch.Tensor) -> torch.Tensor:
        """``padding_mask [b, s]`` (1 = token, 0 = pad) -> bool ``[b, 1, 1, s]``, True = masked key.

        Every query (pad positions too) attends to the real tokens only: Hugging Face's BERT mask and
        megatron-core's ``b11s`` mask. (Megatron's local ``b1ss`` mask also blanks the pad *queries*;
        their outputs differ, but no loss reads them.)
        """
        return (padding_mask < 0.5)[:, None, None, :]

    def forward(
        self,
        input_ids: torch.Tensor | None,
        padding_mask: torch.Tensor,
        tokentype_ids: torch.Tensor | None = None,
        lm_labels: torch.Tensor | None = None,
    ):
        """Run this chunk.

        Args:
            input_ids: ``[b, s]`` int64 ids (first chunk only).
            padding_mask: ``[b, s]``, 1 = token, 0 = padding (every chunk needs it).
            tokentype_ids: ``[b, s]`` segment ids (default all 0); must be None without a token-type
                table (``--bert-no-binary-head``, as Megatron's ``pretrain_bert.py`` passes None).
            lm_labels: ``[b, s]`` target ids (last chunk); negative = not predicted (loss 0).

        Returns:
            last chunk with labels: ``(lm_loss [b, s] fp32, binary_logits [b, 2] fp32 or None)``;
            last chunk without labels: ``(lm_logits [b, s, Vp/p], binary_logits or None)``;
            other chunks: hidden states ``[s, b, h]`` (``[s/p, b, h]`` with sequence parallelism).
        """
        mask = self.attention_mask(padding_mask)
        if self.pre_process:
            if tokentype_ids is not None and self.num_tokentypes == 0:
                raise ValueError(
                    "tokentype_ids given, but this BertModel has no token-type embeddings "
                    "(num_tokentypes=0: --bert-no-binary-head); pass tokentype_ids=None"
                )
            hidden_states = self.embedding(input_ids, None, tokentype_ids)
        else:
            hidden_states = self._received_input()

        rotary_freqs = None
        if self.config.position_embedding_type == "rope":
            seq_len = self._full_sequence_length(hidden_states)
            rotary_freqs = self.rotary_pos_emb(seq_len, None, device=hidden_states.device)

        hidden_states = self.encoder(hidden_states, mask, rotary_freqs)
        if not self.post_process:
            return hidden_states

        binary_logits = None
        if self.add_binary_head:
            binary_logits = self.binary_head(self.pooler(hidden_states)).float()

        logits, _ = self.output_layer(
            self.lm_head(hidden_states), weight=self.output_weight()
        )  # [s, b, Vp/p]
        if lm_labels is None:
            return logits.transpose(0, 1).contiguous(), binary_logits
        labels = lm_labels.transpose(0, 1)
        ignored = labels < 0
        loss = vocab_parallel_cross_entropy(
            logits,
            labels.masked_fill(ignored, 0).contiguous(),
            self.groups.tp,
            0.0,
            overwrite_logits=self.config.cross_entropy_loss_fusion,
        )  # [s, b]
        loss = loss.masked_fill(ignored, 0.0)
        return loss.transpose(0, 1).contiguous(), binary_logits
