"""The optimizer: fp32 master weights, loss scaling, global-norm clipping, Adam/SGD, sharded or not.

One class serves every configuration. It works on *main parameters*: for every trainable model
parameter, the contiguous piece of it this rank updates, as a flat fp32 tensor.

==========================  ===============================  =====================================
                            replicated (default)             distributed (--use-distributed-optimizer)
==========================  ===============================  =====================================
piece of each parameter     all of it                        the part in this dp rank's bucket shard
fp32 params                 main = view of the model param   main = view of the model param
bf16/fp16 params            main = fp32 copy, copied back    main = fp32 copy of the piece, copied back
gradient                    ``param.main_grad`` (all-reduced) this rank's reduce-scattered shard
Adam moments                full size                        piece size (1/dp of the total)
after the step              nothing                          all-gather the parameter buckets
gradient norm reduced over  ``groups.mp`` (tp x pp)           all ranks
                            (experts: ``groups.expert_mp``)
expert-parallel params      as above, over ``groups.edp``    sharded over ``groups.edp``
==========================  ===============================  =====================================

``step()``:

1. gradients to fp32 main gradients (views when the buffer is fp32 already);
2. with a loss scaler: unscale, check for inf/NaN; if any rank overflowed, every rank skips the step
   and the scaler lowers the scale (``(False, None, None)`` is returned);
3. the global gradient norm, and clipping to ``--clip-grad``;
4. the update (``get_ops().adam_step``, the backend's fused kernel, or SGD with momentum; on the flat
   path ``adam_step_flat``, or ``adam_step_flat_fp8`` for a buffer of ``--fp8-param-gather`` weights on
   the delayed recipe, which also writes their FP8 copies);
5. fp32 masters copied back into bf16/fp16 parameters; with the distributed optimizer, updated shards
   all-gathered (asynchronously with ``--overlap-param-gather``: each module's forward pre-hook waits
   for the buckets of its own parameters).

State dict layout (per-parameter, so the checkpoint can reshard it): :mod:`mcore.optimizer.state_dict`.

The other parts: :mod:`mcore.optimizer.main_params` (each parameter's piece on this rank, the
parameter groups), :mod:`mcore.optimizer.updates` (the per-parameter Adam/SGD update),
:mod:`mcore.optimizer.flat_state` (the flat path's buffers), :mod:`mcore.optimizer.clip_grads` and
:mod:`mcore.optimizer.grad_scaler`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from mcore.backend import get_ops
from mcore.config.fields import ConfigError, check
from mcore.distributed.ddp import DistributedDataParallel, unwrap_model
from mcore.distributed.groups import ProcessGroups
from mcore.optimizer.clip_grads import (
    clip_grads_,
    global_grad_norm,
    norm_groups,
    reduce_norm_squared,
    unscale_and_check_,
)
from mcore.optimizer.config import OptimizerConfig, PrecisionConfig
from mcore.optimizer.flat_state import FlatBufferState
from mcore.optimizer.grad_scaler import build_grad_scaler, underflow_error
from mcore.optimizer.main_params import (
    MainParam,
    build_param_groups,
    default_no_weight_decay,
    make_main_param,
    trainable_parameters,
)
from mcore.optimizer.state_dict import gathered_state_dict, load_state_dict, state_dict
from mcore.optimizer.updates import adam_update, copy_main_to_model, sgd_update


class MegatronOptimizer:
    """Mixed-precision, optionally sharded Adam/SGD over all of a rank's model chunks.

    Build it with :func:`mcore.optimizer.build_optimizer`. ``param_groups`` is a list of dicts with
    ``params`` (model parameters), ``lr``, ``weight_decay``, ``wd_mult`` and ``lr_mult``; the LR
    scheduler writes ``lr`` (and ``weight_decay = wd * wd_mult``) before each step.
    """

    def __init__(
        self,
        config: OptimizerConfig,
        precision: PrecisionConfig,
        model_chunks: Sequence[torch.nn.Module],
        groups: ProcessGroups,
        *,
        lr: float = 0.0,
        no_weight_decay: Callable[[str, torch.nn.Parameter], bool] = default_no_weight_decay,
    ):
        self.config = config
        self.precision = precision
        self.model_chunks = list(model_chunks)
        self.groups = groups
        self.distributed = config.use_distributed_optimizer
        self.grad_scaler = build_grad_scaler(precision)
        self._check_chunks()

        tp_rank = groups.tp_rank
        named = trainable_parameters(self.model_chunks)
        self.param_groups, group_of = build_param_groups(named, no_weight_decay, config.weight_decay, lr)

        self.flat = config.uses_flat_adam(precision) and all(
            isinstance(chunk, DistributedDataParallel)
            and all(buffer.param_data is not None for buffer in chunk.grad_buffers)
            for chunk in self.model_chunks
        )
        """One-pass Adam over flat buffers (``adam_step_flat``): bf16/fp32 parameters in DDP buffers."""
        self.skips_nonfinite_on_device = self.flat
        """A non-finite gradient norm skips the update on the device; :meth:`step` never waits for it."""
        self._underflow_checked = False  # see _refuse_underflowed_gradients
        self._zero_norm_seen: torch.Tensor | None = None  # see check_deferred_underflow
        self.main_params: list[MainParam] = []
        for key, _, param, chunk in named:
            entry = make_main_param(
                key, param, chunk, group_of[id(param)], tp_rank, flat=self.flat, etp_rank=groups.etp_rank
            )
            if entry is not None:
                self.main_params.append(entry)
        self.flat_states: list[FlatBufferState] = []
        self._flat_of: dict[int, FlatBufferState] = {}
        if self.flat:
            self._init_flat_state()
        else:
            check(
                not config.params_are_masters(precision),
                "--main-params-dtype bf16 needs the one-pass optimizer over the DDP buffers (AdamW, the "
                "model in DistributedDataParallel with contiguous parameters); this model keeps fp32 masters",
            )
            self._init_state()
        device = next((p.model_param.device for p in self.main_params), None)
        self.device = device or torch.device("cpu")
        """Where the optimizer's own scalars live (the parameters' device)."""
        self.applied_steps = torch.zeros((), dtype=torch.int64, device=self.device)
        """Flat path: Adam's step ``t``, the number of updates applied, counted on the device (a step
        skipped there does not advance it); the entries' ``state["step"]`` mirror it in state dicts."""

    # ----------------------------------------------------------------------------------------------
    # construction

    def _check_chunks(self) -> None:
        for i, chunk in enumerate(self.model_chunks):
            ddp = chunk if isinstance(chunk, DistributedDataParallel) else None
            chunk_distributed = ddp is not None and ddp.ddp_config.use_distributed_optimizer
            if chunk_distributed != self.distributed:
                raise ConfigError(
                    f"model chunk {i} has use_distributed_optimizer={chunk_distributed} but the optimizer "
                    f"has use_distributed_optimizer={self.distributed}: wrap chunks with "
                    "DistributedDataParallel(module, ddp_config.with_training(optimizer_config, precision_config), groups)"
                )

    def _init_state(self) -> None:
        for entry in self.main_params:
            if self.config.optimizer == "adam":
                entry.state = {
                    "step": 0,
                    "exp_avg": torch.zeros_like(entry.main),
                    "exp_avg_sq": torch.zeros_like(entry.main),
                }
            else:
                entry.state = {"momentum_buffer": torch.zeros_like(entry.main)}

    def _init_flat_state(self) -> None:
        by_buffer: dict[int, list[MainParam]] = {}
        for entry in self.main_params:
            by_buffer.setdefault(id(entry.buffer), []).append(entry)
        remainders = self.config.stores_param_remainders(self.precision)
        in_params = self.config.params_are_masters(self.precision)
        moment_dtypes = self.config.moment_dtypes()
        for chunk in self.model_chunks:
            for buffer in chunk.grad_buffers:
                entries = by_buffer.get(id(buffer), [])
                pieces = [(e.model_param, e.start, e.end, e.group, e.counts_in_norm) for e in entries]
                flat = FlatBufferState(buffer, pieces, moment_dtypes, remainders, in_params)
                self.flat_states.append(flat)
                for entry in entries:
                    piece = flat.piece(entry.model_param)
                    self._flat_of[id(entry.model_param)] = flat
                    if flat.masters is not None:
                        entry.main = flat.state_view(flat.masters, piece)
                    elif flat.remainders is None:
                        entry.main = flat.param_view(piece)  # fp32 (or --main-params-dtype bf16) parameters
                    entry.state = {
                        "step": 0,
                        "exp_avg": flat.state_view(flat.exp_avg, piece),
                        "exp_avg_sq": flat.state_view(flat.exp_avg_sq, piece),
                    }

    def master_of(self, entry: MainParam) -> torch.Tensor:
        """``entry``'s fp32 master weights (a copy when they are stored as remainders, or are the bf16
        parameters themselves with ``--main-params-dtype bf16``)."""
        if entry.main is not None:
            return entry.main.float()
        flat = self._flat_of[id(entry.model_param)]
        return flat.read_master(flat.piece(entry.model_param))

    def set_master(self, entry: MainParam, value: torch.Tensor) -> None:
        """Set ``entry``'s fp32 master (and, on the flat path, the model parameter's rounding of it)."""
        if self.flat:
            flat = self._flat_of[id(entry.model_param)]
            flat.write_master(flat.piece(entry.model_param), value)
        else:
            entry.main.copy_(value)

    # ----------------------------------------------------------------------------------------------
    # loss scaling

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 without a scaler)."""
        return self.grad_scaler.scale if self.grad_scaler is not None else 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * loss_scale``: the schedule's ``grad_scale_func``."""
        if self.grad_scaler is None:
            return loss
        return loss * self.grad_scaler.scale

    # ----------------------------------------------------------------------------------------------
    # the step

    def _norm_group(self):
        return norm_groups(self.groups, self.distributed)[0]

    def _grad_norm(self, present) -> float:
        """The global norm of the counted gradients (dense and expert parts, see clip_grads)."""
        group, expert_group = norm_groups(self.groups, self.distributed)
        dense = [g for e, g in present if e.counts_in_norm and not (expert_group is not None and e.expert)]
        expert = [g for e, g in present if e.counts_in_norm and expert_group is not None and e.expert]
        return global_grad_norm(dense, group, self.device, expert, expert_group)

    def _main_grads(self) -> list[torch.Tensor | None]:
        grads = []
        for entry in self.main_params:
            grad = entry.grad_view()
            if grad is not None and grad.dtype != torch.float32:
                grad = grad.float()
            grads.append(grad)
        return grads

    @torch.no_grad()
    def step(self) -> tuple[bool, float | None, None]:
        """Apply one update. Returns ``(update_successful, grad_norm, num_zeros_in_grad)``.

        ``update_successful`` is False when the loss scaler found inf/NaN gradients on any rank (the
        step is skipped everywhere); ``grad_norm`` is the global norm before clipping, or None when
        clipping is off or the step was skipped; ``num_zeros_in_grad`` is not computed (None).
        """
        self.finish_param_sync()
        if self.flat:
            return self._flat_step()
        grads = self._main_grads()
        present = [(e, g) for e, g in zip(self.main_params, grads) if g is not None]
        grad_list = [g for _, g in present]

        if self.grad_scaler is not None:
            found_inf = unscale_and_check_(
                grad_list, self.grad_scaler.inv_scale, self.groups.world, self.device
            )
            self.grad_scaler.update(found_inf)
            if found_inf:
                return False, None, None

        grad_norm = None
        if self.config.clip_grad > 0.0:
            grad_norm = self._grad_norm(present)
            clip_grads_(grad_list, self.config.clip_grad, grad_norm)
        if self.grad_scaler is not None:
            self._refuse_underflowed_gradients(grad_norm, present)

        if self.config.optimizer == "adam":
            adam_update(self.config, self.param_groups, present)
        else:
            sgd_update(self.config, self.param_groups, present)

        copy_main_to_model([entry for entry, _ in present if entry.owns_copy])
        if self.distributed:
            for chunk in self.model_chunks:
                chunk.start_param_sync()
            if not self.config.overlap_param_gather:
                self.finish_param_sync()
        return True, grad_norm, None

    def _refuse_underflowed_gradients(self, grad_norm: float | None, present) -> None:
        """Raise :class:`LossScaleUnderflowError` when the global gradient norm is exactly 0 with a
        loss scale: the scaled gradients underflowed (a too-small static ``--loss-scale``).

        With clipping the norm is known every step, so every step is checked; without it the norm is
        computed (one more reduction and host read) only at the first applied step, where a scale too
        small for the model shows. Every rank sees the same global norm and raises together. The flat
        path checks every step on the device and raises later (:meth:`check_deferred_underflow`).
        """
        if grad_norm is None:
            if self._underflow_checked:
                return
            grad_norm = self._grad_norm(present)
        self._underflow_checked = True
        if grad_norm == 0.0:
            raise underflow_error(self.grad_scaler)

    def check_deferred_underflow(self) -> None:
        """Flat path: raise :class:`LossScaleUnderflowError` when a step since the last call had an
        all-zero global gradient with a loss scale (see :meth:`_refuse_underflowed_gradients`).

        The flat step keeps the decision on the device (``grad_norm == 0``, or-ed over the steps); the
        trainer calls this where it reads the steps' losses and norms anyway (a log interval, a save,
        the end of training), so the host waits for the device no more often than before. Every rank
        holds the same global norm and raises together. A no-op on the per-parameter path.
        """
        seen, self._zero_norm_seen = self._zero_norm_seen, None
        if seen is not None and bool(seen):
            raise underflow_error(self.grad_scaler)

    def _flat_step(self) -> tuple[bool, torch.Tensor | None, None]:
        """The one-pass step: norm, clipping coefficient and skip decision stay on the device.

        Returns ``(True, grad_norm, None)`` with ``grad_norm`` a 0-d fp32 device tensor (None when
        clipping is off). A non-finite norm (a NaN or inf gradient anywhere) leaves parameters and
        state untouched: the kernel reads the decision from device memory, and the caller finds the
        norm non-finite when it reads it.
        """
        cfg = self.config
        # On one rank no collective touches the gradients after DDP's NaN check, which has read them
        # already: its bucket norms give the clipping norm without a second read.
        single_rank = self.groups.world_size == 1
        group, expert_group = norm_groups(self.groups, self.distributed)
        sums = {False: [], True: []}  # expert buffers apart when their norm has a group of its own
        for flat in self.flat_states:
            part = flat.grad_norm_squared(reuse_bucket_norms=single_rank)
            if part is not None:
                sums[expert_group is not None and flat.buffer.comm.expert].append(part)
        dense_sq = torch.stack(sums[False]).sum() if sums[False] else torch.zeros((), device=self.device)
        expert_sq = torch.stack(sums[True]).sum() if sums[True] else None
        norm_sq = reduce_norm_squared(dense_sq, expert_sq, group, expert_group)
        grad_norm = norm_sq.sqrt().reshape(())
        skip = ~torch.isfinite(grad_norm)
        for chunk in self.model_chunks:  # DDP's NaN flags of the local (pre-reduction) gradients
            for bucket in chunk.buckets:
                if bucket.nan_flag is not None:
                    skip = skip | bucket.nan_flag
        scale = None
        if self.grad_scaler is not None:  # a static --loss-scale with bf16: unscale in the kernel
            grad_norm = grad_norm * self.grad_scaler.inv_scale
            # all-zero gradients (the scaled ones underflowed): refused at the next read of the
            # step's results (check_deferred_underflow), not with a wait here
            zero = grad_norm == 0.0
            self._zero_norm_seen = zero if self._zero_norm_seen is None else self._zero_norm_seen | zero
            scale = torch.full((), self.grad_scaler.inv_scale, dtype=torch.float32, device=grad_norm.device)
        if cfg.clip_grad > 0.0:
            clip = torch.clamp(cfg.clip_grad / (grad_norm + 1e-6), max=1.0)
            scale = clip if scale is None else scale * clip
        # Adam's t counts applied updates only: advanced on the device by the skip decision, so a
        # skipped step leaves the bias correction where it was (as the per-parameter path, which
        # returns before its update, does) and the host never waits for the decision.
        self.applied_steps.add_((~skip).to(torch.int64))
        step = self.applied_steps
        lrs = [group["lr"] for group in self.param_groups]
        wds = [group["weight_decay"] for group in self.param_groups]
        ops = get_ops()
        hyper = dict(
            step=step, lrs=lrs, weight_decays=wds, beta1=cfg.adam_beta1, beta2=cfg.adam_beta2,
            eps=cfg.adam_eps, grad_scale=scale, skip=skip,
        )  # fmt: skip
        for flat in self.flat_states:
            buffers = (flat.buffer.grad_data, flat.buffer.param_data, flat.masters, flat.remainders)
            buffers += (flat.exp_avg, flat.exp_avg_sq, flat.segments)
            gather = flat.buffer.fp8_gather  # --fp8-param-gather: the FP8 copies of this buffer
            if gather is not None and gather.quantizes_in_step:  # delayed scales: written in the step
                fp8 = gather.fused_weights()
                ops.adam_step_flat_fp8(*buffers, fp8, **hyper)
                gather.finish_fused_quantization(fp8)
            else:
                ops.adam_step_flat(*buffers, **hyper)
        if self.distributed:
            for chunk in self.model_chunks:
                chunk.start_param_sync()
            if not cfg.overlap_param_gather:
                self.finish_param_sync()
        return True, (grad_norm if cfg.clip_grad > 0.0 else None), None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients of every model chunk (DDP buffers included)."""
        for chunk in self.model_chunks:
            if isinstance(chunk, DistributedDataParallel):
                chunk.zero_grad_buffer()
            else:
                chunk.zero_grad(set_to_none=set_to_none)

    def finish_param_sync(self) -> None:
        """Wait for outstanding parameter all-gathers (distributed optimizer with overlap)."""
        if self.distributed:
            for chunk in self.model_chunks:
                chunk.finish_param_sync()

    def reload_model_params(self) -> None:
        """Refresh the fp32 masters from the model parameters (after the model's weights were loaded)."""
        self.finish_param_sync()
        for chunk in self.model_chunks:  # --fp8-param-gather: the FP8 copies of the loaded weights
            if isinstance(chunk, DistributedDataParallel):
                chunk.refresh_fp8_params()
        if self.flat:
            for flat in self.flat_states:
                flat.reset_masters_from_params()
            return
        for entry in self.main_params:
            if entry.owns_copy:
                entry.main.copy_(entry.model_view())

    # ----------------------------------------------------------------------------------------------
    # state

    def sync_step_counters(self) -> None:
        """Flat path: copy the device step counter into the entries' ``state["step"]`` (waits for the
        device). Call before reading ``main_params[i].state`` directly (a checkpoint save does)."""
        if self.flat:
            step = int(self.applied_steps.item())
            for entry in self.main_params:
                entry.state["step"] = step

    def state_dict(self) -> dict[str, Any]:
        """Per-parameter state (layout in :mod:`mcore.optimizer.state_dict`); tensors are this rank's
        pieces."""
        return state_dict(self)

    def gathered_state_dict(self) -> dict[str, Any]:
        """:meth:`state_dict` with every parameter's whole state on every data-parallel rank
        (:func:`mcore.optimizer.state_dict.gathered_state_dict`; every rank of the data-parallel group
        must call it)."""
        return gathered_state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by :meth:`state_dict` at this or another data-parallel layout
        (:func:`mcore.optimizer.state_dict.load_state_dict`).

        Raises:
            ValueError: the state is of another format or optimizer, or misses a parameter, or holds
                a piece of a parameter that does not cover the piece this rank updates.
        """
        load_state_dict(self, state_dict)

    # ----------------------------------------------------------------------------------------------
    # memory

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds: ``params`` (with ``--fp8-param-gather``'s FP8 weight copies), ``grads``,
        ``optimizer_state`` (moments and fp32 masters)."""
        seen: set[int] = set()
        params = grads = 0
        for chunk in self.model_chunks:
            for p in unwrap_model(chunk).parameters():
                if id(p) in seen:
                    continue
                seen.add(id(p))
                params += p.numel() * p.element_size()
                if not isinstance(chunk, DistributedDataParallel) and p.grad is not None:
                    grads += p.grad.numel() * p.grad.element_size()
            if isinstance(chunk, DistributedDataParallel):
                grads += chunk.grad_bytes
                params += chunk.fp8_param_bytes
        if self.flat:
            state = sum(flat.state_bytes for flat in self.flat_states)
            return {"params": params, "grads": grads, "optimizer_state": state}
        state = 0
        for entry in self.main_params:
            for value in entry.state.values():
                if isinstance(value, torch.Tensor):
                    state += value.numel() * value.element_size()
            if entry.owns_copy:
                state += entry.main.numel() * entry.main.element_size()
        return {"params": params, "grads": grads, "optimizer_state": state}


def format_memory_report(report: dict[str, int]) -> str:
    """``params 12.3 MiB | grads 24.6 MiB | optimizer state 49.2 MiB`` for the log."""
    mib = 1024.0 * 1024.0
    return (
        f"params {report['params'] / mib:.1f} MiB | grads {report['grads'] / mib:.1f} MiB | "
        f"optimizer state {report['optimizer_state'] / mib:.1f} MiB"
    )
