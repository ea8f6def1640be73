"""SIMULATED HCCL: the ``"hccl"`` torch.distributed backend, served by gloo on CPU tensors.

torch_npu registers ``hccl`` with ``Backend.register_backend(..., extended_api=True,
devices=["npu"])`` and a creator that reads a ``ProcessGroupHCCL.Options``.
The double registers the same name for the ``cpu`` device (simulated NPU tensors live there), and
its creator checks the options the way torch_npu does (``hccl_config`` value types) before building
a ``ProcessGroupGloo``. Each creation is recorded in :data:`CREATED_GROUPS` so tests can see which
``hccl_config`` reached which group.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

_CONFIG_TYPES = {
    "hccl_buffer_size": int,
    "group_name": str,
    "qos_service_level": int,
    "qos_traffic_class": int,
    "hccl_op_expansion_mode": int,
    "hccl_buffer_name": str,
}

CREATED_GROUPS: list[dict[str, Any]] = []
"""One record per process group this process created: size, rank, timeout, hccl_config."""


class ProcessGroupHCCL:
    """Namespace mirroring ``torch_npu._C._distributed_c10d.ProcessGroupHCCL``."""

    class Options:
        """``ProcessGroupHCCL.Options``: ``hccl_config`` (a dict) plus the creator-filled fields."""

        def __init__(self) -> None:
            self.hccl_config: dict[str, Any] = {}
            self.is_high_priority_stream = False
            self._timeout = None
            self.global_ranks_in_group: list[int] = []
            self.group_id = ""


def check_options(options: Any) -> None:
    """Validate pg_options the way torch_npu's creator does (raises on a wrong type or value)."""
    if options is None:
        return
    if not isinstance(options, ProcessGroupHCCL.Options):
        raise TypeError(
            f"hccl process groups take ProcessGroupHCCL.Options as pg_options, got {type(options).__name__}"
        )
    for key, value in options.hccl_config.items():
        expected = _CONFIG_TYPES.get(key)
        if expected is None:
            raise RuntimeError(f"unknown hccl_config key {key!r}")
        if not isinstance(value, expected) or isinstance(value, bool):
            raise RuntimeError(f"Value type of {key} should be {expected.__name__}.")
    size = options.hccl_config.get("hccl_buffer_size")
    if size is not None and size < 1:
        raise RuntimeError(f"hccl_buffer_size must be >= 1 (MB), got {size}")
    name = options.hccl_config.get("group_name")
    if name is not None and len(name) > 32:
        raise RuntimeError(f"group_name {name!r} is longer than 32 characters")


def _create_hccl_backend(dist_options, pg_options):
    check_options(pg_options)
    CREATED_GROUPS.append(
        {
            "group_size": dist_options.group_size,
            "group_rank": dist_options.group_rank,
            "global_ranks": list(dist_options.global_ranks_in_group),
            "timeout": dist_options.timeout,
            "hccl_config": dict(pg_options.hccl_config) if pg_options is not None else None,
        }
    )
    return dist.ProcessGroupGloo(
        dist_options.store, dist_options.group_rank, dist_options.group_size, dist_options.timeout
    )


def register_hccl() -> None:
    """Make ``init_process_group("hccl")`` work in this process (gloo underneath)."""
    dist.Backend.register_backend("hccl", _create_hccl_backend, extended_api=True, devices=["cpu"])


def is_hccl_available() -> bool:
    return True
