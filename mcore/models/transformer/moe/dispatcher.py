"""Token dispatch and combine: bring each token to the ranks holding its experts and the expert
outputs back (Megatron's ``token_dispatcher.py``). Collectives are core code (torch.distributed on
the MoE groups); the permutations are the op table's ``moe_permute`` / ``moe_unpermute``.

Both dispatchers take the local tokens ``x`` [T, H] with ``probs`` [T, E] and ``routing_map`` [T, E]
of all ``E`` experts, and return ``dispatch -> (rows [N, H], tokens_per_expert [E_local],
row_probs [N])`` with the rows grouped by local expert (expert order) and ``row_probs[i]`` the
probability of row ``i``'s (token, expert) pair (fp32, differentiable: the experts apply it in their
activation, Megatron's ``moe_apply_probs_on_input=False`` way), and ``combine(rows_out) -> [T, H]``,
which sums each token's (already weighted) expert outputs: an unweighted unpermute, which keeps
nothing for backward but the indices. EP rank ``r`` holds experts ``[r E_local, (r+1) E_local)``.

* :class:`AllGatherDispatcher` (``allgather``, the default): all-gather ``x``,
  ``probs`` and the map over ``tp_ep`` (ETP x EP ranks, ETP fastest), permute the gathered tokens
  and their probs to the local experts; combine unpermutes them (a sum) into the gathered shape and
  reduce-scatters over ``tp_ep``, which also sums the ETP ranks' partial FFN outputs.
* :class:`AllToAllDispatcher` (``alltoall``): permute the local tokens by expert (rows ordered by
  destination EP rank), exchange the per-expert counts, then the rows and their probs (``all_to_all_single``
  with those split sizes, the fp32 probs as a second exchange) over ``ep``, and regroup the received
  rows from source-major to local-expert major. With ETP > 1 the received rows are then all-gathered over ``etp`` (unequal counts: each ETP
  rank holds its own sequence shard's tokens), so every ETP rank computes its FFN slice for all of
  them (the probs likewise); combine sums the partial outputs over ``etp`` and keeps each rank's own
  rows. Combine runs these steps backwards and unpermutes (a sum). The probs' exchanges send their
  gradients back in backward. The split sizes are read on the host (one sync per layer and
  micro-batch).

A rank or expert receiving no token gets empty tensors and works through (zero-row GEMMs).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mcore.backend import get_ops
from mcore.models.transformer.moe.groups import MoEGroups, group_size
from mcore.tensor_parallel.mappings import (
    all_gather_along_sequence,
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)


def gather_rows(tokens: torch.Tensor, sorted_indices: torch.Tensor) -> torch.Tensor:
    """``rows[i] = tokens[sorted_indices[i]]``: the rows ``moe_permute`` returned, recomputed.

    The experts' first GEMM saves its input rows ([T * topk, H]: 256 MiB a layer for OLMoE's shape,
    eight times the layer's input) for its weight gradient. Where the rows are a local permutation of
    the layer's tokens, which the router's GEMM keeps for its own weight gradient, the MoE layer lets
    autograd save this recipe instead (:class:`~mcore.tensor_parallel.recompute.RecomputeWhenSaved`)
    and backward gathers them again: one memory-bound gather for ``1/topk`` of the memory.
    """
    return tokens.index_select(0, sorted_indices)


class AllGatherDispatcher:
    """See module doc. One instance per layer; ``dispatch`` and ``combine`` alternate."""

    def __init__(self, num_experts: int, groups: MoEGroups):
        self.groups = groups
        self.num_local_experts = num_experts // groups.ep_size
        first = groups.ep_rank * self.num_local_experts
        self.local = slice(first, first + self.num_local_experts)

    def dispatch(
        self, x: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor, topk: int | None = None
    ):
        """``topk``: every token is routed to exactly this many experts (dropless), or None."""
        group = self.groups.tp_ep
        if group_size(group) > 1:
            x = gather_from_sequence_parallel_region(x, group)
            probs = gather_from_sequence_parallel_region(probs, group)
            routing_map = _all_gather(routing_map, group)
        self.gathered_shape = x.shape
        self.routing_map = routing_map[:, self.local]
        # With every expert local, a dropless map routes exactly T * topk pairs: said to the op, it
        # permutes without a host sync.
        every_expert_local = self.num_local_experts == routing_map.shape[1]
        num_out = x.shape[0] * topk if topk is not None and every_expert_local else None
        rows, row_probs, self.sorted_indices = get_ops().moe_permute(
            x, self.routing_map, probs=probs[:, self.local], num_out_tokens=num_out
        )
        self.local_tokens = x if group_size(group) == 1 else None
        return rows, self.routing_map.sum(dim=0), row_probs

    def rows_recipe(self):
        """``(function, *args)`` that recompute the rows :meth:`dispatch` returned from tensors backward
        keeps anyway, or None where the rows came through a collective (see :func:`gather_rows`)."""
        tokens, self.local_tokens = self.local_tokens, None
        return None if tokens is None else (gather_rows, tokens, self.sorted_indices)

    def combine(self, rows: torch.Tensor) -> torch.Tensor:
        # the rows are weighted already (the experts' activation): a plain sum per token
        out = get_ops().moe_unpermute(
            rows, self.sorted_indices, tuple(self.gathered_shape), probs=None, routing_map=self.routing_map
        )
        self.routing_map = self.sorted_indices = None
        if group_size(self.groups.tp_ep) > 1:
            out = reduce_scatter_to_sequence_parallel_region(out, self.groups.tp_ep)
        return out


class AllToAllDispatcher:
    """See module doc."""

    def __init__(self, num_experts: int, groups: MoEGroups):
        self.groups = groups
        self.num_experts = num_experts
        self.ep, self.etp = groups.ep_size, groups.etp_size
        self.num_local_experts = num_experts // self.ep

    def dispatch(
        self, x: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor, topk: int | None = None
    ):
        """``topk``: every token is routed to exactly this many experts (dropless), or None."""
        self.shape, self.routing_map = x.shape, routing_map
        num_out = x.shape[0] * topk if topk is not None else None  # no host sync in the permute
        rows, row_probs, self.sorted_indices = get_ops().moe_permute(
            x, routing_map, probs=probs, num_out_tokens=num_out
        )
        self.local_tokens = x if self.ep == 1 and self.etp == 1 else None
        if self.ep == 1 and self.etp == 1:
            return rows, routing_map.sum(dim=0), row_probs
        send_counts = routing_map.sum(dim=0).reshape(self.ep, self.num_local_experts)  # [dest, local e]
        recv_counts = send_counts
        if self.ep > 1:
            recv_counts = torch.empty_like(send_counts)
            dist.all_to_all_single(recv_counts, send_counts.contiguous(), group=self.groups.ep)  # [src, e]
        self.send_splits = send_counts.sum(dim=1).tolist()
        self.recv_splits = recv_counts.sum(dim=1).tolist()
        if self.ep > 1:  # the fp32 probs as an exchange of their own (the rows are bf16 in training)
            rows = _AllToAll.apply(rows, self.recv_splits, self.send_splits, self.groups.ep)
            row_probs = _AllToAll.apply(row_probs, self.recv_splits, self.send_splits, self.groups.ep)
        if self.etp > 1:  # every ETP rank computes its FFN slice for the tokens of all of them
            recv_counts = all_gather_along_sequence(recv_counts.contiguous(), self.groups.etp)
            self.etp_sizes = recv_counts.reshape(self.etp, -1).sum(dim=1).tolist()
            rows = _AllGatherV.apply(rows, self.etp_sizes, self.groups.etp)  # [(etp src, ep src), local e]
            row_probs = _AllGatherV.apply(row_probs, self.etp_sizes, self.groups.etp)
        self.recv_counts = recv_counts.tolist()
        # source-major [src][local e] -> expert-major [local e][src]
        rows, row_probs = _regroup(rows, self.recv_counts), _regroup(row_probs, self.recv_counts)
        return rows, recv_counts.sum(dim=0), row_probs

    def rows_recipe(self):
        """As :meth:`AllGatherDispatcher.rows_recipe`: only without EP and ETP (no exchange)."""
        tokens, self.local_tokens = self.local_tokens, None
        return None if tokens is None else (gather_rows, tokens, self.sorted_indices)

    def combine(self, rows: torch.Tensor) -> torch.Tensor:
        if self.ep > 1 or self.etp > 1:
            counts_t = [list(c) for c in zip(*self.recv_counts, strict=True)]  # [local e][src]
            rows = _regroup(rows, counts_t)  # back to [src][local e]
        if self.etp > 1:  # sum the ETP ranks' partial outputs, keep this rank's tokens
            rows = _ReduceScatterV.apply(rows, self.etp_sizes, self.groups.etp)
        if self.ep > 1:
            rows = _AllToAll.apply(rows, self.send_splits, self.recv_splits, self.groups.ep)
        out = get_ops().moe_unpermute(  # weighted rows (the experts' activation): a plain sum
            rows, self.sorted_indices, tuple(self.shape), probs=None, routing_map=self.routing_map
        )
        self.routing_map = self.sorted_indices = None
        return out


def _regroup(rows: torch.Tensor, counts: list[list[int]]) -> torch.Tensor:
    """Rows in chunks of ``counts[i][j]`` rows, i-major -> the same chunks, j-major."""
    chunks = rows.split([c for row in counts for c in row])
    n_i, n_j = len(counts), len(counts[0])
    return torch.cat([chunks[i * n_j + j] for j in range(n_j) for i in range(n_i)])


def _all_gather(x: torch.Tensor, group) -> torch.Tensor:
    """All-gather along dim 0 without autograd (the bool routing map travels as uint8)."""
    return all_gather_along_sequence(x.to(torch.uint8), group).bool()


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with split sizes; the backward sends the gradients back."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        out = grad.new_empty((sum(input_splits), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), input_splits, output_splits, group=ctx.group)
        return out, None, None, None


def _all_gather_v(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """Concatenate every rank's ``x`` [sizes[r], ...] in rank order (padded to the largest)."""
    most = max(sizes)
    if most == 0:
        return x
    padded = x.new_zeros((most, *x.shape[1:]))
    padded[: x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat([part[:n] for part, n in zip(parts, sizes)])


def _reduce_scatter_v(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """Sum ``x`` [sum(sizes), ...] over the ranks and keep this rank's ``sizes[rank]`` rows."""
    if sum(sizes) == 0:
        return x
    x = x.clone()
    dist.all_reduce(x, group=group)
    start = sum(sizes[: dist.get_rank(group)])
    return x[start : start + sizes[dist.get_rank(group)]]


class _AllGatherV(torch.autograd.Function):
    """All-gather of unequal row counts; backward: the gradients summed, this rank's rows kept."""

    @staticmethod
    def forward(ctx, x, sizes, group):
        ctx.sizes, ctx.group = sizes, group
        return _all_gather_v(x, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_v(grad, ctx.sizes, ctx.group), None, None


class _ReduceScatterV(torch.autograd.Function):
    """Sum over the ranks and keep this rank's rows; backward: all-gather of the gradients."""

    @staticmethod
    def forward(ctx, x, sizes, group):
        ctx.sizes, ctx.group = sizes, group
        return _reduce_scatter_v(x, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_v(grad, ctx.sizes, ctx.group), None, None


def build_dispatcher(kind: str, num_experts: int, groups: MoEGroups):
    """The dispatcher of ``--moe-token-dispatcher-type`` (``allgather`` | ``alltoall``)."""
    return (AllToAllDispatcher if kind == "alltoall" else AllGatherDispatcher)(num_experts, groups)
