"""Position encodings computed on the fly: rotary (RoPE) angles and ALiBi biases. No parameters.

Learned absolute positions are a table and live with the word embeddings
(:mod:`mcore.models.transformer.embeddings`).
"""

from __future__ import annotations

import math

import torch


class RotaryEmbedding(torch.nn.Module):
    """RoPE angles in the "rotate half" convention (Megatron's and Hugging Face Llama's).

    For rotary dim ``r`` (``kv_channels * rotary_percent``) and position ``m``:
    ``inv_freq_i = base^(-2i/r)`` for ``i < r/2`` and the angles are
    ``theta_m = [m * inv_freq, m * inv_freq]`` (the half repeated), which the ``rotary_embedding``
    op applies to the first ``r`` channels of each query and key head.
    """

    def __init__(self, rotary_dim: int, base: float = 10000.0):
        super().__init__()
        if rotary_dim % 2:
            raise ValueError(f"rotary dim {rotary_dim} must be even")
        self.rotary_dim, self.base = rotary_dim, base

    def forward(
        self, seq_len: int, position_ids: torch.Tensor | None = None, device: torch.device | None = None
    ) -> torch.Tensor:
        """Angles ``[s, 1, 1, r]`` (positions ``0..s-1``) or ``[s, b, 1, r]`` from ``position_ids [b, s]``, fp32."""
        if position_ids is not None:
            device = position_ids.device
        exponent = torch.arange(0, self.rotary_dim, 2, dtype=torch.float32, device=device) / self.rotary_dim
        inv_freq = 1.0 / (self.base**exponent)
        if position_ids is None:
            positions = torch.arange(seq_len, dtype=torch.float32, device=device)[:, None]  # [s, 1]
        else:
            positions = position_ids.t().to(torch.float32)  # [s, b]
        freqs = positions[..., None] * inv_freq  # [s, b|1, r/2]
        return torch.cat((freqs, freqs), dim=-1)[:, :, None, :]

    def extra_repr(self) -> str:
        return f"rotary_dim={self.rotary_dim}, base={self.base}"


def alibi_slopes(num_heads: int) -> list[float]:
    """The ALiBi head slopes of Press et al. (2022), as BLOOM and the paper's code compute them.

    For ``n`` a power of two: ``2^(-8k/n)`` for heads ``k = 1..n``. Otherwise the slopes of the
    closest smaller power of two, followed by every other slope of the next power of two.
    """

    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(num_heads).is_integer():
        return power_of_two(num_heads)
    closest = 2 ** math.floor(math.log2(num_heads))
    return power_of_two(closest) + alibi_slopes(2 * closest)[0::2][: num_heads - closest]


def alibi_bias(slopes: torch.Tensor, sq: int, sk: int) -> torch.Tensor:
    """Additive attention bias ``[1, n, sq, sk]``: ``slope_h * (j - i)`` for key ``j``, query ``i``.

    Queries are aligned with the last ``sq`` keys (as the causal mask is), so the bias is
    ``<= 0`` on every visible key and grows more negative with distance.
    """
    query = torch.arange(sk - sq, sk, device=slopes.device, dtype=torch.float32)
    key = torch.arange(sk, device=slopes.device, dtype=torch.float32)
    distance = key[None, :] - query[:, None]  # [sq, sk]
    return (slopes.float()[:, None, None] * distance)[None]
