"""The per-parameter update of the main parameters (the path that is not the flat one): Adam/AdamW
through the backend's ``adam_step``, torch.optim.SGD's update, and the fp32 masters rounded back into
bf16/fp16 model parameters."""

from __future__ import annotations

from typing import Any

import torch

from mcore.backend import get_ops
from mcore.optimizer.config import OptimizerConfig
from mcore.optimizer.main_params import MainParam


def copy_main_to_model(entries: list[MainParam]) -> None:
    """Round the fp32 masters into the bf16/fp16 model parameters: one multi-tensor copy instead of
    a kernel launch per parameter (the same ``copy_`` conversion, element for element)."""
    if entries:
        torch._foreach_copy_([e.model_view() for e in entries], [e.main for e in entries])


def adam_update(
    cfg: OptimizerConfig,
    param_groups: list[dict[str, Any]],
    present: list[tuple[MainParam, torch.Tensor]],
) -> None:
    """Adam/AdamW on the pieces with a gradient (``present``), batched by group and step."""
    batches: dict[tuple[int, int], list[tuple[MainParam, torch.Tensor]]] = {}
    for entry, grad in present:
        entry.state["step"] += 1
        batches.setdefault((entry.group, entry.state["step"]), []).append((entry, grad))
    for (group_index, step), members in batches.items():
        group = param_groups[group_index]
        get_ops().adam_step(
            [e.main for e, _ in members],
            [g for _, g in members],
            [e.state["exp_avg"] for e, _ in members],
            [e.state["exp_avg_sq"] for e, _ in members],
            step=step,
            lr=group["lr"],
            beta1=cfg.adam_beta1,
            beta2=cfg.adam_beta2,
            eps=cfg.adam_eps,
            weight_decay=group["weight_decay"],
            decoupled_weight_decay=cfg.decoupled_weight_decay,
        )


def sgd_update(
    cfg: OptimizerConfig,
    param_groups: list[dict[str, Any]],
    present: list[tuple[MainParam, torch.Tensor]],
) -> None:
    """torch.optim.SGD's update (coupled weight decay, no dampening, no Nesterov)."""
    momentum = cfg.sgd_momentum
    for group_index, group in enumerate(param_groups):
        members = [(e, g) for e, g in present if e.group == group_index]
        if not members:
            continue
        params = [e.main for e, _ in members]
        grads = [g for _, g in members]
        if group["weight_decay"] != 0.0:
            grads = torch._foreach_add(grads, params, alpha=group["weight_decay"])
        if momentum != 0.0:
            bufs = [e.state["momentum_buffer"] for e, _ in members]
            torch._foreach_mul_(bufs, momentum)
            torch._foreach_add_(bufs, grads)
            grads = bufs
        torch._foreach_add_(params, grads, alpha=-group["lr"])
