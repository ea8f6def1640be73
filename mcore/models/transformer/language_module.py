"""What GPT, BERT and T5 share: megatron-core's ``LanguageModule`` (one pipeline chunk of a language model).

A subclass builds its own modules between :meth:`LanguageModule.__init__` and
:meth:`LanguageModule._finish_build`:

* ``__init__`` checks what every model checks (FP8 support, the TP split, a padded vocabulary that
  divides over TP), keeps the chunk's settings (``config``, ``groups``, ``vocab_size``,
  ``pre_process``/``post_process``, ``sequence_parallel``, ``share_embeddings_and_output_weights``)
  and makes the :class:`~mcore.models.transformer.build_context.BuildContext` ``self.ctx`` the layers are built with;
* ``_finish_build(seed)`` marks the tied word embedding, records every parameter's
  :class:`~mcore.tensor_parallel.sharding.ShardSpec` (logical names with global layer numbers,
  :meth:`LanguageModule._layer_offsets`) and initializes the weights from ``seed`` alone.

Tied embeddings: the word embedding ``embedding.word_embeddings.weight`` lives on a chunk with
``pre_process``; a ``post_process`` chunk without it keeps a copy as its output-layer weight
(:func:`mark_tied_output_copy`: same logical name, same initial values). The pipeline sums the
gradients of :meth:`LanguageModule.shared_embedding_or_output_weight` over ``groups.embedding``.
"""

from __future__ import annotations

import re
from dataclasses import replace

import torch

from mcore.backend import current_backend
from mcore.config.fields import ConfigError, check
from mcore.distributed.groups import ProcessGroups
from mcore.fp8.config import Fp8Config
from mcore.models.transformer.build_context import BuildContext
from mcore.models.transformer.model_config import ModelConfig, check_tensor_parallel
from mcore.tensor_parallel.layers import ColumnParallelLinear
from mcore.tensor_parallel.mappings import all_reduce_sequence_parallel_grads
from mcore.tensor_parallel.sharding import (
    ShardSpec,
    build_shard_specs,
    init_method_normal,
    initialize_parameters,
)

WORD_EMBEDDINGS = "embedding.word_embeddings.weight"
_LOCAL_LAYER = re.compile(r"^(encoder|decoder)\.layers\.(\d+)\.")


def mark_tied_output_copy(weight: torch.nn.Parameter) -> None:
    """Make ``weight`` the last stage's copy of the word embedding: same logical tensor
    (``embedding.word_embeddings.weight``), hence the same initial values from the same seed
    (Megatron instead zero-fills it and all-reduces from the first stage)."""
    weight.shard_layout = replace(weight.shard_layout, logical_name=WORD_EMBEDDINGS)
    weight.shared_embedding = True


def vocab_output_layer(
    config: ModelConfig, ctx: BuildContext, vocab_size: int, *, bias: bool, pre_process: bool
) -> ColumnParallelLinear:
    """The output layer ``logits = x W^T (+ b)``, ``W [Vp/p, h]`` vocab rows, output not gathered.

    Tied (``config.share_embeddings_and_output_weights``) on a chunk with the embedding it allocates no
    weight (the forward passes the word embedding); tied without the embedding its weight is the
    word embedding's copy (:func:`mark_tied_output_copy`). A bias runs over the padded vocabulary
    too (resharding re-pads it).
    """
    tied = config.share_embeddings_and_output_weights
    layer = ColumnParallelLinear(
        config.hidden_size,
        vocab_size,
        tp_group=ctx.tp_group,
        bias=bias,
        gather_output=False,
        sequence_parallel=ctx.sequence_parallel,
        init_method=init_method_normal(config.init_method_std),
        vocab_padded=True,
        skip_weight_param_allocation=tied and pre_process,
        gradient_accumulation_fusion=config.gradient_accumulation_fusion,
        params_dtype=ctx.params_dtype,
        device=ctx.device,
    )
    if bias:
        layer.bias.shard_layout = replace(layer.bias.shard_layout, vocab_padded=True)
    if tied and not pre_process:
        mark_tied_output_copy(layer.weight)  # the last stage's copy
    return layer


def chunk_layer_count(offset: int, count: int | None, total: int, stack: str = "") -> int:
    """The layers of a chunk holding ``[offset, offset + count)`` of ``total`` (``count`` None: to the end).

    Raises:
        ConfigError: the range is outside the stack (``stack``: "encoder"/"decoder" names it).
    """
    count = total - offset if count is None else count
    if not (0 <= offset and count >= 0 and offset + count <= total):
        prefix = f"{stack} " if stack else ""
        raise ConfigError(
            f"{prefix}layers [{offset}, {offset + count}) of this chunk are outside "
            f"{stack + '_' if stack else ''}num_layers={total}"
        )
    return count


class LanguageModule(torch.nn.Module):
    """The base of :class:`~mcore.models.gpt.gpt_model.GPTModel`, :class:`~mcore.models.bert.bert_model.BertModel` and
    :class:`~mcore.models.t5.t5_model.T5Model` (module docstring).

    Args:
        config, groups, vocab_size, pre_process, post_process, sequence_parallel, params_dtype,
            device, fp8: as :class:`mcore.models.gpt.gpt_model.GPTModel`.

    Raises:
        ConfigError: the model does not split over TP, or FP8 is asked where the backend has none.
    """

    def __init__(
        self,
        config: ModelConfig,
        groups: ProcessGroups,
        vocab_size: int,
        *,
        pre_process: bool,
        post_process: bool,
        sequence_parallel: bool,
        params_dtype: torch.dtype,
        device: torch.device | None,
        fp8: Fp8Config | None = None,
        cp_comm_type: str = "p2p",
    ):
        super().__init__()
        tp = groups.tp_size
        if fp8 is not None and fp8.enabled:
            backend = current_backend()
            fp8.check_with(config.num_layers, backend.capabilities(), backend.name)
        check_tensor_parallel(config, tp, sequence_parallel, training=False)  # MoE: see MoELayer
        check(
            vocab_size % tp == 0,
            f"padded vocab_size={vocab_size} is not divisible by tensor_model_parallel_size={tp}; "
            "compute it with padded_vocab_size()",
        )
        self.config = config
        self.groups = groups
        self.vocab_size = vocab_size
        self.pre_process, self.post_process = pre_process, post_process
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
            groups=groups,
            cp_group=groups.cp,
            cp_size=groups.cp_size,
            cp_comm_type=cp_comm_type,
        )
        self.input_tensor: torch.Tensor | None = None

    def _finish_build(self, seed: int) -> None:
        """Mark the tied word embedding, record the shard specs and initialize every parameter."""
        if self.pre_process and self.share_embeddings_and_output_weights:
            # Megatron's marker: one of the (up to two) copies of the tied word embedding.
            self.embedding.word_embeddings.weight.shared_embedding = True
        g = self.groups
        self._shard_specs = build_shard_specs(
            self, g.tp_rank, g.tp_size, self._logical_name,
            ep_rank=getattr(g, "ep_rank", 0), ep_size=getattr(g, "ep_size", 1),
            etp_rank=getattr(g, "etp_rank", None), etp_size=getattr(g, "etp_size", None),
        )  # fmt: skip
        initialize_parameters(self, self._shard_specs, seed)

    # -- naming and sharding ------------------------------------------------------------------------

    def _layer_offsets(self) -> dict[str, int]:
        """Global index of the first layer of each stack this chunk holds (``{"decoder": 4}``)."""
        raise NotImplementedError

    def _logical_name(self, local_name: str) -> str:
        """``{stack}.layers.{i}.`` (chunk-local ``i``) -> ``{stack}.layers.{offset + i}.`` (global)."""
        offsets = self._layer_offsets()

        def shift(m: re.Match) -> str:
            if m.group(1) not in offsets:
                return m.group(0)
            return f"{m.group(1)}.layers.{int(m.group(2)) + offsets[m.group(1)]}."

        return _LOCAL_LAYER.sub(shift, local_name)

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
        """Sum the sequence-parallel parameters' gradients over TP (call after backward). Without SP only
        the per-head q/k norms (``--qk-layernorm``) are flagged: each rank applies them to its own heads."""
        if self.groups.tp_size > 1:
            all_reduce_sequence_parallel_grads(self.sequence_parallel_parameters(), self.groups.tp)

    def _output_linear(self) -> torch.nn.Module:
        """The vocab-parallel output layer (T5 keeps it in ``lm_head``)."""
        return self.output_layer

    def shared_embedding_or_output_weight(self) -> torch.nn.Parameter | None:
        """The tied word-embedding weight this chunk holds: the table on the first stage (``pre_process``),
        the output copy on a last stage (``post_process``) that is not the first; None when untied or
        when the chunk has neither. The pipeline sums the gradients of these over ``groups.embedding``
        (a no-op with one stage).
        """
        if not self.share_embeddings_and_output_weights:
            return None
        if self.pre_process:
            return self.embedding.word_embeddings.weight
        if self.post_process:
            return self._output_linear().weight
        return None

    def output_weight(self) -> torch.Tensor | None:
        """The weight the output layer multiplies by when it has none of its own (tied, with the embedding)."""
        if self.share_embeddings_and_output_weights and self.pre_process:
            return self.embedding.word_embeddings.weight
        return None

    # -- forward ------------------------------------------------------------------------------------

    def set_input_tensor(self, input_tensor: torch.Tensor | list[torch.Tensor] | None) -> None:
        """The hidden states ``[s, b, h]`` a non-first pipeline chunk starts from (Megatron's contract)."""
        if isinstance(input_tensor, (list, tuple)):
            if len(input_tensor) != 1:
                raise ValueError(f"{type(self).__name__} takes one input tensor, got {len(input_tensor)}")
            input_tensor = input_tensor[0]
        self.input_tensor = input_tensor

    def _received_input(self) -> torch.Tensor:
        """The hidden states from the previous stage (a chunk without ``pre_process``)."""
        if self.input_tensor is None:
            raise RuntimeError("a non-first pipeline chunk needs set_input_tensor() before forward()")
        return self.input_tensor

    def _full_sequence_length(self, hidden_states: torch.Tensor) -> int:
        """The sequence length of ``hidden_states [s, b, h]`` (``[s/p, b, h]`` with sequence parallelism)."""
        return hidden_states.shape[0] * (self.ctx.tp_size if self.sequence_parallel else 1)
