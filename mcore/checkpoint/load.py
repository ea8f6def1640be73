"""Loading at any TP/PP/DP layout: each rank reads only the files holding the pieces it needs.

For every local tensor (a model shard, or a piece of an optimizer state) the loader builds its
placement in the *current* layout (:mod:`mcore.checkpoint.geometry`), picks the saved records of the
same logical tensor that overlap it (decided from ``metadata.json`` alone), opens those files
(memory-mapped: only the touched bytes are read), checks sizes and CRCs, and copies the overlaps.

Padded vocabulary (``embedding.word_embeddings.weight``, ``output_layer.weight``): the padded size
``Vp`` can change with the TP size. Rows present in both layouts are copied; rows ``>= Vp_saved``
are zero-filled (weights, fp32 masters and Adam moments alike); saved rows ``>= Vp_now`` are dropped.
Rows ``>= V`` (the tokenizer's size) are padding either way.

:func:`load_checkpoint` runs in stages: :func:`locate` (the iteration directory and its metadata),
:func:`check` (whether this run can load it; the reader of its format), :func:`read` (the tensors)
and :func:`restore` (optimizer, scheduler, RNG states). The reading itself is
:class:`~mcore.checkpoint.reader.ShardReader`'s.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch

from mcore.checkpoint.buffers import load_buffers
from mcore.checkpoint.collectives import all_gather_object as _all_gather_object
from mcore.checkpoint.collectives import broadcast_object as _broadcast_object
from mcore.checkpoint.collectives import rank as _rank
from mcore.checkpoint.compat import VOCAB_FLAG, check_compatible, identity_note, vocab_rows_kept
from mcore.checkpoint.format import (
    TRACKER,
    CheckpointError,
    fsync_dir,
    iter_dir_name,
    list_iterations,
    list_old_dirs,
    no_checkpoint_message,
    read_tracker,
    rng_file,
)
from mcore.checkpoint.geometry import full_placement, placement_from_spec
from mcore.checkpoint.megatron.detect import check_megatron_load, open_reader, read_any_metadata
from mcore.checkpoint.reader import ShardReader
from mcore.checkpoint.save import (
    data_parallel_index,
    log0,
    optimizer_key_specs,
    parallel_layout,
    rng_state_from_file,
)
from mcore.distributed.ddp import unwrap_model
from mcore.fp8.scaling import FP8_STATE, fp8_extra_state
from mcore.tensor_parallel.random import model_parallel_seed, set_all_rng_states

# -- resolving which checkpoint ---------------------------------------------------------------------


def resolve_iteration_dir(
    root: str | Path, iteration: int | str | None = None, *, recover: bool = True
) -> Path | None:
    """The iteration directory to load: ``iteration`` if given, else the tracker's. None when ``root``
    has no tracker (nothing saved yet).

    A re-save of the same iteration that was killed between its two renames (see
    :func:`mcore.checkpoint.save.publish`) leaves ``iter_XXXXXXX/`` missing and the complete previous
    copy in ``iter_XXXXXXX.old-<token>/``: with ``recover`` it is renamed back into place (logged);
    without, its path is returned as it is (read-only callers such as the inspector).

    Raises:
        CheckpointError: the given iteration or the tracker's does not exist (listing what does).
    """
    root = Path(root)
    requested = iteration is not None
    if iteration is None:
        iteration = read_tracker(root)
        if iteration is None:
            return None
    path = root / iter_dir_name(iteration)
    if path.is_dir():
        return path
    old = list_old_dirs(root, iteration)
    if old:
        if not recover:
            return old[0]
        os.rename(old[0], path)
        fsync_dir(root)
        log0(
            f"  recovered {path.name} from {old[0].name}: a re-save of iteration {iteration} was "
            "interrupted between its renames"
        )
        return path
    what = (
        f"iteration {iteration} was requested (--ckpt-step) but"
        if requested
        else f"{root / TRACKER} names iteration {iteration}, but"
    )
    raise CheckpointError(
        f"{what} {path} does not exist (complete iterations here: {list_iterations(root) or 'none'})"
    )


def _agree(error: str | None) -> None:
    """Collective: if any rank failed, every rank raises (so none is left waiting in a collective)."""
    errors = _all_gather_object(error)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        mine = errors[_rank()]
        if mine is not None:
            raise CheckpointError(mine)
        r, msg = failed[0]
        raise CheckpointError(f"loading the checkpoint failed on rank {r}: {msg}")


def saved_layout_value(layout: dict, key: str):
    """A saved layout's value, with the default a checkpoint written before the key existed implies
    (no expert parallelism: ep=1, etp=tp)."""
    if key in layout:
        return layout[key]
    if key == "expert_model_parallel_size":
        return 1
    if key == "expert_tensor_parallel_size":
        return layout.get("tensor_model_parallel_size")
    return None


def _describe(layout: dict) -> str:
    return (
        f"tp={layout['tensor_model_parallel_size']} pp={layout['pipeline_model_parallel_size']} "
        f"dp={layout['data_parallel_size']} vp={layout['virtual_pipeline_model_parallel_size']}"
        + (f" cp={layout['context_parallel_size']}" if layout.get("context_parallel_size", 1) > 1 else "")
    )


# -- the entry point -------------------------------------------------------------------------------


def load_checkpoint(
    config,
    model: list,
    optimizer,
    scheduler,
    groups,
    *,
    state_cls: type | None = None,
    seed: int | None = None,
    strict: bool = True,
    run_config=None,
    tokenizer_vocab_size: int | None = None,
):
    """Load ``config.load`` (the tracker's iteration, or ``--ckpt-step``) into this rank's model chunks,
    optimizer and scheduler, at the current layout, and return the training state (collective).

    ``--finetune``: weights only, a fresh state (iteration 0). ``--no-load-optim``: no optimizer and
    no scheduler state (Megatron's rule); the fp32 masters are refreshed from the loaded weights.
    ``--no-load-rng``: keep the current seeds. RNG states are restored only when the layout is the
    saved one; otherwise every RNG is reseeded with ``seed + iteration`` (logged once).
    ``strict``: a checkpoint tensor that no rank of this model uses is an error (else a warning).
    ``run_config`` (this run's ``RunConfig``) and ``tokenizer_vocab_size``: the checkpoint's model and
    vocabulary are compared with them first (:mod:`mcore.checkpoint.compat`; ``--allow-vocab-resize``).

    In stages: :func:`locate` (which iteration directory, its metadata), :func:`check` (what is
    loaded, and whether this run can load it), :func:`read` (the tensors, into the model and host
    buffers), :func:`restore` (optimizer, scheduler and RNG states), then the training state.

    Returns:
        ``state_cls(**saved_train_state)`` (a dict when ``state_cls`` is None); a fresh
        ``state_cls()`` when the load directory has no tracker yet (nothing saved: a new run).

    Raises:
        CheckpointError: on every rank, naming the file and the problem (missing shard files, shape
            mismatches, truncated or corrupted files, a tracker naming a missing directory).
    """
    root = Path(config.load)
    found = locate(root, config.ckpt_step)
    if found is None:
        if root.is_file() or (root / "config.json").is_file():
            # not a first run's empty --save/--load folder (Megatron's auto-resume starts fresh there),
            # but a file or a Hugging Face model: starting from random weights would be silently wrong
            raise CheckpointError(no_checkpoint_message(root))
        log0(f"WARNING: no {TRACKER} in {root}; nothing to load, starting from the initialized model")
        return state_cls() if state_cls is not None else {}
    path, meta = found
    log0(
        f"loading checkpoint from {root} at iteration {meta['iteration']} "
        f"(saved at {_describe(meta['layout'])})"
    )
    plan = LoadPlan.of(config, optimizer, meta, parallel_layout(model, groups))
    reader = check(config, path, meta, plan, run_config=run_config, tokenizer_vocab_size=tokenizer_vocab_size)
    optim_state, rng_states = read(reader, path, meta, model, optimizer, groups, plan, strict=strict)
    restore(optimizer, scheduler, meta, plan, optim_state, rng_states, groups, seed=seed)
    reader.close()
    return _train_state(root, meta, plan, state_cls)


@dataclasses.dataclass(frozen=True)
class LoadPlan:
    """What a load takes from the checkpoint (from the flags, the optimizer and the layouts)."""

    finetune: bool
    load_optim: bool
    load_rng: bool
    now: dict
    """This run's parallel layout (:func:`~mcore.checkpoint.save.parallel_layout`)."""
    same_layout: bool

    @classmethod
    def of(cls, config, optimizer, meta: dict, now: dict) -> LoadPlan:
        finetune = bool(config.finetune)
        return cls(
            finetune=finetune,
            load_optim=optimizer is not None and not (config.no_load_optim or finetune),
            load_rng=not (config.no_load_rng or finetune),
            now=now,
            same_layout=all(saved_layout_value(meta["layout"], k) == v for k, v in now.items()),
        )


# -- the stages ------------------------------------------------------------------------------------


def locate(root: Path, ckpt_step: int | str | None) -> tuple[Path, dict] | None:
    """The iteration directory to load and its metadata (mcore's or a Megatron-LM checkpoint's), found
    on rank 0 and broadcast (collective); None when ``root`` has no tracker yet.

    Raises:
        CheckpointError: on every rank, rank 0's error (see :func:`resolve_iteration_dir`).
    """
    outcome: tuple[str | None, Any] = (None, None)
    if _rank() == 0:
        try:
            path = resolve_iteration_dir(root, ckpt_step)
            outcome = (None, None if path is None else (str(path), read_any_metadata(path)))
        except CheckpointError as err:
            outcome = (str(err), None)
    error, found = _broadcast_object(outcome)
    if error is not None:
        raise CheckpointError(error)
    if found is None:
        return None
    return Path(found[0]), found[1]


def check(
    config,
    path: Path,
    meta: dict,
    plan: LoadPlan,
    *,
    run_config=None,
    tokenizer_vocab_size: int | None = None,
) -> ShardReader:
    """Whether this run can load the checkpoint (a Megatron-LM checkpoint's note, or the model and
    vocabulary compared with ``run_config``; every rank has the same metadata, so all raise alike with
    no collective), and the reader of its format (told which vocabulary rows start at zero after an
    allowed vocabulary resize)."""
    megatron_note = check_megatron_load(path, meta, load_optim=plan.load_optim)  # None for mcore's format
    if megatron_note:
        log0(megatron_note)
    resized = []
    if run_config is not None and megatron_note is None:  # (Megatron's: checked by its reader)
        resized = check_compatible(
            path,
            meta,
            run_config,
            tokenizer_vocab_size=tokenizer_vocab_size,
            allow_vocab_resize=bool(getattr(config, "allow_vocab_resize", False)),
        )
        note = identity_note(path, meta, run_config)
        if note:
            log0(note)
    reader = open_reader(path, meta)
    if resized:
        reader.vocab_rows_kept = vocab_rows_kept(meta, tokenizer_vocab_size)
        kept = reader.vocab_rows_kept
        log0(
            f"  {VOCAB_FLAG}: "
            + "; ".join(resized)
            + ("" if kept is None else f"; vocabulary rows >= {kept} start at zero")
        )
    return reader


def read(
    reader: ShardReader,
    path: Path,
    meta: dict,
    model: list,
    optimizer,
    groups,
    plan: LoadPlan,
    *,
    strict: bool,
) -> tuple[dict | None, Any]:
    """Read the weights into ``model`` and, as ``plan`` says, the optimizer's state and this rank's RNG
    states (returned, for :func:`restore`) (collective: a failure on any rank raises on every rank;
    then the checkpoint tensors no rank used are an error with ``strict``, else a warning)."""
    error = None
    optim_state = rng_states = None
    try:
        with torch.no_grad():
            used = _load_model(reader, model)
        if plan.load_optim:
            optim_state = _read_optimizer(reader, model, optimizer, meta)
        if plan.load_rng and meta.get("rng_saved") and plan.same_layout:
            name = rng_file(groups.tp_rank, groups.pp_rank, data_parallel_index(groups))
            rng_states = rng_state_from_file(reader.file(name))
    except CheckpointError as err:
        error = str(err)
    except Exception as err:  # noqa: BLE001 - a damaged file can fail in many ways
        error = f"{path}: {type(err).__name__}: {err}"
    _agree(error)

    unused = set(reader.names("param")) - set().union(*_all_gather_object(sorted(used)))
    if unused:
        message = f"{path}: tensors no rank of this model uses: {', '.join(sorted(unused)[:8])}" + (
            " ..." if len(unused) > 8 else ""
        )
        if strict:
            raise CheckpointError(message + " (a different model configuration?)")
        log0(f"WARNING: {message}")
    return optim_state, rng_states


def restore(
    optimizer, scheduler, meta: dict, plan: LoadPlan, optim_state, rng_states, groups, *, seed: int | None
) -> None:
    """The optimizer (fp32 masters from the loaded weights, then its read state), the scheduler's state
    and the RNG states (restored at the saved layout, else reseeded with ``seed + iteration``)."""
    if optimizer is not None:
        optimizer.reload_model_params()  # fp32 masters from the loaded weights
        if optim_state is not None:
            optimizer.load_state_dict(optim_state)
    if plan.load_optim and scheduler is not None and meta.get("scheduler") is not None:
        scheduler.load_state_dict(meta["scheduler"])
    if not plan.load_rng:
        return
    iteration = meta["iteration"]
    if rng_states is not None:
        set_all_rng_states(rng_states)
    elif not meta.get("rng_saved"):
        log0(
            "WARNING: the checkpoint has no RNG states (saved with --no-save-rng); keeping the current seeds"
        )
    elif seed is not None:
        log0(
            f"  the layout changed ({_describe(meta['layout'])} -> {_describe(plan.now)}): RNG states are not "
            f"restored; every RNG is reseeded with seed {seed} + iteration {iteration}"
        )
        model_parallel_seed(seed + int(iteration), groups.tp_rank, groups.pp_rank)
    else:
        log0(
            f"  the layout changed ({_describe(meta['layout'])} -> {_describe(plan.now)}): RNG states not restored"
        )


def _train_state(root: Path, meta: dict, plan: LoadPlan, state_cls: type | None):
    """The saved training state (a fresh one with ``--finetune``), as ``state_cls`` (or a dict)."""
    iteration = meta["iteration"]
    if plan.finetune:
        state = {}
        log0(
            f"  loaded the weights of iteration {iteration} from {root} for fine-tuning (starting at iteration 0)"
        )
    else:
        state = dict(meta.get("train_state") or {})
        state["iteration"] = int(iteration)
        log0(f"  successfully loaded checkpoint from {root} at iteration {iteration}")
    if state_cls is None:
        return state
    if dataclasses.is_dataclass(state_cls):
        names = {f.name for f in dataclasses.fields(state_cls)}
        return state_cls(**{k: v for k, v in state.items() if k in names})
    return state_cls(**state)


def _load_model(reader: ShardReader, model: list) -> set[str]:
    used = set()
    for chunk in model:
        module = unwrap_model(chunk)
        params = dict(module.named_parameters())
        for local_name, spec in module.sharded_parameters().items():
            param = params[local_name]
            reader.fill(
                spec.name,
                "param",
                placement_from_spec(spec),
                param.data.view(-1),
                vocab_padded=spec.vocab_padded,
            )
            used.add(spec.name)
        load_buffers(reader, module)
        _load_fp8_state(reader, module)
    return used


def _load_fp8_state(reader: ShardReader, module) -> None:
    """The FP8 delayed-scaling state (amax histories, scales) of one chunk, where the checkpoint has it.

    A checkpoint without it (a bf16 run, or another FP8 recipe) or with another history length
    leaves the fresh state: the scales then start over, as in a new FP8 run (said once on rank 0).
    """
    skipped = []
    for local_name, value in fp8_extra_state(module).items():
        name = module._logical_name(local_name)
        if not reader.has(name, FP8_STATE) or reader.global_shape(name, FP8_STATE) != tuple(value.shape):
            skipped.append(name)
            continue
        reader.fill(name, FP8_STATE, full_placement(value.shape), value.view(-1))
    if skipped:
        log0(
            f"checkpoint {reader.dir}: no matching FP8 scaling state for {len(skipped)} tensors "
            f"(e.g. {skipped[0]}); their amax histories start fresh"
        )


def _read_optimizer(reader: ShardReader, model: list, optimizer, meta: dict) -> dict:
    """The optimizer's ``state_dict`` for this rank's pieces, in the layout
    :meth:`MegatronOptimizer.load_state_dict` takes, assembled from the checkpoint."""
    from mcore.optimizer.state_dict import STATE_FORMAT

    info = meta.get("optimizer") or {}
    if not info.get("saved"):
        raise CheckpointError(
            f"{reader.dir}: the checkpoint has no optimizer state (saved with --no-save-optim, or a "
            "model-only checkpoint): load it with --no-load-optim or --finetune"
        )
    if info.get("type") != optimizer.config.optimizer:
        raise CheckpointError(
            f"{reader.dir}: the optimizer state is for --optimizer {info.get('type')}, "
            f"this run uses --optimizer {optimizer.config.optimizer} (load with --no-load-optim)"
        )
    specs = optimizer_key_specs(model)
    state = {}
    for entry in optimizer.main_params:
        spec = specs[entry.key]
        wanted = placement_from_spec(spec, (entry.start, entry.end))
        n = entry.end - entry.start
        item: dict[str, Any] = {"range": (entry.start, entry.end), "shape": tuple(entry.model_param.shape)}
        for kind, value in entry.state.items():
            if isinstance(value, torch.Tensor):
                buf = torch.empty(n, dtype=torch.float32)
                reader.fill(spec.name, kind, wanted, buf, vocab_padded=spec.vocab_padded)
                item[kind] = buf
            else:
                item[kind] = type(value)(reader.scalar(spec.name, kind))
        if reader.has(spec.name, "main_param"):  # fp32 masters beat the (possibly bf16) weights
            buf = torch.empty(n, dtype=torch.float32)
            reader.fill(spec.name, "main_param", wanted, buf, vocab_padded=spec.vocab_padded)
            item["main_param"] = buf
        state[entry.key] = item
    return {
        "format": STATE_FORMAT,
        "optimizer": optimizer.config.optimizer,
        "distributed": optimizer.distributed,
        "param_groups": [
            {**{k: v for k, v in g.items() if k != "params"}, "params": []} for g in optimizer.param_groups
        ],
        "state": state,
        "grad_scaler": info.get("grad_scaler"),
    }
