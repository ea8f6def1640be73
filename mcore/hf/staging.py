"""What every family's export and import share: dtypes, the files of a Hugging Face directory, and
the staging that puts a conversion in place only once it has passed its parity check.

Export writes into a fresh sibling directory (:func:`staged_output_dir`) that replaces ``--save`` only
when the block ends without an error. Import reads ``config.json`` and the weights
(:func:`read_hf_config`, :func:`read_hf_weights`), stages the tokenizer files beside ``--save``
(:func:`tokenizer_staging_dir`) and moves them under it (:data:`TOKENIZER_SUBDIR`) when the
checkpoint is written.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any

import torch

from mcore.data.config import TokenizerConfig
from mcore.hf.errors import ConversionError
from mcore.utils.outputs import OutputError, check_output_dir, staged_dir, with_umask

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
        _save_shard(save_file, shards[0], os.path.join(out_dir, "model.safetensors"))
        return ["model.safetensors"]
    files, weight_map = [], {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        _save_shard(save_file, shard, os.path.join(out_dir, name))
        files.append(name)
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return [*files, "model.safetensors.index.json"]


def _save_shard(save_file, tensors: Mapping[str, torch.Tensor], path: str) -> None:
    """``save_file`` (safetensors), its errors (a full disk raises safetensors' own error, not an
    OSError) as one line naming the file; the caller's staging removes what was written."""
    try:
        save_file(tensors, path, metadata={"format": "pt"})
        with_umask(path)  # safetensors writes 0600
    except Exception as err:  # noqa: BLE001 - SafetensorError, OSError: one line, not a traceback
        raise ConversionError(f"cannot write {path}: {err}") from None


def write_json(path: str, obj) -> None:
    """``obj`` as indented, key-sorted JSON with a final newline."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


EXPORT_TOOL = "mcore-export-hf"
IMPORT_TOOL = "mcore-import-hf"
REPLACE_FOREIGN_FLAG = "--overwrite-non-export"
"""export-hf's flag that replaces a non-empty ``--save`` which is not an earlier export of it."""


def staged_output_dir(output_dir: str):
    """A fresh directory beside ``output_dir`` (absolute) to write the export into: when the block
    ends without an error it gets the export's marker and replaces ``output_dir``; on any error it is
    removed and ``output_dir`` is left as it was (:func:`mcore.utils.outputs.staged_dir`)."""
    return staged_dir(output_dir, tool=EXPORT_TOOL)


def prepare_output(
    output_dir: str, overwrite: bool, *, replace_foreign: bool = False, load_dir: str | None = None
) -> None:
    """Refuse an export into a file, into or around ``load_dir``, into a non-empty directory without
    ``overwrite``, or over a directory that is not an earlier export without ``replace_foreign``
    (:func:`mcore.utils.outputs.check_output_dir`)."""
    try:
        check_output_dir(
            "--save",
            output_dir,
            tool=EXPORT_TOOL,
            inputs={"--load": load_dir} if load_dir else None,
            overwrite=overwrite,
            replace_flag=REPLACE_FOREIGN_FLAG,
            replace_foreign=replace_foreign,
        )
    except OutputError as err:
        raise ConversionError(str(err)) from None


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

    def load(path: str) -> dict[str, torch.Tensor]:
        try:
            return load_file(path)
        except Exception as err:  # noqa: BLE001 - SafetensorError: a truncated or foreign file, one line
            raise ConversionError(
                f"--hf-dir {hf_dir}: {path} cannot be read (truncated or damaged?): {err}"
            ) from None

    single = os.path.join(hf_dir, "model.safetensors")
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(single):
        return load(single)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map", {})
        state: dict[str, torch.Tensor] = {}
        for name in sorted(set(weight_map.values())):
            path = os.path.join(hf_dir, name)
            if not os.path.isfile(path):
                raise ConversionError(f"{index} names {name}, which is missing")
            state.update(load(path))
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
    check_import_output(os.path.dirname(where), save_dir)
    return vocab_size


def check_import_output(hf_dir: str, save_dir: str) -> None:
    """An import never overwrites, and never writes into or around ``--hf-dir``
    (:func:`mcore.utils.outputs.check_output_dir`)."""
    try:
        check_output_dir(
            "--save", save_dir, tool=IMPORT_TOOL, inputs={"--hf-dir": hf_dir}, overwrite_flag=None
        )
    except OutputError as err:
        raise ConversionError(str(err)) from None


def tokenizer_staging_dir(save_dir: str) -> str:
    """A fresh directory beside ``save_dir`` for the tokenizer files, moved under it once the import
    succeeds (the caller removes what is left of it)."""
    parent = os.path.dirname(os.path.abspath(save_dir))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".tokenizer-", dir=parent)
    with_umask(staging, directory=True)  # it becomes CKPT_DIR/tokenizer: mkdtemp makes it 0700
    return staging


def move_tokenizer_files(staging: str, out_dir: str, save_dir: str) -> str:
    """Move the staged tokenizer files to ``out_dir/tokenizer`` (``out_dir``: the staged ``save_dir``);
    return where they will be once ``out_dir`` is renamed to ``save_dir``."""
    shutil.move(staging, os.path.join(out_dir, TOKENIZER_SUBDIR))
    return os.path.join(os.path.abspath(save_dir), TOKENIZER_SUBDIR)


def staged_import_dir(save_dir: str):
    """The staged directory of an import (:func:`mcore.utils.outputs.staged_dir`): renamed to
    ``save_dir`` once the checkpoint is complete."""
    return staged_dir(save_dir, tool=IMPORT_TOOL)


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
