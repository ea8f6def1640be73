"""The optimizer's main parameters and parameter groups: which piece of each model parameter this rank
updates (:class:`MainParam`), its fp32 master and gradient view, and the weight-decay groups.

A *main parameter* is, for every trainable model parameter, the contiguous piece of it this rank
updates, as a flat fp32 tensor: all of it (replicated), or the part in this data-parallel rank's
bucket shard (``--use-distributed-optimizer``); see :mod:`mcore.optimizer.optimizer`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mcore.distributed.ddp import DistributedDataParallel, unwrap_model
from mcore.distributed.grad_buffer import GradBuffer
from mcore.distributed.param_attrs import is_expert_parallel
from mcore.optimizer.clip_grads import counts_in_grad_norm


@dataclass
class MainParam:
    """The piece ``[start, end)`` of one (flattened) model parameter that this rank updates."""

    key: str
    model_param: torch.nn.Parameter
    start: int
    end: int
    main: torch.Tensor | None
    """fp32, 1-D: a view of the model parameter (fp32 params) or an fp32 copy (bf16/fp16); None when
    the master is held as the bf16 parameter plus a 16-bit remainder (read it with
    :meth:`MegatronOptimizer.master_of <mcore.optimizer.optimizer.MegatronOptimizer.master_of>`)."""
    grad_view: Callable[[], torch.Tensor | None]
    """The piece's gradient in the buffer's dtype (a 1-D view), or None when there is none."""
    owns_copy: bool
    counts_in_norm: bool
    group: int
    state: dict[str, Any] = field(default_factory=dict)
    buffer: GradBuffer | None = None
    """The DDP buffer of the parameter (None for a plain module)."""
    expert: bool = False
    """An expert-parallel parameter (its norm is summed over the expert grid)."""

    def model_view(self) -> torch.Tensor:
        return self.model_param.data.view(-1)[self.start : self.end]


def default_no_weight_decay(name: str, param: torch.nn.Parameter) -> bool:
    """Megatron's rule: biases and every 1-D parameter (norm weights) get no weight decay."""
    return name.endswith(".bias") or param.dim() == 1


def parameter_keys(model_chunks: Sequence[torch.nn.Module]) -> dict[int, str]:
    """``id(param) -> key``: the parameter's name in its (unwrapped) model chunk, prefixed with
    ``model{i}.`` when a rank has several chunks (virtual pipeline)."""
    names = {}
    for i, chunk in enumerate(model_chunks):
        prefix = f"model{i}." if len(model_chunks) > 1 else ""
        for name, param in unwrap_model(chunk).named_parameters():
            names[id(param)] = prefix + name
    return names


def trainable_parameters(model_chunks: Sequence[torch.nn.Module]) -> list[tuple]:
    """``(key, name, param, chunk)`` of every parameter that requires a gradient, in chunk order."""
    named = []
    for i, chunk in enumerate(model_chunks):
        prefix = f"model{i}." if len(model_chunks) > 1 else ""
        for name, param in unwrap_model(chunk).named_parameters():
            if param.requires_grad:
                named.append((prefix + name, name, param, chunk))
    return named


def build_param_groups(
    named: list[tuple],
    no_weight_decay: Callable[[str, torch.nn.Parameter], bool],
    weight_decay: float,
    lr: float,
) -> tuple[list[dict[str, Any]], dict[int, int]]:
    """The parameter groups (with weight decay, then without; an empty one is left out) and
    ``id(param) -> group index``."""
    decay = [(k, p) for k, n, p, _ in named if not no_weight_decay(n, p)]
    no_decay = [(k, p) for k, n, p, _ in named if no_weight_decay(n, p)]
    param_groups: list[dict[str, Any]] = []
    group_of: dict[int, int] = {}
    for members, wd_mult in ((decay, 1.0), (no_decay, 0.0)):
        if not members:
            continue
        for _, p in members:
            group_of[id(p)] = len(param_groups)
        param_groups.append(
            {
                "params": [p for _, p in members],
                "lr": lr,
                "weight_decay": weight_decay * wd_mult,
                "wd_mult": wd_mult,
                "lr_mult": 1.0,
            }
        )
    return param_groups, group_of


def make_main_param(
    key: str,
    param: torch.nn.Parameter,
    chunk: torch.nn.Module,
    group: int,
    tp_rank: int,
    *,
    flat: bool,
    etp_rank: int | None = None,
) -> MainParam | None:
    """``param``'s piece on this rank (None when it is empty: the distributed optimizer's other
    shards); with ``flat`` its master is set later, a view into the flat buffers' masters.
    ``etp_rank`` (default: ``tp_rank``) decides whether an expert-parallel parameter counts."""
    buffer = chunk.buffer_of(param) if isinstance(chunk, DistributedDataParallel) else None
    if buffer is not None:
        local = buffer.local_range(param)
        if local is None:
            return None
        start, end = local
        offset = buffer.buffer_range(param)[0]
        # The buffer is allocated once and zeroed in place, so one view serves every step (a new
        # slice per parameter per step was host time spent right after backward's last sync).
        piece = buffer.grad_data[offset + start : offset + end]

        def grad_view(piece=piece):
            return piece
    else:
        start, end = 0, param.numel()

        def grad_view(p=param):
            return None if p.grad is None else p.grad.view(-1)

    view = param.data.view(-1)[start:end]
    expert = is_expert_parallel(param)
    owns_copy = param.dtype != torch.float32
    if flat:
        main = None  # set by _init_flat_state: a view into the flat masters (or the remainders)
    else:
        main = view.detach().float().clone() if owns_copy else view
    return MainParam(
        key=key,
        model_param=param,
        start=start,
        end=end,
        main=main,
        grad_view=grad_view,
        owns_copy=owns_copy,
        counts_in_norm=counts_in_grad_norm(param, tp_rank if not expert or etp_rank is None else etp_rank),
        group=group,
        buffer=buffer,
        expert=expert,
    )
