"""``--log-params-norm``: the L2 norm of all model parameters, as Megatron's ``calc_params_l2_norm``.

``||w|| = sqrt(sum over every distinct parameter element of w^2)``. Each rank sums the squares of the
parameters it holds that count (the rule of the gradient norm, :func:`counts_in_grad_norm`: a
tensor-parallel replica counts on tp rank 0 only, the last stage's copy of the tied embedding not at
all), and one all-reduce over the model-parallel group (tp x pp) adds them. Data-parallel replicas hold
the same parameters, so they are not summed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mcore.distributed.ddp import unwrap_model
from mcore.distributed.param_attrs import counts_in_grad_norm


def params_l2_norm(model: list, groups, device: torch.device) -> torch.Tensor:
    """The global parameter norm as a 0-d fp32 device tensor (not read on the host: the caller reads it
    with the interval's other values). A collective over ``groups.mp`` (every model-parallel rank)."""
    params = [
        p.detach()
        for chunk in model
        for p in unwrap_model(chunk).parameters()
        if counts_in_grad_norm(p, groups.tp_rank)
    ]
    if params:
        total = torch.stack([n.float() for n in torch._foreach_norm(params, 2.0)]).square().sum().to(device)
    else:
        total = torch.zeros((), device=device)
    total = total.reshape(1)
    if groups.mp is not None and dist.is_initialized() and dist.get_world_size(groups.mp) > 1:
        dist.all_reduce(total, group=groups.mp)
    return total.sqrt().reshape(())
