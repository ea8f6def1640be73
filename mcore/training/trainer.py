"""The training loop: :class:`Trainer` runs training and evaluation steps over this rank's model
chunks, and :meth:`Trainer.train` the loop (step, log, evaluate, save, exit) of a run that
:func:`mcore.training.pretrain.build_training` built.

Its parts: :class:`~mcore.training.step_stats.StepStats` (the steps' results, read at log
intervals), :mod:`mcore.training.step_logs` (the logs' averages over micro-batches and data-parallel
ranks), :class:`~mcore.training.nan_check.DeferredNanCheck` (the deferred NaN check),
:class:`~mcore.training.metrics.MetricsWriter` (the log line, TensorBoard, JSON),
:class:`~mcore.training.checkpointer.Checkpointer` (when to save), :mod:`mcore.training.signals`
(when to stop) and :mod:`mcore.models.transformer.layer_graphs` (when to capture device graphs).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import time
from collections.abc import Callable, Sequence

import torch

from mcore.backend import DeviceBackend
from mcore.distributed.ddp import DistributedDataParallel, unwrap_model
from mcore.distributed.finalize import finalize_model_grads
from mcore.distributed.groups import ProcessGroups
from mcore.distributed.watchdog import note_step
from mcore.fp8.scaling import DelayedScaleUpdate
from mcore.models.transformer.layer_graphs import arm_after_warmup, layer_graphs_of
from mcore.models.transformer.mtp.block import mtp_step_logs
from mcore.pipeline.schedules import ForwardBackwardArgs, get_forward_backward_func
from mcore.training.checkpointer import Checkpointer
from mcore.training.context import TrainContext, TrainResult, TrainState
from mcore.training.device_memory import release_unused_device_memory
from mcore.training.flops import gpt_flops_per_sample
from mcore.training.lr_scheduler import LRScheduler
from mcore.training.metrics import MetricsWriter, Timer, eval_tensorboard_scalars
from mcore.training.microbatches import MicroBatchCalculator
from mcore.training.moe_step import find_routers, finish_moe_step
from mcore.training.nan_check import DeferredNanCheck
from mcore.training.nothing_trains import check_first_step_trains
from mcore.training.params_norm import params_l2_norm
from mcore.training.run_config import RunConfig
from mcore.training.signals import ExitFlags, SignalHandler, exit_message, exit_reason
from mcore.training.step_logs import average_logs, reduce_logs
from mcore.training.step_stats import StepStats
from mcore.training.timers import Timers
from mcore.training.token_id_check import TokenIdCheck

logger = logging.getLogger(__name__)


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
        self._layer_graphs = layer_graphs_of([unwrap_model(chunk) for chunk in model])
        self.nan_check = DeferredNanCheck(self._ddp_chunks, groups.rank, self.device)
        """The deferred NaN check's staged flags (:mod:`mcore.training.nan_check`)."""
        self.fp8_scales = DelayedScaleUpdate(model)
        """The delayed FP8 recipe's step boundary (amax reduction, histories, scales); a no-op without it."""
        self.token_ids = TokenIdCheck(model, getattr(cfg, "data", None))
        """The per-batch vocabulary check: staged every step, read with the deferred NaN check."""
        self.moe = getattr(getattr(cfg, "model", None), "moe", None)
        self.routers = find_routers(model) if self.moe is not None else []
        """The MoE routers (expert-bias update and MoE logs after each step: :mod:`mcore.training.moe_step`)."""
        self.timers = Timers()
        """Phase timers (``--timing-log-level``; none run by default, see :mod:`mcore.training.timers`)."""
        self.context: TrainContext | None = None
        """The built run that :meth:`train` trains (set by :meth:`from_context`)."""
        self.model_flops_per_sample: Callable = gpt_flops_per_sample
        """``(model_config, padded_vocab_size) -> FLOPs`` of one training sample (the throughput line)."""
        self.stop_evaluating: Callable[[], bool] | None = None
        """With ``--exit-signal-handler``: whether the ranks agree a signal came (a collective, asked
        after every evaluation step, so a preemption notice is acted on within one step, not after
        the whole evaluation that the launcher's grace period may not cover)."""
        self.eval_steps_done = 0
        """Steps the last :meth:`evaluate` ran (fewer than asked when a signal stopped it)."""

    @classmethod
    def from_context(
        cls, ctx: TrainContext, forward_step: Callable, *, flops_per_sample: Callable | None = None
    ) -> Trainer:
        """A trainer of the run that :func:`~mcore.training.pretrain.build_training` built;
        ``flops_per_sample(model_config, padded_vocab_size)`` counts the model's FLOPs (default GPT's)."""
        trainer = cls(
            ctx.cfg, ctx.groups, ctx.backend, ctx.model, ctx.optimizer, ctx.scheduler, forward_step,
            ctx.batches,
        )  # fmt: skip
        trainer.context = ctx
        if flops_per_sample is not None:
            trainer.model_flops_per_sample = flops_per_sample
        return trainer

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
                # each context-parallel rank holds (and pipelines) seq_length / cp tokens
                seq_length=self.cfg.model.seq_length // self.groups.cp_size,
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
                tensor_shapes=self.context.tensor_shapes if self.context is not None else None,
            )
        )

    def _average_logs(self, logs: list[dict]) -> dict[str, torch.Tensor]:
        """This rank's micro-batch means of the logged values, on the device
        (:func:`~mcore.training.step_logs.average_logs`)."""
        return average_logs(logs, self.device)

    def reduce_logs(self, steps: Sequence[dict[str, torch.Tensor]]) -> list[dict[str, float]]:
        """The floats of the logs of several steps (from :meth:`train_step`), each averaged over the
        data-parallel ranks: one collective and one wait for the device for all of them
        (:func:`~mcore.training.step_logs.reduce_logs`, a collective over ``groups.dp`` on the last
        pipeline stage)."""
        return reduce_logs(steps, self.groups)

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
        self.token_ids.check(wait=False)
        self._train_mode()
        arm_after_warmup(
            self._layer_graphs,
            self.steps_run,
            self.cfg.training.device_graph_warmup_steps,
            self.batches.num_microbatches,
        )
        self.steps_run += 1
        self.optimizer.zero_grad()
        with self.timers("forward-backward"):
            logs = self._run_schedule(data_iterator, forward_only=False)
        self.token_ids.stage(f"iteration {self.iteration}")
        moe_logs = {}
        if self.moe is not None:  # once per step, after gradient accumulation
            moe_logs = finish_moe_step(
                self.routers, self.moe, self.groups, self.batches.num_microbatches, self.device
            )
        if self.cfg.model.mtp_num_layers:  # Megatron's "mtp_k loss" logs, once per step
            moe_logs.update(
                mtp_step_logs(
                    self.model,
                    self.groups,
                    self.batches.num_microbatches,
                    self.cfg.model.mtp_num_layers,
                    self.device,
                )
            )
        # delayed FP8 recipe only; over dp x cp (Megatron's amax-reduction group with context parallelism)
        self.fp8_scales((self.groups.tp, self.groups.dp_cp))
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
            self.nan_check.stage(self.iteration, grad_norm)
        if ok:
            self.scheduler.step(self.batches.current_global_batch_size)
        return {**self._average_logs(logs), **moe_logs}, ok, grad_norm

    def check_nan(self, wait: bool = True) -> None:
        """Raise the NaN error of an earlier step whose deferred NaN check found one (a no-op when
        nothing is deferred; :meth:`~mcore.training.nan_check.DeferredNanCheck.check`). ``wait=False``
        checks only the steps whose flags reached the host."""
        self.nan_check.check(wait)

    @torch.no_grad()
    def evaluate(self, data_iterator, iters: int) -> dict[str, float]:
        for chunk in self.model:
            chunk.eval()
        steps = []
        for _ in range(iters):
            steps.append(self._average_logs(self._run_schedule(data_iterator, forward_only=True)))
            if self.stop_evaluating is not None and self.stop_evaluating():
                break  # every rank agreed after the same step
        self.eval_steps_done = len(steps)
        self.token_ids.stage(f"an evaluation after iteration {self.iteration}")
        totals: dict[str, float] = {}
        for logs in self.reduce_logs(steps):
            for key, value in logs.items():
                totals[key] = totals.get(key, 0.0) + value / len(steps)
        self.token_ids.check()  # the device is past the evaluation: its logs were read
        for chunk in self.model:
            chunk.train()
        return totals

    # ----------------------------------------------------------------------------------------------
    # the loop

    def train(self) -> TrainResult:
        """Train the built run (:meth:`from_context`): steps until ``--train-iters`` (or the samples) or
        an exit condition, with logging, validation and saves at their intervals; then the final save,
        and the final validation and test when training finished."""
        ctx, t = self.context, self.cfg.training
        state = ctx.state
        self.timers = Timers(t.timing_log_level, t.timing_log_option, self.backend.synchronize)
        train_iter = self.timers.wrap_iterator(ctx.train_iter)
        writer = MetricsWriter(
            t,
            self.groups.rank == self.groups.last_rank,
            run_config={k: dataclasses.asdict(v) for k, v in self.cfg.as_dict().items()},
        )
        train_iters = t.train_iters if t.train_iters is not None else _iters_for_samples(t, self.batches)
        self.flops_per_sample = self.model_flops_per_sample(self.cfg.model, ctx.padded_vocab_size)
        self.peak_flops = (t.peak_tflops * 1e12) if t.peak_tflops else self.backend.peak_flops(self.dtype)
        timer = Timer(self.backend.synchronize)
        train_losses: list[float] = []
        handler = SignalHandler() if t.exit_signal_handler else contextlib.nullcontext()
        exit_flags = ExitFlags(t, handler, self.device, time.time())
        if t.exit_signal_handler:
            self.stop_evaluating = lambda: handler.received(self.device)
        stats = StepStats(
            state, self.scheduler, train_losses, reduce_logs=self.reduce_logs, checks=self._deferred_checks()
        )
        checkpointer = Checkpointer(
            self.cfg, self.model, self.optimizer, self.scheduler, self.groups,
            metadata={
                "tokenizer_vocab_size": ctx.tokenizer_vocab_size, "padded_vocab_size": ctx.padded_vocab_size,
                "tokenizer_identity": getattr(ctx.tokenizer, "identity", None),  # compared on resume
            },
            before_save=stats.flush,  # the saved state counts every step, and no NaN step is saved
        )  # fmt: skip

        stop = None
        with handler:
            timer.start()
            while not t.skip_train and state.iteration < train_iters and not stop:
                self._train_iteration(train_iter, state, stats)
                if state.iteration % t.log_interval == 0:
                    self._log_interval(state, stats, timer, writer, train_iters)
                if ctx.has_valid and t.eval_iters > 0 and state.iteration % t.eval_interval == 0:
                    self.evaluate_and_log(ctx.valid_iter, state, writer, "validation")
                    state.consumed_valid_samples += self.eval_steps_done * t.global_batch_size
                    if self.eval_steps_done < t.eval_iters:  # a signal stopped it: save and exit now
                        stop = "signal"
                checkpointer.maybe_save(state)
                stop = exit_reason(t, state.iteration, exit_flags) or stop
            stats.flush()
            checkpointer.maybe_save(state, final=True)
        checkpointer.finalize(blocking=True)
        if stop:
            saved = checkpointer.saved_dir(state.iteration)
            print_rank_0(self.groups, exit_message(stop, state.iteration, saved, t, handler))

        valid_loss = test_loss = None
        with handler:  # the checkpoint is saved: a signal now only ends the final evaluation, exit 0
            if not stop and t.eval_iters > 0 and ctx.has_valid:
                valid_loss = self.evaluate_and_log(ctx.valid_iter, state, writer, "validation", final=True)
                stop = "signal" if self.eval_steps_done < t.eval_iters else None
            if not stop and t.eval_iters > 0 and ctx.has_test:
                test_loss = self.evaluate_and_log(ctx.test_iter, state, writer, "test", final=True)
        writer.close()
        return TrainResult(state, train_losses, valid_loss, test_loss, exit_reason=stop or "finished")

    def _deferred_checks(self) -> list[Callable[[], None]]:
        """The deferred errors :class:`StepStats` raises before it reads the steps, in order: NaN
        (:meth:`check_nan`), a token id outside the vocabulary
        (:class:`~mcore.training.token_id_check.TokenIdCheck`), all-zero gradients under a static
        loss scale on the flat optimizer path (``MegatronOptimizer.check_deferred_underflow``)."""
        checks = [self.check_nan, self.token_ids.check]
        check_underflow = getattr(self.optimizer, "check_deferred_underflow", None)
        if check_underflow is not None:  # the flat optimizer's all-zero-gradient check
            checks.append(check_underflow)
        return checks

    def _train_iteration(self, train_iter, state: TrainState, stats: StepStats) -> None:
        """One step, and the state's counters after it; its results stay on the device (``stats``
        reads them at log intervals)."""
        self.batches.update(state.consumed_train_samples)
        note_step(state.iteration + 1)
        losses, ok, grad_norm = self.train_step(train_iter, iteration=state.iteration + 1)
        state.iteration += 1
        gbs = self.batches.current_global_batch_size
        state.consumed_train_samples += gbs
        state.floating_point_operations_so_far += self.flops_per_sample * gbs
        if not ok:
            state.skipped_iterations += 1
        elif self.steps_run == 1 and getattr(self.optimizer, "grad_scaler", None) is None:
            check_first_step_trains(grad_norm, self.cfg, state.iteration)  # a loss scale has its own check
        stats.add(losses, ok, grad_norm, gbs)

    def _log_interval(self, state: TrainState, stats: StepStats, timer: Timer, writer, train_iters) -> None:
        """The log line, TensorBoard tags and JSON record of the interval that ends at this step."""
        t = self.cfg.training
        elapsed = timer.stop()
        params_norm = params_l2_norm(self.model, self.groups, self.device) if t.log_params_norm else None
        stats.flush()
        losses, steps = stats.end_interval()
        writer.log_step(
            state, train_iters, seconds_per_iter=elapsed / steps,
            global_batch_size=self.batches.current_global_batch_size, seq_length=self.cfg.model.seq_length,
            learning_rate=self.scheduler.get_lr(), losses=losses, loss_scale=self.optimizer.loss_scale,
            grad_norm=stats.grad_norm, params_norm=params_norm, flops_per_sample=self.flops_per_sample,
            world_size=self.groups.world_size, peak_flops=self.peak_flops, memory=self.backend.memory_stats(),
            times=self.timers.collect(steps, self.device),
        )  # fmt: skip
        timer.start()

    def evaluate_and_log(
        self, data_iter, state: TrainState, writer: MetricsWriter, split: str, final: bool = False
    ) -> float | None:
        """Evaluate ``--eval-iters`` batches of ``split``, print Megatron's line, log the losses;
        returns the ``lm loss`` (None off the ranks that have it)."""
        iters = self.cfg.training.eval_iters
        results = self.evaluate(data_iter, iters)
        if self.eval_steps_done < iters:
            print_rank_0(
                self.groups,
                f" {split} evaluation stopped after {self.eval_steps_done} of {iters} iterations: a signal "
                "was received (--exit-signal-handler)",
            )
            return None
        if not results:
            return None
        parts = [f"{k} value: {v:.6E} | {k} PPL: {math.exp(min(v, 20)):.6E}" for k, v in results.items()]
        label = f"{split} loss at {'the end of training' if final else f'iteration {state.iteration}'}"
        print_rank_last(self.groups, f" {label} | " + " | ".join(parts))
        ppl = self.cfg.training.log_validation_ppl_to_tensorboard
        writer.tagged_scalars(
            state.iteration, state.consumed_train_samples, eval_tensorboard_scalars(results, split, ppl)
        )
        writer.record(state.iteration, {**results, "final": final}, kind=split)
        return results.get("lm loss")


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


def print_rank_last(groups: ProcessGroups, message: str) -> None:
    """Megatron's ``print_rank_last``: ``message`` as an INFO record on the last rank (where the
    losses are), shown on stdout by :func:`mcore.utils.console.configure_console`."""
    if groups.rank == groups.last_rank:
        logger.info(message)


def print_rank_0(groups: ProcessGroups, message: str) -> None:
    """Megatron's ``print_rank_0``: ``message`` as an INFO record on rank 0."""
    if groups.rank == 0:
        logger.info(message)
