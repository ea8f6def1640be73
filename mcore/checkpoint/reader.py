"""Reading saved tensors: :class:`ShardReader` reads pieces of logical tensors from one iteration
directory of mcore's format (``metadata.json`` and its shard files); the Megatron-LM readers
(:mod:`mcore.checkpoint.megatron`) subclass it.

For a wanted piece (its placement in the current layout, :mod:`mcore.checkpoint.geometry`) it picks
the saved records of the same logical tensor that overlap it (decided from ``metadata.json`` alone),
opens those files (memory-mapped: only the touched bytes are read), checks sizes and CRCs, and copies
the overlaps. Padded-vocabulary rows the saved layout did not have are zero-filled
(:mod:`mcore.checkpoint.load` explains the padded vocabulary).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mcore.checkpoint.compat import zero_rows_from
from mcore.checkpoint.format import CheckpointError, file_crc32, load_torch_file, tensor_crc32
from mcore.checkpoint.geometry import Placement, copy_into, overlaps, required_elements


class ShardReader:
    """Reads pieces of logical tensors from one iteration directory (see the module docstring)."""

    def __init__(self, iter_dir: str | Path, meta: dict[str, Any], *, verify: bool = True):
        self.dir = Path(iter_dir)
        self.meta = meta
        self.verify = verify
        self.files: dict[str, dict] = meta.get("files", {})
        self.index: dict[tuple[str, str], list[tuple[dict, Placement]]] = {}
        for rec in meta.get("records", []):
            self.index.setdefault((rec["name"], rec["kind"]), []).append((rec, Placement.from_json(rec)))
        self._open: dict[str, dict] = {}
        self._verified: set[tuple[str, str]] = set()
        self.vocab_rows_kept: int | None = None
        """With ``--allow-vocab-resize`` across a vocabulary change: vocabulary rows from this one on
        start at zero (:mod:`mcore.checkpoint.compat`)."""

    # -- what is there ------------------------------------------------------------------------------

    def names(self, kind: str = "param") -> list[str]:
        return sorted({name for name, k in self.index if k == kind})

    def has(self, name: str, kind: str) -> bool:
        return (name, kind) in self.index

    def global_shape(self, name: str, kind: str = "param") -> tuple[int, ...]:
        return tuple(self.index[(name, kind)][0][1].global_shape)

    def dtype(self, name: str, kind: str = "param") -> str:
        return self.index[(name, kind)][0][0]["dtype"]

    def scalar(self, name: str, field: str) -> Any:
        """A per-tensor scalar saved with the optimizer records (``step``)."""
        for (n, _), recs in self.index.items():
            if n == name:
                for rec, _ in recs:
                    if field in rec:
                        return rec[field]
        raise CheckpointError(f"{self.dir}: the optimizer state of {name} has no {field!r}")

    # -- reading ------------------------------------------------------------------------------------

    def file(self, name: str) -> dict:
        if name not in self._open:
            info = self.files.get(name)
            if info is None:
                raise CheckpointError(f"{self.dir / name} is not listed in {self.dir / 'metadata.json'}")
            path = self.dir / name
            data = load_torch_file(path, info.get("size"))
            if self.verify and "crc32" in info and file_crc32(path) != info["crc32"]:
                raise CheckpointError(f"shard file {path} fails its checksum (corrupted)")
            self._open[name] = data
        return self._open[name]

    def tensor(self, rec: dict) -> torch.Tensor:
        """The stored data of one record, flat, checked against its size and CRC."""
        path = self.dir / rec["file"]
        data = self.file(rec["file"])
        t = data.get(rec["key"]) if isinstance(data, dict) else None
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"shard file {path} has no tensor {rec['key']!r} (the metadata lists it)")
        if t.numel() != rec["numel"] or str(t.dtype).removeprefix("torch.") != rec["dtype"]:
            raise CheckpointError(
                f"shard file {path}: tensor {rec['key']!r} has {t.numel()} {t.dtype} elements, the metadata "
                f"records {rec['numel']} {rec['dtype']}"
            )
        ident = (rec["file"], rec["key"])
        if self.verify and ident not in self._verified and "crc32" in rec:
            if tensor_crc32(t) != rec["crc32"]:
                raise CheckpointError(
                    f"shard file {path}: tensor {rec['key']!r} fails its checksum (corrupted)"
                )
            self._verified.add(ident)
        return t.reshape(-1)

    def fill(
        self, name: str, kind: str, wanted: Placement, dest: torch.Tensor, *, vocab_padded: bool = False
    ) -> None:
        """Write the saved values of ``wanted`` (a piece of logical tensor ``name``) into ``dest``, the
        piece's flat data (a 1-D view; any dtype).

        Raises:
            CheckpointError: no such tensor, a shape mismatch, or shards that do not cover the piece.
        """
        entries = self.index.get((name, kind))
        what = name if kind == "param" else f"{name} ({kind})"
        if not entries:
            raise CheckpointError(f"{self.dir}: the checkpoint has no tensor {what}")
        saved_shape = entries[0][1].global_shape
        shape = tuple(wanted.global_shape)
        expert_dim = entries[0][0].get("expert_dim")
        if (
            expert_dim is not None
            and len(saved_shape) == len(shape)
            and saved_shape[expert_dim] != shape[expert_dim]
        ):
            raise CheckpointError(
                f"{self.dir}: num_experts mismatch for {what}: the checkpoint has {saved_shape[expert_dim]} "
                f"experts, this model has {shape[expert_dim]} (--num-experts)"
            )
        same = saved_shape[1:] == shape[1:] if vocab_padded else saved_shape == shape
        if not same or len(saved_shape) != len(shape):
            raise CheckpointError(
                f"{self.dir}: shape mismatch for {what}: the checkpoint has {list(saved_shape)}, "
                f"this model has {list(shape)}"
                + (" (only the padded vocabulary dim may differ)" if vocab_padded else "")
            )
        required = required_elements(wanted, saved_shape)
        if required < wanted.numel:
            dest.zero_()  # padded-vocabulary rows the saved layout did not have
        sources = [(p, rec) for rec, p in entries if overlaps(p, wanted)]
        written = copy_into(dest, wanted, [(p, self.tensor(rec)) for p, rec in sources])
        if written != required:
            files = sorted({rec["file"] for _, rec in sources})
            raise CheckpointError(
                f"{self.dir}: the shards of {what} cover {written} of the {required} elements this rank needs "
                f"(read from {', '.join(files) or 'no file'}): shards are missing or overlap"
            )
        if vocab_padded and self.vocab_rows_kept is not None:
            zero_rows_from(dest, wanted, self.vocab_rows_kept)

    def close(self) -> None:
        self._open.clear()
