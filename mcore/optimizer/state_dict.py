"""The optimizer's state for checkpoints: this rank's pieces (:func:`state_dict`), every piece gathered
over the data-parallel ranks (:func:`gathered_state_dict`), and loading either at any data-parallel
layout (:func:`load_state_dict`); :class:`~mcore.optimizer.optimizer.MegatronOptimizer`'s methods of
the same names call these (``opt`` is that optimizer).

State dict layout (per-parameter, so the checkpoint can reshard it)::

    {"format": "mcore.optimizer/1", "optimizer": "adam" | "sgd", "distributed": bool,
     "param_groups": [{"lr", "weight_decay", "wd_mult", "lr_mult", "params": [key, ...]}, ...],
     "state": {key: {"range": (start, end),     # flattened piece of the (tp-local) parameter held here
                     "shape": (...),            # the (tp-local) parameter's shape
                     "step": int,                               # adam
                     "exp_avg": fp32[end-start], "exp_avg_sq": fp32[end-start],   # adam
                     "momentum_buffer": fp32[end-start],        # sgd
                     "main_param": fp32[end-start]}},           # bf16/fp16 parameters only
     "grad_scaler": {...} | None}

``key`` is the parameter's name in its (unwrapped) model chunk, prefixed with ``model{i}.`` when a
rank has several chunks (virtual pipeline). With the distributed optimizer, parameters whose piece
on this rank is empty have no entry. :func:`load_state_dict` accepts, for each key, any saved range
that contains this rank's range (a replicated or gathered state loads into any data-parallel size).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from mcore.distributed.grad_buffer import all_gather_into_tensor
from mcore.optimizer.main_params import MainParam, parameter_keys

STATE_FORMAT = "mcore.optimizer/1"


def state_dict(opt) -> dict[str, Any]:
    """Per-parameter state (layout in the module docstring); tensors are this rank's pieces."""
    opt.finish_param_sync()
    opt.sync_step_counters()
    names = parameter_keys(opt.model_chunks)
    state = {}
    for entry in opt.main_params:
        item: dict[str, Any] = {
            "range": (entry.start, entry.end),
            "shape": tuple(entry.model_param.shape),
        }
        for name, value in entry.state.items():
            item[name] = value.clone() if isinstance(value, torch.Tensor) else value
        if entry.owns_copy:
            item["main_param"] = opt.master_of(entry).clone()
        state[entry.key] = item
    return {
        "format": STATE_FORMAT,
        "optimizer": opt.config.optimizer,
        "distributed": opt.distributed,
        "param_groups": [
            {
                **{k: v for k, v in group.items() if k != "params"},
                "params": [names[id(p)] for p in group["params"]],
            }
            for group in opt.param_groups
        ],
        "state": state,
        "grad_scaler": opt.grad_scaler.state_dict() if opt.grad_scaler is not None else None,
    }


def gathered_state_dict(opt) -> dict[str, Any]:
    """:func:`state_dict` with every parameter's whole state on every data-parallel rank.

    Without the distributed optimizer this is :func:`state_dict`. With it, each state tensor is
    assembled in the buffer layout and all-gathered bucket by bucket over the data-parallel
    group (one collective per bucket and state field), so every entry covers ``(0, numel)`` and
    loads at any data-parallel size. It holds the full optimizer state in memory for a moment;
    a checkpoint that saves each rank's pieces with their ranges (:func:`state_dict`) does not.
    Every rank of the data-parallel group must call it.
    """
    state_dict = opt.state_dict()
    if not opt.distributed:
        return state_dict
    by_buffer: dict[int, list[MainParam]] = {}
    for entry in opt.main_params:
        by_buffer.setdefault(id(entry.buffer), []).append(entry)
    fields = ["exp_avg", "exp_avg_sq"] if opt.config.optimizer == "adam" else ["momentum_buffer"]
    step = torch.tensor([max((e.state.get("step", 0) for e in opt.main_params), default=0)])
    step = step.to(opt.device)
    names = parameter_keys(opt.model_chunks)
    comm = None
    full_state: dict[str, dict[str, Any]] = {}
    for chunk in opt.model_chunks:
        for buffer in chunk.grad_buffers:
            comm = buffer.comm
            entries = by_buffer.get(id(buffer), [])
            copies = any(p.dtype != torch.float32 for p in buffer.params)
            gathered = {}
            for name in fields + (["main_param"] if copies else []):
                flat = torch.zeros(buffer.numel, dtype=torch.float32, device=buffer.grad_data.device)
                for entry in entries:
                    offset = buffer.buffer_range(entry.model_param)[0]
                    value = opt.master_of(entry) if name == "main_param" else entry.state[name]
                    flat[offset + entry.start : offset + entry.end].copy_(value)
                if comm.active:
                    for bucket in buffer.buckets:
                        lo, hi = bucket.shard_range(comm.rank)
                        all_gather_into_tensor(
                            flat[bucket.start : bucket.end],
                            flat[lo:hi],
                            group=comm.group,
                        )
                gathered[name] = flat
            for param in buffer.params:
                lo, hi = buffer.buffer_range(param)
                item: dict[str, Any] = {
                    "range": (0, hi - lo),
                    "shape": tuple(param.shape),
                }
                for name, flat in gathered.items():
                    if name == "main_param" and param.dtype == torch.float32:
                        continue
                    item[name] = flat[lo:hi].clone()
                full_state[names[id(param)]] = item
    if comm is not None and comm.active:
        dist.all_reduce(step, op=dist.ReduceOp.MAX, group=comm.group)
    if opt.config.optimizer == "adam":
        for item in full_state.values():
            item["step"] = int(step.item())
    state_dict["state"] = full_state
    return state_dict


def load_state_dict(opt, state_dict: dict[str, Any]) -> None:
    """Load a state saved by :func:`state_dict` at this or another data-parallel layout.

    Raises:
        ValueError: the state is of another format or optimizer, or misses a parameter, or holds
            a piece of a parameter that does not cover the piece this rank updates.
    """
    if state_dict.get("format") != STATE_FORMAT:
        raise ValueError(f"optimizer state format {state_dict.get('format')!r} is not {STATE_FORMAT!r}")
    if state_dict["optimizer"] != opt.config.optimizer:
        raise ValueError(
            f"optimizer state is for --optimizer {state_dict['optimizer']}, "
            f"this run uses --optimizer {opt.config.optimizer}"
        )
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(opt.param_groups):
        raise ValueError(
            f"optimizer state has {len(saved_groups)} parameter groups, this model has {len(opt.param_groups)}"
        )
    for group, saved in zip(opt.param_groups, saved_groups):
        for name in ("lr", "weight_decay", "wd_mult", "lr_mult"):
            group[name] = saved[name]
    saved_state = state_dict["state"]
    for entry in opt.main_params:
        if entry.key not in saved_state:
            raise ValueError(f"optimizer state has no entry for parameter {entry.key}")
        item = saved_state[entry.key]
        lo, hi = item["range"]
        if tuple(item["shape"]) != tuple(entry.model_param.shape) or not (
            lo <= entry.start and entry.end <= hi
        ):
            raise ValueError(
                f"optimizer state for {entry.key} holds [{lo}, {hi}) of shape {tuple(item['shape'])}, "
                f"but this rank updates [{entry.start}, {entry.end}) of shape "
                f"{tuple(entry.model_param.shape)}: gather the data-parallel shards first"
            )
        piece = slice(entry.start - lo, entry.end - lo)
        for name, value in entry.state.items():
            if isinstance(value, torch.Tensor):
                value.copy_(item[name][piece])
            else:
                entry.state[name] = item[name]
        if "main_param" in item:  # for fp32 params: the model param itself
            opt.set_master(entry, item["main_param"][piece])
    if opt.flat:
        opt.applied_steps.fill_(max((e.state.get("step", 0) for e in opt.main_params), default=0))
    opt.finish_param_sync()
    if opt.distributed:  # parameters whose masters changed must reach every data-parallel rank
        if not opt.flat:  # (the flat path's set_master rounded them into the parameters already)
            for entry in opt.main_params:
                if entry.owns_copy:
                    entry.model_view().copy_(entry.main)
        for chunk in opt.model_chunks:
            chunk.start_param_sync()
            chunk.finish_param_sync()
    if opt.grad_scaler is not None and state_dict.get("grad_scaler") is not None:
        opt.grad_scaler.load_state_dict(state_dict["grad_scaler"])
