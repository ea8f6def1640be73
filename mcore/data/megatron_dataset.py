"""What the GPT and masked-LM (BERT, T5) datasets share: megatron-core's ``MegatronDataset``.

One split of one low-level dataset, with the key that names its cached indices::

    unique_identifiers = {class, dataset_path, num_samples, index_split,
                          <the subclass's _key_identifiers()>, data_fingerprint}

The order is Megatron's (the description is a JSON dump of it, hashed into the cache file names), so
it must not change; ``data_fingerprint`` is not in Megatron's key (the data itself, so that rewritten
files never reuse stale indices).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from mcore.data.cache import describe


class MegatronDataset(torch.utils.data.Dataset):
    """One split of ``indexed_dataset`` (the arguments as :class:`~mcore.data.gpt_dataset.GPTDataset`).

    Subclasses give :meth:`_key_identifiers` (the config fields that change the indices); ``config``
    needs ``path_to_cache``.
    """

    def __init__(
        self,
        indexed_dataset: Any,
        dataset_path: str | None,
        indices: np.ndarray,
        num_samples: int | None,
        index_split: str,
        config: Any,
    ) -> None:
        self.dataset = indexed_dataset
        self.dataset_path = dataset_path
        self.indices = indices
        self.num_samples = num_samples
        self.index_split = index_split
        self.config = config
        self.unique_identifiers = self._identifiers()
        self.unique_description = describe(self.unique_identifiers)

    def _key_identifiers(self) -> list[tuple[str, Any]]:
        """The config fields that enter the cache key, in Megatron's order."""
        raise NotImplementedError

    def _identifiers(self) -> OrderedDict:
        ids: OrderedDict = OrderedDict()
        ids["class"] = type(self).__name__
        ids["dataset_path"] = self.dataset_path
        ids["num_samples"] = self.num_samples
        ids["index_split"] = self.index_split
        ids.update(self._key_identifiers())
        ids["data_fingerprint"] = self.dataset.fingerprint()
        return ids

    def _cache_dir(self) -> str | None:
        """``--data-cache-path``, else ``<dataset_path>/cache/<class>_indices``; None: no disk cache (mock data)."""
        if self.config.path_to_cache:
            return self.config.path_to_cache
        if self.dataset_path is None:
            return None
        return os.path.join(self.dataset_path, "cache", f"{type(self).__name__}_indices")
