"""Megatron's GPTDataset: fixed-length language-model samples cut from the documents of one split.

A split's documents (sequence ids of an indexed dataset) are laid end to end in a shuffled order, as
many epochs as the requested sample count needs, and cut into samples of ``L + 1`` tokens that overlap by
one (see :mod:`mcore.data.indices` for the exact index math). Sample ``i`` is
``sample_index[shuffle_index[i]]``; from its ``L + 1`` tokens ``text``::

    tokens   = text[:-1]                  int64[L]
    labels   = text[1:]                   int64[L]
    loss_mask                             float32[L]  1, or 0 on EOD inputs with --eod-mask-loss
    position_ids                          int64[L]    0..L-1, restarting after each EOD with --reset-position-ids
    attention_mask                        bool[1, L, L], True = masked out; only with --reset-attention-mask:
                                          causal, and no attention to earlier documents (an EOD belongs to
                                          the document it ends)

Index building is vectorized numpy (a million documents in well under a second) and cached on disk:
``--data-cache-path`` if given, else ``<prefix>/cache/GPTDataset_indices/`` (Megatron's place), keyed by
a hash of the configuration *and the data files' identity* (see :mod:`mcore.data.cache`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from mcore.data.cache import IndexCache
from mcore.data.errors import DataError
from mcore.data.indices import (
    build_document_index,
    build_sample_index,
    build_shuffle_index,
    compute_num_epochs,
    use_separate_final_epoch,
)
from mcore.data.megatron_dataset import MegatronDataset
from mcore.data.tokenizers import Tokenizer

logger = logging.getLogger(__name__)

_INDEX_NAMES = ("document_index", "sample_index", "shuffle_index")


class LowLevelDataset(Protocol):
    """What a GPTDataset reads: sequences of tokens (an IndexedDataset or the mock generator)."""

    @property
    def sequence_lengths(self) -> np.ndarray: ...

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray: ...

    def fingerprint(self) -> dict[str, Any]: ...


@dataclass(frozen=True, kw_only=True)
class GPTDatasetConfig:
    """Everything a GPTDataset's samples depend on besides its documents.

    ``split`` is the raw ``--split`` string and ``split_matrix`` its bookends; both only enter the cache
    description (as in Megatron). ``path_to_cache=None`` caches next to the data.
    """

    random_seed: int
    sequence_length: int
    tokenizer: Tokenizer
    split: str | None = None
    split_matrix: list | None = None
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    path_to_cache: str | None = None
    mmap_bin_files: bool = True
    add_extra_token_to_sequence: bool = True
    drop_last_partial_validation_sequence: bool = True
    mid_level_dataset_surplus: float = 0.005

    def __post_init__(self) -> None:
        if self.sequence_length < 1:
            raise ValueError(f"sequence_length={self.sequence_length} must be >= 1")


def build_ltor_masks_and_position_ids(
    tokens: torch.Tensor,
    eod: int,
    reset_position_ids: bool,
    reset_attention_mask: bool,
    eod_mask_loss: bool,
    create_attention_mask: bool,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """(attention_mask bool[1,L,L] or None, loss_mask float32[L], position_ids int64[L]) for ``tokens``.

    Vectorized form of Megatron's per-EOD loop: with ``doc[p]`` = number of EODs before position ``p``,
    query ``q`` may attend key ``k`` iff ``k <= q`` and (without reset) always, (with reset) ``doc[k] ==
    doc[q]``; reset positions are ``p - (index after the last EOD before p)``.
    """
    length = tokens.numel()
    arange = torch.arange(length, dtype=torch.long)
    is_eod = tokens == eod
    loss_mask = torch.ones(length, dtype=torch.float)
    if eod_mask_loss:
        loss_mask[is_eod] = 0.0
    position_ids = arange
    if reset_position_ids:
        starts = torch.where(is_eod, arange + 1, torch.zeros_like(arange))
        last_start = torch.cummax(starts, dim=0).values
        previous = torch.cat((torch.zeros(1, dtype=torch.long), last_start[:-1]))
        position_ids = arange - previous
    attention_mask = None
    if create_attention_mask:
        allowed = arange[None, :] <= arange[:, None]
        if reset_attention_mask:
            doc = torch.cumsum(is_eod.long(), 0) - is_eod.long()
            allowed &= doc[None, :] == doc[:, None]
        attention_mask = (~allowed).unsqueeze(0)
    return attention_mask, loss_mask, position_ids


class GPTDataset(MegatronDataset):
    """Samples of one split of one low-level dataset.

    Args:
        indexed_dataset: the documents (an :class:`~mcore.data.indexed_dataset.IndexedDataset`).
        dataset_path: its prefix (None for mock data: no disk cache).
        indices: int32 sequence ids of this split.
        num_samples: samples wanted (None: exactly one epoch). ``len(self)`` is at least this.
        index_split: ``"train"``, ``"valid"`` or ``"test"``.
        config: the rest.

    Raises:
        DataError: the split has no tokens but samples were asked of it (Megatron loops forever here).
    """

    def __init__(
        self,
        indexed_dataset: LowLevelDataset,
        dataset_path: str | None,
        indices: np.ndarray,
        num_samples: int | None,
        index_split: str,
        config: GPTDatasetConfig,
    ) -> None:
        super().__init__(indexed_dataset, dataset_path, indices, num_samples, index_split, config)
        pad = config.tokenizer.pad
        self._pad_id = -1 if pad is None or pad in config.tokenizer.special_token_ids else int(pad)
        self._extra = int(config.add_extra_token_to_sequence)
        arrays = self._load_or_build_indices()
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]

    def _key_identifiers(self) -> list[tuple[str, Any]]:
        config = self.config
        return [
            ("random_seed", config.random_seed),
            ("sequence_length", config.sequence_length),
            ("split", config.split),
            ("split_matrix", config.split_matrix),
            ("tokenizer", config.tokenizer.unique_identifiers),
        ]

    def _load_or_build_indices(self) -> dict[str, np.ndarray]:
        cache = IndexCache(
            self._cache_dir(), self.unique_description, type(self).__name__, self.index_split, _INDEX_NAMES
        )
        cached = cache.load()
        if cached is not None:
            logger.debug(
                "loaded %s %s indices from %s*", type(self).__name__, self.index_split, cache.path("")
            )
            return cached
        start = time.perf_counter()
        arrays = self._build_indices()
        saved = cache.save(arrays)
        logger.debug(
            "built %s %s indices (%d samples) in %.2f s%s",
            type(self).__name__,
            self.index_split,
            len(arrays["sample_index"]) - 1,
            time.perf_counter() - start,
            f", cached in {cache.path('')}*" if saved else "",
        )
        return arrays

    def _describe_split(self) -> str:
        n = len(self.dataset.sequence_lengths)
        if len(self.indices):
            where = f"sequences [{int(self.indices[0])}, {int(self.indices[-1]) + 1}) of {n}"
        else:
            where = f"no sequences of {n}"
        how = f"--split {self.config.split!r}" if self.config.split is not None else "its split"
        return f"the {self.index_split} split of {self.dataset_path or 'the mock dataset'} ({how} gives it {where})"

    def _build_indices(self) -> dict[str, np.ndarray]:
        cfg, x, seq = self.config, self._extra, self.config.sequence_length
        lengths = self.dataset.sequence_lengths
        tokens_per_epoch = int(np.sum(lengths[self.indices], dtype=np.int64))
        if tokens_per_epoch == 0:
            if self.num_samples:
                raise DataError(
                    f"{self._describe_split()} has no tokens, but {self.num_samples} {self.index_split} samples "
                    f"were requested. Use more data, change --split, or request no {self.index_split} samples "
                    "(e.g. --eval-iters 0 for valid/test)."
                )
            return {
                "document_index": np.zeros(0, np.int32),
                "sample_index": np.zeros((1, 2), np.int32),
                "shuffle_index": np.zeros(0, np.uint32),
            }
        num_epochs = compute_num_epochs(tokens_per_epoch, self.num_samples, seq, x)
        separate, sans_final = (
            use_separate_final_epoch(num_epochs, tokens_per_epoch, self.num_samples, seq, x)
            if self.num_samples is not None
            else (False, 0)
        )
        rng = np.random.RandomState(cfg.random_seed)
        document_index = build_document_index(self.indices, num_epochs, rng, separate)
        drop_last = cfg.drop_last_partial_validation_sequence if self.index_split == "valid" else True
        sample_index = build_sample_index(
            lengths, document_index, seq, num_epochs, tokens_per_epoch, drop_last, x
        )
        total = sample_index.shape[0] - 1
        if self.num_samples is not None and total < self.num_samples:
            raise DataError(
                f"{self._describe_split()} yields {total} samples, fewer than the {self.num_samples} asked"
            )
        shuffle_index = build_shuffle_index(sans_final if separate else total, total, rng)
        return {
            "document_index": document_index,
            "sample_index": sample_index,
            "shuffle_index": shuffle_index,
        }

    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1

    def _text(self, idx: int) -> np.ndarray:
        """The ``L + x`` token ids of sample ``idx`` (right-padded with the pad id if short)."""
        j = int(self.shuffle_index[idx])
        p0, o0 = (int(v) for v in self.sample_index[j])
        p1, o1 = (int(v) for v in self.sample_index[j + 1])
        x = self._extra
        if p0 == p1:
            parts = [self.dataset.get(int(self.document_index[p0]), o0, o1 - o0 + x)]
        else:
            parts = [self.dataset.get(int(self.document_index[p0]), o0)]
            parts += [self.dataset.get(int(self.document_index[p])) for p in range(p0 + 1, p1)]
            parts.append(self.dataset.get(int(self.document_index[p1]), 0, o1 + x))
        text = np.concatenate(parts).astype(np.int64)
        want = self.config.sequence_length + x
        if len(text) < want:
            text = np.concatenate((text, np.full(want - len(text), self._pad_id, np.int64)))
        return text

    def __getitem__(self, idx: int | None) -> dict[str, torch.Tensor]:
        """The sample dict (see module doc); ``None`` gives a padding sample with a zero loss mask."""
        if idx is not None and not -len(self) <= idx < len(self):
            raise IndexError(
                f"sample {idx} out of range for {self.index_split} dataset of {len(self)} samples"
            )
        text = torch.from_numpy(self._text(0 if idx is None else idx % len(self)))
        cfg = self.config
        if self._extra:
            tokens, labels = text[:-1].clone(), text[1:].clone()
        else:
            tokens, labels = text, torch.roll(text, -1)
            labels[-1] = self._pad_id
        attention_mask, loss_mask, position_ids = build_ltor_masks_and_position_ids(
            tokens,
            cfg.tokenizer.eod,
            cfg.reset_position_ids,
            cfg.reset_attention_mask,
            cfg.eod_mask_loss,
            create_attention_mask=cfg.reset_attention_mask,
        )
        loss_mask[labels == self._pad_id] = 0.0
        tokens[tokens == self._pad_id] = 0
        labels[labels == self._pad_id] = 0
        if idx is None:
            loss_mask.zero_()
        sample = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids}
        if attention_mask is not None:
            sample["attention_mask"] = attention_mask
        return sample
