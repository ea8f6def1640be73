"""BERT WordPiece tokenizers: ids equal Hugging Face's BertTokenizer/BertTokenizerFast on the same vocab.txt,
and Megatron's ``_BertWordPieceTokenizer`` conventions (appended [BOS]/[EOS]/<extra_id_*>, eod, padding)."""

from __future__ import annotations

import pickle

import pytest

from mcore.config.fields import ConfigError
from mcore.data.config import TokenizerConfig
from mcore.data.errors import DataError
from mcore.data.tokenizers import BertWordPieceTokenizer, build_tokenizer, train_wordpiece_vocab
from mcore.models.transformer.model_config import padded_vocab_size

pytest.importorskip("tokenizers", reason="the 'tokenizers' package is needed for WordPiece")

CORPUS = [
    "The quick brown fox jumps over the lazy dog. It barked; the fox ran away!",
    "Megatron-LM trains large transformer language models with tensor and pipeline parallelism.",
    "Héllo wörld, naïve café — “quotes”, Ångström and emoji 🎉.",
    "CJK 日本語テキスト and 中文句子。 한국어 문장도 있다.",
    "Numbers 12345 and 3.14159, dates 2024-01-01, (brackets) [square] {curly} <angle>.",
    "It's, don't, we'll, they've: contractions everywhere... and ellipses?!",
] * 30

SAMPLES = [
    *CORPUS[:6],
    "",
    "   leading and trailing   \t\r\n",
    "UPPER lower MiXeD Çase ÉCOLE Straße",
    "unseen words: zyxwvut qqqq ʃʒ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ﬁ ligature",
    "control\x00chars\x07and\ufffdreplacement\u200bzero width",
    "punctuation!!! ¿qué? «guillemets» — dashes – and … @#$%^&*_+=|\\/~`",
    "中文，日本語、한국어 mixed with English words and 数字123",
    "a" * 150 + " " + "b" * 250,  # Megatron's WordPiece gives [UNK] only past 200 characters
]


@pytest.fixture(scope="module")
def vocab_files(tmp_path_factory) -> dict[bool, str]:
    root = tmp_path_factory.mktemp("wordpiece")
    return {
        lower: train_wordpiece_vocab(CORPUS, 400, root / str(lower), lower_case=lower)
        for lower in (True, False)
    }


@pytest.mark.parametrize("lower_case", [True, False], ids=["LowerCase", "Case"])
def test_ids_equal_transformers_bert_tokenizer(vocab_files, lower_case):
    transformers = pytest.importorskip("transformers")
    vocab = vocab_files[lower_case]
    kind = "BertWordPieceLowerCase" if lower_case else "BertWordPieceCase"
    tok = build_tokenizer(TokenizerConfig(tokenizer_type=kind, vocab_file=vocab))
    assert isinstance(tok, BertWordPieceTokenizer) and tok.lower_case is lower_case
    slow = transformers.BertTokenizer(vocab, do_lower_case=lower_case)
    fast = transformers.BertTokenizerFast(vocab, do_lower_case=lower_case)
    # Hugging Face's word limit is 100 characters, Megatron's 200: the long-word sample differs by design.
    for text in SAMPLES[:-1]:
        expected = slow.encode(text, add_special_tokens=False)
        assert tok.tokenize(text) == expected, text
        assert fast.encode(text, add_special_tokens=False) == expected, text
    assert tok.tokenize_batch(SAMPLES[:-1]) == [
        slow.encode(t, add_special_tokens=False) for t in SAMPLES[:-1]
    ]
    long_ids = tok.tokenize(SAMPLES[-1])
    assert long_ids[-1] == slow.unk_token_id and slow.unk_token_id not in long_ids[:-1]
    assert (tok.cls, tok.sep, tok.pad, tok.mask) == (
        slow.cls_token_id,
        slow.sep_token_id,
        slow.pad_token_id,
        slow.mask_token_id,
    )
    # Accents and case: only the lower-case variant folds them.
    assert (tok.tokenize("École") == tok.tokenize("ecole")) is lower_case


def test_megatron_special_tokens_and_vocab_padding(vocab_files, tmp_path):
    lines = open(vocab_files[True], encoding="utf-8").read().splitlines()
    lines += [f"filler{i}" for i in range(400 - len(lines))]  # exactly 400 tokens
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(lines) + "\n", encoding="utf-8")
    tok = BertWordPieceTokenizer(str(vocab), lower_case=True, vocab_extra_ids=3)
    n = len(lines)
    # Megatron appends [BOS], [EOS], then <extra_id_0..N-1>; eod is [EOS].
    assert (tok.bos, tok.eos, tok.eod) == (n, n + 1, n + 1)
    assert tok.additional_special_tokens_ids == [n + 2, n + 3, n + 4]
    assert tok.inv_vocab[n + 2] == "<extra_id_0>" and tok.vocab["[EOS]"] == n + 1
    assert tok.vocab_size == n + 5 == 405 == len(tok.inv_vocab)
    assert tok.pad == lines.index("[PAD]") and tok.pad not in tok.special_token_ids
    # Megatron's padding of the embedding table: 405 -> 512 with 128 * TP1, -> 512 with 64 * TP2.
    assert padded_vocab_size(tok.vocab_size, 128, 1) == 512
    assert padded_vocab_size(tok.vocab_size, 64, 2) == 512
    # As Megatron: appended tokens are ids only, the strings in text are split like ordinary text.
    assert tok.vocab["<extra_id_0>"] not in tok.tokenize("<extra_id_0>")
    ids = tok.tokenize("the quick brown fox")
    assert tok.detokenize(ids) == "the quick brown fox"
    assert tok.detokenize([tok.cls, *ids, tok.eos]) == "[CLS] the quick brown fox [EOS]"
    # Pickles for data-loader workers without the Rust object.
    assert pickle.loads(pickle.dumps(tok)).tokenize("fox jumps") == tok.tokenize("fox jumps")


def test_vocab_already_holding_bos_eos_keeps_their_ids(tmp_path, vocab_files):
    lines = open(vocab_files[False], encoding="utf-8").read().splitlines()
    path = tmp_path / "vocab.txt"
    path.write_text("\n".join(lines[:5] + ["[EOS]", "[BOS]"] + lines[5:]) + "\n", encoding="utf-8")
    tok = BertWordPieceTokenizer(str(path), lower_case=False, vocab_extra_ids=1)
    assert (tok.eos, tok.bos, tok.vocab_size) == (5, 6, len(lines) + 3)
    assert tok.additional_special_tokens_ids == [len(lines) + 2]


def test_bad_vocab_and_flags_are_one_clear_error(tmp_path):
    with pytest.raises(DataError, match="nope.txt: no such file"):
        BertWordPieceTokenizer(str(tmp_path / "nope.txt"))
    missing = tmp_path / "missing.txt"
    missing.write_text("[PAD]\n[UNK]\n[CLS]\nhello\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"missing.txt: no \[SEP\] \[MASK\] token"):
        BertWordPieceTokenizer(str(missing))
    dup = tmp_path / "dup.txt"
    dup.write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nhello\nhello\n", encoding="utf-8")
    with pytest.raises(DataError, match="dup.txt: token 'hello' on line 7 is already on line 6"):
        BertWordPieceTokenizer(str(dup))
    with pytest.raises(ConfigError, match="BertWordPieceCase needs --vocab-file"):
        TokenizerConfig(tokenizer_type="BertWordPieceCase")
    with pytest.raises(ConfigError, match="--vocab-extra-ids -1"):
        TokenizerConfig(tokenizer_type="BertWordPieceCase", vocab_file="v.txt", vocab_extra_ids=-1)
