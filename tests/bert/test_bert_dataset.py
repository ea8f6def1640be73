"""Megatron's BERT dataset: mcore's samples equal megatron-core 0.16.1's BERTMaskedWordPieceDataset sample by
sample (single dataset, --split, blends, no binary head, the masking variants T5 uses), the sample index
equals the compiled ``build_mapping``, caching, mock data and the batch keys through the loader."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from mcore.config.fields import ConfigError
from mcore.data.bert_dataset import (
    BERT_BATCH_KEYS,
    BERTMaskedWordPieceDataset,
    BERTMaskedWordPieceDatasetConfig,
    bert_datasets_provider,
    build_bert_datasets,
)
from mcore.data.config import DataConfig
from mcore.data.errors import DataError
from mcore.data.indexed_dataset import IndexedDataset
from mcore.data.loader import build_pretraining_data_loader
from mcore.data.masked_indices import build_sentence_sample_index
from mcore.data.preprocess import main as preprocess_main
from mcore.data.splits import parse_split, split_matrix
from mcore.data.tokenizers import BertWordPieceTokenizer, train_wordpiece_vocab

pytest.importorskip("tokenizers")
pytestmark = pytest.mark.filterwarnings("ignore")

WORDS = (
    "the a of and to in is was for on with as by at from that this it an be are or his her they we "
    "which one all were there their been has had more when who will would no out up what about into "
    "than them can only other new some could time these two may then do first any my now such like "
    "our over man me even most made after also did many before must through back years where much "
    "your way well down should because each just those people mister how too little state good very "
    "make world still own see men work long get here between both life being under never day same "
    "another know while last might us great old year off come since against go came right used take"
).split()
RARE = "zyxomorphic quintessential brobdingnagian sesquipedalian xylophonist antidisestablishment".split()


def _corpus(num_docs: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(num_docs):
        sentences = []
        for _ in range(int(rng.integers(1, 9))):
            n = int(rng.integers(2, 30))
            words = [
                RARE[int(rng.integers(len(RARE)))]
                if rng.random() < 0.08
                else WORDS[int(rng.integers(len(WORDS)))]
                for _ in range(n)
            ]
            sentences.append(" ".join(words).capitalize() + rng.choice([".", "!", "?"]))
        docs.append(" ".join(sentences))
    return docs


@pytest.fixture(scope="module")
def bert_data(tmp_path_factory):
    """Two sentence-level datasets (A: 160 documents, B: 90) and their WordPiece tokenizer."""
    root = tmp_path_factory.mktemp("bert")
    corpus_a, corpus_b = _corpus(160, 0), _corpus(90, 1)
    vocab = train_wordpiece_vocab(corpus_a + corpus_b, 220, root, lower_case=True)
    prefixes = []
    for name, corpus in (("a", corpus_a), ("b", corpus_b)):
        inp = root / f"{name}.jsonl"
        inp.write_text("".join(json.dumps({"text": d}) + "\n" for d in corpus), encoding="utf-8")
        args = ["--input", str(inp), "--output-prefix", str(root / name), "--tokenizer-type",
                "BertWordPieceLowerCase", "--vocab-file", vocab, "--split-sentences"]  # fmt: skip
        assert preprocess_main(args) == 0
        prefixes.append(str(root / f"{name}_text_sentence"))
    tokenizer = BertWordPieceTokenizer(vocab, lower_case=True)
    assert tokenizer.pad == 0
    return tokenizer, prefixes[0], prefixes[1]


@pytest.fixture(scope="module")
def megatron_bert():
    pytest.importorskip("megatron.core", reason="megatron-core is needed for the BERT parity tests")
    from types import SimpleNamespace

    from megatron.core.datasets.bert_dataset import BERTMaskedWordPieceDataset as MegatronBERT
    from megatron.core.datasets.bert_dataset import BERTMaskedWordPieceDatasetConfig as MegatronConfig
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.utils import get_blend_from_list

    return SimpleNamespace(Dataset=MegatronBERT, Config=MegatronConfig, Builder=BlendedMegatronDatasetBuilder,
                           blend=get_blend_from_list)  # fmt: skip


def _megatron_build(mg, monkeypatch, tmp_path, paths, split, sizes, tokenizer, seq_length, seed, **masking):
    import torch

    # Megatron's masked dataset asks torch.distributed for the rank even in a single process.
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a, **k: 0)
    config = mg.Config(
        random_seed=seed, sequence_length=seq_length, blend=mg.blend(list(paths)), split=split,
        path_to_cache=str(tmp_path / "megatron-cache"), tokenizer=tokenizer,
        masking_probability=masking.get("masking_probability", 0.15),
        short_sequence_probability=masking.get("short_sequence_probability", 0.1),
        masking_max_ngram=masking.get("masking_max_ngram", 3),
        masking_do_full_word=masking.get("masking_do_full_word", False), masking_do_permutation=False,
        masking_use_longer_ngrams=masking.get("masking_use_longer_ngrams", False),
        masking_use_geometric_distribution=masking.get("masking_use_geometric_distribution", False),
        classification_head=masking.get("classification_head", True),
    )  # fmt: skip
    return mg.Builder(mg.Dataset, list(sizes), lambda: True, config).build()


def _our_config(tokenizer, split, seq_length, seed, tmp_path, **masking):
    return BERTMaskedWordPieceDatasetConfig(
        random_seed=seed, sequence_length=seq_length, tokenizer=tokenizer, split=split,
        split_matrix=split_matrix(parse_split(split)), path_to_cache=str(tmp_path / "mcore-cache"), **masking,
    )  # fmt: skip


def _compare(ours, theirs, step=1):
    assert len(ours) == len(theirs) > 0
    np.testing.assert_array_equal(ours.sample_index, theirs.sample_index)
    assert ours.sample_index.dtype == theirs.sample_index.dtype
    description = json.loads(ours.unique_description)
    assert description.pop("data_fingerprint")
    assert description == json.loads(theirs.unique_description)
    for i in range(0, len(ours), step):
        a, b = ours[i], theirs[i]
        for key in ("text", "types", "labels", "padding_mask", "loss_mask"):
            assert a[key].dtype.is_floating_point is False and a[key].tolist() == b[key].tolist(), (i, key)
        assert int(a["is_random"]) == b["is_random"] and int(a["truncated"]) == b["truncated"], i


@pytest.mark.parametrize("binary_head", [True, False], ids=["sop", "no-binary-head"])
def test_samples_equal_megatron(bert_data, megatron_bert, monkeypatch, tmp_path, binary_head):
    tokenizer, prefix, _ = bert_data
    sizes, split, seq, seed = (400, 30, 10), "90,7,3", 40, 1234
    data = DataConfig(data_path=(prefix,), split=split, data_cache_path=str(tmp_path / "mcore-cache"))
    ours = build_bert_datasets(data, tokenizer, seq, seed, sizes, classification_head=binary_head)
    theirs = _megatron_build(megatron_bert, monkeypatch, tmp_path, [prefix], split, sizes, tokenizer, seq, seed,
                             classification_head=binary_head)  # fmt: skip
    for a, b in zip(ours, theirs):
        _compare(a, b)
    train = ours[0]
    assert len(train) >= 400 and train.indices[-1] + 1 == round(0.9 * 160)  # split by documents
    stats = [train[i] for i in range(len(train))]
    masked = sum(int(s["loss_mask"].sum()) for s in stats) / sum(
        int(s["padding_mask"].sum()) - 3 for s in stats
    )
    assert 0.10 < masked < 0.16  # ~15% of the non-special tokens
    assert any(s["truncated"] for s in stats) and (any(s["is_random"] for s in stats) is binary_head)


@pytest.mark.parametrize(
    "masking",
    [
        {"masking_do_full_word": True},
        {"masking_use_geometric_distribution": True, "masking_max_ngram": 10, "masking_probability": 0.3},
        {"masking_use_longer_ngrams": True, "short_sequence_probability": 0.5},
    ],
    ids=["whole-word", "geometric", "longer-ngrams"],
)
def test_masking_variants_equal_megatron(bert_data, megatron_bert, monkeypatch, tmp_path, masking):
    tokenizer, prefix, _ = bert_data
    from mcore.data.indexed_dataset import IndexedDataset as Ours

    config = _our_config(tokenizer, "100,0,0", 32, 99, tmp_path, **masking)
    docs = np.arange(160, dtype=np.int32)
    ours = BERTMaskedWordPieceDataset(Ours(prefix), prefix, docs, 150, "train", config)
    theirs = _megatron_build(megatron_bert, monkeypatch, tmp_path, [prefix], "100,0,0", (150, 0, 0), tokenizer,
                             32, 99, **masking)[0]  # fmt: skip
    _compare(ours, theirs)


def test_blend_equals_megatron(bert_data, megatron_bert, monkeypatch, tmp_path):
    tokenizer, a, b = bert_data
    blend, sizes = ("0.3", a, "0.7", b), (200, 20, 10)
    data = DataConfig(data_path=blend, split="80,15,5", data_cache_path=str(tmp_path / "mcore-cache"))
    ours = build_bert_datasets(data, tokenizer, 48, 5, sizes)
    theirs = _megatron_build(megatron_bert, monkeypatch, tmp_path, blend, "80,15,5", sizes, tokenizer, 48, 5)
    for ours_split, theirs_split in zip(ours, theirs):
        np.testing.assert_array_equal(ours_split.dataset_index, theirs_split.dataset_index)
        np.testing.assert_array_equal(ours_split.dataset_sample_index, theirs_split.dataset_sample_index)
        for i in range(0, len(ours_split), 3):
            x, y = ours_split[i], theirs_split[i]
            assert x["text"].tolist() == y["text"].tolist() and x["labels"].tolist() == y["labels"].tolist()


def test_sample_index_equals_the_cpp_helper():
    helpers = pytest.importorskip("megatron.core.datasets.helpers_cpp")
    rng = np.random.default_rng(3)
    for trial in range(25):
        per_doc = rng.integers(0, 10, size=int(rng.integers(1, 200)))
        docs = np.concatenate(([0], np.cumsum(per_doc))).astype(np.int64)
        sizes = rng.integers(0 if trial % 3 == 0 else 1, 700 if trial % 4 == 0 else 90, size=int(docs[-1]))
        sizes = sizes.astype(np.int32)
        seq, prob, seed = (
            int(rng.integers(3, 300)),
            [0.0, 0.1, 0.5, 1.0, 0.3][trial % 5],
            int(rng.integers(1, 9999)),
        )
        min_sentences, num_samples = 1 + trial % 2, int(rng.integers(1, 2000))
        epochs = None if trial % 6 else 1
        want = helpers.build_mapping(docs, sizes, epochs or np.iinfo(np.int32).max - 1, num_samples if epochs is None
                                     else 2**62, seq, prob, seed, False, min_sentences)  # fmt: skip
        got = build_sentence_sample_index(docs, sizes, epochs, num_samples if epochs is None else None, seq, prob,
                                          seed, min_sentences)  # fmt: skip
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)


def test_index_is_cached_and_reused(bert_data, tmp_path, monkeypatch):
    tokenizer, prefix, _ = bert_data
    data = DataConfig(data_path=(prefix,), split="100,0,0", data_cache_path=str(tmp_path / "cache"))
    first = build_bert_datasets(data, tokenizer, 40, 1234, (100, 0, 0))[0]
    files = sorted(os.listdir(tmp_path / "cache"))
    assert len(files) == 2 and files[0].endswith("-BERTMaskedWordPieceDataset-train-description.txt")

    def fail(*args, **kwargs):
        raise AssertionError("rebuilt although cached")

    monkeypatch.setattr("mcore.data.masked_dataset.build_sentence_sample_index", fail)
    again = build_bert_datasets(data, tokenizer, 40, 1234, (100, 0, 0))[0]
    np.testing.assert_array_equal(again.sample_index, first.sample_index)
    assert again[3]["text"].tolist() == first[3]["text"].tolist()


def test_mock_data_provider_and_loader_batches(bert_data):
    tokenizer = bert_data[0]
    from types import SimpleNamespace

    cfg = SimpleNamespace(
        data=DataConfig(mock_data=True, num_workers=0), model=SimpleNamespace(seq_length=64),
        training=SimpleNamespace(seed=1234),
    )  # fmt: skip
    train, valid, test = bert_datasets_provider(cfg, tokenizer, (64, 8, 8))
    assert len(train) >= 64 and len(valid) >= 8 and len(test) >= 8
    loader = build_pretraining_data_loader(train, 0, 4, 0, 1, 0, False)
    batch = next(iter(loader))
    assert sorted(batch) == sorted(BERT_BATCH_KEYS)
    assert all(batch[k].dtype == torch_int64() for k in BERT_BATCH_KEYS)
    assert batch["text"].shape == (4, 64) and batch["is_random"].shape == (4,)
    text, pad = batch["text"], batch["padding_mask"]
    assert (text[:, 0] == tokenizer.cls).all() and ((pad == 0) <= (text == 0)).all()
    assert ((batch["labels"] >= 0) == batch["loss_mask"].bool()).all()


def torch_int64():
    import torch

    return torch.int64


def test_bad_inputs_are_one_clear_error(bert_data, tmp_path):
    tokenizer, prefix, _ = bert_data
    with pytest.raises(ConfigError, match="--mask-prob 1.5"):
        DataConfig(mask_prob=1.5)
    with pytest.raises(ConfigError, match="masking_do_permutation is not supported"):
        _our_config(tokenizer, "1,0,0", 32, 1, tmp_path, masking_do_permutation=True)
    from mcore.data.tokenizers import NullTokenizer

    data = DataConfig(data_path=(prefix,), split="100,0,0")
    with pytest.raises(
        DataError,
        match="need a WordPiece tokenizer .cls, sep, pad, mask, inv_vocab missing from NullTokenizer",
    ):
        build_bert_datasets(data, NullTokenizer(1000), 32, 1, (10, 0, 0))
    # Documents of one sentence cannot make sentence pairs: the split is named, no endless loop.
    single = tmp_path / "single.jsonl"
    single.write_text(
        "".join(json.dumps({"text": "one sentence only"}) + "\n" for _ in range(5)), encoding="utf-8"
    )
    args = ["--input", str(single), "--output-prefix", str(tmp_path / "s"), "--tokenizer-type",
            "BertWordPieceLowerCase", "--vocab-file", tokenizer.vocab_file, "--split-sentences"]  # fmt: skip
    assert preprocess_main(args) == 0
    data = DataConfig(data_path=(str(tmp_path / "s_text_sentence"),), split="100,0,0")
    with pytest.raises(DataError, match=r"train split of .*s_text_sentence.*no document yields a sample"):
        build_bert_datasets(data, tokenizer, 32, 1, (10, 0, 0))
    assert len(IndexedDataset(str(tmp_path / "s_text_sentence"))) == 5


def test_vectorized_fisher_yates_equals_the_swap_loop():
    from mcore.data.masked_indices import MT19937_64, fisher_yates_permutation

    for count in (0, 1, 2, 3, 7, 100, 5000):
        for seed in (1, 2, 1235):
            want = list(range(count))
            if count > 1:
                draws = MT19937_64(seed).draw(count - 1).tolist()
                for i, r in zip(range(count - 1, 0, -1), draws):
                    j = r % (i + 1)
                    want[i], want[j] = want[j], want[i]
            assert fisher_yates_permutation(count, seed).tolist() == want, (count, seed)


def test_mt19937_64_matches_the_standard():
    from mcore.data.masked_indices import MT19937_64

    # C++11 [rand.predef]: the 10000th output of a default-constructed std::mt19937_64 (seed 5489).
    assert int(MT19937_64(5489).draw(10000)[-1]) == 9981545732273789042
