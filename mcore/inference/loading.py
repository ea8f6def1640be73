"""Logical (unsharded) model state <-> live model chunks at any TP/PP layout, and configs from a run.

A *logical state* is ``dict[logical name, whole tensor]`` (what :func:`mcore.checkpoint.load_logical_model_state`
returns and :func:`mcore.checkpoint.save_logical_model_checkpoint` takes): names use global layer
numbers, tensors are TP-merged, the word embedding (and an untied ``output_layer.weight``) has the
padded vocabulary of whatever layout wrote it, and a tied model has no ``output_layer.weight``.

* :func:`load_logical_state` cuts this rank's shards out of it into a model chunk, re-padding the
  vocabulary rows to the chunk's padded size (padding rows are zeros);
* :func:`gather_logical_state` is the inverse: it merges the shards of every rank's chunks
  (a collective over the TP and PP groups) into the logical state;
* :func:`build_model_chunk` builds this rank's chunk of a model for inference (PP stage ``pp_rank``,
  no virtual stages, no sequence parallelism) and loads a logical state into it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from mcore.checkpoint.buffers import logical_buffer_name, logical_buffers, persistent_buffers
from mcore.checkpoint.run_configs import (  # noqa: F401 (re-exported: the public names are here)
    RunConfigLike,
    model_config_from_run_config,
    run_config_groups,
    tokenizer_config_from_run_config,
)
from mcore.distributed.groups import ProcessGroups
from mcore.models.gpt.gpt_model import GPTModel
from mcore.models.transformer.model_config import ModelConfig, padded_vocab_size
from mcore.pipeline.layout import stage_layer_ranges
from mcore.tensor_parallel.sharding import ShardSpec


def fit_vocab_rows(tensor: torch.Tensor, rows: int, vocab_size: int | None = None) -> torch.Tensor:
    """A padded-vocabulary tensor with exactly ``rows`` rows: zero rows appended, or padding rows cut.

    Cutting keeps at least ``vocab_size`` rows (the real vocabulary) when it is given.
    """
    have = tensor.shape[0]
    if have == rows:
        return tensor
    if have > rows:
        if vocab_size is not None and rows < vocab_size:
            raise ValueError(
                f"cannot cut a {have}-row vocabulary to {rows} rows below the real size {vocab_size}"
            )
        return tensor[:rows]
    pad = torch.zeros(rows - have, *tensor.shape[1:], dtype=tensor.dtype, device=tensor.device)
    return torch.cat([tensor, pad])


@torch.no_grad()
def load_logical_state(
    model: GPTModel, state: Mapping[str, torch.Tensor], vocab_size: int | None = None
) -> None:
    """Copy this rank's shards of ``state`` into ``model`` (one chunk; any TP/PP layout).

    Raises:
        KeyError: a parameter of the chunk has no tensor in ``state``.
        ValueError: a tensor's shape differs from the parameter's logical shape.
    """
    params = dict(model.named_parameters())
    missing = []
    for local_name, spec in model.sharded_parameters().items():
        if spec.name not in state:
            missing.append(spec.name)
            continue
        full = state[spec.name]
        if spec.vocab_padded:
            full = fit_vocab_rows(full, spec.global_shape[0], vocab_size)
        if tuple(full.shape) != tuple(spec.global_shape):
            raise ValueError(
                f"{spec.name}: the state has shape {tuple(full.shape)}, the model {tuple(spec.global_shape)}"
            )
        param = params[local_name]
        param.copy_(spec.shard(full.to(param.device)).to(param.dtype))
    if missing:
        raise KeyError(f"the model state has no tensor for: {', '.join(missing[:8])}")
    for local_name, value in persistent_buffers(model).items():  # the routers' expert_bias (kept when absent)
        name = logical_buffer_name(model, local_name)
        if name in state:
            value.copy_(state[name].to(value.device))


def _gather_tp(local: torch.Tensor, spec: ShardSpec, group) -> torch.Tensor:
    if spec.partition_dim is None or spec.tp_size == 1:
        return local
    shards = [torch.empty_like(local) for _ in range(spec.tp_size)]
    dist.all_gather(shards, local.contiguous(), group=group)
    return spec.merge(shards)


@torch.no_grad()
def gather_logical_state(chunks: Sequence[torch.nn.Module], groups: ProcessGroups) -> dict[str, torch.Tensor]:
    """The whole logical state of a model spread over TP and PP, on every rank (CPU tensors).

    A collective: every rank of the model-parallel group must call it. Tied output copies on the
    last stage are skipped (the word embedding is the logical tensor).
    """
    state: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        chunk = getattr(chunk, "module", chunk)  # a DDP wrapper
        params = dict(chunk.named_parameters())
        for local_name, spec in chunk.sharded_parameters().items():
            if spec.tied_copy:
                continue
            state[spec.name] = _gather_tp(params[local_name].detach(), spec, groups.tp).cpu()
        for name, value in logical_buffers(chunk).items():  # replicated model state (expert_bias)
            state[name] = value.detach().cpu().clone()
    if groups.pp_size > 1:
        parts: list[dict[str, torch.Tensor] | None] = [None] * groups.pp_size
        dist.all_gather_object(parts, state, group=groups.pp)
        state = {k: v for part in parts for k, v in part.items()}
    return state


def stage_layers(num_layers: int, groups: ProcessGroups) -> range:
    """The global layers this rank's pipeline stage holds (even split, no virtual stages)."""
    return stage_layer_ranges(num_layers, groups.pp_size)[groups.pp_rank][0]


def build_model_chunk(
    cfg: ModelConfig,
    groups: ProcessGroups,
    vocab_size: int,
    state: Mapping[str, torch.Tensor] | None = None,
    *,
    device: torch.device | None = None,
    params_dtype: torch.dtype = torch.float32,
) -> GPTModel:
    """This rank's pipeline stage of the model (eval mode), loaded from ``state`` when given.

    ``vocab_size`` is the real vocabulary; the chunk's padded size follows Megatron's rule for this
    TP size.
    """
    layers = stage_layers(cfg.num_layers, groups)
    padded = padded_vocab_size(vocab_size, cfg.make_vocab_size_divisible_by, groups.tp_size)
    model = GPTModel(
        cfg,
        groups,
        padded,
        pre_process=groups.is_first_stage,
        post_process=groups.is_last_stage,
        layer_offset=layers.start,
        num_layers=len(layers),
        params_dtype=params_dtype,
        device=device,
    )
    if state is not None:
        load_logical_state(model, state, vocab_size)
    return model.eval()


__all__ = [
    "build_model_chunk",
    "fit_vocab_rows",
    "gather_logical_state",
    "load_logical_state",
    "model_config_from_run_config",
    "run_config_groups",
    "stage_layers",
    "tokenizer_config_from_run_config",
]
