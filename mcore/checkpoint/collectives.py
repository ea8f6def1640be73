"""Small collective helpers of the checkpoint code: no-ops in a single process (no process group, or
a world of one), else torch.distributed's object collectives over the default group."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if initialized() else 1


def broadcast_object(obj: Any) -> Any:
    if not initialized() or world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_object(obj: Any) -> list[Any] | None:
    """Every rank's ``obj`` on rank 0 (None elsewhere)."""
    if not initialized() or world_size() == 1:
        return [obj]
    out = [None] * world_size() if rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def all_gather_object(obj: Any) -> list[Any]:
    if not initialized() or world_size() == 1:
        return [obj]
    out = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def barrier() -> None:
    if initialized() and world_size() > 1:
        dist.barrier()
