"""The batch and the loss under context parallelism.

Each CP rank keeps its zigzag part of every batch tensor (chunks ``r`` and ``2 cp - 1 - r`` of the
sequence, :mod:`mcore.models.transformer.context_parallel.layout`): tokens, labels, loss mask and
position ids along dim 1, an attention mask ``[b, 1, s, s]`` along its query dim 2. The position ids
are the tokens' global positions, so learned positions and RoPE see the same angles as without CP.

The loss is the global token mean ``sum_all(loss * mask) / sum_all(mask)``: each rank's sum and count
are all-reduced over the CP group. Gradients are averaged over ``dp x cp`` by DDP, so the rank
backpropagates ``cp * local_sum / global_count``; the sum of those over the CP ranks divided by ``cp``
is the gradient of the global mean. The count is clamped at 1, so a micro-batch whose tokens are all
masked (on one rank or all) gives 0, not NaN.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mcore.config.fields import ConfigError
from mcore.models.transformer.context_parallel.layout import slice_for_cp

_SEQUENCE_DIM = {"attention_mask": 2}


def slice_batch_for_cp(batch: dict[str, torch.Tensor], cp_rank: int, cp_size: int) -> dict[str, torch.Tensor]:
    """Rank ``cp_rank``'s zigzag part of every ``[b, s, ...]`` tensor of ``batch`` (``attention_mask``
    ``[b, 1, s, s]``: its queries, dim 2). Tensors without a sequence dimension pass unchanged.

    Raises:
        ValueError: a sequence length not divisible by ``2 * cp_size``.
    """
    if cp_size == 1:
        return batch
    out = {}
    for name, tensor in batch.items():
        dim = _SEQUENCE_DIM.get(name, 1)
        out[name] = slice_for_cp(tensor, dim, cp_rank, cp_size) if tensor.dim() > dim else tensor
    return out


def masked_token_mean(
    losses: torch.Tensor, loss_mask: torch.Tensor, cp_group=None, cp_size: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss to backpropagate, global mean to report)`` of per-token ``losses`` under ``loss_mask``.

    Without CP both are ``sum(losses * mask) / max(sum(mask), 1)``. With CP the sum and count are
    all-reduced over ``cp_group`` and the backpropagated loss is ``cp * local_sum / global_count``
    (module docstring).
    """
    losses = losses.float()
    mask = loss_mask.to(losses.device, torch.float32)
    total = (losses * mask).sum()
    if cp_group is None or cp_size == 1:
        loss = total / mask.sum().clamp(min=1.0)
        return loss, loss.detach()
    stats = torch.stack([total.detach(), mask.sum()])
    dist.all_reduce(stats, group=cp_group)
    count = stats[1].clamp(min=1.0)
    return total * cp_size / count, stats[0] / count


def refuse_context_parallel(groups, family: str) -> None:
    """Raise :class:`ConfigError` for a model family that has no context parallelism (BERT, T5);
    ``groups`` None is a single process."""
    if groups is not None and groups.cp_size > 1:
        raise ConfigError(
            f"context_parallel_size={groups.cp_size}: context parallelism is not built for {family}; "
            "use --context-parallel-size 1"
        )
