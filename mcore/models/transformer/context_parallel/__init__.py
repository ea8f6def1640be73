"""Context parallelism: each sequence split over the CP ranks in the load-balanced zigzag layout,
attention over the whole sequence by a ring of K/V blocks (p2p), an all-to-all over heads (a2a) or an
all-gather of K/V (allgather). See docs/parallelism.md, "Context parallelism"."""

from mcore.models.transformer.context_parallel.dispatch import context_parallel_attention
from mcore.models.transformer.context_parallel.layout import (
    ring_schedule,
    slice_for_cp,
    zigzag_indices,
)

__all__ = ["context_parallel_attention", "ring_schedule", "slice_for_cp", "zigzag_indices"]
