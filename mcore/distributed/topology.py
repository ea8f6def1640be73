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

Expert grid (MoE "parallel folding", Megatron's ``expert_decoder_rank_generator``): the routed experts
lay the SAME ranks out a second time, over

* ``etp``: expert tensor parallel (splits each expert's weights; default = tp);
* ``ep``: expert model parallel (each rank holds ``num_experts / ep`` whole experts);
* ``edp``: expert data parallel: what is left, ``edp = world / (etp * ep * pp)``;
* ``pp``: the same pipeline stages as the dense grid.

The expert order is the dense order with ``cp`` replaced by ``ep`` (``"tp-cp-dp-pp"`` gives
``"tp-ep-dp-pp"``: ETP fastest), where ``tp`` means etp and ``dp`` means edp. Worked example: 8 ranks,
tp=2, dp=4 (dense) and etp=1, ep=4 (experts), so edp=2::

    rank:  0  1  2  3  4  5  6  7
    ep:    0  1  2  3  0  1  2  3      ep groups:  [0,1,2,3] [4,5,6,7]
    edp:   0  0  0  0  1  1  1  1      edp groups: [0,4] [1,5] [2,6] [3,7]

A stage holds ``tp*cp*dp = etp*ep*edp`` ranks in both grids, so with pp slowest the pipeline groups
agree (checked by :meth:`Topology.create`, as Megatron asserts).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from mcore.config.fields import ConfigError

AXES = ("tp", "cp", "dp", "pp")
EXPERT_AXES = ("etp", "ep", "edp", "pp")
_EXPERT_ALIASES = {"etp": "tp", "edp": "dp", "tp": "tp", "dp": "dp", "ep": "ep", "pp": "pp"}


def expert_order(order: str) -> str:
    """The expert grid's order from the dense one: ``cp`` (always 1 for experts) becomes ``ep``."""
    return "-".join("ep" if axis == "cp" else axis for axis in order.split("-"))


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
    ep: int = 1
    etp: int = 0  # 0 only while constructing; create() resolves it (None -> tp)
    edp: int = 0

    def __post_init__(self) -> None:
        # Direct construction (tests, single()) gets the defaults create() would give.
        if self.etp == 0:
            object.__setattr__(self, "etp", self.tp)
        if self.edp == 0:
            object.__setattr__(self, "edp", self.world_size // (self.etp * self.ep * self.pp))

    @classmethod
    def create(
        cls,
        world_size: int,
        rank: int,
        tp: int = 1,
        pp: int = 1,
        cp: int = 1,
        order: str = "tp-cp-dp-pp",
        ep: int = 1,
        etp: int | None = None,
    ) -> Topology:
        """Derive dp (and edp) from the world size; refuse a layout that does not tile it, naming every
        factor. ``etp=None`` means the expert tensor-parallel size equals ``tp`` (Megatron's default)."""
        etp = tp if etp is None else etp
        for name, value in (
            ("world_size", world_size),
            ("tensor_model_parallel_size", tp),
            ("pipeline_model_parallel_size", pp),
            ("context_parallel_size", cp),
            ("expert_model_parallel_size", ep),
            ("expert_tensor_parallel_size", etp),
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
        dp = world_size // model_parallel
        _check_expert_grid(world_size, tp, cp, dp, pp, ep, etp, order)
        return cls(
            world_size=world_size,
            rank=rank,
            tp=tp,
            cp=cp,
            dp=dp,
            pp=pp,
            order=order,
            ep=ep,
            etp=etp,
            edp=world_size // (etp * ep * pp),
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

    # -- the expert grid (etp x ep x edp x pp over the same ranks) --------------------------------

    @property
    def expert_sizes(self) -> dict[str, int]:
        return {"tp": self.etp, "ep": self.ep, "dp": self.edp, "pp": self.pp}

    def expert_groups(self, axes: str) -> list[list[int]]:
        """Every group along ``axes`` of the expert grid: hyphen-joined names from ``etp``, ``ep``,
        ``edp``, ``pp`` (``tp``/``dp`` are accepted for etp/edp, as Megatron spells them)."""
        try:
            names = "-".join(_EXPERT_ALIASES[a] for a in axes.split("-"))
        except KeyError as err:
            raise ValueError(f"axis {err.args[0]!r} is not an expert axis {EXPERT_AXES}") from None
        return rank_groups(self.expert_sizes, expert_order(self.order), names)

    def expert_group_of(self, axes: str, rank: int | None = None) -> list[int]:
        """The expert-grid group along ``axes`` that contains ``rank`` (default: this rank)."""
        rank = self.rank if rank is None else rank
        return next(g for g in self.expert_groups(axes) if rank in g)

    def expert_coordinate(self, axis: str, rank: int | None = None) -> int:
        """This rank's index along one expert axis (``etp``, ``ep``, ``edp`` or ``pp``)."""
        rank = self.rank if rank is None else rank
        return self.expert_group_of(axis, rank).index(rank)

    def embedding_groups(self, split_rank: int | None = None) -> list[list[int]]:
        """Ranks that hold the tied word embeddings: the first and the last stage of each pipeline, and
        with an encoder-decoder split (``split_rank``, Megatron's T5) the decoder's first stage too."""
        if split_rank is not None:
            return [sorted({g[0], g[split_rank], g[-1]}) for g in self.groups("pp")]
        return [[g[0], g[-1]] if len(g) > 1 else [g[0]] for g in self.groups("pp")]


def _check_expert_grid(
    world_size: int, tp: int, cp: int, dp: int, pp: int, ep: int, etp: int, order: str
) -> None:
    """Refuse an expert layout that does not tile each pipeline stage of the dense one.

    Per stage the dense grid has ``tp*cp*dp`` ranks; the expert grid needs ``etp*ep`` to divide it
    (``edp`` is the quotient), i.e. ``etp*ep*pp`` divides the world. The pipeline groups of both grids
    must be the same ranks (true whenever ``pp`` is the slowest axis of ``order``).
    """
    per_stage = tp * cp * dp
    if per_stage % (etp * ep) != 0:
        raise ConfigError(
            f"expert_tensor_parallel_size={etp} x expert_model_parallel_size={ep} = {etp * ep} does not "
            f"divide the {per_stage} ranks of each pipeline stage (world_size={world_size} / "
            f"pipeline_model_parallel_size={pp}; tensor_model_parallel_size={tp} x "
            f"context_parallel_size={cp} x data parallel {dp}): etp x ep x pp must divide world_size"
        )
    if ep == 1 and etp == tp and cp == 1:
        return  # the expert grid is the dense grid renamed
    dense = rank_groups({"tp": tp, "cp": cp, "dp": dp, "pp": pp}, order, "pp")
    expert = rank_groups(
        {"tp": etp, "ep": ep, "dp": per_stage // (etp * ep), "pp": pp}, expert_order(order), "pp"
    )
    if dense != expert:
        raise ConfigError(
            f"parallel_order={order!r} gives different pipeline groups to the dense and the expert grid "
            f"(expert_model_parallel_size={ep}, expert_tensor_parallel_size={etp}); put pp last"
        )
