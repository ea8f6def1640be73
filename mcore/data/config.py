"""Data and tokenizer configuration, with Megatron-LM's flag names.

``DataConfig`` says where samples come from (``--data-path`` blends with ``--split``, per-split paths, or
``--mock-data``) and how they are shaped (``--reset-position-ids`` ...). ``TokenizerConfig`` says which
tokenizer to build. The sequence length is not here (the model config owns ``--seq-length``); dataset
builders take it as an argument.
"""

from __future__ import annotations

from dataclasses import dataclass

from mcore.config.fields import ConfigError, check, flag
from mcore.data.splits import DEFAULT_SPLIT, parse_blend, parse_split

TOKENIZER_TYPES = (
    "GPT2BPETokenizer",
    "HuggingFaceTokenizer",
    "NullTokenizer",
    # BERT
    "BertWordPieceLowerCase",
    "BertWordPieceCase",
)
BERT_TOKENIZER_TYPES = ("BertWordPieceLowerCase", "BertWordPieceCase")


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Training data: sources, split, index cache and sample shaping."""

    data_path: tuple[str, ...] = flag(
        (), "Dataset prefixes, optionally weighted: 'P' or 'W1 P1 W2 P2 ...' (split by --split).", nargs="*"
    )
    """Blend of ``.bin/.idx`` prefixes; an even-length list of numbers and prefixes is weighted."""
    split: str = flag(
        DEFAULT_SPLIT, "Train/valid/test proportions of each --data-path dataset, e.g. '969,30,1'."
    )
    """Fractions of the sequences of every dataset that go to train, valid and test."""
    train_data_path: tuple[str, ...] = flag(
        (), "Blend used only for training (instead of --data-path).", nargs="*"
    )
    """Per-split blend for train (bypasses --split)."""
    valid_data_path: tuple[str, ...] = flag((), "Blend used only for validation.", nargs="*")
    """Per-split blend for valid."""
    test_data_path: tuple[str, ...] = flag((), "Blend used only for testing.", nargs="*")
    """Per-split blend for test."""
    mock_data: bool = flag(False, "Train on synthetic data (no files needed).")
    """Use the mock dataset instead of files."""
    data_cache_path: str | None = flag(
        None, "Directory for cached dataset indices (default: next to the data)."
    )
    """Where index caches go; blended-dataset indices are cached only when this is set."""
    num_workers: int = flag(2, "Data loader worker processes per rank.")
    dataloader_type: str = flag(
        "single",
        "Sample order of the training loader: single (the dataset's own shuffled order, read once) or "
        "cyclic (Megatron's random sampler: each epoch a fresh permutation from --seed and the epoch).",
        choices=("single", "cyclic"),
    )
    """Background workers that prepare batches."""
    reset_position_ids: bool = flag(False, "Restart position ids after every end-of-document token.")
    """Position ids restart at 0 after each EOD."""
    reset_attention_mask: bool = flag(
        False, "Block attention across end-of-document tokens (adds attention_mask)."
    )
    """Tokens do not attend across documents; batches then carry an explicit attention_mask."""
    eod_mask_loss: bool = flag(False, "Give no loss to end-of-document input tokens.")
    """loss_mask is 0 where the input token is EOD."""
    mmap_bin_files: bool = flag(
        True, "Read .bin files with file reads instead of mmap.", name="--no-mmap-bin-files"
    )
    """Memory-map the .bin files (default) or read them."""
    mid_level_dataset_surplus: float = flag(
        0.005, "Extra fraction of samples each blended component builds beyond its share."
    )
    """Margin so that a blend never asks a component for more samples than it built."""
    # BERT
    mask_prob: float = flag(0.15, "Probability of replacing a token with [MASK] (BERT, T5).")
    """Share of the tokens the masked-LM datasets mask (Megatron's --mask-prob)."""
    short_seq_prob: float = flag(0.1, "Probability of a sample shorter than --seq-length (BERT).")
    """Probability that a BERT sample's target length is drawn shorter (Megatron's --short-seq-prob)."""

    def __post_init__(self) -> None:
        check(self.num_workers >= 0, f"num_workers={self.num_workers} must be >= 0")
        check(
            self.mid_level_dataset_surplus >= 0,
            f"mid_level_dataset_surplus={self.mid_level_dataset_surplus} must be >= 0",
        )
        per_split = any((self.train_data_path, self.valid_data_path, self.test_data_path))
        if self.data_path and per_split:
            raise ConfigError(
                "give --data-path or --train-data-path/--valid-data-path/--test-data-path, not both"
            )
        if self.mock_data and (self.data_path or per_split):
            raise ConfigError(
                "--mock-data generates its own samples; drop --data-path and the per-split paths"
            )
        check(0.0 < self.mask_prob < 1.0, f"--mask-prob {self.mask_prob} must be in (0, 1)")
        check(0.0 <= self.short_seq_prob <= 1.0, f"--short-seq-prob {self.short_seq_prob} must be in [0, 1]")
        parse_split(self.split)  # raises ConfigError naming the string
        for name in ("data_path", "train_data_path", "valid_data_path", "test_data_path"):
            values = getattr(self, name)
            if values:
                prefixes, _ = parse_blend(values, "--" + name.replace("_", "-"))
                check(len(prefixes) > 0, f"--{name.replace('_', '-')} has no dataset prefix")


@dataclass(frozen=True, kw_only=True)
class TokenizerConfig:
    """Tokenizer selection and its files."""

    tokenizer_type: str | None = flag(None, "Tokenizer to use.", choices=TOKENIZER_TYPES)
    """GPT2BPETokenizer, HuggingFaceTokenizer, NullTokenizer, BertWordPieceLowerCase or BertWordPieceCase."""
    vocab_file: str | None = flag(
        None,
        "GPT-2 vocab.json (GPT2BPETokenizer) or WordPiece vocab.txt (BertWordPiece*). --vocab is kept as a spelling: the CodeParrot blog's "
        "preprocessing line abbreviates it so.",
        aliases=("--vocab",),
    )
    """Token -> id JSON."""
    merge_file: str | None = flag(None, "GPT-2 merges.txt (GPT2BPETokenizer).")
    """BPE merges in rank order."""
    tokenizer_model: str | None = flag(
        None, "Local tokenizer.json or tokenizer directory (HuggingFaceTokenizer)."
    )
    """Path of a Hugging Face tokenizer; nothing is downloaded."""
    vocab_size: int | None = flag(None, "Vocabulary size without EOD (NullTokenizer).")
    """NullTokenizer ids are 0..vocab_size-1 and EOD = vocab_size."""
    # BERT
    vocab_extra_ids: int = flag(
        0, "Append <extra_id_0..N-1> to a BertWordPiece vocabulary (T5's sentinel tokens)."
    )
    """Number of T5 sentinel tokens appended after [BOS] and [EOS]."""

    def __post_init__(self) -> None:
        kind = self.tokenizer_type
        check(self.vocab_extra_ids >= 0, f"--vocab-extra-ids {self.vocab_extra_ids} must be >= 0")
        check(
            kind is None or kind in TOKENIZER_TYPES,
            f"tokenizer_type={kind!r} is not one of {', '.join(TOKENIZER_TYPES)}",
        )
        if kind == "GPT2BPETokenizer":
            check(
                self.vocab_file is not None and self.merge_file is not None,
                f"--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file "
                f"(got vocab_file={self.vocab_file!r}, merge_file={self.merge_file!r})",
            )
        elif kind == "HuggingFaceTokenizer":
            check(
                self.tokenizer_model is not None,
                "--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model",
            )
        elif kind in BERT_TOKENIZER_TYPES:
            check(
                self.vocab_file is not None,
                f"--tokenizer-type {kind} needs --vocab-file (a WordPiece vocab.txt)",
            )
        elif kind == "NullTokenizer":
            check(
                self.vocab_size is not None and self.vocab_size >= 1,
                f"--tokenizer-type NullTokenizer needs --vocab-size >= 1 (got vocab_size={self.vocab_size})",
            )
