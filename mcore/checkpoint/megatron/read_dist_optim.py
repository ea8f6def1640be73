"""The distributed optimizer's bucket-space state in megatron-core ``--ckpt-format torch_dist``
checkpoints (``dp_reshardable``, Megatron-LM's default for ``--use-distributed-optimizer``), as
optimizer records of mcore's logical tensors.

What megatron-core (``DistributedOptimizer.sharded_param_state_dp_reshardable``) stores, per model
parallel (TP x PP) rank ``i = tp_rank + tp * pp_rank`` (its ``data_parallel_group_idx``):

* ``optimizer.distributed.dp_group_idx_<i>.gbuf_idx_<g>.dtype_(<param dtype>, <grad dtype>).bucket_idx_<b>.
  {param,exp_avg,exp_avg_sq}``: one flat fp32 tensor per bucket of the grad buffer, of the bucket's
  unpadded length (``numel_unpadded``: the padding to a DP multiple at its end dropped), the DP ranks'
  shards at their offsets in it. It is the bucket of the grad buffer as ``_ParamAndGradBuffer`` lays it
  out, so the buckets one after the other are exactly the coalesced buffer of ``distrib_optim.pt``:
  the parameter offsets come from :func:`.read_optim.grad_buffer_layout` (no second copy of it);
* ``optimizer.distributed.dp_group_idx_<i>.optimizer`` (a pickled object): the inner optimizer's
  ``param_groups``, whose ``step`` is the Adam step; ``.grad_scaler`` with fp16.

The buffer order is the reverse of the rank's ``named_parameters()`` order, which the checkpoint does
not store. The candidates (the stored keys' order, megatron-core's local layer spec, its
Transformer-Engine spec) are checked against the DCP chunks of each bucket tensor: megatron-core saves
every parameter (and every gap) as its own chunk, cut in two where a DP shard ends, so each parameter's
computed start and end must be chunk boundaries; the first candidate that fits every bucket of every rank is taken, none fitting is an error.
"""

from __future__ import annotations

import io
import re
import warnings
from pathlib import Path
from typing import Any

from mcore.checkpoint.format import CheckpointError
from mcore.checkpoint.megatron.names import (
    COLUMN,
    QKV,
    REPLICATED,
    ROW,
    SWIGLU,
    VOCAB,
    map_layer_param,
    map_name,
)
from mcore.checkpoint.megatron.read_optim import RankParam, _optim_record, grad_buffer_layout
from mcore.checkpoint.megatron.read_torch import placement_json

SHARDING = "dp_reshardable"
_BUCKET = re.compile(
    r"^optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_(.+)\.bucket_idx_(\d+)\."
    r"(param|exp_avg|exp_avg_sq)$"
)
_SOURCES = (("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq"), ("main_param", "param"))

_NORMS = (
    "self_attention.linear_qkv.layer_norm_weight",
    "self_attention.linear_qkv.layer_norm_bias",
)
_ATTN = ("self_attention.linear_proj.weight", "self_attention.linear_proj.bias")
_QKV = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias")
_MLP = (
    "mlp.linear_fc1.layer_norm_weight",
    "mlp.linear_fc1.layer_norm_bias",
    "mlp.linear_fc1.weight",
    "mlp.linear_fc1.bias",
    "mlp.linear_fc2.weight",
    "mlp.linear_fc2.bias",
)
LAYER_ORDERS = {
    # local spec: input_layernorm, then Attention builds linear_proj before SelfAttention's linear_qkv
    "local": _NORMS + _ATTN + _QKV + _MLP,
    # Transformer-Engine spec: the input norm lives in linear_qkv (a LayerNormLinear)
    "transformer_engine": _ATTN + _NORMS + _QKV + _MLP,
}


def _local_shape(key: str, shape: tuple[int, ...], split: str, tp: int) -> tuple[int, ...]:
    dim = {COLUMN: 0, QKV: 0, VOCAB: 0, SWIGLU: 0, ROW: 1}.get(split)
    if dim is None or tp == 1:
        return shape
    if shape[dim] % tp:
        raise CheckpointError(f"{key}: dim {dim} of {list(shape)} does not split into {tp} TP ranks")
    return (*shape[:dim], shape[dim] // tp, *shape[dim + 1 :])


def rank_params(
    model: dict[str, tuple[tuple[int, ...], str]], layer_order: list[str], args: Any, t: int, p: int
) -> list[RankParam]:
    """The parameters of TP rank ``t`` of stage ``p`` in ``named_parameters()`` order, TP-local shapes,
    each with the weight record of its piece (None for TP replicas beyond rank 0 and the tied output
    copy); ``model`` maps the stored DCP keys (stacked layers) to (global shape, dtype)."""
    tp = int(getattr(args, "tensor_model_parallel_size", 1))
    pp = int(getattr(args, "pipeline_model_parallel_size", 1))
    num_layers = int(args.num_layers)
    swiglu = bool(getattr(args, "swiglu", False))
    tied = not bool(getattr(args, "untie_embeddings_and_output_weights", False))
    if num_layers % pp:
        raise CheckpointError(f"{num_layers} layers over {pp} pipeline stages: uneven stages are not read")
    per_stage = num_layers // pp
    params: list[RankParam] = []

    def add(local_key: str, dcp_key: str, shape, name: str, split: str, index: int | None, head=False):
        local = _local_shape(dcp_key, tuple(shape), split, tp)
        record = None
        if not head and (split != REPLICATED or t == 0):
            record = {
                "name": name,
                "kind": "param",
                "key": dcp_key,
                "index": index,
                "dtype": model[dcp_key][1],
                **placement_json(local, split, t, tp),
            }
        params.append(RankParam(local_key, local, record))

    def add_top(key: str, head: bool = False):
        if key in model:
            target = map_name(key, 0, swiglu=swiglu, tied=False)
            add(key, key, model[key][0], target.name, target.split, None, head)

    if p == 0:
        add_top("embedding.word_embeddings.weight")
        add_top("embedding.position_embeddings.weight")
    for g in range(p * per_stage, (p + 1) * per_stage):
        for suffix in layer_order:
            key = f"decoder.layers.{suffix}"
            if key in model:
                name, split = map_layer_param(suffix, swiglu)
                local = f"decoder.layers.{g - p * per_stage}.{suffix}"
                add(local, key, model[key][0][1:], f"decoder.layers.{g}.{name}", split, g)
    if p == pp - 1:
        add_top("decoder.final_layernorm.weight")
        add_top("decoder.final_layernorm.bias")
        if not tied:
            add_top("output_layer.weight")
        elif pp > 1:  # the tied copy of the last stage: in its buffer, not a tensor of its own
            shape = model["embedding.word_embeddings.weight"][0]
            add("output_layer.weight", "embedding.word_embeddings.weight", shape, "", VOCAB, None, head=True)
    return params


def _layer_orders(model_keys: list[str]) -> list[list[str]]:
    stored = [k.removeprefix("decoder.layers.") for k in model_keys if k.startswith("decoder.layers.")]
    orders = [stored] + [[s for s in order if s in stored] for order in LAYER_ORDERS.values()]
    unique = []
    for order in orders:
        if sorted(order) == sorted(stored) and order not in unique:
            unique.append(order)
    return unique


def bucket_space_records(iter_dir: Path, args: Any, dcp_meta: Any, model: dict, step: int) -> list[dict]:
    """Optimizer records of a ``dp_reshardable`` distributed-optimizer state (module docstring).

    Raises:
        CheckpointError: several grad buffers or dtypes (experts, virtual pipeline), missing ranks, or no
            parameter order that fits the stored buckets.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    tp = int(getattr(args, "tensor_model_parallel_size", 1))
    pp = int(getattr(args, "pipeline_model_parallel_size", 1))
    buckets: dict[int, dict[int, tuple[str, int, set[int]]]] = {}  # group -> bucket -> (prefix, numel, cuts)
    for key, info in dcp_meta.state_dict_metadata.items():
        found = _BUCKET.match(key)
        if not found or not isinstance(info, TensorStorageMetadata):
            continue
        group, gbuf, _, bucket, _ = found.groups()
        if int(gbuf) != 0:
            raise CheckpointError(
                f"{iter_dir}: {key}: several grad buffers (virtual pipeline chunks or parameter dtypes) "
                "are not read"
            )
        prefix = key.rsplit(".", 1)[0]
        cuts = {c.offsets[0] for c in info.chunks} | {c.offsets[0] + c.sizes[0] for c in info.chunks}
        seen = buckets.setdefault(int(group), {}).get(int(bucket))
        if seen is not None and seen[0] != prefix:
            raise CheckpointError(
                f"{iter_dir}: {prefix} and {seen[0]}: several parameter dtypes are not read"
            )
        buckets[int(group)][int(bucket)] = (prefix, int(info.size[0]), cuts)
    if sorted(buckets) != list(range(tp * pp)):
        raise CheckpointError(
            f"{iter_dir}: distributed-optimizer buckets of model-parallel groups {sorted(buckets)}, the args "
            f"(TP={tp}, PP={pp}) need {list(range(tp * pp))}"
        )
    errors = []
    for order in _layer_orders(list(model)):
        try:
            return _records(iter_dir, args, model, order, buckets, step)
        except _DoesNotFit as err:
            errors.append(str(err))
    raise CheckpointError(
        f"{iter_dir}: no parameter order fits the distributed optimizer's buckets ({'; '.join(errors)})"
    )


class _DoesNotFit(Exception):
    pass


def _records(
    iter_dir: Path, args: Any, model: dict, order: list[str], buckets: dict, step: int
) -> list[dict]:
    tp = int(getattr(args, "tensor_model_parallel_size", 1))
    pp = int(getattr(args, "pipeline_model_parallel_size", 1))
    records = []
    for p in range(pp):
        for t in range(tp):
            group = buckets[t + tp * p]
            if sorted(group) != list(range(len(group))):
                raise CheckpointError(
                    f"{iter_dir}: model-parallel group {t + tp * p} has buckets {sorted(group)}"
                )
            params = rank_params(model, order, args, t, p)
            offsets, lengths, bucket_size = grad_buffer_layout(params, args, p)
            stored = [group[b][1] for b in range(len(group))]
            if lengths != stored:
                raise _DoesNotFit(
                    f"TP rank {t} stage {p}: the stored buckets hold {stored} elements, the parameters lay "
                    f"out to {lengths} (bucket size {bucket_size})"
                )
            starts = [sum(stored[:b]) for b in range(len(stored))]
            for param in params:
                numel = 1
                for s in param.shape:
                    numel *= s
                begin = offsets[param.key]
                b = max(i for i in range(len(group)) if starts[i] <= begin)
                prefix, _, cuts = group[b]
                local = begin - starts[b]
                if local not in cuts or local + numel not in cuts or local + numel > stored[b]:
                    raise _DoesNotFit(f"TP rank {t} stage {p}: {param.key} is not a stored piece of {prefix}")
                if param.record is None:
                    continue
                for kind, source in _SOURCES:
                    key = f"{prefix}.{source}"
                    rec = _optim_record(param.record, kind, [key, local, numel], step)
                    rec.update(key=key, index=None, bucket_numel=group[b][1])
                    records.append(rec)
    return records


def load_dcp_objects(iter_dir: Path, keys: list[str]) -> dict[str, Any]:
    """Objects megatron-core saved as ``ShardedObject`` (DCP byte entries ``<key>/shard_0_1``)."""
    import torch.distributed.checkpoint as dcp

    state = {f"{key}/shard_0_1": io.BytesIO() for key in keys}
    try:
        with warnings.catch_warnings():  # no_dist=True says it: torch's "assuming ... a single process"
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            dcp.load(state, storage_reader=dcp.FileSystemReader(str(iter_dir)), no_dist=True)
    except Exception as err:  # noqa: BLE001 - missing or damaged .distcp files fail in many ways
        raise CheckpointError(f"{iter_dir}: reading {', '.join(keys)} failed: {err}") from None
    out = {}
    for key in keys:
        value = state[f"{key}/shard_0_1"]
        out[key] = value[0] if isinstance(value, list) and len(value) == 1 else value
    return out


def bucket_space_step(iter_dir: Path, tp_pp: int) -> tuple[int, dict]:
    """The Adam step (the same in every model-parallel group's ``param_groups``) and group 0's
    optimizer ``state_dict`` (``grad_scaler`` included when saved)."""
    keys = [f"optimizer.distributed.dp_group_idx_{i}.optimizer" for i in range(tp_pp)]
    objects = load_dcp_objects(iter_dir, keys)
    steps = set()
    for key in keys:
        groups = objects[key].get("param_groups", []) if isinstance(objects[key], dict) else []
        steps |= {g.get("step") for g in groups}
    steps.discard(None)
    if len(steps) != 1:
        raise CheckpointError(
            f"{iter_dir}: no single Adam step in {keys[0]}...param_groups (found {sorted(steps)})"
        )
    value = steps.pop()
    return int(value.item() if hasattr(value, "item") else value), objects[keys[0]]
