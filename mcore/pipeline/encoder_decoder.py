"""Pipeline layout of an encoder-decoder model (T5): Megatron's ``ModelType.encoder_and_decoder``.

With ``p`` pipeline stages and split rank ``k`` (``--pipeline-model-parallel-split-rank k``, or
``--encoder-pipeline-model-parallel-size k`` on top of the decoder's stages), stages ``0 .. k-1`` hold
the encoder's layers and stages ``k .. p-1`` the decoder's, each side's layers dealt out evenly::

    6 encoder + 4 decoder layers, p = 4, k = 2:
    stage 0: embedding, encoder layers 0-2        (pre_process)
    stage 1: encoder layers 3-5, final norm       (post_process of the encoder)
    stage 2: embedding, decoder layers 0-1        (pre_process of the decoder)
    stage 3: decoder layers 2-3, final norm, loss (post_process)

What travels forward (and its gradient backward), as Megatron's schedule does for T5: an encoder
stage sends its hidden states ``[s_e, b, h]``; a decoder stage sends ``[decoder hidden [s_d, b, h],
encoder output [s_e, b, h]]``, so every decoder stage has the encoder output for its
cross-attention, and the gradients that every decoder stage's cross-attention puts on the encoder
output add up on their way back to the last encoder stage. Under sequence parallelism both
sequence dimensions are divided by the tensor-parallel size. A one-stage run holds everything.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from mcore.config.fields import ConfigError, check


class ModelType(enum.Enum):
    """Megatron's ``ModelType``: what ``pretrain`` lays out over the pipeline."""

    encoder_or_decoder = 1
    """One stack of layers (GPT, BERT): :func:`mcore.pipeline.layout.build_model_chunks`."""
    encoder_and_decoder = 2
    """An encoder and a decoder (T5): :func:`build_encoder_decoder_chunks`."""


@dataclass(frozen=True)
class EncoderDecoderStage:
    """What one pipeline stage of an encoder-decoder model holds.

    ``pre_process``: the stage embeds tokens (the first stage of the encoder or of the decoder);
    ``post_process``: it ends its stack (the encoder's final norm on the last encoder stage; final norm,
    output layer and loss on the last stage). ``encoder_layers`` / ``decoder_layers``: global layer
    indices of each stack held here (empty ranges for the stack it does not hold).
    """

    add_encoder: bool
    add_decoder: bool
    pre_process: bool
    post_process: bool
    encoder_layers: range
    decoder_layers: range


def _even_split(num_layers: int, stages: int, what: str, flag: str) -> list[range]:
    check(
        num_layers >= stages and num_layers % stages == 0,
        f"{what}={num_layers} does not divide evenly over the {stages} {flag} pipeline stage(s)",
    )
    per = num_layers // stages
    return [range(i * per, (i + 1) * per) for i in range(stages)]


def encoder_decoder_stages(
    encoder_num_layers: int, decoder_num_layers: int, pp_size: int, split_rank: int | None
) -> list[EncoderDecoderStage]:
    """Every stage's share of the model (see the module docstring).

    Raises:
        ConfigError: more than one stage without a split rank, or layers that do not divide evenly.
    """
    if pp_size == 1:
        return [
            EncoderDecoderStage(True, True, True, True, range(encoder_num_layers), range(decoder_num_layers))
        ]
    if split_rank is None:
        raise ConfigError(
            f"an encoder-decoder model on pipeline_model_parallel_size={pp_size} stages needs "
            "--pipeline-model-parallel-split-rank (the stage where the decoder starts) or "
            "--encoder-pipeline-model-parallel-size"
        )
    check(
        0 < split_rank < pp_size,
        f"pipeline_model_parallel_split_rank={split_rank} must lie between 1 and {pp_size - 1}",
    )
    encoder = _even_split(encoder_num_layers, split_rank, "encoder_num_layers", "encoder")
    decoder = _even_split(decoder_num_layers, pp_size - split_rank, "decoder_num_layers", "decoder")
    stages = []
    for rank in range(pp_size):
        is_encoder = rank < split_rank
        stages.append(
            EncoderDecoderStage(
                add_encoder=is_encoder,
                add_decoder=not is_encoder,
                pre_process=rank in (0, split_rank),
                post_process=rank in (split_rank - 1, pp_size - 1),
                encoder_layers=encoder[rank] if is_encoder else range(0),
                decoder_layers=range(0) if is_encoder else decoder[rank - split_rank],
            )
        )
    return stages


def encoder_decoder_tensor_shapes(
    stages: list[EncoderDecoderStage],
    *,
    encoder_seq_length: int,
    decoder_seq_length: int,
    micro_batch_size: int,
    hidden_size: int,
    tensor_model_parallel_size: int = 1,
    sequence_parallel: bool = False,
) -> list[list[tuple[int, int, int]]]:
    """Per stage, the shapes of the tensors its forward output holds (the schedule's ``tensor_shapes``)."""
    tp = tensor_model_parallel_size if sequence_parallel else 1
    for name, length in (
        ("encoder_seq_length", encoder_seq_length),
        ("decoder_seq_length", decoder_seq_length),
    ):
        check(
            length % tp == 0,
            f"{name}={length} is not divisible by tensor_model_parallel_size={tp} "
            "(sequence parallelism shards activations along the sequence)",
        )
    encoder = (encoder_seq_length // tp, micro_batch_size, hidden_size)
    decoder = (decoder_seq_length // tp, micro_batch_size, hidden_size)
    return [[decoder, encoder] if stage.add_decoder else [encoder] for stage in stages]


def build_encoder_decoder_chunks(
    model_provider: Callable[..., nn.Module], groups, stages: list[EncoderDecoderStage]
) -> list[nn.Module]:
    """This rank's one model chunk: ``model_provider(pre_process=, post_process=, add_encoder=,
    add_decoder=, encoder_layers=, decoder_layers=)`` with this stage's share (no virtual stages)."""
    check(
        groups.pp_size == len(stages),
        f"process groups have pipeline size {groups.pp_size} but the layout has {len(stages)} stages",
    )
    stage = stages[groups.pp_rank]
    return [
        model_provider(
            pre_process=stage.pre_process,
            post_process=stage.post_process,
            add_encoder=stage.add_encoder,
            add_decoder=stage.add_decoder,
            encoder_layers=stage.encoder_layers,
            decoder_layers=stage.decoder_layers,
        )
    ]
