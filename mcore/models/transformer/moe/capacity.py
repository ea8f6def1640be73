"""Expert capacity and token dropping (``--moe-expert-capacity-factor``; dropless without it).

``capacity = ceil(T * topk / E * factor)`` for ``T`` local tokens (Megatron's ``get_capacity``).
An expert routed more than ``capacity`` tokens keeps, by ``--moe-token-drop-policy``:

* ``probs``: the ``capacity`` tokens with the highest routing probabilities;
* ``position``: the first ``capacity`` tokens in token order.

With ``--moe-pad-expert-input-to-capacity`` the map is the capacity mask itself: every expert gets
exactly ``capacity`` rows (tokens not routed to it come with probability 0, so they add nothing to
the output), giving static shapes.
"""

from __future__ import annotations

import math

import torch


def expert_capacity(num_tokens: int, num_experts: int, topk: int, factor: float) -> int:
    """``ceil(num_tokens * topk / num_experts * factor)``."""
    return math.ceil(num_tokens * topk / num_experts * factor)


def drop_tokens(
    probs: torch.Tensor, routing_map: torch.Tensor, topk: int, factor: float, policy: str, pad: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(probs, routing_map)`` [T, E] after the capacity limit (see the module doc)."""
    num_tokens, num_experts = probs.shape
    capacity = expert_capacity(num_tokens, num_experts, topk, factor)
    if capacity >= num_tokens:
        keep = torch.ones_like(routing_map)
    else:
        if policy == "probs":
            # routed tokens first by probability; unrouted ones (prob 0) only fill a padded capacity
            key = probs.float() + routing_map.float()
        else:
            # routed tokens first, then by position (earliest first)
            position = torch.arange(num_tokens, 0, -1, device=probs.device, dtype=torch.float32)
            key = routing_map.float() * (num_tokens + 1) + position[:, None] / (num_tokens + 1)
        top = torch.topk(key, k=capacity, dim=0).indices
        keep = torch.zeros_like(routing_map).scatter(0, top, True)
    new_map = keep if pad else routing_map & keep
    return probs * new_map, new_map
