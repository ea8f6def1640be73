"""What a training run is made of: its progress (:class:`TrainState`), everything
:func:`mcore.training.pretrain.build_training` builds (:class:`TrainContext`), and what
:func:`~mcore.training.pretrain.pretrain` returns (:class:`TrainResult`)."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class TrainState:
    """Progress that a checkpoint saves and a resume restores."""

    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    skipped_iterations: int = 0
    nan_iterations: int = 0
    floating_point_operations_so_far: float = 0.0


@dataclasses.dataclass
class TrainResult:
    """What :func:`~mcore.training.pretrain.pretrain` returns (the tests compare runs through it)."""

    state: TrainState
    train_losses: list[float]
    valid_loss: float | None
    test_loss: float | None
    exit_reason: str


@dataclasses.dataclass
class TrainContext:
    """A built run, ready to train: what :func:`~mcore.training.pretrain.build_training` returns and
    :meth:`mcore.training.trainer.Trainer.from_context` consumes.

    ``model`` is this rank's model chunks (each wrapped in DDP); ``state`` the progress loaded from
    ``--load`` (fresh without); ``padded_vocab_size`` the model's vocabulary, ``tokenizer_vocab_size``
    the unpadded one. The data iterators are None on ranks that take no data (middle pipeline stages)
    and for splits that have no data; ``has_valid`` / ``has_test`` say, on every rank, whether the
    split exists.
    """

    cfg: Any
    groups: Any
    backend: Any
    tokenizer: Any
    padded_vocab_size: int
    tokenizer_vocab_size: int
    model: list
    optimizer: Any
    scheduler: Any
    batches: Any
    state: TrainState
    train_iter: Any = None
    valid_iter: Any = None
    test_iter: Any = None
    has_valid: bool = False
    has_test: bool = False
    tensor_shapes: Any = None
    """The pipeline schedule's ``tensor_shapes`` (an encoder-decoder model's per-stage shapes; else None)."""
