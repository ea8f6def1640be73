"""The communication of context-parallel attention: the ring's KV hand-over and the Ulysses all-to-all.

Ring: every rank sends a buffer to the next rank of the CP group and receives one from the previous
rank, as non-blocking point-to-point operations (``torch.distributed.batch_isend_irecv``) so that
the next block travels while the current one is computed. The peers are global ranks of the group.

All-to-all (Ulysses): ``[s_l, b, h, d]`` local sequence, all heads <-> ``[cp s_l, b, h/cp, d]`` all
sequences (rank-major, i.e. the zigzag parts of rank 0, then rank 1, ...), this rank's head slice.
Each is the other's backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class RingExchange:
    """Send ``buffer`` to the next CP rank and receive the previous rank's into a new buffer.

    ``tag`` keeps two exchanges in flight between the same peers apart (the backward's K/V and dK/dV).
    ``start`` posts the operations and returns at once; ``wait`` blocks until both completed and
    returns the received buffer.
    """

    def __init__(self, group: dist.ProcessGroup, tag: int = 0):
        self.group, self.tag = group, tag
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        self.next_rank = dist.get_global_rank(group, (rank + 1) % size)
        self.prev_rank = dist.get_global_rank(group, (rank - 1) % size)
        self._requests: list = []
        self._received: torch.Tensor | None = None

    def start(self, buffer: torch.Tensor) -> RingExchange:
        buffer = buffer.contiguous()
        self._received = torch.empty_like(buffer)
        ops = [
            dist.P2POp(dist.isend, buffer, self.next_rank, self.group, self.tag),
            dist.P2POp(dist.irecv, self._received, self.prev_rank, self.group, self.tag),
        ]
        self._requests = dist.batch_isend_irecv(ops)
        return self

    def wait(self) -> torch.Tensor:
        for request in self._requests:
            request.wait()
        self._requests = []
        received, self._received = self._received, None
        return received


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``all_to_all_single`` along dim 0 (``x [cp, ...]``: block ``j`` goes to rank ``j``)."""
    x = x.contiguous()
    out = torch.empty_like(x)  # after contiguous(): empty_like keeps a permuted input's strides
    dist.all_to_all_single(out, x, group=group)
    return out


def _seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    cp = dist.get_world_size(group)
    s, b, h, d = x.shape
    blocks = x.reshape(s, b, cp, h // cp, d).permute(2, 0, 1, 3, 4)  # [cp, s, b, h/cp, d]
    return _all_to_all(blocks, group).reshape(cp * s, b, h // cp, d)


def _heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    cp = dist.get_world_size(group)
    s_all, b, hc, d = x.shape
    blocks = _all_to_all(x.reshape(cp, s_all // cp, b, hc, d), group)  # block j: rank j's heads
    return blocks.permute(1, 2, 0, 3, 4).reshape(s_all // cp, b, cp * hc, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad, ctx.group), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _heads_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad, ctx.group), None


def seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[s_l, b, h, d] -> [cp s_l, b, h/cp, d]`` (every rank's sequence, rank-major; heads
    ``c h/cp .. (c+1) h/cp - 1`` on CP rank ``c``). Differentiable."""
    return _SeqToHeads.apply(x, group)


def heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The inverse of :func:`seq_to_heads`. Differentiable."""
    return _HeadsToSeq.apply(x, group)
