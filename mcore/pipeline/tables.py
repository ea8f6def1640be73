"""Pure pipeline arithmetic: micro-batch order, the lock-step timeline, constraints, bubble fractions.

Nothing here touches ``torch.distributed``: every function is a pure function of the sizes, so the
schedules are unit-tested without processes, and every rank computes the same plan for the whole
pipeline (which is how ranks agree on what to send and receive without any handshake).

Glossary: ``p`` pipeline stages (ranks along ``pp``), ``v`` virtual stages (model chunks) per rank,
``m`` micro-batches per step. Virtual stage ``s = chunk * p + rank`` holds the ``s``-th slice of
layers, so with ``p=2, v=2`` the model runs rank 0 chunk 0, rank 1 chunk 0, rank 0 chunk 1, rank 1
chunk 1 (Megatron's interleaved layout).

Worked example, 1F1B (PipeDream-Flush) with ``p=4, m=6``: rank ``r`` runs ``p - r - 1`` warm-up
forwards, then alternates one forward and one backward, then drains the remaining backwards::

    rank 0: F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5
    rank 3: F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5

The interleaved order (Megatron's) walks micro-batches in groups of ``p`` per chunk:
forward number ``k`` runs chunk ``(k // p) % v`` on micro-batch ``(k // (p*v)) * p + k % p``; backwards
visit the chunks in reverse.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

from mcore.config.fields import ConfigError, check

FORWARD: Literal["F"] = "F"
BACKWARD: Literal["B"] = "B"


@dataclass(frozen=True, order=True)
class Op:
    """One unit of pipeline work on one rank: a forward or a backward of one chunk on one micro-batch."""

    kind: Literal["F", "B"]
    chunk: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


@dataclass(frozen=True)
class Transfer:
    """One tensor moving between adjacent virtual stages in one tick.

    ``kind`` is ``"F"`` for an activation going forward and ``"B"`` for a gradient going backward;
    ``chunk``/``microbatch`` name the op on the *receiving* rank that consumes it.
    """

    kind: Literal["F", "B"]
    chunk: int
    microbatch: int
    src: int  # pipeline rank (index in the pp group), not global rank
    dst: int


@dataclass(frozen=True)
class Tick:
    """What one rank does in one lock-step tick: at most one op, then one batch of sends and receives."""

    tick: int
    op: Op | None
    sends: tuple[Transfer, ...]
    recvs: tuple[Transfer, ...]


def check_pipeline_schedule(pp_size: int, vp_size: int, num_microbatches: int) -> None:
    """Raise :class:`ConfigError` (naming the numbers) unless the schedule can run.

    Megatron's classic interleaved schedule walks micro-batches in groups of ``p``, so it needs
    ``num_microbatches % pipeline_model_parallel_size == 0``.
    """
    check(pp_size >= 1, f"pipeline_model_parallel_size={pp_size} must be >= 1")
    check(vp_size >= 1, f"virtual_pipeline_model_parallel_size={vp_size} must be >= 1")
    check(num_microbatches >= 1, f"num_microbatches={num_microbatches} must be >= 1")
    if vp_size > 1:
        check(
            pp_size > 1,
            f"virtual_pipeline_model_parallel_size={vp_size} needs pipeline_model_parallel_size > 1 "
            f"(got {pp_size})",
        )
        check(
            num_microbatches % pp_size == 0,
            f"the interleaved schedule needs num_microbatches divisible by pipeline_model_parallel_size: "
            f"num_microbatches={num_microbatches} is not divisible by pipeline_model_parallel_size={pp_size} "
            f"(virtual_pipeline_model_parallel_size={vp_size}); use a global batch size that gives a "
            f"multiple of {pp_size} micro-batches per data-parallel rank",
        )


def _interleaved_chunk(k: int, p: int, v: int, forward: bool) -> int:
    chunk = (k % (p * v)) // p
    return chunk if forward else v - 1 - chunk


def _interleaved_microbatch(k: int, p: int, v: int) -> int:
    return (k // (p * v)) * p + k % p


@functools.lru_cache(maxsize=256)
def schedule_table(
    pp_size: int, vp_size: int, num_microbatches: int, pp_rank: int, forward_only: bool = False
) -> tuple[Op, ...]:
    """The order in which pipeline rank ``pp_rank`` runs its forwards and backwards.

    ``pp_size == 1`` gives no pipelining (F0 B0 F1 B1 ...); ``vp_size == 1`` gives 1F1B; ``vp_size > 1``
    gives Megatron's interleaved 1F1B. ``forward_only`` keeps the forwards in the same order.

    Raises:
        ConfigError: the sizes cannot be scheduled (see :func:`check_pipeline_schedule`).
    """
    p, v, m, r = pp_size, vp_size, num_microbatches, pp_rank
    check_pipeline_schedule(p, v, m)
    check(0 <= r < p, f"pp_rank={r} is outside 0..{p - 1}")
    if v == 1:
        forwards = [Op(FORWARD, 0, i) for i in range(m)]
        backwards = [Op(BACKWARD, 0, i) for i in range(m)]
        warmup = m if forward_only else min(p - r - 1, m)
    else:
        total = m * v
        forwards = [
            Op(FORWARD, _interleaved_chunk(k, p, v, True), _interleaved_microbatch(k, p, v))
            for k in range(total)
        ]
        backwards = [
            Op(BACKWARD, _interleaved_chunk(k, p, v, False), _interleaved_microbatch(k, p, v))
            for k in range(total)
        ]
        # Megatron: two forwards per later rank so that the steady state's backward inputs have
        # arrived, plus one full round of the other chunks.
        warmup = total if forward_only else min((p - r - 1) * 2 + (v - 1) * p, total)
    if forward_only:
        return tuple(forwards)
    order = forwards[:warmup]
    for i in range(len(forwards) - warmup):
        order += [forwards[warmup + i], backwards[i]]
    order += backwards[len(forwards) - warmup :]
    return tuple(order)


def _deps(op: Op, rank: int, p: int, v: int) -> list[tuple[str, int, int]]:
    """Ops (kind, virtual stage, microbatch) that ``op`` on ``rank`` needs first."""
    stage = op.chunk * p + rank
    if op.kind == FORWARD:
        return [(FORWARD, stage - 1, op.microbatch)] if stage > 0 else []
    deps = [(FORWARD, stage, op.microbatch)]
    if stage < p * v - 1:
        deps.append((BACKWARD, stage + 1, op.microbatch))
    return deps


@functools.lru_cache(maxsize=64)
def pipeline_timeline(
    pp_size: int, vp_size: int, num_microbatches: int, forward_only: bool = False
) -> tuple[tuple[Tick, ...], ...]:
    """The lock-step plan of the whole pipeline: for each rank, its ticks (only non-empty ones).

    Every op takes one tick; each rank runs its :func:`schedule_table` order, an op as soon as its
    inputs arrived in an earlier tick. A tensor produced in tick ``t`` is sent in tick ``t`` and the
    neighbour receives it in the *same* tick ``t``, in one batched exchange, then keeps it until the
    op that needs it. So every send meets its receive in the same batch on both ranks, and the pipeline
    cannot deadlock: batch ``t`` only waits for ranks to finish ops of tick ``t``, whose inputs came in
    ticks before ``t`` (induction over ``t``). Between two ranks at most one tensor per direction moves
    per tick, so messages also match in first-in-first-out order.

    Raises:
        ConfigError: the sizes cannot be scheduled.
        RuntimeError: the orders are inconsistent (a bug; tests assert this never happens).
    """
    p, v, m = pp_size, vp_size, num_microbatches
    orders = [schedule_table(p, v, m, r, forward_only) for r in range(p)]
    done: dict[tuple[str, int, int], int] = {}
    position = [0] * p
    ops_at: list[list[Op | None]] = [[] for _ in range(p)]
    tick = 0
    while any(position[r] < len(orders[r]) for r in range(p)):
        ran = []
        for r in range(p):
            if position[r] == len(orders[r]):
                ops_at[r].append(None)
                continue
            op = orders[r][position[r]]
            if all(done.get(d, tick) < tick for d in _deps(op, r, p, v)):
                ran.append((r, op))
                ops_at[r].append(op)
            else:
                ops_at[r].append(None)
        if not ran:
            stuck = {r: str(orders[r][position[r]]) for r in range(p) if position[r] < len(orders[r])}
            raise RuntimeError(f"pipeline schedule p={p} v={v} m={m} cannot progress at tick {tick}: {stuck}")
        for r, op in ran:
            done[(op.kind, op.chunk * p + r, op.microbatch)] = tick
            position[r] += 1
        tick += 1

    sends: list[list[list[Transfer]]] = [[[] for _ in range(tick)] for _ in range(p)]
    recvs: list[list[list[Transfer]]] = [[[] for _ in range(tick)] for _ in range(p)]
    for r in range(p):
        for t, op in enumerate(ops_at[r]):
            if op is None:
                continue
            stage = op.chunk * p + r
            target = stage + 1 if op.kind == FORWARD else stage - 1
            if not 0 <= target < p * v or (op.kind == BACKWARD and forward_only):
                continue
            dst = target % p
            transfer = Transfer(op.kind, target // p, op.microbatch, r, dst)
            sends[r][t].append(transfer)
            recvs[dst][t].append(transfer)
    return tuple(
        tuple(
            Tick(t, ops_at[r][t], tuple(sends[r][t]), tuple(recvs[r][t]))
            for t in range(tick)
            if ops_at[r][t] is not None or sends[r][t] or recvs[r][t]
        )
        for r in range(p)
    )


def theoretical_bubble_fraction(pp_size: int, vp_size: int, num_microbatches: int) -> float:
    """Megatron's pipeline bubble, idle time over ideal compute time: ``(p - 1) / (v * m)``."""
    return (pp_size - 1) / (vp_size * num_microbatches)


def timeline_bubble_fraction(pp_size: int, vp_size: int, num_microbatches: int) -> float:
    """Idle ticks over busy ticks of rank 0 in :func:`pipeline_timeline`, with one tick per op.

    Each virtual stage's op takes ``1/v`` of a stage's time, so this equals
    :func:`theoretical_bubble_fraction` when the schedule is as tight as the theory says.
    """
    ticks = pipeline_timeline(pp_size, vp_size, num_microbatches)
    length = max(t.tick for rank in ticks for t in rank) + 1
    busy = sum(1 for t in ticks[0] if t.op is not None)
    return (length - busy) / busy


def check_model_chunks(num_chunks: int, vp_size: int) -> None:
    """The schedule got as many model chunks as there are virtual stages."""
    if num_chunks != vp_size:
        raise ConfigError(
            f"the schedule got {num_chunks} model chunk(s) but virtual_pipeline_model_parallel_size={vp_size}"
        )
