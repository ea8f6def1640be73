"""The on-disk checkpoint format: names, the tracker file, metadata, checksums, durable writes.

Layout (Megatron's directory tree and tracker file; sharded files instead of
``mp_rank_XX/model_optim_rng.pt``)::

    <save>/
      latest_checkpointed_iteration.txt        "100": the latest COMPLETE iteration (written last)
      iter_0000100/
        metadata.json                          rank 0, last: format, iteration, layout, run config,
                                               train state, scheduler, grad scaler, every file's
                                               size and every stored tensor's record (below)
        model_tp00_pp000.pt                    model shards of (tp, pp), written by its dp-rank-0
        optim_tp00_pp000_dp000.pt              optimizer state (fp32 masters, moments) of (tp, pp);
                                               one file per dp rank with the distributed optimizer
        rng_tp00_pp000_dp000.pt                RNG states of the rank at (tp, pp, dp)
      iter_0000200.tmp-3f9a1c/                 a save in progress (or one that was killed)

Each ``.pt`` file is a plain ``torch.save`` dict ``{key: tensor}`` (loaded with ``weights_only=True``
and ``mmap=True``, so a reader touches only the bytes it needs). A *record* in ``metadata.json``
describes one stored tensor::

    {"name": "decoder.layers.3.mlp.linear_fc1.weight",   logical name (global layer numbers)
     "kind": "param" | "exp_avg" | "exp_avg_sq" | "main_param" | "momentum_buffer",
     "file": "model_tp01_pp000.pt", "key": "decoder.layers.3.mlp.linear_fc1.weight",
     "dtype": "float32", "global_shape": [256, 32],       logical (unsharded) shape
     "partition_dim": 0,                                  TP split dim, null when replicated
     "boxes": [[[64, 0], [64, 32]], [[192, 0], [64, 32]]],  the TP-local tensor is these logical
                                                          boxes [offsets, lengths] concatenated along
                                                          partition_dim (two for SwiGLU [gate; up])
     "local_shape": [128, 32],
     "flat_range": [0, 4096],                             the piece of the flattened TP-local tensor
                                                          stored (a distributed-optimizer shard
                                                          holds part of it)
     "numel": 4096, "crc32": 123456789, "vocab_padded": false, "step": 10}
"""

from __future__ import annotations

import json
import os
import re
import secrets
import zlib
from pathlib import Path
from typing import Any

import torch

FORMAT = "mcore.checkpoint/1"
TRACKER = "latest_checkpointed_iteration.txt"
METADATA = "metadata.json"
_ITER_RE = re.compile(r"^iter_(\d{7,})$")
_TMP_RE = re.compile(r"^(iter_\d{7,}|release)\.tmp-[0-9a-f]+$")
_OLD_SUFFIX = ".old-"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded; the message names the file and what is wrong."""


def no_checkpoint_message(path: str | os.PathLike, flag: str | None = "--load") -> str:
    """The one line for a path (given by ``flag``; None: a positional argument) that holds no
    checkpoint, saying what it is instead: missing, a file, a Hugging Face model directory (with the
    command that converts it), or a folder without the tracker file."""
    where = Path(path)
    subject = f"{flag} {path}" if flag else str(path)
    if not where.exists():
        return f"{subject}: no such directory"
    if not where.is_dir():
        return f"{subject} is a file, not a checkpoint directory"
    if (where / "config.json").is_file():
        return (
            f"{subject} is a Hugging Face model directory (config.json), not an mcore or Megatron "
            f"checkpoint: convert it with `mcore-import-hf --hf-dir {path} --save DIR`"
            + (f", then {flag} DIR" if flag else ", then give DIR")
        )
    return f"{subject} holds no checkpoint (no {TRACKER})"


# -- names ------------------------------------------------------------------------------------------


def iter_dir_name(iteration: int | str) -> str:
    """``iter_0000100`` (7 digits, more if needed), or ``release``."""
    return "release" if iteration == "release" else f"iter_{int(iteration):07d}"


def model_file(tp: int, pp: int) -> str:
    return f"model_tp{tp:02d}_pp{pp:03d}.pt"


def expert_model_file(etp: int, ep: int, pp: int) -> str:
    """The routed experts' weights of one (etp, ep, pp) slice, written by its edp rank 0."""
    return f"model_experts_tp{etp:02d}_ep{ep:03d}_pp{pp:03d}.pt"


def optim_file(tp: int, pp: int, dp: int) -> str:
    return f"optim_tp{tp:02d}_pp{pp:03d}_dp{dp:03d}.pt"


def rng_file(tp: int, pp: int, dp: int) -> str:
    return f"rng_tp{tp:02d}_pp{pp:03d}_dp{dp:03d}.pt"


def new_tmp_token() -> str:
    return secrets.token_hex(4)


def tmp_dir_name(iteration: int, token: str) -> str:
    return f"{iter_dir_name(iteration)}.tmp-{token}"


def list_iterations(root: str | os.PathLike) -> list[int]:
    """Complete-looking iteration directories (``iter_*`` holding a metadata file), sorted."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _ITER_RE.match(entry.name)
        if match and (entry / METADATA).is_file():
            found.append(int(match.group(1)))
    return sorted(found)


def list_tmp_dirs(root: str | os.PathLike) -> list[Path]:
    """Directories of saves in progress or killed midway (``iter_XXXXXXX.tmp-<token>``)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and _TMP_RE.match(p.name))


def old_dir_name(iteration: int | str, token: str) -> str:
    """``iter_0000100.old-<token>``: the previous copy of an iteration while a re-save replaces it."""
    return f"{iter_dir_name(iteration)}{_OLD_SUFFIX}{token}"


def list_old_dirs(root: str | os.PathLike, iteration: int | str) -> list[Path]:
    """Complete previous copies of ``iteration`` (``iter_XXXXXXX.old-<token>`` holding a metadata
    file), newest first. A re-save of the same iteration renames the old directory aside, renames the
    new one into place and then removes the old one; a kill between the two renames leaves only this
    copy (the tracker still names the iteration)."""
    root = Path(root)
    if not root.is_dir():
        return []
    prefix = iter_dir_name(iteration) + _OLD_SUFFIX
    found = [p for p in root.iterdir() if p.name.startswith(prefix) and (p / METADATA).is_file()]
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


# -- tracker ----------------------------------------------------------------------------------------


def read_tracker(root: str | os.PathLike) -> int | str | None:
    """The iteration the tracker names (an int, or ``"release"``), or None when there is no tracker.

    Raises:
        CheckpointError: the tracker holds something other than an integer or ``release``.
    """
    path = Path(root) / TRACKER
    if not path.is_file():
        return None
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise CheckpointError(
            f"{path} is damaged ({len(raw)} bytes of binary data): expected an iteration number or "
            f"'release' (complete iterations here: {list_iterations(root) or 'none'}; write one into it, "
            "or choose one with --ckpt-step)"
        ) from None
    if text == "release":
        return "release"
    try:
        value = int(text)
    except ValueError:
        raise CheckpointError(
            f"{path}: expected an iteration number or 'release', found {text[:40]!r}"
        ) from None
    if value < 0:
        raise CheckpointError(f"{path}: negative iteration {value}")
    return value


def write_tracker(root: str | os.PathLike, iteration: int | str) -> None:
    """Atomically replace the tracker: write a temporary file, fsync it, ``os.replace``, fsync the dir."""
    root = Path(root)
    tmp = root / f".{TRACKER}.tmp-{new_tmp_token()}"
    with open(tmp, "w") as f:
        f.write(f"{iteration}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / TRACKER)
    fsync_dir(root)


# -- durable writes ---------------------------------------------------------------------------------


def fsync_file(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_torch_file(path: str | os.PathLike, obj: Any) -> None:
    """``torch.save`` ``obj`` to ``path`` and fsync it.

    Raises:
        CheckpointError: the write failed, naming the file and the OS's reason ("No space left on
            device" on a full disk). The write goes through a Python file so that the OS error is
            seen: torch's own path writer reports a full disk only as "unexpected pos 64 vs 0", and
            even through a file that RuntimeError (from closing the zip archive) is what propagates,
            with the file's OSError as its context.
    """
    try:
        with open(path, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
    except Exception as err:
        cause: BaseException | None = err
        while cause is not None and not isinstance(cause, OSError):
            cause = cause.__cause__ or cause.__context__
        if cause is None:
            raise
        raise CheckpointError(f"cannot write {path}: {cause.strerror or cause}") from None


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename or a new file in ``path`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json(path: str | os.PathLike, obj: Any) -> int:
    """Write ``obj`` as JSON, fsync; returns the size in bytes."""
    records = obj.get("records") if isinstance(obj, dict) else None
    if isinstance(records, list) and records:  # one line per record keeps big indexes readable
        head = json.dumps({k: v for k, v in obj.items() if k != "records"}, indent=1, default=_json_default)
        lines = ",\n".join(
            "  " + json.dumps(r, separators=(",", ":"), default=_json_default) for r in records
        )
        text = (
            f'{head[:-2]},\n "records": [\n{lines}\n ]\n}}\n' if head != "{}" else f'{{"records": [{lines}]}}'
        )
    else:
        text = json.dumps(obj, indent=1, default=_json_default)
    data = text.encode()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return len(data)


def _json_default(obj: Any) -> Any:
    if isinstance(obj, torch.dtype):
        return str(obj).removeprefix("torch.")
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    if isinstance(obj, Path):
        return str(obj)
    return repr(obj)


def read_metadata(iter_dir: str | os.PathLike) -> dict[str, Any]:
    """``metadata.json`` of one iteration directory, checked for format.

    Raises:
        CheckpointError: the directory or its metadata file is missing, unreadable or of another format.
    """
    iter_dir = Path(iter_dir)
    if not iter_dir.is_dir():
        raise CheckpointError(f"checkpoint directory {iter_dir} does not exist")
    path = iter_dir / METADATA
    if not path.is_file():
        legacy = sorted(p.name for p in iter_dir.glob("mp_rank_*"))
        hint = (
            f" (it holds Megatron-LM shards {', '.join(legacy[:3])}: --load, mcore-export-hf, mcore-generate and "
            "mcore-inspect-checkpoint read it directly)"
            if legacy
            else " (an incomplete save?)"
        )
        raise CheckpointError(f"{path} is missing: {iter_dir} is not a complete mcore checkpoint{hint}")
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path} is corrupted or truncated: {err}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise CheckpointError(f"{path}: format {found!r} is not {FORMAT!r}")
    check_metadata_keys(meta, path)
    return meta


# What every reader of metadata.json indexes without a default (key -> the type it must have).
_REQUIRED_KEYS = {"iteration": (int, str), "layout": dict, "files": dict, "records": list}
_REQUIRED_LAYOUT_KEYS = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "data_parallel_size",
    "virtual_pipeline_model_parallel_size",
)
_REQUIRED_RECORD_KEYS = (
    "name",
    "kind",
    "file",
    "key",
    "dtype",
    "numel",
    "global_shape",
    "partition_dim",
    "boxes",
    "flat_range",
)


def check_metadata_keys(meta: dict[str, Any], path: str | os.PathLike) -> None:
    """Every key the loaders read from ``metadata.json`` is there, with the right kind of value.

    Raises:
        CheckpointError: naming ``path`` and the first missing (or mistyped) key.
    """

    def missing(where: str) -> CheckpointError:
        return CheckpointError(
            f"{path}: {where} (the metadata is incomplete: edited, or written by another tool)"
        )

    for key, kind in _REQUIRED_KEYS.items():
        if key not in meta:
            raise missing(f"the key {key!r} is missing")
        if not isinstance(meta[key], kind):
            raise missing(f"{key!r} is a {type(meta[key]).__name__}")
    for key in _REQUIRED_LAYOUT_KEYS:
        if key not in meta["layout"]:
            raise missing(f"the key 'layout.{key}' is missing")
    for i, rec in enumerate(meta["records"]):
        if not isinstance(rec, dict):
            raise missing(f"records[{i}] is a {type(rec).__name__}")
        for key in _REQUIRED_RECORD_KEYS:
            if key not in rec:
                raise missing(f"the key {key!r} is missing from records[{i}] ({rec.get('name', '?')})")


# -- checksums and dtypes ---------------------------------------------------------------------------


def tensor_crc32(tensor: torch.Tensor) -> int:
    """CRC-32 of a CPU tensor's bytes (row-major)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    if t.numel() == 0:
        return 0
    return zlib.crc32(t.view(torch.uint8).numpy()) & 0xFFFFFFFF


def file_crc32(path: str | os.PathLike, chunk: int = 1 << 24) -> int:
    crc = 0
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk)
            if not block:
                return crc & 0xFFFFFFFF
            crc = zlib.crc32(block, crc)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def load_torch_file(path: Path, expected_size: int | None, mmap: bool = True) -> dict[str, Any]:
    """``torch.load`` a checkpoint file after checking it exists and has the recorded size.

    Raises:
        CheckpointError: the file is missing, truncated (or grown), or not a readable torch file.
    """
    if not path.is_file():
        raise CheckpointError(f"shard file {path} is missing")
    size = path.stat().st_size
    if expected_size is not None and size != expected_size:
        raise CheckpointError(
            f"shard file {path} is truncated or damaged: {size} bytes, the metadata records {expected_size}"
        )
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as err:  # noqa: BLE001 - any failure to unpickle is a damaged file
        raise CheckpointError(f"shard file {path} cannot be read (corrupted?): {err}") from None
