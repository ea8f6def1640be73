"""``--empty-unused-memory-level``: give the device allocator's unused cached memory back."""

from __future__ import annotations

import torch


def release_unused_device_memory(device_type: str) -> None:
    """Hand the caching allocator's unused blocks back to the device (the device module's
    ``empty_cache``, found through ``torch.get_device_module``; nothing to do on the CPU)."""
    if device_type == "cpu":
        return
    empty_cache = getattr(torch.get_device_module(device_type), "empty_cache", None)
    if empty_cache is not None:
        empty_cache()
