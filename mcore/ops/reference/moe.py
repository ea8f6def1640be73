"""Mixture-of-experts ops: the router's top-k selection, token permute/unpermute by a routing map, and
the grouped GEMM over per-expert token counts (kernels: ``backends/cuda/moe.py``,
``backends/npu/moe_ops.py``).

Shapes: ``T`` tokens on this rank, ``E`` experts (local ones for permute/GEMM), ``H`` hidden,
``N`` routed (token, expert) pairs (``routing_map.sum()``), ``K``/``M`` a GEMM's in/out features.

All four are local computations (the dispatchers' collectives stay in the core) and differentiable by
plain autograd here; index tensors are int64. Semantics are Megatron-Core's
(``moe_utils.topk_routing_with_score_function``, ``permute``/``unpermute`` with a routing map).
"""

from __future__ import annotations

import torch

from mcore.ops.reference._common import _wide

SCORE_FUNCTIONS = ("softmax", "sigmoid")


def check_routing_args(logits, topk, score_function, num_groups, group_topk, expert_bias) -> None:
    if logits.dim() != 2:
        raise ValueError(f"moe_topk_routing: logits must be [tokens, experts], got {tuple(logits.shape)}")
    num_experts = logits.shape[1]
    if not 1 <= topk <= num_experts:
        raise ValueError(f"moe_topk_routing: topk={topk} must be in [1, num_experts={num_experts}]")
    if score_function not in SCORE_FUNCTIONS:
        raise ValueError(
            f"moe_topk_routing: score_function={score_function!r} is not one of {SCORE_FUNCTIONS}"
        )
    if (num_groups is None) != (group_topk is None):
        raise ValueError(
            f"moe_topk_routing: num_groups={num_groups} and group_topk={group_topk} must be given together"
        )
    if num_groups is not None:
        if num_experts % num_groups:
            raise ValueError(
                f"moe_topk_routing: num_experts={num_experts} is not divisible by num_groups={num_groups}"
            )
        if (
            not 1 <= group_topk <= num_groups
            or topk % group_topk
            or topk // group_topk > num_experts // num_groups
        ):
            raise ValueError(
                f"moe_topk_routing: group_topk={group_topk} must be in [1, num_groups={num_groups}], divide "
                f"topk={topk}, and topk/group_topk must fit in a group of {num_experts // num_groups} experts"
            )
    if expert_bias is not None and score_function != "sigmoid":
        raise ValueError(
            "moe_topk_routing: expert_bias (aux-loss-free balancing) needs score_function='sigmoid', "
            f"got {score_function!r}"
        )


def _select(scores: torch.Tensor, topk: int, num_groups: int | None, group_topk: int | None) -> torch.Tensor:
    """Indices ``[T, topk]`` of the chosen experts: plain top-k, or top-k within the ``group_topk`` best
    of ``num_groups`` contiguous groups (group score = sum of its ``topk // group_topk`` best scores)."""
    if num_groups is None:
        return torch.topk(scores, topk, dim=-1).indices
    t, e = scores.shape
    grouped = scores.view(t, num_groups, e // num_groups)
    group_scores = grouped.topk(topk // group_topk, dim=-1).values.sum(dim=-1)  # [T, G]
    best_groups = group_scores.topk(group_topk, dim=-1).indices
    allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
    allowed = allowed[:, :, None].expand_as(grouped).reshape(t, e)
    return torch.topk(scores.masked_fill(~allowed, float("-inf")), topk, dim=-1).indices


def moe_topk_routing(
    logits: torch.Tensor,
    topk: int,
    *,
    score_function: str = "softmax",
    pre_softmax: bool = False,
    num_groups: int | None = None,
    group_topk: int | None = None,
    scaling_factor: float | None = None,
    expert_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's top-k: which ``topk`` experts each token goes to, and with which weight.

    Args:
        logits: ``[T, E]`` router logits (the router keeps them fp32).
        topk: experts per token.
        score_function: ``"softmax"``: with ``pre_softmax`` ``p = softmax(logits)`` over all ``E``
            then the top-k of ``p`` (not renormalised); without, the top-k logits then a softmax over
            those ``k``. ``"sigmoid"``: ``s = sigmoid(logits)``; the experts are chosen on
            ``s + expert_bias``, and their weights are the un-biased ``s`` renormalised
            ``s / (sum_k s + 1e-20)`` when ``topk > 1``.
        num_groups, group_topk: group-limited routing (DeepSeek): the experts form ``num_groups``
            contiguous groups; a group's score is the sum of its ``topk // group_topk`` best scores
            (after the bias), and only the ``group_topk`` best groups may be chosen.
        scaling_factor: multiplies the weights last (``--moe-router-topk-scaling-factor``).
        expert_bias: ``[E]`` (sigmoid only): shifts the choice, never the weights; no gradient.

    Returns ``(probs, routing_map)``: ``probs [T, E]`` in at least fp32 (fp32 for fp32/bf16/fp16
    logits), zero off the chosen experts, differentiable w.r.t. ``logits``; ``routing_map [T, E]``
    bool with exactly ``topk`` True per row. Among equal scores ``torch.topk`` chooses (which ones is
    its own; the CUDA backend's kernel takes the lowest experts).
    """
    check_routing_args(logits, topk, score_function, num_groups, group_topk, expert_bias)
    logits = _wide(logits)
    if score_function == "softmax":
        if pre_softmax:
            scores = torch.softmax(logits, dim=-1)
            index = _select(scores, topk, num_groups, group_topk)
            weights = scores.gather(1, index)
        else:
            index = _select(logits, topk, num_groups, group_topk)
            weights = torch.softmax(logits.gather(1, index), dim=-1)
    else:
        scores = torch.sigmoid(logits)
        choice = scores.detach() if expert_bias is None else scores.detach() + expert_bias.to(scores.dtype)
        index = _select(choice, topk, num_groups, group_topk)
        weights = scores.gather(1, index)
        if topk > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if scaling_factor:
        weights = weights * scaling_factor
    probs = torch.zeros_like(logits).scatter(1, index, weights)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, index, True)
    return probs, routing_map


def moe_permute(
    tokens: torch.Tensor,
    routing_map: torch.Tensor,
    probs: torch.Tensor | None = None,
    num_out_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Group the tokens by expert: one row per routed (token, expert) pair, expert-major.

    Args:
        tokens: ``[T, H]``.
        routing_map: ``[T, E]`` bool; ``N = routing_map.sum()`` rows come out (0 is allowed: a rank
            that receives no token).
        probs: ``[T, E]`` router weights, or None.
        num_out_tokens: ``N`` when the caller knows it (a hint for static shapes); must equal it.

    Returns ``(permuted [N, H], permuted_probs [N] or None, sorted_indices [N] int64)``: rows are
    expert 0's tokens in increasing token index, then expert 1's, ...; ``sorted_indices[i]`` is the
    source token of row ``i``, ``permuted_probs[i] = probs[sorted_indices[i], e_i]``. Gradients flow to
    ``tokens`` (summed over a token's rows) and ``probs``.
    """
    if tokens.dim() != 2 or routing_map.dim() != 2 or routing_map.shape[0] != tokens.shape[0]:
        raise ValueError(
            f"moe_permute: tokens {tuple(tokens.shape)} must be [T, H] and routing_map "
            f"{tuple(routing_map.shape)} [T, E]"
        )
    mask = routing_map.bool().t()  # [E, T]: expert-major, token order within an expert
    token_ids = torch.arange(tokens.shape[0], device=tokens.device).expand_as(mask)
    sorted_indices = token_ids.masked_select(mask)
    if num_out_tokens is not None and num_out_tokens != sorted_indices.numel():
        raise ValueError(
            f"moe_permute: num_out_tokens={num_out_tokens} but the routing map routes {sorted_indices.numel()}"
        )
    permuted_probs = None if probs is None else probs.t().masked_select(mask)
    return tokens.index_select(0, sorted_indices), permuted_probs, sorted_indices


def moe_unpermute(
    permuted: torch.Tensor,
    sorted_indices: torch.Tensor,
    restore_shape: tuple[int, int] | torch.Size,
    probs: torch.Tensor | None = None,
    routing_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """The inverse of :func:`moe_permute`, merging each token's expert outputs.

    ``out[sorted_indices[i]] += permuted[i] * probs[t_i, e_i]`` (the weight only when ``probs`` is
    given; it needs the ``routing_map`` that permuted the rows to know each row's expert), summed in
    at least fp32; ``out`` has ``restore_shape = (T, H)`` and ``permuted.dtype``. A token routed
    nowhere gets zeros. Gradients flow to ``permuted`` and ``probs``; without ``probs`` backward keeps
    only the indices (the MoE layer's combine: the experts weighted their rows).
    """
    if probs is not None and routing_map is None:
        raise ValueError("moe_unpermute: probs need the routing_map that permuted the tokens")
    rows = _wide(permuted)
    if probs is not None:
        row_probs = probs.t().masked_select(routing_map.bool().t())
        rows = rows * row_probs.to(rows.dtype)[:, None]
    # scatter_add, not index_add: its backward is a gather by the index alone, while autograd's
    # index_add keeps the rows [N, H] (to expand the gradient to their shape)
    index = sorted_indices[:, None].expand(-1, rows.shape[1])
    out = rows.new_zeros(tuple(restore_shape)).scatter_add(0, index, rows)
    return out.to(permuted.dtype)


def grouped_gemm(x: torch.Tensor, weight: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """Each expert's linear layer on its own rows: ``y[rows of e] = x[rows of e] @ weight[e].T``.

    Args:
        x: ``[N, K]``, rows grouped contiguously by expert, in expert order (:func:`moe_permute`'s).
        weight: ``[E, M, K]`` (stacked ``nn.Linear`` weights, out x in).
        tokens_per_expert: ``[E]`` int64 counts on any device, summing to ``N``; zeros allowed (that
            expert's weight gradient is zero).

    Returns ``y [N, M]`` in ``x``'s dtype. A loop of per-expert matmuls (one host sync for the counts).
    """
    if x.dim() != 2 or weight.dim() != 3 or weight.shape[2] != x.shape[1]:
        raise ValueError(
            f"grouped_gemm: x {tuple(x.shape)} must be [N, K] and weight {tuple(weight.shape)} [E, M, K]"
        )
    counts = [int(c) for c in tokens_per_expert.tolist()]
    if len(counts) != weight.shape[0] or sum(counts) != x.shape[0] or min(counts, default=0) < 0:
        raise ValueError(
            f"grouped_gemm: tokens_per_expert {counts} must have one count >= 0 per expert "
            f"({weight.shape[0]}) summing to x's {x.shape[0]} rows"
        )
    pieces = torch.split(x, counts)
    outs = [piece @ weight[e].t() for e, piece in enumerate(pieces)]
    return torch.cat(outs) if outs else x.new_zeros(0, weight.shape[1])
