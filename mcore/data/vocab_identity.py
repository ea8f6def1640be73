"""The identity of a vocabulary: which token each id means, as a short digest of the tokenizer's files.

Two tokenizers of the same type and size can still give every id another token (another
``vocab.json``/``merges.txt``, another ``tokenizer.json``). The identity is::

    {"tokenizer_type": "GPT2BPETokenizer", "sha256": "<first 16 hex digits>"}

the SHA-256 over the contents of the files that define the ids (``--vocab-file``, ``--merge-file``,
``--tokenizer-model``: a file, or the tokenizer files of a directory) and the type (not
``--vocab-extra-ids``: its sentinels follow every id of the files); NullTokenizer's identity is its
``--vocab-size``. It depends on
the contents only, so a copy of the files elsewhere (an imported checkpoint's ``tokenizer/``) is the
same vocabulary. None when the files cannot be read (a hub name): nothing is then compared.

It is recorded and compared in two places: checkpoints (``extra["tokenizer_identity"]``, compared on
resume by :func:`mcore.checkpoint.compat.check_compatible`) and datasets (``PREFIX.tokenizer.json``
beside ``PREFIX.bin``/``.idx``, written by preprocessing and merging, compared when a dataset is opened
and when datasets are merged, :func:`check_dataset_vocab`).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from mcore.data.errors import DataError

_DIR_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer.model", "vocab.txt", "spiece.model")
"""The files of a tokenizer directory that define its ids (configs with timestamps are left out)."""

SIDECAR_SUFFIX = ".tokenizer.json"


def _files(config: Any) -> list[str] | None:
    paths = [p for p in (config.vocab_file, config.merge_file) if p]
    model = getattr(config, "tokenizer_model", None)
    if model:
        if os.path.isdir(model):
            paths += [os.path.join(model, n) for n in _DIR_FILES if os.path.isfile(os.path.join(model, n))]
        elif os.path.isfile(model):
            paths.append(model)
        else:
            return None  # a hub name: nothing to hash
    return paths if paths and all(os.path.isfile(p) for p in paths) else None


def tokenizer_identity(config: Any) -> dict[str, Any] | None:
    """The identity of the vocabulary a :class:`~mcore.data.config.TokenizerConfig` names (see the
    module docstring), or None when its files cannot be read."""
    kind = getattr(config, "tokenizer_type", None)
    if kind is None:
        return None
    if kind == "NullTokenizer":
        return {"tokenizer_type": kind, "vocab_size": config.vocab_size}
    paths = _files(config)
    if paths is None:
        return None
    # Not --vocab-extra-ids: the sentinels go after every id the files define (T5 data preprocessed
    # without them is the same vocabulary); the size, which they change, is compared on its own.
    digest = hashlib.sha256(kind.encode())
    for path in paths:
        with open(path, "rb") as f:
            digest.update(hashlib.sha256(f.read()).digest())
    return {"tokenizer_type": kind, "sha256": digest.hexdigest()[:16]}


def describe(identity: dict[str, Any] | None) -> str:
    if not identity:
        return "unknown"
    detail = identity.get("sha256") or f"vocab_size {identity.get('vocab_size')}"
    return f"{identity.get('tokenizer_type')} {detail}"


def sidecar_path(prefix: str) -> str:
    return prefix + SIDECAR_SUFFIX


def read_dataset_vocab(prefix: str) -> dict[str, Any] | None:
    """The identity recorded beside a dataset (None: none recorded, e.g. made by Megatron)."""
    try:
        with open(sidecar_path(prefix), encoding="utf-8") as f:
            identity = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise DataError(f"{sidecar_path(prefix)}: cannot read: {err}") from None
    return identity if isinstance(identity, dict) else None


def write_dataset_vocab(prefix: str, identity: dict[str, Any] | None) -> None:
    """Record ``identity`` beside the dataset ``prefix`` (a temporary name renamed; nothing for None)."""
    if identity is None:
        return
    tmp = f"{sidecar_path(prefix)}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(identity, f, sort_keys=True)
        f.write("\n")
    os.replace(tmp, sidecar_path(prefix))


def same_vocab(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    """False only when both are known and differ."""
    return a is None or b is None or a == b


def check_dataset_vocab(prefix: str, identity: dict[str, Any] | None, flag: str = "--data-path") -> None:
    """Refuse the dataset ``prefix`` when it records another vocabulary than ``identity`` (this run's)."""
    recorded = read_dataset_vocab(prefix)
    if not same_vocab(recorded, identity):
        raise DataError(
            f"{flag} {prefix}: the dataset was made with another tokenizer ({describe(recorded)}, recorded in "
            f"{sidecar_path(prefix)}) than this run's ({describe(identity)}): give the --tokenizer-type and "
            "vocabulary files it was preprocessed with"
        )
