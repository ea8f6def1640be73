"""Token dispatch and combine: bring each token to the ranks holding its experts and the expert
outputs back (Megatron's ``token_dispatcher.py``). Collectives are core code (torch.distributed on
the MoE groups); the permutations are the op table's ``moe_permute`` / ``moe_unpermute``.

Both dispatchers take the local tokens ``x`` [T, H] with ``probs`` [T, E] and ``routing_map`` [T, E]
of all ``E`` experts, and return ``dispatch -> (rows [N, H], tokens_per_expert [E_local])`` with
the rows grouped by local expert (expert order), and ``combine(rows_out) -> [T, H]``, which sums
each token's expert outputs weighted by its probs. EP rank ``r`` holds experts
``[r E_local, (r+1) E_local)``.

* :class:`AllGatherDispatcher` (``allgather``, and the only one at EP = ETP = 1): all-gather ``x``,
  ``probs`` and the map over ``tp_ep`` (ETP x EP ranks, ETP fastest), permute the gathered tokens
  to the local experts; combine unpermutes them (weighted) into the gathered shape and
  reduce-scatters over ``tp_ep``, which also sums the ETP ranks' partial FFN outputs.
* :class:`AllToAllDispatcher` (``alltoall``): permute the local tokens by expert (rows ordered by
  destination EP rank), exchange the per-expert counts, then the rows (``all_to_all_single`` with
  those split sizes) over ``ep``, and regroup the received rows from source-major to local-expert
  major. Combine runs the same steps backwards and unpermutes with the probs. Needs ETP = 1.

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


class AllGatherDispatcher:
    """See module doc. One instance per layer; ``dispatch`` and ``combine`` alternate."""

    def __init__(self, num_experts: int, groups: MoEGroups):
        self.groups = groups
        self.num_local_experts = num_experts // groups.ep_size
        first = groups.ep_rank * self.num_local_experts
        self.local = slice(first, first + self.num_local_experts)

    def dispatch(self, x: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):
        group = self.groups.tp_ep
        self.local_shape = x.shape
        if group_size(group) > 1:
            x = gather_from_sequence_parallel_region(x, group)
            probs = gather_from_sequence_parallel_region(probs, group)
            routing_map = _all_gather(routing_map, group)
        self.gathered_shape = x.shape
        self.probs = probs[:, self.local]
        self.routing_map = routing_map[:, self.local]
        rows, _, self.sorted_indices = get_ops().moe_permute(x, self.routing_map)
        return rows, self.routing_map.sum(dim=0)

    def combine(self, rows: torch.Tensor) -> torch.Tensor:
        out = get_ops().moe_unpermute(
            rows,
            self.sorted_indices,
            tuple(self.gathered_shape),
            probs=self.probs,
            routing_map=self.routing_map,
        )
        self.probs = self.routing_map = self.sorted_indices = None
        if group_size(self.groups.tp_ep) > 1:
            out = reduce_scatter_to_sequence_parallel_region(out, self.groups.tp_ep)
        return out


class AllToAllDispatcher:
    """See module doc."""

    def __init__(self, num_experts: int, groups: MoEGroups):
        if groups.etp_size > 1:
            raise ValueError(
                "--moe-token-dispatcher-type alltoall needs expert_tensor_parallel_size=1 "
                f"(got {groups.etp_size}); use --moe-token-dispatcher-type allgather"
            )
        self.groups = groups
        self.num_experts = num_experts
        self.ep = groups.ep_size
        self.num_local_experts = num_experts // self.ep

    def dispatch(self, x: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):
        self.shape, self.probs, self.routing_map = x.shape, probs, routing_map
        rows, _, self.sorted_indices = get_ops().moe_permute(x, routing_map)
        if self.ep == 1:
            return rows, routing_map.sum(dim=0)
        send_counts = routing_map.sum(dim=0).reshape(self.ep, self.num_local_experts)  # [dest, local e]
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts.contiguous(), group=self.groups.ep)  # [src, local e]
        self.send_splits = send_counts.sum(dim=1).tolist()
        self.recv_splits = recv_counts.sum(dim=1).tolist()
        self.recv_counts = recv_counts.tolist()
        received = _AllToAll.apply(rows, self.recv_splits, self.send_splits, self.groups.ep)
        # source-major [src][local e] -> expert-major [local e][src]
        return _regroup(received, self.recv_counts, transpose=True), recv_counts.sum(dim=0)

    def combine(self, rows: torch.Tensor) -> torch.Tensor:
        if self.ep > 1:
            counts_t = [list(c) for c in zip(*self.recv_counts, strict=True)]  # [local e][src]
            rows = _regroup(rows, counts_t, transpose=True)  # back to [src][local e]
            rows = _AllToAll.apply(rows, self.send_splits, self.recv_splits, self.groups.ep)
        out = get_ops().moe_unpermute(
            rows, self.sorted_indices, tuple(self.shape), probs=self.probs, routing_map=self.routing_map
        )
        self.probs = self.routing_map = self.sorted_indices = None
        return out


def _regroup(rows: torch.Tensor, counts: list[list[int]], transpose: bool) -> torch.Tensor:
    """Rows in chunks ``counts[i][j]`` (i-major) -> the same chunks in j-major order."""
    chunks = rows.split([c for row in counts for c in row])
    n_i, n_j = len(counts), len(counts[0])
    order = [i * n_j + j for j in range(n_j) for i in range(n_i)] if transpose else range(len(chunks))
    return torch.cat([chunks[k] for k in order]) if chunks else rows


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


def build_dispatcher(kind: str, num_experts: int, groups: MoEGroups):
    """The dispatcher of ``--moe-token-dispatcher-type`` (``allgather`` | ``alltoall``)."""
    return (AllToAllDispatcher if kind == "alltoall" else AllGatherDispatcher)(num_experts, groups)
