"""Build the train/valid/test datasets from a :class:`~mcore.data.config.DataConfig` (Megatron's rules).

Sources, in Megatron's order of precedence:

* ``--mock-data``: :class:`~mcore.data.mock_dataset.MockGPTDataset` splits by ``--split``.
* ``--data-path P``: one dataset, split by ``--split``.
* ``--data-path W1 P1 W2 P2 ...``: every component is split by ``--split``; split ``i`` of size ``S_i``
  asks component ``k`` for ``ceil(ceil(S_i * w_k) * (1 + surplus))`` samples and blends
  ``sum_k ceil(S_i * w_k)`` of them. Unweighted lists blend whole epochs in proportion to their lengths
  (at most ``S_i`` samples).
* ``--train-data-path/--valid-data-path/--test-data-path``: each split uses the whole of its own blend.

A size of None means "one epoch" (weighted blends need sizes). In a distributed run rank 0 builds (and
caches) first while the other ranks wait at a barrier, then they load the cached indices.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from mcore.config.fields import ConfigError
from mcore.data.blended_dataset import BlendedDataset
from mcore.data.config import DataConfig
from mcore.data.gpt_dataset import GPTDataset, GPTDatasetConfig
from mcore.data.indexed_dataset import IndexedDataset, check_token_ids
from mcore.data.mock_dataset import MockGPTDataset, MockLowLevelDataset
from mcore.data.splits import SPLIT_NAMES, normalize, parse_blend, parse_split, split_matrix, split_ranges
from mcore.data.tokenizers import Tokenizer
from mcore.data.vocab_identity import check_dataset_vocab

Sizes = Sequence[int | None]
Datasets = tuple[
    torch.utils.data.Dataset | None, torch.utils.data.Dataset | None, torch.utils.data.Dataset | None
]


def gpt_dataset_config(
    data_config: DataConfig, tokenizer: Tokenizer, seq_length: int, seed: int
) -> GPTDatasetConfig:
    """The GPTDatasetConfig a DataConfig describes."""
    return GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        tokenizer=tokenizer,
        split=data_config.split,
        split_matrix=split_matrix(parse_split(data_config.split)),
        reset_position_ids=data_config.reset_position_ids,
        reset_attention_mask=data_config.reset_attention_mask,
        eod_mask_loss=data_config.eod_mask_loss,
        path_to_cache=data_config.data_cache_path,
        mmap_bin_files=data_config.mmap_bin_files,
        mid_level_dataset_surplus=data_config.mid_level_dataset_surplus,
    )


def build_train_valid_test_datasets(
    data_config: DataConfig,
    tokenizer: Tokenizer,
    seq_length: int,
    seed: int,
    train_valid_test_num_samples: Sizes,
) -> Datasets:
    """(train, valid, test) datasets; an entry is None where the split has zero width.

    Args:
        data_config: the data flags.
        tokenizer: gives EOD (masks) and identifies the data in cache keys.
        seq_length: ``--seq-length``.
        seed: ``--seed`` (each split and component reseeds ``RandomState(seed)``).
        train_valid_test_num_samples: samples wanted per split (e.g. ``train_iters * global_batch_size``,
            ``(train_iters // eval_interval + 1) * eval_iters * global_batch_size``,
            ``eval_iters * global_batch_size``); None for one epoch.

    Raises:
        DataError: missing or corrupted data, an empty split asked for samples, an oversampled blend.
        ConfigError: no data source, or a weighted blend without sizes.
    """
    if len(train_valid_test_num_samples) != 3:
        raise ValueError(
            f"need 3 sample counts (train, valid, test), got {list(train_valid_test_num_samples)}"
        )
    config = gpt_dataset_config(data_config, tokenizer, seq_length, seed)
    sizes = list(train_valid_test_num_samples)
    return build_split_datasets(
        data_config, config, sizes, GPTDataset, lambda: (MockGPTDataset, MockLowLevelDataset(tokenizer))
    )


def build_split_datasets(
    data_config: DataConfig, config, sizes: list[int | None], dataset_cls, mock
) -> Datasets:
    """(train, valid, test) of ``dataset_cls`` (GPT's, or e.g. BERT's) by the rules of the module doc.

    ``config`` is the dataset class's config (it has ``split_matrix``, ``tokenizer``, ``path_to_cache``,
    ``mmap_bin_files``, ``mid_level_dataset_surplus``); ``mock()`` gives ``(mock class, low-level
    dataset)`` for ``--mock-data``. A class with ``numel_low_level_dataset`` splits what that counts
    (BERT: documents), otherwise sequences.
    """
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if not distributed:
        return _build(data_config, config, sizes, dataset_cls, mock)
    # Rank 0 builds and writes the caches; the others then find them. Building is deterministic, so a
    # rank that cannot read the cache (unwritable directory) just builds the same arrays itself.
    if torch.distributed.get_rank() == 0:
        datasets = _build(data_config, config, sizes, dataset_cls, mock)
        torch.distributed.barrier()
        return datasets
    torch.distributed.barrier()
    return _build(data_config, config, sizes, dataset_cls, mock)


def _build(
    data_config: DataConfig, config, sizes: list[int | None], dataset_cls=GPTDataset, mock=None
) -> Datasets:
    if data_config.mock_data:
        mock_cls, low = mock()
        return _split_datasets(mock_cls, low, None, config.split_matrix, sizes, config)
    if data_config.data_path:
        prefixes, weights = parse_blend(data_config.data_path, "--data-path")
        return _build_blend(prefixes, weights, config.split_matrix, sizes, config, "--data-path", dataset_cls)
    per_split = (data_config.train_data_path, data_config.valid_data_path, data_config.test_data_path)
    if not any(per_split):
        raise ConfigError("no training data: give --data-path, --train-data-path/..., or --mock-data")
    out: list[torch.utils.data.Dataset | None] = [None, None, None]
    for i, values in enumerate(per_split):
        if not values:
            continue
        flag = f"--{SPLIT_NAMES[i]}-data-path"
        prefixes, weights = parse_blend(values, flag)
        matrix = [None, None, None]
        matrix[i] = (0.0, 1.0)
        only = [None, None, None]
        only[i] = sizes[i]
        out[i] = _build_blend(prefixes, weights, matrix, only, config, flag, dataset_cls)[i]
    return out[0], out[1], out[2]


def _split_datasets(cls, low, path, matrix, sizes, config: GPTDatasetConfig) -> Datasets:
    numel = getattr(cls, "numel_low_level_dataset", None)
    ranges = split_ranges(matrix, numel(low) if numel is not None else len(low.sequence_lengths))
    out = [
        None if ranges[i] is None else cls(low, path, ranges[i], sizes[i], SPLIT_NAMES[i], config)
        for i in range(3)
    ]
    return out[0], out[1], out[2]


def _open(prefix: str, config: GPTDatasetConfig) -> IndexedDataset:
    dataset = IndexedDataset(prefix, multimodal=False, mmap=config.mmap_bin_files)
    if config.tokenizer is not None:  # ids the model cannot embed: fail here, naming the file
        check_dataset_vocab(prefix, getattr(config.tokenizer, "identity", None))  # another vocabulary
        check_token_ids(dataset, config.tokenizer.vocab_size)
    return dataset


def _build_blend(
    prefixes: list[str],
    weights: list[float] | None,
    matrix,
    sizes: list[int | None],
    config: GPTDatasetConfig,
    flag: str,
    dataset_cls=GPTDataset,
) -> Datasets:
    if len(prefixes) == 1 and weights is None:
        return _split_datasets(dataset_cls, _open(prefixes[0], config), prefixes[0], matrix, sizes, config)
    if weights is not None:
        weights = normalize(weights)
        for i in range(3):
            if matrix[i] is not None and sizes[i] is None:
                raise ConfigError(f"{flag} has weights, so the {SPLIT_NAMES[i]} split needs a sample count")
        target = [[None if s is None else math.ceil(s * w) for s in sizes] for w in weights]
        surplus = 1 + config.mid_level_dataset_surplus
        asked = [[None if t is None else math.ceil(t * surplus) for t in row] for row in target]
    else:
        target = None
        asked = [[None, None, None] for _ in prefixes]
    components = [
        _split_datasets(dataset_cls, _open(prefix, config), prefix, matrix, asked[k], config)
        for k, prefix in enumerate(prefixes)
    ]
    out: list[torch.utils.data.Dataset | None] = [None, None, None]
    for i in range(3):
        if matrix[i] is None:
            continue
        parts = [c[i] for c in components]
        if target is not None:
            out[i] = BlendedDataset(parts, weights, sum(row[i] for row in target), config)
        else:
            lengths = [len(p) for p in parts]
            size = None if sizes[i] is None else min(sizes[i], sum(lengths))
            if all(n > 0 for n in lengths):
                out[i] = BlendedDataset(parts, lengths, size, config)
            else:
                # An empty component cannot take part in a blend (weight 0); blend the others.
                kept = [(p, n) for p, n in zip(parts, lengths) if n > 0]
                out[i] = (
                    BlendedDataset([p for p, _ in kept], [n for _, n in kept], size, config)
                    if kept
                    else parts[0]
                )
    return out[0], out[1], out[2]
