"""Pure rank arithmetic: which global ranks form each parallel group. No torch.distributed here.

Axis glossary (used everywhere in mcore, in code, configs and logs):

* ``tp``: tensor model parallel: ranks that split each weight matrix;
* ``cp``: context parallel: ranks that split the sequence inside attention;
* ``dp``: data parallel: ranks that hold replicas and see different samples;
* ``pp``: pipeline model parallel: ranks that hold consecutive groups of layers;
* ``vp``: virtual pipeline: model chunks per pipeline rank (not a rank axis).

Ranks are laid out like a multi-dimensional array whose axes are listed fastest-varying first by the
order string (Megatron's default ``"tp-cp-dp-pp"``). Worked example: 8 ranks, tp=2, pp=2, dp=2::

    rank:  0  1  2  3  4  5  6  7
    tp:    0  1  0  1  0  1  0  1      tp groups: [0,1] [2,3] [4,5] [6,7]
    dp:    0  0  1  1  0  0  1  1      dp groups: [0,2] [1,3] [4,6] [5,7]
    pp:    0  0  0  0  1  1  1  1      pp groups: [0,4] [1,5] [2,6] [3,7]

so tensor-parallel peers are neighbours (fast links inside a node) and pipeline stages are far apart.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from mcore.config.fields import ConfigError

AXES = ("tp", "cp", "dp", "pp")


def rank_groups(sizes: dict[str, int], order: str, axes: str) -> list[list[int]]:
    """Rank groups along the hyphen-joined ``axes`` (e.g. ``"tp"`` or ``"tp-pp"``).

    Each group holds the ranks whose coordinates differ only along ``axes``; inside a group ranks
    are sorted by their coordinate on those axes (fastest axis first), which is the group rank.

    Args:
        sizes: size of every axis named in ``order``.
        order: axes from fastest- to slowest-varying, e.g. ``"tp-cp-dp-pp"``.
        axes: the axes that vary inside one group.
    """
    names = order.split("-")
    chosen = axes.split("-")
    for axis in chosen:
        if axis not in names:
            raise ValueError(f"axis {axis!r} is not in order {order!r}")
    dims = [sizes[n] for n in names]
    strides = [math.prod(dims[:i]) for i in range(len(dims))]
    inner = [i for i, n in enumerate(names) if n in chosen]
    outer = [i for i, n in enumerate(names) if n not in chosen]

    groups = []
    for outer_coords in itertools.product(*(range(dims[i]) for i in reversed(outer))):
        base = sum(c * strides[i] for c, i in zip(outer_coords, reversed(outer)))
        members = []
        for inner_coords in itertools.product(*(range(dims[i]) for i in reversed(inner))):
            members.append(base + sum(c * strides[i] for c, i in zip(inner_coords, reversed(inner))))
        groups.append(sorted(members, key=lambda r: [(r // strides[i]) % dims[i] for i in reversed(inner)]))
    return sorted(groups, key=lambda g: g[0])


@dataclass(frozen=True)
class Topology:
    """Sizes of every axis and the coordinates of one rank. Built by :meth:`create`; pure values."""

    world_size: int
    rank: int
    tp: int
    cp: int
    dp: int
    pp: int
    order: str = "tp-cp-dp-pp"

    @classmethod
    def create(
        cls, world_size: int, rank: int, tp: int = 1, pp: int = 1, cp: int = 1, order: str = "tp-cp-dp-pp"
    ) -> Topology:
        """Derive dp from the world size; refuse a layout that does not tile it, naming every factor."""
        for name, value in (
            ("world_size", world_size),
            ("tensor_model_parallel_size", tp),
            ("pipeline_model_parallel_size", pp),
            ("context_parallel_size", cp),
        ):
            if value < 1:
                raise ConfigError(f"{name}={value} must be >= 1")
        model_parallel = tp * cp * pp
        if world_size % model_parallel != 0:
            raise ConfigError(
                f"world_size={world_size} is not divisible by tensor_model_parallel_size={tp} x "
                f"context_parallel_size={cp} x pipeline_model_parallel_size={pp} = {model_parallel}"
            )
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank={rank} is outside world_size={world_size}")
        return cls(
            world_size=world_size,
            rank=rank,
            tp=tp,
            cp=cp,
            dp=world_size // model_parallel,
            pp=pp,
            order=order,
        )

    @property
    def sizes(self) -> dict[str, int]:
        return {"tp": self.tp, "cp": self.cp, "dp": self.dp, "pp": self.pp}

    def groups(self, axes: str) -> list[list[int]]:
        """Every group along ``axes`` (all ranks, not just this one's)."""
        return rank_groups(self.sizes, self.order, axes)

    def group_of(self, axes: str, rank: int | None = None) -> list[int]:
        """The group along ``axes`` that contains ``rank`` (default: this rank)."""
        rank = self.rank if rank is None else rank
        return next(g for g in self.groups(axes) if rank in g)

    def coordinate(self, axis: str, rank: int | None = None) -> int:
        """This rank's index along one axis (its rank inside that axis's group)."""
        return self.group_of(axis, rank).index(self.rank if rank is None else rank)

    def embedding_groups(self, split_rank: int | None = None) -> list[list[int]]:
        """Ranks that hold the tied word embeddings: the first and the last stage of each pipeline, and
        with an encoder-decoder split (``split_rank``, Megatron's T5) the decoder's first stage too."""
        if split_rank is not None:
            return [sorted({g[0], g[split_rank], g[-1]}) for g in self.groups("pp")]
        return [[g[0], g[-1]] if len(g) > 1 else [g[0]] for g in self.groups("pp")]
