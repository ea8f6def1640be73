"""Megatron-LM ``--ckpt-format torch``: ``iter_N/mp_rank_TT[_PPP]/model_optim_rng.pt``, one file per
(TP, PP) rank, presented to mcore's loader as placements of mcore's logical tensors.

Each stored tensor becomes a record (the fields of :mod:`mcore.checkpoint.format`'s records) naming its
mcore logical tensor (global layer number = stage-local number + the layers of the earlier stages) and
the box(es) of it the TP rank holds (:mod:`.names` gives the split kind). The loader then copies the
overlaps into whatever TP/PP/DP layout the run has. ``checkpoint_version`` < 2 QKV layouts
(``[3, np, hn]`` for version 0, ``[np, hn, 3]`` for 1.0) are reordered per shard into the version-2
per-head ``[np, 3, hn]`` layout, which is megatron-core's (and mcore's) per-group layout with one
head per group.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from mcore.checkpoint.format import CheckpointError
from mcore.checkpoint.megatron.args import check_supported, model_flags_from_args, tokenizer_flags_from_args
from mcore.checkpoint.megatron.names import (
    QKV,
    REPLICATED,
    ROW,
    SWIGLU,
    UnsupportedTensor,
    flatten_state,
    is_skipped,
    local_layer_count,
    map_name,
)
from mcore.checkpoint.megatron.read_optim import (
    DISTRIB_OPTIM,
    RankParam,
    distributed_optimizer_records,
    map_grad_scaler,
    map_scheduler,
    optimizer_tensor,
    torch_optimizer_records,
)
from mcore.checkpoint.megatron.unpickle import load_megatron_file
from mcore.checkpoint.reader import ShardReader

FORMAT_TORCH = "megatron-torch"
FILE_NAMES = ("model_optim_rng.pt", "model_rng.pt")
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")


def rank_dir_name(tp: int, pp: int, pp_size: int, ep: int = 0, ep_size: int = 1) -> str:
    """``mp_rank_TT`` (one pipeline stage) or ``mp_rank_TT_PPP``, then ``_EEE`` with expert
    parallelism (Megatron's ``get_checkpoint_name``)."""
    name = f"mp_rank_{tp:02d}" if pp_size == 1 else f"mp_rank_{tp:02d}_{pp:03d}"
    return name if ep_size == 1 else f"{name}_{ep:03d}"


def _rank_file(iter_dir: Path, sub: str) -> Path:
    for name in FILE_NAMES:
        if (iter_dir / sub / name).is_file():
            return iter_dir / sub / name
    return iter_dir / sub / FILE_NAMES[0]


def placement_json(shape: tuple[int, ...], split: str, tp_rank: int, tp_size: int) -> dict:
    """Where one TP rank's tensor of ``shape`` sits in the logical tensor (a record's placement fields)."""
    shape = tuple(int(s) for s in shape)
    zeros = [0] * len(shape)
    if split == REPLICATED or tp_size == 1 and split != SWIGLU:
        boxes, dim, global_shape = [[zeros, list(shape)]], None, list(shape)
    elif split == SWIGLU:
        half = shape[0] // 2
        total = half * tp_size
        global_shape = [2 * total, *shape[1:]]
        dim = 0
        boxes = [
            [[tp_rank * half, *zeros[1:]], [half, *shape[1:]]],
            [[total + tp_rank * half, *zeros[1:]], [half, *shape[1:]]],
        ]
    else:
        dim = 1 if split == ROW else 0
        global_shape = list(shape)
        global_shape[dim] *= tp_size
        offsets = list(zeros)
        offsets[dim] = tp_rank * shape[dim]
        boxes = [[offsets, list(shape)]]
    numel = 1
    for s in shape:
        numel *= s
    return {
        "global_shape": global_shape,
        "partition_dim": dim,
        "boxes": boxes,
        "local_shape": list(shape),
        "flat_range": [0, numel],
        "numel": numel,
    }


def expert_placement(placement: dict, expert: int, num_experts: int) -> dict:
    """One expert's TP-shard ``placement`` (of its ``[rows, cols]`` matrix) as a placement in the
    stacked ``[E, rows, cols]`` logical tensor: a leading expert axis of length 1 at ``expert``."""
    dim = placement["partition_dim"]
    return {
        **placement,
        "global_shape": [num_experts, *placement["global_shape"]],
        "partition_dim": None if dim is None else dim + 1,
        "boxes": [[[expert, *offsets], [1, *lengths]] for offsets, lengths in placement["boxes"]],
        "local_shape": [1, *placement["local_shape"]],
    }


def qkv_to_version2(t: torch.Tensor, version: float, heads: int) -> torch.Tensor:
    """A TP shard's fused QKV weight/bias in the version-2 ``[np, 3, hn]`` row layout."""
    if version >= 2.0:
        return t
    rest = t.shape[1:]
    hn = t.shape[0] // (3 * heads)
    if version == 0:
        return t.view(3, heads, hn, *rest).transpose(0, 1).reshape(t.shape)
    return t.view(heads, hn, 3, *rest).transpose(1, 2).reshape(t.shape)  # version 1.0


def _model_state(data: dict, path: Path) -> dict[str, Any]:
    if "model" not in data:
        chunks = sorted(k for k in data if re.fullmatch(r"model\d+", k))
        if chunks:
            raise CheckpointError(
                f"{path}: holds interleaved-pipeline chunks ({', '.join(chunks)}): virtual pipeline "
                "checkpoints are not read"
            )
        raise CheckpointError(f"{path}: no 'model' entry (keys: {', '.join(map(str, data))})")
    return flatten_state(data["model"])


def read_torch_metadata(iter_dir: Path) -> dict[str, Any]:
    """The loader's metadata (records of every stored tensor, layout, train state, model flags) of a
    Megatron ``torch``-format iteration directory.

    Raises:
        CheckpointError: missing rank files, an unsupported architecture (naming the arg or tensor),
            args that disagree with the tensors.
    """
    subs = _rank_dirs(iter_dir)
    first = _rank_file(iter_dir, subs[0])
    head = load_megatron_file(first)
    args = _checked_args(head, first)
    wanted, tp = _expected_rank_dirs(iter_dir, subs, args)
    version = float(head.get("checkpoint_version", 0) or 0)
    heads = int(args.num_attention_heads)
    if version < 2.0 and bool(getattr(args, "group_query_attention", False)):
        raise CheckpointError(
            f"{first}: checkpoint_version={version} with grouped-query attention is undefined"
        )
    states, loaded = _model_states(iter_dir, wanted, first, head)
    offsets = _stage_layer_offsets(iter_dir, states, args)
    records, files, rank_params = _param_records(iter_dir, states, offsets, args, tp, heads, version)
    iteration = head.get("iteration", head.get("total_iters", 0))
    has_optimizer = "optimizer" in head or any((iter_dir / s / DISTRIB_OPTIM).is_file() for s in subs)
    meta = megatron_metadata(FORMAT_TORCH, args, iteration, version, has_optimizer, records, files)
    if has_optimizer:
        _add_optimizer_state(meta, iter_dir, head, args, rank_params, loaded)
    return meta


def _rank_dirs(iter_dir: Path) -> list[str]:
    """The ``mp_rank_*`` directories (sorted); none is an error."""
    subs = sorted(p.name for p in iter_dir.iterdir() if p.is_dir() and _RANK_DIR.match(p.name))
    if not subs:
        raise CheckpointError(f"{iter_dir}: no mp_rank_* directories (not a Megatron torch checkpoint)")
    return subs


def _checked_args(head: dict, first: Path) -> Any:
    """The ``args`` of the first rank file, checked for what mcore implements."""
    args = head.get("args")
    if args is None:
        raise CheckpointError(
            f"{first}: no 'args' in the checkpoint: the model configuration is unknown (Megatron "
            "checkpoints saved by Megatron-LM's training loop carry it)"
        )
    check_supported(args, str(first), moe=True)
    return args


def _expected_rank_dirs(
    iter_dir: Path, subs: list[str], args: Any
) -> tuple[dict[str, tuple[int, int, int]], int]:
    """``{rank directory: (tp rank, pp rank, ep rank)}`` the args' sizes call for, and the TP size; a
    missing rank file or a directory too many is an error."""
    tp = int(getattr(args, "tensor_model_parallel_size", 1))
    pp = int(getattr(args, "pipeline_model_parallel_size", 1))
    ep = int(getattr(args, "expert_model_parallel_size", 1) or 1)
    wanted = {
        rank_dir_name(t, p, pp, e, ep): (t, p, e) for e in range(ep) for t in range(tp) for p in range(pp)
    }
    for sub in wanted:
        path = _rank_file(iter_dir, sub)
        if not path.is_file():
            raise CheckpointError(
                f"Megatron checkpoint file {path} is missing (args say tensor_model_parallel_size={tp}, "
                f"pipeline_model_parallel_size={pp}, expert_model_parallel_size={ep})"
            )
    extra = sorted(set(subs) - set(wanted))
    if extra:
        raise CheckpointError(
            f"{iter_dir}: rank directories {', '.join(extra)} do not fit the args' "
            f"tensor_model_parallel_size={tp}, pipeline_model_parallel_size={pp}, "
            f"expert_model_parallel_size={ep}"
        )
    return wanted, tp


def _model_states(
    iter_dir: Path, wanted: dict[str, tuple[int, int, int]], first: Path, head: dict
) -> tuple[dict[tuple[int, int, int], tuple[str, dict]], dict[str, dict]]:
    """``{(t, p, e): (rank file, its model state)}`` and ``{rank file: its whole dict}`` (the optimizer
    state is read from it)."""
    states: dict[tuple[int, int, int], tuple[str, dict]] = {}
    loaded: dict[str, dict] = {}  # rank file -> its whole dict (the optimizer state is read from it)
    for sub, rank in wanted.items():
        path = _rank_file(iter_dir, sub)
        data = head if path == first else load_megatron_file(path)
        states[rank] = (str(path.relative_to(iter_dir)), _model_state(data, path))
        loaded[states[rank][0]] = data
    return states, loaded


def _stage_layer_offsets(iter_dir: Path, states: dict, args: Any) -> list[int]:
    """The global index of each pipeline stage's first layer (the stages' layers must add up to
    ``args.num_layers``)."""
    pp = int(getattr(args, "pipeline_model_parallel_size", 1))
    counts = [local_layer_count(states[(0, p, 0)][1]) for p in range(pp)]
    if sum(counts) != int(args.num_layers):
        raise CheckpointError(
            f"{iter_dir}: the stages hold {counts} layers ({sum(counts)} in all), "
            f"args.num_layers={args.num_layers}"
        )
    return [sum(counts[:p]) for p in range(pp)]


def _param_records(
    iter_dir: Path, states: dict, offsets: list[int], args: Any, tp: int, heads: int, version: float
) -> tuple[list[dict], dict[str, dict], dict[tuple[int, int], list[RankParam]]]:
    """The loader's records of the model tensors (mapped to mcore's names and placements), the rank
    files with their sizes, and each rank file's parameters in order (for its optimizer state).
    EP rank ``e`` > 0 adds only its routed experts (global index ``e * E/ep + N``): the rest of its
    file replicates EP rank 0's."""
    swiglu = bool(getattr(args, "swiglu", False))
    tied = not bool(getattr(args, "untie_embeddings_and_output_weights", False))
    ep = int(getattr(args, "expert_model_parallel_size", 1) or 1)
    records, files = [], {}
    rank_params: dict[tuple[int, int, int], list[RankParam]] = {}
    for (t, p, e), (fname, state) in sorted(states.items()):
        files[fname] = {"size": (iter_dir / fname).stat().st_size}
        params: list[RankParam] = []  # the file's order (its optimizer state follows it)
        rank_params[(t, p, e)] = params
        for key, value in state.items():
            try:
                target = map_name(key, offsets[p], swiglu=swiglu, tied=tied)
            except UnsupportedTensor as err:
                raise CheckpointError(f"{iter_dir / fname}: {err}") from None
            if p > 0 and key == "embedding.word_embeddings.weight":
                target = None  # the last stage's copy for MTP (the first stage's is the one)
            if e > 0 and (target is None or target.expert is None):
                if not is_skipped(key) and isinstance(value, torch.Tensor) and target is not None:
                    params.append(RankParam(key, tuple(value.shape), None))  # still in the optimizer
                continue  # an EP replica of what EP rank 0 holds
            if target is None or (target.split == REPLICATED and t != 0):
                if not is_skipped(key) and isinstance(value, torch.Tensor):
                    params.append(RankParam(key, tuple(value.shape), None))  # still in the optimizer
                continue  # skipped, or a replica of what TP rank 0 holds
            if not isinstance(value, torch.Tensor):
                raise CheckpointError(
                    f"{iter_dir / fname}: {key!r} is a {type(value).__name__}, not a tensor"
                )
            record = _record(target, key, value, fname, t, tp, e, ep, args, iter_dir)
            if target.split == QKV and version < 2.0:
                record["qkv_version"] = version
                record["qkv_heads"] = heads // tp
            records.append(record)
            params.append(RankParam(key, tuple(value.shape), record))
    if getattr(args, "num_experts", None) and not any("mlp.experts." in r["name"] for r in records):
        raise CheckpointError(
            f"{iter_dir}: args.num_experts={args.num_experts}: mixture-of-experts args, but no layer has "
            "expert tensors (mlp.experts.*)"
        )
    return records, files, rank_params


def _record(
    target, key: str, value: torch.Tensor, fname: str, t: int, tp: int, e: int, ep: int, args, iter_dir
):
    """The loader's record of one stored tensor (a routed expert's placed in the ``[E, ...]`` tensor)."""
    placement = placement_json(tuple(value.shape), target.split, t, tp)
    if target.expert is not None:
        experts = _num_experts(args, iter_dir / fname, key)
        placement = expert_placement(placement, e * (experts // ep) + target.expert, experts)
    return {
        "name": target.name,
        "kind": "param",
        "file": fname,
        "key": key,
        "dtype": str(value.dtype).removeprefix("torch."),
        **placement,
    }


def _num_experts(args: Any, path: Path, key: str) -> int:
    """``args.num_experts`` for an expert tensor ``key``, or the error naming both."""
    experts = getattr(args, "num_experts", None)
    if not experts:
        raise CheckpointError(
            f"{path}: tensor {key!r} is a mixture-of-experts tensor, but args.num_experts={experts!r}"
        )
    return int(experts)


def _add_optimizer_state(meta: dict, iter_dir: Path, head: dict, args: Any, rank_params: dict, loaded: dict):
    """Optimizer records (:mod:`.read_optim`) into ``meta``; what cannot be read becomes
    ``meta["megatron"]["optimizer_error"]``, raised only for a run that asks for the optimizer state."""
    optimizer = str(getattr(args, "optimizer", "adam"))
    distributed = bool(getattr(args, "use_distributed_optimizer", False)) or any(
        (p.parent / DISTRIB_OPTIM).is_file() for p in (iter_dir / f for f in loaded)
    )
    pp = int(getattr(args, "pipeline_model_parallel_size", 1))
    records = []
    try:
        if optimizer != "adam":
            raise CheckpointError(
                f"{iter_dir}: the optimizer state is {optimizer!r} (args.optimizer); mcore reads Megatron's "
                "Adam state only (load with --no-load-optim)"
            )
        ep = int(getattr(args, "expert_model_parallel_size", 1) or 1)
        for (t, p, e), params in sorted(rank_params.items()):
            sub = rank_dir_name(t, p, pp, e, ep)
            fname = str(_rank_file(iter_dir, sub).relative_to(iter_dir))
            if distributed:
                path, name = iter_dir / sub / DISTRIB_OPTIM, f"{sub}/{DISTRIB_OPTIM}"
                records += distributed_optimizer_records(path, name, loaded[fname], params, args, p, e)
            else:  # an EP rank > 0 adds its experts' state (its dense state replicates EP rank 0's)
                records += torch_optimizer_records(iter_dir / fname, fname, loaded[fname], params, e > 0)
    except CheckpointError as err:
        meta["megatron"]["optimizer_error"] = str(err)
        return
    meta["records"] += records
    for rec in records:
        meta["files"].setdefault(rec["file"], {"size": (iter_dir / rec["file"]).stat().st_size})
    saved = head.get("optimizer") if isinstance(head.get("optimizer"), dict) else {}
    meta["optimizer"] = {
        "saved": True,
        "type": optimizer,
        "grad_scaler": map_grad_scaler(saved.get("grad_scaler")),
        "param_groups": [],
    }
    meta["scheduler"] = map_scheduler(head.get("opt_param_scheduler"))


def megatron_metadata(
    fmt: str,
    args: Any,
    iteration: int | str,
    checkpoint_version: float,
    has_optimizer: bool,
    records: list[dict[str, Any]],
    files: dict[str, Any],
) -> dict[str, Any]:
    """The ``metadata.json``-shaped dict mcore's loader reads, for a Megatron-LM checkpoint of format
    ``fmt`` (weights: the ``torch`` reader adds the optimizer records and scheduler after it, see
    :func:`_add_optimizer_state`; no RNG state is offered; ``megatron`` keeps what the Megatron-specific
    checks need)."""
    return {
        "format": fmt,
        "iteration": int(iteration) if iteration != "release" else 0,
        "layout": megatron_layout(args),
        "train_state": train_state_from_args(args, iteration),
        "scheduler": None,
        "optimizer": {"saved": False},
        "rng_saved": False,
        "run_config": {
            "model": model_flags_from_args(args),
            **({"tokenizer": tok} if (tok := tokenizer_flags_from_args(args)) else {}),
        },
        "megatron": {
            "checkpoint_version": checkpoint_version,
            "has_optimizer": has_optimizer,
            "padded_vocab_size": getattr(args, "padded_vocab_size", None),
            "vocab_size": getattr(args, "orig_vocab_size", None) or getattr(args, "vocab_size", None),
        },
        "files": files,
        "records": records,
    }


def megatron_layout(args: Any) -> dict[str, Any]:
    tp = int(getattr(args, "tensor_model_parallel_size", 1))
    pp = int(getattr(args, "pipeline_model_parallel_size", 1))
    dp = getattr(args, "data_parallel_size", None)
    return {
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": pp,
        "data_parallel_size": dp,
        "context_parallel_size": int(getattr(args, "context_parallel_size", 1) or 1),
        "virtual_pipeline_model_parallel_size": 1,
        "world_size": getattr(args, "world_size", None),
        "parallel_order": "megatron",  # never equal to a run's: Megatron's RNG states are not restored
    }


def train_state_from_args(args: Any, iteration: Any) -> dict[str, Any]:
    return {
        "iteration": int(iteration) if iteration != "release" else 0,
        "consumed_train_samples": int(getattr(args, "consumed_train_samples", 0) or 0),
        "consumed_valid_samples": int(getattr(args, "consumed_valid_samples", 0) or 0),
    }


class MegatronTorchReader(ShardReader):
    """:class:`ShardReader` over Megatron ``model_optim_rng.pt`` files (records from
    :func:`read_torch_metadata`); a file is read when a record in it is first needed."""

    def raw(self, name: str) -> dict:
        """A rank file's whole dict (``model_optim_rng.pt`` or ``distrib_optim.pt``), loaded once."""
        if not hasattr(self, "_raw"):
            self._raw: dict[str, dict] = {}
        if name not in self._raw:
            self._raw[name] = load_megatron_file(self.dir / name)
        return self._raw[name]

    def file(self, name: str) -> dict:
        if name not in self._open:
            self._open[name] = _model_state(self.raw(name), self.dir / name)
        return self._open[name]

    def close(self) -> None:
        super().close()
        self._raw = {}

    def tensor(self, rec: dict) -> torch.Tensor:
        path = self.dir / rec["file"]
        if rec["kind"] != "param":
            try:
                t = optimizer_tensor(self.raw(rec["file"]), rec).float()
            except (KeyError, IndexError, TypeError, RuntimeError) as err:
                raise CheckpointError(
                    f"{path}: the optimizer state of {rec['key']!r} changed since the checkpoint was "
                    f"indexed ({type(err).__name__}: {err})"
                ) from None
        else:
            t = self.file(rec["file"]).get(rec["key"])
        if not isinstance(t, torch.Tensor) or t.numel() != rec["numel"]:
            raise CheckpointError(f"{path}: tensor {rec['key']!r} changed since the checkpoint was indexed")
        if "qkv_version" in rec:
            t = qkv_to_version2(t, rec["qkv_version"], rec["qkv_heads"])
        return t.reshape(-1)
