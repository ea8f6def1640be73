"""``--mock-data``: Megatron's synthetic GPT documents, so that a run needs no files.

100,000 documents with lengths drawn from ``numpy.random.default_rng(0).integers(1, 4096)``; document
``i`` of length ``n`` is ``(arange(n - 1) + 1) % vocab_size`` followed by the tokenizer's EOD (the same
documents as megatron-core's ``MockGPTLowLevelDataset``). The usual split, sample and shuffle indices
are built over them in memory (no cache: there is no data path).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mcore.data.gpt_dataset import GPTDataset
from mcore.data.tokenizers import Tokenizer


class MockLowLevelDataset:
    """Synthetic documents computed on the fly (see module doc)."""

    seed = 0
    size = 100_000
    max_sequence_length = 4096

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.vocab_size = tokenizer.vocab_size
        self.eod = tokenizer.eod
        rng = np.random.default_rng(seed=self.seed)
        self.sequence_lengths = rng.integers(
            low=1, high=self.max_sequence_length, size=self.size, dtype=np.int32
        )

    def __len__(self) -> int:
        return self.size

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of document ``idx``."""
        n = int(self.sequence_lengths[idx])
        if length is None:
            length = n - offset
        positions = np.arange(offset, offset + length, dtype=np.int64)
        tokens = (positions + 1) % self.vocab_size
        tokens[positions == n - 1] = self.eod
        return tokens

    def fingerprint(self) -> dict[str, Any]:
        """Mock data has no files; its identity is its generator."""
        return {
            "mock": {"seed": self.seed, "size": self.size, "max_sequence_length": self.max_sequence_length}
        }


class MockGPTDataset(GPTDataset):
    """A GPTDataset over :class:`MockLowLevelDataset`."""
