"""``pretrain()``: Megatron's training entry point on mcore's parts.

The caller supplies three functions, as with Megatron-LM's ``pretrain``:

* ``model_provider(cfg, groups, vocab_size, *, pre_process, post_process, layer_offset, num_layers)
  -> Module`` builds one model chunk (``vocab_size`` is the padded vocabulary);
* ``datasets_provider(cfg, tokenizer, train_valid_test_num_samples) -> (train, valid, test)``;
* ``forward_step(data_iterator, model) -> (output_tensor, loss_func)`` runs one micro-batch (the
  contract of :func:`mcore.pipeline.schedules.get_forward_backward_func`).

Order of one run: parse flags -> select the device backend -> process groups (:func:`pretrain`) ->
seeds -> tokenizer and padded vocabulary -> model chunks (layout-independent init) -> DDP ->
optimizer -> LR schedule -> load checkpoint -> data loaders (:func:`build_training`, which returns a
:class:`~mcore.training.context.TrainContext`) -> train loop (step, log, evaluate, save, exit checks)
-> final save -> final evaluation (:meth:`mcore.training.trainer.Trainer.train`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import logging
import math
import sys
from collections.abc import Callable, Iterator, Sequence

import torch.distributed as dist

from mcore.backend import DeviceBackend, current_backend
from mcore.checkpoint.format import CheckpointError
from mcore.config.fields import ConfigError
from mcore.data.builder import build_train_valid_test_datasets
from mcore.data.errors import DataError
from mcore.data.loader import build_pretraining_data_loader
from mcore.data.tokenizers import build_tokenizer
from mcore.distributed.ddp import DistributedDataParallel, unwrap_model
from mcore.distributed.groups import LaunchEnv, ProcessGroups, destroy_parallel, initialize_parallel
from mcore.distributed.launcher import hand_to_launcher, under_launcher
from mcore.distributed.watchdog import watch_job
from mcore.fp8.grouped import experts_fp8_status
from mcore.models.transformer.context_parallel.checks import check_context_parallel
from mcore.models.transformer.layer_graphs import (
    GRAPH_SAFE_RECOMPUTE_MODULES,
    attach_layer_graphs,
    check_layer_graphs,
)
from mcore.models.transformer.model_config import padded_vocab_size, validate_model_parallel
from mcore.optimizer import build_optimizer, format_memory_report
from mcore.pipeline.encoder_decoder import (
    ModelType,
    build_encoder_decoder_chunks,
    encoder_decoder_stages,
    encoder_decoder_tensor_shapes,
)
from mcore.pipeline.layout import build_model_chunks
from mcore.plugins.manager import BackendSelectionError, PluginError, plugin_manager, select_backend
from mcore.tensor_parallel.random import model_parallel_seed
from mcore.training.checkpointer import load_train_state
from mcore.training.context import TrainContext, TrainResult, TrainState
from mcore.training.lr_scheduler import LRScheduler
from mcore.training.metrics import format_arguments_block, format_parameter_count
from mcore.training.microbatches import MicroBatchCalculator
from mcore.training.run_config import RunConfig, parse_run_config
from mcore.training.timers import Timers
from mcore.training.trainer import Trainer, print_rank_0, print_rank_last
from mcore.utils.console import configure_console
from mcore.utils.outputs import OutputError, check_not_input, check_writable, relation

__all__ = [
    "GRAPH_SAFE_RECOMPUTE_MODULES",
    "ModelType",
    "TrainContext",
    "TrainResult",
    "TrainState",
    "Trainer",
    "Timers",
    "build_model",
    "build_training",
    "check_run_config",
    "gpt_datasets_provider",
    "pretrain",
    "print_rank_0",
    "print_rank_last",
    "setup_backend",
]

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------------
# set-up


def setup_backend(cfg: RunConfig) -> DeviceBackend:
    """Select ``--device-backend`` and let plugins check the configuration."""
    backend = select_backend(cfg.parallel.device_backend)
    plugin_manager().hook.mcore_configure(backend=backend, configs=cfg.as_dict())
    return backend


def check_expert_layout(cfg: RunConfig, world_size: int) -> None:
    """The expert grid tiles the world (every factor named), and expert parallelism has experts."""
    from mcore.distributed.topology import Topology

    par = cfg.parallel
    ep, etp = par.expert_model_parallel_size, par.expert_tensor_parallel_size
    if getattr(cfg.model, "num_experts", None) is None and (
        ep > 1 or etp not in (None, par.tensor_model_parallel_size)
    ):
        raise ConfigError(
            f"expert_model_parallel_size={ep}, expert_tensor_parallel_size={etp} need --num-experts "
            "(a dense model has no experts to split)"
        )
    tp, pp, cp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size, par.context_parallel_size
    Topology.create(world_size, 0, tp=tp, pp=pp, cp=cp, order=par.parallel_order, ep=ep, etp=etp)


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
    check_expert_layout(cfg, world_size)
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
    check_context_parallel(
        model,
        cfg.parallel,
        reset_attention_mask=getattr(cfg.data, "reset_attention_mask", False),
        device_graph_impl=training.device_graph_impl,
    )
    if training.device_graph_impl == "local":
        check_layer_graphs(cfg, backend)
    check_save_dir(cfg.checkpoint.save, cfg.checkpoint.load)
    if "fp8" in cfg.as_dict():
        cfg.fp8.check_with(
            model.num_layers,
            backend.capabilities(),
            backend.name,
            use_distributed_optimizer=cfg.optimizer.use_distributed_optimizer,
        )
    return cfg.replace(training=training)


def check_save_dir(save: str | None, load: str | None) -> None:
    """``--save`` can be written (not under a file, not in a read-only directory): found now, not at
    the first save hours later. ``--save`` equal to ``--load`` is Megatron's resume; one nested in the
    other is refused (the output rule of :mod:`mcore.utils.outputs`)."""
    if not save:
        return
    try:
        check_writable("--save", save, directory=True)
        if load and relation(save, load) not in (None, "is"):
            check_not_input("--save", save, {"--load": load})
    except OutputError as err:
        raise ConfigError(str(err)) from None


def build_model(
    cfg: RunConfig,
    groups: ProcessGroups,
    model_provider: Callable,
    vocab_size: int,
    model_type: ModelType = ModelType.encoder_or_decoder,
):
    """This rank's model chunks, each wrapped for data-parallel gradient reduction.

    An encoder-decoder model (T5) is laid out by :mod:`mcore.pipeline.encoder_decoder`: its provider
    gets ``add_encoder``/``add_decoder`` and each stack's layer range instead of ``layer_offset``."""
    provider = functools.partial(model_provider, cfg, groups, vocab_size)
    if model_type == ModelType.encoder_and_decoder:
        chunks = build_encoder_decoder_chunks(provider, groups, _encoder_decoder_stages(cfg))
    else:
        chunks = build_model_chunks(provider, groups, cfg.parallel, cfg.model.num_layers)
    if cfg.training.compile_layers:
        backend = current_backend()
        if "compile_layers" not in backend.capabilities():
            raise ConfigError(f"--compile-layers: backend {backend.name!r} cannot compile layers")
        for chunk in chunks:
            # GPT's decoder, BERT's encoder, T5's encoder and decoder (either may be None on a stage)
            for stack in (getattr(chunk, "encoder", None), getattr(chunk, "decoder", None)):
                for layer in stack.layers if stack is not None else ():
                    backend.compile_layer(layer)
    if cfg.training.device_graph_impl == "local":
        attach_layer_graphs(chunks, current_backend())
    ddp_config = cfg.ddp.with_training(cfg.optimizer, cfg.precision, cfg.as_dict().get("fp8"))
    return [DistributedDataParallel(chunk, ddp_config, groups) for chunk in chunks]


def _encoder_decoder_stages(cfg: RunConfig):
    m = cfg.model
    return encoder_decoder_stages(
        m.encoder_num_layers,
        m.decoder_num_layers,
        cfg.parallel.pipeline_model_parallel_size,
        cfg.parallel.pipeline_model_parallel_split_rank,
    )


def pipeline_tensor_shapes(cfg: RunConfig, groups: ProcessGroups, model_type: ModelType):
    """The schedule's ``tensor_shapes``: None (one ``[s, b, h]`` tensor) except for an encoder-decoder
    model on several stages (:func:`~mcore.pipeline.encoder_decoder.encoder_decoder_tensor_shapes`)."""
    if model_type != ModelType.encoder_and_decoder or groups.pp_size == 1:
        return None
    m = cfg.model
    return encoder_decoder_tensor_shapes(
        _encoder_decoder_stages(cfg),
        encoder_seq_length=m.encoder_seq_length,
        decoder_seq_length=m.decoder_seq_length,
        micro_batch_size=cfg.training.micro_batch_size,
        hidden_size=m.hidden_size,
        tensor_model_parallel_size=groups.tp_size,
        sequence_parallel=cfg.parallel.sequence_parallel,
    )


def train_valid_test_num_samples(cfg: RunConfig, state: TrainState | None = None) -> tuple[int, int, int]:
    """Samples each split must provide (Megatron's formula).

    On a resume (``state``) each split also covers the samples already consumed plus what the rest of
    the run reads at *this* run's batch settings: a smaller ``--global-batch-size`` or ``--eval-iters``
    than the checkpoint's run otherwise leaves the consumed position past the end of the split. The
    positions continue from the consumed counts, as in Megatron; unchanged settings give Megatron's
    counts exactly."""
    t = cfg.training
    gbs = t.global_batch_size
    if t.train_samples is not None:
        train = t.train_samples
        iters = math.ceil(train / gbs)
    else:
        iters = t.train_iters or 0
        train = iters * gbs
    evals = (iters // t.eval_interval + 1) * t.eval_iters
    valid = evals * gbs
    if state is not None and state.iteration > 0:
        left = max(iters - state.iteration, 0)
        train = max(train, state.consumed_train_samples + left * gbs)
        valid = max(valid, state.consumed_valid_samples + (left // t.eval_interval + 1) * t.eval_iters * gbs)
    return train, valid, t.eval_iters * gbs


def build_data_iterators(
    cfg: RunConfig,
    groups: ProcessGroups,
    tokenizer,
    datasets_provider: Callable,
    state: TrainState,
    backend: DeviceBackend,
    num_chunks: int,
    every_stage: bool = False,
):
    """Per split: whether it exists (known on every rank) and, on the ranks that take data (first and
    last pipeline stage; every stage with ``every_stage``, as an encoder's padding mask and an
    encoder-decoder model's masks are needed by every layer), one iterator per model chunk (each chunk
    reads the same micro-batches)."""
    datasets = datasets_provider(cfg, tokenizer, train_valid_test_num_samples(cfg, state))
    # A split asked for no samples (--eval-iters 0) may hold none (a tiny test share): no loader then.
    datasets = [ds if ds is not None and len(ds) > 0 else None for ds in datasets]
    exists = tuple(ds is not None for ds in datasets)
    if not (every_stage or groups.is_first_stage or groups.is_last_stage):
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


USER_ERRORS = (ConfigError, DataError, CheckpointError)
"""Errors of the user's input or environment (flags, data, a damaged checkpoint, a full disk): one line on
stderr from the rank that saw it first, exit status 2, no traceback (:func:`watch_job`)."""


def pretrain(
    model_provider: Callable,
    forward_step: Callable,
    datasets_provider: Callable = gpt_datasets_provider,
    *,
    argv: Sequence[str] | None = None,
    extra_config_groups: dict[str, type] | None = None,
    cfg: RunConfig | None = None,
    args_defaults: dict | None = None,
    data_on_every_stage: bool = False,
    flops_per_sample: Callable | None = None,
    model_type: ModelType = ModelType.encoder_or_decoder,
) -> TrainResult:
    """Train a model with Megatron-LM's command line (see the module docstring for the providers).

    User mistakes (bad flags, impossible layouts, unavailable backends, missing data) end the process
    with one message on stderr and exit status 2. ``args_defaults`` are the script's own defaults by
    config field name, as in Megatron (``{"tokenizer_type": "GPT2BPETokenizer"}``). The console lines
    are ``mcore`` log records (:func:`mcore.utils.console.configure_console`).

    For models other than GPT: ``data_on_every_stage`` gives every pipeline stage a data iterator (an
    encoder's layers all need the batch's padding mask; GPT's read data on the first and last stage
    only); ``flops_per_sample(model_config, padded_vocab_size)`` is the model's training FLOPs per
    sample for the throughput line (default :func:`mcore.training.flops.gpt_flops_per_sample`);
    ``model_type``: Megatron's ``ModelType`` (``encoder_and_decoder`` for T5: see
    :mod:`mcore.pipeline.encoder_decoder`).
    """
    configure_console()
    try:
        cfg = cfg or _parse_once(argv, extra_config_groups, args_defaults)
        backend = setup_backend(cfg)
        world_size = dist.get_world_size() if dist.is_initialized() else LaunchEnv.from_environ().world_size
        cfg = check_run_config(cfg, backend, world_size)
        owns_process_group = not dist.is_initialized()
        groups = initialize_parallel(cfg.parallel, backend)
    except (ConfigError, BackendSelectionError, PluginError) as err:
        # The flags are the same on every rank, and so is the error: one line (rank 0's, or mcore-run's
        # from any rank), not one per rank.
        if not hand_to_launcher(f"error: {err}", 2) and _launch_rank() == 0:
            logger.error(f"error: {err}")
        raise SystemExit(2) from None
    try:
        with watch_job(groups, cfg.parallel, user_errors=USER_ERRORS):
            return _pretrain(
                cfg, groups, backend, model_provider, forward_step, datasets_provider,
                data_on_every_stage=data_on_every_stage, flops_per_sample=flops_per_sample,
                model_type=model_type,
            )  # fmt: skip
    except USER_ERRORS as err:
        if not hand_to_launcher(f"error (rank {groups.rank}): {err}", 2):
            logger.error(f"error (rank {groups.rank}): {err}")
        raise SystemExit(2) from None
    finally:
        # Tear down what this call set up, while the interpreter is whole (see destroy_parallel).
        if owns_process_group:
            groups = None  # noqa: F841 - the last handle of every subgroup must go before the collection
            destroy_parallel()


def _parse_once(argv, extra_config_groups, args_defaults) -> RunConfig:
    """:func:`parse_run_config`, whose usage errors and ``--help`` (argparse prints them) only rank 0
    shows: the flags are the same on every rank, so a torchrun job shows one message, not one per rank."""
    quiet, launcher = _launch_rank() != 0, under_launcher()
    if not (quiet or launcher):
        return parse_run_config(argv, extra_config_groups, args_defaults=args_defaults)
    err = io.StringIO()
    out = io.StringIO() if quiet else sys.stdout  # rank 0's --help is shown
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            cfg = parse_run_config(argv, extra_config_groups, args_defaults=args_defaults)
    except SystemExit as exit_:
        # Under mcore-run every rank hands the usage error over (mcore-run prints it once).
        if exit_.code not in (0, None) and hand_to_launcher(err.getvalue().strip(), 2):
            raise
        if not quiet:
            sys.stderr.write(err.getvalue())
        raise
    if not quiet:
        sys.stderr.write(err.getvalue())  # rank 0's warnings
    return cfg


def _launch_rank() -> int:
    """This process's rank before the process groups exist (0 when it cannot be told)."""
    if dist.is_initialized():
        return dist.get_rank()
    try:
        return LaunchEnv.from_environ().rank
    except Exception:  # noqa: BLE001 - an unusable launch environment: say the error anyway
        return 0


def _pretrain(
    cfg: RunConfig,
    groups: ProcessGroups,
    backend: DeviceBackend,
    model_provider: Callable,
    forward_step: Callable,
    datasets_provider: Callable,
    *,
    data_on_every_stage: bool = False,
    flops_per_sample: Callable | None = None,
    model_type: ModelType = ModelType.encoder_or_decoder,
) -> TrainResult:
    ctx = build_training(
        cfg, groups, backend, model_provider, datasets_provider,
        data_on_every_stage=data_on_every_stage, model_type=model_type,
    )  # fmt: skip
    return Trainer.from_context(ctx, forward_step, flops_per_sample=flops_per_sample).train()


def build_training(
    cfg: RunConfig,
    groups: ProcessGroups,
    backend: DeviceBackend,
    model_provider: Callable,
    datasets_provider: Callable | None = gpt_datasets_provider,
    *,
    vocab_size: int | None = None,
    verbose: bool = True,
    data_on_every_stage: bool = False,
    model_type: ModelType = ModelType.encoder_or_decoder,
) -> TrainContext:
    """Build a run on set-up process groups: seeds, tokenizer and padded vocabulary, model chunks (DDP),
    optimizer, micro-batch calculator, LR schedule, the ``--load`` checkpoint, data iterators.

    ``datasets_provider=None`` builds no data (the caller feeds the steps, as the throughput benchmark
    does); ``vocab_size`` replaces the tokenizer's vocabulary size before padding; ``verbose=False``
    prints nothing (the arguments block, the backend line, the parameter count, ``--log-memory``);
    ``data_on_every_stage``: see :func:`pretrain`.
    """
    t = cfg.training
    _check_model_type(cfg, model_type)
    say = functools.partial(print_rank_0, groups) if verbose else (lambda message: None)
    say(format_arguments_block(cfg.as_dict(), {"world_size": groups.world_size}))
    model_parallel_seed(t.seed, groups.tp_rank, groups.pp_rank)
    tokenizer = build_tokenizer(cfg.tokenizer)
    unpadded = vocab_size if vocab_size is not None else tokenizer.vocab_size
    vocab = padded_vocab_size(unpadded, cfg.model.make_vocab_size_divisible_by, groups.tp_size)
    say(
        f"> backend {backend.name} ({backend.is_available()[1]}); world {groups.world_size} = "
        f"tp {groups.tp_size} x pp {groups.pp_size} x dp {groups.dp_size}"
        + (f" x cp {groups.cp_size} ({cfg.parallel.cp_comm_type})" if groups.cp_size > 1 else "")
        + f"; padded vocab {vocab}"
    )

    fp8 = cfg.fp8 if "fp8" in cfg.as_dict() else None
    if getattr(cfg.model, "moe", None) is not None and fp8 is not None and fp8.enabled:
        say("> " + experts_fp8_status(fp8, backend.capabilities(), backend.name, groups.etp_size)[1])
    model = build_model(cfg, groups, model_provider, vocab, model_type)
    if verbose and groups.dp_rank == 0:
        count = sum(p.nelement() for chunk in model for p in unwrap_model(chunk).parameters())
        logger.info(format_parameter_count(groups.tp_rank, groups.pp_rank, count))
    optimizer = build_optimizer(cfg.optimizer, cfg.precision, model, groups, lr=cfg.scheduler.lr or 0.0)
    batches, scheduler = _batches_and_schedule(cfg, groups, optimizer)
    state = load_train_state(cfg, model, optimizer, scheduler, groups, TrainState, tokenizer.vocab_size)
    batches.update(state.consumed_train_samples)
    ctx = TrainContext(
        cfg=cfg, groups=groups, backend=backend, tokenizer=tokenizer, padded_vocab_size=vocab,
        tokenizer_vocab_size=tokenizer.vocab_size, model=model, optimizer=optimizer, scheduler=scheduler,
        batches=batches, state=state, tensor_shapes=pipeline_tensor_shapes(cfg, groups, model_type),
    )  # fmt: skip
    if datasets_provider is not None:
        every_stage = data_on_every_stage or model_type == ModelType.encoder_and_decoder
        _attach_data(ctx, datasets_provider, every_stage, say)
    if verbose and t.log_memory:
        log_memory_per_rank(groups, optimizer.memory_report())
    return ctx


def _check_model_type(cfg: RunConfig, model_type: ModelType) -> None:
    """A pipeline split rank (the encoder's stages) only with an encoder-decoder model.

    Raises:
        ConfigError: ``--pipeline-model-parallel-split-rank`` for a model of one stack.
    """
    if (
        cfg.parallel.pipeline_model_parallel_split_rank is not None
        and model_type != ModelType.encoder_and_decoder
    ):
        raise ConfigError(
            "--pipeline-model-parallel-split-rank / --encoder-pipeline-model-parallel-size split an "
            "encoder-decoder model (T5, examples/pretrain_t5.py) over the pipeline; this model has one stack"
        )


def _batches_and_schedule(
    cfg: RunConfig, groups: ProcessGroups, optimizer
) -> tuple[MicroBatchCalculator, LRScheduler]:
    """The micro-batch calculator (with ``--rampup-batch-size``) and the LR schedule of ``optimizer``."""
    t = cfg.training
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
    return batches, scheduler


def _attach_data(ctx: TrainContext, datasets_provider: Callable, every_stage: bool, say: Callable) -> None:
    """The data iterators (train, validation, test) of ``ctx``'s run, resuming at its state; says so
    when ``--eval-iters`` asks for validation the data has none of."""
    cfg = ctx.cfg
    (_, ctx.has_valid, ctx.has_test), (ctx.train_iter, ctx.valid_iter, ctx.test_iter) = build_data_iterators(
        cfg,
        ctx.groups,
        ctx.tokenizer,
        datasets_provider,
        ctx.state,
        ctx.backend,
        len(ctx.model),
        every_stage=every_stage,
    )  # fmt: skip
    if cfg.training.eval_iters > 0 and not ctx.has_valid:
        say(no_validation_warning(cfg))


def log_memory_per_rank(groups: ProcessGroups, report: dict[str, int]) -> None:
    """Log every rank's parameter / gradient / optimizer-state bytes on rank 0 (so the 1/DP saving of
    the distributed optimizer is visible); large jobs get the smallest and largest rank only."""
    reports = [report]
    if dist.is_initialized() and groups.world_size > 1:
        reports = [None] * groups.world_size
        dist.all_gather_object(reports, report)
    if groups.rank != 0:
        return
    if len(reports) <= 16:
        for rank, r in enumerate(reports):
            logger.info(f"> memory rank {rank}: {format_memory_report(r)}")
        return
    by_state = sorted(range(len(reports)), key=lambda i: reports[i]["optimizer_state"])
    for label, rank in (("least", by_state[0]), ("most", by_state[-1])):
        logger.info(f"> memory rank {rank} ({label} optimizer state): {format_memory_report(reports[rank])}")
