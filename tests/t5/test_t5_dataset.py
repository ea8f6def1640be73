"""The T5 span-corruption dataset: samples equal megatron-core's; the index is cached; --split and
blends work as for GPT."""

import numpy as np
import pytest
import torch

from mcore.data.config import DataConfig
from mcore.data.indexed_dataset import IndexedDataset
from mcore.data.t5_dataset import T5Dataset, T5DatasetConfig, build_t5_datasets
from mcore.data.tokenizers import BertWordPieceTokenizer


def _tokenizer(corpus, extra_ids=100):
    return BertWordPieceTokenizer(corpus["vocab"], lower_case=True, vocab_extra_ids=extra_ids)


class _MegatronTokenizer:
    """What megatron-core's T5 dataset reads from a tokenizer, taken from mcore's."""

    def __init__(self, tok):
        self.tok = tok
        self.cls, self.sep, self.pad, self.mask = tok.cls, tok.sep, tok.pad, tok.mask
        self.bos, self.eos = tok.bos, tok.eos
        self.inv_vocab = tok.inv_vocab
        self.vocab_size = tok.vocab_size
        self.additional_special_tokens_ids = tok.additional_special_tokens_ids
        self.unique_identifiers = {"class": "mcore"}


def _megatron_samples(prefix, tok, num_samples, seed, enc, dec, cache):
    import megatron.core.datasets.t5_dataset as mt5
    from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronIndexed
    from megatron.core.datasets.utils import Split

    config = mt5.T5MaskedWordPieceDatasetConfig(
        random_seed=seed, sequence_length=enc, sequence_length_decoder=dec, blend=None,
        blend_per_split=[None, None, None], split="100,0,0", path_to_cache=str(cache),
        tokenizer=_MegatronTokenizer(tok), masking_probability=0.15, short_sequence_probability=0.1,
        masking_max_ngram=10, masking_do_full_word=True, masking_do_permutation=False,
        masking_use_longer_ngrams=False, masking_use_geometric_distribution=True,
    )  # fmt: skip
    low = MegatronIndexed(prefix)
    docs = np.arange(low.document_indices.shape[0] - 1, dtype=np.int32)
    return mt5.T5MaskedWordPieceDataset(low, prefix, docs, num_samples, Split.train, config)


def test_samples_equal_megatron_core(t5_corpus, tmp_path, monkeypatch):
    pytest.importorskip("megatron.core.datasets.t5_dataset")
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a, **k: 0)
    tok = _tokenizer(t5_corpus)
    prefix, seed, enc, dec, n = t5_corpus["prefix"], 1234, 128, 64, 150
    theirs = _megatron_samples(prefix, tok, n, seed, enc, dec, tmp_path / "megatron")
    config = T5DatasetConfig(
        random_seed=seed, sequence_length=enc, sequence_length_decoder=dec, tokenizer=tok,
        split="100,0,0", split_matrix=[(0.0, 1.0), None, None], path_to_cache=str(tmp_path / "mcore"),
    )  # fmt: skip
    low = IndexedDataset(prefix)
    ours = T5Dataset(
        low, prefix, np.arange(len(low.document_indices) - 1, dtype=np.int32), n, "train", config
    )
    np.testing.assert_array_equal(np.asarray(ours.sample_index), np.asarray(theirs.sample_index))
    assert len(ours) == len(theirs) >= n
    for i in range(len(ours)):
        mine, ref = ours.sample_arrays(i), theirs[i]
        assert sorted(mine) == sorted(ref), i
        for key in ref:
            np.testing.assert_array_equal(mine[key], ref[key], err_msg=f"sample {i} key {key}")


def test_index_cache_splits_and_blends(t5_corpus, tmp_path):
    """The sample index is cached (a second build loads it); --split divides documents; a weighted
    --data-path blends T5 datasets as GPT's."""
    from mcore.data.blended_dataset import BlendedDataset

    tok = _tokenizer(t5_corpus)
    prefix, cache = t5_corpus["prefix"], str(tmp_path / "cache")
    single = DataConfig(data_path=(prefix,), split="90,10,0", data_cache_path=cache)
    train, valid, test = build_t5_datasets(single, tok, 64, 32, 3, [20, 6, 0])
    assert test is None and len(train) >= 20 and len(valid) >= 6
    documents = len(IndexedDataset(prefix).document_indices) - 1
    assert train.indices[-1] + 1 == valid.indices[0] and valid.indices[-1] + 1 == documents
    files = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert any(f.endswith("T5Dataset-train-sample_index.npy") for f in files)
    again, _, _ = build_t5_datasets(single, tok, 64, 32, 3, [20, 6, 0])
    np.testing.assert_array_equal(np.asarray(again.sample_index), np.asarray(train.sample_index))
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == files  # loaded, nothing rebuilt
    blend = DataConfig(data_path=("0.3", prefix, "0.7", prefix), split="90,10,0", data_cache_path=cache)
    btrain, bvalid, _ = build_t5_datasets(blend, tok, 64, 32, 3, [20, 6, 0])
    # Megatron sizes a split's blend as sum_k ceil(S * w_k): 6 + 14 and 2 + 5
    assert isinstance(btrain, BlendedDataset) and len(btrain) == 20 and len(bvalid) == 7
    assert set(btrain[5]) == {
        "text_enc",
        "text_dec",
        "labels",
        "loss_mask",
        "truncated",
        "enc_mask",
        "dec_mask",
    }
