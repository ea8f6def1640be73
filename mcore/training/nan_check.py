"""The deferred NaN check of the gradients: each step's NaN flags staged to the host, read a step later.

With an optimizer that skips a non-finite update on the device (``skips_nonfinite_on_device``) the
data-parallel NaN check does not wait for the device: :meth:`DeferredNanCheck.stage` queues each
step's flags (:func:`~mcore.utils.async_host.stage_to_host`) and :meth:`DeferredNanCheck.check`
reads them during the next step, when the device is past them, so the error comes one step late but
the parameters never took the NaN step (see :class:`mcore.training.trainer.Trainer`).
"""

from __future__ import annotations

import collections
import math

import torch

from mcore.utils.async_host import HostValue, stage_to_host


class DeferredNanCheck:
    """Staged NaN flags of the steps, checked when they reach the host.

    Args:
        ddp_chunks: this rank's DDP-wrapped model chunks (their ``nan_flags`` / ``raise_if_nan``).
        rank: this rank, named in the error of a NaN global gradient norm.
        device: where a tensor gradient norm is moved to be staged with the flags.
    """

    def __init__(self, ddp_chunks: list, rank: int, device):
        self.ddp_chunks, self.rank, self.device = ddp_chunks, rank, device
        self._pending: collections.deque[tuple[int, HostValue, list[int], int | None]] = collections.deque()

    def stage(self, iteration: int, grad_norm) -> None:
        """Stage this step's NaN flags (and a tensor gradient norm) for :meth:`check`."""
        parts, counts = [], []
        for chunk in self.ddp_chunks:
            flags = chunk.nan_flags()
            counts.append(0 if flags is None else flags.numel())
            if flags is not None:
                parts.append(flags.float())
        norm_at = None
        if isinstance(grad_norm, torch.Tensor):
            norm_at = sum(counts)
            parts.append(grad_norm.detach().float().reshape(1).to(self.device))
        if parts:
            staged = stage_to_host(torch.cat(parts))
            self._pending.append((iteration, staged, counts, norm_at))

    def check(self, wait: bool = True) -> None:
        """Raise the NaN error of an earlier step whose deferred NaN check found one (a no-op when
        nothing is deferred). ``wait=False`` checks only the steps whose flags reached the host.

        Raises:
            RuntimeError: the DDP message (rank, parameters) naming the iteration; or, when only the
                global gradient norm is NaN (a NaN on another rank, or made by the reduction), a
                message naming the iteration and the rank.
        """
        while self._pending:
            iteration, staged, counts, norm_at = self._pending[0]
            if not wait and not staged.ready():
                return
            self._pending.popleft()
            values = staged.tolist()
            offset = 0
            for chunk, count in zip(self.ddp_chunks, counts):
                if count:
                    chunk.raise_if_nan(values[offset : offset + count], iteration=iteration)
                offset += count
            if norm_at is not None and math.isnan(values[norm_at]):
                raise RuntimeError(
                    f"NaN in the gradients of iteration {iteration} on rank {self.rank}: the "
                    "global gradient norm is NaN (the update was skipped)"
                )
