"""Position encodings computed on the fly: rotary (RoPE, YaRN) angles and ALiBi biases. No parameters.

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
        inv_freq = self.inv_freq(device)
        if position_ids is None:
            positions = torch.arange(seq_len, dtype=torch.float32, device=device)[:, None]  # [s, 1]
        else:
            positions = position_ids.t().to(torch.float32)  # [s, b]
        freqs = positions[..., None] * inv_freq  # [s, b|1, r/2]
        return torch.cat((freqs, freqs), dim=-1)[:, :, None, :]

    def inv_freq(self, device: torch.device | None) -> torch.Tensor:
        """``[r/2]`` fp32 inverse frequencies ``base^(-2i/r)``."""
        exponent = torch.arange(0, self.rotary_dim, 2, dtype=torch.float32, device=device) / self.rotary_dim
        return 1.0 / (self.base**exponent)

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


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention-temperature factor ``0.1 * mscale * ln(scale) + 1`` (1 for ``scale <= 1``)."""
    return 1.0 if scale <= 1.0 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_correction_range(
    beta_fast: float, beta_slow: float, dim: int, base: float, original_max_positions: int
) -> tuple[int, int]:
    """The channel-pair range over which YaRN ramps from interpolated to extrapolated frequencies.

    Pair ``i`` completes ``L / (2 pi base^(2i/dim))`` rotations over the original context ``L``; the
    pairs doing ``beta_fast`` (low end) and ``beta_slow`` (high end) rotations bound the ramp,
    floored/ceiled and clamped to ``[0, dim - 1]`` (Megatron's ``round_to_int``, HF's ``truncate``).
    """

    def pair(rotations: float) -> float:
        return dim * math.log(original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = math.floor(pair(beta_fast)), math.ceil(pair(beta_slow))
    return max(low, 0), min(high, dim - 1)


class YarnRotaryEmbedding(RotaryEmbedding):
    """YaRN RoPE angles (Peng et al. 2023; DeepSeek-V2/V3's ``rope_scaling: yarn``), rotate-half layout.

    ``inv_freq = inv_interp * (1 - w) + inv_extra * w`` with ``inv_extra_i = base^(-2i/r)``,
    ``inv_interp = inv_extra / scaling_factor`` and ``w_i = 1 - clamp((i - low) / (high - low), 0, 1)``
    over the pairs ``i < r/2`` (:func:`yarn_correction_range`): high-frequency pairs keep their
    frequency, low-frequency pairs are interpolated. The magnitude factor (``mscale``) is not in the
    angles: the attention multiplies the rotated channels by it.
    """

    def __init__(
        self,
        rotary_dim: int,
        base: float = 10000.0,
        scaling_factor: float = 1.0,
        original_max_position_embeddings: int = 4096,
        beta_fast: float = 32.0,
        beta_slow: float = 1.0,
    ):
        super().__init__(rotary_dim, base)
        self.scaling_factor = scaling_factor
        self.original_max_position_embeddings = original_max_position_embeddings
        self.beta_fast, self.beta_slow = beta_fast, beta_slow

    def inv_freq(self, device: torch.device | None) -> torch.Tensor:
        exponent = torch.arange(0, self.rotary_dim, 2, dtype=torch.float32, device=device) / self.rotary_dim
        extra = 1.0 / (self.base**exponent)
        inter = extra / self.scaling_factor
        low, high = yarn_correction_range(
            self.beta_fast, self.beta_slow, self.rotary_dim, self.base, self.original_max_position_embeddings
        )
        span = (high - low) if high != low else 0.001
        ramp = ((torch.arange(self.rotary_dim // 2, dtype=torch.float32, device=device) - low) / span).clamp(
            0, 1
        )
        extra_weight = 1.0 - ramp
        return inter * (1.0 - extra_weight) + extra * extra_weight

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, yarn scaling_factor={self.scaling_factor}, "
            f"original_max_position_embeddings={self.original_max_position_embeddings}, "
            f"beta_fast={self.beta_fast}, beta_slow={self.beta_slow}"
        )
