"""What every family's export and import share: dtypes, the files of a Hugging Face directory, and
the staging that puts a conversion in place only once it has passed its parity check.

Export writes into a fresh sibling directory (:func:`staged_output_dir`) that replaces ``--save`` only
when the block ends without an error. Import reads ``config.json`` and the weights
(:func:`read_hf_config`, :func:`read_hf_weights`), stages the tokenizer files beside ``--save``
(:func:`tokenizer_staging_dir`) and moves them under it (:data:`TOKENIZER_SUBDIR`) when the
checkpoint is written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any

import torch

from mcore.data.config import TokenizerConfig
from mcore.hf.errors import ConversionError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30
TOKENIZER_SUBDIR = "tokenizer"
"""Where an imported checkpoint keeps its tokenizer files (``CKPT_DIR/tokenizer``)."""


# -- dtypes -------------------------------------------------------------------------------------------


def dtype_name(dtype: torch.dtype) -> str:
    """``"float32"``, ``"bfloat16"`` or ``"float16"`` (float32 for any other dtype)."""
    return {v: k for k, v in DTYPES.items()}.get(dtype, "float32")


def export_dtype(dtype: str | torch.dtype | None, state: Mapping[str, torch.Tensor]) -> torch.dtype:
    """The weights dtype of an export: ``dtype`` (a name, or ``"auto"``/None for the checkpoint's
    own, float32 when that is not one of :data:`DTYPES`)."""
    if isinstance(dtype, str):
        dtype = None if dtype == "auto" else DTYPES[dtype]
    if dtype is None:
        dtype = next(iter(state.values())).dtype if state else torch.float32
        dtype = dtype if dtype in DTYPES.values() else torch.float32
    return dtype


def import_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """The weights dtype of an import: ``dtype`` (a name), or None (``"auto"``: as stored)."""
    if isinstance(dtype, str):
        return None if dtype == "auto" else DTYPES[dtype]
    return dtype


# -- export: writing a directory -------------------------------------------------------------------


def write_safetensors(
    tensors: Mapping[str, torch.Tensor], out_dir: str, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
) -> list[str]:
    """``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` shards plus their index."""
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.detach().cpu().contiguous()
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    files, weight_map = [], {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(out_dir, name), metadata={"format": "pt"})
        files.append(name)
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return [*files, "model.safetensors.index.json"]


def write_json(path: str, obj) -> None:
    """``obj`` as indented, key-sorted JSON with a final newline."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


@contextlib.contextmanager
def staged_output_dir(output_dir: str):
    """A fresh directory beside ``output_dir`` (absolute) to write the export into: when the block
    ends without an error it replaces ``output_dir``; on any error it is removed and ``output_dir``
    is left as it was."""
    parent = os.path.dirname(output_dir)
    os.makedirs(parent, exist_ok=True)
    staging = os.path.join(parent, f".{os.path.basename(output_dir)}.tmp-{secrets.token_hex(4)}")
    os.makedirs(staging)
    try:
        yield staging
        if os.path.isdir(output_dir):
            shutil.rmtree(output_dir)
        os.replace(staging, output_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def prepare_output(output_dir: str, overwrite: bool) -> None:
    """Refuse an export into a file, or into a non-empty directory without ``overwrite``."""
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise ConversionError(f"--save {output_dir}: exists and is not a directory")
    if os.path.isdir(output_dir) and os.listdir(output_dir) and not overwrite:
        raise ConversionError(
            f"--save {output_dir}: the directory is not empty (give --overwrite to replace it)"
        )


# -- import: reading a directory --------------------------------------------------------------------


def read_hf_config(hf_dir: str) -> dict:
    """``config.json`` of a Hugging Face model directory, or a :class:`ConversionError` saying why not."""
    if not os.path.isdir(hf_dir):
        raise ConversionError(f"{hf_dir}: not a directory")
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise ConversionError(f"{hf_dir}: not a Hugging Face model directory (no config.json)")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as err:
        raise ConversionError(f"{path}: cannot read: {err}") from None
    if not isinstance(config, dict):
        raise ConversionError(f"{path}: expected a JSON object")
    return config


def read_hf_weights(hf_dir: str) -> dict[str, torch.Tensor]:
    """The state dict in ``model.safetensors`` (or its sharded index), else ``pytorch_model.bin``."""
    from safetensors.torch import load_file

    single = os.path.join(hf_dir, "model.safetensors")
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(single):
        return load_file(single)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map", {})
        state: dict[str, torch.Tensor] = {}
        for name in sorted(set(weight_map.values())):
            path = os.path.join(hf_dir, name)
            if not os.path.isfile(path):
                raise ConversionError(f"{index} names {name}, which is missing")
            state.update(load_file(path))
        return state
    binary = os.path.join(hf_dir, "pytorch_model.bin")
    if os.path.isfile(binary):
        return torch.load(binary, map_location="cpu", weights_only=True)
    raise ConversionError(
        f"{hf_dir}: no weights (model.safetensors, model.safetensors.index.json or pytorch_model.bin)"
    )


def check_word_rows(
    hf_state: Mapping[str, torch.Tensor], word_key: str, vocab_size: int, hf_dir: str
) -> None:
    """Refuse a word embedding whose rows differ from ``config.json``'s ``vocab_size``."""
    if word_key in hf_state and hf_state[word_key].shape[0] != vocab_size:
        raise ConversionError(
            f"{hf_dir}: {word_key} has {hf_state[word_key].shape[0]} rows but vocab_size={vocab_size}"
        )


def check_import_target(hf: Mapping[str, Any], where: str, save_dir: str) -> int:
    """The Hugging Face ``vocab_size`` (``where``: the config.json it came from), after checking that it
    is a positive integer and that ``save_dir`` is empty or absent (an import never overwrites)."""
    vocab_size = hf.get("vocab_size")
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise ConversionError(f"{where}: vocab_size={vocab_size!r} must be a positive integer")
    if os.path.isdir(save_dir) and os.listdir(save_dir):
        raise ConversionError(f"--save {save_dir}: the directory is not empty")
    return vocab_size


def tokenizer_staging_dir(save_dir: str) -> str:
    """A fresh directory beside ``save_dir`` for the tokenizer files, moved under it once the import
    succeeds (the caller removes what is left of it)."""
    parent = os.path.dirname(os.path.abspath(save_dir))
    os.makedirs(parent, exist_ok=True)
    return tempfile.mkdtemp(prefix=".tokenizer-", dir=parent)


def move_tokenizer_files(staging: str, save_dir: str) -> str:
    """Move the staged tokenizer files to ``save_dir/tokenizer``; return that directory."""
    final = os.path.join(os.path.abspath(save_dir), TOKENIZER_SUBDIR)
    shutil.move(staging, final)
    return final


def relocate_tokenizer(config: TokenizerConfig, old: str, new: str) -> TokenizerConfig:
    """``config`` with its file paths under ``old`` moved to ``new``."""

    def move(path: str | None) -> str | None:
        return None if path is None else os.path.join(new, os.path.relpath(path, old))

    return dataclasses.replace(
        config,
        vocab_file=move(config.vocab_file),
        merge_file=move(config.merge_file),
        tokenizer_model=move(config.tokenizer_model),
    )
