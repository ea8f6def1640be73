"""Megatron-compatible data: tokenizers, ``.bin/.idx`` datasets, GPT samples, blends and the loader.

What the training loop calls::

    tokenizer = build_tokenizer(tokenizer_config)
    train_ds, valid_ds, test_ds = build_train_valid_test_datasets(
        data_config, tokenizer, seq_length, seed, (train_samples, valid_samples, test_samples))
    loader = build_pretraining_data_loader(train_ds, consumed_samples, micro_batch_size,
                                           dp_rank, dp_size, data_config.num_workers, pin_memory)

The batch layout is documented in :mod:`mcore.data.loader`. Tools: ``mcore-preprocess-data``
(:mod:`mcore.data.preprocess`) and ``mcore-merge-datasets`` (:mod:`mcore.data.merge`). The optional
``tokenizers`` package is imported only when a BPE tokenizer is built.
"""

from mcore.data.bert_dataset import (  # BERT: Megatron's BERTMaskedWordPieceDataset
    BERTMaskedWordPieceDataset,
    BERTMaskedWordPieceDatasetConfig,
    MockBERTMaskedWordPieceDataset,
    bert_datasets_provider,
    build_bert_datasets,
)
from mcore.data.blended_dataset import BlendedDataset  # weighted blends
from mcore.data.builder import build_train_valid_test_datasets  # what the training loop calls
from mcore.data.config import DataConfig, TokenizerConfig  # CLI-facing configuration
from mcore.data.errors import DataError  # every data problem
from mcore.data.gpt_dataset import GPTDataset, GPTDatasetConfig  # LM samples of one split
from mcore.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, optimal_dtype  # .bin/.idx
from mcore.data.loader import build_pretraining_data_loader  # sampler + workers
from mcore.data.mock_dataset import MockGPTDataset  # --mock-data
from mcore.data.tokenizers import (  # --tokenizer-type
    BertWordPieceTokenizer,
    GPT2BPETokenizer,
    HuggingFaceTokenizer,
    NullTokenizer,
    Tokenizer,
    build_tokenizer,
    train_bpe_tokenizer,
    train_wordpiece_vocab,
)

__all__ = [
    "BERTMaskedWordPieceDataset",
    "BERTMaskedWordPieceDatasetConfig",
    "MockBERTMaskedWordPieceDataset",
    "bert_datasets_provider",
    "build_bert_datasets",
    "BertWordPieceTokenizer",
    "BlendedDataset",
    "DataConfig",
    "DataError",
    "GPT2BPETokenizer",
    "GPTDataset",
    "GPTDatasetConfig",
    "HuggingFaceTokenizer",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "MockGPTDataset",
    "NullTokenizer",
    "Tokenizer",
    "TokenizerConfig",
    "build_pretraining_data_loader",
    "build_tokenizer",
    "build_train_valid_test_datasets",
    "optimal_dtype",
    "train_bpe_tokenizer",
    "train_wordpiece_vocab",
]
