"""Global gradient norm, clipping, and the overflow check, across model- and data-parallel ranks.

The global L2 norm is ``sqrt(sum over every *distinct* gradient element of g^2)``. Each rank sums the
squares of the gradients it is responsible for and one all-reduce adds the partial sums:

* a parameter replicated over tensor-parallel ranks (norms, biases of row-parallel layers) counts
  only on tp rank 0;
* the last stage's copy of the tied word embedding does not count: the first stage's copy carries
  the same (all-reduced) gradient (:mod:`mcore.distributed.param_attrs` says how both are marked);
* without the distributed optimizer, data-parallel replicas hold identical gradients, so the sum runs
  over the model-parallel group (tp x pp); with it, each data-parallel rank holds a shard of every
  parameter, so the sum runs over all ranks.

Expert-parallel parameters (MoE routed experts) live on the expert grid: each ep rank holds other
experts and edp ranks hold replicas. Without the distributed optimizer their squares are summed over
``groups.expert_mp`` (etp x ep x pp) in a reduction of their own, and the dense squares over
``groups.mp``; the norm is ``sqrt(dense + expert)``, so every expert counts once however many edp
replicas hold it (a parameter replicated over etp counts on etp rank 0). With the distributed
optimizer each edp rank holds a distinct shard and one sum over all ranks serves both. At ep=1 and
etp=tp the two groups are the same ranks and one reduction does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mcore.distributed.param_attrs import counts_in_grad_norm

__all__ = [
    "clip_grads_",
    "counts_in_grad_norm",
    "global_grad_norm",
    "norm_groups",
    "reduce_norm_squared",
    "unscale_and_check_",
]


def _distributed(group) -> bool:
    """Reduce over ``group`` (None: a one-process job's group, nothing to reduce)."""
    return group is not None and dist.is_available() and dist.is_initialized()


def norm_groups(groups, distributed: bool) -> tuple:
    """``(dense group, expert group)`` the squared norms are summed over; the expert group is ``None``
    when it is the same reduction as the dense one (the distributed optimizer, or ep=1 and etp=tp)."""
    if distributed:
        return groups.world, None
    if groups.ep_size == 1 and groups.etp_size == groups.tp_size:
        return groups.mp, None
    return groups.mp, groups.expert_mp


def _squares(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    if not grads:
        return torch.zeros(1, dtype=torch.float32, device=device)
    norms = torch._foreach_norm(grads, 2.0)
    return torch.stack(norms).square().sum().to(dtype=torch.float32).reshape(1)


def reduce_norm_squared(
    dense_sq: torch.Tensor, expert_sq: torch.Tensor | None, group, expert_group
) -> torch.Tensor:
    """The global sum of squares (shape [1], fp32): ``dense_sq`` summed over ``group`` plus
    ``expert_sq`` over ``expert_group`` (over ``group`` with it when ``expert_group`` is None)."""
    dense_sq = dense_sq.to(torch.float32).reshape(1)
    if expert_sq is not None and expert_group is None:
        dense_sq, expert_sq = dense_sq + expert_sq.to(torch.float32).reshape(1), None
    if _distributed(group):
        dist.all_reduce(dense_sq, group=group)
    if expert_group is None:
        return dense_sq
    expert_sq = (
        torch.zeros_like(dense_sq) if expert_sq is None else expert_sq.to(torch.float32).reshape(1).clone()
    )
    if _distributed(expert_group):
        dist.all_reduce(expert_sq, group=expert_group)
    return dense_sq + expert_sq


def global_grad_norm(
    grads: list[torch.Tensor],
    group,
    device: torch.device,
    expert_grads: list[torch.Tensor] | None = None,
    expert_group=None,
) -> float:
    """L2 norm of ``grads`` summed over ``group`` (``grads``: this rank's counted fp32 gradients), with
    ``expert_grads`` summed over ``expert_group`` (see the module docstring)."""
    expert_sq = None if expert_grads is None else _squares(expert_grads, device)
    total = reduce_norm_squared(_squares(grads, device), expert_sq, group, expert_group)
    return float(total.sqrt().item())


def clip_grads_(grads: list[torch.Tensor], max_norm: float, total_norm: float) -> None:
    """Scale ``grads`` in place so their global norm is at most ``max_norm`` (torch's formula)."""
    coef = max_norm / (total_norm + 1e-6)
    if coef < 1.0 and grads:
        torch._foreach_mul_(grads, coef)


def unscale_and_check_(grads: list[torch.Tensor], inv_scale: float, group, device: torch.device) -> bool:
    """Multiply ``grads`` by ``inv_scale``; True if any gradient on any rank of ``group`` is inf/NaN."""
    found = torch.zeros(1, dtype=torch.float32, device=device)
    if grads:
        inv = torch.full((1,), inv_scale, dtype=torch.float32, device=device)
        try:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
        except (RuntimeError, NotImplementedError):  # a device without the fused AMP kernel
            torch._foreach_mul_(grads, inv_scale)
            finite = torch.stack([torch.isfinite(g).all() for g in grads]).all()
            found.fill_(0.0 if bool(finite) else 1.0)
    if _distributed(group):
        dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
    return bool(found.item() > 0)
