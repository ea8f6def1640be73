"""Ring (p2p) context-parallel attention: K/V blocks travel around the CP group, partials merge by LSE.

Forward, rank ``r`` of ``cp`` (layouts of the ``attention_with_lse`` op: ``q [b, n, s_l, d]``,
``k``/``v [b, g, s_l, d]``, ``s_l = 2 L`` zigzag-local tokens). Step ``i`` holds the K/V block of
rank ``src = (r - i) mod cp``; before computing on it the rank posts the send of that block to
rank ``r + 1`` and the receive of the next one from ``r - 1`` (communication overlapped with
computation). The block's queries/keys follow :func:`~.layout.ring_block_kind`:

* diagonal: ``attention_with_lse(q, k, v, causal=True)``;
* kv_first_half: ``attention_with_lse(q, k[:L], v[:L], causal=False)``;
* q_second_half: ``attention_with_lse(q[L:], k, v, causal=False)``, merged into rows ``L:`` only.

Partials merge exactly through their log-sum-exp (``attention_merge``):
``lse = logaddexp(lse_a, lse_b)``, ``out = e^(lse_a - lse) out_a + e^(lse_b - lse) out_b``, in fp32.

Backward (flash-attention style, from the final ``out`` and ``lse``): the K/V blocks go around the
ring again; each block gives ``(dq, dk, dv) = attention_with_lse_backward(dout, q, k, v, out, lse)``
on the same query/key slices. ``dq`` accumulates locally; ``dk``/``dv`` accumulate (fp32) in a buffer
that travels with its block, one hop behind it, and after ``cp`` hops is back at the block's owner.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mcore.backend import get_ops
from mcore.models.transformer.context_parallel.comm import RingExchange
from mcore.models.transformer.context_parallel.layout import (
    DIAGONAL,
    KV_FIRST_HALF,
    ring_block_kind,
)


def _block_slices(kind: str, causal: bool, half: int) -> tuple[slice, slice, bool]:
    """(query rows, key rows, causal) of one block."""
    everything = slice(None)
    if not causal:
        return everything, everything, False
    if kind == DIAGONAL:
        return everything, everything, True
    if kind == KV_FIRST_HALF:
        return everything, slice(0, half), False
    return slice(half, None), everything, False


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale):
        ops = get_ops()
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        half = q.shape[2] // 2
        kv = torch.stack([k, v])
        exchange = RingExchange(group)
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        for i in range(cp):
            if i < cp - 1:
                exchange.start(kv)  # the next block travels while this one is computed
            rows, keys, block_causal = _block_slices(ring_block_kind(rank, (rank - i) % cp), causal, half)
            o, s = ops.attention_with_lse(
                q[:, :, rows], kv[0][:, :, keys], kv[1][:, :, keys], causal=block_causal, scale=scale
            )
            out[:, :, rows], lse[:, :, rows] = ops.attention_merge(
                out[:, :, rows], lse[:, :, rows], o.float(), s
            )
            if i < cp - 1:
                kv = exchange.wait()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.scale = group, causal, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, causal, scale = ctx.group, ctx.causal, ctx.scale
        ops = get_ops()
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        half = q.shape[2] // 2
        dout = dout.contiguous()
        kv = torch.stack([k, v])
        kv_exchange, dkv_exchange = RingExchange(group, tag=0), RingExchange(group, tag=1)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
        for i in range(cp):
            if i < cp - 1:
                kv_exchange.start(kv)
            rows, keys, block_causal = _block_slices(ring_block_kind(rank, (rank - i) % cp), causal, half)
            dq_b, dk_b, dv_b = ops.attention_with_lse_backward(
                dout[:, :, rows],
                q[:, :, rows],
                kv[0][:, :, keys],
                kv[1][:, :, keys],
                out[:, :, rows],
                lse[:, :, rows],
                causal=block_causal,
                scale=scale,
            )
            dq[:, :, rows] += dq_b.float()
            if i > 0:
                dkv = dkv_exchange.wait()  # this block's dK/dV so far, from the previous rank
            dkv[0][:, :, keys] += dk_b.float()
            dkv[1][:, :, keys] += dv_b.float()
            dkv_exchange.start(dkv)  # one hop behind its block; the last hop brings it home
            if i < cp - 1:
                kv = kv_exchange.wait()
        dkv = dkv_exchange.wait()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def ring_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    causal: bool,
    scale: float,
) -> torch.Tensor:
    """``query [s_l, b, n_p, d]``, ``key``/``value [s_l, b, g_p, d]`` (zigzag-local) -> ``[s_l, b, n_p, d]``."""
    q, k, v = (x.permute(1, 2, 0, 3).contiguous() for x in (query, key, value))
    out = _RingAttention.apply(q, k, v, group, causal, scale)
    return out.permute(2, 0, 1, 3)
