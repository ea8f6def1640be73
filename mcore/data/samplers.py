"""The pretraining batch samplers: which sample ids each data-parallel rank takes, resumable.

``--dataloader-type single``: Megatron's ``MegatronPretrainingSampler`` (:class:`PretrainingSampler`).
Sample ids ``consumed_samples, consumed_samples + 1, ...`` are grouped into global micro-batches of
``micro_batch_size * data_parallel_size``; data-parallel rank ``r`` takes the slice
``[r * mbs, (r + 1) * mbs)`` of each, and an incomplete last group is dropped. Resuming with the
checkpoint's ``consumed_samples`` continues with exactly the samples an uninterrupted run would have
seen next. The datasets are already shuffled, so the sampler does not shuffle.

``--dataloader-type cyclic``: Megatron's random pretraining sampler
(``MegatronPretrainingRandomSampler``, :class:`CyclicPretrainingSampler`). The training samples are
walked epoch after epoch, each epoch in a fresh random order, without end (the loop stops at
``--train-iters``). Per epoch ``e``:

* the epoch holds ``A = total - total % (micro_batch_size * data_parallel_size)`` samples (an incomplete
  last global micro-batch is dropped, as Megatron drops it);
* the order is ``torch.randperm(A)`` from a generator seeded with ``(seed, e)``; Megatron seeds with
  ``e`` alone, mcore adds ``--seed`` so that a different seed also gives a different order;
* global micro-batch ``k`` of the epoch is ``order[k*m*d : (k+1)*m*d]`` and data-parallel rank ``r``
  takes its slice ``[r*m, (r+1)*m)`` (as the 'single' sampler does), so the union over ranks is the
  single-process micro-batch and a data-parallel run trains on what one process would.

Resuming: ``consumed_samples`` gives the epoch (``consumed // A``) and the offset in it (``consumed %
A``), so a resumed run continues with exactly the samples an uninterrupted one would have seen next.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from mcore.data.errors import DataError


def check_sampler_layout(micro_batch_size: int, data_parallel_rank: int, data_parallel_size: int) -> None:
    """Raise ``ValueError`` unless the sizes are positive and the rank is in ``[0, data_parallel_size)``."""
    if micro_batch_size <= 0 or data_parallel_size <= 0:
        raise ValueError(
            f"micro_batch_size={micro_batch_size} and data_parallel_size={data_parallel_size} must be positive"
        )
    if not 0 <= data_parallel_rank < data_parallel_size:
        raise ValueError(f"data_parallel_rank={data_parallel_rank} outside [0, {data_parallel_size})")


class PretrainingSampler:
    """Batch sampler yielding this data-parallel rank's sample ids of each global micro-batch.

    Raises:
        ValueError: non-positive sizes, a rank outside ``[0, data_parallel_size)``, or no samples left.
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        drop_last: bool = True,
    ) -> None:
        if total_samples <= 0:
            raise ValueError(f"the dataset has no samples (total_samples={total_samples})")
        if not 0 <= consumed_samples < total_samples:
            raise DataError(  # a user error: one line, no traceback (a ValueError subclass)
                f"consumed_samples={consumed_samples} leaves no samples in a dataset of {total_samples}; "
                "the run has used all the data it was built for (ask for more samples: --train-iters/"
                "--train-samples, --eval-iters)"
            )
        check_sampler_layout(micro_batch_size, data_parallel_rank, data_parallel_size)
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.global_micro_batch = micro_batch_size * data_parallel_size
        self.drop_last = drop_last

    def __len__(self) -> int:
        """Micro-batches this rank will yield."""
        left = self.total_samples - self.consumed_samples
        full, rest = divmod(left, self.global_micro_batch)
        return full + (1 if rest and not self.drop_last else 0)

    def __iter__(self) -> Iterator[list[int]]:
        start = self.data_parallel_rank * self.micro_batch_size
        stop = start + self.micro_batch_size
        step = self.global_micro_batch
        first = self.consumed_samples
        full_end = first + (self.total_samples - first) // step * step
        for base in range(first, full_end, step):
            yield list(range(base + start, base + stop))
        if not self.drop_last and full_end < self.total_samples:
            tail = list(range(full_end, self.total_samples))[start:stop]
            if tail:
                yield tail


class CyclicPretrainingSampler:
    """Batch sampler yielding this data-parallel rank's sample ids, epoch after epoch, shuffled per epoch.

    Raises:
        ValueError: non-positive sizes, a rank outside ``[0, data_parallel_size)``, fewer samples than one
            global micro-batch, or a ``consumed_samples`` that is not a whole number of global micro-batches.
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        seed: int,
    ) -> None:
        check_sampler_layout(micro_batch_size, data_parallel_rank, data_parallel_size)
        self.global_micro_batch = micro_batch_size * data_parallel_size
        self.epoch_samples = total_samples - total_samples % self.global_micro_batch
        if self.epoch_samples <= 0:
            raise ValueError(
                f"the dataset has {total_samples} samples, fewer than one global micro-batch "
                f"(micro_batch_size={micro_batch_size} x data_parallel_size={data_parallel_size})"
            )
        if consumed_samples < 0 or consumed_samples % self.global_micro_batch:
            raise ValueError(
                f"consumed_samples={consumed_samples} is not a whole number of global micro-batches "
                f"of {self.global_micro_batch}"
            )
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.seed = seed

    def epoch_order(self, epoch: int) -> list[int]:
        """The sample ids of ``epoch`` in training order (all ranks' micro-batches, in turn)."""
        generator = torch.Generator()
        generator.manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.epoch_samples, generator=generator).tolist()

    def __len__(self) -> int:
        """Micro-batches this rank yields before the current epoch ends (one pass of the loader)."""
        return (self.epoch_samples - self.consumed_samples % self.epoch_samples) // self.global_micro_batch

    def __iter__(self) -> Iterator[list[int]]:
        """The rest of the current epoch; iterating again continues with the next epoch."""
        epoch, offset = divmod(self.consumed_samples, self.epoch_samples)
        order = self.epoch_order(epoch)
        start = self.data_parallel_rank * self.micro_batch_size
        for base in range(offset, self.epoch_samples, self.global_micro_batch):
            self.consumed_samples += self.global_micro_batch
            yield order[base + start : base + start + self.micro_batch_size]
