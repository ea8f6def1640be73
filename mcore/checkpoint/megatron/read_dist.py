"""megatron-core ``--ckpt-format torch_dist``: a torch.distributed.checkpoint (DCP) directory
(``metadata.json``, ``common.pt``, ``.metadata``, ``__R_N.distcp``), read with DCP's
``FileSystemReader`` in each process (no megatron import, no collective).

DCP keys are megatron-core's sharded keys: transformer layers are stacked, ``decoder.layers.<param>``
with a leading axis of ``num_layers`` (global layer numbers), norms under the Transformer-Engine names
(``self_attention.linear_qkv.layer_norm_weight``), SwiGLU fc1 as the global ``[gate; up]``; the tied
output copy is stored once under the word embedding. Each key's global tensor is what mcore's logical
tensor is (per layer), so every record is a whole logical tensor and the loader slices what each rank
needs. ``*/shard_*`` byte objects (``_extra_state``, RNG) are skipped. Routed experts (``--num-experts``) are
``decoder.layers.mlp.experts.experts.linear_fcK.weight`` (SequentialMLP; the grouped MLPs drop the
second ``experts``) of global shape ``[layers, experts, ...]``: per layer, mcore's stacked ``[E, ...]``
expert tensor, whatever EP/ETP saved it.

Optimizer state: the model-space keys ``optimizer.state.{exp_avg,exp_avg_sq,fp32_param,param}.<key>``
(the non-distributed optimizer; the distributed one saved ``fully_reshardable`` or
``fully_sharded_model_space``) have the global shape of ``<key>`` and become optimizer records the same
way; the Adam step comes from ``common.pt``. The distributed optimizer's bucket-space ``dp_reshardable``
layout (``optimizer.distributed.*``, Megatron-LM's default) is read by :mod:`.read_dist_optim`; the
deprecated ``dp_zero_gather_scatter`` is refused when a run asks for the optimizer state.
"""

from __future__ import annotations

import dataclasses
import json
import re
import warnings
from pathlib import Path
from typing import Any

import torch

from mcore.checkpoint.format import CheckpointError
from mcore.checkpoint.megatron.args import check_supported
from mcore.checkpoint.megatron.names import REPLICATED, UnsupportedTensor, map_layer_param, map_name
from mcore.checkpoint.megatron.read_dist_optim import (
    SHARDING,
    bucket_space_records,
    bucket_space_step,
    load_dcp_objects,
)
from mcore.checkpoint.megatron.read_optim import map_grad_scaler, map_scheduler
from mcore.checkpoint.megatron.read_torch import megatron_metadata, placement_json
from mcore.checkpoint.megatron.unpickle import load_megatron_file
from mcore.checkpoint.reader import ShardReader

FORMAT_TORCH_DIST = "megatron-torch_dist"
_PER_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_OPTIM_STATE = re.compile(r"^optimizer\.state\.(exp_avg|exp_avg_sq|fp32_param|param)\.(.+)$")
_OPTIM_KINDS = {
    "exp_avg": "exp_avg",
    "exp_avg_sq": "exp_avg_sq",
    "fp32_param": "main_param",
    "param": "main_param",
}
_CHAINED = re.compile(r"^chained_\d+\.")
"""megatron-core's ChainedOptimizer prefixes each optimizer's keys (an MoE model: dense, experts)."""
_NOT_MODEL = ("optimizer.", "rng_state", "rerun_state_machine", "common_state", "content_metadata")


def is_torch_dist_dir(iter_dir: Path) -> bool:
    path = iter_dir / "metadata.json"
    if not path.is_file():
        return False
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and "sharded_backend" in meta


def _dcp_metadata(iter_dir: Path):
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return FileSystemReader(str(iter_dir)).read_metadata()
    except Exception as err:  # noqa: BLE001 - a damaged .metadata fails in many ways
        raise CheckpointError(f"{iter_dir / '.metadata'} cannot be read (corrupted?): {err}") from None


def read_dist_metadata(iter_dir: Path) -> dict[str, Any]:
    """The loader's metadata of a megatron-core ``torch_dist`` iteration directory.

    Raises:
        CheckpointError: another sharded backend (zarr), no ``common.pt``, an unsupported architecture.
    """
    common_path, common, args = _read_common(iter_dir)
    scan = _scan_keys(iter_dir, args)
    iteration = common.get("iteration", 0)
    version = float(common.get("checkpoint_version", 0) or 0)
    has_optimizer = scan.has_optimizer or "optimizer" in common
    meta = megatron_metadata(FORMAT_TORCH_DIST, args, iteration, version, has_optimizer, scan.records, {})
    if has_optimizer:
        _add_optimizer_state(meta, iter_dir, common_path, common, args, scan)
    return meta


def _read_common(iter_dir: Path) -> tuple[Path, dict, Any]:
    """``common.pt`` (its path, its dict, the ``args`` in it, checked for what mcore implements)."""
    backend = json.loads((iter_dir / "metadata.json").read_text()).get("sharded_backend")
    if backend != "torch_dist":
        raise CheckpointError(
            f"{iter_dir / 'metadata.json'}: sharded_backend={backend!r}; only 'torch_dist' is read"
        )
    common_path = iter_dir / "common.pt"
    if not common_path.is_file():
        raise CheckpointError(
            f"{common_path} is missing: this torch_dist checkpoint keeps its args elsewhere "
            "(a newer megatron-core's common_state), which is not read"
        )
    common = load_megatron_file(common_path)
    args = common.get("args")
    if args is None:
        raise CheckpointError(f"{common_path}: no 'args': the model configuration is unknown")
    check_supported(args, str(common_path), moe=True)
    return common_path, common, args


@dataclasses.dataclass
class _KeyScan:
    """What the DCP keys of a ``torch_dist`` directory hold (:func:`_scan_keys`)."""

    dcp_meta: Any
    records: list[dict] = dataclasses.field(default_factory=list)
    optim_records: list[dict] = dataclasses.field(default_factory=list)
    has_optimizer: bool = False
    bucket_space: str | None = None
    """A distributed-optimizer key of a bucket-space layout."""
    model: dict[str, tuple[tuple[int, ...], str]] = dataclasses.field(default_factory=dict)
    """Stored model key -> (global shape, dtype)."""


def _scan_keys(iter_dir: Path, args: Any) -> _KeyScan:
    """The loader's records of every stored model tensor and optimizer state (mapped to mcore's
    names; a stacked layer tensor gives one record per layer)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    swiglu = bool(getattr(args, "swiglu", False))
    tied = not bool(getattr(args, "untie_embeddings_and_output_weights", False))
    num_layers = int(args.num_layers)
    scan = _KeyScan(_dcp_metadata(iter_dir))
    for key, info in scan.dcp_meta.state_dict_metadata.items():
        kind, model_key = "param", key
        state_match = _OPTIM_STATE.match(_CHAINED.sub("", key))  # MoE: chained_0 dense, chained_1 experts
        if state_match:
            kind, model_key = _OPTIM_KINDS[state_match.group(1)], state_match.group(2)
        elif _CHAINED.sub("", key).startswith(_NOT_MODEL) or "/shard_" in key:
            scan.has_optimizer |= _CHAINED.sub("", key).startswith("optimizer.")
            if _CHAINED.sub("", key).startswith("optimizer.distributed."):
                scan.bucket_space = scan.bucket_space or key
            continue
        if not isinstance(info, TensorStorageMetadata):
            continue
        scan.has_optimizer |= kind != "param"
        shape = tuple(info.size)
        dtype = str(info.properties.dtype).removeprefix("torch.")
        if kind == "param":
            scan.model[key] = (shape, dtype)
        entries = _key_entries(iter_dir, key, model_key, shape, num_layers, swiglu, tied)
        for name, index, tshape in _stored_layers(entries, info):
            (scan.records if kind == "param" else scan.optim_records).append(
                {
                    "name": name,
                    "kind": kind,
                    "file": key,
                    "key": key,
                    "index": index,
                    "dtype": dtype,
                    **placement_json(tshape, REPLICATED, 0, 1),
                }
            )
    return scan


def _stored_layers(entries: list, info: Any) -> list:
    """The entries of a stacked layer key whose layer a stored chunk covers: with ``--moe-layer-freq``
    the dense layers' MLP and the MoE layers' router are one key each, over the layers that have them."""
    if not entries or entries[0][1] is None:
        return entries
    stored = {int(c.offsets[0]) + i for c in info.chunks for i in range(int(c.sizes[0]))}
    return [entry for entry in entries if entry[1] in stored]


def _key_entries(
    iter_dir: Path,
    key: str,
    model_key: str,
    shape: tuple[int, ...],
    num_layers: int,
    swiglu: bool,
    tied: bool,
) -> list[tuple[str, int | None, tuple[int, ...]]]:
    """``(mcore name, layer index in the stacked tensor or None, shape)`` of one stored key."""
    try:
        if model_key.startswith("decoder.layers.") and not _PER_LAYER.match(model_key):
            if shape[0] != num_layers:
                raise CheckpointError(
                    f"{iter_dir}: {key} stacks {shape[0]} layers, args.num_layers={num_layers}"
                )
            suffix, _ = map_layer_param(model_key.removeprefix("decoder.layers."), swiglu)
            return [(f"decoder.layers.{i}.{suffix}", i, shape[1:]) for i in range(num_layers)]
        target = map_name(model_key, 0, swiglu=swiglu, tied=tied)
        return [] if target is None else [(target.name, None, shape)]
    except UnsupportedTensor as err:
        raise CheckpointError(f"{iter_dir}: {err}") from None


def _add_optimizer_state(
    meta: dict, iter_dir: Path, common_path: Path, common: dict, args: Any, scan: _KeyScan
) -> None:
    """The optimizer's records (with Adam's step), grad scaler and scheduler into ``meta``; a state
    that cannot be read is noted (``meta["megatron"]["optimizer_error"]``) instead."""
    optim_records = scan.optim_records
    saved = common.get("optimizer") if isinstance(common.get("optimizer"), dict) else {}
    try:
        if saved.get("param_state_sharding_type") == SHARDING:
            saved, optim_records = _bucket_space_state(iter_dir, args, scan.dcp_meta, scan.model)
        else:
            step = _optimizer_step(common_path, common, args, scan.bucket_space, optim_records)
            for rec in optim_records:
                rec["step"] = step
    except CheckpointError as err:
        meta["megatron"]["optimizer_error"] = str(err)
        return
    meta["records"] += optim_records
    meta["optimizer"] = {
        "saved": True,
        "type": "adam",
        "grad_scaler": map_grad_scaler(saved.get("grad_scaler")),
        "param_groups": [],
    }
    meta["scheduler"] = map_scheduler(common.get("opt_param_scheduler"))


def _bucket_space_state(iter_dir: Path, args: Any, dcp_meta: Any, model: dict) -> tuple[dict, list[dict]]:
    """``(optimizer state_dict with the grad scaler, records)`` of a ``dp_reshardable`` distributed
    optimizer (:mod:`.read_dist_optim`)."""
    optimizer = str(getattr(args, "optimizer", "adam"))
    if optimizer != "adam":
        raise CheckpointError(
            f"{iter_dir}: the optimizer state is {optimizer!r} (args.optimizer); mcore reads Megatron's "
            "Adam state only"
        )
    tp_pp = int(getattr(args, "tensor_model_parallel_size", 1)) * int(
        getattr(args, "pipeline_model_parallel_size", 1)
    )
    step, saved = bucket_space_step(iter_dir, tp_pp)
    scaler = "optimizer.distributed.dp_group_idx_0.grad_scaler"
    if f"{scaler}/shard_0_1" in dcp_meta.state_dict_metadata:
        saved = {**saved, "grad_scaler": load_dcp_objects(iter_dir, [scaler])[scaler]}
    return saved, bucket_space_records(iter_dir, args, dcp_meta, model, step)


def _optimizer_step(
    common_path: Path, common: dict, args: Any, bucket_space: str | None, records: list
) -> int:
    """The Adam step of a torch_dist checkpoint's model-space optimizer state (``common.pt``:
    ``optimizer.state.common_step``, ``optimizer.optimizer.state.common_step`` with mixed precision, or
    the distributed optimizer's ``optimizer.optimizer.param_groups[*].step``).

    Raises:
        CheckpointError: not Adam, a bucket-space distributed-optimizer layout, no moments, no step.
    """
    iter_dir = common_path.parent
    optimizer = str(getattr(args, "optimizer", "adam"))
    if optimizer != "adam":
        raise CheckpointError(
            f"{iter_dir}: the optimizer state is {optimizer!r} (args.optimizer); mcore reads Megatron's "
            "Adam state only"
        )
    saved = common.get("optimizer") if isinstance(common.get("optimizer"), dict) else {}
    if saved and all(isinstance(k, int) for k in saved):  # chained (MoE): {0: dense, 1: experts}
        steps = {
            _optimizer_step(common_path, {"optimizer": sub}, args, bucket_space, records)
            for sub in saved.values()
        }
        if len(steps) != 1:
            raise CheckpointError(
                f"{common_path}: the chained optimizers hold different Adam steps {sorted(steps)}"
            )
        return steps.pop()
    sharding = saved.get("param_state_sharding_type")
    if bucket_space is not None or sharding == "dp_zero_gather_scatter":
        raise CheckpointError(
            f"{iter_dir}: the distributed optimizer's state is saved in its bucket layout "
            f"({sharding or bucket_space}), which is not read: save it with "
            "--dist-ckpt-optim-fully-reshardable (model-space optimizer.state.* tensors)"
        )
    kinds = {r["kind"] for r in records}
    if not {"exp_avg", "exp_avg_sq"} <= kinds:
        raise CheckpointError(f"{iter_dir}: no optimizer.state.exp_avg / exp_avg_sq tensors (not Adam?)")
    inner = saved.get("optimizer") if isinstance(saved.get("optimizer"), dict) else {}
    step = (saved.get("state") or inner.get("state") or {}).get("common_step")  # fp32 / mixed precision
    if step is None:
        steps = {g.get("step") for g in inner.get("param_groups", [])}
        steps.discard(None)
        step = steps.pop() if len(steps) == 1 else None
    if step is None:
        raise CheckpointError(
            f"{common_path}: no Adam step (optimizer.state.common_step or param_groups' step)"
        )
    return int(step.item()) if isinstance(step, torch.Tensor) else int(step)


def check_distcp_sizes(iter_dir: Path) -> None:
    """Refuse a truncated ``.distcp`` file by name: DCP's metadata records where each item ends, and a
    short file otherwise fails deep in DCP with a multi-line error that names no file."""
    needed: dict[str, int] = {}
    for info in (getattr(_dcp_metadata(iter_dir), "storage_data", None) or {}).values():
        path = getattr(info, "relative_path", None)
        if path is not None:
            needed[path] = max(needed.get(path, 0), int(info.offset) + int(info.length))
    for name, need in sorted(needed.items()):
        path = iter_dir / name
        try:
            size = path.stat().st_size
        except OSError:
            raise CheckpointError(f"{path}: missing (the checkpoint's .metadata names it)") from None
        if size < need:
            raise CheckpointError(
                f"{path}: truncated: {size} bytes, the checkpoint's .metadata needs {need} (an interrupted "
                "copy or save?)"
            )


def load_dcp_tensors(iter_dir: Path, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict:
    """Whole global tensors of the given DCP keys, read in this process alone (``no_dist``)."""
    import torch.distributed.checkpoint as dcp

    state = {key: torch.empty(shape, dtype=dtype) for key, (shape, dtype) in shapes.items()}
    check_distcp_sizes(iter_dir)
    try:
        with warnings.catch_warnings():  # no_dist=True says it: torch's "assuming ... a single process"
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            dcp.load(state, storage_reader=dcp.FileSystemReader(str(iter_dir)), no_dist=True)
    except Exception as err:  # noqa: BLE001 - missing or damaged .distcp files fail in many ways
        raise CheckpointError(
            f"{iter_dir}: reading {', '.join(sorted(shapes))[:200]} failed: {err}"
        ) from None
    return state


class MegatronDistReader(ShardReader):
    """:class:`ShardReader` over a ``torch_dist`` directory: a DCP key's global tensor is read whole
    when a record of it is first needed."""

    def file(self, name: str) -> dict:
        if name not in self._open:
            rec = next(r for (r, _) in self.index_by_key[name])
            shape = tuple(rec["global_shape"]) if rec["index"] is None else (-1,)
            if "bucket_numel" in rec:  # a distributed-optimizer bucket (read_dist_optim)
                shape = (rec["bucket_numel"],)
            if rec["index"] is not None:
                layers = [r["index"] for (r, _) in self.index_by_key[name]]
                shape = (max(layers) + 1, *rec["global_shape"])
            dtype = getattr(torch, rec["dtype"])
            self._open[name] = load_dcp_tensors(self.dir, {name: (shape, dtype)})
        return self._open[name]

    @property
    def index_by_key(self) -> dict[str, list]:
        if not hasattr(self, "_by_key"):
            self._by_key: dict[str, list] = {}
            for entries in self.index.values():
                for rec, placement in entries:
                    self._by_key.setdefault(rec["key"], []).append((rec, placement))
        return self._by_key

    def tensor(self, rec: dict) -> torch.Tensor:
        t = self.file(rec["file"])[rec["key"]]
        if "bucket_numel" in rec:
            offset, numel = rec["where"]
            return t[offset : offset + numel]
        if rec["index"] is not None:
            t = t[rec["index"]]
        return t.reshape(-1)
