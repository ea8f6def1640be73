"""Megatron's masked WordPiece datasets (the shared part of BERT's and T5's): sentence runs and masking.

A masked dataset reads a *sentence-level* indexed dataset (``mcore-preprocess-data --split-sentences``:
one document per text, one sequence per sentence) and splits it by **documents** (``--split`` applies to
document counts, as in Megatron). Its sample index (:mod:`mcore.data.masked_indices`) lists runs of
consecutive sentences of one document with a target length each; it is built once and cached like
GPT's (``--data-cache-path``, else ``<prefix>/cache/<Class>_indices/``; rank 0 builds, the others load).

Masking (:meth:`MaskedWordPieceDataset.create_masked_lm_predictions`), per sample with the sample's own
``RandomState((seed + idx) % 2**32)``, in Megatron's order of random draws:

1. Candidates: every token but ``[CLS]``/``[SEP]`` is a candidate of its own; with whole-word masking a
   ``##`` continuation joins the candidate before it.
2. Budget: ``n_mask = min(p * target_length, max(1, round(len(tokens) * p)))`` tokens, ``p =
   masking_probability`` (``--mask-prob``, 0.15).
3. The candidates are shuffled; for each in turn (until the budget is used) an n-gram size is drawn,
   ``P(n) ∝ 1/n`` for ``n = 1..masking_max_ngram`` (reversed with ``masking_use_longer_ngrams``; a
   geometric(0.2) draw clipped to the maximum with ``masking_use_geometric_distribution``, SpanBERT's),
   shrunk until the n candidates starting there fit the remaining budget; n-grams touching an already
   masked token are skipped.
4. Each chosen token is replaced as the subclass says (:meth:`token_mask`; BERT: 80% ``[MASK]``, 10% a
   random vocabulary id, 10% unchanged) and its original id becomes the label.

``masking_do_permutation`` is refused: Megatron's permutation draws from numpy's *global* generator,
so its samples are not reproducible, and no Megatron model script turns it on.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from mcore.config.fields import ConfigError
from mcore.data.cache import IndexCache
from mcore.data.errors import DataError
from mcore.data.masked_indices import build_sentence_sample_index
from mcore.data.megatron_dataset import MegatronDataset
from mcore.data.tokenizers import Tokenizer

logger = logging.getLogger(__name__)


class SentenceDataset(Protocol):
    """What a masked dataset reads: a sentence-level IndexedDataset or the mock generator."""

    @property
    def document_indices(self) -> np.ndarray: ...

    @property
    def sequence_lengths(self) -> np.ndarray: ...

    def __getitem__(self, idx: int) -> np.ndarray: ...

    def fingerprint(self) -> dict[str, Any]: ...


@dataclass(frozen=True, kw_only=True)
class MaskedWordPieceDatasetConfig:
    """Everything a masked dataset's samples depend on besides its documents (Megatron's fields).

    ``split``/``split_matrix`` only enter the cache description; ``path_to_cache=None`` caches next to
    the data; ``mid_level_dataset_surplus`` serves blends as for GPT.
    """

    random_seed: int
    sequence_length: int
    tokenizer: Tokenizer
    split: str | None = None
    split_matrix: list | None = None
    path_to_cache: str | None = None
    mmap_bin_files: bool = True
    mid_level_dataset_surplus: float = 0.005
    masking_probability: float = 0.15
    """Share of the tokens that are masked (``--mask-prob``)."""
    short_sequence_probability: float = 0.1
    """Probability of a shorter random target length (``--short-seq-prob``)."""
    masking_max_ngram: int = 3
    """Longest n-gram (in candidates) masked at once."""
    masking_do_full_word: bool = False
    """Whole-word masking: a word's ``##`` pieces are masked with it."""
    masking_do_permutation: bool = False
    """Refused (see module doc)."""
    masking_use_longer_ngrams: bool = False
    """Favour long n-grams (``P(n) ∝ 1/(max + 1 - n)``)."""
    masking_use_geometric_distribution: bool = False
    """Draw the n-gram size from geometric(0.2) (SpanBERT)."""

    def check_maskable(self, flag: str, room: int) -> None:
        """Refuse a configuration under which no token is ever masked (the loss would be zero and the
        run would exit 0 having learned nothing): a sample masks at most ``--mask-prob`` x its target
        length (``sequence_length - room``: the special tokens) tokens, rounded down in effect, as
        in Megatron's budget; below 1 it masks none."""
        target = self.sequence_length - room
        if self.masking_probability * target < 1.0:
            need = math.ceil(1.0 / self.masking_probability) + room
            raise ConfigError(
                f"{flag} {self.sequence_length} with --mask-prob {self.masking_probability}: a sample of at most "
                f"{target} tokens can mask {self.masking_probability} x {target} < 1 token, so no token is ever "
                f"masked and the loss cannot train; raise {flag} to at least {need} or --mask-prob to at least "
                f"{1.0 / max(target, 1):.3g}"
            )

    def __post_init__(self) -> None:
        if not 0.0 < self.masking_probability < 1.0:
            raise ConfigError(f"--mask-prob {self.masking_probability} must be in (0, 1)")
        if not 0.0 <= self.short_sequence_probability <= 1.0:
            raise ConfigError(f"--short-seq-prob {self.short_sequence_probability} must be in [0, 1]")
        if self.masking_max_ngram < 1:
            raise ConfigError(f"masking_max_ngram={self.masking_max_ngram} must be >= 1")
        if self.masking_do_permutation:
            raise ConfigError(
                "masking_do_permutation is not supported: Megatron's permutation draws from numpy's global "
                "generator (not reproducible), and no Megatron model uses it"
            )
        missing = [
            n for n in ("cls", "sep", "pad", "mask", "inv_vocab") if getattr(self.tokenizer, n, None) is None
        ]
        if missing:
            raise DataError(
                f"the masked-LM datasets need a WordPiece tokenizer ({', '.join(missing)} missing from "
                f"{type(self.tokenizer).__name__}): use --tokenizer-type BertWordPieceLowerCase or BertWordPieceCase"
            )
        if self.random_seed <= 0:
            raise ConfigError(
                f"--seed {self.random_seed} must be > 0 for the masked datasets (Megatron's rule)"
            )


def _key_identifiers(config: MaskedWordPieceDatasetConfig) -> list[tuple[str, Any]]:
    names = (
        "random_seed",
        "sequence_length",
        "split",
        "split_matrix",
        "tokenizer",
        "masking_probability",
        "short_sequence_probability",
        "masking_max_ngram",
        "masking_do_full_word",
        "masking_do_permutation",
        "masking_use_longer_ngrams",
        "masking_use_geometric_distribution",
    )
    return [(name, getattr(config, name)) for name in names]


class MaskedWordPieceDataset(MegatronDataset):
    """The shared part of BERT's and T5's datasets over one split of a sentence-level dataset.

    Args:
        indexed_dataset: the sentences (an :class:`~mcore.data.indexed_dataset.IndexedDataset`).
        dataset_path: its prefix (None for mock data: no disk cache).
        indices: int32 **document** ids of this split (consecutive).
        num_samples: samples wanted (None: one epoch); ``len(self)`` is at least this.
        index_split: ``"train"``, ``"valid"`` or ``"test"``.
        config: the rest.
    """

    def __init__(
        self,
        indexed_dataset: SentenceDataset,
        dataset_path: str | None,
        indices: np.ndarray,
        num_samples: int | None,
        index_split: str,
        config: MaskedWordPieceDatasetConfig,
    ) -> None:
        super().__init__(indexed_dataset, dataset_path, indices, num_samples, index_split, config)
        tokenizer = config.tokenizer
        # Megatron's pad id: the tokenizer's, or -1 where it collides with end-of-document.
        pad = int(tokenizer.pad)
        self.pad_id = -1 if pad in {getattr(tokenizer, "eos", None), tokenizer.eod} else pad

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: SentenceDataset) -> int:
        """Number of documents: ``--split`` divides documents, not sentences."""
        return len(low_level_dataset.document_indices) - 1

    def _key_identifiers(self) -> list[tuple[str, Any]]:
        return _key_identifiers(self.config)

    def _describe_split(self) -> str:
        n = self.numel_low_level_dataset(self.dataset)
        if len(self.indices):
            where = f"documents [{int(self.indices[0])}, {int(self.indices[-1]) + 1}) of {n}"
        else:
            where = f"no documents of {n}"
        how = f"--split {self.config.split!r}" if self.config.split is not None else "its split"
        return f"the {self.index_split} split of {self.dataset_path or 'the mock dataset'} ({how} gives it {where})"

    def build_sample_index(self, max_length: int, min_sentences: int) -> np.ndarray:
        """The ``[n, 3]`` sample index (first sentence, end sentence, target length), cached."""
        cache = IndexCache(
            self._cache_dir(),
            self.unique_description,
            type(self).__name__,
            self.index_split,
            ("sample_index",),
        )
        cached = cache.load()
        if cached is not None:
            logger.info(
                "loaded %s %s indices from %s*", type(self).__name__, self.index_split, cache.path("")
            )
            return cached["sample_index"]
        start = time.perf_counter()
        if len(self.indices) == 0:
            if self.num_samples:
                raise DataError(
                    f"{self._describe_split()} has no documents, but {self.num_samples} {self.index_split} "
                    "samples were requested. Use more data, change --split, or request none."
                )
            sample_index = np.zeros((0, 3), np.uint32)
        else:
            docs = self.dataset.document_indices[np.append(self.indices, self.indices[-1] + 1)]
            try:
                sample_index = build_sentence_sample_index(
                    docs,
                    self.dataset.sequence_lengths,
                    1 if self.num_samples is None else None,
                    self.num_samples,
                    max_length,
                    self.config.short_sequence_probability,
                    self.config.random_seed,
                    min_sentences,
                )
            except ValueError as err:
                raise DataError(f"{self._describe_split()}: {err}") from None
        saved = cache.save({"sample_index": sample_index})
        logger.info(
            "built %s %s indices (%d samples) in %.2f s%s",
            type(self).__name__,
            self.index_split,
            len(sample_index),
            time.perf_counter() - start,
            f", cached in {cache.path('')}*" if saved else "",
        )
        return sample_index

    def create_masked_lm_predictions(
        self, token_ids: list[int], target_sequence_length: int, rng: np.random.RandomState
    ) -> tuple[list[int], list[int], list[int], list[int], list[tuple[list[int], list[int]]]]:
        """Mask ``token_ids`` (see module doc).

        Returns:
            (masked token ids, masked positions ascending, their original ids, word boundaries (1 where a
            word or a special token starts), masked spans ``(positions, original ids)`` by first position).
        """
        cfg, tokenizer = self.config, self.config.tokenizer
        inv_vocab, specials = tokenizer.inv_vocab, (tokenizer.cls, tokenizer.sep)
        boundaries: list[int] = []
        candidates: list[list[int]] = []
        for i, token in enumerate(token_ids):
            if token in specials:
                boundaries.append(1)
                continue
            continuation = inv_vocab[token].startswith("##")
            boundaries.append(0 if continuation else 1)
            if continuation and cfg.masking_do_full_word and candidates:
                candidates[-1].append(i)
            else:
                candidates.append([i])

        p = cfg.masking_probability
        budget = min(p * target_sequence_length, max(1, int(round(len(token_ids) * p))))
        sizes = np.arange(1, cfg.masking_max_ngram + 1, dtype=np.int64)
        size_probs = 1.0 / sizes
        size_probs = size_probs / size_probs.sum(keepdims=True)
        if cfg.masking_use_longer_ngrams:
            size_probs = size_probs[::-1]
        # Every candidate offers all n-gram sizes (shorter at the end), so Megatron's renormalisation
        # over the sizes on offer is this same division each time.
        size_probs = size_probs / size_probs.sum(keepdims=True)

        order = list(range(len(candidates)))
        rng.shuffle(order)
        masked = list(token_ids)
        positions_labels: list[tuple[int, int]] = []
        spans: list[tuple[list[int], list[int]]] = []
        taken: set[int] = set()
        for start in order:
            if len(positions_labels) >= budget:
                break
            if cfg.masking_use_geometric_distribution:
                n = min(rng.geometric(0.2), cfg.masking_max_ngram)
            else:
                n = int(rng.choice(sizes, p=size_probs))
            # Shrink the n-gram until it fits what is left of the budget.
            while True:
                ngram = [i for candidate in candidates[start : start + n] for i in candidate]
                n -= 1
                if budget >= len(positions_labels) + len(ngram):
                    break
                if n == 0:
                    ngram = []
                    break
            if not ngram or any(i in taken for i in ngram):
                continue
            for i in ngram:
                taken.add(i)
                replacement = self.token_mask(rng)
                masked[i] = token_ids[i] if replacement is None else replacement
                positions_labels.append((i, token_ids[i]))
            spans.append((ngram, [token_ids[i] for i in ngram]))
        # Megatron shuffles the candidates once more (for its permutation pass); the draw is kept so
        # that a subclass drawing after masking sees Megatron's stream.
        rng.shuffle(order)

        positions_labels.sort(key=lambda pair: pair[0])
        spans.sort(key=lambda span: span[0][0])
        return (
            masked,
            [pos for pos, _ in positions_labels],
            [label for _, label in positions_labels],
            boundaries,
            spans,
        )

    def token_mask(self, rng: np.random.RandomState) -> int | None:
        """The id that replaces a masked token (None: keep the original)."""
        raise NotImplementedError
