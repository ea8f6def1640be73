"""A small model, a deterministic global batch, and a Megatron-style training step for DDP tests.

Every data-parallel layout sees the same global batch of ``GLOBAL_BATCH`` samples per step: rank ``r``
of ``dp`` takes samples ``[r * n / dp, (r + 1) * n / dp)`` in micro-batches of ``MICRO_BATCH``, and
each micro-batch loss is divided by the number of micro-batches (as Megatron's schedule does), so
every layout computes the gradient of the same global mean loss.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from mcore.distributed.ddp import DDPConfig, DistributedDataParallel
from mcore.distributed.finalize import finalize_model_grads
from mcore.models.transformer.build_context import default_device
from mcore.optimizer import OptimizerConfig, PrecisionConfig, build_optimizer

IN, OUT = 6, 4
GLOBAL_BATCH, MICRO_BATCH = 8, 2


class Toy(nn.Module):
    """Linear, LayerNorm, GELU, Linear, Tanh, Linear; plus a frozen and an unused parameter."""

    def __init__(self, hidden: int):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(IN, hidden),
            nn.LayerNorm(hidden),
            nn.GELU(),
            nn.Linear(hidden, hidden),
            nn.Tanh(),
            nn.Linear(hidden, OUT),
        )
        self.frozen = nn.Parameter(torch.ones(OUT), requires_grad=False)
        self.unused = nn.Parameter(torch.ones(3, 3))

    def forward(self, x):
        return self.net(x) * self.frozen


def make_model(hidden: int = 16, seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Drawn on the host (the same values on every rank and device), then moved to the rank's device."""
    gen = torch.Generator().manual_seed(seed)
    model = Toy(hidden)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return model.to(device=default_device(), dtype=dtype)


def global_batch(step: int, dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(GLOBAL_BATCH, IN, generator=gen)
    y = torch.randn(GLOBAL_BATCH, OUT, generator=gen)
    return x.to(device=default_device(), dtype=dtype), y.to(default_device())


def build(
    groups,
    *,
    distopt=False,
    overlap=False,
    overlap_param_gather=False,
    bucket=None,
    fp16=False,
    bf16=False,
    optimizer="adam",
    clip_grad=0.5,
    hidden=16,
    lr=0.01,
    optimizer_options=None,
    **precision,
):
    opt_cfg = OptimizerConfig(
        **(optimizer_options or {}),
        optimizer=optimizer,
        weight_decay=0.1,
        clip_grad=clip_grad,
        use_distributed_optimizer=distopt,
        overlap_param_gather=overlap_param_gather,
    )
    prec = PrecisionConfig(fp16=fp16, bf16=bf16, **precision)
    ddp_cfg = DDPConfig(overlap_grad_reduce=overlap, ddp_bucket_size=bucket).with_training(opt_cfg, prec)
    model = DistributedDataParallel(make_model(hidden, dtype=prec.params_dtype), ddp_cfg, groups)
    return model, build_optimizer(opt_cfg, prec, [model], groups, lr=lr)


def train(model, optimizer, groups, steps: int, inject_inf_at=None, start_step: int = 0, snapshots=None):
    """Train steps ``start_step ..``; return per-step ``(global loss, update_successful, grad_norm, scale)``.

    ``inject_inf_at=(step, dp_rank)`` writes an inf into one gradient on that rank at that step;
    ``snapshots``, a list, receives the weights after every step.
    """
    dp, rank = groups.dp_size, groups.dp_rank
    per_rank = GLOBAL_BATCH // dp
    num_micro = per_rank // MICRO_BATCH
    dtype = next(model.parameters()).dtype
    history = []
    for step in range(start_step, start_step + steps):
        optimizer.zero_grad()
        x, y = global_batch(step, dtype)
        x, y = x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank]
        total = torch.zeros((), device=default_device())
        for i in range(num_micro):
            sync = contextlib.nullcontext() if i == num_micro - 1 else model.no_sync()
            with sync:
                sl = slice(i * MICRO_BATCH, (i + 1) * MICRO_BATCH)
                loss = nn.functional.mse_loss(model(x[sl]).float(), y[sl]) / num_micro
                optimizer.scale_loss(loss).backward()
            total += loss.detach()
        if isinstance(model, DistributedDataParallel):  # which reductions started during backward
            model.started_in_backward = [b.grad_started for b in model.buckets]
        finalize_model_grads([model], groups)
        if inject_inf_at is not None and inject_inf_at == (step, rank):
            next(p for p in model.parameters() if p.requires_grad).main_grad.view(-1)[0] = float("inf")
        scale = optimizer.loss_scale
        ok, norm, _ = optimizer.step()
        norm = (
            float(norm) if isinstance(norm, torch.Tensor) else norm
        )  # the one-pass step returns a device tensor
        if isinstance(model, DistributedDataParallel):  # all-gathers still in flight after the step
            model.gathers_in_flight = sum(b.param_handle is not None for b in model.buckets)
        if dist.is_initialized() and dp > 1:
            dist.all_reduce(total, group=groups.dp)
        history.append((total.item() / dp, ok, norm, scale))
        if snapshots is not None:
            snapshots.append(weights(model))
    return history


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()}
