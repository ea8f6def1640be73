"""Megatron-LM's Adam state in ``--ckpt-format torch`` checkpoints, as optimizer records of mcore's
logical tensors (kinds ``exp_avg``, ``exp_avg_sq``, ``main_param``, with the Adam ``step``).

Each optimizer tensor of a TP rank's parameter gets the placement of that parameter's weight record
(:mod:`.read_torch`), so the loader reshards the moments exactly as it reshards the weights (QKV
groups, SwiGLU ``[gate_t; up_t]``, padded vocabulary) into any TP/PP/DP layout, for mcore's per-param
and distributed optimizers alike. Two layouts are read:

* without the distributed optimizer, ``model_optim_rng.pt["optimizer"]``: torch's Adam ``state_dict``
  (``state[i] = {step, exp_avg, exp_avg_sq}``, ``param_groups[g]["params"]`` the indices ``i``),
  wrapped for bf16/fp16 runs as ``{"optimizer": ..., "fp32_from_fp16_params": [[main, ...], ...],
  "grad_scaler": ...}``. Index ``i`` is the parameter's position in its group: Megatron builds the
  groups from ``named_parameters()`` order (the ``model`` state dict's order) with the default
  weight-decay rule (biases and 1-D parameters in the no-decay group), which is checked against every
  tensor's shape;
* with ``--use-distributed-optimizer``, ``mp_rank_*/distrib_optim.pt`` (megatron-core's
  ``get_parameter_state_dp_zero``: all DP shards gathered): per model chunk, per ``(param_dtype,
  grad_dtype)``, flat fp32 ``param`` / ``exp_avg`` / ``exp_avg_sq`` over the grad buffer with the
  padding at bucket ends removed (``buckets_coalesced``). The parameter offsets follow
  ``_ParamAndGradBuffer``: parameters in reverse ``named_parameters()`` order, each starting at a
  multiple of 64 elements, a new bucket after ``bucket_size`` elements (``--overlap-grad-reduce``;
  ``--ddp-bucket-size``, default ``max(4e7, 1e6 * dp)``; one bucket on later pipeline stages), and
  the tied embedding copies of a pipelined model in their own bucket. The Adam ``step`` is the
  ``param_groups``' ``step`` in ``model_optim_rng.pt``.

A mixture-of-experts model's state is a chained pair (dense, experts; the experts' from every EP
rank's file), in both layouts: with the distributed optimizer ``distrib_optim.pt`` holds the list
``[dense, experts]`` of the two DistributedOptimizers' buffers (:func:`distributed_optimizer_records`).
What cannot be mapped (SGD, extra parameter groups such as ``--decoupled-lr``, chained optimizers of
several model chunks, a missing ``distrib_optim.pt``, a buffer size that disagrees with the
parameters) becomes one error line naming the file, raised only when a run asks for the optimizer
state.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mcore.checkpoint.format import CheckpointError

DISTRIB_OPTIM = "distrib_optim.pt"
OPTIM_KINDS = ("exp_avg", "exp_avg_sq")


@dataclass
class RankParam:
    """One parameter of a rank file, in ``named_parameters()`` order."""

    key: str  # the Megatron state-dict key
    shape: tuple[int, ...]
    record: dict | None  # its weight record; None for the tied output copy (no mcore tensor)


def _no_weight_decay(key: str, shape: tuple[int, ...]) -> bool:
    """Megatron's default rule (``_get_param_groups``): biases and 1-D parameters get no decay."""
    return key.endswith(".bias") or len(shape) == 1


def _optim_record(weight: dict, kind: str, where: list, step: int) -> dict:
    rec = {k: v for k, v in weight.items() if k not in ("kind", "key", "file")}
    rec.update(kind=kind, file=where[0], key=f"{weight['key']}/{kind}", where=where[1:], step=int(step))
    rec["dtype"] = "float32"
    return rec


def _step_value(value: Any) -> int:
    return int(value.item()) if isinstance(value, torch.Tensor) else int(value)


def is_expert_key(key: str) -> bool:
    """A routed expert's Megatron key (``mlp.experts.*``; the shared expert is a dense parameter)."""
    return ".mlp.experts." in key


def torch_optimizer_records(
    path: Path, fname: str, data: dict, params: list[RankParam], experts_only: bool = False
) -> list[dict]:
    """Records of the non-distributed optimizer state in one ``model_optim_rng.pt`` (``fname``).

    A mixture-of-experts model's state is megatron-core's ``ChainedOptimizer`` list: ``[dense, experts]``,
    the dense parameters' optimizer and the routed experts' (``is_expert_parallel`` groups), each a
    plain optimizer state over its own parameters in ``named_parameters()`` order. ``experts_only``:
    the file of an EP rank > 0, whose dense state replicates EP rank 0's (only its experts are read).
    """
    saved = data.get("optimizer")
    if isinstance(saved, list):
        expert = [p for p in params if is_expert_key(p.key)]
        if len(saved) != 2 or not expert:
            raise CheckpointError(
                f"{path}: {len(saved)} chained optimizers (several model chunks?): only the [dense, experts] "
                "pair of a mixture-of-experts model is read"
            )
        dense = [] if experts_only else [p for p in params if not is_expert_key(p.key)]
        records = _adam_records(path, fname, saved[0], dense, ["chain", 0]) if dense else []
        return records + _adam_records(path, fname, saved[1], expert, ["chain", 1])
    return _adam_records(path, fname, saved, params, [])


def _adam_records(path: Path, fname: str, saved: Any, params: list[RankParam], chain: list) -> list[dict]:
    """Records of one torch Adam state (``saved``, possibly wrapped with the fp32 masters) over
    ``params``; ``chain`` prefixes the records' ``where`` (``["chain", c]``: the c-th chained one)."""
    if not isinstance(saved, dict):
        raise CheckpointError(f"{path}: no optimizer state (saved with --no-save-optim)")
    inner = saved.get("optimizer") if "state" not in saved else saved
    if not isinstance(inner, dict) or "state" not in inner or "param_groups" not in inner:
        raise CheckpointError(
            f"{path}: 'optimizer' holds no torch optimizer state_dict (state, param_groups)"
        )
    masters = saved.get("fp32_from_fp16_params")
    groups = inner["param_groups"]
    state = inner["state"]
    kinds = [(p, _no_weight_decay(p.key, p.shape)) for p in params]
    records = []
    taken = 0
    for g, group in enumerate(groups):
        indices = list(group["params"])
        if not indices:
            continue
        first = state.get(indices[0], {}).get("exp_avg")
        if first is None:
            raise CheckpointError(
                f"{path}: optimizer state index {indices[0]} has no exp_avg (not Adam, or never stepped)"
            )
        no_wd = first.dim() == 1
        members = [p for p, nwd in kinds if nwd == no_wd]
        if len(members) != len(indices):
            raise CheckpointError(
                f"{path}: optimizer parameter group {g} holds {len(indices)} parameters, Megatron's "
                f"default {'no-' if no_wd else ''}weight-decay group of this model has {len(members)} "
                "(other parameter groups, e.g. --decoupled-lr, are not read)"
            )
        taken += len(indices)
        for j, (index, param) in enumerate(zip(indices, members)):
            entry = state.get(index)
            if entry is None or any(k not in entry for k in OPTIM_KINDS):
                raise CheckpointError(
                    f"{path}: optimizer state index {index} ({param.key}) has no Adam moments"
                )
            for kind in OPTIM_KINDS:
                if tuple(entry[kind].shape) != param.shape:
                    raise CheckpointError(
                        f"{path}: optimizer state index {index} {kind} has shape {list(entry[kind].shape)}, "
                        f"parameter {param.key} (in Megatron's group order) has {list(param.shape)}"
                    )
            if param.record is None:
                continue
            step = _step_value(entry["step"] if "step" in entry else group.get("step", 0))
            for kind in OPTIM_KINDS:
                records.append(_optim_record(param.record, kind, [fname, *chain, "state", index, kind], step))
            if masters is not None:
                records.append(_optim_record(param.record, "main_param", [fname, *chain, "fp32", g, j], step))
    if taken != len(params):
        raise CheckpointError(
            f"{path}: the optimizer's parameter groups hold {taken} parameters, the model {len(params)}"
        )
    return records


def bucket_offsets(
    params: list[RankParam], bucket_size: int | None, shared_embedding: set[str]
) -> tuple[dict[str, int], list[int]]:
    """Each parameter's offset in the coalesced (bucket-end padding removed) flat buffer of
    ``distrib_optim.pt``, and the unpadded length of each bucket (their sum: the buffer's length), as
    ``_ParamAndGradBuffer`` lays them out with the distributed optimizer."""
    offsets: dict[str, int] = {}
    lengths: list[int] = []
    done = 0  # unpadded elements of the closed buckets
    start = 0  # the open bucket's next free element, relative to its start
    members = 0

    def pad64(n: int) -> int:
        return -(-n // 64) * 64

    for p in reversed(params):
        numel = 1
        for s in p.shape:
            numel *= s
        own_bucket = p.key in shared_embedding
        begin = pad64(start)
        if own_bucket and members:
            lengths.append(start)
            done, start, members, begin = done + start, 0, 0, 0
        offsets[p.key] = done + begin
        start, members = begin + numel, members + 1
        if (bucket_size is not None and start >= bucket_size) or own_bucket:
            lengths.append(start)
            done, start, members = done + start, 0, 0
    return offsets, lengths + ([start] if members else [])


def grad_buffer_layout(
    params: list[RankParam], args: Any, pp_rank: int
) -> tuple[dict[str, int], list[int], int | None]:
    """:func:`bucket_offsets` of one (TP, PP) rank's parameters with the bucket size and the tied
    embedding buckets Megatron-LM's ``args`` imply; also returns that bucket size (None: one bucket)."""
    dp = int(getattr(args, "data_parallel_size", 1) or 1) * int(
        getattr(args, "context_parallel_size", 1) or 1
    )
    bucket_size = None
    if getattr(args, "overlap_grad_reduce", False) and pp_rank == 0:
        bucket_size = getattr(args, "ddp_bucket_size", None) or max(40000000, 1000000 * dp)
    tied = not bool(getattr(args, "untie_embeddings_and_output_weights", False))
    pp = int(getattr(args, "pipeline_model_parallel_size", 1))
    shared = set()
    if tied and pp > 1:
        shared = {p.key for p in params if p.key.endswith(("word_embeddings.weight", "output_layer.weight"))}
    offsets, lengths = bucket_offsets(params, bucket_size, shared)
    return offsets, lengths, bucket_size


def distributed_optimizer_records(
    path: Path, fname: str, data: dict, params: list[RankParam], args: Any, pp_rank: int, expert_rank: int = 0
) -> list[dict]:
    """Records of one ``distrib_optim.pt`` (``fname``) whose parameters are ``params``; ``data`` is
    the ``model_optim_rng.pt`` beside it (the Adam step of its ``param_groups``).

    A mixture-of-experts model's file holds megatron-core's ``ChainedOptimizer.save_parameter_state``
    list ``[dense, experts]``: one DistributedOptimizer per grad-buffer group, the dense parameters'
    buffer (gathered over the data-parallel group) and the routed experts' (``expert_parallel_buffers``,
    gathered over the expert-data-parallel group), each the one-buffer layout below over its own
    parameters in ``named_parameters()`` order; ``None`` where the saving rank was not DP rank 0 of that
    group (the dense state of EP ranks > 0, ``expert_rank``: only their experts are read)."""
    from mcore.checkpoint.megatron.unpickle import load_megatron_file

    if not path.is_file():
        raise CheckpointError(
            f"{path} is missing: the args say --use-distributed-optimizer, whose Adam state Megatron "
            "writes there (load with --no-load-optim for the weights only)"
        )
    saved = data.get("optimizer")
    chained = isinstance(saved, list)
    heads = saved if chained else [saved]
    groups = [
        g
        for head in heads
        if isinstance(head, dict)
        for g in head.get("optimizer", {}).get("param_groups", [])
    ]
    steps = {_step_value(g["step"]) for g in groups if g.get("step") is not None}
    if len(steps) != 1:
        raise CheckpointError(
            f"{path.parent / 'model_optim_rng.pt'}: no single Adam step in optimizer.param_groups "
            f"(found {sorted(steps)})"
        )
    step = steps.pop()
    state = load_megatron_file(path)
    if not chained:
        return _buffer_records(path, fname, state, params, args, pp_rank, step, [])
    expert = [p for p in params if is_expert_key(p.key)]
    states = state.get("chained")
    if len(saved) != 2 or not expert or not isinstance(states, list) or len(states) != 2:
        raise CheckpointError(
            f"{path}: {len(saved)} chained optimizers (several model chunks?): only the [dense, experts] "
            "pair of a mixture-of-experts model is read"
        )
    records = []
    if expert_rank == 0:
        dense = [p for p in params if not is_expert_key(p.key)]
        records += _buffer_records(path, fname, states[0], dense, args, pp_rank, step, ["chain", 0])
    return records + _buffer_records(path, fname, states[1], expert, args, pp_rank, step, ["chain", 1])


def _buffer_records(
    path: Path,
    fname: str,
    state: Any,
    params: list[RankParam],
    args: Any,
    pp_rank: int,
    step: int,
    chain: list,
) -> list[dict]:
    """Records of one DistributedOptimizer's ``get_parameter_state_dp_zero`` dict over ``params``;
    ``chain`` prefixes the records' ``where`` (``["chain", c]``: the c-th chained optimizer's)."""
    what = f"{path}{f' (chained optimizer {chain[1]})' if chain else ''}"
    if not isinstance(state, dict):
        raise CheckpointError(f"{what}: no distributed-optimizer state (saved by a rank of DP rank > 0?)")
    chunks = [k for k in state if isinstance(k, int)]
    if not state.get("buckets_coalesced"):
        raise CheckpointError(
            f"{what}: a per-bucket layout without 'buckets_coalesced' (megatron-core before 0.10) is not read"
        )
    if chunks != [0] or len(state[0]) != 1:
        raise CheckpointError(
            f"{what}: {len(chunks)} model chunks with {sum(len(state[c]) for c in chunks)} buffers: "
            "only one model chunk with one parameter dtype is read (no virtual pipeline)"
        )
    ((dtype_key, buffers),) = state[0].items()
    offsets, lengths, bucket_size = grad_buffer_layout(params, args, pp_rank)
    total = sum(lengths)
    numel = int(buffers.get("numel_unpadded", buffers["param"].numel()))
    if total != numel:
        raise CheckpointError(
            f"{what}: the {dtype_key} buffer holds {numel} elements, this rank's parameters lay out to "
            f"{total} (bucket size {bucket_size}): a layout this reader does not know"
        )
    records = []
    for p in params:
        if p.record is None:
            continue
        n = p.record["numel"]
        for kind, source in (("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq"), ("main_param", "param")):
            where = [fname, *chain, "buffer", source, offsets[p.key], n]
            records.append(_optim_record(p.record, kind, where, step))
    return records


def optimizer_tensor(raw: dict, rec: dict) -> torch.Tensor:
    """The TP-local tensor an optimizer record names, from its file's loaded dict ``raw``."""
    how = rec["where"]
    saved = raw.get("optimizer")
    if how[0] == "chain":  # one of a ChainedOptimizer's states (mixture of experts: dense, experts)
        if how[2] == "buffer":  # distrib_optim.pt (unpickle: {"chained": [dense, experts]})
            raw = raw["chained"][how[1]]
        else:
            saved = saved[how[1]]
        how = how[2:]
    if how[0] == "state":
        inner = saved if "state" in saved else saved["optimizer"]
        return inner["state"][how[1]][how[2]]
    if how[0] == "fp32":
        return saved["fp32_from_fp16_params"][how[1]][how[2]]
    _, source, offset, n = how
    (buffers,) = raw[0].values()
    return buffers[source][offset : offset + n].view(rec["local_shape"])


def map_scheduler(saved: Any) -> dict | None:
    """Megatron's ``opt_param_scheduler`` state as mcore's :class:`~mcore.training.lr_scheduler.LRScheduler`
    state (both count samples); None when absent or of an older layout."""
    keys = ("num_steps", "max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style")
    if not isinstance(saved, dict) or any(k not in saved for k in keys):
        return None
    return {
        "num_steps": int(saved["num_steps"]),
        "max_lr": float(saved["max_lr"]),
        "min_lr": float(saved["min_lr"]),
        "warmup_steps": int(saved["lr_warmup_steps"]),
        "decay_steps": int(saved["lr_decay_steps"]),
        "decay_style": str(saved["lr_decay_style"]),
    }


def map_grad_scaler(saved: Any) -> dict | None:
    """Megatron's dynamic grad scaler state (``scale`` a tensor) as mcore's."""
    if not isinstance(saved, dict) or "scale" not in saved:
        return None
    out = {
        "scale": float(saved["scale"].item() if isinstance(saved["scale"], torch.Tensor) else saved["scale"])
    }
    for key in ("growth_tracker", "hysteresis_tracker"):
        if key in saved:
            out[key] = int(saved[key])
    return out
