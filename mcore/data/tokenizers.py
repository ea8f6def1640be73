"""Tokenizers for ``--tokenizer-type``: GPT-2 byte-level BPE, BERT WordPiece, a local Hugging Face tokenizer,
and a null one.

All BPE and WordPiece work is done by the Hugging Face ``tokenizers`` library (Rust), imported lazily so that
``import mcore`` does not need it. Every tokenizer offers:

* ``tokenize(text) -> list[int]`` and ``tokenize_batch(texts) -> list[list[int]]``,
  ``detokenize(ids) -> str``;
* ``vocab_size`` (unpadded; it picks the on-disk dtype: uint16 below 65500, else int32);
* ``eod`` (end-of-document id, appended by ``--append-eod``), ``pad`` (or None);
* ``unique_identifiers`` (an ordered dict that enters dataset cache descriptions).

GPT2BPETokenizer gives the ids of Hugging Face's ``GPT2TokenizerFast`` on the same ``vocab.json`` and
``merges.txt``: OpenAI's pre-tokenizer regex, bytes mapped through ``bytes_to_unicode``, merges by rank.
Like it (and like current Megatron-LM, whose GPT2BPETokenizer is that HF class), a literal
``<|endoftext|>`` in the text becomes the EOD id; Megatron's legacy hand-written tokenizer split it as
ordinary text instead. For plain text every implementation agrees.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from mcore.data.errors import DataError
from mcore.utils.outputs import with_umask

if TYPE_CHECKING:
    from mcore.data.config import TokenizerConfig

EOD_TOKEN = "<|endoftext|>"


def _import_tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError:
        raise DataError(
            "the Hugging Face 'tokenizers' package is needed for BPE tokenizers; install it with "
            "`pip install tokenizers` (or the mcore-train[data] extra)"
        ) from None
    return tokenizers


def _read_json(path: str, what: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise DataError(f"{what} {path}: no such file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DataError(f"{what} {path}: not valid JSON: {err}") from None


class Tokenizer:
    """The interface every tokenizer implements (see module doc)."""

    vocab_size: int
    pad: int | None = None
    identity: dict | None = None
    """Which token each id means (:mod:`mcore.data.vocab_identity`); set by :func:`build_tokenizer`."""

    @property
    def eod(self) -> int:
        """End-of-document id."""
        raise NotImplementedError

    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text``."""
        raise NotImplementedError

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text (a batch call where the backend has one)."""
        return [self.tokenize(t) for t in texts]

    def detokenize(self, ids: Sequence[int]) -> str:
        """Text of ``ids``."""
        raise NotImplementedError

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of the special tokens other than the pad token (a pad id among them is not used as padding)."""
        return frozenset({self.eod})

    @property
    def unique_identifiers(self) -> OrderedDict:
        """Identity of this tokenizer for cache descriptions: class and the files/args that define it."""
        raise NotImplementedError


class _RustBPE(Tokenizer):
    """Shared part of the tokenizers backed by a ``tokenizers.Tokenizer`` (picklable by its arguments)."""

    _tok: Any

    def __getstate__(self) -> dict[str, Any]:
        # Rebuild from the files in the child process instead of pickling the Rust object.
        return {k: v for k, v in self.__dict__.items() if k != "_tok"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._tok = self._load()

    def _load(self) -> Any:
        raise NotImplementedError

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts))]

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)


class GPT2BPETokenizer(_RustBPE):
    """GPT-2 byte-level BPE from ``vocab.json`` (token -> id) and ``merges.txt`` (``#version`` line, then
    one ``a b`` merge per line in rank order). ``vocab_size = len(vocab.json)``, ``eod`` = the id of
    ``<|endoftext|>`` (50256 for GPT-2), no pad.

    Raises:
        DataError: a missing or unreadable file, or a vocabulary without ``<|endoftext|>``.
    """

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        self.vocab_file = vocab_file
        self.merge_file = merge_file
        vocab = _read_json(vocab_file, "--vocab-file")
        if not isinstance(vocab, dict):
            raise DataError(f"--vocab-file {vocab_file}: expected a JSON object of token -> id")
        if EOD_TOKEN not in vocab:
            raise DataError(
                f"--vocab-file {vocab_file}: no {EOD_TOKEN} token; GPT2BPETokenizer uses it as EOD"
            )
        if not os.path.isfile(merge_file):
            raise DataError(f"--merge-file {merge_file}: no such file")
        self.vocab_size = len(vocab)
        self._eod = int(vocab[EOD_TOKEN])
        self._tok = self._load()

    def _load(self) -> Any:
        tk = _import_tokenizers()
        try:
            model = tk.models.BPE.from_file(self.vocab_file, self.merge_file)
        except Exception as err:  # the Rust side raises plain Exception for malformed files
            raise DataError(
                f"cannot load GPT-2 BPE from {self.vocab_file} and {self.merge_file}: {err}"
            ) from None
        tok = tk.Tokenizer(model)
        tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = tk.decoders.ByteLevel()
        tok.add_special_tokens([tk.AddedToken(EOD_TOKEN, special=True, normalized=False)])
        return tok

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict(
            [
                ("class", f"{type(self).__module__}.{type(self).__qualname__}"),
                ("tokenizer_path", [self.vocab_file, self.merge_file]),
            ]
        )


def _special_token_content(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


class HuggingFaceTokenizer(_RustBPE):
    """A local Hugging Face tokenizer: ``tokenizer.json`` or a directory that holds one.

    ``tokenize`` returns ``encode(text).ids`` *with* the special tokens the tokenizer adds by default
    (e.g. Llama's BOS), as Megatron's HuggingFaceTokenizer does. ``vocab_size`` includes added tokens
    (``len(tokenizer)``); ``eod`` / ``pad`` / ``bos`` come from ``eos_token`` / ``pad_token`` /
    ``bos_token`` in ``tokenizer_config.json`` or ``special_tokens_map.json`` next to it. Nothing is
    downloaded: a hub name that is not a local path is an error.
    """

    def __init__(self, tokenizer_model: str) -> None:
        self.tokenizer_model = tokenizer_model
        path = tokenizer_model
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(path):
            raise DataError(
                f"--tokenizer-model {tokenizer_model}: no tokenizer.json there (give a local tokenizer.json or a "
                "directory saved with save_pretrained; nothing is downloaded)"
            )
        self.tokenizer_file = path
        self._tok = self._load()
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        specials: dict[str, str] = {}
        folder = os.path.dirname(path)
        for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the config wins
            file = os.path.join(folder, name)
            if os.path.isfile(file):
                data = _read_json(file, "tokenizer file")
                for key in ("eos_token", "bos_token", "pad_token"):
                    content = _special_token_content(data.get(key))
                    if content is not None:
                        specials[key] = content
        self._eos = self._id_of(specials.get("eos_token"))
        self.bos = self._id_of(specials.get("bos_token"))
        self._pad_token = specials.get("pad_token")
        self.pad = self._id_of(self._pad_token)
        if self._eos is None:
            for fallback in (EOD_TOKEN, "</s>", "<eos>", "<|end_of_text|>"):
                self._eos = self._id_of(fallback)
                if self._eos is not None:
                    break

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def _load(self) -> Any:
        tk = _import_tokenizers()
        try:
            return tk.Tokenizer.from_file(self.tokenizer_file)
        except Exception as err:
            raise DataError(f"--tokenizer-model {self.tokenizer_file}: cannot load: {err}") from None

    @property
    def eod(self) -> int:
        if self._eos is None:
            raise DataError(
                f"--tokenizer-model {self.tokenizer_model}: the tokenizer names no eos_token (tokenizer_config.json), "
                "which is needed as the end-of-document id"
            )
        return self._eos

    @property
    def special_token_ids(self) -> frozenset[int]:
        # As Megatron: every special token but the pad token itself, so that a pad sharing its id with
        # EOS (a common Llama set-up) counts as a collision.
        ids = {i for i, added in self._tok.get_added_tokens_decoder().items() if added.special}
        ids -= {self._tok.token_to_id(self._pad_token)} if self._pad_token is not None else set()
        ids |= {i for i in (self._eos, self.bos) if i is not None}
        return frozenset(ids)

    @property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict(
            [
                ("class", f"{type(self).__module__}.{type(self).__qualname__}"),
                ("tokenizer_path", self.tokenizer_model),
            ]
        )


BERT_SPECIAL_TOKENS = ("[CLS]", "[SEP]", "[PAD]", "[MASK]")


def load_wordpiece_vocab(vocab_file: str) -> dict[str, int]:
    """``vocab.txt`` -> {token: id}: one token per line, id = line number, surrounding whitespace stripped
    (as Megatron's and Google's ``load_vocab``).

    Raises:
        DataError: a missing or non-UTF-8 file, or a token listed twice (Megatron would silently give the
            later line's id and a vocabulary size that collides with the tokens it appends).
    """
    vocab: dict[str, int] = {}
    try:
        with open(vocab_file, encoding="utf-8") as f:
            for index, line in enumerate(f):
                token = line.strip()
                if token in vocab:
                    raise DataError(
                        f"--vocab-file {vocab_file}: token {token!r} on line {index + 1} is already on line "
                        f"{vocab[token] + 1}; a WordPiece vocabulary lists each token once"
                    )
                vocab[token] = index
    except FileNotFoundError:
        raise DataError(f"--vocab-file {vocab_file}: no such file") from None
    except UnicodeDecodeError as err:
        raise DataError(f"--vocab-file {vocab_file}: not UTF-8 text: {err}") from None
    return vocab


class BertWordPieceTokenizer(_RustBPE):
    """Megatron's ``BertWordPieceLowerCase`` / ``BertWordPieceCase``: BERT WordPiece from a ``vocab.txt``.

    The work is done by the ``tokenizers`` library with BERT's pipeline: clean text (control characters
    dropped, whitespace -> space), CJK characters split apart, lowercasing *and* accent stripping (NFD,
    combining marks dropped) only for the lower-case variant, split on whitespace and punctuation, then
    greedy longest-match-first WordPiece with ``##`` continuations and ``[UNK]`` for a word that does not
    decompose or is longer than 200 characters (Google's and Megatron's limit; Hugging Face's
    ``BertTokenizer`` uses 100). ``tokenize`` adds no ``[CLS]``/``[SEP]`` (the datasets place them).

    As Megatron's ``_BertWordPieceTokenizer``: ``[BOS]`` and ``[EOS]`` are appended to the vocabulary when
    absent, then ``<extra_id_0..N-1>`` for ``--vocab-extra-ids N`` (T5's sentinels); ``vocab_size`` counts
    them (a 30522-token ``vocab.txt`` gives 30524); ``eod`` is ``[EOS]``; ``cls/sep/pad/mask`` are the ids of
    ``[CLS] [SEP] [PAD] [MASK]``. Like Megatron, the appended tokens are ids only: the same strings inside
    a text are tokenized as ordinary text (Hugging Face's BertTokenizer keeps ``[MASK]`` etc. whole).
    ``detokenize`` joins the tokens with spaces and glues ``##`` pieces, as Megatron's ``decode``.

    Raises:
        DataError: a missing/unreadable/duplicated vocabulary, or one without ``[CLS] [SEP] [PAD] [MASK]
            [UNK]``.
    """

    def __init__(self, vocab_file: str, lower_case: bool = True, vocab_extra_ids: int = 0) -> None:
        if vocab_extra_ids < 0:
            raise DataError(f"--vocab-extra-ids {vocab_extra_ids} must be >= 0")
        self.vocab_file = vocab_file
        self.lower_case = lower_case
        self.vocab_extra_ids = vocab_extra_ids
        vocab = load_wordpiece_vocab(vocab_file)
        missing = [t for t in (*BERT_SPECIAL_TOKENS, "[UNK]") if t not in vocab]
        if missing:
            raise DataError(f"--vocab-file {vocab_file}: no {' '.join(missing)} token (BERT needs them)")
        self._wordpiece_size = len(vocab)
        self.bos_token, self.eos_token = "[BOS]", "[EOS]"
        self.additional_special_tokens = [f"<extra_id_{i}>" for i in range(vocab_extra_ids)]
        for token in (self.bos_token, self.eos_token, *self.additional_special_tokens):
            vocab.setdefault(token, len(vocab))
        self.vocab = vocab
        self.inv_vocab = {i: t for t, i in vocab.items()}
        self.vocab_size = len(vocab)
        self.cls, self.sep, self.pad, self.mask = (vocab[t] for t in BERT_SPECIAL_TOKENS)
        self.bos, self.eos = vocab[self.bos_token], vocab[self.eos_token]
        self._tok = self._load()

    def _load(self) -> Any:
        tk = _import_tokenizers()
        # The WordPiece model knows only vocab.txt; appended tokens are never produced from text.
        wordpiece_vocab = {t: i for t, i in self.vocab.items() if i < self._wordpiece_size}
        tok = tk.Tokenizer(
            tk.models.WordPiece(
                wordpiece_vocab,
                unk_token="[UNK]",
                max_input_chars_per_word=200,
                continuing_subword_prefix="##",
            )
        )
        tok.normalizer = tk.normalizers.BertNormalizer(
            clean_text=True,
            handle_chinese_chars=True,
            strip_accents=self.lower_case,
            lowercase=self.lower_case,
        )
        tok.pre_tokenizer = tk.pre_tokenizers.BertPreTokenizer()
        return tok

    @property
    def eod(self) -> int:
        return self.eos

    @property
    def additional_special_tokens_ids(self) -> list[int]:
        """Ids of ``<extra_id_0..N-1>`` in order."""
        return [self.vocab[t] for t in self.additional_special_tokens]

    @property
    def special_token_ids(self) -> frozenset[int]:
        ids = {self.cls, self.sep, self.mask, self.bos, self.eos, self.vocab["[UNK]"]}
        return frozenset(ids | set(self.additional_special_tokens_ids))

    def detokenize(self, ids: Sequence[int]) -> str:
        tokens = [self.inv_vocab[int(i)] for i in ids]
        return " ".join(tokens).replace(" ##", "").strip()

    @property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict(
            [
                ("class", f"{type(self).__module__}.{type(self).__qualname__}"),
                ("tokenizer_path", [self.vocab_file]),
                ("lower_case", self.lower_case),
                ("vocab_extra_ids", self.vocab_extra_ids),
            ]
        )


class NullTokenizer(Tokenizer):
    """Synthetic runs: text is whitespace-separated integer ids; ``vocab_size = V + 1``, ``eod = V``."""

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < 1:
            raise DataError(f"NullTokenizer needs --vocab-size >= 1, got {vocab_size}")
        self._base = int(vocab_size)
        self.vocab_size = self._base + 1

    @property
    def eod(self) -> int:
        return self._base

    def tokenize(self, text: str) -> list[int]:
        try:
            return [int(x) for x in text.split()]
        except ValueError:
            raise ValueError(
                f"NullTokenizer input must be whitespace-separated integers, got {text[:60]!r}"
            ) from None

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)

    @property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict(
            [("class", f"{type(self).__module__}.{type(self).__qualname__}"), ("vocab_size", self._base)]
        )


def build_tokenizer(config: TokenizerConfig) -> Tokenizer:
    """The tokenizer ``config.tokenizer_type`` names, from the files/sizes the config gives, with the
    identity of its vocabulary (:mod:`mcore.data.vocab_identity`) as ``identity``."""
    from mcore.data.vocab_identity import tokenizer_identity

    tokenizer = _build_tokenizer(config)
    tokenizer.identity = tokenizer_identity(config)
    return tokenizer


def _build_tokenizer(config: TokenizerConfig) -> Tokenizer:
    kind = config.tokenizer_type
    if kind == "GPT2BPETokenizer":
        assert config.vocab_file is not None and config.merge_file is not None
        return GPT2BPETokenizer(config.vocab_file, config.merge_file)
    if kind == "HuggingFaceTokenizer":
        assert config.tokenizer_model is not None
        return HuggingFaceTokenizer(config.tokenizer_model)
    if kind == "NullTokenizer":
        assert config.vocab_size is not None
        return NullTokenizer(config.vocab_size)
    if kind in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        assert config.vocab_file is not None
        return BertWordPieceTokenizer(
            config.vocab_file,
            lower_case=kind == "BertWordPieceLowerCase",
            vocab_extra_ids=config.vocab_extra_ids,
        )
    raise DataError(
        f"--tokenizer-type {kind!r}: choose GPT2BPETokenizer, HuggingFaceTokenizer, NullTokenizer, "
        "BertWordPieceLowerCase or BertWordPieceCase"
        if kind
        else "--tokenizer-type is required to build a tokenizer"
    )


def train_bpe_tokenizer(
    files_or_iterator: str | os.PathLike | Sequence[str | os.PathLike] | Iterable[str],
    vocab_size: int,
    output_dir: str | os.PathLike,
    min_frequency: int = 2,
) -> tuple[str, str]:
    """Train a GPT-2-style byte-level BPE and write ``vocab.json`` and ``merges.txt`` to ``output_dir``.

    The vocabulary holds the 256 byte symbols, the learned merges and ``<|endoftext|>``, so the files
    work with ``--tokenizer-type GPT2BPETokenizer`` (and with Hugging Face's GPT2TokenizerFast).

    Args:
        files_or_iterator: a text file path, a list of paths, or an iterable of strings (documents).
        vocab_size: the final vocabulary size, special token included (>= 257).
        output_dir: created if missing; the two files are written atomically.
        min_frequency: a pair must occur this often to be merged.

    Returns:
        The paths of ``vocab.json`` and ``merges.txt``.
    """
    if vocab_size < 257:
        raise ValueError(f"vocab_size={vocab_size} must be >= 257 (256 byte symbols + {EOD_TOKEN})")
    tk = _import_tokenizers()
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOD_TOKEN],
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    if isinstance(files_or_iterator, (str, os.PathLike)):
        tok.train([os.fspath(files_or_iterator)], trainer)
    elif isinstance(files_or_iterator, Sequence) and all(
        isinstance(f, (str, os.PathLike)) and os.path.isfile(f) for f in files_or_iterator
    ):
        tok.train([os.fspath(f) for f in files_or_iterator], trainer)
    else:
        tok.train_from_iterator(files_or_iterator, trainer)
    output_dir = os.fspath(output_dir)
    os.makedirs(output_dir, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".bpe-", dir=output_dir)
    try:
        tok.model.save(staging)
        paths = []
        for name in ("vocab.json", "merges.txt"):
            final = os.path.join(output_dir, name)
            os.replace(os.path.join(staging, name), final)
            paths.append(final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return paths[0], paths[1]


def train_wordpiece_vocab(
    files_or_iterator: str | os.PathLike | Sequence[str | os.PathLike] | Iterable[str],
    vocab_size: int,
    output_dir: str | os.PathLike,
    lower_case: bool = True,
    min_frequency: int = 2,
) -> str:
    """Train a BERT WordPiece vocabulary and write ``vocab.txt`` (one token per line) to ``output_dir``.

    The vocabulary starts with ``[PAD] [UNK] [CLS] [SEP] [MASK]`` (ids 0-4), then the alphabet and the
    learned pieces; it works with ``--tokenizer-type BertWordPieceLowerCase`` (``lower_case=True``) or
    ``BertWordPieceCase`` and with Hugging Face's ``BertTokenizer``. The text is normalized as the
    tokenizer will normalize it (lowercasing and accent stripping only when ``lower_case``).

    Args:
        files_or_iterator: a text file path, a list of paths, or an iterable of strings (documents).
        vocab_size: the largest vocabulary size, special tokens included.
        output_dir: created if missing; ``vocab.txt`` is written atomically.
        lower_case: train for the lower-case variant.
        min_frequency: a pair must occur this often to be merged.

    Returns:
        The path of ``vocab.txt``.
    """
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    if vocab_size <= len(specials):
        raise ValueError(f"vocab_size={vocab_size} must exceed the {len(specials)} special tokens")
    tk = _import_tokenizers()
    tok = tk.Tokenizer(tk.models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = tk.normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=lower_case, lowercase=lower_case
    )
    tok.pre_tokenizer = tk.pre_tokenizers.BertPreTokenizer()
    trainer = tk.trainers.WordPieceTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=specials,
        continuing_subword_prefix="##",
        show_progress=False,
    )
    if isinstance(files_or_iterator, (str, os.PathLike)):
        tok.train([os.fspath(files_or_iterator)], trainer)
    elif isinstance(files_or_iterator, Sequence) and all(
        isinstance(f, (str, os.PathLike)) and os.path.isfile(f) for f in files_or_iterator
    ):
        tok.train([os.fspath(f) for f in files_or_iterator], trainer)
    else:
        tok.train_from_iterator(files_or_iterator, trainer)
    vocab = sorted(tok.get_vocab(with_added_tokens=True).items(), key=lambda item: item[1])
    output_dir = os.fspath(output_dir)
    os.makedirs(output_dir, exist_ok=True)
    final = os.path.join(output_dir, "vocab.txt")
    fd, staging = tempfile.mkstemp(prefix=".vocab-", dir=output_dir)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.writelines(token + "\n" for token, _ in vocab)
        with_umask(staging)  # mkstemp makes it 0600
        os.replace(staging, final)
    except BaseException:
        if os.path.exists(staging):
            os.remove(staging)
        raise
    return final
