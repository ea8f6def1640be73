"""Sharded checkpoints: exact resume, loading at any TP/PP/DP layout, crash-safe saves.

On disk (Megatron's tree and tracker file; details in :mod:`mcore.checkpoint.format`)::

    <save>/latest_checkpointed_iteration.txt      the latest complete iteration, replaced atomically
    <save>/iter_0000100/metadata.json             layout, run config, train state, scheduler, grad
                                                  scaler, file sizes, one record per stored tensor
    <save>/iter_0000100/model_tp00_pp000.pt       model shards of each (tp, pp) slice (dp rank 0)
    <save>/iter_0000100/optim_tp00_pp000_dp000.pt fp32 masters and moments (per dp rank with the
                                                  distributed optimizer)
    <save>/iter_0000100/rng_tp00_pp000_dp000.pt   every rank's RNG states

Tensors are stored under their *logical* names (global layer numbers) with the logical box(es) and
flat range each file holds, so a checkpoint saved at one layout loads at any other, optimizer state
included (:mod:`mcore.checkpoint.geometry`).

Training loop API (collective: every rank calls them)
-----------------------------------------------------
``save_checkpoint(config, state, model, optimizer, scheduler, groups, *, run_config=None, metadata=None)``
    Save iteration ``state.iteration`` to ``config.save`` (``--save``); with ``--async-save`` only the
    device-to-host copy blocks and the files are written by a background thread.
``maybe_finalize_async_save(blocking=False)`` / ``wait_for_async_save()``
    Commit a background save once its writes are done (call after each iteration / at the end).
``load_checkpoint(config, model, optimizer, scheduler, groups, *, state_cls=None, seed=None)``
    Load ``--load`` (``--ckpt-step``, ``--no-load-optim``, ``--no-load-rng``, ``--finetune``) at the
    current layout; returns the training state.

Single-process helpers for converters (Hugging Face import/export)
-----------------------------------------------------------------
``load_logical_model_state(ckpt_dir, iteration=None, *, use_fp32_master=False) -> (state, metadata)``
    Assemble every logical model tensor, unsharded, on the CPU, from a checkpoint saved at any layout.
    ``state``: ``{logical name: tensor}`` with :meth:`GPTModel.sharded_parameters` names and shapes
    (e.g. ``decoder.layers.3.self_attention.linear_qkv.weight``; SwiGLU fc1 as ``[gate; up]``; the
    word embedding with its padded rows). ``metadata``: the parsed ``metadata.json``, with
    ``run_config`` (``{group: {flag: value}}``, e.g. ``metadata["run_config"]["model"]["hidden_size"]``),
    ``layout``, ``iteration`` and ``extra["tokenizer_vocab_size"]`` (unpadded vocabulary size) when
    the training loop wrote it.
``save_logical_model_checkpoint(ckpt_dir, logical_state, run_config=None, *, iteration=0, metadata=None)``
    Write such a dict as a model-only checkpoint (TP=1/PP=1 layout, tracker updated) that
    ``--load ckpt_dir --finetune`` loads at any layout; a word embedding may have ``V`` rows (the loader
    zero-fills the padding rows).

Inspecting: ``python -m mcore.checkpoint.inspect DIR`` (iterations, layout, tensor names and shapes;
``--verify`` checks every checksum).
"""

from __future__ import annotations

import importlib
from typing import Any

# Lazy exports: ``mcore.checkpoint.config`` is imported by the flag parser, which must stay light.
_EXPORTS = {
    "CheckpointConfig": "mcore.checkpoint.config",
    "CheckpointError": "mcore.checkpoint.format",
    "list_iterations": "mcore.checkpoint.format",
    "read_metadata": "mcore.checkpoint.format",
    "read_tracker": "mcore.checkpoint.format",
    "ShardReader": "mcore.checkpoint.reader",
    "load_checkpoint": "mcore.checkpoint.load",
    "resolve_iteration_dir": "mcore.checkpoint.load",
    "load_logical_model_state": "mcore.checkpoint.logical",
    "save_logical_model_checkpoint": "mcore.checkpoint.logical",
    "async_save_pending": "mcore.checkpoint.save",
    "maybe_finalize_async_save": "mcore.checkpoint.save",
    "save_checkpoint": "mcore.checkpoint.save",
    "wait_for_async_save": "mcore.checkpoint.save",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mcore.checkpoint' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
