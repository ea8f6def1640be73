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
on this rank is empty have no entry. :meth:`MegatronOptimizer.load_state_dict` accepts, for each key,
any saved range that contains this rank's range (a replicated or gathered state loads into any
data-parallel size).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from mcore.backend import get_ops
from mcore.config.fields import ConfigError
from mcore.distributed.ddp import DistributedDataParallel, unwrap_model
from mcore.distributed.grad_buffer import GradBuffer, all_gather_into_tensor
from mcore.distributed.groups import ProcessGroups
from mcore.optimizer.clip_grads import clip_grads_, counts_in_grad_norm, global_grad_norm, unscale_and_check_
from mcore.optimizer.config import OptimizerConfig, PrecisionConfig
from mcore.optimizer.flat_state import FlatBufferState
from mcore.optimizer.grad_scaler import build_grad_scaler, underflow_error

STATE_FORMAT = "mcore.optimizer/1"


@dataclass
class MainParam:
    """The piece ``[start, end)`` of one (flattened) model parameter that this rank updates."""

    key: str
    model_param: torch.nn.Parameter
    start: int
    end: int
    main: torch.Tensor | None
    """fp32, 1-D: a view of the model parameter (fp32 params) or an fp32 copy (bf16/fp16); None when
    the master is held as the bf16 parameter plus a 16-bit remainder (read it with
    :meth:`MegatronOptimizer.master_of`)."""
    grad_view: Callable[[], torch.Tensor | None]
    """The piece's gradient in the buffer's dtype (a 1-D view), or None when there is none."""
    owns_copy: bool
    counts_in_norm: bool
    group: int
    state: dict[str, Any] = field(default_factory=dict)
    buffer: GradBuffer | None = None
    """The DDP buffer of the parameter (None for a plain module)."""

    def model_view(self) -> torch.Tensor:
        return self.model_param.data.view(-1)[self.start : self.end]


def default_no_weight_decay(name: str, param: torch.nn.Parameter) -> bool:
    """Megatron's rule: biases and every 1-D parameter (norm weights) get no weight decay."""
    return name.endswith(".bias") or param.dim() == 1


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
        named = []
        for i, chunk in enumerate(self.model_chunks):
            prefix = f"model{i}." if len(self.model_chunks) > 1 else ""
            for name, param in unwrap_model(chunk).named_parameters():
                if param.requires_grad:
                    named.append((prefix + name, name, param, chunk))

        decay = [(k, p) for k, n, p, _ in named if not no_weight_decay(n, p)]
        no_decay = [(k, p) for k, n, p, _ in named if no_weight_decay(n, p)]
        self.param_groups: list[dict[str, Any]] = []
        group_of: dict[int, int] = {}
        for members, wd_mult in ((decay, 1.0), (no_decay, 0.0)):
            if not members:
                continue
            for _, p in members:
                group_of[id(p)] = len(self.param_groups)
            self.param_groups.append(
                {
                    "params": [p for _, p in members],
                    "lr": lr,
                    "weight_decay": config.weight_decay * wd_mult,
                    "wd_mult": wd_mult,
                    "lr_mult": 1.0,
                }
            )

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
            entry = self._make_main_param(key, param, chunk, group_of[id(param)], tp_rank)
            if entry is not None:
                self.main_params.append(entry)
        self.flat_states: list[FlatBufferState] = []
        self._flat_of: dict[int, FlatBufferState] = {}
        if self.flat:
            self._init_flat_state()
        else:
            self._init_state()
        device = next((p.model_param.device for p in self.main_params), None)
        self._device = device or torch.device("cpu")
        self._applied_steps = torch.zeros((), dtype=torch.int64, device=self._device)
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

    def _make_main_param(
        self, key: str, param: torch.nn.Parameter, chunk: torch.nn.Module, group: int, tp_rank: int
    ) -> MainParam | None:
        buffer = chunk.buffer_of(param) if isinstance(chunk, DistributedDataParallel) else None
        if buffer is not None:
            local = buffer.local_range(param)
            if local is None:
                return None
            start, end = local
            offset = buffer.buffer_range(param)[0]
            # The buffer is allocated once and zeroed in place, so one view serves every step (a new
            # slice per parameter per step was host time spent right after backward's last sync).
            piece = buffer.grad_data[offset + start : offset + end]

            def grad_view(piece=piece):
                return piece
        else:
            start, end = 0, param.numel()

            def grad_view(p=param):
                return None if p.grad is None else p.grad.view(-1)

        view = param.data.view(-1)[start:end]
        owns_copy = param.dtype != torch.float32
        if self.flat:
            main = None  # set by _init_flat_state: a view into the flat masters (or the remainders)
        else:
            main = view.detach().float().clone() if owns_copy else view
        return MainParam(
            key=key,
            model_param=param,
            start=start,
            end=end,
            main=main,
            grad_view=grad_view,
            owns_copy=owns_copy,
            counts_in_norm=counts_in_grad_norm(param, tp_rank),
            group=group,
            buffer=buffer,
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
        moment_dtypes = self.config.moment_dtypes()
        for chunk in self.model_chunks:
            for buffer in chunk.grad_buffers:
                entries = by_buffer.get(id(buffer), [])
                pieces = [(e.model_param, e.start, e.end, e.group, e.counts_in_norm) for e in entries]
                flat = FlatBufferState(buffer, pieces, moment_dtypes, remainders)
                self.flat_states.append(flat)
                for entry in entries:
                    piece = flat.piece(entry.model_param)
                    self._flat_of[id(entry.model_param)] = flat
                    if flat.masters is not None:
                        entry.main = flat.state_view(flat.masters, piece)
                    elif flat.remainders is None:
                        entry.main = flat.param_view(piece)  # fp32 parameters are the masters
                    entry.state = {
                        "step": 0,
                        "exp_avg": flat.state_view(flat.exp_avg, piece),
                        "exp_avg_sq": flat.state_view(flat.exp_avg_sq, piece),
                    }

    def master_of(self, entry: MainParam) -> torch.Tensor:
        """``entry``'s fp32 master weights (a copy when they are stored as remainders)."""
        if entry.main is not None:
            return entry.main
        flat = self._flat_of[id(entry.model_param)]
        return flat.read_master(flat.piece(entry.model_param))

    def _set_master(self, entry: MainParam, value: torch.Tensor) -> None:
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
        return self.groups.world if self.distributed else self.groups.mp

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
                grad_list, self.grad_scaler.inv_scale, self.groups.world, self._device
            )
            self.grad_scaler.update(found_inf)
            if found_inf:
                return False, None, None

        grad_norm = None
        if self.config.clip_grad > 0.0:
            counted = [g for e, g in present if e.counts_in_norm]
            grad_norm = global_grad_norm(counted, self._norm_group(), self._device)
            clip_grads_(grad_list, self.config.clip_grad, grad_norm)
        if self.grad_scaler is not None:
            self._refuse_underflowed_gradients(grad_norm, present)

        if self.config.optimizer == "adam":
            self._adam(present)
        else:
            self._sgd(present)

        self._copy_main_to_model([entry for entry, _ in present if entry.owns_copy])
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
            counted = [g for e, g in present if e.counts_in_norm]
            grad_norm = global_grad_norm(counted, self._norm_group(), self._device)
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
        partial = [flat.grad_norm_squared(reuse_bucket_norms=single_rank) for flat in self.flat_states]
        partial = [s for s in partial if s is not None]
        norm_sq = torch.stack(partial).sum() if partial else torch.zeros((), device=self._device)
        norm_sq = norm_sq.reshape(1)
        group = self._norm_group()
        if group is not None and dist.is_available() and dist.is_initialized():
            dist.all_reduce(norm_sq, group=group)
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
        self._applied_steps.add_((~skip).to(torch.int64))
        step = self._applied_steps
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

    @staticmethod
    def _copy_main_to_model(entries: list[MainParam]) -> None:
        """Round the fp32 masters into the bf16/fp16 model parameters: one multi-tensor copy instead of
        a kernel launch per parameter (the same ``copy_`` conversion, element for element)."""
        if entries:
            torch._foreach_copy_([e.model_view() for e in entries], [e.main for e in entries])

    def _adam(self, present: list[tuple[MainParam, torch.Tensor]]) -> None:
        cfg = self.config
        batches: dict[tuple[int, int], list[tuple[MainParam, torch.Tensor]]] = {}
        for entry, grad in present:
            entry.state["step"] += 1
            batches.setdefault((entry.group, entry.state["step"]), []).append((entry, grad))
        for (group_index, step), members in batches.items():
            group = self.param_groups[group_index]
            get_ops().adam_step(
                [e.main for e, _ in members],
                [g for _, g in members],
                [e.state["exp_avg"] for e, _ in members],
                [e.state["exp_avg_sq"] for e, _ in members],
                step=step,
                lr=group["lr"],
                beta1=cfg.adam_beta1,
                beta2=cfg.adam_beta2,
                eps=cfg.adam_eps,
                weight_decay=group["weight_decay"],
                decoupled_weight_decay=cfg.decoupled_weight_decay,
            )

    def _sgd(self, present: list[tuple[MainParam, torch.Tensor]]) -> None:
        """torch.optim.SGD's update (coupled weight decay, no dampening, no Nesterov)."""
        momentum = self.config.sgd_momentum
        for group_index, group in enumerate(self.param_groups):
            members = [(e, g) for e, g in present if e.group == group_index]
            if not members:
                continue
            params = [e.main for e, _ in members]
            grads = [g for _, g in members]
            if group["weight_decay"] != 0.0:
                grads = torch._foreach_add(grads, params, alpha=group["weight_decay"])
            if momentum != 0.0:
                bufs = [e.state["momentum_buffer"] for e, _ in members]
                torch._foreach_mul_(bufs, momentum)
                torch._foreach_add_(bufs, grads)
                grads = bufs
            torch._foreach_add_(params, grads, alpha=-group["lr"])

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
            step = int(self._applied_steps.item())
            for entry in self.main_params:
                entry.state["step"] = step

    def state_dict(self) -> dict[str, Any]:
        """Per-parameter state (layout in the module docstring); tensors are this rank's pieces."""
        self.finish_param_sync()
        self.sync_step_counters()
        names = self._all_keys()
        state = {}
        for entry in self.main_params:
            item: dict[str, Any] = {
                "range": (entry.start, entry.end),
                "shape": tuple(entry.model_param.shape),
            }
            for name, value in entry.state.items():
                item[name] = value.clone() if isinstance(value, torch.Tensor) else value
            if entry.owns_copy:
                item["main_param"] = self.master_of(entry).clone()
            state[entry.key] = item
        return {
            "format": STATE_FORMAT,
            "optimizer": self.config.optimizer,
            "distributed": self.distributed,
            "param_groups": [
                {
                    **{k: v for k, v in group.items() if k != "params"},
                    "params": [names[id(p)] for p in group["params"]],
                }
                for group in self.param_groups
            ],
            "state": state,
            "grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler is not None else None,
        }

    def gathered_state_dict(self) -> dict[str, Any]:
        """:meth:`state_dict` with every parameter's whole state on every data-parallel rank.

        Without the distributed optimizer this is :meth:`state_dict`. With it, each state tensor is
        assembled in the buffer layout and all-gathered bucket by bucket over the data-parallel
        group (one collective per bucket and state field), so every entry covers ``(0, numel)`` and
        loads at any data-parallel size. It holds the full optimizer state in memory for a moment;
        a checkpoint that saves each rank's pieces with their ranges (:meth:`state_dict`) does not.
        Every rank of the data-parallel group must call it.
        """
        state_dict = self.state_dict()
        if not self.distributed:
            return state_dict
        by_buffer: dict[int, list[MainParam]] = {}
        for entry in self.main_params:
            by_buffer.setdefault(id(entry.buffer), []).append(entry)
        fields = ["exp_avg", "exp_avg_sq"] if self.config.optimizer == "adam" else ["momentum_buffer"]
        step = torch.tensor([max((e.state.get("step", 0) for e in self.main_params), default=0)])
        step = step.to(self._device)
        names = self._all_keys()
        comm = None
        full_state: dict[str, dict[str, Any]] = {}
        for chunk in self.model_chunks:
            for buffer in chunk.grad_buffers:
                comm = buffer.comm
                entries = by_buffer.get(id(buffer), [])
                copies = any(p.dtype != torch.float32 for p in buffer.params)
                gathered = {}
                for name in fields + (["main_param"] if copies else []):
                    flat = torch.zeros(buffer.numel, dtype=torch.float32, device=buffer.grad_data.device)
                    for entry in entries:
                        offset = buffer.buffer_range(entry.model_param)[0]
                        value = self.master_of(entry) if name == "main_param" else entry.state[name]
                        flat[offset + entry.start : offset + entry.end].copy_(value)
                    if comm.active:
                        for bucket in buffer.buckets:
                            lo, hi = bucket.shard_range(comm.rank)
                            all_gather_into_tensor(
                                flat[bucket.start : bucket.end], flat[lo:hi], group=comm.group
                            )
                    gathered[name] = flat
                for param in buffer.params:
                    lo, hi = buffer.buffer_range(param)
                    item: dict[str, Any] = {"range": (0, hi - lo), "shape": tuple(param.shape)}
                    for name, flat in gathered.items():
                        if name == "main_param" and param.dtype == torch.float32:
                            continue
                        item[name] = flat[lo:hi].clone()
                    full_state[names[id(param)]] = item
        if comm is not None and comm.active:
            dist.all_reduce(step, op=dist.ReduceOp.MAX, group=comm.group)
        if self.config.optimizer == "adam":
            for item in full_state.values():
                item["step"] = int(step.item())
        state_dict["state"] = full_state
        return state_dict

    def _all_keys(self) -> dict[int, str]:
        names = {}
        for i, chunk in enumerate(self.model_chunks):
            prefix = f"model{i}." if len(self.model_chunks) > 1 else ""
            for name, param in unwrap_model(chunk).named_parameters():
                names[id(param)] = prefix + name
        return names

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by :meth:`state_dict` at this or another data-parallel layout.

        Raises:
            ValueError: the state is of another format or optimizer, or misses a parameter, or holds
                a piece of a parameter that does not cover the piece this rank updates.
        """
        if state_dict.get("format") != STATE_FORMAT:
            raise ValueError(f"optimizer state format {state_dict.get('format')!r} is not {STATE_FORMAT!r}")
        if state_dict["optimizer"] != self.config.optimizer:
            raise ValueError(
                f"optimizer state is for --optimizer {state_dict['optimizer']}, "
                f"this run uses --optimizer {self.config.optimizer}"
            )
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"optimizer state has {len(saved_groups)} parameter groups, this model has {len(self.param_groups)}"
            )
        for group, saved in zip(self.param_groups, saved_groups):
            for name in ("lr", "weight_decay", "wd_mult", "lr_mult"):
                group[name] = saved[name]
        saved_state = state_dict["state"]
        for entry in self.main_params:
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
                self._set_master(entry, item["main_param"][piece])
        if self.flat:
            self._applied_steps.fill_(max((e.state.get("step", 0) for e in self.main_params), default=0))
        self.finish_param_sync()
        if self.distributed:  # parameters whose masters changed must reach every data-parallel rank
            if not self.flat:  # (the flat path's _set_master rounded them into the parameters already)
                for entry in self.main_params:
                    if entry.owns_copy:
                        entry.model_view().copy_(entry.main)
            for chunk in self.model_chunks:
                chunk.start_param_sync()
                chunk.finish_param_sync()
        if self.grad_scaler is not None and state_dict.get("grad_scaler") is not None:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])

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
