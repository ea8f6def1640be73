"""On-disk cache of dataset indices, keyed by a hash of what they depend on, data included.

Layout (Megatron's): ``{dir}/{H}-{Class}-{split}-{suffix}`` with suffixes ``description.txt`` and one
``.npy`` per index array. ``H = md5(description)``, where the description is the JSON text (indent 4) of
the dataset's ordered identifiers: Megatron's own fields (class, dataset_path, num_samples, index_split,
random_seed, sequence_length, split, split_matrix, tokenizer) **plus** ``data_fingerprint`` (sizes,
mtimes and an ``.idx`` digest of the files). Megatron's key leaves the data out, so a dataset rewritten
at the same path silently reuses stale indices; here the key changes with the data.

Writes are atomic: each array goes to a temporary name and is renamed; the description is written last,
so its presence marks a complete entry. A directory that cannot be written is not an error: the indices
are then rebuilt in memory on every run (with a warning).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)


def describe(identifiers: Mapping[str, Any]) -> str:
    """The description text: ``json.dumps(identifiers, indent=4)``, nested objects by their identifiers."""
    return json.dumps(identifiers, indent=4, default=lambda obj: obj.unique_identifiers)


def description_hash(description: str) -> str:
    """``md5(description)`` as hex, Megatron's cache key function."""
    return hashlib.md5(description.encode("utf-8"), usedforsecurity=False).hexdigest()


class IndexCache:
    """Reads and writes one dataset's index arrays under ``directory`` (``None``: no caching).

    Args:
        directory: the cache directory, or None.
        description: the description text (see module doc); its hash names the files.
        class_name: ``GPTDataset`` or ``BlendedDataset``.
        split: ``train``, ``valid`` or ``test``.
        names: the arrays, e.g. ``("document_index", "sample_index", "shuffle_index")``.
    """

    def __init__(
        self, directory: str | None, description: str, class_name: str, split: str, names: Sequence[str]
    ) -> None:
        self.directory = directory
        self.description = description
        self.names = tuple(names)
        self.stem = f"{description_hash(description)}-{class_name}-{split}-"

    def path(self, suffix: str) -> str:
        """Path of one cache file (``description.txt`` or ``<name>.npy``)."""
        assert self.directory is not None
        return os.path.join(self.directory, self.stem + suffix)

    def load(self) -> dict[str, np.ndarray] | None:
        """The cached arrays (memory-mapped, read-only), or None on a miss or an unreadable entry."""
        if self.directory is None:
            return None
        paths = [self.path("description.txt")] + [self.path(f"{n}.npy") for n in self.names]
        if not all(os.path.isfile(p) for p in paths):
            return None
        try:
            with open(paths[0], encoding="utf-8") as f:
                if f.read() != self.description:
                    return None
            return {n: np.load(self.path(f"{n}.npy"), mmap_mode="r", allow_pickle=False) for n in self.names}
        except (OSError, ValueError) as err:
            logger.warning("ignoring unreadable index cache %s*: %s", self.path(""), err)
            return None

    def save(self, arrays: Mapping[str, np.ndarray]) -> bool:
        """Write the arrays then the description, each atomically; False if the directory is not writable."""
        if self.directory is None:
            return False
        pid = os.getpid()
        try:
            os.makedirs(self.directory, exist_ok=True)
            for name in self.names:
                final = self.path(f"{name}.npy")
                tmp = f"{final}.{pid}.tmp"
                with open(tmp, "wb") as f:
                    np.save(f, np.ascontiguousarray(arrays[name]), allow_pickle=False)
                os.replace(tmp, final)
            final = self.path("description.txt")
            tmp = f"{final}.{pid}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(self.description)
            os.replace(tmp, final)
            return True
        except OSError as err:
            logger.warning(
                "cannot write the index cache in %s (%s); indices are rebuilt on every run. Pass "
                "--data-cache-path with a writable directory to keep them.",
                self.directory,
                err,
            )
            return False
