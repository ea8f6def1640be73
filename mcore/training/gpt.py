"""The GPT pieces ``pretrain`` needs: a model provider and a forward step (Megatron's pretrain_gpt.py).

``examples/pretrain_gpt.py`` wires them into :func:`mcore.training.pretrain.pretrain`; BERT/T5 or
custom losses supply their own pair.
"""

from __future__ import annotations

import functools

import torch

from mcore.distributed.ddp import unwrap_model
from mcore.distributed.groups import ProcessGroups
from mcore.models.gpt.gpt_model import GPTModel
from mcore.training.cp_batch import masked_token_mean, slice_batch_for_cp
from mcore.training.run_config import RunConfig


def model_provider(
    cfg: RunConfig,
    groups: ProcessGroups,
    vocab_size: int,
    *,
    pre_process: bool = True,
    post_process: bool = True,
    layer_offset: int = 0,
    num_layers: int | None = None,
) -> GPTModel:
    """One GPT chunk: layers ``[layer_offset, layer_offset + num_layers)`` of the model."""
    return GPTModel(
        cfg.model,
        groups,
        vocab_size,
        pre_process=pre_process,
        post_process=post_process,
        layer_offset=layer_offset,
        num_layers=num_layers,
        sequence_parallel=cfg.parallel.sequence_parallel,
        params_dtype=cfg.precision.params_dtype,
        seed=cfg.training.seed,
        fp8=cfg.as_dict().get("fp8"),
        cp_comm_type=cfg.parallel.cp_comm_type,
    )


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor, groups: ProcessGroups | None = None):
    """Mean per-token loss over the tokens the mask keeps (``loss_mask`` [b, s], ``output_tensor`` [b, s]).

    With context parallelism (``groups.cp_size > 1``) the mean is over the whole sequence's tokens:
    see :func:`mcore.training.cp_batch.masked_token_mean` (the logged loss is the global mean)."""
    cp_size = 1 if groups is None else groups.cp_size
    loss, report = masked_token_mean(output_tensor, loss_mask, groups.cp if cp_size > 1 else None, cp_size)
    return loss, {"lm loss": report}


def _model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def forward_step(data_iterator, model: torch.nn.Module):
    """One micro-batch: read it (on stages that take data), run the chunk, return the loss closure.

    The batch contract is :mod:`mcore.data.loader`'s: ``tokens``, ``labels``, ``loss_mask``,
    ``position_ids`` [b, s] and, with ``--reset-attention-mask``, ``attention_mask`` [b, 1, s, s].
    """
    batch = next(data_iterator) if data_iterator is not None else None
    if batch is None:
        return model(None), functools.partial(loss_func, torch.ones(1))
    device = _model_device(model)
    batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    groups = getattr(unwrap_model(model), "groups", None)
    if groups is not None and groups.cp_size > 1:
        batch = slice_batch_for_cp(batch, groups.topology.coordinate("cp"), groups.cp_size)
    # multi-token prediction counts the loss mask's positions (shifted per depth)
    extra = {"loss_mask": batch["loss_mask"]} if getattr(unwrap_model(model), "mtp", None) is not None else {}
    output = model(
        batch["tokens"], batch["position_ids"], batch.get("attention_mask"), labels=batch["labels"], **extra
    )
    return output, functools.partial(loss_func, batch["loss_mask"], groups=groups)
