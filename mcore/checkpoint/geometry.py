"""Where a stored piece of a tensor sits in its logical tensor, and copying between any two layouts.

A *placement* describes one rank's piece of a logical tensor in any layout:

* the TP-local tensor is a list of logical *boxes* (offsets, lengths) concatenated along
  ``partition_dim`` (one box for a plain split, ``num_stacked`` boxes for SwiGLU's ``[gate; up]``, the
  whole tensor when replicated); a routed expert's weight (``expert_dim``) has boxes covering only
  this ep rank's block of the global expert axis, so experts saved at one EP size load at any other;
* the piece is the flat range ``[start, end)`` of the row-major flattened TP-local tensor (the whole
  of it for model weights; a distributed-optimizer shard holds part of it).

:func:`pieces` cuts a placement into logical boxes, each with a view into the flat data. Copying from
saved placements to a wanted placement is then box intersection (:func:`copy_into`), which covers
every change of TP, PP, DP and distributed optimizer at once. Pure functions: tested without processes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

Box = tuple[tuple[int, ...], tuple[int, ...]]
"""``(offsets, lengths)`` of a box in logical coordinates."""


@dataclass(frozen=True)
class Placement:
    """One piece of a logical tensor (see the module docstring)."""

    global_shape: tuple[int, ...]
    partition_dim: int | None
    boxes: tuple[Box, ...]
    flat_range: tuple[int, int]

    @property
    def local_shape(self) -> tuple[int, ...]:
        if self.partition_dim is None:
            return tuple(self.boxes[0][1])
        shape = list(self.boxes[0][1])
        shape[self.partition_dim] = sum(lengths[self.partition_dim] for _, lengths in self.boxes)
        return tuple(shape)

    @property
    def numel(self) -> int:
        return self.flat_range[1] - self.flat_range[0]

    def to_json(self) -> dict:
        return {
            "global_shape": list(self.global_shape),
            "partition_dim": self.partition_dim,
            "boxes": [[list(o), list(n)] for o, n in self.boxes],
            "local_shape": list(self.local_shape),
            "flat_range": list(self.flat_range),
        }

    @classmethod
    def from_json(cls, record: dict) -> Placement:
        return cls(
            global_shape=tuple(record["global_shape"]),
            partition_dim=record["partition_dim"],
            boxes=tuple((tuple(o), tuple(n)) for o, n in record["boxes"]),
            flat_range=tuple(record["flat_range"]),
        )


def placement_from_spec(spec, flat_range: tuple[int, int] | None = None) -> Placement:
    """The placement of a :class:`~mcore.tensor_parallel.sharding.ShardSpec`'s local tensor (or of the
    flat piece ``flat_range`` of it)."""
    shape = tuple(spec.global_shape)
    base_offsets, base_lengths = [0] * len(shape), list(shape)
    expert_dim = getattr(spec, "expert_dim", None)
    if expert_dim is not None:  # a routed expert's weight: this ep rank's block of the expert axis
        base_offsets[expert_dim], base_lengths[expert_dim] = spec.expert_range()
    if spec.partition_dim is None:
        boxes = ((tuple(base_offsets), tuple(base_lengths)),)
    else:
        d = spec.partition_dim
        boxes = []
        for _, start, length in spec.chunks():
            offsets, lengths = list(base_offsets), list(base_lengths)
            offsets[d], lengths[d] = start, length
            boxes.append((tuple(offsets), tuple(lengths)))
        boxes = tuple(boxes)
    numel = math.prod(spec.local_shape)
    return Placement(shape, spec.partition_dim, boxes, flat_range or (0, numel))


def full_placement(shape: Sequence[int]) -> Placement:
    """The whole logical tensor (TP=1)."""
    shape = tuple(shape)
    return Placement(shape, None, (((0,) * len(shape), shape),), (0, math.prod(shape)))


def _flat_boxes(shape: Sequence[int], start: int, end: int) -> list[tuple[list[int], list[int], int]]:
    """Cut the flat range ``[start, end)`` of a row-major tensor of ``shape`` into boxes
    ``(offsets, lengths, flat_start)``, each contiguous in the flat order."""
    out: list[tuple[list[int], list[int], int]] = []

    def rec(prefix: list[int], shape: Sequence[int], s: int, e: int, base: int) -> None:
        if s >= e:
            return
        ones = [1] * len(prefix)
        if len(shape) == 1:
            out.append((prefix + [s], ones + [e - s], base + s))
            return
        inner = math.prod(shape[1:])
        r0, o0 = divmod(s, inner)
        r1, o1 = divmod(e, inner)
        if r0 == r1:
            rec(prefix + [r0], shape[1:], o0, o1, base + r0 * inner)
            return
        if o0:
            rec(prefix + [r0], shape[1:], o0, inner, base + r0 * inner)
            r0 += 1
        if r1 > r0:
            out.append(
                (prefix + [r0] + [0] * (len(shape) - 1), ones + [r1 - r0, *shape[1:]], base + r0 * inner)
            )
        if o1:
            rec(prefix + [r1], shape[1:], 0, o1, base + r1 * inner)

    if not shape:
        if start < end:
            out.append(([], [], 0))
        return out
    rec([], list(shape), start, end, 0)
    return out


@dataclass(frozen=True)
class Piece:
    """A box of the logical tensor and where its values sit in the piece's flat data."""

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    flat_start: int  # relative to the start of the flat piece
    local_lengths: tuple[int, ...]
    narrow: tuple[int, int, int] | None  # (dim, start, length) inside the local box, or None

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        """The box's values as a tensor view of ``flat`` (the piece's 1-D data)."""
        block = flat[self.flat_start : self.flat_start + math.prod(self.local_lengths)]
        block = block.view(self.local_lengths)
        if self.narrow is not None:
            block = block.narrow(*self.narrow)
        return block


def pieces(placement: Placement) -> list[Piece]:
    """Cut a placement into logical boxes (at most a few per placement)."""
    start, end = placement.flat_range
    local_shape = placement.local_shape
    d = placement.partition_dim
    # where each box starts along partition_dim in the local tensor
    starts, acc = [], 0
    for _, lengths in placement.boxes:
        starts.append(acc)
        acc += lengths[d] if d is not None else 0
    out = []
    for loc_off, loc_len, flat_start in _flat_boxes(local_shape, start, end):
        rel = flat_start - start
        if d is None:
            base = placement.boxes[0][0]
            offsets = tuple(b + o for b, o in zip(base, loc_off))
            out.append(Piece(offsets, tuple(loc_len), rel, tuple(loc_len), None))
            continue
        lo, hi = loc_off[d], loc_off[d] + loc_len[d]
        for (box_off, box_len), box_start in zip(placement.boxes, starts):
            a, b = max(lo, box_start), min(hi, box_start + box_len[d])
            if a >= b:
                continue
            offsets = [box_off[k] + loc_off[k] for k in range(len(loc_off))]
            offsets[d] = box_off[d] + (a - box_start)
            lengths = list(loc_len)
            lengths[d] = b - a
            narrow = None if (a, b) == (lo, hi) else (d, a - lo, b - a)
            out.append(Piece(tuple(offsets), tuple(lengths), rel, tuple(loc_len), narrow))
    return out


def _intersect(a: Piece | Box, b: Piece | Box) -> Box | None:
    ao, al = (a.offsets, a.lengths) if isinstance(a, Piece) else a
    bo, bl = (b.offsets, b.lengths) if isinstance(b, Piece) else b
    offsets, lengths = [], []
    for x0, xn, y0, yn in zip(ao, al, bo, bl):
        lo, hi = max(x0, y0), min(x0 + xn, y0 + yn)
        if lo >= hi:
            return None
        offsets.append(lo)
        lengths.append(hi - lo)
    return tuple(offsets), tuple(lengths)


def _sub(view: torch.Tensor, piece: Piece, box: Box) -> torch.Tensor:
    for dim, (o, n) in enumerate(zip(*box)):
        view = view.narrow(dim, o - piece.offsets[dim], n)
    return view


def overlaps(saved: Placement, wanted: Placement) -> bool:
    """Whether the two placements share any element (decided on metadata only)."""
    want = pieces(wanted)
    return any(_intersect(p, q) is not None for p in pieces(saved) for q in want)


def required_elements(wanted: Placement, saved_shape: Sequence[int]) -> int:
    """Elements of ``wanted`` inside a logical tensor of ``saved_shape`` (what the sources must cover)."""
    bounds = ((0,) * len(saved_shape), tuple(saved_shape))
    total = 0
    for p in pieces(wanted):
        box = _intersect(p, bounds)
        if box is not None:
            total += math.prod(box[1])
    return total


def copy_into(
    dest: torch.Tensor, wanted: Placement, sources: Iterable[tuple[Placement, torch.Tensor]]
) -> int:
    """Copy every overlap of the saved ``(placement, flat data)`` sources into ``dest`` (the flat
    data of ``wanted``). Returns the number of elements written."""
    want = pieces(wanted)
    written = 0
    for placement, flat in sources:
        for p in pieces(placement):
            for q in want:
                box = _intersect(p, q)
                if box is None:
                    continue
                _sub(q.view(dest), q, box).copy_(_sub(p.view(flat), p, box))
                written += math.prod(box[1])
    return written
