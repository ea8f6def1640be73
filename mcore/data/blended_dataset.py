"""Megatron's BlendedDataset: samples drawn from several datasets in fixed proportions.

Sample ``i`` is ``datasets[dataset_index[i]][dataset_sample_index[i]]``, with the two arrays from the
deterministic greedy in :func:`mcore.data.indices.build_blending_indices` (no RNG: every component is
already shuffled). With ``size=None`` the blend is exhaustive: ``weights`` are the integer sample counts
to take from each component, all of them.

The indices are cached (``{H}-BlendedDataset-{split}-{description.txt,dataset_index.npy,
dataset_sample_index.npy}``) only when ``--data-cache-path`` is given, as in Megatron; the description
lists the components' identifiers, which carry their data fingerprints.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch

from mcore.data.cache import IndexCache, describe
from mcore.data.errors import DataError
from mcore.data.gpt_dataset import GPTDataset, GPTDatasetConfig
from mcore.data.indices import build_blending_indices, build_exhaustive_blending_indices
from mcore.data.splits import normalize

logger = logging.getLogger(__name__)


class BlendedDataset(torch.utils.data.Dataset):
    """A weighted blend of datasets of one split.

    Args:
        datasets: the components (same class, same split).
        weights: positive weights (normalized here when ``size`` is given), or with ``size=None`` the
            integer number of samples to take from each component.
        size: samples in the blend, or None for the exhaustive blend.
        config: the GPT dataset config (only ``path_to_cache`` and ``mid_level_dataset_surplus`` are used).

    Raises:
        DataError: the blend asks a component for more samples than it has.
    """

    def __init__(
        self,
        datasets: Sequence[GPTDataset],
        weights: Sequence[float],
        size: int | None,
        config: GPTDatasetConfig,
    ) -> None:
        if len(datasets) != len(weights) or not datasets:
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        if len(datasets) >= 32767:
            raise ValueError(f"{len(datasets)} datasets in one blend; at most 32766 fit the int16 index")
        splits = {d.index_split for d in datasets}
        if len(splits) != 1:
            raise ValueError(f"a blend mixes splits {sorted(splits)}")
        if any(w <= 0 for w in weights):
            raise ValueError(f"blend weights must be positive, got {list(weights)}")
        self.datasets = list(datasets)
        self.split = datasets[0].index_split
        self.weights = normalize(weights) if size is not None else [int(w) for w in weights]
        self.size = size
        self.config = config
        self.unique_identifiers = OrderedDict(
            [
                ("class", type(self).__name__),
                ("datasets", [d.unique_identifiers for d in self.datasets]),
                ("split", self.split),
                ("weights", self.weights),
                ("size", self.size),
            ]
        )
        self.unique_description = describe(self.unique_identifiers)
        cache = IndexCache(
            config.path_to_cache,
            self.unique_description,
            type(self).__name__,
            self.split,
            ("dataset_index", "dataset_sample_index"),
        )
        arrays = cache.load()
        if arrays is None:
            arrays = self._build()
            cache.save(arrays)
        self.dataset_index = arrays["dataset_index"]
        self.dataset_sample_index = arrays["dataset_sample_index"]

    def _build(self) -> dict[str, np.ndarray]:
        if self.size is not None:
            dataset_index, sample_index = build_blending_indices(self.weights, self.size)
        else:
            dataset_index, sample_index = build_exhaustive_blending_indices(self.weights)
        counts = np.bincount(dataset_index.astype(np.int64), minlength=len(self.datasets))
        for k, (count, dataset) in enumerate(zip(counts.tolist(), self.datasets)):
            if count > len(dataset):
                raise DataError(
                    f"the {self.split} blend asks {count} samples of component {k} "
                    f"({dataset.dataset_path or type(dataset).__name__}), which has only {len(dataset)}; "
                    f"raise --mid-level-dataset-surplus (now {self.config.mid_level_dataset_surplus})"
                )
        return {"dataset_index": dataset_index, "dataset_sample_index": sample_index}

    def __len__(self) -> int:
        return self.dataset_index.shape[0]

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        dataset = self.datasets[int(self.dataset_index[idx])]
        return dataset[int(self.dataset_sample_index[idx])]
