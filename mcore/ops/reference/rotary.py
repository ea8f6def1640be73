"""Rotary position embedding, rotate-half convention, partial rotary (kernel:
``backends/cuda/triton_kernels/rotary.py``)."""

from __future__ import annotations

import torch

from mcore.ops.reference._common import _wide


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotary_embedding(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding, non-interleaved ("rotate half") convention.

    Args:
        x: ``[..., d]`` (mcore passes ``[s, b, n, d]``).
        freqs: angles ``theta_{pos, i}`` of shape broadcastable to ``x[..., :r]`` where ``r`` is the
            rotary dim (``r <= d``, even; ``freqs[..., i] == freqs[..., i + r/2]``). Channels past ``r``
            pass through unchanged (``--rotary-percent`` < 1).

    Returns ``x_rot * cos + rotate_half(x_rot) * sin`` on the first ``r`` channels, where
    ``rotate_half([a, b]) = [-b, a]``; computed in fp32, returned in ``x.dtype``.
    """
    rot_dim = freqs.shape[-1]
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    compute = torch.promote_types(x.dtype, torch.float32)
    cos, sin = freqs.to(compute).cos(), freqs.to(compute).sin()
    out = (_wide(x_rot) * cos + _rotate_half(_wide(x_rot)) * sin).to(x.dtype)
    return torch.cat((out, x_pass), dim=-1) if x_pass.numel() else out
