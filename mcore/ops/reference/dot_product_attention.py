"""Scaled dot-product attention with its softmax: causal and padding masks, an additive bias (ALiBi),
grouped KV heads, attention dropout."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from mcore.ops.reference._common import _wide


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention with causal/padding masks, an additive bias and grouped KV heads.

    Args:
        q: ``[b, n, sq, d]``.
        k, v: ``[b, g, sk, d]`` with ``n % g == 0``; kv head ``j`` serves query heads
            ``j*n/g .. (j+1)*n/g - 1`` (grouped-query attention; ``g == 1`` is multi-query).
        causal: query ``i`` sees keys ``j <= i + (sk - sq)`` (aligned at the end, so a KV cache works).
        mask: bool, broadcastable to ``[b, n, sq, sk]``, True = masked out (Megatron's convention).
        bias: float, broadcastable to ``[b, n, sq, sk]``, added to the scaled scores (ALiBi).
        dropout_p: attention-probability dropout (uses the current RNG: fork the TP tracker outside).
        scale: score scale, default ``1/sqrt(d)``.

    Returns ``[b, n, sq, d]`` in ``q.dtype``; scores and softmax in fp32.
    """
    n, g = q.shape[1], k.shape[1]
    if n != g:
        k = k.repeat_interleave(n // g, dim=1)
        v = v.repeat_interleave(n // g, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.matmul(_wide(q), _wide(k).transpose(-1, -2)) * scale
    if bias is not None:
        scores = scores + bias.to(scores.dtype)
    sq, sk = q.shape[-2], k.shape[-2]
    fill = torch.finfo(scores.dtype).min
    if causal:
        future = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(sk - sq + 1)
        scores = scores.masked_fill(future, fill)
    if mask is not None:
        scores = scores.masked_fill(mask, fill)
    probs = torch.softmax(scores, dim=-1)
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p)
    return torch.matmul(probs.to(v.dtype), v)
