"""Tokenizers: GPT-2 BPE parity with Hugging Face on the same files, HF tokenizer.json, Null, training."""

from __future__ import annotations

import json
import os
import pickle

import pytest

from mcore.config.fields import ConfigError
from mcore.data.config import TokenizerConfig
from mcore.data.errors import DataError
from mcore.data.tokenizers import (
    EOD_TOKEN,
    GPT2BPETokenizer,
    HuggingFaceTokenizer,
    NullTokenizer,
    build_tokenizer,
    train_bpe_tokenizer,
)

from .conftest import CORPUS

PARITY_TEXTS = [
    *CORPUS[:6],
    "",
    " ",
    "   leading and trailing   ",
    "tabs\tand\r\nwindows newlines\n",
    "unseen words: zyxwvut qqqq ʃʒ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "a<|endoftext|>b and <|endoftext|> again",
    "'s 't 're 've 'm 'll 'd 'S",
]


def test_trained_files_are_gpt2_style(bpe_files):
    vocab_path, merges_path = bpe_files
    vocab = json.load(open(vocab_path, encoding="utf-8"))
    assert len(vocab) == 500 and EOD_TOKEN in vocab
    with open(merges_path, encoding="utf-8") as f:
        assert f.readline().startswith("#version")
    tok = GPT2BPETokenizer(vocab_path, merges_path)
    assert tok.vocab_size == 500 and tok.eod == vocab[EOD_TOKEN] and tok.pad is None


def test_gpt2_parity_with_transformers(bpe_files):
    transformers = pytest.importorskip("transformers", reason="transformers is needed for the HF parity test")
    tok = GPT2BPETokenizer(*bpe_files)
    hf = transformers.GPT2TokenizerFast.from_pretrained(os.path.dirname(bpe_files[0]))
    for text in PARITY_TEXTS:
        assert tok.tokenize(text) == hf(text)["input_ids"], text
    assert tok.tokenize_batch(PARITY_TEXTS) == [hf(t)["input_ids"] for t in PARITY_TEXTS]
    assert tok.eod == hf.eos_token_id and tok.vocab_size == len(hf)


def test_gpt2_parity_with_tokenizers_byte_level_bpe(bpe_files):
    tokenizers = pytest.importorskip("tokenizers")
    tok = GPT2BPETokenizer(*bpe_files)
    reference = tokenizers.ByteLevelBPETokenizer(*bpe_files)  # no special tokens: plain text only
    for text in PARITY_TEXTS:
        if EOD_TOKEN not in text:
            assert tok.tokenize(text) == reference.encode(text).ids, text


def test_gpt2_round_trip_and_pickle(bpe_files):
    tok = GPT2BPETokenizer(*bpe_files)
    for text in PARITY_TEXTS:
        assert tok.detokenize(tok.tokenize(text)) == text
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.tokenize(CORPUS[3]) == tok.tokenize(CORPUS[3])


def test_gpt2_bad_files(bpe_files, tmp_path):
    vocab_path, merges_path = bpe_files
    with pytest.raises(DataError, match=r"--vocab-file .*missing\.json: no such file"):
        GPT2BPETokenizer(str(tmp_path / "missing.json"), merges_path)
    with pytest.raises(DataError, match=r"--merge-file .*missing\.txt: no such file"):
        GPT2BPETokenizer(vocab_path, str(tmp_path / "missing.txt"))
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(DataError, match=r"broken\.json: not valid JSON"):
        GPT2BPETokenizer(str(broken), merges_path)
    no_eod = tmp_path / "no_eod.json"
    vocab = json.load(open(vocab_path, encoding="utf-8"))
    del vocab[EOD_TOKEN]
    no_eod.write_text(json.dumps(vocab))
    with pytest.raises(DataError, match=r"no_eod\.json: no <\|endoftext\|> token"):
        GPT2BPETokenizer(str(no_eod), merges_path)


def test_huggingface_tokenizer_directory_matches_auto_tokenizer(bpe_files, tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers is needed for the HF parity test")
    hf = transformers.GPT2TokenizerFast.from_pretrained(os.path.dirname(bpe_files[0]))
    hf.save_pretrained(tmp_path / "saved")
    ours = HuggingFaceTokenizer(str(tmp_path / "saved"))
    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "saved"), local_files_only=True)
    for text in PARITY_TEXTS:
        assert ours.tokenize(text) == auto(text)["input_ids"], text
    assert ours.vocab_size == len(auto) and ours.eod == auto.eos_token_id
    assert ours.eod in ours.special_token_ids
    assert pickle.loads(pickle.dumps(ours)).tokenize("hello") == ours.tokenize("hello")


def test_huggingface_tokenizer_json_with_bos(bpe_files, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    tok = GPT2BPETokenizer(*bpe_files)._tok
    tok.add_special_tokens(["<s>", "<pad>"])
    bos = tok.token_to_id("<s>")
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bos)]
    )
    folder = tmp_path / "llama_like"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": EOD_TOKEN, "bos_token": {"content": "<s>"}, "pad_token": "<pad>"})
    )
    ours = HuggingFaceTokenizer(str(folder))
    assert ours.tokenize("hello")[0] == bos  # the BOS the tokenizer adds by default is kept (Megatron does)
    assert ours.bos == bos and ours.pad == tok.token_to_id("<pad>") and ours.vocab_size == 502
    assert HuggingFaceTokenizer(str(folder / "tokenizer.json")).eod == tok.token_to_id(EOD_TOKEN)
    assert ours.pad not in ours.special_token_ids and {bos, ours.eod} <= ours.special_token_ids
    # A pad that is the EOS token collides (GPTDataset then pads with -1, as Megatron does).
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": EOD_TOKEN, "pad_token": EOD_TOKEN})
    )
    same = HuggingFaceTokenizer(str(folder))
    assert same.pad == same.eod and same.pad in same.special_token_ids


def test_huggingface_tokenizer_missing(tmp_path):
    with pytest.raises(
        DataError, match=r"--tokenizer-model .*: no tokenizer\.json there .*nothing is downloaded"
    ):
        HuggingFaceTokenizer(str(tmp_path))
    with pytest.raises(DataError, match="no tokenizer.json"):
        HuggingFaceTokenizer("gpt2")


def test_null_tokenizer():
    tok = NullTokenizer(100)
    assert tok.vocab_size == 101 and tok.eod == 100
    assert tok.tokenize("1 2  30") == [1, 2, 30] and tok.tokenize("") == []
    assert tok.detokenize([4, 5]) == "4 5"
    with pytest.raises(ValueError, match="whitespace-separated integers"):
        tok.tokenize("one two")


def test_build_tokenizer_from_config(bpe_files):
    vocab_path, merges_path = bpe_files
    tok = build_tokenizer(
        TokenizerConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab_path, merge_file=merges_path)
    )
    assert isinstance(tok, GPT2BPETokenizer)
    assert build_tokenizer(TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=7)).eod == 7
    with pytest.raises(DataError, match="--tokenizer-type is required"):
        build_tokenizer(TokenizerConfig())


def test_tokenizer_config_validation():
    with pytest.raises(ConfigError, match="needs --vocab-file and --merge-file .*merge_file=None"):
        TokenizerConfig(tokenizer_type="GPT2BPETokenizer", vocab_file="v.json")
    with pytest.raises(ConfigError, match="needs --tokenizer-model"):
        TokenizerConfig(tokenizer_type="HuggingFaceTokenizer")
    with pytest.raises(ConfigError, match="needs --vocab-size >= 1"):
        TokenizerConfig(tokenizer_type="NullTokenizer")
    with pytest.raises(ConfigError, match="is not one of"):
        TokenizerConfig(tokenizer_type="SentencePieceTokenizer")


def test_train_bpe_from_files_and_iterator(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(CORPUS), encoding="utf-8")
    from_file = train_bpe_tokenizer(str(corpus), 300, tmp_path / "a")
    from_iter = train_bpe_tokenizer(iter(CORPUS), 300, tmp_path / "b")
    for vocab_path, merges_path in (from_file, from_iter):
        tok = GPT2BPETokenizer(vocab_path, merges_path)
        assert tok.vocab_size == 300
        assert (
            tok.detokenize(tok.tokenize("anything at all, even ünïcödé")) == "anything at all, even ünïcödé"
        )
    assert sorted(os.listdir(tmp_path / "a")) == ["merges.txt", "vocab.json"]
    with pytest.raises(ValueError, match="must be >= 257"):
        train_bpe_tokenizer(iter(CORPUS), 100, tmp_path / "c")
