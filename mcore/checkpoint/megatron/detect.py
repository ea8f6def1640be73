"""Which checkpoint format an iteration directory holds, and the reader for it.

* ``mcore``: ``metadata.json`` with ``"format": "mcore.checkpoint/1"`` (:mod:`mcore.checkpoint.format`);
* ``megatron-torch``: ``mp_rank_*`` directories (:mod:`.read_torch`);
* ``megatron-torch_dist``: ``metadata.json`` with ``"sharded_backend"`` (:mod:`.read_dist`).

All three share Megatron's tree (``latest_checkpointed_iteration.txt``, ``iter_0000100/``, ``release/``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mcore.checkpoint.format import CheckpointError, read_metadata
from mcore.checkpoint.megatron.read_dist import (
    FORMAT_TORCH_DIST,
    MegatronDistReader,
    is_torch_dist_dir,
    read_dist_metadata,
)
from mcore.checkpoint.megatron.read_torch import FORMAT_TORCH, MegatronTorchReader, read_torch_metadata
from mcore.checkpoint.reader import ShardReader

MEGATRON_FORMATS = (FORMAT_TORCH, FORMAT_TORCH_DIST)


def detect_format(iter_dir: str | Path) -> str:
    """``"mcore"``, ``"megatron-torch"`` or ``"megatron-torch_dist"`` (``"mcore"`` when unsure: its
    reader gives the precise error)."""
    iter_dir = Path(iter_dir)
    if is_torch_dist_dir(iter_dir):
        return FORMAT_TORCH_DIST
    if iter_dir.is_dir() and not (iter_dir / "metadata.json").exists() and any(iter_dir.glob("mp_rank_*")):
        return FORMAT_TORCH
    return "mcore"


def is_iteration_dir(path: str | Path) -> bool:
    """Whether ``path`` is an iteration directory itself (rather than a ``--save`` root)."""
    path = Path(path)
    return (path / "metadata.json").is_file() or detect_format(path) == FORMAT_TORCH


def read_any_metadata(iter_dir: str | Path) -> dict[str, Any]:
    """The loader's metadata of an iteration directory in any of the three formats."""
    iter_dir = Path(iter_dir)
    fmt = detect_format(iter_dir)
    if fmt == FORMAT_TORCH:
        return read_torch_metadata(iter_dir)
    if fmt == FORMAT_TORCH_DIST:
        return read_dist_metadata(iter_dir)
    return read_metadata(iter_dir)


def open_reader(iter_dir: str | Path, meta: dict[str, Any], *, verify: bool = True) -> ShardReader:
    """The :class:`ShardReader` for ``meta``'s format."""
    cls = {FORMAT_TORCH: MegatronTorchReader, FORMAT_TORCH_DIST: MegatronDistReader}.get(
        meta.get("format"), ShardReader
    )
    return cls(iter_dir, meta, verify=verify)


def check_megatron_load(path: Path, meta: dict[str, Any], *, load_optim: bool) -> str | None:
    """For a Megatron checkpoint: refuse an optimizer-state load that cannot be served (no state saved,
    or a layout :mod:`.read_optim` does not map, naming the file) and return the line to log about what
    is and is not restored; None for an mcore checkpoint.

    Raises:
        CheckpointError: the run asks for the optimizer state (neither ``--no-load-optim`` nor
            ``--finetune``) and the checkpoint has none, or one that cannot be read.
    """
    if meta.get("format") not in MEGATRON_FORMATS:
        return None
    info = meta.get("megatron", {})
    instead = (
        "load it with --no-load-optim (resume: the weights, the iteration and the consumed samples, with "
        "a fresh optimizer and learning-rate schedule, as Megatron does with --no-load-optim) or "
        "--finetune (the weights only, from iteration 0)"
    )
    if load_optim and info.get("optimizer_error"):
        raise CheckpointError(f"{info['optimizer_error']}; {instead}")
    if load_optim and not (meta.get("optimizer") or {}).get("saved"):
        held = (
            "holds optimizer state that mcore does not read"
            if info.get("has_optimizer")
            else "holds no optimizer state"
        )
        raise CheckpointError(f"{path} is a Megatron-LM checkpoint ({meta['format']}) that {held}: {instead}")
    restored = "model weights"
    if load_optim:
        restored += ", Adam state (exp_avg, exp_avg_sq, step" + (
            ", fp32 main params)" if any(r["kind"] == "main_param" for r in meta["records"]) else ")"
        )
        if meta.get("scheduler") is not None:
            restored += ", learning-rate schedule"
    return (
        f"  Megatron-LM checkpoint ({meta['format']}, checkpoint_version "
        f"{info.get('checkpoint_version')}): {restored} loaded; Megatron's RNG states are not "
        "restored (the run's --seed is used)"
    )
