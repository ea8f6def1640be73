"""Attention by key blocks, for context parallelism: one block's attention with its log-sum-exp, the
merge of two blocks' partial results, and one block's backward given the merged (final) results.

Ring attention (``--context-parallel-size > 1``) holds a chunk of the queries and sees the keys one
block at a time. Each block gives a partial output normalised over its own keys plus its per-row
log-sum-exp; merging two partials through their log-sum-exps is exact:

    lse = logaddexp(lse_a, lse_b)
    out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b

The backward of a block needs only the final ``out`` and ``lse`` (the flash-attention backward):

    P  = exp(S - lse)                       the block's share of the full softmax
    D  = rowsum(dout * out)                 one value per query row
    dV = P^T dout,  dS = P * (dout V^T - D),  dQ = scale * dS K,  dK = scale * dS^T Q

so the blocks' ``dQ`` sum to the full attention's, and each block's ``dK``/``dV`` are its keys' full
gradients. Layouts are :func:`mcore.ops.reference.attention`'s: ``q [b, n, sq, d]``, ``k``/``v``
``[b, g, sk, d]`` with ``n % g == 0`` (grouped-query attention, kv head ``j`` serves query heads
``j*n/g .. (j+1)*n/g - 1``); ``lse [b, n, sq]``. ``causal`` aligns the triangle at the end (query ``i``
sees keys ``j <= i + sk - sq``), so a diagonal block is ``sq == sk`` and a block of earlier keys is
``causal=False``. A row whose keys are all masked (``causal`` with ``sq > sk``) has ``out`` 0 and
``lse`` -inf; the merge and the backward treat such rows as contributing nothing. No dropout.

Precision: scores, softmax, log-sum-exp and the merge are computed in at least fp32 (float64 stays
float64); ``out`` and the gradients come back in their input's dtype, ``lse`` in the compute dtype
(fp32 for fp32/bf16/fp16 inputs).
"""

from __future__ import annotations

import math

import torch

from mcore.ops.reference._common import _wide


def _expand_kv(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``k`` with each kv head repeated for the ``n / g`` query heads it serves."""
    n, g = q.shape[1], k.shape[1]
    if n % g:
        raise ValueError(f"query heads n={n} are not a multiple of key/value heads g={g}")
    return k if n == g else k.repeat_interleave(n // g, dim=1)


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float | None) -> torch.Tensor:
    """``scale * q k^T`` in the compute dtype, -inf where causally masked: ``[b, n, sq, sk]``."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = torch.matmul(_wide(q), _wide(_expand_kv(q, k)).transpose(-1, -2)) * scale
    if causal:
        sq, sk = q.shape[-2], k.shape[-2]
        future = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(sk - sq + 1)
        s = s.masked_fill(future, float("-inf"))
    return s


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with -inf (rows without a visible key) replaced by 0, so ``exp(S - lse)`` is 0 there."""
    return lse.masked_fill(torch.isneginf(lse), 0.0)


def attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True, scale: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` over one block of keys, and the log-sum-exp of its scaled scores.

    Args:
        q: ``[b, n, sq, d]``.
        k, v: ``[b, g, sk, d]``, ``n % g == 0``.
        causal: query ``i`` sees keys ``j <= i + sk - sq`` (aligned at the end).
        scale: score scale, default ``1/sqrt(d)``.

    Returns ``(out [b, n, sq, d] in q.dtype, lse [b, n, sq] in the compute dtype)`` with
    ``lse = logsumexp_j(S)`` and ``out = softmax(S) v`` (``S`` the scaled, masked scores); rows with
    every key masked give ``out`` 0 and ``lse`` -inf. Equals :func:`attention` where a key is visible.
    """
    s = _scores(q, k, causal, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - _finite(lse).unsqueeze(-1))
    out = torch.matmul(p, _wide(_expand_kv(q, v)))
    return out.to(q.dtype), lse


def attention_with_lse_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One key block's ``(dq, dk, dv)`` given the FINAL (merged over every block) ``out`` and ``lse``.

    Args:
        dout: ``[b, n, sq, d]``, the gradient of the merged output.
        q, k, v, causal, scale: the block's forward arguments (:func:`attention_with_lse`).
        out: ``[b, n, sq, d]``, the merged output; lse: ``[b, n, sq]``, the merged log-sum-exp.

    Returns ``dq [b, n, sq, d]`` (this block's share: the blocks' ``dq`` sum to the full one),
    ``dk, dv [b, g, sk, d]`` (summed over the query heads of each kv head), in q/k/v's dtypes.
    Math in the module docstring; rows with ``lse`` -inf contribute nothing.
    """
    scale_ = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = _scores(q, k, causal, scale_)
    p = torch.exp(s - _finite(_wide(lse)).unsqueeze(-1))
    do, vx = _wide(dout), _wide(_expand_kv(q, v))
    delta = (do * _wide(out)).sum(dim=-1, keepdim=True)
    ds = p * (torch.matmul(do, vx.transpose(-1, -2)) - delta)
    dq = torch.matmul(ds, _wide(_expand_kv(q, k))) * scale_
    dk = torch.matmul(ds.transpose(-1, -2), _wide(q)) * scale_
    dv = torch.matmul(p.transpose(-1, -2), do)
    b, n, g = q.shape[0], q.shape[1], k.shape[1]
    if n != g:  # sum each kv head's gradient over the query heads it serves
        dk = dk.reshape(b, g, n // g, *dk.shape[-2:]).sum(dim=2)
        dv = dv.reshape(b, g, n // g, *dv.shape[-2:]).sum(dim=2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def attention_merge(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two key blocks' partial attentions of the same queries.

    Args:
        out_a, out_b: ``[b, n, sq, d]``, each normalised over its own block's keys.
        lse_a, lse_b: ``[b, n, sq]``, their log-sum-exps (-inf for rows with no visible key).

    Returns ``(out in out_a.dtype, lse in the compute dtype)``: ``lse = logaddexp(lse_a, lse_b)``,
    ``out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b``, in at least fp32; a row -inf in both
    gives ``out`` 0 and ``lse`` -inf.
    """
    la, lb = _wide(lse_a), _wide(lse_b)
    lse = torch.logaddexp(la, lb)
    finite = _finite(lse)
    wa = torch.exp(la - finite).unsqueeze(-1)  # exp(-inf) = 0: a block without keys weighs nothing
    wb = torch.exp(lb - finite).unsqueeze(-1)
    out = wa * _wide(out_a) + wb * _wide(out_b)
    return out.to(out_a.dtype), lse
