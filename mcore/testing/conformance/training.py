"""A tiny training run: 2 steps of ``pretrain`` of a Llama-style GPT on a backend, whose losses must
equal the reference backend's (the CPU's) within a tolerance."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from mcore.testing.conformance.compare import ConformanceError
from mcore.testing.distributed import run_distributed

TRAINING_ARGV: tuple[str, ...] = (
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--group-query-attention", "--num-query-groups", "2", "--position-embedding-type", "rope",
    "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
    "--seq-length", "32", "--max-position-embeddings", "32",
    "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2",
    "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "0", "--seed", "1234",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
    "--attention-dropout", "0", "--hidden-dropout", "0", "--num-workers", "0",
    "--eval-iters", "0", "--log-interval", "1000",
)  # fmt: skip
"""A Llama-style GPT small enough for CI (RoPE, RMSNorm, SwiGLU, GQA), no dropout (the kernels' random
streams differ between backends), 2 steps. :func:`training_losses` adds the backend and the layout."""


def training_rank(argv: Sequence[str]) -> list[float]:
    """``pretrain`` with ``argv`` in this rank; the per-iteration losses."""
    from mcore.training.gpt import forward_step, model_provider
    from mcore.training.pretrain import gpt_datasets_provider, pretrain

    result = pretrain(model_provider, forward_step, gpt_datasets_provider, argv=list(argv))
    return [float(x) for x in result.train_losses]


def training_losses(
    backend_name: str,
    world: int = 2,
    extra_argv: Sequence[str] = ("--tensor-model-parallel-size", "2", "--sequence-parallel"),
    rank_setup: Callable | None = None,
    base_argv: Sequence[str] = TRAINING_ARGV,
) -> list[float]:
    """The losses (from the last rank, where they are computed) of a short ``pretrain`` run."""
    argv = [*base_argv, *extra_argv, "--device-backend", backend_name]
    results = run_distributed(training_rank, world, argv, backend=backend_name, rank_setup=rank_setup)
    return results[-1]


_REFERENCE_LOSSES: dict[tuple, list[float]] = {}


def reference_training_losses(
    reference_backend: str = "cpu",
    world: int = 2,
    extra_argv: Sequence[str] = ("--tensor-model-parallel-size", "2", "--sequence-parallel"),
    base_argv: Sequence[str] = TRAINING_ARGV,
) -> list[float]:
    """:func:`training_losses` of the reference backend, computed once per process and argument set."""
    key = (reference_backend, world, tuple(extra_argv), tuple(base_argv))
    if key not in _REFERENCE_LOSSES:
        _REFERENCE_LOSSES[key] = training_losses(reference_backend, world, extra_argv, base_argv=base_argv)
    return list(_REFERENCE_LOSSES[key])


def compare_losses(ours: Sequence[float], theirs: Sequence[float], rtol: float, what: str) -> None:
    """Step-by-step relative comparison of two loss curves (raises :class:`ConformanceError`)."""
    if len(ours) != len(theirs) or not ours or not all(math.isfinite(x) for x in ours):
        raise ConformanceError(f"{what}: losses {list(ours)}, reference {list(theirs)}")
    for step, (a, b) in enumerate(zip(ours, theirs), 1):
        if abs(a - b) > rtol * abs(b):
            raise ConformanceError(
                f"{what}, step {step}: loss {a:.7g} vs reference {b:.7g} "
                f"(relative difference {abs(a - b) / abs(b):.2g} > {rtol})"
            )


def check_training(
    backend_name: str, rank_setup: Callable | None = None, rtol: float = 1e-4, reference_backend: str = "cpu"
) -> tuple[list[float], list[float]]:
    """2 steps at TP=2 with sequence parallelism on ``backend_name`` reproduce ``reference_backend``'s losses."""
    ours = training_losses(backend_name, rank_setup=rank_setup)
    theirs = reference_training_losses(reference_backend)
    compare_losses(ours, theirs, rtol, f"TP=2 training on {backend_name} against {reference_backend}")
    return ours, theirs
