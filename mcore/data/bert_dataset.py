"""Megatron's BERT dataset (``BERTMaskedWordPieceDataset``): sentence pairs with MLM masking and SOP labels.

Input: a sentence-level dataset (``mcore-preprocess-data --split-sentences`` with a BertWordPiece
tokenizer), split by documents with ``--split``, blended with ``--data-path W1 P1 W2 P2`` like GPT's, or
``--mock-data`` (:class:`MockBertLowLevelDataset`). Samples equal megatron-core 0.16.1's for the same data,
seed and settings (checked sample by sample in the tests; the one deliberate difference is below).

Sample ``idx`` = sentences ``[first, end)`` of one document with a target length ``T <= seq_length - 3``
(the sample index of :mod:`mcore.data.masked_indices`), drawn with ``RandomState((seed + idx) % 2**32)``:

1. With the binary head (the default; ``--bert-no-binary-head`` turns it off) the sentences are cut at a
   random pivot into segments A and B (the pivot is 1 for two sentences) and with probability 1/2 swapped:
   ``is_random = 1`` (Megatron's sentence-order prediction label). Without it, everything is A.
2. While ``len(A) + len(B) > T`` the longer segment (B on ties) loses its first or last token (1/2 each):
   ``truncated = 1``.
3. ``[CLS] A [SEP] B [SEP]`` (``[CLS] A [SEP]`` when B is empty), token types 0 for ``[CLS] A [SEP]``, 1
   after; then masking (:mod:`mcore.data.masked_dataset`, ``--mask-prob`` 0.15, n-grams up to 3, no
   whole-word masking): a chosen token becomes ``[MASK]`` (80%), a random vocabulary id (10%) or stays
   (10%).
4. Right-padding to ``seq_length``.

Batch keys (Megatron's names; ``b`` = micro-batch size, ``s`` = ``--seq-length``):

================  ============  ==================================================================
key               dtype, shape  meaning
================  ============  ==================================================================
``text``          int64 [b, s]  input ids after masking; padding is 0 (Megatron writes 0 at pad
                                positions "so the embedding can map it")
``types``         int64 [b, s]  token type: 0 for ``[CLS] A [SEP]``, 1 for ``B [SEP]``, 0 on padding
``labels``        int64 [b, s]  original id at masked positions, -1 elsewhere
``is_random``     int64 [b]     SOP label: 1 when A and B were swapped (always 0 without binary head)
``padding_mask``  int64 [b, s]  1 on tokens, 0 on padding (and, as in Megatron, on a position whose
                                random replacement is the pad id)
``loss_mask``     int64 [b, s]  1 at masked positions, 0 elsewhere
``truncated``     int64 [b]     1 when the pair was cut to fit
================  ============  ==================================================================

Difference from Megatron, only when ``[PAD]`` is not id 0: Megatron pads ``types`` with the pad id (out
of range for two token types) and writes the pad id into ``padding_mask``; here they are 0. With the
usual vocabularies (``[PAD]`` = 0) the samples are identical.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mcore.config.fields import ConfigError
from mcore.data.builder import Datasets, build_split_datasets
from mcore.data.config import DataConfig
from mcore.data.errors import DataError
from mcore.data.masked_dataset import MaskedWordPieceDataset, MaskedWordPieceDatasetConfig
from mcore.data.splits import parse_split, split_matrix
from mcore.data.tokenizers import Tokenizer

BERT_BATCH_KEYS = ("text", "types", "labels", "is_random", "padding_mask", "loss_mask", "truncated")


@dataclass(frozen=True, kw_only=True)
class BERTMaskedWordPieceDatasetConfig(MaskedWordPieceDatasetConfig):
    """Megatron's BERT dataset config: the masked-dataset fields and the binary (SOP) head."""

    classification_head: bool = True
    """Sentence-pair samples with the SOP label (Megatron's ``--bert-binary-head``, on by default)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sequence_length < 5:
            raise ConfigError(f"--seq-length {self.sequence_length}: BERT samples need at least 5 tokens")
        self.check_maskable("--seq-length", 3)  # one [CLS] and two [SEP]


class BERTMaskedWordPieceDataset(MaskedWordPieceDataset):
    """BERT samples of one split (see module doc)."""

    def __init__(
        self,
        indexed_dataset: Any,
        dataset_path: str | None,
        indices: np.ndarray,
        num_samples: int | None,
        index_split: str,
        config: BERTMaskedWordPieceDatasetConfig,
    ) -> None:
        super().__init__(indexed_dataset, dataset_path, indices, num_samples, index_split, config)
        self.token_lookup = list(config.tokenizer.inv_vocab.keys())
        # One [CLS] and two [SEP]; pairs need two sentences.
        self.sample_index = self.build_sample_index(
            config.sequence_length - 3, 2 if config.classification_head else 1
        )

    def _key_identifiers(self) -> list[tuple[str, Any]]:
        return [*super()._key_identifiers(), ("classification_head", self.config.classification_head)]

    def __len__(self) -> int:
        return self.sample_index.shape[0]

    def token_mask(self, rng: np.random.RandomState) -> int | None:
        """80%: ``[MASK]``; 10%: a uniformly random vocabulary id; 10%: None (keep the token)."""
        if rng.random() < 0.8:
            return self.config.tokenizer.mask
        if rng.random() >= 0.5:
            return self.token_lookup[rng.randint(0, len(self.token_lookup))]
        return None

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        if not 0 <= idx < len(self):
            raise IndexError(
                f"sample {idx} out of range for {self.index_split} dataset of {len(self)} samples"
            )
        cfg, tokenizer = self.config, self.config.tokenizer
        first, end, target = (int(v) for v in self.sample_index[idx])
        sentences = [self.dataset[i] for i in range(first, end)]
        rng = np.random.RandomState(seed=(cfg.random_seed + idx) % 2**32)

        pivot, swapped = len(sentences), False
        if cfg.classification_head:
            if len(sentences) < 2:
                raise DataError(f"BERT sample {idx} has {len(sentences)} sentence; pairs need two")
            pivot = rng.randint(low=1, high=len(sentences)) if len(sentences) >= 3 else 1
            swapped = rng.random() < 0.5
        segment_a = [int(t) for sentence in sentences[:pivot] for t in sentence]
        segment_b = [int(t) for sentence in sentences[pivot:] for t in sentence]
        if swapped:
            segment_a, segment_b = segment_b, segment_a

        truncated = len(segment_a) + len(segment_b) > target
        while len(segment_a) + len(segment_b) > target:
            longer = segment_a if len(segment_a) > len(segment_b) else segment_b
            if rng.random() < 0.5:
                del longer[0]
            else:
                del longer[-1]

        tokens = [tokenizer.cls, *segment_a, tokenizer.sep]
        types = [0] * len(tokens)
        if segment_b:
            tokens += [*segment_b, tokenizer.sep]
            types += [1] * (len(segment_b) + 1)
        tokens, positions, masked_labels, _, _ = self.create_masked_lm_predictions(tokens, target, rng)

        length, pad = cfg.sequence_length, self.pad_id
        text = np.full(length, pad, dtype=np.int64)
        text[: len(tokens)] = tokens
        token_types = np.zeros(length, dtype=np.int64)
        token_types[: len(types)] = types
        padding_mask = (text != pad).astype(np.int64)
        labels = np.full(length, -1, dtype=np.int64)
        labels[positions] = masked_labels
        loss_mask = np.zeros(length, dtype=np.int64)
        loss_mask[positions] = 1
        text[text == pad] = 0  # Megatron's: the embedding must be able to look the pad up
        labels[labels == pad] = 0
        return {
            "text": torch.from_numpy(text),
            "types": torch.from_numpy(token_types),
            "labels": torch.from_numpy(labels),
            "is_random": torch.tensor(int(swapped), dtype=torch.int64),
            "padding_mask": torch.from_numpy(padding_mask),
            "loss_mask": torch.from_numpy(loss_mask),
            "truncated": torch.tensor(int(truncated), dtype=torch.int64),
        }


class MockBertLowLevelDataset:
    """``--mock-data`` for BERT: synthetic sentence-level documents computed on the fly.

    10,000 documents of 1-12 sentences, sentence lengths 4-48 tokens, all from
    ``numpy.random.default_rng(0)``; sentence ``s`` of length ``n`` holds ordinary vocabulary ids (no
    special token, no ``##`` piece, so that every token is a word) ``words[(s * 7919 + arange(n)) %
    len(words)]``.
    """

    seed = 0
    num_documents = 10_000
    max_sentences = 12
    min_length, max_length = 4, 48

    def __init__(self, tokenizer: Tokenizer) -> None:
        inv_vocab = getattr(tokenizer, "inv_vocab", None)
        if inv_vocab is None:
            raise DataError(
                "--mock-data for BERT needs a WordPiece tokenizer (--tokenizer-type BertWordPiece*)"
            )
        special = {t for t in (tokenizer.cls, tokenizer.sep, tokenizer.pad, tokenizer.mask, tokenizer.eod)}
        special |= set(getattr(tokenizer, "special_token_ids", ()))
        words = [
            i for i, token in inv_vocab.items() if i not in special and not token.startswith(("##", "["))
        ]
        if not words:
            raise DataError("--mock-data: the vocabulary has no ordinary word to build sentences from")
        self._words = np.asarray(words, dtype=np.int64)
        rng = np.random.default_rng(self.seed)
        per_document = rng.integers(1, self.max_sentences + 1, size=self.num_documents)
        self.document_indices = np.concatenate(([0], np.cumsum(per_document))).astype(np.int64)
        self.sequence_lengths = rng.integers(
            self.min_length, self.max_length + 1, size=int(self.document_indices[-1]), dtype=np.int32
        )

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def __getitem__(self, idx: int) -> np.ndarray:
        n = int(self.sequence_lengths[idx])
        return self._words[(idx * 7919 + np.arange(n)) % len(self._words)]

    def fingerprint(self) -> dict[str, Any]:
        """Mock data has no files; its identity is its generator (and the vocabulary it draws from)."""
        return {"mock_bert": {"seed": self.seed, "documents": self.num_documents, "words": len(self._words)}}


class MockBERTMaskedWordPieceDataset(BERTMaskedWordPieceDataset):
    """A BERT dataset over :class:`MockBertLowLevelDataset`."""


def bert_dataset_config(
    data_config: DataConfig,
    tokenizer: Tokenizer,
    seq_length: int,
    seed: int,
    classification_head: bool = True,
) -> BERTMaskedWordPieceDatasetConfig:
    """The BERT dataset config of the data flags (Megatron's ``pretrain_bert.py`` settings)."""
    return BERTMaskedWordPieceDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        tokenizer=tokenizer,
        split=data_config.split,
        split_matrix=split_matrix(parse_split(data_config.split)),
        path_to_cache=data_config.data_cache_path,
        mmap_bin_files=data_config.mmap_bin_files,
        mid_level_dataset_surplus=data_config.mid_level_dataset_surplus,
        masking_probability=data_config.mask_prob,
        short_sequence_probability=data_config.short_seq_prob,
        masking_max_ngram=3,
        masking_do_full_word=False,
        masking_do_permutation=False,
        masking_use_longer_ngrams=False,
        masking_use_geometric_distribution=False,
        classification_head=classification_head,
    )


def build_bert_datasets(
    data_config: DataConfig,
    tokenizer: Tokenizer,
    seq_length: int,
    seed: int,
    train_valid_test_num_samples,
    classification_head: bool = True,
) -> Datasets:
    """(train, valid, test) BERT datasets (None where a split has zero width); rules as GPT's builder."""
    if len(train_valid_test_num_samples) != 3:
        raise ValueError(
            f"need 3 sample counts (train, valid, test), got {list(train_valid_test_num_samples)}"
        )
    config = bert_dataset_config(data_config, tokenizer, seq_length, seed, classification_head)
    return build_split_datasets(
        data_config,
        config,
        list(train_valid_test_num_samples),
        BERTMaskedWordPieceDataset,
        lambda: (MockBERTMaskedWordPieceDataset, MockBertLowLevelDataset(tokenizer)),
    )


def bert_datasets_provider(cfg: Any, tokenizer: Tokenizer, num_samples) -> Datasets:
    """The BERT datasets provider of :func:`mcore.training.pretrain.pretrain` (like ``gpt_datasets_provider``).

    Reads ``cfg.data`` (``--data-path``/``--split``/``--mock-data``/``--mask-prob``/``--short-seq-prob``
    ...), ``cfg.model.seq_length``, ``cfg.training.seed`` and the binary head from
    ``cfg.model.bert_binary_head`` (True when the model config has no such field).
    """
    binary_head = bool(getattr(cfg.model, "bert_binary_head", True))
    return build_bert_datasets(
        cfg.data, tokenizer, cfg.model.seq_length, cfg.training.seed, num_samples, binary_head
    )
