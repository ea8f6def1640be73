"""The optimizer: Adam/AdamW or SGD with fp32 master weights, loss scaling, global-norm clipping,
and the distributed optimizer (fp32 masters and moments sharded over data-parallel ranks).

Wiring, in a training step::

    ddp_config = ddp_config.with_training(opt_cfg, precision_cfg)
    chunks = [DistributedDataParallel(m, ddp_config, groups) for m in model_chunks]
    optimizer = build_optimizer(opt_cfg, precision_cfg, chunks, groups)
    # every step:
    optimizer.zero_grad()                         # zeroes the DDP gradient buffers
    losses = schedule(..., no_sync_func=..., finalize_grads_func=finalize_model_grads,
                      grad_scale_func=optimizer.scale_loss)
    for group in optimizer.param_groups: group["lr"] = ...    # the LR scheduler
    update_successful, grad_norm, _ = optimizer.step()
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from mcore.distributed.groups import ProcessGroups
from mcore.optimizer.config import OptimizerConfig, PrecisionConfig
from mcore.optimizer.grad_scaler import (
    ConstantGradScaler,
    DynamicGradScaler,
    LossScaleUnderflowError,
    build_grad_scaler,
)
from mcore.optimizer.main_params import default_no_weight_decay
from mcore.optimizer.optimizer import MegatronOptimizer, format_memory_report

__all__ = [
    "ConstantGradScaler",
    "DynamicGradScaler",
    "LossScaleUnderflowError",
    "MegatronOptimizer",
    "OptimizerConfig",
    "PrecisionConfig",
    "build_grad_scaler",
    "build_optimizer",
    "default_no_weight_decay",
    "format_memory_report",
]


def build_optimizer(
    optimizer_config: OptimizerConfig,
    precision_config: PrecisionConfig,
    model_chunks: Sequence[torch.nn.Module],
    groups: ProcessGroups,
    *,
    lr: float = 0.0,
    no_weight_decay: Callable[[str, torch.nn.Parameter], bool] = default_no_weight_decay,
) -> MegatronOptimizer:
    """The optimizer over every trainable parameter of this rank's model chunks.

    Args:
        optimizer_config: Adam/SGD, betas, weight decay, clipping, distributed optimizer.
        precision_config: bf16/fp16 (fp32 masters) and the loss scaler.
        model_chunks: :class:`~mcore.distributed.ddp.DistributedDataParallel` chunks (required with
            the distributed optimizer; plain modules are accepted otherwise and use ``param.grad``).
        groups: the process groups (the norm and overflow checks reduce over them).
        lr: the initial learning rate of every group (the LR scheduler sets it before each step).
        no_weight_decay: ``(name, param) -> bool``; default: biases and 1-D parameters.
    """
    return MegatronOptimizer(
        optimizer_config,
        precision_config,
        model_chunks,
        groups,
        lr=lr,
        no_weight_decay=no_weight_decay,
    )
