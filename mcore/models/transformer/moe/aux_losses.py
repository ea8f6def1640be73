"""Load-balancing and z losses of the router, and how their gradient joins the main loss's.

Switch load-balancing loss (Megatron's ``switch_load_balancing_loss_func``), for scores ``P`` [T, E]
(softmax over all experts, or sigmoid scores normalised per token) and the top-k map of those
scores::

    loss = coeff * E / (k * T_total^2) * sum_e (sum_t P[t, e]) * count[e]

``count[e]`` is the number of tokens routed to ``e`` summed over the group that shares the batch
(``tp_cp`` for ``aux_loss`` and ``seq_aux_loss``, ``tp_dp_cp`` and every micro-batch so far for
``global_aux_loss``); ``T_total`` = local tokens x that group's size. ``seq_aux_loss`` applies it to
each sequence (the batch folded into the expert axis) and divides by the batch size.
z-loss (ST-MoE): ``coeff / tp_cp_size * mean_t(logsumexp_e(logits[t])^2)``.

The losses are not added to the model's output: :class:`AuxLossScaler` attaches each to an
activation; its backward hands the loss the gradient ``scale`` = the main loss's backward scale
(fp16 loss scale) / micro-batches (x CP size, since DDP averages over CP as well), which the
pipeline schedule sets on every router before the step (``aux_loss_backward_scale``), so the aux
losses enter the gradient exactly as a term of the mean loss would.
"""

from __future__ import annotations

import torch

from mcore.backend import get_ops


def switch_load_balancing_loss(
    scores: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    total_tokens,
    topk: int,
    num_experts: int,
    coeff: float,
) -> torch.Tensor:
    """``coeff * E / (topk * T^2) * sum_e scores[:, e].sum() * tokens_per_expert[e]`` (see module doc)."""
    per_expert = scores.sum(dim=0)
    return torch.sum(per_expert * tokens_per_expert) * (
        num_experts * coeff / (topk * total_tokens * total_tokens)
    )


def z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    """``coeff * mean_t(logsumexp(logits[t])^2)`` over tokens ``t`` of ``logits`` [T, E]."""
    return torch.mean(torch.square(torch.logsumexp(logits, dim=-1))) * coeff


def scores_for_aux_loss(
    logits: torch.Tensor, topk: int, score_function: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scores [T, E] fp32 the aux losses use and their top-k map [T, E] bool (no bias, no groups).

    For softmax scores the map is the op table's top-k of ``softmax(logits)`` (``moe_topk_routing``
    with ``pre_softmax``: the same choice, one kernel where the backend has one)."""
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
        _, routing_map = get_ops().moe_topk_routing(logits.detach().float(), topk, pre_softmax=True)
        return routing_map, scores
    scores = torch.sigmoid(logits.float())
    scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    top = torch.topk(scores, k=topk, dim=-1).indices
    routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter(1, top, True)
    return routing_map, scores


class AuxLossScaler(torch.autograd.Function):
    """``forward(x, loss, scale) = x``; backward gives ``loss`` the gradient ``scale`` (a float or a
    0-dim tensor), so ``loss`` is minimised with the main loss (Megatron's ``MoEAuxLossAutoScaler``)."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, loss: torch.Tensor, scale) -> torch.Tensor:
        ctx.save_for_backward(loss)
        ctx.scale = scale
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (loss,) = ctx.saved_tensors
        scale = ctx.scale
        if isinstance(scale, torch.Tensor):
            scale = scale.to(device=loss.device, dtype=loss.dtype)
        return grad_output, torch.ones_like(loss) * scale, None


def attach_loss(output: torch.Tensor, loss: torch.Tensor, scale) -> torch.Tensor:
    """``output`` unchanged, with ``loss`` joining the backward (see :class:`AuxLossScaler`)."""
    return AuxLossScaler.apply(output, loss, scale)


def set_aux_loss_backward_scale(model_chunks, scale) -> None:
    """Set ``aux_loss_backward_scale`` on every module of ``model_chunks`` that has one (the MoE
    routers); the schedule calls it once per step with ``loss_scale * cp_size / num_microbatches``."""
    for chunk in model_chunks:
        for module in chunk.modules():
            if hasattr(module, "aux_loss_backward_scale"):
                module.aux_loss_backward_scale = scale
