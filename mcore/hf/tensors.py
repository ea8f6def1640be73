"""Tensor helpers every family's mapping shares: the grouped QKV packing, the vocabulary rows, and a
state dict that records which of its tensors were read.

* ``linear_qkv`` ``[(np + 2 ng) d, h]`` is ``ng`` blocks of ``[q_1..q_r, k, v]`` (``r = np/ng``);
  :func:`split_qkv` / :func:`merge_qkv` convert it to and from separate Q, K, V.
* The vocabulary is cut to the tokenizer's ``V`` rows on export (:func:`vocab_rows`) and zero-padded
  to the target ``Vp`` on import (:func:`pad_vocab_rows`).
* :class:`TensorSource` reads a state dict and reports the tensors no mapping read (a conversion
  that would drop weights is refused).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from mcore.hf.errors import ConversionError


def split_qkv(
    fused: torch.Tensor, num_heads: int, num_groups: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q ``[np d, ...]``, K and V ``[ng d, ...]`` from mcore's grouped ``[(np + 2 ng) d, ...]`` rows."""
    r = num_heads // num_groups
    rest = fused.shape[1:]
    blocks = fused.reshape(num_groups, r + 2, head_dim, *rest)
    q = blocks[:, :r].reshape(num_heads * head_dim, *rest)
    k = blocks[:, r].reshape(num_groups * head_dim, *rest)
    v = blocks[:, r + 1].reshape(num_groups * head_dim, *rest)
    return q, k, v


def merge_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int, num_groups: int, head_dim: int
) -> torch.Tensor:
    """Inverse of :func:`split_qkv`."""
    r = num_heads // num_groups
    rest = q.shape[1:]
    blocks = torch.cat(
        [
            q.reshape(num_groups, r, head_dim, *rest),
            k.reshape(num_groups, 1, head_dim, *rest),
            v.reshape(num_groups, 1, head_dim, *rest),
        ],
        dim=1,
    )
    return blocks.reshape((num_heads + 2 * num_groups) * head_dim, *rest)


def vocab_rows(tensor: torch.Tensor, vocab_size: int, name: str) -> torch.Tensor:
    """The first ``vocab_size`` rows of ``tensor`` (the real vocabulary of a padded table)."""
    if tensor.shape[0] < vocab_size:
        raise ConversionError(
            f"{name} has {tensor.shape[0]} rows, fewer than the vocabulary size {vocab_size}"
        )
    return tensor[:vocab_size]


def pad_vocab_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """``tensor`` with zero rows appended up to ``rows`` (the padded vocabulary of the target layout)."""
    if tensor.shape[0] > rows:
        raise ConversionError(f"vocabulary of {tensor.shape[0]} rows does not fit a padded size of {rows}")
    if tensor.shape[0] == rows:
        return tensor
    pad = torch.zeros(rows - tensor.shape[0], *tensor.shape[1:], dtype=tensor.dtype)
    return torch.cat([tensor, pad.to(tensor.device)])


class TensorSource:
    """A logical state dict that records which keys were read (so leftovers can be reported)."""

    def __init__(self, state: Mapping[str, torch.Tensor], what: str):
        self.state, self.what, self.used = state, what, set()

    def get(self, key: str) -> torch.Tensor:
        if key not in self.state:
            raise ConversionError(f"{self.what} has no tensor {key!r}")
        self.used.add(key)
        return self.state[key]

    def optional(self, key: str) -> torch.Tensor | None:
        return self.get(key) if key in self.state else None

    def leftovers(self, ignore: tuple[str, ...] = ()) -> list[str]:
        return sorted(k for k in self.state if k not in self.used and not k.endswith(ignore))


def zeros(n: int, like: torch.Tensor) -> torch.Tensor:
    """A zero vector of ``n`` elements with ``like``'s dtype and device (a bias a model does not have)."""
    return torch.zeros(n, dtype=like.dtype, device=like.device)


__all__ = ["TensorSource", "merge_qkv", "pad_vocab_rows", "split_qkv", "vocab_rows", "zeros"]
