"""What every ``npu_fusion_attention`` caller shares: the dtypes the fused kernels take, the "no limit"
token window, and the compressed causal mask sparse modes 2/3/4 require (one per device). Its own module
so the op adapters (:mod:`.ops`), the ring-attention adapters (:mod:`.cp_ops`) and the adaptor's SBH
attention path import it without importing each other."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_TOCKENS = 2147483647
"""``pre_tockens``/``next_tockens`` meaning "no band limit"."""
COMPRESSED_MASK_SIZE = 2048


_compressed_masks: dict[torch.device, torch.Tensor] = {}


def compressed_causal_mask(device: torch.device) -> torch.Tensor:
    """The 2048x2048 ``triu(ones, 1)`` bool mask sparse modes 2/3/4 require (one per device)."""
    mask = _compressed_masks.get(device)
    if mask is None:
        mask = torch.ones(COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE, dtype=torch.bool, device=device).triu(1)
        _compressed_masks[device] = mask
    return mask
