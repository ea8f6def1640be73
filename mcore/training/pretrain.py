"""``pretrain()``: Megatron's training entry point on mcore's parts.

The caller supplies three functions, as with Megatron-LM's ``pretrain``:

* ``model_provider(cfg, groups, vocab_size, *, pre_process, post_process, layer_offset, num_layers)
  -> Module`` builds one model chunk (``vocab_size`` is the padded vocabulary);
* ``datasets_provider(cfg, tokenizer, train_valid_test_num_samples) -> (train, valid, test)``;
* ``forward_step(data_iterator, model) -> (output_tensor, loss_func)`` runs one micro-batch (the
  contract of :func:`mcore.pipeline.schedules.get_forward_backward_func`).

Order of one run: parse flags -> select the device backend -> process groups -> seeds -> tokenizer
and padded vocabulary -> model chunks (layout-independent init) -> DDP -> optimizer -> LR schedule
-> load checkpoint -> data loaders -> train loop (evaluate, save, exit checks) -> final evaluation.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import math
import sys
import time
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from mcore.backend import DeviceBackend, current_backend
from mcore.config.fields import ConfigError
from mcore.data.builder import build_train_valid_test_datasets
from mcore.data.errors import DataError
from mcore.data.loader import build_pretraining_data_loader
from mcore.data.tokenizers import build_tokenizer
from mcore.distributed.ddp import DistributedDataParallel, unwrap_model
from mcore.distributed.finalize import finalize_model_grads
from mcore.distributed.groups import LaunchEnv, ProcessGroups, destroy_parallel, initialize_parallel
from mcore.distributed.watchdog import note_step, watch_job
from mcore.models.config import padded_vocab_size, validate_model_parallel
from mcore.models.layer_graphs import LayerGraphs
from mcore.optimizer import build_optimizer, format_memory_report
from mcore.pipeline.layout import build_model_chunks
from mcore.pipeline.schedules import ForwardBackwardArgs, get_forward_backward_func
from mcore.plugins.manager import BackendSelectionError, PluginError, plugin_manager, select_backend
from mcore.tensor_parallel.fp8 import update_fp8_scales
from mcore.tensor_parallel.random import model_parallel_seed
from mcore.training.device_memory import release_unused_device_memory
from mcore.training.flops import gpt_flops
from mcore.training.lr_scheduler import LRScheduler
from mcore.training.metrics import (
    MetricsWriter,
    Timer,
    eval_tensorboard_scalars,
    format_arguments_block,
    format_parameter_count,
    format_train_line,
    train_tensorboard_scalars,
)
from mcore.training.microbatches import MicroBatchCalculator
from mcore.training.params_norm import params_l2_norm
from mcore.training.run_config import RunConfig, parse_run_config
from mcore.training.signals import SignalHandler, exit_message
from mcore.training.timers import Timers, format_timers, timer_scalars
from mcore.utils.async_host import HostValue, host_floats, stage_to_host


@dataclasses.dataclass
class TrainState:
    """Progress that a checkpoint saves and a resume restores."""

    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    skipped_iterations: int = 0
    nan_iterations: int = 0
    floating_point_operations_so_far: float = 0.0


@dataclasses.dataclass
class TrainResult:
    """What :func:`pretrain` returns (the tests compare runs through it)."""

    state: TrainState
    train_losses: list[float]
    valid_loss: float | None
    test_loss: float | None
    exit_reason: str


def print_rank_last(groups: ProcessGroups, message: str) -> None:
    if groups.rank == groups.last_rank:
        print(message, flush=True)


def print_rank_0(groups: ProcessGroups, message: str) -> None:
    if groups.rank == 0:
        print(message, flush=True)


# --------------------------------------------------------------------------------------------------
# set-up


def setup_backend(cfg: RunConfig) -> DeviceBackend:
    """Select ``--device-backend`` and let plugins check the configuration."""
    backend = select_backend(cfg.parallel.device_backend)
    plugin_manager().hook.mcore_configure(backend=backend, configs=cfg.as_dict())
    return backend


def check_run_config(cfg: RunConfig, backend: DeviceBackend, world_size: int) -> RunConfig:
    """Cross-group validation and derived defaults, before any communication."""
    model, training = cfg.model, cfg.training
    validate_model_parallel(model, cfg.parallel)
    if training.train_iters is None and training.train_samples is None and not training.skip_train:
        raise ConfigError("give --train-iters or --train-samples")
    tp, pp, cp = (
        cfg.parallel.tensor_model_parallel_size,
        cfg.parallel.pipeline_model_parallel_size,
        cfg.parallel.context_parallel_size,
    )
    if world_size % (tp * pp * cp) != 0:
        raise ConfigError(
            f"world_size={world_size} is not divisible by tensor_model_parallel_size={tp} x "
            f"pipeline_model_parallel_size={pp} x context_parallel_size={cp}"
        )
    dp = world_size // (tp * pp * cp)
    if training.global_batch_size is None:
        training = dataclasses.replace(training, global_batch_size=training.micro_batch_size * dp)
    precision = cfg.precision
    if precision.bf16 and "bf16" not in backend.capabilities():
        raise ConfigError(f"--bf16: backend {backend.name!r} does not support bf16")
    if precision.fp16 and "fp16" not in backend.capabilities():
        raise ConfigError(f"--fp16: backend {backend.name!r} does not support fp16")
    if cfg.scheduler.lr is None and not training.skip_train:
        raise ConfigError("--lr is required")
    if training.device_graph_impl == "local":
        _check_layer_graphs(cfg, backend)
    if "fp8" in cfg.as_dict():
        cfg.fp8.check_with(model.num_layers, backend.capabilities(), backend.name)
    return cfg.replace(training=training)


# Selective recompute modules that device graphs can capture: they recompute inside the backward pass
# that reads them (mcore.tensor_parallel.recompute.RecomputeWhenSaved) and run no backward of their own.
GRAPH_SAFE_RECOMPUTE_MODULES = frozenset({"layernorm", "mlp_act"})


def _check_layer_graphs(cfg: RunConfig, backend: DeviceBackend) -> None:
    """What ``--cuda-graph-impl local`` (:mod:`mcore.models.layer_graphs`) cannot replay."""
    model, parallel = cfg.model, cfg.parallel
    flag = "--cuda-graph-impl local"
    if "device_graphs" not in backend.capabilities():
        raise ConfigError(f"{flag}: backend {backend.name!r} has no device graphs")
    if parallel.pipeline_model_parallel_size > 1:
        raise ConfigError(
            f"{flag} keeps one micro-batch's layer activations at a time: it needs "
            f"--pipeline-model-parallel-size 1 (got {parallel.pipeline_model_parallel_size})"
        )
    if cfg.training.compile_layers:
        raise ConfigError(f"{flag} and --compile-layers: choose one")
    captured_recompute = model.selective_recompute_modules - GRAPH_SAFE_RECOMPUTE_MODULES
    if model.recompute_granularity == "full" or captured_recompute:
        # The backward graph is captured with torch.autograd.grad; a checkpointed region backpropagates
        # with its own backward() call, which accumulates into .grad instead of returning gradients.
        # layernorm and mlp_act recompute inside the backward that reads them, which is captured.
        what = (
            "--recompute-granularity full"
            if model.recompute_granularity == "full"
            else f"--recompute-modules {' '.join(sorted(captured_recompute))}"
        )
        raise ConfigError(
            f"{flag}: {what} cannot be captured (a checkpointed region runs its own backward pass); "
            "--recompute-granularity selective --recompute-modules layernorm mlp_act can"
        )
    if model.attention_dropout > 0.0:
        raise ConfigError(
            f"{flag}: --attention-dropout {model.attention_dropout} draws from the tensor-parallel RNG "
            "stream, whose state swaps cannot be captured; use --attention-dropout 0"
        )
    if model.hidden_dropout > 0.0 and parallel.sequence_parallel:
        raise ConfigError(
            f"{flag}: --hidden-dropout {model.hidden_dropout} with --sequence-parallel draws from the "
            "tensor-parallel RNG stream, whose state swaps cannot be captured"
        )
    if cfg.optimizer.overlap_param_gather:
        raise ConfigError(
            f"{flag}: --overlap-param-gather waits for parameters in module hooks that a replay skips"
        )


def build_model(cfg: RunConfig, groups: ProcessGroups, model_provider: Callable, vocab_size: int):
    """This rank's model chunks, each wrapped for data-parallel gradient reduction."""
    provider = functools.partial(model_provider, cfg, groups, vocab_size)
    chunks = build_model_chunks(provider, groups, cfg.parallel, cfg.model.num_layers)
    if cfg.training.compile_layers:
        backend = current_backend()
        if "compile_layers" not in backend.capabilities():
            raise ConfigError(f"--compile-layers: backend {backend.name!r} cannot compile layers")
        for chunk in chunks:
            for layer in chunk.decoder.layers:
                backend.compile_layer(layer)
    if cfg.training.device_graph_impl == "local":
        for chunk in chunks:
            chunk.decoder.layer_graphs = LayerGraphs(chunk.decoder.layers, current_backend())
    ddp_config = cfg.ddp.with_training(cfg.optimizer, cfg.precision)
    return [DistributedDataParallel(chunk, ddp_config, groups) for chunk in chunks]


def train_valid_test_num_samples(cfg: RunConfig) -> tuple[int, int, int]:
    """Samples each split must provide (Megatron's formula)."""
    t = cfg.training
    if t.train_samples is not None:
        train = t.train_samples
        iters = math.ceil(train / t.global_batch_size)
    else:
        iters = t.train_iters or 0
        train = iters * t.global_batch_size
    evals = (iters // t.eval_interval + 1) * t.eval_iters
    return train, evals * t.global_batch_size, t.eval_iters * t.global_batch_size


def build_data_iterators(
    cfg: RunConfig,
    groups: ProcessGroups,
    tokenizer,
    datasets_provider: Callable,
    state: TrainState,
    backend: DeviceBackend,
    num_chunks: int,
):
    """Per split: whether it exists (known on every rank) and, on the ranks that take data (first and
    last pipeline stage), one iterator per model chunk (each chunk reads the same micro-batches)."""
    datasets = datasets_provider(cfg, tokenizer, train_valid_test_num_samples(cfg))
    # A split asked for no samples (--eval-iters 0) may hold none (a tiny test share): no loader then.
    datasets = [ds if ds is not None and len(ds) > 0 else None for ds in datasets]
    exists = tuple(ds is not None for ds in datasets)
    if not (groups.is_first_stage or groups.is_last_stage):
        return exists, (None, None, None)
    pin = backend.device_type != "cpu"
    mbs = cfg.training.micro_batch_size
    iterators = []
    consumed_per_split = (state.consumed_train_samples, state.consumed_valid_samples, 0)
    for split, ds, consumed in zip(("train", "valid", "test"), datasets, consumed_per_split):
        if ds is None:
            iterators.append(None)
            continue
        per_chunk = [
            _cycle(
                build_pretraining_data_loader(
                    ds,
                    consumed,
                    mbs,
                    groups.dp_rank,
                    groups.dp_size,
                    cfg.data.num_workers,
                    pin,
                    dataloader_type=cfg.data.dataloader_type,
                    seed=cfg.training.seed,
                    split=split,
                )
            )
            for _ in range(num_chunks)
        ]
        iterators.append(per_chunk if num_chunks > 1 else per_chunk[0])
    return exists, tuple(iterators)


def _cycle(loader) -> Iterator:
    """Iterate a loader forever (validation restarts after its samples run out, as in Megatron)."""
    while True:
        yield from loader


def gpt_datasets_provider(cfg: RunConfig, tokenizer, num_samples: Sequence[int]):
    """The default datasets provider: Megatron's GPT datasets from ``--data-path`` (or ``--mock-data``)."""
    return build_train_valid_test_datasets(
        cfg.data, tokenizer, cfg.model.seq_length, cfg.training.seed, num_samples
    )


def no_validation_warning(cfg: RunConfig) -> str:
    """The one line said when ``--eval-iters`` asks for validation that has no data.

    A warning, not an error: Megatron trains on without validation here (and its default
    ``--eval-iters`` is 100, so ``--split 100,0,0`` alone is how its users say "no validation")."""
    d = cfg.data
    if d.data_path:
        why = f"--split {d.split!r} gives validation a share of 0"
    elif d.train_data_path:
        why = "no --valid-data-path is given"
    else:
        why = "the datasets provider built no validation dataset"
    return (
        f"WARNING: --eval-iters {cfg.training.eval_iters} but there is no validation data ({why}): "
        "this run does not validate. Give validation data (e.g. --split 969,30,1) or set --eval-iters 0."
    )


# --------------------------------------------------------------------------------------------------
# one step


class Trainer:
    """Runs training and evaluation steps over this rank's model chunks.

    A training step never waits for the device (the host keeps issuing work while the device runs):
    :meth:`train_step` returns the logged values as device tensors, and the caller reads them with
    :meth:`reduce_logs` when it needs them (at log intervals). With an optimizer that skips a
    non-finite update on the device (``skips_nonfinite_on_device``) the data-parallel NaN check is
    deferred as well: each step's NaN flags are staged to the host (:func:`stage_to_host`) and
    checked during the next step (:meth:`check_nan`), when the device is past them, so the error
    comes one step late but the parameters never took the NaN step. Otherwise the check stays in
    :meth:`~mcore.distributed.ddp.DistributedDataParallel.finish_grad_sync` and waits, as before.
    """

    def __init__(
        self,
        cfg: RunConfig,
        groups: ProcessGroups,
        backend: DeviceBackend,
        model: list,
        optimizer,
        scheduler: LRScheduler,
        forward_step: Callable,
        batches: MicroBatchCalculator,
    ):
        self.cfg, self.groups, self.backend = cfg, groups, backend
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.forward_step = forward_step
        self.batches = batches
        vp = len(model)
        self.schedule = get_forward_backward_func(groups.pp_size, vp)
        self.dtype = cfg.precision.params_dtype
        self.device = groups.device
        self._chunk_modules = [list(chunk.modules()) for chunk in model]
        self._ddp_chunks = [chunk for chunk in model if isinstance(chunk, DistributedDataParallel)]
        self.iteration = 0
        """The iteration of the last :meth:`train_step` (named in a deferred NaN error)."""
        self.steps_run = 0
        """Training steps this trainer ran (the device graphs are captured after the warm-up ones)."""
        decoders = [getattr(unwrap_model(chunk), "decoder", None) for chunk in model]
        self._layer_graphs = [
            d.layer_graphs for d in decoders if getattr(d, "layer_graphs", None) is not None
        ]
        self._pending_nan: collections.deque[tuple[int, HostValue, list[int], int | None]] = (
            collections.deque()
        )
        self.timers = Timers()
        """Phase timers (``--timing-log-level``; none run by default, see :mod:`mcore.training.timers`)."""

    def _train_mode(self) -> None:
        """Put every module in training mode; ``Module.train()`` only when one is not (it sets an
        attribute through ``Module.__setattr__`` on every module, about 1 ms for a 24-layer GPT,
        at the start of the step while the device waits)."""
        for chunk, modules in zip(self.model, self._chunk_modules):
            if not all(m.training for m in modules):
                chunk.train()

    def _run_schedule(self, data_iterator, forward_only: bool) -> list[dict]:
        return self.schedule(
            ForwardBackwardArgs(
                forward_step_func=self.forward_step,
                data_iterator=data_iterator,
                model=self.model,
                num_microbatches=self.batches.num_microbatches,
                seq_length=self.cfg.model.seq_length,
                micro_batch_size=self.cfg.training.micro_batch_size,
                hidden_size=self.cfg.model.hidden_size,
                groups=self.groups,
                sequence_parallel=self.cfg.parallel.sequence_parallel,
                dtype=self.dtype,
                forward_only=forward_only,
                grad_scale_func=None if forward_only else self.optimizer.scale_loss,
                no_sync_func=None if forward_only else [chunk.no_sync for chunk in self.model],
                finalize_grads_func=None
                if forward_only
                else functools.partial(finalize_model_grads, groups=self.groups),
                timeout_s=self.cfg.parallel.distributed_timeout_minutes * 60.0,
            )
        )

    def _average_logs(self, logs: list[dict]) -> dict[str, torch.Tensor]:
        """Mean of each logged value over this rank's micro-batches (on the last stage), as 0-d device
        tensors: nothing is read on the host, and the data-parallel average is :meth:`reduce_logs`'s."""
        if not logs:
            return {}
        keys = sorted(logs[0])
        values = torch.stack(
            [torch.stack([log[k].detach().float().reshape(()) for k in keys]) for log in logs]
        )
        mean = values.mean(0).to(self.device)
        return dict(zip(keys, mean.unbind()))

    def reduce_logs(self, steps: Sequence[dict[str, torch.Tensor]]) -> list[dict[str, float]]:
        """The floats of the logs of several steps (from :meth:`train_step`), each averaged over the
        data-parallel ranks: one collective and one wait for the device for all of them.

        A collective over ``groups.dp`` on the last pipeline stage: every data-parallel rank there calls
        it with the same steps (elsewhere the logs are empty and nothing is communicated).
        """
        out: list[dict[str, float]] = [{} for _ in steps]
        by_keys: dict[tuple[str, ...], list[int]] = {}
        for i, logs in enumerate(steps):
            if logs:
                by_keys.setdefault(tuple(logs), []).append(i)
        for keys, indices in by_keys.items():
            values = torch.stack([torch.stack([steps[i][k] for k in keys]) for i in indices])
            if self.groups.dp is not None and self.groups.dp_size > 1:
                dist.all_reduce(values, group=self.groups.dp)
                values /= self.groups.dp_size
            for i, row in zip(indices, values.tolist()):
                out[i] = {k: float(v) for k, v in zip(keys, row)}
        return out

    def defers_nan_check(self) -> bool:
        """Whether the NaN check of the gradients is deferred (see the class docstring)."""
        return bool(getattr(self.optimizer, "skips_nonfinite_on_device", False)) and any(
            chunk.ddp_config.check_for_nan_in_loss_and_grad for chunk in self._ddp_chunks
        )

    def train_step(
        self, data_iterator, iteration: int | None = None
    ) -> tuple[dict[str, torch.Tensor], bool, float | torch.Tensor | None]:
        """One optimizer step over a global batch, without waiting for the device.

        Returns ``(logs, update_successful, grad_norm)``: ``logs`` maps each logged name to this rank's
        micro-batch mean as a 0-d device tensor (read them with :meth:`reduce_logs`; empty off the last
        pipeline stage); ``update_successful`` and ``grad_norm`` as the optimizer's ``step()`` returned
        them (``grad_norm`` a float, None, or a 0-d device tensor whose non-finite value means the
        update was skipped on the device). ``iteration`` (default: one more than the last) names the
        step in a deferred NaN error.
        """
        self.iteration = iteration if iteration is not None else self.iteration + 1
        deferred = self.defers_nan_check()
        for chunk in self._ddp_chunks:
            chunk.defer_nan_check = deferred
        self.check_nan(wait=False)  # flags of earlier steps that have reached the host already
        self._train_mode()
        if self.steps_run >= self.cfg.training.device_graph_warmup_steps:
            for graphs in self._layer_graphs:
                if not graphs.captured:
                    graphs.arm()  # captured in this step's first forward
        self.steps_run += 1
        self.optimizer.zero_grad()
        with self.timers("forward-backward"):
            logs = self._run_schedule(data_iterator, forward_only=False)
        update_fp8_scales(self.model, (self.groups.tp, self.groups.dp))  # delayed FP8 recipe only
        if self.cfg.training.empty_unused_memory_level >= 1:
            release_unused_device_memory(self.backend.device_type)
        # The previous step's flags: the device has this step's forward and backward queued behind
        # them, so waiting for them does not let it run dry.
        self.check_nan()
        with self.timers("optimizer"):
            ok, grad_norm, _ = self.optimizer.step()
        if self.cfg.training.empty_unused_memory_level >= 2:
            release_unused_device_memory(self.backend.device_type)
        if deferred:
            self._stage_nan_check(grad_norm)
        if ok:
            self.scheduler.step(self.batches.current_global_batch_size)
        return self._average_logs(logs), ok, grad_norm

    def _stage_nan_check(self, grad_norm) -> None:
        """Stage this step's NaN flags (and a tensor gradient norm) for :meth:`check_nan`."""
        parts, counts = [], []
        for chunk in self._ddp_chunks:
            flags = chunk.nan_flags()
            counts.append(0 if flags is None else flags.numel())
            if flags is not None:
                parts.append(flags.float())
        norm_at = None
        if isinstance(grad_norm, torch.Tensor):
            norm_at = sum(counts)
            parts.append(grad_norm.detach().float().reshape(1).to(self.device))
        if parts:
            staged = stage_to_host(torch.cat(parts))
            self._pending_nan.append((self.iteration, staged, counts, norm_at))

    def check_nan(self, wait: bool = True) -> None:
        """Raise the NaN error of an earlier step whose deferred NaN check found one (a no-op when
        nothing is deferred). ``wait=False`` checks only the steps whose flags reached the host.

        Raises:
            RuntimeError: the DDP message (rank, parameters) naming the iteration; or, when only the
                global gradient norm is NaN (a NaN on another rank, or made by the reduction), a
                message naming the iteration and the rank.
        """
        while self._pending_nan:
            iteration, staged, counts, norm_at = self._pending_nan[0]
            if not wait and not staged.ready():
                return
            self._pending_nan.popleft()
            values = staged.tolist()
            offset = 0
            for chunk, count in zip(self._ddp_chunks, counts):
                if count:
                    chunk.raise_if_nan(values[offset : offset + count], iteration=iteration)
                offset += count
            if norm_at is not None and math.isnan(values[norm_at]):
                raise RuntimeError(
                    f"NaN in the gradients of iteration {iteration} on rank {self.groups.rank}: the "
                    "global gradient norm is NaN (the update was skipped)"
                )

    @torch.no_grad()
    def evaluate(self, data_iterator, iters: int) -> dict[str, float]:
        for chunk in self.model:
            chunk.eval()
        steps = [
            self._average_logs(self._run_schedule(data_iterator, forward_only=True)) for _ in range(iters)
        ]
        totals: dict[str, float] = {}
        for logs in self.reduce_logs(steps):
            for key, value in logs.items():
                totals[key] = totals.get(key, 0.0) + value / iters
        for chunk in self.model:
            chunk.train()
        return totals


# --------------------------------------------------------------------------------------------------
# the loop


def _flops_per_sample(cfg: RunConfig, vocab_size: int) -> float:
    m = cfg.model
    return gpt_flops(
        batch_size=1,
        seq_length=m.seq_length,
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        vocab_size=vocab_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups if m.group_query_attention else None,
        ffn_hidden_size=m.ffn_hidden_size,
        swiglu=m.swiglu,
        kv_channels=m.kv_channels,
    )


def _load_checkpoint(
    cfg: RunConfig, model, optimizer, scheduler, groups, tokenizer_vocab_size: int | None = None
) -> TrainState:
    if not cfg.checkpoint.load:
        return TrainState()
    from mcore.checkpoint import load_checkpoint

    return load_checkpoint(
        cfg.checkpoint, model, optimizer, scheduler, groups, state_cls=TrainState, seed=cfg.training.seed,
        run_config=cfg, tokenizer_vocab_size=tokenizer_vocab_size,
    )  # fmt: skip


def _save_checkpoint(
    cfg: RunConfig, state: TrainState, model, optimizer, scheduler, groups, metadata=None
) -> float:
    from mcore.checkpoint import save_checkpoint

    start = time.perf_counter()
    save_checkpoint(
        cfg.checkpoint, state, model, optimizer, scheduler, groups, run_config=cfg, metadata=metadata
    )
    return time.perf_counter() - start


def _finalize_async_save(cfg: RunConfig, blocking: bool) -> None:
    """Commit a ``--async-save`` checkpoint whose background write finished (collective)."""
    if cfg.checkpoint.save and cfg.checkpoint.async_save:
        from mcore.checkpoint import maybe_finalize_async_save

        maybe_finalize_async_save(blocking=blocking)


def pretrain(
    model_provider: Callable,
    forward_step: Callable,
    datasets_provider: Callable = gpt_datasets_provider,
    *,
    argv: Sequence[str] | None = None,
    extra_config_groups: dict[str, type] | None = None,
    cfg: RunConfig | None = None,
    args_defaults: dict | None = None,
) -> TrainResult:
    """Train a model with Megatron-LM's command line (see the module docstring for the providers).

    User mistakes (bad flags, impossible layouts, unavailable backends, missing data) end the process
    with one message on stderr and exit status 2. ``args_defaults`` are the script's own defaults by
    config field name, as in Megatron (``{"tokenizer_type": "GPT2BPETokenizer"}``).
    """
    try:
        cfg = cfg or parse_run_config(argv, extra_config_groups, args_defaults=args_defaults)
        backend = setup_backend(cfg)
        world_size = dist.get_world_size() if dist.is_initialized() else LaunchEnv.from_environ().world_size
        cfg = check_run_config(cfg, backend, world_size)
        owns_process_group = not dist.is_initialized()
        groups = initialize_parallel(cfg.parallel, backend)
    except (ConfigError, BackendSelectionError, PluginError) as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    try:
        with watch_job(groups, cfg.parallel, user_errors=(ConfigError, DataError)):
            return _pretrain(cfg, groups, backend, model_provider, forward_step, datasets_provider)
    except (ConfigError, DataError) as err:
        print(f"error (rank {groups.rank}): {err}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    finally:
        # Tear down what this call set up, while the interpreter is whole (see destroy_parallel).
        if owns_process_group:
            groups = None  # noqa: F841 - the last handle of every subgroup must go before the collection
            destroy_parallel()


def _pretrain(
    cfg: RunConfig,
    groups: ProcessGroups,
    backend: DeviceBackend,
    model_provider: Callable,
    forward_step: Callable,
    datasets_provider: Callable,
) -> TrainResult:
    t = cfg.training
    print_rank_0(groups, format_arguments_block(cfg.as_dict(), {"world_size": groups.world_size}))
    model_parallel_seed(t.seed, groups.tp_rank, groups.pp_rank)
    tokenizer = build_tokenizer(cfg.tokenizer)
    vocab = padded_vocab_size(tokenizer.vocab_size, cfg.model.make_vocab_size_divisible_by, groups.tp_size)
    print_rank_0(
        groups,
        f"> backend {backend.name} ({backend.is_available()[1]}); world {groups.world_size} = "
        f"tp {groups.tp_size} x pp {groups.pp_size} x dp {groups.dp_size}; padded vocab {vocab}",
    )

    model = build_model(cfg, groups, model_provider, vocab)
    if groups.dp_rank == 0:
        count = sum(p.nelement() for chunk in model for p in unwrap_model(chunk).parameters())
        print(format_parameter_count(groups.tp_rank, groups.pp_rank, count), flush=True)
    optimizer = build_optimizer(cfg.optimizer, cfg.precision, model, groups, lr=cfg.scheduler.lr or 0.0)
    batches = MicroBatchCalculator(
        global_batch_size=t.global_batch_size,
        micro_batch_size=t.micro_batch_size,
        data_parallel_size=groups.dp_size,
        rampup_batch_size=tuple(t.rampup_batch_size) if t.rampup_batch_size else None,
    )
    scheduler = LRScheduler.from_config(
        optimizer,
        cfg.scheduler,
        global_batch_size=t.global_batch_size,
        train_iters=t.train_iters,
        train_samples=t.train_samples,
    )
    state = _load_checkpoint(cfg, model, optimizer, scheduler, groups, tokenizer.vocab_size)
    batches.update(state.consumed_train_samples)
    (_, has_valid, has_test), (train_iter, valid_iter, test_iter) = build_data_iterators(
        cfg, groups, tokenizer, datasets_provider, state, backend, len(model)
    )
    if t.eval_iters > 0 and not has_valid:
        print_rank_0(groups, no_validation_warning(cfg))
    trainer = Trainer(cfg, groups, backend, model, optimizer, scheduler, forward_step, batches)
    trainer.timers = Timers(t.timing_log_level, t.timing_log_option, backend.synchronize)
    train_iter = trainer.timers.wrap_iterator(train_iter)
    is_logging_rank = groups.rank == groups.last_rank
    writer = MetricsWriter(
        t, is_logging_rank, run_config={k: dataclasses.asdict(v) for k, v in cfg.as_dict().items()}
    )
    if t.log_memory:
        log_memory_per_rank(groups, optimizer.memory_report())

    train_iters = t.train_iters if t.train_iters is not None else _iters_for_samples(t, batches)
    flops_per_sample = _flops_per_sample(cfg, vocab)
    peak = (t.peak_tflops * 1e12) if t.peak_tflops else backend.peak_flops(cfg.precision.params_dtype)
    timer = Timer(backend.synchronize)
    start_time = time.time()
    train_losses: list[float] = []
    exit_reason = "finished"
    handler = SignalHandler() if t.exit_signal_handler else contextlib.nullcontext()
    exit_flags = _ExitFlags(t, handler, trainer.device, start_time)
    stats = _StepStats(trainer, state, scheduler, train_losses)
    interval_steps = 0
    save_dir = cfg.checkpoint.save
    last_saved = None
    ckpt_meta = {"tokenizer_vocab_size": tokenizer.vocab_size, "padded_vocab_size": vocab}

    with handler:
        timer.start()
        while not t.skip_train and state.iteration < train_iters:
            batches.update(state.consumed_train_samples)
            note_step(state.iteration + 1)
            # The step's results stay on the device (no wait): ``stats`` reads them at log intervals.
            losses, ok, grad_norm = trainer.train_step(train_iter, iteration=state.iteration + 1)
            state.iteration += 1
            gbs = batches.current_global_batch_size
            state.consumed_train_samples += gbs
            state.floating_point_operations_so_far += flops_per_sample * gbs
            if not ok:
                state.skipped_iterations += 1
            stats.add(losses, ok, grad_norm, gbs)
            interval_steps += 1

            if state.iteration % t.log_interval == 0:
                elapsed = timer.stop()
                params_norm = params_l2_norm(model, groups, trainer.device) if t.log_params_norm else None
                stats.flush()
                per_iter = elapsed / interval_steps
                tokens = gbs * cfg.model.seq_length
                tflops = flops_per_sample * gbs / per_iter / groups.world_size
                mem = backend.memory_stats()
                values = {
                    "consumed_samples": state.consumed_train_samples,
                    "iteration_time_ms": 1000 * per_iter,
                    "learning_rate": scheduler.get_lr(),
                    "global_batch_size": gbs,
                    "losses": {k: v / interval_steps for k, v in stats.interval_losses.items()},
                    "loss_scale": host_floats([optimizer.loss_scale])[0],
                    "grad_norm": stats.grad_norm,
                    "params_norm": host_floats([params_norm])[0],
                    "skipped_iterations": state.skipped_iterations,
                    "nan_iterations": state.nan_iterations,
                    "tokens_per_s": tokens / per_iter,
                    "tflops_per_device": tflops / 1e12,
                    "mfu": tflops / peak if peak else None,
                    "mem_allocated_gib": mem["allocated"] / 2**30,
                    "mem_peak_gib": mem["peak_allocated"] / 2**30,
                    "mem_allocated_bytes": mem["allocated"],
                    "mem_peak_bytes": mem["peak_allocated"],
                }
                times = trainer.timers.collect(interval_steps, trainer.device)
                if is_logging_rank:
                    print(format_train_line(state.iteration, train_iters, values), flush=True)
                    if times:
                        print(format_timers(times, t.timing_log_option), flush=True)
                tags = train_tensorboard_scalars(values, log_timers=t.log_timers_to_tensorboard)
                if t.log_timers_to_tensorboard:
                    tags.update(timer_scalars(times))
                writer.tagged_scalars(state.iteration, state.consumed_train_samples, tags)
                flat = {k: v for k, v in values.items() if k != "losses"}
                flat.update(values["losses"])
                writer.record(state.iteration, flat)
                stats.interval_losses, interval_steps = {}, 0
                timer.start()

            if has_valid and t.eval_iters > 0 and state.iteration % t.eval_interval == 0:
                _evaluate_and_log(trainer, valid_iter, t.eval_iters, state, writer, groups, "validation")
                state.consumed_valid_samples += t.eval_iters * t.global_batch_size

            saved_now = False
            if (
                save_dir
                and cfg.checkpoint.save_interval
                and state.iteration % cfg.checkpoint.save_interval == 0
            ):
                stats.flush()  # the saved state counts every step, and no NaN step is saved
                _save_checkpoint(cfg, state, model, optimizer, scheduler, groups, ckpt_meta)
                last_saved, saved_now = state.iteration, True
            _finalize_async_save(cfg, blocking=False)

            reason = _exit_reason(t, state, exit_flags)
            if reason:
                exit_reason = reason
                stats.flush()
                if save_dir and not saved_now:
                    _save_checkpoint(cfg, state, model, optimizer, scheduler, groups, ckpt_meta)
                    last_saved = state.iteration
                break
        else:
            stats.flush()
            if save_dir and state.iteration > 0 and last_saved != state.iteration:
                _save_checkpoint(cfg, state, model, optimizer, scheduler, groups, ckpt_meta)
    _finalize_async_save(cfg, blocking=True)
    if exit_reason != "finished":
        saved = save_dir if save_dir and last_saved == state.iteration else None
        print_rank_0(groups, exit_message(exit_reason, state.iteration, saved, t, handler))

    valid_loss = test_loss = None
    if exit_reason == "finished" and t.eval_iters > 0:
        if has_valid:
            valid_loss = _evaluate_and_log(
                trainer, valid_iter, t.eval_iters, state, writer, groups, "validation", final=True
            )
        if has_test:
            test_loss = _evaluate_and_log(
                trainer, test_iter, t.eval_iters, state, writer, groups, "test", final=True
            )
    writer.close()
    return TrainResult(
        state=state,
        train_losses=train_losses,
        valid_loss=valid_loss,
        test_loss=test_loss,
        exit_reason=exit_reason,
    )


def log_memory_per_rank(groups: ProcessGroups, report: dict[str, int]) -> None:
    """Print every rank's parameter / gradient / optimizer-state bytes on rank 0 (so the 1/DP saving of
    the distributed optimizer is visible); large jobs get the smallest and largest rank only."""
    reports = [report]
    if dist.is_initialized() and groups.world_size > 1:
        reports = [None] * groups.world_size
        dist.all_gather_object(reports, report)
    if groups.rank != 0:
        return
    if len(reports) <= 16:
        for rank, r in enumerate(reports):
            print(f"> memory rank {rank}: {format_memory_report(r)}", flush=True)
        return
    by_state = sorted(range(len(reports)), key=lambda i: reports[i]["optimizer_state"])
    for label, rank in (("least", by_state[0]), ("most", by_state[-1])):
        print(
            f"> memory rank {rank} ({label} optimizer state): {format_memory_report(reports[rank])}",
            flush=True,
        )


def _iters_for_samples(t, batches: MicroBatchCalculator) -> int:
    """Iterations needed to consume ``--train-samples`` under the rampup."""
    consumed, iters = 0, 0
    probe = MicroBatchCalculator(
        global_batch_size=t.global_batch_size,
        micro_batch_size=t.micro_batch_size,
        data_parallel_size=batches.data_parallel_size,
        rampup_batch_size=batches.rampup,
    )
    while consumed < t.train_samples:
        probe.update(consumed)
        consumed += probe.current_global_batch_size
        iters += 1
    return iters


@dataclasses.dataclass
class _PendingStep:
    logs: dict[str, torch.Tensor]
    ok: bool
    grad_norm: float | torch.Tensor | None
    global_batch_size: int


class _StepStats:
    """The training steps' results, read on the host only when needed.

    :meth:`add` keeps a step's logs (device tensors) and gradient norm (a float, None, or a lazy 0-d
    device tensor) without reading them; :meth:`flush` reads every kept step at once (one
    data-parallel collective, one wait for the device) when a log line, a checkpoint or the end of
    training needs them, and first raises a deferred NaN error (:meth:`Trainer.check_nan`). Per step,
    in order, it then does what the loop did after each step before: count NaN/inf losses
    (``nan_iterations``), append the ``lm loss`` to ``train_losses``, add the losses to the sums of the
    current log interval; ``grad_norm`` becomes the last step's norm. A lazy norm that is not finite
    means the optimizer skipped that update on the device: the step counts as skipped, its norm as
    None (as the optimizer reports a skipped step's), and the LR schedule takes back the step it was
    advanced by (the host could not know at the time without waiting).
    """

    def __init__(self, trainer: Trainer, state: TrainState, scheduler: LRScheduler, train_losses: list):
        self.trainer, self.state, self.scheduler = trainer, state, scheduler
        self.train_losses = train_losses
        self.pending: list[_PendingStep] = []
        self.interval_losses: dict[str, float] = {}
        self.grad_norm: float | None = None

    def add(self, logs, ok: bool, grad_norm, global_batch_size: int) -> None:
        self.pending.append(_PendingStep(logs, ok, grad_norm, global_batch_size))

    def flush(self) -> None:
        self.trainer.check_nan()
        if not self.pending:
            return
        pending, self.pending = self.pending, []
        rows = self.trainer.reduce_logs([p.logs for p in pending])
        norms = host_floats([p.grad_norm for p in pending])
        for step, losses, norm in zip(pending, rows, norms):
            if isinstance(step.grad_norm, torch.Tensor) and norm is not None and not math.isfinite(norm):
                norm = None
                if step.ok:
                    self.state.skipped_iterations += 1
                    self.scheduler.step(-step.global_batch_size)
            if any(math.isnan(v) or math.isinf(v) for v in losses.values()):
                self.state.nan_iterations += 1
            if "lm loss" in losses:
                self.train_losses.append(losses["lm loss"])
            for k, v in losses.items():
                self.interval_losses[k] = self.interval_losses.get(k, 0.0) + v
            self.grad_norm = norm


class _ExitFlags:
    """``--exit-signal-handler`` and ``--exit-duration-in-mins`` without waiting for the device.

    Every rank must stop after the same iteration, so the ranks agree on the flags with an all-reduce
    (MAX). After each iteration :meth:`poll` launches that all-reduce on the device and stages its
    result to the host (:func:`stage_to_host`); the next :meth:`poll`, one iteration later, reads it
    (the device is past it by then, so the read hardly waits). Every rank reads the same iteration's
    agreed flags, so all stop together: one iteration after the signal or the deadline was seen.
    """

    def __init__(self, t, handler, device: torch.device, start_time: float):
        self.t, self.handler, self.device, self.start_time = t, handler, device, start_time
        self.active = bool(t.exit_signal_handler) or t.exit_duration_in_mins is not None
        self._staged: HostValue | None = None

    def poll(self) -> str | None:
        """The reason to stop that the ranks agreed on after the previous iteration (or None); then
        start the agreement on this iteration's flags. A collective when active: every rank calls it
        after every iteration."""
        if not self.active:
            return None
        reason = None
        if self._staged is not None:
            signal_seen, deadline_passed = self._staged.tolist()
            if signal_seen > 0:
                reason = "signal"
            elif deadline_passed > 0:
                reason = "exit-duration"
        flags = torch.zeros(2, device=self.device)  # filled on the device: no host-to-device copy
        if self.t.exit_signal_handler and self.handler.signaled:
            flags[0].fill_(1.0)
        minutes = (time.time() - self.start_time) / 60.0
        if self.t.exit_duration_in_mins is not None and minutes > self.t.exit_duration_in_mins:
            flags[1].fill_(1.0)
        if dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        self._staged = stage_to_host(flags)
        return reason


def _exit_reason(t, state: TrainState, exit_flags: _ExitFlags) -> str | None:
    agreed = exit_flags.poll()
    if agreed == "signal":
        return agreed
    if t.exit_interval and state.iteration % t.exit_interval == 0:
        return "exit-interval"
    return agreed


def _evaluate_and_log(
    trainer: Trainer,
    data_iter,
    iters: int,
    state: TrainState,
    writer: MetricsWriter,
    groups: ProcessGroups,
    split: str,
    final: bool = False,
) -> float | None:
    results = trainer.evaluate(data_iter, iters)
    if not results:
        return None
    parts = [f"{k} value: {v:.6E} | {k} PPL: {math.exp(min(v, 20)):.6E}" for k, v in results.items()]
    label = f"{split} loss at {'the end of training' if final else f'iteration {state.iteration}'}"
    print_rank_last(groups, f" {label} | " + " | ".join(parts))
    ppl = trainer.cfg.training.log_validation_ppl_to_tensorboard
    writer.tagged_scalars(
        state.iteration, state.consumed_train_samples, eval_tensorboard_scalars(results, split, ppl)
    )
    writer.record(state.iteration, {**results, "final": final}, kind=split)
    return results.get("lm loss")
