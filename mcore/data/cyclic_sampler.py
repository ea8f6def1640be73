"""``--dataloader-type cyclic``: Megatron's random pretraining sampler (``MegatronPretrainingRandomSampler``).

The training samples are walked epoch after epoch, each epoch in a fresh random order, without end
(the loop stops at ``--train-iters``). Per epoch ``e``:

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

from mcore.data.loader import check_sampler_layout


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
