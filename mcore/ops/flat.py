"""Flat optimizer state: the segment table and the exact fp32 master split into bf16 + 16 bits.

The fused optimizer step (op ``adam_step_flat``) updates whole buffers at once instead of one
tensor per parameter. Two index spaces meet there:

* the *buffer* space of DDP's contiguous gradient and parameter buffers
  (:class:`mcore.distributed.grad_buffer.GradBuffer`): ``grad[i]`` and ``param[i]``;
* the *state* space of this rank's optimizer state (moments and masters): with the distributed
  optimizer only the shards this rank owns, packed back to back, otherwise the same as the buffer.

A :class:`FlatSegments` table lists the runs that map one onto the other::

    segment k: state[state_start : state_start + length]  <->  buffer[buffer_start : buffer_start + length]
               every element of it belongs to parameter group ``group`` (lr, weight decay)

Bucket padding and pieces other ranks own are in no segment, so they are never touched.

Exact fp32 masters in 2 extra bytes (Megatron's precision-aware optimizer stores "parameter
remainders" the same way): the fp32 master's bit pattern ``u`` (int32) is split into the bf16 model
parameter ``hi`` and a signed 16-bit remainder ``rem``::

    hi  = (u + 0x8000) >> 16          # round half up in magnitude (bf16 keeps the top 16 bits)
    rem = u - (hi << 16)              # in [-0x8000, 0x7fff]: fits int16 exactly
    u   = (hi << 16) + rem            # the master, bit for bit

so the model parameter is the master rounded to bf16 (ties away from zero, instead of ``copy_``'s
ties to even) and nothing of the master is lost.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

STATE_ALIGN = 16
"""State indices are laid out congruent to their buffer indices modulo this many elements (a few
elements of padding per shard at most), so a kernel can walk both spaces in aligned vectors."""


@dataclass(frozen=True)
class Segment:
    state_start: int
    buffer_start: int
    length: int
    group: int


@dataclass
class FlatSegments:
    """The runs of one buffer that one optimizer updates (see the module docstring).

    ``cache`` holds what a backend derives from the table once (a device tile table, say), keyed
    by the backend; the table itself never changes after construction.
    """

    segments: tuple[Segment, ...]
    cache: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_runs(cls, runs: Iterable[tuple[int, int, int, int]]) -> FlatSegments:
        """Build from ``(state_start, buffer_start, length, group)``, merging runs that continue
        each other in both spaces with the same group (a whole layer of one group becomes one run)."""
        merged: list[Segment] = []
        for state_start, buffer_start, length, group in sorted(runs, key=lambda r: r[0]):
            if length <= 0:
                continue
            if merged:
                last = merged[-1]
                if (
                    last.group == group
                    and last.state_start + last.length == state_start
                    and last.buffer_start + last.length == buffer_start
                ):
                    merged[-1] = Segment(last.state_start, last.buffer_start, last.length + length, group)
                    continue
                if state_start < last.state_start + last.length:
                    raise ValueError(f"flat segments overlap at state index {state_start}")
            merged.append(Segment(state_start, buffer_start, length, group))
        return cls(tuple(merged))

    @property
    def numel(self) -> int:
        return sum(s.length for s in self.segments)


def bias_corrections(step: int | torch.Tensor, beta1: float, beta2: float) -> tuple[Any, Any]:
    """Adam's bias corrections ``(1 - beta1^t, 1 - beta2^t)`` for step ``t`` (counted from 1).

    ``step`` is a host int (Python floats are returned, double precision), or a 0-d integer tensor
    on the device: the number of updates applied so far, counted there, so that a step skipped on the
    device (a non-finite gradient norm) does not advance it and the host never reads the decision.
    Then the corrections are float64 0-d tensors on that device, the same values as the host's
    double arithmetic (``pow`` of doubles on both sides). A tensor ``t = 0`` (every step so far
    skipped) gives a correction of 0: the update it would divide is discarded by the skip anyway.
    """
    if isinstance(step, torch.Tensor):
        t = step.to(torch.float64)
        return 1.0 - torch.pow(beta1, t), 1.0 - torch.pow(beta2, t)
    return 1.0 - beta1**step, 1.0 - beta2**step


def split_master(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``master`` -> (bf16 parameter, int16 remainder) with ``join_master`` inverting it exactly."""
    bits = master.contiguous().view(torch.int32)
    hi = (bits + 0x8000) >> 16  # arithmetic shift: the sign-extended top half
    rem = bits - (hi << 16)
    return hi.to(torch.int16).view(torch.bfloat16), rem.to(torch.int16)


def join_master(param: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """(bf16 parameter, int16 remainder) -> the fp32 master, bit for bit."""
    hi = param.contiguous().view(torch.int16).to(torch.int32)
    return ((hi << 16) + remainder.to(torch.int32)).view(torch.float32)


@dataclass(frozen=True, eq=False)
class FlatFp8Weights:
    """The FP8 copies that ``adam_step_flat_fp8`` writes beside the parameters it updates
    (``--fp8-param-gather`` with the delayed recipe, :mod:`mcore.fp8.param_gather`), or
    ``fp8_quantize_flat`` after the step (tensorwise: it reads ``scales`` only, never ``amax``).

    Attributes:
        data: ``[N]`` float8 (e4m3), indexed like the buffer (``data[i]`` is ``params[i]``'s copy).
        ranges: ``(start, end, index)`` per piece: the buffer range ``[start, end)`` of this rank's
            piece of FP8 weight ``index``; pieces other ranks own are absent, and every piece lies
            inside the step's segments (the parameters it updates).
        scales: ``[W]`` fp32, weight ``index``'s scale (the delayed recipe's WEIGHT scale).
        amax: ``[W]`` fp32, written by the op: ``max |p|`` over weight ``index``'s pieces of the
            parameters after the step (0 for a weight with no piece here).
    """

    data: torch.Tensor
    ranges: tuple[tuple[int, int, int], ...]
    scales: torch.Tensor
    amax: torch.Tensor


def split_at_fp8_pieces(
    segments: FlatSegments, ranges: tuple[tuple[int, int, int], ...]
) -> list[tuple[Segment, int]]:
    """``segments`` cut at the FP8 pieces' boundaries: ``(segment, index)`` with ``index`` the FP8
    weight every element of the segment belongs to, or -1 (a parameter that is not an FP8 weight).

    Raises:
        ValueError: a piece overlaps another or does not lie inside the segments.
    """
    pieces = sorted((start, end, index) for start, end, index in ranges if end > start)
    for (_, end, a), (start, _, b) in zip(pieces, pieces[1:]):
        if start < end:
            raise ValueError(f"FP8 pieces of weights {a} and {b} overlap at buffer index {start}")
    out: list[tuple[Segment, int]] = []
    covered = 0
    for seg in sorted(segments.segments, key=lambda s: s.buffer_start):
        cuts = {seg.buffer_start, seg.buffer_start + seg.length}
        for start, end, _ in pieces:
            cuts.update(c for c in (start, end) if seg.buffer_start < c < seg.buffer_start + seg.length)
        cuts = sorted(cuts)
        for lo, hi in zip(cuts, cuts[1:]):
            index = next((i for start, end, i in pieces if start <= lo and hi <= end), -1)
            covered += (hi - lo) if index >= 0 else 0
            delta = seg.state_start - seg.buffer_start
            out.append((Segment(lo + delta, lo, hi - lo, seg.group), index))
    if covered != sum(end - start for start, end, _ in pieces):
        raise ValueError(
            f"FP8 pieces {pieces} do not lie inside the optimizer's segments "
            f"{[(s.buffer_start, s.buffer_start + s.length) for s in segments.segments]} (buffer ranges)"
        )
    out.sort(key=lambda item: item[0].state_start)
    return out
