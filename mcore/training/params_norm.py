"""``--log-params-norm``: the L2 norm of all model parameters, as Megatron's ``calc_params_l2_norm``.

``||w|| = sqrt(sum over every distinct parameter element of w^2)``. Each rank sums the squares of the
parameters it holds that count (the rule of the gradient norm, :func:`counts_in_grad_norm`: a
tensor-parallel replica counts on tp rank 0 only, the last stage's copy of the tied embedding not at
all), and one all-reduce over the model-parallel group (tp x pp) adds them. Data-parallel replicas hold
the same parameters, so they are not summed. Routed experts (expert parallelism) are summed over the
expert model-parallel group (etp x ep x pp) instead, counted on etp rank 0 when replicated over etp
(:func:`mcore.optimizer.clip_grads.norm_groups`), so each expert counts once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mcore.distributed.ddp import unwrap_model
from mcore.distributed.param_attrs import counts_in_grad_norm, is_expert_parallel
from mcore.optimizer.clip_grads import norm_groups, reduce_norm_squared


def _squares(params: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    if not params:
        return torch.zeros((), device=device)
    return torch.stack([n.float() for n in torch._foreach_norm(params, 2.0)]).square().sum().to(device)


def params_l2_norm(model: list, groups, device: torch.device) -> torch.Tensor:
    """The global parameter norm as a 0-d fp32 device tensor (not read on the host: the caller reads it
    with the interval's other values). A collective over ``groups.mp`` (every model-parallel rank)."""
    group, expert_group = norm_groups(groups, distributed=False)
    dense, expert = [], []
    for chunk in model:
        for p in unwrap_model(chunk).parameters():
            is_expert = is_expert_parallel(p)
            if counts_in_grad_norm(p, groups.etp_rank if is_expert else groups.tp_rank):
                (expert if is_expert and expert_group is not None else dense).append(p.detach())
    expert_sq = _squares(expert, device) if expert_group is not None else None
    if group is not None and (not dist.is_initialized() or dist.get_world_size(group) == 1):
        group = None
    return reduce_norm_squared(_squares(dense, device), expert_sq, group, expert_group).sqrt().reshape(())
