"""Optimizer state of one DDP buffer as flat tensors, for the one-pass step (``adam_step_flat``).

For every :class:`~mcore.distributed.grad_buffer.GradBuffer` the optimizer keeps::

    exp_avg, exp_avg_sq  [n]   Adam's moments (fp32, or bf16 with --exp-avg(-sq)-dtype bf16)
    masters              [n]   fp32 master weights (bf16/fp16 parameters), or
    remainders           [n]   int16 low halves of the fp32 masters (precision-aware, bf16), or
                               neither (fp32 parameters: the parameter buffer holds the masters)

where ``n`` is this rank's share of the buffer: all of it, or with the distributed optimizer its
shard of every bucket, packed bucket after bucket. The per-parameter state the checkpoint and
:class:`~mcore.optimizer.main_params.MainParam` see are views into these tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mcore.distributed.grad_buffer import GradBuffer
from mcore.ops.flat import STATE_ALIGN, FlatSegments, join_master, split_master


@dataclass(frozen=True)
class Piece:
    """One parameter's piece ``[start, end)`` (flattened) in buffer and state index spaces."""

    buffer_start: int
    state_start: int
    length: int
    group: int
    counts_in_norm: bool


class FlatBufferState:
    """Moments and masters of one buffer's pieces owned by this rank, as flat tensors.

    Args:
        buffer: the DDP buffer (with ``param_data``: parameters live in it).
        pieces: ``(param, start, end, group, counts_in_norm)`` for every parameter piece this rank
            updates (``start``/``end`` in the flattened parameter).
        moment_dtypes: dtypes of the first and second moments.
        remainders: hold bf16 parameters' fp32 masters as int16 remainders instead of fp32 copies.
        params_are_masters: keep no master for bf16 parameters (``--main-params-dtype bf16``): the step
            reads and rounds into the parameters themselves, as for fp32 parameters.
    """

    def __init__(
        self,
        buffer: GradBuffer,
        pieces: Sequence[tuple[torch.nn.Parameter, int, int, int, bool]],
        moment_dtypes: tuple[torch.dtype, torch.dtype],
        remainders: bool,
        params_are_masters: bool = False,
    ):
        if buffer.param_data is None:
            raise ValueError(
                "the one-pass optimizer needs the parameters in the DDP buffer (contiguous_params)"
            )
        self.buffer = buffer
        comm = buffer.comm
        # state index of every owned bucket shard: shards packed in bucket order
        self._shards: list[tuple[int, int, int]] = []  # (buffer lo, buffer hi, state base)
        base = 0
        for bucket in buffer.buckets:
            lo, hi = (
                bucket.shard_range(comm.rank)
                if comm.use_distributed_optimizer
                else (bucket.start, bucket.end)
            )
            data_end = max(buffer.buffer_range(p)[1] for p in bucket.params)  # no state for padding
            hi = max(lo, min(hi, data_end))
            base += (lo - base) % STATE_ALIGN  # state index = buffer index mod STATE_ALIGN
            self._shards.append((lo, hi, base))
            base += hi - lo
        self.numel = base

        self.pieces: dict[int, Piece] = {}
        for param, start, end, group, counts in pieces:
            buffer_start = buffer.buffer_range(param)[0] + start
            self.pieces[id(param)] = Piece(
                buffer_start, self.state_index(buffer_start), end - start, group, counts
            )
        self.segments = FlatSegments.from_runs(
            (p.state_start, p.buffer_start, p.length, p.group) for p in self.pieces.values()
        )
        self._norm_views = self._merged_grad_views([p for p in self.pieces.values() if p.counts_in_norm])
        counted = sum(p.length for p in self.pieces.values() if p.counts_in_norm)
        self._norm_is_whole_buffer = counted == sum(param.numel() for param in buffer.params)
        """Every gradient element of the buffer counts in the norm (its buckets' norms are this state's)."""

        device = buffer.grad_data.device
        m_dtype, v_dtype = moment_dtypes
        self.exp_avg = torch.zeros(self.numel, dtype=m_dtype, device=device)
        self.exp_avg_sq = torch.zeros(self.numel, dtype=v_dtype, device=device)
        self.masters: torch.Tensor | None = None
        self.remainders: torch.Tensor | None = None
        params_fp32 = buffer.param_dtype == torch.float32 or (
            params_are_masters and buffer.param_dtype == torch.bfloat16
        )  # the parameters hold the masters themselves
        if remainders and buffer.param_dtype != torch.bfloat16:
            remainders = False  # fp32 parameters are their own masters
        if remainders:
            # a bf16 value is an fp32 value with a zero low half: the master starts equal to the parameter
            self.remainders = torch.zeros(self.numel, dtype=torch.int16, device=device)
        elif not params_fp32:
            self.masters = torch.zeros(self.numel, dtype=torch.float32, device=device)
            for piece in self.pieces.values():
                self.state_view(self.masters, piece).copy_(self.param_view(piece))

    def state_index(self, buffer_index: int) -> int:
        for lo, hi, base in self._shards:
            if lo <= buffer_index < hi:
                return base + buffer_index - lo
        raise ValueError(f"buffer index {buffer_index} is in no shard this rank owns")

    def piece(self, param: torch.nn.Parameter) -> Piece:
        return self.pieces[id(param)]

    def state_view(self, tensor: torch.Tensor, piece: Piece) -> torch.Tensor:
        return tensor[piece.state_start : piece.state_start + piece.length]

    def param_view(self, piece: Piece) -> torch.Tensor:
        return self.buffer.param_data[piece.buffer_start : piece.buffer_start + piece.length]

    def grad_view(self, piece: Piece) -> torch.Tensor:
        return self.buffer.grad_data[piece.buffer_start : piece.buffer_start + piece.length]

    def _merged_grad_views(self, pieces: list[Piece]) -> list[torch.Tensor]:
        """Gradient views of ``pieces``, adjacent ones merged (fewer tensors for the norm kernel)."""
        runs: list[list[int]] = []
        for piece in sorted(pieces, key=lambda p: p.buffer_start):
            if runs and runs[-1][1] == piece.buffer_start:
                runs[-1][1] += piece.length
            else:
                runs.append([piece.buffer_start, piece.buffer_start + piece.length])
        return [self.buffer.grad_data[lo:hi] for lo, hi in runs]

    def grad_norm_squared(self, reuse_bucket_norms: bool = False) -> torch.Tensor | None:
        """Sum of squares (fp32, on the device) of the gradients that count in the global norm.

        ``reuse_bucket_norms``: the caller knows that no collective changes the gradients after DDP's
        NaN check (one rank: no data-parallel reduction, no pipeline or tensor-parallel gradient
        all-reduce). If every bucket then holds the squared norm that check computed
        (``Bucket.local_norm_sq``), no in-place write reached the buffer since the last of them (its
        version counter), and every gradient of the buffer counts, their sum is returned and the
        gradients are not read a second time (2.6 GB a step at 1.3 G bf16 parameters). Bucket padding
        is zero and adds nothing.
        """
        if not self._norm_views:
            return None
        buckets = self.buffer.buckets
        if (
            reuse_bucket_norms
            and self._norm_is_whole_buffer
            and all(b.local_norm_sq is not None for b in buckets)
            and self.buffer.grad_data._version == max(b.local_norm_version for b in buckets)
        ):
            return torch.stack([b.local_norm_sq for b in buckets]).sum()
        norms = torch._foreach_norm(self._norm_views, 2.0, dtype=torch.float32)
        return torch.stack(norms).square().sum()

    # ---------------------------------------------------------------------------------------------
    # the master of a piece, whatever its storage

    def read_master(self, piece: Piece) -> torch.Tensor:
        """The piece's fp32 master (a copy, except for fp32 parameters where it is the parameter)."""
        if self.masters is not None:
            return self.state_view(self.masters, piece)
        if self.remainders is not None:
            return join_master(self.param_view(piece), self.state_view(self.remainders, piece))
        return self.param_view(piece)

    def write_master(self, piece: Piece, value: torch.Tensor) -> None:
        """Set the piece's fp32 master (and the model parameter, its rounding) to ``value``."""
        value = value.to(torch.float32)
        if self.remainders is not None:
            hi, rem = split_master(value)
            self.param_view(piece).copy_(hi)
            self.state_view(self.remainders, piece).copy_(rem)
            return
        if self.masters is not None:
            self.state_view(self.masters, piece).copy_(value)
        self.param_view(piece).copy_(value)

    def reset_masters_from_params(self) -> None:
        """Masters := the model parameters (after new weights were loaded into the model)."""
        if self.remainders is not None:
            self.remainders.zero_()
        elif self.masters is not None:
            for piece in self.pieces.values():
                self.state_view(self.masters, piece).copy_(self.param_view(piece))

    @property
    def state_bytes(self) -> int:
        tensors = [self.exp_avg, self.exp_avg_sq, self.masters, self.remainders]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)
