"""The example backend's own kernels. Each must match :mod:`mcore.ops.reference` (the conformance
suite checks forward results and gradients in every dtype the backend claims)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm through torch's ``F.rms_norm`` in fp32 (the weight is applied before rounding)."""
    y = F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps)
    return y.to(torch.promote_types(x.dtype, weight.dtype))


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` on a fused ``[gate, up]`` input, computed in fp32."""
    gate, up = x.float().chunk(2, dim=-1)
    return (gate * torch.sigmoid(gate) * up).to(x.dtype)


def attention(q, k, v, *, causal=True, mask=None, bias=None, dropout_p=0.0, scale=None):
    """``[b, n, s, d]`` attention through ``F.scaled_dot_product_attention``.

    mcore's mask is True = masked out and its causal triangle is aligned at the end (a KV cache);
    SDPA's boolean mask means the opposite and its ``is_causal`` aligns at the start, so one additive
    fp32 mask carries causality, the mask and the bias. GQA: K/V heads are repeated.
    """
    n, g = q.shape[1], k.shape[1]
    if n != g:
        k = k.repeat_interleave(n // g, dim=1)
        v = v.repeat_interleave(n // g, dim=1)
    sq, sk = q.shape[-2], k.shape[-2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    additive = torch.zeros(sq, sk, dtype=torch.float32, device=q.device)
    if bias is not None:
        additive = additive + bias.float()
    lowest = torch.finfo(torch.float32).min  # as the reference: a fully masked row stays finite
    if causal:
        future = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(sk - sq + 1)
        additive = additive.masked_fill(future, lowest)
    if mask is not None:
        additive = additive.masked_fill(mask, lowest)
    out = F.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=additive, dropout_p=dropout_p, scale=scale
    )
    return out.to(q.dtype)


EXAMPLE_OPS = {"rms_norm": rms_norm, "swiglu": swiglu, "attention": attention}
