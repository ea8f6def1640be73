"""Saving: every rank writes its own shards in parallel into a temporary directory; rank 0 commits.

Protocol of one save (all ranks call :func:`save_checkpoint` at the same iteration):

1. finish an asynchronous save still in flight (its commit is collective);
2. rank 0 removes directories of killed saves, picks a random token and broadcasts it; every rank
   creates ``iter_XXXXXXX.tmp-<token>/``;
3. *snapshot*: each rank copies the tensors it owns to host memory (model shards on data-parallel rank
   0 of each (tp, pp) slice and only their main replicas; optimizer pieces on the same ranks, or on
   every data-parallel rank with the distributed optimizer; its own RNG states);
4. *write*: ``torch.save`` one file per kind, fsync, CRC-32 of every tensor (in a background thread
   with ``--async-save``: the training loop was blocked only for step 3);
5. *commit* (collective): the file sizes and tensor records are gathered on rank 0, which writes
   ``metadata.json``, fsyncs, renames the directory to ``iter_XXXXXXX/`` and atomically replaces the
   tracker file; a barrier ends the save. A failure on any rank raises the same error everywhere
   (a full disk says "No space left on device" and names the file), removes the temporary directory
   and leaves the previous checkpoint and tracker untouched; a killed process leaves the temporary
   directory behind, and the next save removes it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from mcore.checkpoint.buffers import BUFFER, logical_buffers
from mcore.checkpoint.collectives import barrier as _barrier
from mcore.checkpoint.collectives import broadcast_object as _broadcast_object
from mcore.checkpoint.collectives import gather_object as _gather_object
from mcore.checkpoint.collectives import initialized as _initialized
from mcore.checkpoint.collectives import rank as _rank
from mcore.checkpoint.collectives import world_size as _world_size
from mcore.checkpoint.format import (
    FORMAT,
    METADATA,
    CheckpointError,
    dtype_name,
    expert_model_file,
    file_crc32,
    fsync_dir,
    iter_dir_name,
    list_tmp_dirs,
    model_file,
    new_tmp_token,
    old_dir_name,
    optim_file,
    rng_file,
    tensor_crc32,
    tmp_dir_name,
    write_json,
    write_torch_file,
    write_tracker,
)
from mcore.checkpoint.geometry import full_placement, placement_from_spec
from mcore.checkpoint.rng_state import rng_state_for_save, rng_state_from_file  # noqa: F401 (re-exported)
from mcore.distributed.ddp import DistributedDataParallel, unwrap_model
from mcore.fp8.scaling import FP8_STATE, fp8_extra_state


def parallel_layout(model: list, groups) -> dict[str, Any]:
    """The parallel layout of this run (``model``: its chunks) as a checkpoint's metadata records it,
    and as a load compares it with the saved one."""
    return {
        "tensor_model_parallel_size": groups.tp_size,
        "pipeline_model_parallel_size": groups.pp_size,
        "data_parallel_size": groups.dp_size,
        "context_parallel_size": groups.cp_size,
        "expert_model_parallel_size": groups.ep_size,
        "expert_tensor_parallel_size": groups.etp_size,
        "virtual_pipeline_model_parallel_size": len(model),
        "world_size": groups.world_size,
        "parallel_order": groups.topology.order,
    }


def log0(message: str) -> None:
    """``message`` as an INFO record of the ``mcore.checkpoint`` logger, on rank 0 only."""
    if _rank() == 0:
        logging.getLogger("mcore.checkpoint").info(message)


# -- what a rank owns -------------------------------------------------------------------------------


def optimizer_key_specs(model: list) -> dict[str, Any]:
    """The :class:`ShardSpec` of every parameter, keyed as the optimizer keys them (``model{i}.`` prefix
    when a rank holds several chunks)."""
    out = {}
    for i, chunk in enumerate(model):
        prefix = f"model{i}." if len(model) > 1 else ""
        for local_name, spec in unwrap_model(chunk).sharded_parameters().items():
            out[prefix + local_name] = spec
    return out


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A compact CPU copy (never a view: ``torch.save`` of a view writes its whole storage)."""
    out = torch.empty(tuple(tensor.shape), dtype=tensor.dtype, device="cpu")
    out.copy_(tensor.detach())
    return out


def _record(name: str, kind: str, file: str, key: str, tensor: torch.Tensor, placement, spec) -> dict:
    record = {
        "name": name,
        "kind": kind,
        "file": file,
        "key": key,
        "dtype": dtype_name(tensor.dtype),
        **placement.to_json(),
        "numel": int(tensor.numel()),
        "vocab_padded": bool(getattr(spec, "vocab_padded", False)),
    }
    if getattr(spec, "expert_dim", None) is not None:  # a routed expert's weight: the global expert axis
        record["expert_dim"] = spec.expert_dim
    return record


def _writes_entry(spec, optimizer, groups, dp: int) -> bool:
    """Whether this rank (data-parallel index ``dp``) writes the optimizer state of one parameter: every
    rank its own shard with the distributed optimizer; else one replica: dp index 0 for dense
    parameters, edp rank 0 for routed experts (each ep rank holds other experts)."""
    if not spec.is_main_replica:
        return False
    if optimizer.distributed:
        return True
    return (groups.edp_rank if spec.is_expert else dp) == 0


def _model_payload(model, file: str, *, experts: bool, fp8_state: bool) -> _FilePayload:
    """The model tensors this rank writes to ``file``: the dense ones (``experts=False``) or the routed
    experts' (each ep rank its block of the global expert axis), main replicas only."""
    tensors, records = {}, []
    for chunk in model:
        module = unwrap_model(chunk)
        params = dict(module.named_parameters())
        for local_name, spec in module.sharded_parameters().items():
            if not spec.is_main_replica or spec.is_expert != experts:
                continue
            t = _host_copy(params[local_name])
            tensors[spec.name] = t
            records.append(_record(spec.name, "param", file, spec.name, t, placement_from_spec(spec), spec))
        if fp8_state:  # persistent buffers (the router's expert_bias): replicated, once per stage
            for name, value in logical_buffers(module).items():
                tensors[f"{name}/{BUFFER}"] = t = _host_copy(value)
                records.append(
                    _record(name, BUFFER, file, f"{name}/{BUFFER}", t, full_placement(t.shape), None)
                )
        if fp8_state:  # FP8 delayed-scaling state: replicated over TP and DP, written once per stage
            for local_name, value in fp8_extra_state(module).items():
                name = module._logical_name(local_name)
                t = _host_copy(value)
                key = f"{name}/{FP8_STATE}"
                tensors[key] = t
                records.append(_record(name, FP8_STATE, file, key, t, full_placement(t.shape), None))
    return _FilePayload(file, tensors, records)


@dataclass
class _FilePayload:
    name: str
    tensors: dict[str, torch.Tensor]
    records: list[dict]
    whole_file_crc: bool = False  # small files (RNG): a CRC of the file instead of per-tensor ones


def data_parallel_index(groups) -> int:
    """This rank's index among the dp x cp ranks holding the same (tp, pp) shards: its data-parallel
    rank without context parallelism. Context-parallel ranks hold the same weights (and shards of the
    distributed optimizer over dp x cp), so only index 0 writes the model and the files are named by
    this index: a checkpoint carries nothing specific to context parallelism."""
    if groups.cp_size == 1 or groups.dp_cp is None:
        return groups.dp_rank
    return dist.get_rank(groups.dp_cp)


def _snapshot(config, model, optimizer, groups) -> list[_FilePayload]:
    """Step 3: host copies of everything this rank writes."""
    tp, pp, dp = groups.tp_rank, groups.pp_rank, data_parallel_index(groups)
    payloads: list[_FilePayload] = []
    if optimizer is not None:
        optimizer.finish_param_sync()  # parameters must hold their updated values
        for chunk in model:  # --fp8-param-gather: FP8 linears' weights exactly, not dequantized
            if isinstance(chunk, DistributedDataParallel):
                chunk.gather_full_precision_params()
    if dp == 0:
        payloads.append(_model_payload(model, model_file(tp, pp), experts=False, fp8_state=tp == 0))
    if groups.edp_rank == 0:  # routed experts: one writer per (etp, ep, pp), replicas over edp skipped
        experts = _model_payload(
            model, expert_model_file(groups.etp_rank, groups.ep_rank, pp), experts=True, fp8_state=False
        )
        if experts.records:
            payloads.append(experts)
    specs = optimizer_key_specs(model) if optimizer is not None else {}
    if optimizer is not None and not config.no_save_optim:
        ofile = optim_file(tp, pp, dp)
        tensors, records = {}, []
        optimizer.sync_step_counters()  # Adam's t is counted on the device (skipped steps excluded)
        for entry in optimizer.main_params:
            spec = specs[entry.key]
            if not _writes_entry(spec, optimizer, groups, dp):
                continue
            placement = placement_from_spec(spec, (entry.start, entry.end))
            stats = {k: v for k, v in entry.state.items() if isinstance(v, torch.Tensor)}
            scalars = {k: v for k, v in entry.state.items() if not isinstance(v, torch.Tensor)}
            if entry.owns_copy:
                # master_of: with --use-precision-aware-optimizer the fp32 master is the bf16 parameter
                # plus a 16-bit remainder (entry.main is None); the checkpoint stores the fp32 value.
                stats["main_param"] = optimizer.master_of(entry)
            for kind, value in stats.items():
                key = f"{spec.name}/{kind}"
                t = _host_copy(value.reshape(-1))
                tensors[key] = t
                rec = _record(spec.name, kind, ofile, key, t, placement, spec)
                rec.update({k: int(v) if isinstance(v, (int, np.integer)) else v for k, v in scalars.items()})
                records.append(rec)
        if optimizer.distributed or dp == 0 or records:
            payloads.append(_FilePayload(ofile, tensors, records))
    if not config.no_save_rng:
        payloads.append(_FilePayload(rng_file(tp, pp, dp), rng_state_for_save(), [], whole_file_crc=True))
    return payloads


def _write(tmp: Path, payloads: list[_FilePayload]) -> tuple[dict[str, dict], list[dict]]:
    """Step 4: write, fsync, checksum. Returns ``(files, records)``."""
    files: dict[str, dict] = {}
    records: list[dict] = []
    for payload in payloads:
        path = tmp / payload.name
        write_torch_file(path, payload.tensors)  # a full disk: "No space left on device", the file named
        info: dict[str, Any] = {"size": path.stat().st_size}
        if payload.whole_file_crc:
            info["crc32"] = file_crc32(path)
        for rec in payload.records:
            rec["crc32"] = tensor_crc32(payload.tensors[rec["key"]])
            records.append(rec)
        files[payload.name] = info
    return files, records


# -- one save in flight ----------------------------------------------------------------------------


@dataclass
class _SaveJob:
    root: Path
    tmp: Path
    iteration: int
    payloads: list[_FilePayload]
    common: dict | None  # rank 0 only
    coords: tuple[int, int, int]
    device: torch.device
    started: float
    blocked_s: float = 0.0
    error: str | None = None
    files: dict = field(default_factory=dict)
    records: list = field(default_factory=list)
    thread: threading.Thread | None = None
    write_s: float = 0.0

    def run(self) -> None:
        if self.error is not None:
            return
        start = time.perf_counter()
        try:
            self.files, self.records = _write(self.tmp, self.payloads)
        except CheckpointError as err:  # a clear message already: no traceback
            self.error = str(err)
        except BaseException as err:  # noqa: BLE001 - reported to every rank by the commit
            self.error = f"{type(err).__name__}: {err}\n{traceback.format_exc(limit=4)}"
        finally:
            self.payloads = []  # drop the host copies
            self.write_s = time.perf_counter() - start

    def start_thread(self) -> None:
        self.thread = threading.Thread(target=self.run, name=f"mcore-ckpt-{self.iteration}", daemon=True)
        self.thread.start()

    def done(self) -> bool:
        return self.thread is None or not self.thread.is_alive()

    def join(self) -> None:
        if self.thread is not None:
            self.thread.join()


_pending: _SaveJob | None = None


def publish(root: Path, tmp: Path, iteration: int, meta: dict) -> Path:
    """Write ``metadata.json`` into the finished temporary directory, rename it to ``iter_XXXXXXX/``
    and atomically point the tracker at it (one process; every file in ``tmp`` is already durable)."""
    write_json(tmp / METADATA, meta)
    fsync_dir(tmp)
    final = root / iter_dir_name(iteration)
    old = None
    if final.exists():  # the same iteration saved again: replace it
        # Two renames, not one: a directory cannot atomically replace a non-empty one. A kill between
        # them leaves the tracker naming a missing directory; the loader recovers the ``.old-`` copy
        # (:func:`mcore.checkpoint.load.resolve_iteration_dir`).
        old = root / old_dir_name(iteration, new_tmp_token())
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(root)
    write_tracker(root, iteration)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _commit(job: _SaveJob) -> None:
    """Step 5 (collective): gather, write metadata, rename, tracker, barrier."""
    job.join()
    gathered = _gather_object((job.error, job.coords, job.files, job.records))
    outcome: tuple[bool, str] = (True, "")
    if _rank() == 0:
        try:
            errors = [(r, g[0]) for r, g in enumerate(gathered) if g[0] is not None]
            if errors:
                r, msg = errors[0]
                raise CheckpointError(
                    f"saving iteration {job.iteration} failed on rank {r}: {msg.strip()}\n"
                    f"(the previous checkpoint and {job.root / 'latest_checkpointed_iteration.txt'} are unchanged; "
                    f"the partial directory {job.tmp.name} is removed)"
                )
            meta = dict(job.common)
            files: dict[str, dict] = {}
            records: list[dict] = []
            ranks = {}
            for r, (_, coords, f, recs) in enumerate(gathered):
                for name, info in f.items():
                    files[name] = {**info, "rank": r}
                records.extend(recs)
                ranks[str(r)] = "tp={} pp={} dp={}".format(*coords)
            meta["layout"]["ranks"] = ranks
            meta["files"] = files
            meta["records"] = records
            publish(job.root, job.tmp, job.iteration, meta)
        except Exception as err:  # noqa: BLE001 - every rank raises the same error
            outcome = (
                False,
                str(err) if isinstance(err, CheckpointError) else f"{type(err).__name__}: {err}",
            )
            # Every rank has finished writing (gathered above): the partial files only take space,
            # which a full disk needs back. Once renamed (tmp gone) nothing is removed.
            shutil.rmtree(job.tmp, ignore_errors=True)
    ok, message = _broadcast_object(outcome)
    if not ok:
        raise CheckpointError(message)
    _barrier()
    total = time.perf_counter() - job.started
    log0(
        f"  successfully saved checkpoint from iteration {job.iteration:7d} to {job.root} "
        f"[ blocked {job.blocked_s:.3f} s, write {job.write_s:.3f} s, total {total:.3f} s ]"
    )


def maybe_finalize_async_save(blocking: bool = False) -> bool:
    """Commit an asynchronous save whose writes have finished on every rank (collective: every rank
    calls it at the same point, e.g. after each iteration). ``blocking=True`` waits for the writes.
    Returns True when nothing is pending any more."""
    global _pending
    job = _pending
    if job is None:
        return True
    if not blocking:
        flag = torch.tensor([1 if job.done() else 0], dtype=torch.int32, device=job.device)
        if _initialized() and _world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if int(flag.item()) == 0:
            return False
    _pending = None
    start = time.perf_counter()
    job.join()
    waited = time.perf_counter() - start
    if blocking and waited > 0.001:
        log0(f"  waited {waited:.3f} s for the background checkpoint write of iteration {job.iteration}")
    _commit(job)
    return True


def wait_for_async_save() -> None:
    """Wait for an asynchronous save in flight and commit it (collective; a no-op when none is)."""
    maybe_finalize_async_save(blocking=True)


def async_save_pending() -> bool:
    return _pending is not None


# -- metadata ---------------------------------------------------------------------------------------


def run_config_dict(run_config: Any) -> dict | None:
    """A JSON-able dict of the run configuration (``RunConfig``, a dict of dataclasses, or a dict)."""
    if run_config is None:
        return None
    groups = run_config.as_dict() if hasattr(run_config, "as_dict") else dict(run_config)
    return {
        k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) and not isinstance(v, type) else v
        for k, v in groups.items()
    }


def _state_dict_of(state: Any) -> dict:
    if dataclasses.is_dataclass(state):
        return dataclasses.asdict(state)
    return dict(vars(state))


def _common_metadata(config, state, model, optimizer, scheduler, groups, run_config, metadata) -> dict:
    saved_optim = optimizer is not None and not config.no_save_optim
    return {
        "format": FORMAT,
        "iteration": int(state.iteration),
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "torch_version": torch.__version__,
        "layout": {
            **parallel_layout(model, groups),
            "use_distributed_optimizer": bool(optimizer is not None and optimizer.distributed),
        },
        "train_state": _state_dict_of(state),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "optimizer": {
            "saved": saved_optim,
            "type": optimizer.config.optimizer if optimizer is not None else None,
            "grad_scaler": optimizer.grad_scaler.state_dict()
            if optimizer is not None and optimizer.grad_scaler is not None
            else None,
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
            if optimizer is not None
            else [],
        },
        "rng_saved": not config.no_save_rng,
        "run_config": run_config_dict(run_config),
        "extra": dict(metadata or {}),
    }


def _remove_stale_tmp_dirs(root: Path) -> None:
    for path in list_tmp_dirs(root):
        shutil.rmtree(path, ignore_errors=True)
        log0(f"  removed {path.name}: an earlier save that did not complete")


# -- the entry point -------------------------------------------------------------------------------


def save_checkpoint(
    config,
    state,
    model: list,
    optimizer,
    scheduler,
    groups,
    *,
    run_config: Any = None,
    metadata: dict | None = None,
) -> float:
    """Save a checkpoint of iteration ``state.iteration`` into ``config.save`` (collective).

    Args:
        config: :class:`~mcore.checkpoint.config.CheckpointConfig` (``save``, ``no_save_optim``,
            ``no_save_rng``, ``async_save``).
        state: the training progress (a dataclass such as ``TrainState``; saved as a dict).
        model: this rank's model chunks (``DistributedDataParallel`` or plain ``GPTModel``).
        optimizer: a :class:`~mcore.optimizer.MegatronOptimizer` or None.
        scheduler: an LR scheduler with ``state_dict()`` or None.
        groups: the :class:`~mcore.distributed.groups.ProcessGroups`.
        run_config: the ``RunConfig`` (or a dict) stored in the metadata.
        metadata: extra JSON-able facts stored under ``"extra"`` (e.g. the tokenizer's vocabulary size).

    Returns:
        Seconds the caller was blocked (with ``async_save`` only the host copy).

    Raises:
        CheckpointError: on every rank if any rank failed; the previous checkpoint stays valid.
    """
    global _pending
    if not config.save:
        raise CheckpointError("save_checkpoint: no save directory (--save) is configured")
    wait_for_async_save()
    started = time.perf_counter()
    root = Path(config.save)
    iteration = int(state.iteration)
    log0(f"saving checkpoint at iteration {iteration:7d} to {root}")
    tmp = root / tmp_dir_name(iteration, _save_token(root))
    payloads, common, error = _snapshot_or_error(
        tmp, config, state, model, optimizer, scheduler, groups, run_config, metadata
    )
    device = next((p.device for chunk in model for p in chunk.parameters()), torch.device("cpu"))
    job = _SaveJob(
        root=root,
        tmp=tmp,
        iteration=iteration,
        payloads=payloads,
        common=common,
        coords=(groups.tp_rank, groups.pp_rank, data_parallel_index(groups)),
        device=device,
        started=started,
        error=error,
    )
    if config.async_save:
        job.blocked_s = time.perf_counter() - started
        job.start_thread()
        _pending = job
        log0(
            f"  checkpoint of iteration {iteration} is being written in the background "
            f"(training was blocked {job.blocked_s:.3f} s for the device-to-host copy)"
        )
        return job.blocked_s
    job.run()
    job.blocked_s = time.perf_counter() - started
    _commit(job)
    return time.perf_counter() - started


def _save_token(root: Path) -> str:
    """The token of this save's temporary directory, made on rank 0 (after creating ``root`` and
    removing stale temporary directories) and broadcast (collective).

    Raises:
        CheckpointError: on every rank, when rank 0 cannot create ``root``.
    """
    token = None
    if _rank() == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            _remove_stale_tmp_dirs(root)
            token = new_tmp_token()
        except OSError as err:
            token = f"error: cannot create {root}: {err}"
    token = _broadcast_object(token)
    if token.startswith("error:"):
        raise CheckpointError(token.removeprefix("error: "))
    return token


def _snapshot_or_error(
    tmp: Path, config, state, model: list, optimizer, scheduler, groups, run_config, metadata
) -> tuple[list[_FilePayload], dict | None, str | None]:
    """Create ``tmp`` and take this rank's host copy of what it saves (rank 0: with the common
    metadata); ``(payloads, common, error)``, the error reported to every rank by the commit."""
    error = None
    payloads: list[_FilePayload] = []
    common = None
    try:
        try:
            tmp.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise CheckpointError(f"cannot create {tmp}: {err.strerror or err}") from None
        payloads = _snapshot(config, model, optimizer, groups)
        if _rank() == 0:
            common = _common_metadata(
                config, state, model, optimizer, scheduler, groups, run_config, metadata
            )
    except CheckpointError as err:
        error = str(err)
    except Exception as err:  # noqa: BLE001 - reported to every rank by the commit
        error = f"{type(err).__name__}: {err}\n{traceback.format_exc(limit=4)}"
    return payloads, common, error
