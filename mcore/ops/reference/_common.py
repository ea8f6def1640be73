"""What every reference op shares: the compute dtype of reductions (at least fp32)."""

from __future__ import annotations

import torch


def _wide(x: torch.Tensor) -> torch.Tensor:
    """``x`` in its compute dtype: at least fp32."""
    return x.to(torch.promote_types(x.dtype, torch.float32))
