"""Whole (unsharded) model weights in one process: for converters (Hugging Face import/export).

* :func:`load_logical_model_state` assembles every logical model tensor of a checkpoint saved at any
  layout, on the CPU, without ``torch.distributed``.
* :func:`save_logical_model_checkpoint` writes such a dict as a model-only checkpoint (a TP=1, PP=1,
  DP=1 layout) that ``--load DIR --finetune`` loads at any layout (the loader reshards it).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from mcore.checkpoint.buffers import BUFFER, BUFFER_SUFFIXES
from mcore.checkpoint.format import (
    FORMAT,
    METADATA,
    CheckpointError,
    model_file,
    new_tmp_token,
    no_checkpoint_message,
    tensor_crc32,
    tmp_dir_name,
    write_torch_file,
)
from mcore.checkpoint.geometry import full_placement
from mcore.checkpoint.load import resolve_iteration_dir
from mcore.checkpoint.save import _record, publish, run_config_dict

VOCAB_PADDED_NAMES = frozenset(
    {"embedding.word_embeddings.weight", "output_layer.weight"}
    | {"lm_head.output_layer.weight", "lm_head.output_layer.bias"}  # T5
)
"""Logical tensors whose dim 0 is the padded vocabulary (informational in the metadata: the loading
model's own shard specs decide how rows are re-padded)."""


def _iteration_dir(ckpt_dir: str | os.PathLike, iteration: int | str | None) -> Path:
    path = Path(ckpt_dir)
    from mcore.checkpoint.megatron.detect import is_iteration_dir

    if iteration is None and ((path / METADATA).is_file() or is_iteration_dir(path)):
        return path  # an iteration directory itself (mcore's or Megatron's)
    found = resolve_iteration_dir(path, iteration)
    if found is None:
        raise CheckpointError(no_checkpoint_message(path))
    return found


def load_logical_model_state(
    ckpt_dir: str | os.PathLike,
    iteration: int | str | None = None,
    *,
    use_fp32_master: bool = False,
    verify: bool = True,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every logical model tensor of a checkpoint, whole, on the CPU, in one process.

    Args:
        ckpt_dir: the ``--save`` directory (the tracker's iteration is used unless ``iteration`` is
            given) or an ``iter_XXXXXXX`` directory itself.
        iteration: the iteration to read.
        use_fp32_master: return the optimizer's fp32 master weights (float32) for tensors that have
            them (runs with bf16/fp16 parameters and a saved optimizer) instead of the model weights.
        verify: check every tensor's CRC-32.

    Returns:
        ``(state, metadata)``: ``state`` maps logical names (global layer numbers, e.g.
        ``decoder.layers.3.mlp.linear_fc1.weight``, SwiGLU fc1 as ``[gate; up]``) to tensors in the
        saved dtype; padded-vocabulary tensors keep the saved padded rows (``metadata["extra"]``
        holds ``tokenizer_vocab_size`` when the training loop saved it); persistent buffers too (the MoE
        router's ``decoder.layers.{L}.mlp.router.expert_bias``). ``metadata`` is the parsed
        ``metadata.json``: ``run_config`` (every config group as a dict), ``layout``, ``iteration``,
        ``train_state``, ... (``records``, the per-shard index, is included).

    Raises:
        CheckpointError: a missing, truncated or corrupted file, or shards that do not cover a tensor.
    """
    path = _iteration_dir(ckpt_dir, iteration)
    from mcore.checkpoint.megatron.detect import open_reader, read_any_metadata

    meta = read_any_metadata(path)  # mcore's format, or Megatron-LM's torch / torch_dist
    reader = open_reader(path, meta, verify=verify)
    out: dict[str, torch.Tensor] = {}
    for name in reader.names("param"):
        kind = "main_param" if use_fp32_master and reader.has(name, "main_param") else "param"
        shape = reader.global_shape(name, kind)
        dtype = torch.float32 if kind == "main_param" else getattr(torch, reader.dtype(name))
        tensor = torch.empty(shape, dtype=dtype)
        reader.fill(name, kind, full_placement(shape), tensor.view(-1))
        out[name] = tensor
    for name in reader.names(BUFFER):  # persistent buffers (the MoE router's expert_bias)
        shape = reader.global_shape(name, BUFFER)
        tensor = torch.empty(shape, dtype=getattr(torch, reader.dtype(name, BUFFER)))
        reader.fill(name, BUFFER, full_placement(shape), tensor.view(-1))
        out[name] = tensor
    reader.close()
    return out, meta


def save_logical_model_checkpoint(
    ckpt_dir: str | os.PathLike,
    logical_state: dict[str, torch.Tensor],
    run_config: Any = None,
    *,
    iteration: int = 0,
    metadata: dict | None = None,
) -> Path:
    """Write whole logical tensors as a model-only checkpoint loadable with ``--load ckpt_dir --finetune``
    (or ``--no-load-optim --no-load-rng``) at any TP/PP/DP layout. One process, no ``torch.distributed``.

    Args:
        ckpt_dir: the checkpoint root; ``iter_XXXXXXX/`` and the tracker file are written in it
            (atomically, as the training loop does).
        logical_state: logical name -> whole tensor, with the names and shapes of
            :meth:`mcore.models.gpt.gpt_model.GPTModel.sharded_parameters` (global layer numbers; QKV in
            mcore's per-group packed layout; SwiGLU fc1 as ``[gate; up]``; a word embedding with
            ``V`` or padded rows: the loader zero-fills or cuts rows to its padded vocabulary).
            A tied model has no ``output_layer.weight``. Names ending in
            :data:`mcore.checkpoint.buffers.BUFFER_SUFFIXES` (``.expert_bias``) are stored as buffers.
        run_config: the run configuration (``RunConfig`` or ``{group: dict}``) to store, e.g. the
            model flags the weights were converted for.
        iteration: the iteration number of the directory (0 by default).
        metadata: extra JSON-able facts stored under ``"extra"`` (e.g. ``tokenizer_vocab_size``).

    Returns:
        The iteration directory written.
    """
    root = Path(ckpt_dir)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / tmp_dir_name(iteration, new_tmp_token())
    tmp.mkdir()
    fname = model_file(0, 0)
    tensors, records = {}, []
    for name, value in logical_state.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"logical_state[{name!r}] is a {type(value).__name__}, not a tensor")
        t = torch.empty(tuple(value.shape), dtype=value.dtype)
        t.copy_(value.detach())
        tensors[name] = t
        kind = BUFFER if name.endswith(BUFFER_SUFFIXES) else "param"
        rec = _record(name, kind, fname, name, t, full_placement(t.shape), None)
        rec["vocab_padded"] = name in VOCAB_PADDED_NAMES
        rec["crc32"] = tensor_crc32(t)
        records.append(rec)
    try:
        write_torch_file(tmp / fname, tensors)
    except CheckpointError:
        shutil.rmtree(tmp, ignore_errors=True)  # a full disk needs the space back
        raise
    meta = {
        "format": FORMAT,
        "iteration": int(iteration),
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "torch_version": torch.__version__,
        "layout": {
            "tensor_model_parallel_size": 1,
            "pipeline_model_parallel_size": 1,
            "data_parallel_size": 1,
            "context_parallel_size": 1,
            "virtual_pipeline_model_parallel_size": 1,
            "world_size": 1,
            "parallel_order": "tp-cp-dp-pp",
            "use_distributed_optimizer": False,
            "ranks": {"0": "tp=0 pp=0 dp=0"},
        },
        "train_state": {"iteration": int(iteration)},
        "scheduler": None,
        "optimizer": {"saved": False, "type": None, "grad_scaler": None, "param_groups": []},
        "rng_saved": False,
        "model_only": True,
        "run_config": run_config_dict(run_config),
        "extra": dict(metadata or {}),
        "files": {fname: {"size": (tmp / fname).stat().st_size, "rank": 0}},
        "records": records,
    }
    return publish(root, tmp, iteration, meta)
