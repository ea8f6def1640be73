"""The FP8 operand types of the core: what a cast or a gather hands to the FP8 GEMMs."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class Fp8GatheredWeight:
    """A weight quantized once per optimizer step and all-gathered in FP8 (``--fp8-param-gather``,
    :mod:`mcore.distributed.fp8_param_gather`): the FP8 linear uses it instead of casting ``W``.

    Attributes:
        data: ``W_q [N, K]`` in the forward format (e4m3), a view into the all-gathered buffer.
        scale_inv: 0-dim fp32, ``W ~= W_q * scale_inv`` (the same on every data-parallel rank).
    """

    data: torch.Tensor
    scale_inv: torch.Tensor


__all__ = ["Fp8GatheredWeight"]
