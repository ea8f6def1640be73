"""Megatron's ``--split`` strings, split matrices and ``--data-path`` blends.

``--split "969, 30, 1"`` gives train/valid/test fractions of the *sequences* of each dataset:

1. the numbers are separated by commas, slashes or spaces (``"969,30,1"``, ``"969, 30, 1"`` and
   ``"99/1"`` all parse); right-pad with zeros to 3 numbers; all must be finite and >= 0; divide by
   their sum (float64). Megatron reads the regex matches of ``[.0-9]+``, so ``"100,-5,5"`` becomes
   100,5,5 there; here a sign or any other character is an error naming the string;
2. the split matrix holds cumulative bookends ``[(0, c1), (c1, c2), (c2, c3)]``; a zero-width split is
   ``None`` (no dataset is built for it);
3. for ``N`` sequences split ``i`` gets ``arange(int(round(lo * N)), int(round(hi * N)))`` (Python's
   round: ties to even).

``"969,30,1"`` -> ``[(0, 0.969), (0.969, 0.999), (0.999, 1.0)]``; on 1000 sequences train is ``[0, 969)``,
valid ``[969, 999)``, test ``[999, 1000)``.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Sequence

import numpy as np

from mcore.config.fields import ConfigError

DEFAULT_SPLIT = "969, 30, 1"
SPLIT_NAMES = ("train", "valid", "test")

SplitMatrix = list  # list[tuple[float, float] | None], one entry per split


def normalize(weights: Sequence[float]) -> list[float]:
    """``weights / sum(weights)`` in float64, as Python floats."""
    w = np.asarray(weights, dtype=np.float64)
    return (w / w.sum()).tolist()


def parse_split(split: str) -> list[float]:
    """Normalized train/valid/test fractions of a ``--split`` string.

    Raises:
        ConfigError: more than three numbers, no positive number, a negative or malformed number.
    """
    values = []
    for token in (t for t in re.split(r"[,/\s]+", split.strip()) if t):
        try:
            value = float(token)
        except ValueError:
            raise ConfigError(
                f"--split {split!r}: {token!r} is not a number (give train,valid,test proportions, e.g. 969,30,1)"
            ) from None
        if not math.isfinite(value) or value < 0:
            raise ConfigError(
                f"--split {split!r}: {token!r} is not a proportion; each of train,valid,test must be a "
                "finite number >= 0 (e.g. 969,30,1; 100,0,0 for no validation or test data)"
            )
        values.append(value)
    if len(values) > 3:
        raise ConfigError(f"--split {split!r} has {len(values)} numbers; give at most 3 (train, valid, test)")
    values += [0.0] * (3 - len(values))
    if sum(values) <= 0:
        raise ConfigError(f"--split {split!r} must contain a positive number")
    return normalize(values)


def split_matrix(vector: Sequence[float]) -> SplitMatrix:
    """Cumulative bookends of a normalized split vector; zero-width splits are ``None``."""
    # Same left-to-right float sums as Megatron, so the bookends are bit-identical to its.
    ends = functools.reduce(lambda acc, x: acc + [acc[-1] + x], vector, [0])
    return [(lo, hi) if hi > lo else None for lo, hi in zip(ends[:-1], ends[1:])]


def split_ranges(matrix: SplitMatrix, num_elements: int) -> list[np.ndarray | None]:
    """The int32 sequence ids each split takes from a dataset of ``num_elements`` sequences."""
    out: list[np.ndarray | None] = []
    for bookends in matrix:
        if bookends is None:
            out.append(None)
            continue
        lo = int(round(bookends[0] * float(num_elements)))
        hi = int(round(bookends[1] * float(num_elements)))
        out.append(np.arange(lo, hi, dtype=np.int32))
    return out


def parse_blend(values: Sequence[str], flag: str = "--data-path") -> tuple[list[str], list[float] | None]:
    """Split a Megatron blend list into prefixes and (unnormalized) weights.

    An odd-length list is all prefixes; an even-length list is ``weight prefix`` pairs unless some
    weight is not a number, in which case the whole list is prefixes (Megatron's rule).

    Raises:
        ConfigError: a weight that is not positive (Megatron asserts the same).
    """
    values = list(values)
    if len(values) % 2 == 1:
        return values, None
    weights: list[float] = []
    for raw in values[0::2]:
        try:
            weights.append(float(raw))
        except ValueError:
            return values, None
    prefixes = values[1::2]
    for weight, prefix in zip(weights, prefixes):
        if not (weight > 0 and np.isfinite(weight)):
            raise ConfigError(
                f"{flag}: weight {weight:g} for {prefix!r} must be a positive number "
                "(leave the dataset out instead of giving it weight 0)"
            )
    return prefixes, weights
