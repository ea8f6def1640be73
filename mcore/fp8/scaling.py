"""FP8 scaling: the scale a cast uses, the delayed recipe's per-linear state and its step boundary.

Recipes (``--fp8-recipe``, :class:`mcore.fp8.config.Recipe`), as Transformer Engine defines them:

* ``tensorwise`` (current scaling): one scale per tensor from the tensor's own amax,
  ``scale = fp8_max / amax / 2^margin``. Stateless: a recomputed forward quantizes identically.
* ``delayed``: one scale per tensor role (input, weight, output gradient) taken from an amax
  history of earlier steps (``--fp8-amax-history-len``, ``--fp8-amax-compute-algo max|most_recent``).
  During a step the scales stay fixed; every quantization records its amax (a running max, so a
  recomputed forward records nothing new) and :func:`update_fp8_scales` closes the step: it
  all-reduces (max) the recorded amaxes over the amax-reduction group (tensor x data x context
  parallel, as Megatron's ``get_amax_reduction_group(with_context_parallel=True)``), pushes them into the histories and recomputes the
  scales. The histories and scales are saved in checkpoints (:func:`fp8_extra_state`).
* ``rowwise`` (current scaling, one scale per row of each NT operand, i.e. per token for
  activations and per output feature for weights; torchao's rowwise recipe). It needs the
  backend's ``fp8_rowwise`` capability (Hopper's ``torch._scaled_mm`` takes row scales).

A linear's tensors have three roles (:data:`INPUT`, :data:`WEIGHT`, :data:`GRAD_OUTPUT`): the indices
into the delayed state's amax history and scales. The delayed states are saved in checkpoints as
records of kind :data:`FP8_STATE` (:func:`fp8_extra_state`).
"""

from __future__ import annotations

import torch

from mcore.fp8.config import Fp8Config
from mcore.ops import reference
from mcore.tensor_parallel.mappings import all_reduce_in_tensor_model_parallel_group

INPUT, WEIGHT, GRAD_OUTPUT = 0, 1, 2
"""Tensor roles of one FP8 linear (indices into its delayed-scaling state)."""
_ROLE_NAMES = ("input", "weight", "grad_output")


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 format (448 for e4m3fn, 57344 for e5m2)."""
    return float(torch.finfo(dtype).max)


def scale_from_amax(amax: torch.Tensor, dtype: torch.dtype, margin: int) -> torch.Tensor:
    """``fp8_max / amax / 2^margin`` in fp32 (1 where ``amax`` is 0 or not finite), capped at fp32's
    largest value: the scale that maps the largest magnitude onto the format's largest value (the op
    ``fp8_cast`` forms the same scale itself from an ``amax=``)."""
    return reference.fp8_scale_from_amax(amax, dtype, margin)


def _amax(t: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """max |t| (over ``dim`` with keepdim, or all elements): one reduction, no ``|t|`` temporary."""
    if dim is None:
        return torch.linalg.vector_norm(t, float("inf")).float()
    return torch.linalg.vector_norm(t, float("inf"), dim=dim, keepdim=True).float()


class Fp8DelayedState(torch.nn.Module):
    """The delayed recipe's state of one linear: per role (input, weight, grad_output) an amax history
    ``[L, 3]``, the current ``scale [3]`` and the amaxes recorded during this step (``pending_amax``).

    History and scales are buffers (so they move with the module and live on its device) and go into
    checkpoints through :func:`fp8_extra_state`. The recorded amaxes are zero at step boundaries and
    the casts keep the running max of each role's amaxes in its slot (:meth:`amax_record`, passed as
    ``fp8_cast(amax_record=...)`` and written in place: graph- and recompute-safe), in two buffers,
    one per pass that writes them: ``forward_amax [2]`` (input, weight) and ``grad_output_amax [1]``.
    Why two: ``torch.compile`` traces a layer's forward and backward as one joint graph and
    functionalizes the in-place writes; a buffer the forward and the backward both write comes out as
    a forward output that depends on the backward (the partitioner refuses it unless the compiler
    keeps input mutations in the graph), while a buffer written only in the backward is updated
    inside the compiled backward (AOTAutograd's backward input mutations, as torchao's delayed
    scaling kept its output-gradient amax in a buffer of its own).
    """

    def __init__(self, config: Fp8Config, device: torch.device | None = None):
        super().__init__()
        self.config = config
        length = config.fp8_amax_history_len
        self.register_buffer("amax_history", torch.zeros(length, 3, device=device), persistent=False)
        self.register_buffer("scale", torch.ones(3, device=device), persistent=False)
        self.register_buffer("forward_amax", torch.zeros(2, device=device), persistent=False)
        self.register_buffer("grad_output_amax", torch.zeros(1, device=device), persistent=False)

    def amax_record(self, role: int) -> torch.Tensor:
        """The one-element slot (a view) where the casts of ``role`` record their running max amax."""
        if role == GRAD_OUTPUT:
            return self.grad_output_amax
        return self.forward_amax[role : role + 1]

    @property
    def pending_amax(self) -> torch.Tensor:
        """The amaxes recorded this step, ``[3]`` by role (a copy: write through :meth:`amax_record`)."""
        return torch.cat([self.forward_amax, self.grad_output_amax])

    def extra_repr(self) -> str:
        return f"history={self.config.fp8_amax_history_len}, algo={self.config.fp8_amax_compute_algo}"


def delayed_states(modules) -> list[tuple[str, Fp8DelayedState]]:
    """``(qualified name, state)`` of every delayed-scaling state in ``modules`` (an ``nn.Module`` or a
    list of model chunks), in a deterministic order."""
    chunks = modules if isinstance(modules, (list, tuple)) else [modules]
    out = []
    for i, chunk in enumerate(chunks):
        for name, module in chunk.named_modules():
            if isinstance(module, Fp8DelayedState):
                out.append((f"{i}.{name}", module))
    return out


class DelayedScaleUpdate:
    """The delayed recipe's step boundary for one model: reduce the step's amaxes (max) over each
    amax-reduction group (Megatron reduces over tensor x data x context parallel: ``groups.tp`` and
    ``groups.dp_cp``), push them into the histories and recompute the scales.

    Per config the states are updated as one stacked tensor: one collective per group and a dozen
    kernels for all layers of this rank, with no host-device synchronisation. Everything that does not
    change from step to step is built once, on the states' device: the list of states (walking the
    modules costs milliseconds of host time), their row indices per config and the FP8 limits per role.
    Those must not be host tensors copied per step: a pageable host-to-device copy waits for the device
    to drain, and the device then idles while the host refills its queue (~6 ms a step at 24L h2048 on
    an H100). Every rank of a group calls it with the same layers (the ranks of one pipeline stage hold
    the same layers).

    For a stacked history ``H [S, L, 3]`` (S states, L steps, roles input/weight/grad_output), the
    recorded ``pending [S, 3]`` and the previous ``scale [S, 3]``::

        H'    = [pending, H[:, :-1]]                       (newest first)
        amax  = H'[:, 0] (most_recent) or max_l H'[:, l] (max)
        scale = limit / amax  where 0 < amax < inf, else the previous scale
        limit = (fwd_max, fwd_max, bwd_max) / 2**margin
    """

    def __init__(self, model):
        self.model = model
        self.states = [s for _, s in delayed_states(model)]
        by_config: dict[Fp8Config, list[int]] = {}
        for i, s in enumerate(self.states):
            by_config.setdefault(s.config, []).append(i)
        self._groups = []  # (config, its states, their rows of the stacked pending [S, 3] or None, limit [3])
        for config, index in by_config.items():
            device = self.states[index[0]].scale.device
            limit = torch.full((3,), fp8_max(config.fwd_dtype) / 2.0**config.fp8_margin, device=device)
            limit[2] = fp8_max(config.bwd_dtype) / 2.0**config.fp8_margin
            rows = None if len(index) == len(self.states) else torch.tensor(index, device=device)
            self._groups.append((config, [self.states[i] for i in index], rows, limit))

    @torch.no_grad()
    def __call__(self, amax_reduction_groups=()) -> None:
        if not self.states:
            return
        forward = torch.stack([s.forward_amax for s in self.states])  # [S, 2]
        pending = torch.cat([forward, torch.stack([s.grad_output_amax for s in self.states])], dim=1)
        for group in amax_reduction_groups:
            all_reduce_in_tensor_model_parallel_group(pending, group, op="max")
        for config, states, rows, limit in self._groups:
            newest = pending if rows is None else pending.index_select(0, rows)
            history = torch.stack([s.amax_history for s in states])  # [S, L, 3]
            history = torch.cat([newest.unsqueeze(1), history[:, :-1]], dim=1)
            amax = history[:, 0] if config.fp8_amax_compute_algo == "most_recent" else history.amax(1)
            old = torch.stack([s.scale for s in states])
            keep = (amax > 0) & torch.isfinite(amax)
            scale = torch.where(keep, (limit / amax).clamp(max=torch.finfo(torch.float32).max), old)
            torch._foreach_copy_([s.amax_history for s in states], list(history.unbind(0)))
            torch._foreach_copy_([s.scale for s in states], list(scale.unbind(0)))
            torch._foreach_zero_([t for s in states for t in (s.forward_amax, s.grad_output_amax)])


def update_fp8_scales(model, amax_reduction_groups=()) -> None:
    """Close a training step of the delayed recipe (:class:`DelayedScaleUpdate`, built for this one
    call; a training loop builds one and keeps it); a no-op without delayed-scaling layers."""
    DelayedScaleUpdate(model)(amax_reduction_groups)


FP8_STATE = "fp8_state"
"""The checkpoint record kind of FP8 scaling state (beside ``param`` and the optimizer kinds)."""


def fp8_extra_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The checkpointed FP8 state of one model chunk: ``{local name: tensor}`` with names like
    ``decoder.layers.0.mlp.linear_fc1.fp8_state.amax_history`` (``.scale``), for the delayed recipe
    (the tensorwise and rowwise recipes keep no state). Values are replicated over TP and DP."""
    out = {}
    for name, state in module.named_modules():
        if isinstance(state, Fp8DelayedState):
            out[f"{name}.amax_history"] = state.amax_history
            out[f"{name}.scale"] = state.scale
    return out


__all__ = [
    "FP8_STATE",
    "GRAD_OUTPUT",
    "INPUT",
    "WEIGHT",
    "DelayedScaleUpdate",
    "Fp8DelayedState",
    "delayed_states",
    "fp8_extra_state",
    "fp8_max",
    "scale_from_amax",
    "update_fp8_scales",
]
