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

import re
from dataclasses import replace

import torch

from mcore.backend import current_backend
from mcore.config.fields import ConfigError, check
from mcore.config.fp8 import Fp8Config
from mcore.distributed.groups import ProcessGroups
from mcore.models.attention import CoreAttention, SelfAttention, SelfAttentionSubmodules
from mcore.models.config import ModelConfig, check_tensor_parallel
from mcore.models.context import BuildContext
from mcore.models.embeddings import LanguageModelEmbedding
from mcore.models.mlp import MLP, MLPSubmodules
from mcore.models.norms import Norm
from mcore.models.positions import RotaryEmbedding
from mcore.models.spec import ModuleSpec
from mcore.models.transformer_layer import TransformerBlock, TransformerLayer, TransformerLayerSubmodules
from mcore.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from mcore.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from mcore.tensor_parallel.mappings import all_reduce_sequence_parallel_grads
from mcore.tensor_parallel.output_loss import output_layer_cross_entropy
from mcore.tensor_parallel.sharding import (
    ShardSpec,
    build_shard_specs,
    init_method_normal,
    initialize_parameters,
)

WORD_EMBEDDINGS = "embedding.word_embeddings.weight"
_LOCAL_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def gpt_layer_spec() -> ModuleSpec:
    """The GPT transformer layer: norm, self-attention (QKV, core attention, proj), norm, MLP."""
    return ModuleSpec(
        TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=ModuleSpec(Norm),
            self_attention=ModuleSpec(
                SelfAttention,
                submodules=SelfAttentionSubmodules(
                    linear_qkv=ColumnParallelLinear,
                    core_attention=CoreAttention,
                    linear_proj=RowParallelLinear,
                ),
            ),
            pre_mlp_layernorm=ModuleSpec(Norm),
            mlp=ModuleSpec(
                MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
            ),
        ),
    )


class GPTModel(torch.nn.Module):
    """A decoder-only transformer language model, or one pipeline chunk of it.

    Args:
        config: the model flags.
        groups: process groups; the model uses ``groups.tp`` (and the TP size and rank).
        vocab_size: the *padded* vocabulary size, from
            :func:`mcore.models.config.padded_vocab_size` (a multiple of the TP size).
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
            (:mod:`mcore.tensor_parallel.fp8`); the backend must have the ``fp8`` capability.

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
    ):
        super().__init__()
        tp = groups.tp_size
        if fp8 is not None and fp8.enabled:
            backend = current_backend()
            fp8.check_with(config.num_layers, backend.capabilities(), backend.name)
        check_tensor_parallel(config, tp, sequence_parallel)
        check(
            config.position_embedding_type != "relative",
            "position_embedding_type='relative' is T5's relative position bias: GPT takes "
            "learned_absolute, rope, alibi or none",
        )
        check(
            vocab_size % tp == 0,
            f"padded vocab_size={vocab_size} is not divisible by tensor_model_parallel_size={tp}; "
            "compute it with padded_vocab_size()",
        )
        num_layers = config.num_layers - layer_offset if num_layers is None else num_layers
        if not (0 <= layer_offset and num_layers >= 0 and layer_offset + num_layers <= config.num_layers):
            raise ConfigError(
                f"layers [{layer_offset}, {layer_offset + num_layers}) of this chunk are outside "
                f"num_layers={config.num_layers}"
            )
        self.config = config
        self.groups = groups
        self.vocab_size = vocab_size
        self.pre_process, self.post_process = pre_process, post_process
        self.layer_offset, self.num_layers = layer_offset, num_layers
        self.sequence_parallel = sequence_parallel
        self.share_embeddings_and_output_weights = config.share_embeddings_and_output_weights
        self.ctx = BuildContext(
            tp_group=groups.tp,
            tp_size=tp,
            tp_rank=groups.tp_rank,
            sequence_parallel=sequence_parallel,
            params_dtype=params_dtype,
            device=device if device is not None else groups.device,
            fp8=fp8 if fp8 is not None and fp8.enabled else None,
            num_layers=config.num_layers,
        )
        self.input_tensor: torch.Tensor | None = None

        if pre_process:
            self.embedding = LanguageModelEmbedding(config, self.ctx, vocab_size)
        if config.position_embedding_type == "rope":
            self.rotary_pos_emb = RotaryEmbedding(config.rotary_dim, config.rotary_base)
        self.decoder = TransformerBlock(
            config,
            self.ctx,
            layer_spec or gpt_layer_spec(),
            num_layers=num_layers,
            layer_offset=layer_offset,
            post_process=post_process,
        )
        if post_process:
            tied = self.share_embeddings_and_output_weights
            self.output_layer = ColumnParallelLinear(
                config.hidden_size,
                vocab_size,
                tp_group=groups.tp,
                bias=False,
                gather_output=False,
                sequence_parallel=sequence_parallel,
                init_method=init_method_normal(config.init_method_std),
                vocab_padded=True,
                skip_weight_param_allocation=tied and pre_process,
                gradient_accumulation_fusion=config.gradient_accumulation_fusion,
                params_dtype=params_dtype,
                device=self.ctx.device,
            )
            if tied and not pre_process:
                # The last stage's copy of the word embedding: same logical tensor, same init.
                weight = self.output_layer.weight
                weight.shard_layout = replace(weight.shard_layout, logical_name=WORD_EMBEDDINGS)
                weight.shared_embedding = True
        if pre_process and self.share_embeddings_and_output_weights:
            # Megatron's marker: one of the (up to two) copies of the tied word embedding.
            self.embedding.word_embeddings.weight.shared_embedding = True

        self._shard_specs = build_shard_specs(self, groups.tp_rank, tp, self._logical_name)
        initialize_parameters(self, self._shard_specs, seed)

    # -- naming and sharding ------------------------------------------------------------------------

    def _logical_name(self, local_name: str) -> str:
        return _LOCAL_LAYER.sub(
            lambda m: f"decoder.layers.{int(m.group(1)) + self.layer_offset}.", local_name
        )

    def sharded_parameters(self) -> dict[str, ShardSpec]:
        """For every parameter (key: its name in ``named_parameters()``), where it sits in the model.

        Each :class:`~mcore.tensor_parallel.sharding.ShardSpec` gives the logical name (global layer
        numbers; the tied output copy maps to ``embedding.word_embeddings.weight``), the logical
        shape, the TP partition dim and rank, how the local slice is cut (``chunks()``, ``shard()``,
        ``merge()``; ``num_stacked=2`` for SwiGLU fc1), whether dim 0 is the padded vocabulary, and
        whether the gradient needs a TP sum under sequence parallelism. Checkpoint resharding and the
        Hugging Face exporter are built on it.
        """
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
        """The tied word-embedding weight this chunk holds: the table on the first stage, the output
        copy on a last stage that is not the first; None when untied or when the chunk has neither.
        The pipeline sums the gradients of these over ``groups.embedding`` (a no-op with one stage).
        """
        if not self.share_embeddings_and_output_weights:
            return None
        if self.pre_process:
            return self.embedding.word_embeddings.weight
        if self.post_process:
            return self.output_layer.weight
        return None

    # -- forward ------------------------------------------------------------------------------------

    def set_input_tensor(self, input_tensor: torch.Tensor | list[torch.Tensor] | None) -> None:
        """The hidden states ``[s, b, h]`` a non-first pipeline chunk starts from (Megatron's contract)."""
        if isinstance(input_tensor, (list, tuple)):
            if len(input_tensor) != 1:
                raise ValueError(f"GPTModel takes one input tensor, got {len(input_tensor)}")
            input_tensor = input_tensor[0]
        self.input_tensor = input_tensor

    def forward(
        self,
        tokens: torch.Tensor | None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        label_smoothing: float = 0.0,
        inference_context=None,
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

        Returns:
            last chunk with labels: per-token fp32 loss ``[b, s]``;
            last chunk without labels: this rank's vocabulary slice of the logits ``[b, s, Vp/p]``;
            other chunks: hidden states ``[s, b, h]`` (``[s/p, b, h]`` with sequence parallelism).
        """
        if self.pre_process:
            hidden_states = self.embedding(tokens, position_ids)
        else:
            if self.input_tensor is None:
                raise RuntimeError("a non-first pipeline chunk needs set_input_tensor() before forward()")
            hidden_states = self.input_tensor

        rotary_freqs = None
        if self.config.position_embedding_type == "rope":
            seq_len = hidden_states.shape[0] * (self.ctx.tp_size if self.sequence_parallel else 1)
            rotary_freqs = self.rotary_pos_emb(seq_len, position_ids, device=hidden_states.device)

        hidden_states = self.decoder(
            hidden_states, attention_mask, rotary_freqs, inference_context=inference_context
        )
        if not self.post_process:
            return hidden_states

        weight = None
        if self.share_embeddings_and_output_weights and self.pre_process:
            weight = self.embedding.word_embeddings.weight
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
