"""Is a checkpoint's model this run's model? Compared before any tensor is read.

The loader copies tensors by logical name and global shape, which changes of layout (TP/PP/DP) need,
but which also lets a different model "load": 8 heads of 4 channels read the QKV weight saved for
4 heads of 8 channels (same shape, rows in another order), another vocabulary or tokenizer gives
every id another row. ``metadata.json`` records the run's configuration (``run_config``) and the
tokenizer's vocabulary size (``extra["tokenizer_vocab_size"]``); :func:`check_compatible` compares
them with this run's and refuses, naming every differing value::

    checkpoint .../iter_0000010 is not compatible with this model: num_attention_heads: the
    checkpoint has 4, this run 8; kv_channels: the checkpoint has 8, this run 4

A vocabulary change (tokenizer size or type) is allowed only with ``--allow-vocab-resize``; the
word embedding and output layer then keep the rows of the ids both vocabularies have
(``min(V_saved, V_now)`` rows), and every other row (new ids and padding) starts at zero, weights,
fp32 masters and Adam moments alike (:func:`zero_rows_from`); rows beyond the new size are dropped.
Checkpoints that do not record a value (a model-only checkpoint written without a run config) are
not compared on it.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from mcore.checkpoint.format import CheckpointError
from mcore.checkpoint.geometry import Placement, _intersect, _sub, pieces

ARCHITECTURE_FIELDS: tuple[str, ...] = (
    # shapes and the order of rows inside the stored tensors
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",  # QKV rows are grouped per head: same shape, another meaning
    "kv_channels",
    "num_query_groups",
    "max_position_embeddings",  # the learned position table's rows (compared for that type only)
    "swiglu",  # fc1 is [gate; up] with it
    "normalization",  # RMSNorm has no bias, LayerNorm's weight means x-hat scaling with one
    "disable_bias_linear",
    "add_qkv_bias",
    "untie_embeddings_and_output_weights",
    # what the weights were trained to compute with
    "position_embedding_type",
    "rotary_percent",  # which channels of each head were rotated
    "apply_residual_connection_post_layernorm",
    # mixture of experts: the stored expert tensors' expert axis and FFN size
    "num_experts",
    "moe_ffn_hidden_size",
    "moe_shared_expert_intermediate_size",
)
"""The ``--model`` flags whose change makes the stored tensors mean something else. Not among them:
sequence length with RoPE, ``--rotary-base`` (context extension changes them on purpose), epsilons,
dropout, recomputation, fusions."""

VOCAB_FLAG = "--allow-vocab-resize"


def _model_section(run_config: Any) -> dict[str, Any] | None:
    """The model flags of a ``RunConfig`` or of a saved ``run_config`` dict."""
    if run_config is None:
        return None
    if isinstance(run_config, dict):
        section = run_config.get("model")
        return section if isinstance(section, dict) else None
    model = getattr(run_config, "model", None)
    return None if model is None else {f: getattr(model, f, None) for f in ARCHITECTURE_FIELDS}


def _tokenizer_type(run_config: Any) -> str | None:
    if run_config is None:
        return None
    if isinstance(run_config, dict):
        section = run_config.get("tokenizer")
        return section.get("tokenizer_type") if isinstance(section, dict) else None
    tokenizer = getattr(run_config, "tokenizer", None)
    return getattr(tokenizer, "tokenizer_type", None)


def _same(saved: Any, now: Any) -> bool:
    if isinstance(saved, float) or isinstance(now, float):
        return saved is not None and now is not None and math.isclose(float(saved), float(now))
    return saved == now


def vocab_rows_kept(meta: dict, tokenizer_vocab_size: int | None) -> int | None:
    """``min(V_saved, V_now)`` when the vocabulary size changed, else None (nothing to zero)."""
    saved = (meta.get("extra") or {}).get("tokenizer_vocab_size")
    if saved is None or tokenizer_vocab_size is None or int(saved) == int(tokenizer_vocab_size):
        return None
    return min(int(saved), int(tokenizer_vocab_size))


def check_compatible(
    path: Any,
    meta: dict,
    run_config: Any,
    *,
    tokenizer_vocab_size: int | None = None,
    allow_vocab_resize: bool = False,
) -> list[str]:
    """Refuse a checkpoint whose model differs from this run's.

    Args:
        path: the iteration directory (named in the error).
        meta: its parsed ``metadata.json``.
        run_config: this run's ``RunConfig`` (``model`` and ``tokenizer`` sections are read).
        tokenizer_vocab_size: this run's tokenizer vocabulary size (unpadded).
        allow_vocab_resize: ``--allow-vocab-resize``: a vocabulary change is allowed.

    Returns:
        The vocabulary changes allowed by ``allow_vocab_resize`` (to log), else ``[]``.

    Raises:
        CheckpointError: naming every differing architecture value, and the vocabulary ones unless
            ``allow_vocab_resize``.
    """
    saved_cfg = meta.get("run_config")
    saved_model, now_model = _model_section(saved_cfg), _model_section(run_config)
    problems: list[str] = []
    if saved_model is not None and now_model is not None:
        for name in ARCHITECTURE_FIELDS:
            if name not in saved_model:
                continue
            saved, now = saved_model[name], now_model.get(name)
            if name == "max_position_embeddings" and not (
                saved_model.get("position_embedding_type")
                == now_model.get("position_embedding_type")
                == "learned_absolute"
            ):
                continue
            if not _same(saved, now):
                problems.append(f"{name}: the checkpoint has {saved!r}, this run {now!r}")

    vocab: list[str] = []
    saved_type, now_type = _tokenizer_type(saved_cfg), _tokenizer_type(run_config)
    if saved_type is not None and now_type is not None and saved_type != now_type:
        vocab.append(f"tokenizer_type: the checkpoint has {saved_type!r}, this run {now_type!r}")
    saved_vocab = (meta.get("extra") or {}).get("tokenizer_vocab_size")
    if (
        saved_vocab is not None
        and tokenizer_vocab_size is not None
        and int(saved_vocab) != int(tokenizer_vocab_size)
    ):
        vocab.append(
            f"tokenizer vocabulary size: the checkpoint has {int(saved_vocab)}, this run {int(tokenizer_vocab_size)}"
        )
    if vocab and not allow_vocab_resize:
        problems += [
            f"{v} (every token id would read another row; pass {VOCAB_FLAG} to keep the rows of the "
            "ids both vocabularies share and start the others at zero)"
            for v in vocab
        ]
    if problems:
        raise CheckpointError(f"checkpoint {path} is not compatible with this model: " + "; ".join(problems))
    return vocab


def zero_rows_from(dest: torch.Tensor, wanted: Placement, first_row: int) -> None:
    """Zero the elements of ``wanted`` (flat data ``dest``) whose logical row (dim 0) is ``>= first_row``."""
    shape = wanted.global_shape
    if not shape or first_row >= shape[0]:
        return
    bounds = ((first_row,) + (0,) * (len(shape) - 1), (shape[0] - first_row, *shape[1:]))
    for piece in pieces(wanted):
        box = _intersect(piece, bounds)
        if box is not None:
            _sub(piece.view(dest), piece, box).zero_()
