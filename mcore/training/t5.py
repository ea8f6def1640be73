"""The T5 pieces ``pretrain`` needs (Megatron's ``pretrain_t5.py``): a model provider, a forward step
and a datasets provider; ``examples/pretrain_t5.py`` passes them to
:func:`mcore.training.pretrain.pretrain` with ``model_type=ModelType.encoder_and_decoder``.

Pipeline parallelism (:mod:`mcore.pipeline.encoder_decoder`): stages before
``--pipeline-model-parallel-split-rank`` hold the encoder, the others the decoder. Each stage is a
:class:`T5Stage`: a :class:`~mcore.models.t5.t5_model.T5Model` chunk that returns the tensors its stage sends on
(``[encoder hidden]`` on encoder stages; ``[decoder hidden, encoder output]`` on decoder stages, so every
decoder stage's cross-attention reads the encoder output), and declares the parameters that several
stages hold:

* the word embedding on the first encoder stage, the first decoder stage and (as the tied output layer)
  the last stage: summed over ``groups.embedding`` (which includes the split rank);
* the learned position embeddings (first encoder and first decoder stage), the relative-position bias
  tables (every stage of their stack) and untied word embeddings: summed over the pipeline
  (:func:`~mcore.distributed.finalize.all_reduce_pipeline_shared_grads`).

The later copies are left out of the gradient norm and out of checkpoints (the first copy is saved;
a load fills every copy from it), so a run at any layout has the single-stage model's gradients, norm
and checkpoint.

Every stage reads the micro-batches (the masks are needed everywhere); the loss is the mean over the
decoder tokens of ``loss_mask``, logged as ``lm loss``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import torch

from mcore.config.fields import ConfigError
from mcore.data.t5_dataset import build_t5_datasets
from mcore.distributed.groups import ProcessGroups
from mcore.models.t5.t5_model import T5Model
from mcore.models.transformer.moe.config import refuse_moe
from mcore.models.transformer.mtp.config import refuse_mla_mtp
from mcore.training.cp_batch import refuse_context_parallel
from mcore.training.gpt import loss_func
from mcore.training.run_config import RunConfig

_WORD = "embedding.word_embeddings.weight"
_POSITION = "embedding.position_embeddings.weight"
_ENCODER_BIAS = "encoder_relative_pos_emb.relative_attention_bias.weight"
_DECODER_BIAS = "decoder_relative_pos_emb.relative_attention_bias.weight"


class T5Stage(T5Model):
    """A :class:`T5Model` chunk as one stage of an encoder-decoder pipeline (module docstring).

    Args (besides :class:`T5Model`'s):
        pipeline_stage: this stage's index; ``pipeline_split_rank``: the first decoder stage;
        ``pipeline_size``: the number of stages (1: the whole model, nothing special).
    """

    def __init__(self, *args, pipeline_stage: int, pipeline_split_rank: int | None, pipeline_size: int, **kw):
        super().__init__(*args, **kw)
        self.pipeline_size = pipeline_size
        self._shared_entries: list[tuple[tuple[int, ...], torch.nn.Parameter | None]] = []
        if pipeline_size == 1:
            return
        split = pipeline_split_rank
        # Which stage holds the original (saved, counted in the norm) of each shared tensor.
        first_holder = {_WORD: 0, _POSITION: 0, _ENCODER_BIAS: 0, _DECODER_BIAS: split}
        params = dict(self.named_parameters())
        cfg, tp = self.config, self.ctx.tp_size
        declared: list[tuple[str, tuple[int, ...]]] = []
        if not self.share_embeddings_and_output_weights:
            declared.append((_WORD, (self.vocab_size // tp, cfg.hidden_size)))
        if not self.relative:
            declared.append((_POSITION, (cfg.max_position_embeddings, cfg.hidden_size)))
        else:
            heads = (cfg.relative_attention_num_buckets, cfg.num_attention_heads)
            declared += [(_ENCODER_BIAS, heads), (_DECODER_BIAS, heads)]
        for name, shape in declared:
            param = params.get(name)
            if param is not None:
                param.pipeline_shared = True
                if tuple(param.shape) != shape:
                    raise RuntimeError(f"{name}: shape {tuple(param.shape)}, expected {shape}")
            self._shared_entries.append((shape, param))
        copies = [n for n, _ in declared if n in params and pipeline_stage != first_holder[n]]
        if self.share_embeddings_and_output_weights and self.pre_process and pipeline_stage != 0:
            copies.append(_WORD)  # the decoder's embedding: a tied copy (summed over groups.embedding)
        for name in copies:
            params[name].pipeline_copy = True
            self._shard_specs[name] = dataclasses.replace(self._shard_specs[name], tied_copy=True)

    def pipeline_shared_parameters(self) -> list[tuple[tuple[int, ...], torch.nn.Parameter | None]]:
        """The same list on every stage: (local shape, this stage's parameter or None)."""
        return list(self._shared_entries)

    def forward(self, *args, **kwargs):
        output = super().forward(*args, **kwargs)
        if self.pipeline_size == 1 or self.post_process:
            return output
        if self.add_decoder:
            return [output, self.encoder_hidden_state]
        return [output]


def model_provider(
    cfg: RunConfig,
    groups: ProcessGroups,
    vocab_size: int,
    *,
    pre_process: bool = True,
    post_process: bool = True,
    add_encoder: bool = True,
    add_decoder: bool = True,
    encoder_layers: range | None = None,
    decoder_layers: range | None = None,
) -> T5Stage:
    """This stage's T5 chunk (the arguments come from
    :func:`~mcore.pipeline.encoder_decoder.build_encoder_decoder_chunks`)."""
    refuse_context_parallel(groups, "T5")
    model = cfg.model
    refuse_moe(cfg.model, "T5")
    refuse_mla_mtp(cfg.model, "T5")
    fp8 = cfg.as_dict().get("fp8")
    if fp8 is not None and fp8.enabled:
        # T5's layers (cross-attention, relative bias) have no FP8 path yet: refuse rather than train bf16
        raise ConfigError(
            f"--fp8-format {fp8.fp8_format}: T5 has no FP8 layers yet; train it without --fp8-format"
        )
    encoder_layers = range(model.encoder_num_layers) if encoder_layers is None else encoder_layers
    decoder_layers = range(model.decoder_num_layers) if decoder_layers is None else decoder_layers
    return T5Stage(
        model,
        groups,
        vocab_size,
        pre_process=pre_process,
        post_process=post_process and add_decoder,  # the encoder's last stage ends with its final norm
        add_encoder=add_encoder,
        add_decoder=add_decoder,
        encoder_layer_offset=encoder_layers.start,
        encoder_num_layers=len(encoder_layers),
        decoder_layer_offset=decoder_layers.start,
        decoder_num_layers=len(decoder_layers),
        sequence_parallel=cfg.parallel.sequence_parallel,
        params_dtype=cfg.precision.params_dtype,
        seed=cfg.training.seed,
        pipeline_stage=groups.pp_rank,
        pipeline_split_rank=cfg.parallel.pipeline_model_parallel_split_rank,
        pipeline_size=groups.pp_size,
    )


def attention_masks(enc_mask: torch.Tensor, dec_mask: torch.Tensor):
    """Bool masks (True = masked) from the batch's padding vectors (1 = token), as ``[b, 1, 1, s_k]``
    key masks: ``enc_mask`` for the encoder's self-attention and the cross-attention, ``dec_mask`` for
    the decoder's self-attention (the model adds the causal mask). Padded queries are not masked: their
    outputs reach no loss (megatron-core's local masks also blank those rows)."""
    enc = (enc_mask < 0.5)[:, None, None, :]
    dec = (dec_mask < 0.5)[:, None, None, :]
    return enc, dec, enc


def forward_step(data_iterator, model: torch.nn.Module):
    """One micro-batch of Megatron's T5 batch keys (:mod:`mcore.data.t5_dataset`) through this stage."""
    batch = next(data_iterator)
    device = next(model.parameters()).device
    batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    enc_mask, dec_mask, enc_dec_mask = attention_masks(batch["enc_mask"], batch["dec_mask"])
    output = model(
        batch["text_enc"],
        batch["text_dec"],
        enc_mask,
        dec_mask,
        enc_dec_mask,
        lm_labels=batch["labels"].clamp(min=0),  # -1 past the decoder's tokens, where loss_mask is 0
    )
    return output, functools.partial(loss_func, batch["loss_mask"])


def t5_datasets_provider(cfg: RunConfig, tokenizer, num_samples: Sequence[int]):
    """Megatron's T5 datasets from ``--data-path`` (a sentence-level ``.bin/.idx``) or ``--mock-data``."""
    m = cfg.model
    return build_t5_datasets(
        cfg.data, tokenizer, m.encoder_seq_length, m.decoder_seq_length, cfg.training.seed, num_samples
    )
