"""Data parallelism: mcore's own DDP wrapper with contiguous gradient buffers and bucketed reduction.

Why not ``torch.nn.parallel.DistributedDataParallel``: gradients must land in buffers whose layout the
distributed optimizer shards, tied embeddings and sequence-parallel parameters need extra reductions
over other groups (:mod:`mcore.distributed.finalize`), and the pipeline schedule decides which
micro-batch is the last one.

How gradients flow::

    backward of each micro-batch:  param.grad --(post-accumulate hook)--> param.main_grad += grad;
                                   param.grad = None
                                   (gradients of small parameters - biases, norm weights - are
                                   added in one multi-tensor add per bucket, see below)
                                   (gradient-accumulation fusion: the linear layer's backward already
                                   added its weight gradient to main_grad; param.grad is a placeholder
                                   that the hook drops, see below)
    last micro-batch only, with --overlap-grad-reduce: a bucket whose parameters all have their
        gradient is reduced asynchronously (in bucket order, so every rank issues the same sequence)
    finish_grad_sync():            reduce the remaining buckets, wait for all; main_grad now holds
                                   the data-parallel average (with the distributed optimizer: only
                                   this rank's shard of every bucket does)

The schedule runs all but the last micro-batch inside :meth:`DistributedDataParallel.no_sync`, so
gradient accumulation costs no communication until the last micro-batch. Gradients are averaged
over ``groups.dp_cp`` (data x context parallel ranks).

Expert-parallel parameters (routed experts, :func:`mcore.distributed.param_attrs.is_expert_parallel`)
live in buffers of their own, reduced over ``groups.edp`` (the ranks holding the same experts; the
distributed optimizer shards them over edp). They are scaled by ``1/(dp*cp)``, not ``1/edp``, as in
Megatron: the token dispatcher brings every token of the dp x cp replicas to exactly one edp replica
of its expert, so the sum over edp of the expert gradients is the sum over all dp x cp replicas'
losses, and the dense average divides that sum by dp x cp. (At ep=1, etp=tp: edp = dp x cp and both
are the same average.)

Gradient-accumulation fusion (:func:`mcore.tensor_parallel.layers.linear_with_grad_accumulation_fusion`):
a linear layer whose weight's ``main_grad`` has the weight's dtype computes ``main_grad += dY^T X`` in
its backward GEMM and returns a placeholder gradient, so that this hook still fires (and marks the
bucket ready) but skips the add. The layer says so with ``param.grad_added_to_main_grad``, which it
sets in its forward and which stays set while it keeps fusing (every micro-batch of every step); the
wrapper initializes it to False. A weight that also gets gradients from other autograd uses (the tied
word embedding, multiplied in by the output layer) keeps the flag False: the output layer returns no
gradient for it, so the hook adds the embedding's gradient alone.

A step's first weight gradient may be written instead of added (:mod:`mcore.tensor_parallel.first_grad`):
:meth:`DistributedDataParallel.zero_grad_buffer` skips the ``main_grad`` regions of the weights whose
layers opt in and flags them unwritten: the FP8 linears, whose ``torch._scaled_mm`` cannot add into its
output (the first wgrad GEMM of the step writes its result there, later ones add), and the MoE
experts' grouped weights, whose gradient autograd produces (the hook below copies the step's first
gradient over the region instead of zeroing it and adding: for OLMoE's 6.4 B expert parameters that is
one pass over the buffer instead of three). A flagged region still unwritten when its bucket's
reduction starts (the weight got no gradient) is zeroed then.

Small gradients (at most ``_BATCHED_ADD_MAX_ELEMENTS``, with ``main_grad``'s dtype): a GPT layer has
eight bias and norm-weight vectors, whose adds are each a kernel launch shorter than its own launch
gap (a 24-layer model: about 200 adds of 2-3 us). The hook queues them and one ``_foreach_add_`` adds
the queue before anything reads ``main_grad``: before a bucket's reduction starts, and at the end of
every backward pass (a callback of autograd's engine, which runs after the engine has synchronised
the gradients' streams with the caller's). Queued gradients stay alive until then (their size is
bounded by the small parameters' size).
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mcore.config.fields import check, flag
from mcore.distributed.grad_buffer import Bucket, CommSpec, GradBuffer
from mcore.distributed.groups import ProcessGroups
from mcore.distributed.param_attrs import is_expert_parallel, is_pipeline_shared, is_shared_embedding
from mcore.fp8.param_gather import Fp8ParamGather, fp8_gathered_layers
from mcore.tensor_parallel.first_grad import take_first_write

_DEFAULT_BUCKET_ELEMENTS = 40_000_000
_BATCHED_ADD_MAX_ELEMENTS = 1 << 16
"""Gradients up to this size are added to ``main_grad`` in batches (see the module docstring)."""


@dataclass(frozen=True, kw_only=True)
class DDPConfig:
    """Data-parallel gradient reduction (the flags of Megatron's DistributedDataParallelConfig)."""

    overlap_grad_reduce: bool = flag(
        False, "Reduce gradient buckets during the last micro-batch's backward, as soon as each is ready."
    )
    ddp_bucket_size: int | None = flag(
        None,
        "Elements per gradient bucket (default: max(40M, 1M x data-parallel size) with "
        "--overlap-grad-reduce, else one bucket per dtype).",
    )
    ddp_average_in_collective: bool = flag(
        False, "Average with the collective's AVG reduction instead of pre-scaling by 1/dp."
    )
    check_for_nan_in_loss_and_grad: bool = flag(
        True,
        "Check the loss and the local gradients for NaN before reducing them.",
        name="--no-check-for-nan-in-loss-and-grad",
    )
    grad_reduce_in_fp32: bool = flag(
        False, "Accumulate and reduce gradients in fp32 (set from PrecisionConfig).", cli=False
    )
    use_distributed_optimizer: bool = flag(
        False, "Reduce-scatter gradients into shards (set from OptimizerConfig).", cli=False
    )
    overlap_param_gather: bool = flag(
        False, "Overlap the parameter all-gather with the forward (set from OptimizerConfig).", cli=False
    )
    contiguous_params: bool = flag(
        False,
        "Keep parameters in one contiguous buffer per dtype, laid out like the gradient buffer (set "
        "from OptimizerConfig: the one-pass optimizer updates whole buffers).",
        cli=False,
    )
    fp8_param_gather: bool = flag(
        False,
        "All-gather the FP8 linears' weights in FP8 (set from Fp8Config's --fp8-param-gather; see "
        "mcore.fp8.param_gather).",
        cli=False,
    )

    def __post_init__(self) -> None:
        check(
            self.ddp_bucket_size is None or self.ddp_bucket_size >= 1,
            f"ddp_bucket_size={self.ddp_bucket_size} must be a positive number of elements",
        )
        check(
            not self.overlap_param_gather or self.use_distributed_optimizer,
            "overlap_param_gather=True needs use_distributed_optimizer=True",
        )
        check(
            not self.fp8_param_gather or self.use_distributed_optimizer,
            "--fp8-param-gather needs --use-distributed-optimizer",
        )

    def with_training(self, optimizer, precision, fp8=None) -> DDPConfig:
        """This config completed from the optimizer, precision and (optional) FP8 configs (the fields
        without flags).

        fp16 with dynamic loss scaling turns the NaN check off: an overflow may produce NaN gradients,
        and the loss scaler is what handles it (skip the step, lower the scale).
        """
        precision.check_with(optimizer)
        bf16_grads = optimizer.use_precision_aware_optimizer and optimizer.main_grads_dtype == "bf16"
        return dataclasses.replace(
            self,
            grad_reduce_in_fp32=precision.grads_in_fp32 and not bf16_grads,
            contiguous_params=optimizer.uses_flat_adam(precision),
            use_distributed_optimizer=optimizer.use_distributed_optimizer,
            overlap_param_gather=optimizer.overlap_param_gather,
            fp8_param_gather=fp8 is not None and fp8.fp8_param_gather,
            check_for_nan_in_loss_and_grad=self.check_for_nan_in_loss_and_grad
            and not precision.dynamic_loss_scale,
        )


class DistributedDataParallel(torch.nn.Module):
    """Wrap ``module`` so its gradients accumulate in contiguous buffers reduced over data parallel.

    Args:
        module: one model chunk (one pipeline stage, or one virtual chunk of it).
        ddp_config: reduction settings (complete it with :meth:`DDPConfig.with_training`).
        groups: the process groups; gradients are averaged over ``groups.dp_cp``.

    Parameters with ``requires_grad=False`` are left alone. Parameters of different dtypes get
    separate buffers. Every trainable parameter gets ``param.main_grad``, a view into its buffer
    (and with the distributed optimizer ``param.data`` becomes a view into the parameter buffer):
    move the module to its device and dtype before wrapping it, not after.
    """

    def __init__(self, module: torch.nn.Module, ddp_config: DDPConfig, groups: ProcessGroups):
        super().__init__()
        self.module = module
        self.ddp_config = ddp_config
        self.groups = groups
        comm, self.expert_comm = _comm_specs(ddp_config, groups)
        self.comm = comm
        dp_size = comm.size

        bucket_size = ddp_config.ddp_bucket_size
        if bucket_size is None and ddp_config.overlap_grad_reduce:
            bucket_size = max(_DEFAULT_BUCKET_ELEMENTS, 1_000_000 * dp_size)
        # else: an explicit size, or nothing to overlap and one collective per buffer (None)

        names = {id(p): n for n, p in module.named_parameters()}
        self._all_params = list(module.parameters())  # for zero_grad_buffer, without a module walk per step
        # --fp8-param-gather: the FP8 linears' weights get buffers of their own (gathered in FP8)
        fp8_layers = fp8_gathered_layers(module) if ddp_config.fp8_param_gather else {}
        by_dtype = _params_by_buffer(module, ddp_config, fp8_layers)

        def own_bucket(param: torch.nn.Parameter) -> bool:
            # the tied embedding's two copies (first and last stage) must shard alike
            return (
                ddp_config.use_distributed_optimizer
                and groups.pp_size > 1
                and (is_shared_embedding(param) or is_pipeline_shared(param))
            )

        self.grad_buffers = [
            GradBuffer(
                params,
                pdt,
                gdt,
                bucket_size,
                self.expert_comm if expert else comm,
                own_bucket,
                names,
                ddp_config.contiguous_params,
            )
            for (pdt, gdt, _, expert), params in by_dtype.items()
        ]
        self._fp8_gathers: list[Fp8ParamGather] = []
        for (_, _, fp8, _), buffer in zip(by_dtype, self.grad_buffers):
            if fp8:
                layers = [fp8_layers[id(p)] for p in buffer.params]
                buffer.fp8_gather = Fp8ParamGather(buffer, layers, groups.tp)
                self._fp8_gathers.append(buffer.fp8_gather)
        self.buckets: list[Bucket] = [b for buffer in self.grad_buffers for b in buffer.buckets]
        self._buffer_of: dict[int, GradBuffer] = {
            id(p): buffer for buffer in self.grad_buffers for p in buffer.params
        }
        self._next_bucket = 0
        self._sync_enabled = True
        self._queued_adds: list[tuple[torch.Tensor, torch.Tensor]] = []  # (main_grad, grad)
        for buffer in self.grad_buffers:
            for param in buffer.params:
                param.grad_added_to_main_grad = False  # set by fusing layers' forward
        # Parameters keep their hooks on the C++ side, where the garbage collector cannot follow them: a
        # bound method there would make model -> parameter -> hook -> DDP -> model an uncollectable
        # cycle that keeps the buffers and the process groups (with their threads) alive until exit.
        grad_hook = _weak_method(self._grad_hook)
        self._hooks = [
            param.register_post_accumulate_grad_hook(grad_hook)
            for buffer in self.grad_buffers
            for param in buffer.params
        ]
        self.refresh_fp8_params()  # the FP8 copies of the initial weights
        if ddp_config.overlap_param_gather:
            for sub in module.modules():
                if any(id(p) in self._buffer_of for p in sub.parameters(recurse=False)):
                    self._hooks.append(sub.register_forward_pre_hook(self._param_gather_hook))

    # ----------------------------------------------------------------------------------------------
    # forward, and attributes of the wrapped module (set_input_tensor, config, ...)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "module":
                raise
            return getattr(self.module, name)

    def state_dict(self, *args, **kwargs):
        """The wrapped module's state dict (keys without a ``module.`` prefix)."""
        self.finish_param_sync()
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        if assign:
            raise ValueError("load_state_dict(assign=True) would detach parameters from the DDP buffers")
        self.finish_param_sync()
        return self.module.load_state_dict(state_dict, strict=strict)

    # ----------------------------------------------------------------------------------------------
    # gradients

    def _grad_hook(self, param: torch.nn.Parameter) -> None:
        if param.grad is None:
            return
        grad = param.grad
        if not param.grad_added_to_main_grad:  # else the layer's backward did it; grad is a placeholder
            if take_first_write(param):  # an opted-in weight's first gradient of the step: written over
                param.main_grad.copy_(grad)  # the stale memory, no zeroing pass and no add
            elif grad.numel() <= _BATCHED_ADD_MAX_ELEMENTS and grad.dtype == param.main_grad.dtype:
                if not self._queued_adds:
                    _run_after_backward(self._add_queued_grads)
                self._queued_adds.append((param.main_grad, grad))
            else:
                param.main_grad.add_(grad)
        param.grad = None
        if self._sync_enabled and self.ddp_config.overlap_grad_reduce:
            if self._buffer_of[id(param)].bucket_of(param).mark_ready(param):
                self._launch_ready_buckets()

    def _add_queued_grads(self) -> None:
        """``main_grad += grad`` for the queued small gradients: one multi-tensor add."""
        if self._queued_adds:
            main_grads, grads = zip(*self._queued_adds)
            self._queued_adds = []
            torch._foreach_add_(main_grads, grads)

    def _launch_ready_buckets(self) -> None:
        """Start reductions in bucket order, so every rank issues the same collective sequence."""
        self._add_queued_grads()
        check_nan = self.ddp_config.check_for_nan_in_loss_and_grad
        while self._next_bucket < len(self.buckets):
            bucket = self.buckets[self._next_bucket]
            if len(bucket.ready) < len(bucket.params):
                return
            bucket.start_grad_sync(check_nan)
            self._next_bucket += 1

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients without reducing them (every micro-batch but the last)."""
        previous = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def disable_grad_sync(self) -> None:
        self._sync_enabled = False

    def enable_grad_sync(self) -> None:
        self._sync_enabled = True

    def start_grad_sync(self) -> None:
        """Launch the reduction of every bucket not yet launched (in bucket order)."""
        self._add_queued_grads()
        check_nan = self.ddp_config.check_for_nan_in_loss_and_grad
        for bucket in self.buckets[self._next_bucket :]:
            bucket.start_grad_sync(check_nan)
        self._next_bucket = len(self.buckets)

    def finish_grad_sync(self) -> None:
        """Reduce what is left and wait: afterwards ``main_grad`` holds the data-parallel average.

        With the distributed optimizer only this rank's shard of each bucket is reduced.

        Raises:
            RuntimeError: a local gradient was NaN before the reduction (``--no-check-for-nan-in-loss-and-grad``
                turns the check off); the message names the rank and the parameters of the bucket.
                Not raised here with :attr:`defer_nan_check` (see :meth:`nan_flags`).
        """
        self.start_grad_sync()
        check_nan = self.ddp_config.check_for_nan_in_loss_and_grad
        for bucket in self.buckets:
            bucket.finish_grad_sync(check_nan)
        if not self.defer_nan_check:
            flags = self.nan_flags()
            if flags is not None:
                self.raise_if_nan(flags.tolist())  # the host waits for the device here

    defer_nan_check: bool = False
    """False (the default): :meth:`finish_grad_sync` reads the NaN flags on the host and raises at once,
    which waits for the device. True: it leaves them on the device; the caller reads :meth:`nan_flags`
    later (a step later, without waiting for the device) and passes them to :meth:`raise_if_nan`. Only
    for an optimizer that does not apply a non-finite update (``skips_nonfinite_on_device``): the
    parameters must not take the NaN step before the late check sees it."""

    def nan_flags(self) -> torch.Tensor | None:
        """This step's NaN flags, one bool per bucket in ``self.buckets`` order (True: the bucket's local
        gradients held a NaN before the data-parallel reduction), as a device tensor (nothing is read);
        None when no bucket was checked (``--no-check-for-nan-in-loss-and-grad``). Valid from
        :meth:`finish_grad_sync` until the next :meth:`zero_grad_buffer`."""
        if all(b.nan_flag is None for b in self.buckets):
            return None
        return torch.stack(
            [
                b.nan_flag
                if b.nan_flag is not None
                else torch.zeros((), dtype=torch.bool, device=b.grad_data.device)
                for b in self.buckets
            ]
        )

    def raise_if_nan(self, flags, iteration: int | None = None) -> None:
        """Raise the NaN error if any of ``flags`` is set.

        Args:
            flags: host values of :meth:`nan_flags` (a list of bools, or a CPU tensor), or None.
            iteration: the training iteration whose gradients the flags are of (named in the message).

        Raises:
            RuntimeError: naming the rank, the iteration when given, and the parameters of the buckets.
        """
        if flags is None:
            return
        if isinstance(flags, torch.Tensor):
            flags = flags.tolist()
        if len(flags) != len(self.buckets):
            raise ValueError(f"{len(flags)} NaN flags for {len(self.buckets)} buckets")
        bad = [b for b, flag in zip(self.buckets, flags) if flag]
        if not bad:
            return
        names = [b.buffer.name_of(p) for b in bad for p in b.params]
        when = "" if iteration is None else f" of iteration {iteration}"
        raise RuntimeError(
            f"NaN in the local gradients{when} on rank {self.groups.rank} before the data-parallel "
            f"reduction, in a bucket holding {', '.join(names[:8])}{' ...' if len(names) > 8 else ''}"
        )

    overwrite_first_grads: bool = True
    """True (the default): :meth:`zero_grad_buffer` leaves the ``main_grad`` of the weights that opt in
    unzeroed and their first gradient of the step is written over it (:mod:`mcore.tensor_parallel.first_grad`).
    False: zero everything and add every gradient (the tests' reference behaviour)."""

    def zero_grad_buffer(self) -> None:
        """Zero every gradient buffer and reset the buckets (call before each step's first forward).

        The ``main_grad`` of an opted-in weight is zero from here until its first gradient of the step
        is written, not added: its region is skipped and flagged (see :attr:`overwrite_first_grads`)."""
        for param in self._all_params:
            param.grad = None
        self._queued_adds = []  # left by a backward pass that raised
        for buffer in self.grad_buffers:
            buffer.reset(overwrite_first=self.overwrite_first_grads)
        self._next_bucket = 0

    # ----------------------------------------------------------------------------------------------
    # parameters (distributed optimizer)

    def start_param_sync(self) -> None:
        """Launch the all-gather of updated parameter shards, first-needed bucket first (with
        ``--fp8-param-gather`` the FP8 linears' shards are quantized first, unless the optimizer step
        wrote them (``adam_step_flat_fp8``), and gathered in FP8)."""
        for fp8 in self._fp8_gathers:
            if not fp8.take_quantized():
                fp8.quantize_shards()
        for bucket in reversed(self.buckets):
            bucket.start_param_sync()

    def refresh_fp8_params(self) -> None:
        """``--fp8-param-gather``: quantize and all-gather the FP8 weights again from the parameters
        (after weights were set other than by the optimizer's step: construction, a checkpoint load);
        a no-op without it. Every data-parallel rank calls it."""
        if not self._fp8_gathers:
            return
        self.finish_param_sync()
        for fp8 in self._fp8_gathers:
            fp8.quantize_shards()
            for bucket in fp8.buffer.buckets:
                bucket.start_param_sync()
                bucket.finish_param_sync()

    def gather_full_precision_params(self) -> None:
        """``--fp8-param-gather``: all-gather the FP8 linears' weights in their own dtype, so that every
        rank holds them exactly (a checkpoint save); a no-op without it. Every data-parallel rank calls it."""
        self.finish_param_sync()
        for fp8 in self._fp8_gathers:
            fp8.gather_full_precision()

    def finish_param_sync(self) -> None:
        """Wait until every parameter holds its updated value (before eval, saving, or reading weights)."""
        for bucket in reversed(self.buckets):
            bucket.finish_param_sync()

    def _param_gather_hook(self, module: torch.nn.Module, args) -> None:
        for param in module.parameters(recurse=False):
            buffer = self._buffer_of.get(id(param))
            if buffer is not None:
                buffer.bucket_of(param).finish_param_sync()

    # ----------------------------------------------------------------------------------------------
    # for the optimizer

    def buffer_of(self, param: torch.nn.Parameter) -> GradBuffer | None:
        """The buffer holding ``param``'s gradient (None for frozen parameters)."""
        return self._buffer_of.get(id(param))

    @property
    def grad_bytes(self) -> int:
        return sum(buffer.grad_bytes for buffer in self.grad_buffers)

    @property
    def fp8_param_bytes(self) -> int:
        """Bytes of the FP8 weight copies of ``--fp8-param-gather`` (beside the parameters; 0 without)."""
        return sum(fp8.data.numel() * fp8.data.element_size() for fp8 in self._fp8_gathers)


def _run_after_backward(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the backward pass that is running now ends (autograd's engine calls it
    after synchronising the gradients' streams with the stream that called ``backward``)."""
    torch.autograd.Variable._execution_engine.queue_callback(_weak_method(callback))


def _weak_method(method: Callable[..., None]) -> Callable[..., None]:
    """``method`` as a function that holds its object weakly (a no-op once the object is gone)."""
    ref = weakref.WeakMethod(method)

    def call(*args) -> None:
        bound = ref()
        if bound is not None:
            bound(*args)

    return call


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside a :class:`DistributedDataParallel` (or the module itself)."""
    while isinstance(model, DistributedDataParallel):
        model = model.module
    return model


def _comm_specs(ddp_config: DDPConfig, groups: ProcessGroups) -> tuple[CommSpec, CommSpec]:
    """The dense gradients' reduction (over DP x CP) and the experts' (over EDP, scaled by
    ``1 / (DP x CP)`` as Megatron's ``expert_gradient_scaling_factor``)."""
    dp_size = groups.dp_size * groups.cp_size
    dense = CommSpec(
        group=groups.dp_cp,
        size=dp_size,
        rank=0 if groups.dp_cp is None else dist.get_rank(groups.dp_cp),
        average_in_collective=ddp_config.ddp_average_in_collective,
        use_distributed_optimizer=ddp_config.use_distributed_optimizer,
    )
    expert = CommSpec(
        group=groups.edp,
        size=groups.edp_size,
        rank=0 if groups.edp is None else dist.get_rank(groups.edp),
        average_in_collective=ddp_config.ddp_average_in_collective,
        use_distributed_optimizer=ddp_config.use_distributed_optimizer,
        grad_scale=1.0 / dp_size,
        expert=True,
    )
    return dense, expert


def _params_by_buffer(
    module: torch.nn.Module, ddp_config: DDPConfig, fp8_layers: dict
) -> dict[tuple[torch.dtype, torch.dtype, bool, bool], list[torch.nn.Parameter]]:
    """The trainable parameters grouped into gradient buffers, keyed by (param dtype, grad dtype,
    FP8-gathered, expert-parallel); dense buffers first, each in backward order (roughly)."""
    by_buffer: dict[tuple[torch.dtype, torch.dtype, bool, bool], list[torch.nn.Parameter]] = {}
    for expert in (False, True):
        for param in reversed(list(module.parameters())):
            if not param.requires_grad or is_expert_parallel(param) != expert:
                continue
            grad_dtype = torch.float32 if ddp_config.grad_reduce_in_fp32 else param.dtype
            key = (param.dtype, grad_dtype, id(param) in fp8_layers, expert)
            by_buffer.setdefault(key, []).append(param)
    return by_buffer
