"""Point-to-point exchange of activations and gradients between adjacent pipeline stages.

Shapes are known in advance, ``[s, b, h]`` with ``s = seq_length / tp`` under sequence parallelism,
so there is no per-micro-batch shape handshake. Each lock-step tick of
:func:`mcore.pipeline.tables.pipeline_timeline` is one batched exchange
(``torch.distributed.batch_isend_irecv``): the sends and receives of that tick are posted together
and waited together, which keeps both gloo and collective libraries that serialize point-to-point
kernels per pair of ranks free of deadlock.

Every wait has a deadline. A peer that died or stopped answering ends the step with a
:class:`PipelineCommunicationError` that names the stage and the global rank, instead of a hang.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from mcore.distributed.watchdog import CommunicationError
from mcore.pipeline.tables import FORWARD, Transfer, theoretical_bubble_fraction


class PipelineCommunicationError(CommunicationError):
    """A neighbouring pipeline stage did not send or receive in time (it died, hung, or disagrees)."""


@dataclass
class PipelineStats:
    """Timing of one or more schedule runs (filled by the schedules when passed as ``stats=``)."""

    total_s: float = 0.0
    """Wall time inside the schedule."""
    wait_s: float = 0.0
    """Wall time spent waiting for point-to-point exchanges (the bubble, plus transfer time)."""
    exchanges: int = 0
    """Batched exchanges waited on."""

    @property
    def bubble_fraction(self) -> float:
        """Measured share of the step spent waiting on neighbours: ``wait_s / total_s``."""
        return self.wait_s / self.total_s if self.total_s > 0 else 0.0

    def report(self, pp_size: int, vp_size: int, num_microbatches: int) -> str:
        """One log line: the measured bubble next to the theoretical ``(p - 1) / (v * m)``.

        The theory counts idle time over compute time; as a share of the step it is
        ``(p - 1) / (v * m + p - 1)``, which is what the measured share compares with.
        """
        theory = theoretical_bubble_fraction(pp_size, vp_size, num_microbatches)
        share = theory / (1.0 + theory)
        return (
            f"pipeline bubble: measured {100 * self.bubble_fraction:.1f}% of {self.total_s:.3f} s waiting "
            f"on p2p; theoretical (p-1)/(v*m) = ({pp_size}-1)/({vp_size}*{num_microbatches}) = {theory:.3f} "
            f"= {100 * share:.1f}% of the step"
        )


class StageCommunicator:
    """Sends and receives ``[s, b, h]`` tensors between this rank and its pipeline neighbours.

    Args:
        groups: the job's process groups (``pp``, ``pp_ranks``, ``pp_rank``).
        shape: the tensor shape every stage exchanges, ``(s, b, h)``.
        dtype: the dtype of activations and gradients on the wire.
        device: where receive buffers live (the backend's device for this rank).
        timeout_s: deadline of each exchange; ``None`` waits as long as the process group allows.
        stats: accumulates wait time when given.
        synchronize: waits for queued device work (the backend's ``synchronize``); called around
            exchanges only when ``stats`` is given, so that measuring does not slow a normal step.
        stage_shapes: an encoder-decoder pipeline's shapes per stage (see ``tensor_shapes`` of
            :func:`mcore.pipeline.schedules.get_forward_backward_func`): a transfer between stages
            ``r`` and ``r + 1`` (either way) is a list of tensors shaped ``stage_shapes[r]``. ``None``:
            every transfer is one tensor of ``shape``.
    """

    def __init__(
        self,
        groups,
        shape: Sequence[int],
        dtype: torch.dtype,
        device: torch.device,
        timeout_s: float | None = None,
        stats: PipelineStats | None = None,
        synchronize: Callable[[], None] = lambda: None,
        stage_shapes: Sequence[Sequence[Sequence[int]]] | None = None,
    ) -> None:
        self.groups = groups
        self.shape = tuple(int(d) for d in shape)
        self.stage_shapes = (
            None
            if stage_shapes is None
            else [[tuple(int(d) for d in shp) for shp in shapes] for shapes in stage_shapes]
        )
        self.dtype = dtype
        self.device = device
        self.timeout_s = timeout_s
        self.stats = stats
        self.synchronize = synchronize

    def _describe(self, pp_rank: int) -> str:
        return f"stage {pp_rank} (global rank {self.groups.pp_ranks[pp_rank]})"

    def transfer_shapes(self, transfer: Transfer) -> list[tuple[int, ...]]:
        """The shapes of the tensors a transfer carries (one, unless the pipeline is encoder-decoder)."""
        if self.stage_shapes is None:
            return [self.shape]
        return self.stage_shapes[min(transfer.src, transfer.dst)]

    def check_tensor(self, tensor: torch.Tensor, what: str, shape: tuple[int, ...] | None = None) -> None:
        """Refuse to send a tensor the receiver does not expect (it would hang or corrupt the stream)."""
        shape = self.shape if shape is None else shape
        if tuple(tensor.shape) != shape or tensor.dtype != self.dtype:
            raise PipelineCommunicationError(
                f"{self._describe(self.groups.pp_rank)} produced {what} of shape {tuple(tensor.shape)} and "
                f"dtype {tensor.dtype}, but the schedule exchanges shape {shape} (seq_length[/tp], "
                f"micro_batch_size, hidden_size) and dtype {self.dtype}"
            )

    def exchange(
        self,
        sends: Sequence[tuple[Transfer, torch.Tensor | Sequence[torch.Tensor]]],
        recvs: Sequence[Transfer],
    ) -> list[torch.Tensor | list[torch.Tensor]]:
        """Post ``sends`` and ``recvs`` as one batch, wait for all, return the received tensors.

        Received activations come back with ``requires_grad=True`` (they are the next stage's
        inputs); received gradients without. With ``stage_shapes`` every transfer is a list of tensors.
        """
        if not sends and not recvs:
            return []
        pp_ranks = self.groups.pp_ranks
        ops, described = [], []
        for transfer, payload in sends:
            what = "activation" if transfer.kind == FORWARD else "gradient"
            tensors = [payload] if isinstance(payload, torch.Tensor) else list(payload)
            shapes = self.transfer_shapes(transfer)
            if len(tensors) != len(shapes):
                raise PipelineCommunicationError(
                    f"{self._describe(self.groups.pp_rank)} produced {len(tensors)} {what} tensor(s) for "
                    f"{self._describe(transfer.dst)}, which expects {len(shapes)} of shapes {shapes}"
                )
            for tensor, shape in zip(tensors, shapes):
                self.check_tensor(tensor, what, shape)
                ops.append(
                    dist.P2POp(dist.isend, tensor.contiguous(), pp_ranks[transfer.dst], self.groups.pp)
                )
                described.append(
                    f"{self._describe(transfer.dst)} did not receive the {what} of micro-batch "
                    f"{transfer.microbatch} from {self._describe(self.groups.pp_rank)}"
                )
        received: list[list[torch.Tensor]] = []
        for transfer in recvs:
            what = "activation" if transfer.kind == FORWARD else "gradient"
            group = []
            for shape in self.transfer_shapes(transfer):
                buffer = torch.empty(shape, dtype=self.dtype, device=self.device)
                group.append(buffer)
                ops.append(dist.P2POp(dist.irecv, buffer, pp_ranks[transfer.src], self.groups.pp))
                described.append(
                    f"{self._describe(transfer.src)} did not send the {what} of micro-batch "
                    f"{transfer.microbatch} to {self._describe(self.groups.pp_rank)}"
                )
            received.append(group)
        if self.stats is not None:
            # Device work is asynchronous: finish this rank's compute first so that the time
            # measured below is time spent waiting on neighbours only.
            self.synchronize()
        start = time.perf_counter()
        try:
            works = dist.batch_isend_irecv(ops)
        except RuntimeError as err:
            raise self._error(described, err, time.perf_counter() - start) from err
        timeout = timedelta(seconds=self.timeout_s) if self.timeout_s is not None else None
        deadline = start + self.timeout_s if self.timeout_s is not None else None
        for work, description in zip(works, described):
            try:
                ok = work.wait(timeout) if timeout is not None else work.wait()
            except RuntimeError as err:
                raise self._error([description], err, time.perf_counter() - start) from err
            if ok is False:
                raise self._error([description], None, time.perf_counter() - start)
            # Host-blocking process groups (gloo) are done here. Device-stream ones only queued
            # the wait on the stream; with a deadline, watch the work until it completes (Megatron
            # also synchronizes after each batched exchange by default).
            while deadline is not None and not work.is_completed():
                if time.perf_counter() > deadline:
                    raise self._error([description], None, time.perf_counter() - start)
                time.sleep(1e-5)
        if self.stats is not None:
            self.synchronize()
            self.stats.wait_s += time.perf_counter() - start
            self.stats.exchanges += 1
        for transfer, group in zip(recvs, received):
            if transfer.kind == FORWARD:
                for buffer in group:
                    buffer.requires_grad_(True)
        return [group[0] if self.stage_shapes is None else group for group in received]

    def _error(
        self, described: list[str], cause: BaseException | None, elapsed_s: float
    ) -> PipelineCommunicationError:
        """The error of a failed exchange, with the time it really took: a peer that died breaks the
        connection after seconds, long before the deadline; a peer that hangs reaches the deadline
        (the collective library's own timeout says "Timed out")."""
        first = str(cause).splitlines()[0] if cause is not None and str(cause) else ""
        timed_out = cause is None or "timed out" in first.lower()
        if timed_out and self.timeout_s is not None:
            when = f"within {self.timeout_s:g} s (gave up after {elapsed_s:.1f} s)"
        else:
            when = f"(the exchange failed after {elapsed_s:.1f} s)"
        reason = f" ({first or type(cause).__name__})" if cause is not None else ""
        return PipelineCommunicationError(
            f"{'; '.join(described)} {when}: that rank died, hangs, or runs a different schedule{reason}"
        )
