"""Logical tensors, their tensor-parallel shards, and initialization that does not depend on the layout.

Every parameter of an mcore model is a *shard* of a *logical tensor*: the unsharded tensor a TP=1,
PP=1 model would hold, named with global layer numbers (``decoder.layers.7.mlp.linear_fc1.weight``).
Two small records describe the relation:

* :class:`ParamLayout`, attached by the layer that creates the parameter as ``param.shard_layout``:
  the logical (global) shape, the TP partition dim, how the local slice is cut, which init to use.
* :class:`ShardSpec`, built by the model (``model.sharded_parameters()``) from the layout plus the
  logical name and this rank's TP coordinates: everything a checkpoint (resharding) or a Hugging Face
  exporter needs to place the local tensor inside the logical one, or to cut it out.

How a local shard is cut (``p`` = TP size, ``t`` = TP rank, ``d`` = ``partition_dim``, ``G`` =
``global_shape[d]``):

* ``partition_dim=None``: replicated; every TP rank holds the whole logical tensor
  (norm weights, position embeddings, row-parallel biases).
* ``partition_dim=d, num_stacked=1``: rank ``t`` holds the contiguous block
  ``[t*G/p, (t+1)*G/p)`` of dim ``d`` (column-parallel weights/biases and the vocabulary: dim 0;
  row-parallel weights: dim 1). Merging shards = ``cat`` in rank order.
* ``num_stacked=k``: the logical tensor is ``k`` equal sub-tensors concatenated along ``d`` and each
  is split separately; rank ``t`` holds ``[sub_0 block t; sub_1 block t; ...]``. The SwiGLU
  ``linear_fc1`` is ``k=2``: logical ``[gate; up]`` (``[2F, h]``), local ``[gate_t; up_t]``
  (``[2F/p, h]``). Naive ``cat`` of such shards is wrong; use :meth:`ShardSpec.merge`.
* ``vocab_padded=True``: dim 0 is the padded vocabulary ``Vp`` (see
  :func:`mcore.models.transformer.model_config.padded_vocab_size`). ``Vp`` is a multiple of
  ``make_vocab_size_divisible_by * p``, so it can change with the TP size; rows ``>= V`` (the
  tokenizer's size) are padding that a resharding loader re-pads and an exporter drops.

Routed experts (MoE): ``expert_dim=e`` says dim ``e`` of the logical tensor is the global expert
index, split over the ``ep`` expert-parallel ranks in contiguous blocks (ep rank ``r`` of size ``q``
holds experts ``[r*E/q, (r+1)*E/q)``), and ``partition_dim`` is split over the *expert* tensor-parallel
ranks (etp), not tp: for such a layout every ``tp_rank``/``tp_size`` below means the etp coordinate.
Example: SwiGLU experts' fc1, logical ``[E, 2F, H]`` with ``expert_dim=0, partition_dim=1,
num_stacked=2``, local ``[E/ep, 2F/etp, H]``. Each expert is drawn from its own generator seeded by
``(seed, name, expert index)``, so an ep rank draws only its experts and any ep/etp equals ep=1.

Initialization: each logical tensor is drawn whole, in fp32, from a generator on the model's device
seeded by ``(seed, logical name)`` (:func:`tensor_seed`); each rank keeps its slice
(:meth:`ShardSpec.shard`). Padded-vocabulary tensors are drawn in fixed blocks of
:data:`VOCAB_INIT_BLOCK_ROWS` rows, each seeded by ``(seed, name, block)``, so that row ``i`` does not
depend on ``Vp`` (and a rank draws only the blocks it keeps). So the same seed gives the same weights
at any TP and PP size. Dropout, in contrast, uses the TP-aware RNG tracker
(:mod:`mcore.tensor_parallel.random`).
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

VOCAB_INIT_BLOCK_ROWS = 128
"""Rows per independently seeded block of a padded-vocabulary tensor (see the module docstring)."""


# -- init methods (picklable callables: ``init(tensor, generator)`` fills ``tensor`` in place) -------


@dataclass(frozen=True)
class NormalInit:
    """``N(0, std^2)``: Megatron's ``init_method_normal(std)``."""

    std: float

    def __call__(self, tensor: torch.Tensor, generator: torch.Generator) -> None:
        tensor.normal_(0.0, self.std, generator=generator)


@dataclass(frozen=True)
class ConstantInit:
    """A constant: 0 for biases, 1 for norm weights."""

    value: float = 0.0

    def __call__(self, tensor: torch.Tensor, generator: torch.Generator) -> None:
        tensor.fill_(self.value)


def init_method_normal(std: float) -> NormalInit:
    """Weights of input-side projections and embeddings: ``N(0, std^2)``."""
    return NormalInit(std)


def scaled_init_method_normal(std: float, num_layers: int) -> NormalInit:
    """Output projections (``linear_proj``, ``linear_fc2``): ``N(0, (std / sqrt(2 * num_layers))^2)``.

    Megatron's scaled init: each layer adds two residual branches, so the scaled std keeps the
    variance of the residual stream independent of depth (GPT-2 paper, section 2.3).
    """
    return NormalInit(std / math.sqrt(2.0 * num_layers))


ZEROS = ConstantInit(0.0)
ONES = ConstantInit(1.0)

InitMethod = Callable[[torch.Tensor, torch.Generator], None]


# -- layouts and specs ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParamLayout:
    """What the layer that owns a parameter knows about it; attached as ``param.shard_layout``.

    Attributes:
        global_shape: shape of the logical (unsharded) tensor.
        partition_dim: dim split over the TP ranks, or ``None`` if replicated.
        num_stacked: number of equal sub-tensors stacked along ``partition_dim``, each split over TP
            (2 for the SwiGLU ``[gate; up]`` fc1; 1 otherwise).
        vocab_padded: dim 0 is the padded vocabulary.
        sequence_parallel: with sequence parallelism this replicated parameter is applied to one
            sequence shard per rank, so its gradient must be summed over TP
            (:func:`mcore.tensor_parallel.mappings.all_reduce_sequence_parallel_grads`).
        init: fills the logical tensor (``init(tensor, generator)``).
        logical_name: the logical name when it is not the parameter's own name: the last pipeline
            stage's copy of a tied word embedding says ``"embedding.word_embeddings.weight"``.
        expert_dim: the global-expert dim of a routed expert's weight (split over ep; then
            ``partition_dim`` is split over etp), or ``None`` for every other parameter.
    """

    global_shape: tuple[int, ...]
    partition_dim: int | None = None
    num_stacked: int = 1
    vocab_padded: bool = False
    sequence_parallel: bool = False
    init: InitMethod = ZEROS
    logical_name: str | None = None
    expert_dim: int | None = None

    def local_shape(self, tp_size: int, ep_size: int = 1) -> tuple[int, ...]:
        """This rank's shape; ``tp_size`` is the etp size for an expert layout."""
        shape = list(self.global_shape)
        if self.expert_dim is not None:
            if shape[self.expert_dim] % ep_size:
                raise ValueError(
                    f"{shape[self.expert_dim]} experts (dim {self.expert_dim}) do not split over "
                    f"expert_model_parallel_size={ep_size}"
                )
            shape[self.expert_dim] //= ep_size
        if self.partition_dim is None:
            return tuple(shape)
        d = self.partition_dim
        if shape[d] % (self.num_stacked * tp_size):
            raise ValueError(
                f"dim {d} of size {shape[d]} ({self.num_stacked} stacked parts) does not split over "
                f"tensor_model_parallel_size={tp_size}"
            )
        shape[d] //= tp_size
        return tuple(shape)


def make_parameter(
    layout: ParamLayout, tp_size: int, *, dtype: torch.dtype, device: torch.device | None, ep_size: int = 1
) -> torch.nn.Parameter:
    """An uninitialized parameter of this rank's shape, carrying ``layout`` as ``shard_layout``.

    For an expert layout (``expert_dim`` set) pass the etp size as ``tp_size`` and the ep size as
    ``ep_size``; the parameter is marked ``expert_parallel = True``.
    Values are written by :func:`initialize_parameters` (the model does it in its constructor).
    """
    shape = layout.local_shape(tp_size, ep_size)
    param = torch.nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
    param.shard_layout = layout
    if layout.expert_dim is not None:
        param.expert_parallel = True
    return param


_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.")


@dataclass(frozen=True)
class ShardSpec:
    """Where one local parameter sits inside its logical tensor.

    Attributes:
        name: logical name with global layer numbers (``decoder.layers.{i}.self_attention...``);
            stable across TP/PP layouts; the checkpoint key.
        local_name: the parameter's name in this module's ``named_parameters()`` (stage-local layer
            numbers; ``output_layer.weight`` for a tied copy).
        global_shape: shape of the logical tensor (for ``vocab_padded`` tensors dim 0 is this
            layout's padded vocabulary).
        partition_dim, num_stacked, vocab_padded, sequence_parallel: see :class:`ParamLayout`.
        tp_rank, tp_size: this rank's coordinates in the tensor-parallel group.
        tied_copy: this parameter is a copy of the logical tensor ``name`` held on another pipeline
            stage too (the last stage's output layer with tied embeddings). Its gradient is summed
            with the original's over ``groups.embedding``; a checkpoint saves the original only.
        expert_dim, ep_rank, ep_size: a routed expert's weight: ``expert_dim`` of ``global_shape``
            counts every expert; this rank holds the block :meth:`expert_range`. ``tp_rank``/
            ``tp_size`` are then the expert tensor-parallel coordinates.
    """

    name: str
    local_name: str
    global_shape: tuple[int, ...]
    partition_dim: int | None
    tp_rank: int = 0
    tp_size: int = 1
    num_stacked: int = 1
    vocab_padded: bool = False
    sequence_parallel: bool = False
    tied_copy: bool = False
    expert_dim: int | None = None
    ep_rank: int = 0
    ep_size: int = 1

    @classmethod
    def from_layout(
        cls,
        layout: ParamLayout,
        local_name: str,
        name: str,
        tp_rank: int,
        tp_size: int,
        ep_rank: int = 0,
        ep_size: int = 1,
    ) -> ShardSpec:
        expert = layout.expert_dim is not None
        return cls(
            name=layout.logical_name or name,
            local_name=local_name,
            global_shape=tuple(layout.global_shape),
            partition_dim=layout.partition_dim,
            tp_rank=tp_rank,
            tp_size=tp_size,
            num_stacked=layout.num_stacked,
            vocab_padded=layout.vocab_padded,
            sequence_parallel=layout.sequence_parallel,
            tied_copy=layout.logical_name is not None,
            expert_dim=layout.expert_dim,
            ep_rank=ep_rank if expert else 0,
            ep_size=ep_size if expert else 1,
        )

    @property
    def is_expert(self) -> bool:
        return self.expert_dim is not None

    @property
    def num_experts(self) -> int | None:
        """Global expert count of an expert tensor (``None`` otherwise)."""
        return None if self.expert_dim is None else self.global_shape[self.expert_dim]

    def expert_range(self) -> tuple[int, int]:
        """``(first global expert, count)`` held by this ep rank."""
        if self.expert_dim is None:
            return (0, 1)
        local = self.global_shape[self.expert_dim] // self.ep_size
        return (self.ep_rank * local, local)

    @property
    def ep_global_shape(self) -> tuple[int, ...]:
        """The shape of this ep rank's block of experts, unsplit over etp (the logical shape for a
        non-expert tensor): what :meth:`merge` returns."""
        shape = list(self.global_shape)
        if self.expert_dim is not None:
            shape[self.expert_dim] //= self.ep_size
        return tuple(shape)

    @property
    def local_shape(self) -> tuple[int, ...]:
        shape = list(self.ep_global_shape)
        if self.partition_dim is not None:
            shape[self.partition_dim] //= self.tp_size
        return tuple(shape)

    @property
    def layer_number(self) -> int | None:
        """Global 0-based transformer-layer index for ``decoder.layers.{i}.*`` tensors, else None."""
        match = _LAYER_RE.match(self.name)
        return int(match.group(1)) if match else None

    @property
    def is_main_replica(self) -> bool:
        """True on exactly one rank of each TP group per logical element: save/count it here."""
        return not self.tied_copy and (self.partition_dim is not None or self.tp_rank == 0)

    def chunks(self) -> list[tuple[int, int, int]]:
        """``(local_offset, global_offset, length)`` along ``partition_dim``, in local order.

        One chunk for plain column/row/vocab splits, ``num_stacked`` chunks for stacked tensors;
        ``[(0, 0, size)]`` for a replicated tensor (along dim 0).
        """
        if self.partition_dim is None:
            return [(0, 0, self.global_shape[0] if self.global_shape else 1)]
        sub = self.global_shape[self.partition_dim] // self.num_stacked
        piece = sub // self.tp_size
        return [(k * piece, k * sub + self.tp_rank * piece, piece) for k in range(self.num_stacked)]

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's local tensor, cut from the logical tensor ``full``."""
        if tuple(full.shape) != tuple(self.global_shape):
            raise ValueError(
                f"{self.name}: logical tensor has shape {tuple(full.shape)}, expected {self.global_shape}"
            )
        if self.expert_dim is not None:
            full = full.narrow(self.expert_dim, *self.expert_range())
        if self.partition_dim is None:
            return full
        d = self.partition_dim
        parts = [full.narrow(d, start, length) for _, start, length in self.chunks()]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=d)

    def merge(self, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        """The logical tensor from every TP rank's local tensor, given in TP-rank order (for an expert
        tensor: this ep rank's block of experts, :attr:`ep_global_shape`, from the etp ranks' shards;
        blocks of successive ep ranks concatenate along ``expert_dim``)."""
        if len(shards) != self.tp_size:
            raise ValueError(
                f"{self.name}: got {len(shards)} shards for tensor_model_parallel_size={self.tp_size}"
            )
        if self.partition_dim is None:
            return shards[0]
        d = self.partition_dim
        piece = self.local_shape[d] // self.num_stacked
        subs = [
            torch.cat([s.narrow(d, k * piece, piece) for s in shards], dim=d) for k in range(self.num_stacked)
        ]
        return subs[0] if len(subs) == 1 else torch.cat(subs, dim=d)

    def for_rank(self, tp_rank: int, ep_rank: int | None = None) -> ShardSpec:
        """The same logical tensor's spec on another TP (etp) rank, and ep rank for an expert tensor."""
        if ep_rank is None or self.expert_dim is None:
            return replace(self, tp_rank=tp_rank)
        return replace(self, tp_rank=tp_rank, ep_rank=ep_rank)

    def single_expert(self, expert: int) -> ShardSpec:
        """The spec of one global expert's slice (expert dim of size 1, not split over ep): what
        initialization draws per expert."""
        shape = list(self.global_shape)
        shape[self.expert_dim] = 1
        return replace(
            self, name=f"{self.name}:expert{expert}", global_shape=tuple(shape), ep_rank=0, ep_size=1
        )


def build_shard_specs(
    module: torch.nn.Module,
    tp_rank: int,
    tp_size: int,
    logical_name: Callable[[str], str] = lambda local_name: local_name,
    *,
    ep_rank: int = 0,
    ep_size: int = 1,
    etp_rank: int | None = None,
    etp_size: int | None = None,
) -> dict[str, ShardSpec]:
    """A :class:`ShardSpec` for every parameter of ``module``, keyed by local parameter name.

    Expert layouts take the ep coordinates and the etp ones (``None``: the tp ones), e.g.
    ``ep_rank=groups.ep_rank, ep_size=groups.ep_size, etp_rank=groups.etp_rank, etp_size=groups.etp_size``.

    Raises:
        TypeError: a parameter carries no ``shard_layout`` (every mcore layer attaches one).
    """
    etp_rank = tp_rank if etp_rank is None else etp_rank
    etp_size = tp_size if etp_size is None else etp_size
    specs = {}
    for local_name, param in module.named_parameters():
        layout = getattr(param, "shard_layout", None)
        if layout is None:
            raise TypeError(f"parameter {local_name!r} has no shard_layout; create it with make_parameter()")
        if layout.expert_dim is None:
            specs[local_name] = ShardSpec.from_layout(
                layout, local_name, logical_name(local_name), tp_rank, tp_size
            )
        else:
            specs[local_name] = ShardSpec.from_layout(
                layout, local_name, logical_name(local_name), etp_rank, etp_size, ep_rank, ep_size
            )
    return specs


# -- layout-independent initialization -------------------------------------------------------------


def tensor_seed(seed: int, name: str, block: int | None = None) -> int:
    """A 63-bit generator seed from the run seed and a logical tensor name (and a row-block index)."""
    key = f"{seed}:{name}" if block is None else f"{seed}:{name}:{block}"
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") & ((1 << 63) - 1)


def _generator(device: torch.device, seed: int) -> torch.Generator:
    try:
        generator = torch.Generator(device=device)
    except RuntimeError:  # a device without generator objects: draw on the host, then copy
        generator = torch.Generator()
    generator.manual_seed(seed)
    return generator


def _draw(shape: Sequence[int], init: InitMethod, seed: int, device: torch.device) -> torch.Tensor:
    generator = _generator(device, seed)
    tensor = torch.empty(tuple(shape), dtype=torch.float32, device=generator.device)
    init(tensor, generator)
    return tensor.to(device)


def draw_local_shard(spec: ShardSpec, init: InitMethod, seed: int, device: torch.device) -> torch.Tensor:
    """This rank's slice (fp32) of the logical tensor ``spec.name`` drawn from ``seed``."""
    if spec.expert_dim is not None:
        # One generator per global expert, seeded by (seed, name, expert): independent of ep/etp.
        first, count = spec.expert_range()
        pieces = []
        for expert in range(first, first + count):
            one = spec.single_expert(expert)
            pieces.append(
                one.shard(_draw(one.global_shape, init, tensor_seed(seed, spec.name, expert), device))
            )
        return torch.cat(pieces, dim=spec.expert_dim)
    if not spec.vocab_padded:
        return spec.shard(_draw(spec.global_shape, init, tensor_seed(seed, spec.name), device))
    block, rest = VOCAB_INIT_BLOCK_ROWS, tuple(spec.global_shape[1:])
    if spec.partition_dim not in (0, None):
        raise ValueError(f"{spec.name}: a padded vocabulary must be split along dim 0")
    pieces = []
    for _, start, length in spec.chunks() if spec.partition_dim == 0 else [(0, 0, spec.global_shape[0])]:
        first, last = start // block, (start + length - 1) // block
        rows = torch.cat(
            [
                _draw((block, *rest), init, tensor_seed(seed, spec.name, j), device)
                for j in range(first, last + 1)
            ]
        )
        pieces.append(rows[start - first * block : start - first * block + length])
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


@torch.no_grad()
def initialize_parameters(module: torch.nn.Module, specs: dict[str, ShardSpec], seed: int) -> None:
    """Fill every parameter named in ``specs`` from its logical tensor drawn with ``seed``."""
    params = dict(module.named_parameters())
    for local_name, spec in specs.items():
        param = params[local_name]
        local = draw_local_shard(spec, param.shard_layout.init, seed, param.device)
        param.copy_(local)
