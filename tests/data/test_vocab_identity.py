"""The vocabulary's identity (a digest of the tokenizer's files): recorded by preprocessing, merging and
checkpoints; a dataset or checkpoint of another vocabulary of the same type and size is refused."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from mcore.checkpoint.compat import check_compatible, identity_note
from mcore.checkpoint.format import CheckpointError
from mcore.data.builder import _open
from mcore.data.config import TokenizerConfig
from mcore.data.errors import DataError
from mcore.data.gpt_dataset import GPTDatasetConfig
from mcore.data.merge import main as merge_main
from mcore.data.tokenizers import build_tokenizer
from mcore.data.vocab_identity import read_dataset_vocab, tokenizer_identity, write_dataset_vocab

sys.path.insert(0, str(Path(__file__).parent))
from conftest import write_toy_dataset  # noqa: E402


@pytest.fixture
def two_vocabs(bpe_files, tmp_path):
    """The session BPE and a copy whose merges differ: same type, same size, other ids."""
    vocab, merges = bpe_files
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(vocab, other / "vocab.json")
    lines = Path(merges).read_text().splitlines()
    (other / "merges.txt").write_text("\n".join([lines[0], *reversed(lines[1:])]) + "\n")
    a = TokenizerConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    b = TokenizerConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=str(other / "vocab.json"),
                        merge_file=str(other / "merges.txt"))  # fmt: skip
    return a, b


def test_identity_is_the_contents_not_the_path(two_vocabs, tmp_path):
    a, b = two_vocabs
    copy = tmp_path / "copy"
    copy.mkdir()
    shutil.copy(a.vocab_file, copy / "v.json")
    shutil.copy(a.merge_file, copy / "m.txt")
    moved = TokenizerConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=str(copy / "v.json"),
                            merge_file=str(copy / "m.txt"))  # fmt: skip
    assert tokenizer_identity(a) == tokenizer_identity(moved) != tokenizer_identity(b)
    assert build_tokenizer(a).identity == tokenizer_identity(a)


def test_checkpoint_of_another_vocabulary_needs_allow_vocab_resize(two_vocabs):
    a, b = two_vocabs
    meta = {"extra": {"tokenizer_vocab_size": 500, "tokenizer_identity": tokenizer_identity(a)}}
    with pytest.raises(CheckpointError, match="vocabulary files: .*--allow-vocab-resize"):
        check_compatible("ckpt/iter_0000002", meta, SimpleNamespace(tokenizer=b), tokenizer_vocab_size=500)
    allowed = check_compatible("c", meta, SimpleNamespace(tokenizer=b), tokenizer_vocab_size=500,
                               allow_vocab_resize=True)  # fmt: skip
    assert len(allowed) == 1
    assert check_compatible("c", meta, SimpleNamespace(tokenizer=a), tokenizer_vocab_size=500) == []
    # A checkpoint saved before the identity was recorded loads, with one warning line.
    old = {"extra": {"tokenizer_vocab_size": 500}}
    assert check_compatible("c", old, SimpleNamespace(tokenizer=b), tokenizer_vocab_size=500) == []
    assert identity_note("c", old, SimpleNamespace(tokenizer=b)).startswith(
        "warning: checkpoint c records no"
    )


def test_datasets_of_another_vocabulary_are_refused_when_opened_and_merged(two_vocabs, tmp_path, capsys):
    a, b = two_vocabs
    first, second = write_toy_dataset(str(tmp_path / "a")), write_toy_dataset(str(tmp_path / "b"))
    write_dataset_vocab(first, tokenizer_identity(a))
    write_dataset_vocab(second, tokenizer_identity(b))
    tokenizer = build_tokenizer(b)
    tokenizer.vocab_size = 1000  # the toy ids fit: only the identity tells the vocabularies apart
    with pytest.raises(DataError, match=r"--data-path .*a: the dataset was made with another tokenizer"):
        _open(first, GPTDatasetConfig(random_seed=1, sequence_length=8, tokenizer=tokenizer))
    _open(second, GPTDatasetConfig(random_seed=1, sequence_length=8, tokenizer=tokenizer))
    out = str(tmp_path / "ab")
    assert merge_main(["--input", first, second, "--output-prefix", out]) == 1
    assert "was made with another tokenizer" in capsys.readouterr().err
    assert not Path(out + ".bin").exists()
    assert merge_main(["--input", second, second, "--output-prefix", out]) == 0
    assert read_dataset_vocab(out) == tokenizer_identity(b)


def test_a_sequence_too_short_to_mask_any_token_is_refused(bpe_files):
    """BERT at --seq-length 8 (5 tokens besides [CLS]/[SEP]) with --mask-prob 0.15 masks 0.75 < 1 token:
    every loss would be zero. Megatron trains on; mcore names the flags."""
    from mcore.config.fields import ConfigError
    from mcore.data.bert_dataset import BERTMaskedWordPieceDatasetConfig

    tokenizer = SimpleNamespace(cls=1, sep=2, pad=0, mask=3, inv_vocab={0: "[PAD]"})
    with pytest.raises(
        ConfigError, match=r"--seq-length 8 with --mask-prob 0.15: .* at least 10 .*at least 0.2"
    ):
        BERTMaskedWordPieceDatasetConfig(random_seed=1, sequence_length=8, tokenizer=tokenizer)
    BERTMaskedWordPieceDatasetConfig(random_seed=1, sequence_length=10, tokenizer=tokenizer)


def test_extra_sentinel_ids_are_the_same_vocabulary(two_vocabs):
    """T5 data is preprocessed without --vocab-extra-ids and trained with 100 sentinels after the ids."""
    import dataclasses

    a, _ = two_vocabs
    assert tokenizer_identity(dataclasses.replace(a, vocab_extra_ids=100)) == tokenizer_identity(a)
