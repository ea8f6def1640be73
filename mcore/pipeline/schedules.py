"""Which schedule runs a training step: no pipelining, 1F1B, or interleaved 1F1B.

:func:`get_forward_backward_func` is the one selector; its docstring is the contract between the
training loop, the user's ``forward_step_func`` and the schedules. The order of forwards and
backwards and every send and receive come from the pure tables of :mod:`mcore.pipeline.tables`;
this module only executes them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mcore.backend import current_backend
from mcore.config.fields import ConfigError, check
from mcore.pipeline.p2p import PipelineStats, StageCommunicator
from mcore.pipeline.tables import BACKWARD, FORWARD, Op, check_model_chunks, pipeline_timeline

ForwardBackwardFunc = Callable[..., list[dict[str, Any]]]


@dataclass(frozen=True, kw_only=True)
class ForwardBackwardArgs:
    """What one call of a schedule needs: every schedule takes one of these, or the same fields as
    keywords (Megatron's calling convention). The fields are documented in
    :func:`get_forward_backward_func`."""

    forward_step_func: Callable
    data_iterator: Iterator | Sequence[Iterator] | None
    model: nn.Module | Sequence[nn.Module]
    num_microbatches: int
    seq_length: int
    micro_batch_size: int
    hidden_size: int
    groups: Any
    sequence_parallel: bool = False
    dtype: torch.dtype = torch.float32
    forward_only: bool = False
    grad_scale_func: Callable | None = None
    no_sync_func: Callable | Sequence[Callable] | None = None
    finalize_grads_func: Callable | None = None
    timeout_s: float | None = None
    stats: PipelineStats | None = None
    tensor_shapes: Sequence[Sequence[tuple[int, ...]]] | None = None


def _schedule_args(args: ForwardBackwardArgs | None, keywords: dict[str, Any]) -> ForwardBackwardArgs:
    """``args``, or the :class:`ForwardBackwardArgs` of Megatron-style keywords (not both)."""
    if args is None:
        return ForwardBackwardArgs(**keywords)
    if keywords:
        raise TypeError(f"give a ForwardBackwardArgs or keywords, not both (got {sorted(keywords)})")
    return args


def get_forward_backward_func(pp_size: int, vp_size: int = 1) -> ForwardBackwardFunc:
    """Return the schedule for ``pp_size`` pipeline stages with ``vp_size`` model chunks per stage.

    ``pp_size == 1`` gives :func:`forward_backward_no_pipelining` (gradient accumulation over
    micro-batches); ``vp_size == 1`` gives :func:`forward_backward_pipelining_without_interleaving`
    (1F1B, PipeDream-Flush); ``vp_size > 1`` gives
    :func:`forward_backward_pipelining_with_interleaving` (Megatron's interleaved 1F1B).

    Every schedule takes one :class:`ForwardBackwardArgs`, or its fields as keywords as Megatron's
    schedules do::

        forward_backward(ForwardBackwardArgs(forward_step_func=..., data_iterator=..., ...))
        forward_backward(forward_step_func=..., data_iterator=..., model=..., num_microbatches=...,
                         seq_length=..., micro_batch_size=..., hidden_size=..., groups=...)

    Fields (:class:`ForwardBackwardArgs`):
        forward_step_func: ``forward_step_func(data_iterator, model_chunk) -> (output_tensor,
            loss_func)``. The schedule calls it once per micro-batch and model chunk, micro-batches
            in order for each chunk, so each chunk's iterator advances ``num_microbatches`` times
            per call (stages that need no data still call ``next`` or ignore the iterator, as they
            like). Before the call, a chunk that is not the first virtual stage gets its input
            through ``model_chunk.set_input_tensor(tensor)`` (found through ``.module`` wrappers);
            ``output_tensor`` is then the chunk's hidden states ``[s, b, h]``. On the last virtual
            stage, ``output_tensor`` is whatever the model returns (per-token loss ``[b, s]``) and
            ``loss_func(output_tensor) -> (loss, logs)`` where ``loss`` is the scalar mean loss of the
            micro-batch and ``logs`` a ``dict[str, Tensor]`` for logging. ``loss_func`` is ignored
            elsewhere.
        data_iterator: an iterator, or a list with one iterator per model chunk.
        model: a module, or a list of model chunks (virtual stages, chunk 0 first).
        num_microbatches: micro-batches in this step (per data-parallel rank).
        seq_length, micro_batch_size, hidden_size: the activation shape exchanged between stages,
            ``[seq_length / tp if sequence_parallel else seq_length, micro_batch_size, hidden_size]``
            (fixed in advance: no shape handshakes).
        groups: the job's :class:`~mcore.distributed.groups.ProcessGroups`.
        sequence_parallel: activations between stages are sharded along the sequence over TP.
        dtype: dtype of activations and gradients on the wire (the model's compute dtype).
        forward_only: evaluation: same schedule, no backward, run under ``torch.no_grad()``.
        grad_scale_func: ``grad_scale_func(loss) -> scaled_loss`` (fp16 loss scaling, Megatron's
            convention); applied to ``loss / num_microbatches`` before its backward.
        no_sync_func: a context-manager factory (DDP's ``no_sync``), or a list of them, one per
            chunk. The schedule holds it open during the backwards and leaves it just before the
            last backward of this rank (of each chunk, for a list), so gradient reduction happens
            once per step.
        finalize_grads_func: ``finalize_grads_func(model_chunks)``, called once after all
            backwards (DDP grad sync, tied-embedding and sequence-parallel norm all-reduces).
        timeout_s: deadline of each point-to-point exchange; a neighbour that misses it ends the
            step with :class:`~mcore.pipeline.p2p.PipelineCommunicationError` naming its rank.
        stats: a :class:`~mcore.pipeline.p2p.PipelineStats` that accumulates time and p2p waits
            (the measured bubble).
        tensor_shapes: for an encoder-decoder pipeline (Megatron's ``ModelType.encoder_and_decoder``),
            per pipeline stage the shapes of the tensors its forward output holds, e.g. ``[(s_e, b, h)]``
            on encoder stages and ``[(s_d, b, h), (s_e, b, h)]`` on decoder stages (decoder hidden
            states and the encoder output that every decoder stage attends to). Stage ``r`` then
            receives a list of tensors shaped ``tensor_shapes[r - 1]`` through ``set_input_tensor``
            and returns a list shaped ``tensor_shapes[r]``; gradients travel back as lists. ``None``
            (the default): one ``[s, b, h]`` tensor everywhere, as above. Needs ``vp_size == 1``.

    Returns:
        On the last pipeline stage, the ``logs`` dict of every micro-batch, in order; elsewhere ``[]``.
        Each micro-batch's loss was divided by ``num_microbatches`` before backward, so gradients
        are those of the mean loss over the step's micro-batches.

    Raises:
        ConfigError: sizes that cannot be scheduled (checked before any communication).
    """
    check(pp_size >= 1, f"pipeline_model_parallel_size={pp_size} must be >= 1")
    check(vp_size >= 1, f"virtual_pipeline_model_parallel_size={vp_size} must be >= 1")
    if pp_size == 1:
        check(
            vp_size == 1,
            f"virtual_pipeline_model_parallel_size={vp_size} needs pipeline_model_parallel_size > 1",
        )
        return forward_backward_no_pipelining
    if vp_size == 1:
        return forward_backward_pipelining_without_interleaving
    return forward_backward_pipelining_with_interleaving


# ---------------------------------------------------------------------------------------------
# one forward and one backward of one micro-batch on one chunk


_AUX_LOSS_MODULES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_AUX_LOSS_SCALES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _set_aux_loss_scale(chunks: list[nn.Module], a: ForwardBackwardArgs) -> None:
    """Give the MoE routers' aux losses the main loss's backward scale: ``loss_scale / num_microbatches``
    (x CP size: data-parallel averaging also divides by CP), as Megatron's ``MoEAuxLossAutoScaler``.
    Modules that take it have an ``aux_loss_backward_scale`` attribute (duck-typed: the schedule
    does not import the models); each chunk is searched once."""
    if a.forward_only:
        return
    modules = []
    for chunk in chunks:
        if chunk not in _AUX_LOSS_MODULES:
            _AUX_LOSS_MODULES[chunk] = [m for m in chunk.modules() if hasattr(m, "aux_loss_backward_scale")]
        modules += _AUX_LOSS_MODULES[chunk]
    if not modules:
        return
    one = torch.ones((), device=a.groups.device)
    scale = (a.grad_scale_func(one) if a.grad_scale_func else one) * (a.groups.cp_size / a.num_microbatches)
    # One tensor, updated in place, shared by the modules: a captured device graph of a layer
    # (layer_graphs) reads the scale at the address it had at capture.
    shared = _AUX_LOSS_SCALES.get(chunks[0])
    if shared is None or (shared.device, shared.dtype) != (scale.device, scale.dtype):
        shared = _AUX_LOSS_SCALES[chunks[0]] = scale.detach().clone()
    else:
        shared.copy_(scale)
    for module in modules:
        module.aux_loss_backward_scale = shared


def _as_chunks(model: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    return list(model) if isinstance(model, (list, tuple)) else [model]


def _iterator_for(data_iterator: Iterator | Sequence[Iterator] | None, chunk: int) -> Any:
    if isinstance(data_iterator, (list, tuple)):
        return data_iterator[chunk]
    return data_iterator


def _set_input_tensor(model_chunk: nn.Module, tensor: torch.Tensor) -> None:
    module = model_chunk
    while not hasattr(module, "set_input_tensor"):
        inner = getattr(module, "module", None)
        if inner is None:
            raise TypeError(
                f"{type(model_chunk).__name__} has no set_input_tensor(); a model chunk after the first "
                "pipeline stage must take its input through set_input_tensor(tensor)"
            )
        module = inner
    module.set_input_tensor(tensor)


def _forward_step(
    forward_step_func: Callable,
    data_iterator: Any,
    model_chunk: nn.Module,
    input_tensor: torch.Tensor | None,
    is_last_stage: bool,
    num_microbatches: int,
    logs: list[dict[str, Any]],
) -> torch.Tensor:
    """Run one micro-batch through one chunk; on the last stage return ``loss / num_microbatches``."""
    if input_tensor is not None:
        _set_input_tensor(model_chunk, input_tensor)
    output_tensor, loss_func = forward_step_func(data_iterator, model_chunk)
    if not is_last_stage:
        return output_tensor
    loss, log = loss_func(output_tensor)
    if loss.numel() != 1:
        raise ValueError(
            f"loss_func must return the scalar mean loss of the micro-batch, got shape {tuple(loss.shape)}"
        )
    logs.append(log)
    return loss.reshape(()) / num_microbatches


def _backward_step(
    input_tensor: torch.Tensor | None,
    output_tensor: torch.Tensor,
    output_tensor_grad: torch.Tensor | None,
    grad_scale_func: Callable | None,
) -> torch.Tensor | None:
    """Backpropagate one micro-batch through one chunk; return the gradient of its input."""
    if output_tensor_grad is None and grad_scale_func is not None:
        output_tensor = grad_scale_func(output_tensor)
    if isinstance(output_tensor, (list, tuple)):
        # Encoder-decoder stage: several outputs, each with the gradient its consumer sent back (an
        # output may be an input passed on, e.g. the encoder output: its gradient accumulates there).
        torch.autograd.backward(list(output_tensor), grad_tensors=list(output_tensor_grad))
    else:
        torch.autograd.backward(output_tensor, grad_tensors=output_tensor_grad)
    if isinstance(input_tensor, (list, tuple)):
        return [t.grad for t in input_tensor]
    return input_tensor.grad if input_tensor is not None else None


class _GradSyncControl:
    """Holds DDP's ``no_sync`` open until the last backward of the step (per chunk for a list)."""

    def __init__(self, no_sync_func: Callable | Sequence[Callable] | None, num_chunks: int) -> None:
        if no_sync_func is None:
            self.funcs: dict[int | None, Callable] = {}
        elif callable(no_sync_func):
            self.funcs = {None: no_sync_func}
        else:
            funcs = list(no_sync_func)
            if len(funcs) != num_chunks:
                raise ConfigError(f"no_sync_func has {len(funcs)} entries for {num_chunks} model chunk(s)")
            self.funcs = dict(enumerate(funcs))
        self.stacks: dict[int | None, contextlib.ExitStack] = {}

    def __enter__(self) -> _GradSyncControl:
        for key, func in self.funcs.items():
            stack = contextlib.ExitStack()
            stack.enter_context(func())
            self.stacks[key] = stack
        return self

    def before_backward(self, chunk: int, last_of_chunk: bool, last_overall: bool) -> None:
        for key in (chunk, None):
            if key in self.stacks and (last_of_chunk if key is not None else last_overall):
                self.stacks.pop(key).close()

    def __exit__(self, *exc_info) -> None:
        for stack in self.stacks.values():
            stack.__exit__(*exc_info)
        self.stacks.clear()


# ---------------------------------------------------------------------------------------------
# the schedules


def forward_backward_no_pipelining(
    args: ForwardBackwardArgs | None = None, /, **keywords: Any
) -> list[dict[str, Any]]:
    """One stage: forward and backward each micro-batch in turn, accumulating gradients.

    See :func:`get_forward_backward_func` for the contract. ``seq_length``, ``micro_batch_size``,
    ``hidden_size``, ``sequence_parallel``, ``dtype`` and ``timeout_s`` are accepted for a uniform
    signature and unused (nothing is exchanged).
    """
    a = _schedule_args(args, keywords)
    chunks = _as_chunks(a.model)
    check_model_chunks(len(chunks), 1)
    m = a.num_microbatches
    check(m >= 1, f"num_microbatches={m} must be >= 1")
    start = time.perf_counter()
    logs: list[dict[str, Any]] = []
    iterator = _iterator_for(a.data_iterator, 0)
    grad_mode = torch.no_grad() if a.forward_only else contextlib.nullcontext()
    sync = _GradSyncControl(None if a.forward_only else a.no_sync_func, 1)
    _set_aux_loss_scale(chunks, a)
    with grad_mode, sync:
        for i in range(m):
            output = _forward_step(a.forward_step_func, iterator, chunks[0], None, True, m, logs)
            if not a.forward_only:
                last = i == m - 1
                sync.before_backward(0, last, last)
                _backward_step(None, output, None, a.grad_scale_func)
    if not a.forward_only and a.finalize_grads_func is not None:
        a.finalize_grads_func(chunks)
    if a.stats is not None:
        a.stats.total_s += time.perf_counter() - start
    return logs


def _run_pipeline(vp_size: int, a: ForwardBackwardArgs) -> list[dict[str, Any]]:
    """Execute this rank's part of :func:`~mcore.pipeline.tables.pipeline_timeline`."""
    chunks = _as_chunks(a.model)
    check_model_chunks(len(chunks), vp_size)
    groups = a.groups
    p, r, m = groups.pp_size, groups.pp_rank, a.num_microbatches
    # Computing the plan checks the sizes (ConfigError) before anything is exchanged.
    program = pipeline_timeline(p, vp_size, m, a.forward_only)[r]
    _set_aux_loss_scale(chunks, a)
    shape = _activation_shape(a, vp_size)
    backend = current_backend()
    device = groups.device
    if a.stats is not None:
        backend.synchronize()
    start = time.perf_counter()
    comm = StageCommunicator(
        groups,
        shape,
        a.dtype,
        device,
        a.timeout_s,
        a.stats,
        backend.synchronize,
        stage_shapes=a.tensor_shapes,
    )

    last_stage = p * vp_size - 1
    received: dict[tuple[str, int, int], torch.Tensor] = {}
    saved: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
    logs: list[dict[str, Any]] = []
    backwards = [t.op for t in program if t.op is not None and t.op.kind == BACKWARD]
    last_backward = backwards[-1] if backwards else None
    grad_mode = torch.no_grad() if a.forward_only else contextlib.nullcontext()
    sync = _GradSyncControl(None if a.forward_only else a.no_sync_func, len(chunks))
    with grad_mode, sync:
        for tick in program:
            outgoing: list[tuple[Any, torch.Tensor]] = []
            if tick.op is not None:
                result = _run_op(
                    tick.op, r, p, m, last_stage, chunks, a.data_iterator, a.forward_step_func,
                    a.grad_scale_func, received, saved, logs, sync, last_backward, a.forward_only,
                )  # fmt: skip
                outgoing = _outgoing(tick, result, r)
            tensors = comm.exchange(outgoing, tick.recvs)
            for transfer, tensor in zip(tick.recvs, tensors):
                received[(transfer.kind, transfer.chunk, transfer.microbatch)] = tensor
    if received or saved:
        raise RuntimeError(f"pipeline step ended with unused tensors: {sorted(received)} {sorted(saved)}")
    if not a.forward_only and a.finalize_grads_func is not None:
        a.finalize_grads_func(chunks)
    if a.stats is not None:
        backend.synchronize()
        a.stats.total_s += time.perf_counter() - start
    return logs


def _activation_shape(a: ForwardBackwardArgs, vp_size: int) -> tuple[int, int, int]:
    """The ``[s, b, h]`` shape of the tensors exchanged between stages (``s/tp`` with sequence
    parallelism), after checking the sizes, ``tensor_shapes`` and the per-chunk data iterators.

    Raises:
        ConfigError: a sequence not divisible by TP under sequence parallelism, or ``tensor_shapes``
            that do not give one entry per stage (or with virtual stages).
        TypeError: several chunks but not one data iterator per chunk.
    """
    groups, seq_length = a.groups, a.seq_length
    p, tp = groups.pp_size, groups.tp_size
    if a.sequence_parallel:
        check(
            seq_length % tp == 0,
            f"seq_length={seq_length} is not divisible by tensor_model_parallel_size={tp} "
            "(sequence parallelism shards activations along the sequence)",
        )
    shape = (seq_length // tp if a.sequence_parallel else seq_length, a.micro_batch_size, a.hidden_size)
    if a.tensor_shapes is not None:
        check(
            vp_size == 1 and len(a.tensor_shapes) == p,
            f"an encoder-decoder pipeline needs one entry of tensor_shapes per stage ({len(a.tensor_shapes)} "
            f"for pipeline_model_parallel_size={p}) and no virtual stages (got {vp_size} chunks)",
        )
    if vp_size > 1 and a.data_iterator is not None and not isinstance(a.data_iterator, (list, tuple)):
        raise TypeError(
            f"with {vp_size} model chunks, data_iterator must be a list of {vp_size} iterators "
            "(one per chunk), or None"
        )
    return shape


def _outgoing(tick, result, r: int) -> list[tuple[Any, Any]]:
    """What ``tick`` sends: the op's result (detached; a list for several tensors) once per transfer.

    Raises:
        RuntimeError: a backward op that sends but whose chunk input received no gradient.
    """
    parts = list(result) if isinstance(result, (list, tuple)) else [result]
    if tick.sends and any(part is None for part in parts):
        raise RuntimeError(
            f"{tick.op} on pipeline stage {r}: the chunk's input received no gradient; "
            "its output must depend on the tensor given through set_input_tensor()"
        )
    return [
        (
            transfer,
            [t.detach() for t in parts] if isinstance(result, (list, tuple)) else result.detach(),
        )
        for transfer in tick.sends
    ]


def _run_op(
    op: Op,
    rank: int,
    p: int,
    m: int,
    last_stage: int,
    chunks: list[nn.Module],
    data_iterator: Any,
    forward_step_func: Callable,
    grad_scale_func: Callable | None,
    received: dict,
    saved: dict,
    logs: list,
    sync: _GradSyncControl,
    last_backward: Op | None,
    forward_only: bool,
) -> torch.Tensor | None:
    """Run one forward or backward; return what goes to the neighbour (or None)."""
    stage = op.chunk * p + rank
    key = (op.chunk, op.microbatch)
    if op.kind == FORWARD:
        input_tensor = received.pop((FORWARD, *key)) if stage > 0 else None
        output = _forward_step(
            forward_step_func,
            _iterator_for(data_iterator, op.chunk),
            chunks[op.chunk],
            input_tensor,
            stage == last_stage,
            m,
            logs,
        )
        if not forward_only:
            saved[key] = (input_tensor, output)
        return output if stage < last_stage else None
    input_tensor, output = saved.pop(key)
    output_grad = received.pop((BACKWARD, *key)) if stage < last_stage else None
    sync.before_backward(op.chunk, op.microbatch == m - 1, op == last_backward)
    return _backward_step(input_tensor, output, output_grad, grad_scale_func)


def forward_backward_pipelining_without_interleaving(
    args: ForwardBackwardArgs | None = None, /, **keywords: Any
) -> list[dict[str, Any]]:
    """1F1B (PipeDream-Flush): warm-up forwards, one forward one backward, cool-down backwards.

    Rank ``r`` of ``p`` keeps at most ``p - r`` micro-batches' activations alive. See
    :func:`get_forward_backward_func` for the contract; ``model`` is one module (or a list of one).
    """
    return _run_pipeline(1, _schedule_args(args, keywords))


def forward_backward_pipelining_with_interleaving(
    args: ForwardBackwardArgs | None = None, /, **keywords: Any
) -> list[dict[str, Any]]:
    """Interleaved 1F1B: each rank holds ``v`` model chunks; the bubble shrinks to ``(p-1)/(v*m)``.

    See :func:`get_forward_backward_func` for the contract. ``model`` is the list of this rank's
    chunks (chunk ``c`` is virtual stage ``c * p + pp_rank``; ``v = len(model)``) and
    ``num_microbatches`` must be a multiple of ``p``.
    """
    a = _schedule_args(args, keywords)
    chunks = _as_chunks(a.model)
    return _run_pipeline(len(chunks), dataclasses.replace(a, model=chunks))
