"""Process groups: initialize torch.distributed through the backend and build every parallel group.

:func:`initialize_parallel` returns a frozen :class:`ProcessGroups` that is passed explicitly to
layers, DDP, the optimizer and the schedules; there are no module-level group globals. With one
process and no launcher it returns :meth:`ProcessGroups.single`, whose groups are all of size 1, and
every collective in mcore is then a no-op.

Launchers: torchrun (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) and
Slurm ``srun`` (``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``; ``MASTER_ADDR`` and
``MASTER_PORT`` must be exported by the batch script, as in Megatron's Slurm examples).
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from mcore.backend import DeviceBackend, current_backend
from mcore.config.fields import ConfigError
from mcore.config.parallel import ParallelConfig
from mcore.distributed.topology import Topology


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, as the launcher described it."""

    rank: int
    world_size: int
    local_rank: int
    launcher: str

    @classmethod
    def from_environ(cls, environ=None) -> LaunchEnv:
        env = os.environ if environ is None else environ
        if "RANK" in env and "WORLD_SIZE" in env:
            return cls(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)), "torchrun")
        if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
            return cls(
                int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0)), "slurm"
            )
        return cls(0, 1, 0, "none")


@dataclass(frozen=True)
class ProcessGroups:
    """Every parallel group of this rank, plus the topology it came from.

    ``tp``/``pp``/``dp``/``cp`` are the groups along one axis; ``mp`` spans tp x pp (one model
    replica: gradient norms are reduced over it); ``dp_cp`` spans dp x cp (gradients are averaged
    over it); ``embedding`` joins the first and last pipeline stage (tied embedding gradients).
    A group is ``None`` when the job is a single process.

    Expert (MoE) groups, from the expert grid of :mod:`mcore.distributed.topology`: ``ep`` (ranks
    holding different experts: the token dispatcher's all-to-all), ``etp`` (ranks splitting one
    expert's weights), ``edp`` (replicas of the same experts: their gradients are averaged and the
    distributed optimizer shards them over it), ``tp_ep`` (etp x ep: the all-gather dispatcher),
    ``expert_mp`` (etp x ep x pp: the experts' part of the gradient norm). Dense-grid groups MoE
    needs: ``tp_cp`` (tp x cp: aux-loss token counts) and ``tp_dp_cp`` (tp x dp x cp: the expert-bias
    token counts and the global aux loss). Groups with the same ranks share one handle.

    ``device`` is the one device this rank computes on: :func:`initialize_parallel` asks the backend
    for it once, from the *local* rank (``--local-rank``, else the launcher's ``LOCAL_RANK`` /
    ``SLURM_LOCALID``), and makes it current. The model, the trainer and the pipeline schedule all
    read it here, so they cannot disagree (a global rank indexes the wrong device on the second node,
    or whenever a node runs fewer processes than it has devices).
    """

    topology: Topology
    tp: dist.ProcessGroup | None = None
    pp: dist.ProcessGroup | None = None
    dp: dist.ProcessGroup | None = None
    cp: dist.ProcessGroup | None = None
    mp: dist.ProcessGroup | None = None
    dp_cp: dist.ProcessGroup | None = None
    embedding: dist.ProcessGroup | None = None
    world: dist.ProcessGroup | None = None
    ep: dist.ProcessGroup | None = None
    etp: dist.ProcessGroup | None = None
    edp: dist.ProcessGroup | None = None
    tp_ep: dist.ProcessGroup | None = None
    tp_cp: dist.ProcessGroup | None = None
    tp_dp_cp: dist.ProcessGroup | None = None
    expert_mp: dist.ProcessGroup | None = None
    pp_ranks: tuple[int, ...] = field(default=(0,))
    embedding_ranks: tuple[int, ...] = field(default=(0,))
    device: torch.device = field(default_factory=lambda: current_backend().device(0))

    @classmethod
    def single(cls, device: torch.device | None = None) -> ProcessGroups:
        """The groups of a one-process job (every size is 1, every collective a no-op), on
        ``device`` (default: the current backend's device of local rank 0)."""
        if device is None:
            return cls(topology=Topology.create(1, 0))
        return cls(topology=Topology.create(1, 0), device=device)

    # sizes and ranks along each axis
    @property
    def rank(self) -> int:
        return self.topology.rank

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def tp_size(self) -> int:
        return self.topology.tp

    @property
    def tp_rank(self) -> int:
        return self.topology.coordinate("tp")

    @property
    def pp_size(self) -> int:
        return self.topology.pp

    @property
    def pp_rank(self) -> int:
        return self.topology.coordinate("pp")

    @property
    def dp_size(self) -> int:
        return self.topology.dp

    @property
    def dp_rank(self) -> int:
        return self.topology.coordinate("dp")

    @property
    def cp_size(self) -> int:
        return self.topology.cp

    @property
    def cp_rank(self) -> int:
        return self.topology.coordinate("cp")

    @property
    def ep_size(self) -> int:
        return self.topology.ep

    @property
    def ep_rank(self) -> int:
        return self.topology.expert_coordinate("ep")

    @property
    def etp_size(self) -> int:
        return self.topology.etp

    @property
    def etp_rank(self) -> int:
        return self.topology.expert_coordinate("etp")

    @property
    def edp_size(self) -> int:
        return self.topology.edp

    @property
    def edp_rank(self) -> int:
        return self.topology.expert_coordinate("edp")

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def next_stage_rank(self) -> int:
        """Global rank of the next pipeline stage (wraps around)."""
        return self.pp_ranks[(self.pp_rank + 1) % self.pp_size]

    @property
    def last_rank(self) -> int:
        """The global rank that logs: the last pipeline stage of the last data-parallel replica."""
        return self.world_size - 1


def _new_groups(
    rank_lists: list[list[int]], rank: int, timeout: timedelta, options
) -> dist.ProcessGroup | None:
    """Create every group along one axis (all ranks must create all groups, in the same order)."""
    mine = None
    for ranks in rank_lists:
        group = dist.new_group(ranks=ranks, timeout=timeout, pg_options=options)
        if rank in ranks:
            mine = group
    return mine


def initialize_parallel(
    config: ParallelConfig, backend: DeviceBackend | None = None, init_method: str = "env://"
) -> ProcessGroups:
    """Initialize torch.distributed (if the launcher started several processes) and build the groups.

    Args:
        config: the layout (tp, pp, cp sizes, rank order, timeout).
        backend: the device backend; its ``dist_backend`` names the torch.distributed backend and its
            plugins may supply process-group options (``mcore_process_group_options``).
        init_method: torch.distributed rendezvous (``env://`` reads MASTER_ADDR/MASTER_PORT).

    Raises:
        ConfigError: the layout does not tile the world size (the message names every factor).
    """
    from mcore.plugins.manager import plugin_manager

    backend = backend or current_backend()
    launch = LaunchEnv.from_environ()
    world_size = dist.get_world_size() if dist.is_initialized() else launch.world_size
    rank = dist.get_rank() if dist.is_initialized() else launch.rank
    topology = Topology.create(
        world_size,
        rank,
        tp=config.tensor_model_parallel_size,
        pp=config.pipeline_model_parallel_size,
        cp=config.context_parallel_size,
        order=config.parallel_order,
        ep=config.expert_model_parallel_size,
        etp=config.expert_tensor_parallel_size,
    )
    # The one place the device is derived (ProcessGroups.device): from the local rank, never the
    # global one, and made current before any process group or parameter is created.
    local_rank = config.local_rank if config.local_rank is not None else launch.local_rank
    device = backend.device(local_rank)
    backend.set_device(local_rank)
    if world_size == 1 and not dist.is_initialized():
        return ProcessGroups(topology=topology, device=device)

    timeout = timedelta(minutes=config.distributed_timeout_minutes)
    pm = plugin_manager()

    def options(axis: str):
        return pm.hook.mcore_process_group_options(backend=backend, axis=axis)

    _init_process_group(backend, launch, init_method, rank, world_size, timeout, options)
    return _build_groups(topology, config.pipeline_model_parallel_split_rank, rank, timeout, options, device)


def _init_process_group(
    backend: DeviceBackend, launch: LaunchEnv, init_method: str, rank: int, world_size: int, timeout, options
) -> None:
    """``torch.distributed.init_process_group`` with the backend's ``dist_backend`` (checked against
    an already initialized one instead).

    Raises:
        ConfigError: Slurm without ``MASTER_ADDR``, or torch.distributed initialized with another
            backend.
    """
    if not dist.is_initialized():
        if launch.launcher == "slurm" and "MASTER_ADDR" not in os.environ:
            raise ConfigError(
                "running under Slurm with several tasks needs MASTER_ADDR and MASTER_PORT "
                "exported by the batch script"
            )
        dist.init_process_group(
            backend=backend.dist_backend,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            pg_options=options("world"),
        )
    elif dist.get_backend() != backend.dist_backend:
        raise ConfigError(
            f"torch.distributed is already initialized with {dist.get_backend()!r}, but "
            f"backend {backend.name!r} needs {backend.dist_backend!r}"
        )


def _build_groups(
    topology: Topology, split_rank: int | None, rank: int, timeout, options, device
) -> ProcessGroups:
    """Every process group of ``topology`` (collective: each rank creates every group, in order)."""

    made: dict[tuple, dist.ProcessGroup | None] = {}

    def new(rank_lists: list[list[int]], axis_name: str):
        # The same rank lists (e.g. etp == tp when ep=1) reuse one handle: fewer groups to create.
        key = tuple(tuple(r) for r in rank_lists)
        if key not in made:
            made[key] = _new_groups(rank_lists, rank, timeout, options(axis_name))
        return made[key]

    def build(axes: str, axis_name: str):
        # The dense groups are created as before (one handle each); the MoE groups below reuse them.
        rank_lists = topology.groups(axes)
        made[tuple(tuple(r) for r in rank_lists)] = group = _new_groups(
            rank_lists, rank, timeout, options(axis_name)
        )
        return group

    def build_expert(axes: str, axis_name: str):
        return new(topology.expert_groups(axes), axis_name)

    embedding_lists = topology.embedding_groups(split_rank)
    return ProcessGroups(
        topology=topology,
        tp=build("tp", "tp"),
        pp=build("pp", "pp"),
        dp=build("dp", "dp"),
        cp=build("cp", "cp"),
        mp=build("tp-pp", "mp"),
        dp_cp=build("cp-dp", "dp"),
        tp_cp=new(topology.groups("tp-cp"), "tp"),
        tp_dp_cp=new(topology.groups("tp-cp-dp"), "dp"),
        ep=build_expert("ep", "ep"),
        etp=build_expert("etp", "tp"),
        edp=build_expert("edp", "dp"),
        tp_ep=build_expert("etp-ep", "ep"),
        expert_mp=build_expert("etp-ep-pp", "mp"),
        embedding=_new_groups(embedding_lists, rank, timeout, options("embedding")),
        world=dist.group.WORLD,
        pp_ranks=tuple(topology.group_of("pp")),
        embedding_ranks=tuple(next(g for g in embedding_lists if topology.group_of("pp")[0] in g)),
        device=device,
    )


def destroy_parallel() -> None:
    """Tell plugins the run is over, tear down torch.distributed and end its communication threads.

    Callers first drop their own references to :class:`ProcessGroups` and to what holds group handles
    (models, DDP wrappers, optimizers). Why: ``destroy_process_group`` forgets the groups, but a gloo
    group's worker threads live until its last Python handle is freed. Left to interpreter shutdown,
    a worker still releasing the tensors of a finished collective needs the GIL while the interpreter
    is being torn down, and the process aborts ("terminate called without an active exception",
    pytorch/pytorch#179291). The collection below frees handles held in reference cycles while the
    interpreter is whole; a handle's destructor releases the GIL while it joins its workers.
    """
    from mcore.plugins.manager import plugin_manager

    plugin_manager().hook.mcore_on_shutdown(backend=current_backend())
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
