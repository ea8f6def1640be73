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
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mcore.distributed.param_attrs import counts_in_grad_norm

__all__ = ["clip_grads_", "counts_in_grad_norm", "global_grad_norm", "unscale_and_check_"]


def _distributed(group) -> bool:
    """Reduce over ``group`` (None: a one-process job's group, nothing to reduce)."""
    return group is not None and dist.is_available() and dist.is_initialized()


def global_grad_norm(grads: list[torch.Tensor], group, device: torch.device) -> float:
    """L2 norm of ``grads`` summed over ``group`` (``grads``: this rank's counted fp32 gradients)."""
    if grads:
        norms = torch._foreach_norm(grads, 2.0)
        local = torch.stack(norms).square().sum()
    else:
        local = torch.zeros((), device=device)
    local = local.to(dtype=torch.float32).reshape(1)
    if _distributed(group):
        dist.all_reduce(local, group=group)
    return float(local.sqrt().item())


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
