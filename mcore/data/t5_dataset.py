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
truncated to the target length, masked by the shared masked-LM step
(:meth:`mcore.data.masked_dataset.MaskedWordPieceDataset.create_masked_lm_predictions`) with Megatron's
T5 settings: whole words (a piece starting ``##`` joins the word before it), about ``--mask-prob`` of
the tokens, in spans whose length is drawn from a geometric distribution (p = 0.2, at most 10:
SpanBERT's), never overlapping. Each span
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

import re
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mcore.data.errors import DataError
from mcore.data.masked_dataset import MaskedWordPieceDataset, MaskedWordPieceDatasetConfig

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


class _T5TokenizerView:
    """A tokenizer without BERT's ``cls/sep/mask`` (a T5 SentencePiece vocabulary) as the masked-LM
    datasets read it: those ids are -1 (no token is one; masked tokens never reach a T5 sample, the
    sentinels replace them), ``inv_vocab`` and the sentinels from the vocabulary, BOS = the pad id."""

    def __init__(self, tokenizer, vocab: T5Vocab) -> None:
        self._tokenizer = tokenizer
        self.cls = self.sep = self.mask = -1
        self.pad = vocab.pad if vocab.pad is not None else -1
        self.bos, self.eos = vocab.bos, vocab.eos
        self.inv_vocab = vocab.inv_vocab
        self.additional_special_tokens_ids = list(vocab.sentinels)

    def __getattr__(self, name: str):
        if name.startswith("__") or name == "_tokenizer":  # pickling (loader workers) looks these up first
            raise AttributeError(name)
        return getattr(self._tokenizer, name)


def t5_tokenizer(tokenizer):
    """``tokenizer`` as the T5 dataset reads it (a BERT WordPiece tokenizer as it is)."""
    vocab = T5Vocab.from_tokenizer(tokenizer)
    if all(getattr(tokenizer, n, None) is not None for n in ("cls", "sep", "mask", "pad", "inv_vocab")):
        return tokenizer
    return _T5TokenizerView(tokenizer, vocab)


# --------------------------------------------------------------------------------------------------
# the dataset


@dataclass(frozen=True, kw_only=True)
class T5DatasetConfig(MaskedWordPieceDatasetConfig):
    """Everything a T5 dataset's samples depend on besides its documents: the masked-LM fields with
    Megatron's ``pretrain_t5.py`` values (whole-word masking, geometric span lengths up to 10) and the
    decoder's length. ``sequence_length`` is the encoder's."""

    sequence_length_decoder: int
    masking_max_ngram: int = 10
    masking_do_full_word: bool = True
    masking_use_geometric_distribution: bool = True

    def __post_init__(self) -> None:
        if self.sequence_length < 4:
            raise DataError(f"--encoder-seq-length {self.sequence_length} must be at least 4")
        if self.sequence_length_decoder < 2:
            raise DataError(f"--decoder-seq-length {self.sequence_length_decoder} must be at least 2")
        object.__setattr__(self, "tokenizer", t5_tokenizer(self.tokenizer))
        super().__post_init__()
        self.check_maskable("--encoder-seq-length", 2)  # BOS and EOS


class T5Dataset(MaskedWordPieceDataset):
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
        super().__init__(indexed_dataset, dataset_path, indices, num_samples, index_split, config)
        self.vocab = T5Vocab.from_tokenizer(config.tokenizer)
        self.sample_index = self.build_sample_index(config.sequence_length - 2, 1)  # room for BOS and EOS

    def _key_identifiers(self):
        return [*super()._key_identifiers(), ("sequence_length_decoder", self.config.sequence_length_decoder)]

    def token_mask(self, rng: np.random.RandomState) -> int | None:
        """Always the mask id (no draw): the sentinels replace the masked spans anyway."""
        return self.config.tokenizer.mask

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
        tokens, _, _, _, spans = self.create_masked_lm_predictions(tokens, target, rng)
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
        pad = self.pad_id
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
    from mcore.data.builder import build_split_datasets

    config = t5_dataset_config(data_config, tokenizer, encoder_seq_length, decoder_seq_length, seed)
    sizes = list(train_valid_test_num_samples)
    return build_split_datasets(
        data_config, config, sizes, T5Dataset, lambda: (T5Dataset, MockSentenceDataset(tokenizer))
    )
