"""Megatron's T5 span-corruption dataset (megatron-core's ``T5MaskedWordPieceDataset``).

Input: a sentence-level ``.bin/.idx`` (``mcore-preprocess-data --split-sentences``: one item per
sentence, one document per JSON line). ``--split`` divides the *documents*.

**Sample index**: Megatron's ``build_mapping``
(:func:`mcore.data.masked_indices.build_sentence_sample_index`, shared with BERT): shuffled rows
``(first sentence, end sentence, target length)`` of runs of consecutive sentences of one document, with
target length ``encoder_seq_length - 2`` (room for BOS and EOS), shorter with probability
``--short-seq-prob``, and at least one sentence per sample. It is cached like GPT's indices
(``--data-cache-path``; the key includes a fingerprint of the data).

**Sample** ``i`` (its own ``numpy.random.RandomState((seed + i) % 2**32)``): the sentences' tokens,
truncated to the target length; candidates are whole words (a piece starting ``##`` joins the word
before it); about ``--mask-prob`` of the tokens (``min(p * target, max(1, round(p * n)))``) are masked in
spans whose length is drawn from a geometric distribution (p = 0.2, at most 10: SpanBERT's, mean about 3
after the clip to the words left), candidates in a shuffled order, spans never overlapping. Each span
``k`` (in order of position) is replaced by sentinel ``<extra_id_k>`` in the encoder input; the decoder
input is ``[BOS] <extra_id_0> span_0 <extra_id_1> span_1 ...`` and the labels the same shifted by one,
ending in ``[EOS]``.

Batch keys (megatron-core's): ``text_enc`` [s_e], ``text_dec`` [s_d], ``labels`` [s_d] (-1 after the
decoder's tokens), ``loss_mask`` [s_d] (1 on the decoder's tokens), ``enc_mask`` [s_e] and ``dec_mask``
[s_d] (1 = token, 0 = pad), ``truncated``. Pads are 0 in the token arrays. The attention masks are
built from ``enc_mask``/``dec_mask`` in :mod:`mcore.training.t5` (bool, True = masked).

Samples equal megatron-core 0.16.1's for the same data, seed and configuration
(``tests/t5/test_t5_dataset.py`` builds both and compares them).

Tokenizers: BERT WordPiece with ``--vocab-extra-ids N`` (sentinels ``<extra_id_0..N-1>``, ``[BOS]``,
``[EOS]``, ``[MASK]``), or ``--tokenizer-type HuggingFaceTokenizer`` with a T5 vocabulary whose
``<extra_id_N>`` tokens are built in (BOS is the tokenizer's, else its pad token, which is T5's decoder
start; a SentencePiece vocabulary has no ``##`` pieces, so every piece is a word of its own).
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mcore.data.cache import IndexCache, describe
from mcore.data.errors import DataError
from mcore.data.indexed_dataset import IndexedDataset, check_token_ids
from mcore.data.masked_indices import build_sentence_sample_index

logger = logging.getLogger(__name__)

_SENTINEL = re.compile(r"<extra_id_(\d+)>")


# --------------------------------------------------------------------------------------------------
# vocabulary


@dataclass(frozen=True)
class T5Vocab:
    """The special ids the T5 dataset needs; ``cls``/``sep`` (sentence boundaries, never masked) and
    ``mask`` may be None (a T5 SentencePiece vocabulary has none)."""

    bos: int
    eos: int
    pad: int | None
    sentinels: tuple[int, ...]
    inv_vocab: Mapping[int, str]
    cls: int | None = None
    sep: int | None = None
    mask: int | None = None

    @classmethod
    def from_tokenizer(cls, tokenizer) -> T5Vocab:
        """From a BERT WordPiece tokenizer (``--vocab-extra-ids``) or a Hugging Face T5 tokenizer.

        Raises:
            DataError: no sentinel tokens, or no BOS/EOS.
        """
        sentinels = getattr(tokenizer, "additional_special_tokens_ids", None)
        inv_vocab = getattr(tokenizer, "inv_vocab", None)
        if inv_vocab is None and hasattr(tokenizer, "_tok"):
            inv_vocab = {i: t for t, i in tokenizer._tok.get_vocab(with_added_tokens=True).items()}
        if not sentinels and inv_vocab is not None:
            found = sorted(
                (int(m.group(1)), i) for i, t in inv_vocab.items() if (m := _SENTINEL.fullmatch(t))
            )
            sentinels = [i for _, i in found]
        if not sentinels:
            raise DataError(
                f"the T5 dataset needs sentinel tokens <extra_id_N>: {type(tokenizer).__name__} has none "
                "(give --vocab-extra-ids N with a BertWordPiece tokenizer, or a T5 tokenizer that has them)"
            )
        pad = getattr(tokenizer, "pad", None)
        bos = getattr(tokenizer, "bos", None)
        bos = pad if bos is None else bos
        eos = getattr(tokenizer, "eos", None)
        eos = tokenizer.eod if eos is None else eos
        if bos is None:
            raise DataError(f"the T5 dataset needs a BOS (or pad) token: {type(tokenizer).__name__} has none")
        return cls(
            bos=int(bos),
            eos=int(eos),
            pad=None if pad is None else int(pad),
            sentinels=tuple(int(i) for i in sentinels),
            inv_vocab=inv_vocab,
            cls=getattr(tokenizer, "cls", None),
            sep=getattr(tokenizer, "sep", None),
            mask=getattr(tokenizer, "mask", None),
        )


# --------------------------------------------------------------------------------------------------
# span corruption


def masked_spans(
    tokens: Sequence[int],
    target_length: int,
    vocab: T5Vocab,
    rng: np.random.RandomState,
    masking_probability: float = 0.15,
    max_ngram: int = 10,
    do_full_word: bool = True,
    use_geometric: bool = True,
    use_longer_ngrams: bool = False,
) -> list[tuple[list[int], list[int]]]:
    """The masked spans ``[(positions, original ids)]`` in order of position (megatron-core's
    ``_create_masked_lm_predictions`` without permutation, which T5 does not use)."""
    candidates: list[list[int]] = []
    for i, token in enumerate(tokens):
        if token == vocab.cls or token == vocab.sep:
            continue
        if not vocab.inv_vocab[token].startswith("##"):
            candidates.append([i])
        elif do_full_word and candidates:
            candidates[-1].append(i)
        else:
            candidates.append([i])
    n_maskings = min(
        masking_probability * target_length, max(1, int(round(len(tokens) * masking_probability)))
    )
    ngram_sizes = np.arange(max_ngram, dtype=np.int64) + 1
    probs = 1.0 / ngram_sizes
    probs = probs / probs.sum(keepdims=True)
    if use_longer_ngrams:
        probs = probs[::-1]
    candidate_ngrams = [[candidates[idx : idx + n] for n in ngram_sizes] for idx in range(len(candidates))]
    rng.shuffle(candidate_ngrams)
    masked: set[int] = set()
    count = 0
    spans: list[tuple[list[int], list[int]]] = []
    for ngrams in candidate_ngrams:
        if count >= n_maskings:
            break
        if not ngrams:
            continue
        if use_geometric:
            n = min(rng.geometric(0.2), max_ngram)
        else:
            p = probs[: len(ngrams)] / probs[: len(ngrams)].sum(keepdims=True)
            n = rng.choice(ngram_sizes[: len(ngrams)], p=p)
        while True:  # shrink the span until it fits the budget
            indices = sum(ngrams[n - 1], [])
            n -= 1
            if n_maskings >= count + len(indices):
                fits = True
                break
            if n == 0:
                fits = False
                break
        if not fits or any(i in masked for i in indices):
            continue
        masked.update(indices)
        count += len(indices)
        spans.append((indices, [tokens[i] for i in indices]))
    # (Megatron shuffles the candidates once more here; nothing drawn after it reaches a T5 sample.)
    return sorted(spans, key=lambda span: span[0][0])


# --------------------------------------------------------------------------------------------------
# the dataset


@dataclass(frozen=True, kw_only=True)
class T5DatasetConfig:
    """Everything a T5 dataset's samples depend on besides its documents (Megatron's pretrain_t5.py
    values: whole-word masking, geometric span lengths up to 10, no permutation)."""

    random_seed: int
    sequence_length: int
    sequence_length_decoder: int
    tokenizer: Any
    masking_probability: float = 0.15
    short_sequence_probability: float = 0.1
    masking_max_ngram: int = 10
    masking_do_full_word: bool = True
    masking_use_longer_ngrams: bool = False
    masking_use_geometric_distribution: bool = True
    split: str | None = None
    split_matrix: list | None = None
    path_to_cache: str | None = None
    mmap_bin_files: bool = True
    mid_level_dataset_surplus: float = 0.005

    def __post_init__(self) -> None:
        if self.sequence_length < 4:
            raise DataError(f"--encoder-seq-length {self.sequence_length} must be at least 4")
        if self.sequence_length_decoder < 2:
            raise DataError(f"--decoder-seq-length {self.sequence_length_decoder} must be at least 2")


class T5Dataset(torch.utils.data.Dataset):
    """The samples of one split of a sentence-level dataset (see the module docstring).

    Args:
        indexed_dataset: sentences as items, documents as runs of them (``document_indices``).
        dataset_path: its prefix (None: mock data, no disk cache).
        indices: the split's document ids.
        num_samples: samples wanted (None: one epoch).
        index_split: ``train``, ``valid`` or ``test``.
        config: the rest.
    """

    def __init__(
        self,
        indexed_dataset,
        dataset_path: str | None,
        indices: np.ndarray,
        num_samples: int | None,
        index_split: str,
        config: T5DatasetConfig,
    ) -> None:
        self.dataset = indexed_dataset
        self.dataset_path = dataset_path
        self.indices = indices
        self.num_samples = num_samples
        self.index_split = index_split
        self.config = config
        self.vocab = T5Vocab.from_tokenizer(config.tokenizer)
        self._pad = self.vocab.pad if self.vocab.pad is not None else -1
        self.unique_identifiers = self._identifiers()
        self.unique_description = describe(self.unique_identifiers)
        self.sample_index = self._load_or_build_index()

    def _identifiers(self) -> OrderedDict:
        c = self.config
        ids: OrderedDict = OrderedDict()
        ids["class"] = type(self).__name__
        ids["dataset_path"] = self.dataset_path
        ids["num_samples"] = self.num_samples
        ids["index_split"] = self.index_split
        ids["random_seed"] = c.random_seed
        ids["sequence_length"] = c.sequence_length
        ids["split"] = c.split
        ids["split_matrix"] = c.split_matrix
        ids["tokenizer"] = c.tokenizer.unique_identifiers
        ids["masking_probability"] = c.masking_probability
        ids["short_sequence_probability"] = c.short_sequence_probability
        ids["masking_max_ngram"] = c.masking_max_ngram
        ids["masking_do_full_word"] = c.masking_do_full_word
        ids["masking_use_longer_ngrams"] = c.masking_use_longer_ngrams
        ids["masking_use_geometric_distribution"] = c.masking_use_geometric_distribution
        ids["sequence_length_decoder"] = c.sequence_length_decoder
        ids["data_fingerprint"] = self.dataset.fingerprint()
        return ids

    def _cache_dir(self) -> str | None:
        if self.config.path_to_cache:
            return self.config.path_to_cache
        if self.dataset_path is None:
            return None
        return os.path.join(self.dataset_path, "cache", f"{type(self).__name__}_indices")

    def _load_or_build_index(self) -> np.ndarray:
        cache = IndexCache(
            self._cache_dir(),
            self.unique_description,
            type(self).__name__,
            self.index_split,
            ("sample_index",),
        )
        cached = cache.load()
        if cached is not None:
            return cached["sample_index"]
        start = time.perf_counter()
        index = np.zeros((0, 3), np.uint32)
        if len(self.indices) > 0:
            bounds = np.append(self.indices, self.indices[-1] + 1)
            try:
                index = build_sentence_sample_index(
                    self.dataset.document_indices[bounds],
                    self.dataset.sequence_lengths,
                    None if self.num_samples is not None else 1,
                    self.num_samples,
                    self.config.sequence_length - 2,  # room for one <bos> and one <eos>
                    self.config.short_sequence_probability,
                    self.config.random_seed,
                    1,
                )
            except ValueError as err:
                where = self.dataset_path or "the mock dataset"
                raise DataError(f"the {self.index_split} split of {where}: {err}") from None
        if self.num_samples and len(index) < self.num_samples:
            where = self.dataset_path or "the mock dataset"
            raise DataError(
                f"the {self.index_split} split of {where} ({len(self.indices)} documents under --split "
                f"{self.config.split!r}) yields {len(index)} T5 samples, but {self.num_samples} were requested: "
                "use more data (a document with several sentences needs them all at most 512 tokens), change "
                "--split, or request fewer"
            )
        saved = cache.save({"sample_index": index})
        logger.info(
            "built %s %s index (%d samples) in %.2f s%s", type(self).__name__, self.index_split, len(index),
            time.perf_counter() - start, f", cached in {cache.path('')}*" if saved else "",
        )  # fmt: skip
        return index

    def __len__(self) -> int:
        return int(self.sample_index.shape[0])

    def sample_arrays(self, idx: int) -> dict[str, np.ndarray | int]:
        """Sample ``idx`` as megatron-core returns it (numpy arrays)."""
        c, vocab = self.config, self.vocab
        first, end, target = (int(v) for v in self.sample_index[idx])
        tokens = [int(t) for i in range(first, end) for t in self.dataset[i]]
        rng = np.random.RandomState(seed=(c.random_seed + idx) % 2**32)
        truncated = len(tokens) > target
        tokens = tokens[:target]
        spans = masked_spans(
            tokens, target, vocab, rng, c.masking_probability, c.masking_max_ngram, c.masking_do_full_word,
            c.masking_use_geometric_distribution, c.masking_use_longer_ngrams,
        )  # fmt: skip
        if len(spans) > len(vocab.sentinels):
            raise DataError(
                f"sample {idx} of the {self.index_split} split masks {len(spans)} spans, but the tokenizer has "
                f"only {len(vocab.sentinels)} sentinel tokens: raise --vocab-extra-ids (Megatron uses 100)"
            )
        sentinels = deque(vocab.sentinels)
        encoder, decoder_in, decoder_out = [], [vocab.bos], []
        begin = 0
        for positions, labels in spans:
            sentinel = sentinels.popleft()
            encoder.extend(tokens[begin : positions[0]])
            encoder.append(sentinel)
            decoder_in.append(sentinel)
            decoder_in.extend(labels)
            decoder_out.append(sentinel)
            decoder_out.extend(labels)
            begin = positions[-1] + 1
        encoder.extend(tokens[begin:])
        decoder_out.append(vocab.eos)
        s_e, s_d = c.sequence_length, c.sequence_length_decoder
        if len(decoder_in) > s_d:
            raise DataError(
                f"sample {idx} of the {self.index_split} split needs {len(decoder_in)} decoder tokens, more than "
                f"--decoder-seq-length {s_d} (at --encoder-seq-length {s_e} and --mask-prob "
                f"{c.masking_probability}): raise --decoder-seq-length"
            )
        n_dec = len(decoder_in)
        pad = self._pad
        enc = np.full(s_e, pad, np.int64)
        enc[: len(encoder)] = encoder
        dec = np.full(s_d, pad, np.int64)
        dec[:n_dec] = decoder_in
        labels = np.full(s_d, -1, np.int64)
        labels[: len(decoder_out)] = decoder_out
        # Megatron marks the positions that do not hold the pad id; by length is the same, and stays
        # right when BOS is the pad id (a T5 vocabulary's decoder start token).
        enc_mask = (np.arange(s_e) < len(encoder)).astype(np.int64)
        dec_mask = (np.arange(s_d) < n_dec).astype(np.int64)
        loss_mask = np.zeros(s_d, np.int64)
        loss_mask[:n_dec] = 1
        enc[enc == pad] = 0
        dec[dec == pad] = 0
        labels[labels == pad] = 0
        return {
            "text_enc": enc,
            "text_dec": dec,
            "labels": labels,
            "loss_mask": loss_mask,
            "truncated": int(truncated),
            "enc_mask": enc_mask,
            "dec_mask": dec_mask,
        }

    def __getitem__(self, idx: int | None) -> dict[str, torch.Tensor]:
        """The sample as tensors; ``None`` gives a padding sample with a zero loss mask."""
        if idx is not None and not -len(self) <= idx < len(self):
            raise IndexError(
                f"sample {idx} out of range for {self.index_split} dataset of {len(self)} samples"
            )
        arrays = self.sample_arrays(0 if idx is None else idx % len(self))
        sample = {k: torch.as_tensor(v, dtype=torch.int64) for k, v in arrays.items()}
        if idx is None:
            sample["loss_mask"].zero_()
        return sample


# --------------------------------------------------------------------------------------------------
# mock data and the builder


class MockSentenceDataset:
    """Synthetic sentence-level documents for ``--mock-data`` (no files): document ``d`` has
    ``1 + d % 7`` sentences of 5-40 tokens, ids drawn by a fixed generator from the vocabulary's
    ordinary (non-special) tokens."""

    seed = 0
    num_documents = 20_000

    def __init__(self, tokenizer) -> None:
        vocab = T5Vocab.from_tokenizer(tokenizer)
        special = {vocab.bos, vocab.eos, vocab.pad, vocab.cls, vocab.sep, vocab.mask, *vocab.sentinels}
        special |= set(getattr(tokenizer, "special_token_ids", ()) or ())
        self.ordinary = np.array(
            [i for i in range(tokenizer.vocab_size) if i not in special and i in vocab.inv_vocab], np.int64
        )
        counts = 1 + np.arange(self.num_documents) % 7
        self.document_indices = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
        rng = np.random.default_rng(self.seed)
        self.sequence_lengths = rng.integers(5, 41, size=int(self.document_indices[-1]), dtype=np.int32)
        self._offsets = np.concatenate(([0], np.cumsum(self.sequence_lengths, dtype=np.int64)))

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def __getitem__(self, idx: int) -> np.ndarray:
        start = int(self._offsets[idx])
        positions = np.arange(start, start + int(self.sequence_lengths[idx]), dtype=np.int64)
        return self.ordinary[(positions * 2654435761 + 12345) % len(self.ordinary)]

    def fingerprint(self) -> dict[str, Any]:
        return {"mock": {"seed": self.seed, "num_documents": self.num_documents}}


def _open_sentences(prefix: str, config: T5DatasetConfig) -> IndexedDataset:
    dataset = IndexedDataset(prefix, multimodal=False, mmap=config.mmap_bin_files)
    check_token_ids(dataset, config.tokenizer.vocab_size)
    return dataset


def _documents(low) -> int:
    return len(low.document_indices) - 1


def t5_datasets_kind():
    """The builder's :class:`~mcore.data.builder.DatasetKind` for T5 (``--split`` divides documents)."""
    from mcore.data.builder import DatasetKind

    return DatasetKind(T5Dataset, T5Dataset, MockSentenceDataset, _documents, _open_sentences)


def t5_dataset_config(data_config, tokenizer, encoder_seq_length: int, decoder_seq_length: int, seed: int):
    """The :class:`T5DatasetConfig` of the data flags (``--mask-prob``, ``--short-seq-prob``, ...)."""
    from mcore.data.splits import parse_split, split_matrix

    return T5DatasetConfig(
        random_seed=seed,
        sequence_length=encoder_seq_length,
        sequence_length_decoder=decoder_seq_length,
        tokenizer=tokenizer,
        masking_probability=data_config.mask_prob,
        short_sequence_probability=data_config.short_seq_prob,
        split=data_config.split,
        split_matrix=split_matrix(parse_split(data_config.split)),
        path_to_cache=data_config.data_cache_path,
        mmap_bin_files=data_config.mmap_bin_files,
        mid_level_dataset_surplus=data_config.mid_level_dataset_surplus,
    )


def build_t5_datasets(
    data_config,
    tokenizer,
    encoder_seq_length: int,
    decoder_seq_length: int,
    seed: int,
    train_valid_test_num_samples: Sequence[int | None],
):
    """(train, valid, test) T5 datasets from ``--data-path`` (blends and ``--split`` as GPT's),
    the per-split paths, or ``--mock-data``."""
    from mcore.data.builder import build_datasets

    config = t5_dataset_config(data_config, tokenizer, encoder_seq_length, decoder_seq_length, seed)
    return build_datasets(data_config, config, train_valid_test_num_samples, t5_datasets_kind())
