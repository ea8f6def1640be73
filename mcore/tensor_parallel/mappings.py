"""Autograd-aware tensor- and sequence-parallel collectives: the only module that calls
``torch.distributed`` collectives for TP/SP.

Every public function is named verb + direction + region and takes the tensor-parallel ``group``
(``groups.tp`` from :class:`mcore.distributed.groups.ProcessGroups`). With ``group=None`` (one
process) or a group of size 1 each function returns its input unchanged, so layers read the same at
any TP size.

Regions (``p`` = TP size, ``r`` = this rank):

* tensor-model-parallel region: each rank holds ``1/p`` of the *last* dim (hidden features,
  heads, vocabulary) and the full sequence;
* sequence-parallel region: each rank holds ``1/p`` of the *first* dim (the sequence, activations
  are ``[s, b, h]``) and the full hidden size.

==============================================  ====================  ==========================
function                                        forward               backward
==============================================  ====================  ==========================
copy_to_tensor_model_parallel_region            identity              all-reduce
reduce_from_tensor_model_parallel_region        all-reduce            identity
scatter_to_tensor_model_parallel_region         keep chunk r (last)   all-gather (last)
gather_from_tensor_model_parallel_region        all-gather (last)     keep chunk r (last)
scatter_to_sequence_parallel_region             keep chunk r (first)  all-gather (first)
gather_from_sequence_parallel_region            all-gather (first)    reduce-scatter (first) [*]
reduce_scatter_to_sequence_parallel_region      reduce-scatter        all-gather (first)
==============================================  ====================  ==========================

[*] or "keep chunk r" with ``tensor_parallel_output_grad=False``: the gathered tensor feeds a
computation that is replicated (not split) over the TP ranks, so its gradient is already complete.

Plain (non-autograd) helpers for code that reduces statistics itself (vocab-parallel cross-entropy,
sequence-parallel gradient reduction) are at the end of the module.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

# torch >= 2.12 renamed the single-tensor collectives; keep working on the older spelling (>= 2.4).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_size(group: dist.ProcessGroup | None) -> int:
    """Ranks in ``group`` (1 for ``None``, the one-process job)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank inside ``group`` (0 for ``None``)."""
    return 0 if group is None else dist.get_rank(group)


def _is_trivial(group: dist.ProcessGroup | None) -> bool:
    return group is None or dist.get_world_size(group) == 1


# -- primitives (no autograd) -------------------------------------------------------------------


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def _split_last(x: torch.Tensor, group) -> torch.Tensor:
    size, rank = group_size(group), group_rank(group)
    if x.shape[-1] % size:
        raise ValueError(f"last dim {x.shape[-1]} is not divisible by tensor_model_parallel_size={size}")
    return x.chunk(size, dim=-1)[rank].contiguous()


def _gather_last(x: torch.Tensor, group) -> torch.Tensor:
    size = group_size(group)
    x = x.contiguous()
    # Gather along the first dim (contiguous chunks), then move the rank blocks to the last dim.
    out = torch.empty((size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(out, x, group=group)
    return torch.cat(out.chunk(size, dim=0), dim=-1).contiguous()


def _check_sequence_divisible(x: torch.Tensor, size: int) -> None:
    if x.shape[0] % size:
        raise ValueError(
            f"sequence length {x.shape[0]} is not divisible by tensor_model_parallel_size={size} "
            "(sequence parallelism splits the sequence over the TP ranks)"
        )


def _gathered_buffer(x: torch.Tensor, size: int) -> torch.Tensor:
    """The ``[size * s, ...]`` output of an all-gather of ``x [s, ...]`` along the first dim."""
    return torch.empty((size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)


def _scattered_buffer(x: torch.Tensor, size: int) -> torch.Tensor:
    """The ``[s / size, ...]`` output of a reduce-scatter of ``x [s, ...]`` along the first dim."""
    _check_sequence_divisible(x, size)
    return torch.empty((x.shape[0] // size, *x.shape[1:]), dtype=x.dtype, device=x.device)


def _split_first(x: torch.Tensor, group) -> torch.Tensor:
    size, rank = group_size(group), group_rank(group)
    _check_sequence_divisible(x, size)
    return x.chunk(size, dim=0)[rank].contiguous()


def _gather_first(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    out = _gathered_buffer(x, group_size(group))
    _all_gather_single(out, x, group=group)
    return out


def _reduce_scatter_first(x: torch.Tensor, group) -> torch.Tensor:
    out = _scattered_buffer(x, group_size(group))
    x = x.contiguous()
    _reduce_scatter_single(out, x, group=group)
    return out


# -- autograd functions ---------------------------------------------------------------------------


class _CopyToTensorParallel(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce the gradient over the TP group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """Forward: all-reduce (sum) over the TP group. Backward: identity."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTensorParallel(torch.autograd.Function):
    """Forward: keep this rank's chunk of the last dim. Backward: all-gather the last dim."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last(grad, ctx.group), None


class _GatherFromTensorParallel(torch.autograd.Function):
    """Forward: all-gather the last dim. Backward: keep this rank's chunk of the last dim."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.group), None


class _ScatterToSequenceParallel(torch.autograd.Function):
    """Forward: keep this rank's chunk of the sequence (first) dim. Backward: all-gather it."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_first(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_first(grad, ctx.group), None


class _GatherFromSequenceParallel(torch.autograd.Function):
    """Forward: all-gather the sequence dim. Backward: reduce-scatter it (or keep the own chunk)."""

    @staticmethod
    def forward(ctx, x, group, tensor_parallel_output_grad):
        ctx.group = group
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        return _gather_first(x, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.tensor_parallel_output_grad:
            return _reduce_scatter_first(grad, ctx.group), None, None
        return _split_first(grad, ctx.group), None, None


class _ReduceScatterToSequenceParallel(torch.autograd.Function):
    """Forward: reduce-scatter along the sequence dim. Backward: all-gather it."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_first(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_first(grad, ctx.group), None


# -- public API -------------------------------------------------------------------------------------


def copy_to_tensor_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Enter a TP region with a replicated input: identity forward, all-reduce of the gradient."""
    return x if _is_trivial(group) else _CopyToTensorParallel.apply(x, group)


def reduce_from_tensor_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Leave a TP region by summing the partial results of every rank (identity backward)."""
    return x if _is_trivial(group) else _ReduceFromTensorParallel.apply(x, group)


def scatter_to_tensor_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Keep this rank's ``1/p`` of the last dim (gradient: all-gather)."""
    return x if _is_trivial(group) else _ScatterToTensorParallel.apply(x, group)


def gather_from_tensor_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Concatenate every rank's last-dim chunk in rank order (gradient: keep own chunk)."""
    return x if _is_trivial(group) else _GatherFromTensorParallel.apply(x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Keep this rank's ``1/p`` of the sequence (first) dim (gradient: all-gather)."""
    return x if _is_trivial(group) else _ScatterToSequenceParallel.apply(x, group)


def gather_from_sequence_parallel_region(
    x: torch.Tensor, group, tensor_parallel_output_grad: bool = True
) -> torch.Tensor:
    """All-gather the sequence dim in rank order.

    Args:
        tensor_parallel_output_grad: the gathered tensor feeds a TP-split computation (a
            column-parallel linear), so each rank's gradient is partial and the backward is a
            reduce-scatter. ``False``: the consumer is replicated; the backward keeps the own chunk.
    """
    if _is_trivial(group):
        return x
    return _GatherFromSequenceParallel.apply(x, group, tensor_parallel_output_grad)


def all_gather_along_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """``[s/p, ...] -> [s, ...]`` in rank order, outside autograd (a recipe's recomputation)."""
    return x if _is_trivial(group) else _gather_first(x, group)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Sum partial results and keep this rank's ``1/p`` of the sequence dim (gradient: all-gather)."""
    return x if _is_trivial(group) else _ReduceScatterToSequenceParallel.apply(x, group)


# -- plain collectives (no autograd) ----------------------------------------------------------------


class _Pending:
    """A collective's output and the work to wait on before reading it (``None``: already complete)."""

    __slots__ = ("output", "work", "_input")

    def __init__(self, output: torch.Tensor, work=None, input: torch.Tensor | None = None):
        self.output = output
        self.work = work
        self._input = input  # alive until the collective is done with it

    def wait(self) -> torch.Tensor:
        """The output, once the collective has written it: on a device backend the current stream
        waits for the communication stream; the host does not block."""
        if self.work is not None:
            self.work.wait()
            self.work = self._input = None
        return self.output


def _launch(collective, out: torch.Tensor, x: torch.Tensor, group) -> _Pending:
    # Asynchronous where it can overlap with the computation that follows; a traced graph (dynamo)
    # gets the synchronous form, which it can capture.
    if torch.compiler.is_compiling():
        collective(out, x, group=group)
        return _Pending(out)
    return _Pending(out, collective(out, x, group=group, async_op=True), x)


def start_all_gather_along_sequence(x: torch.Tensor, group) -> _Pending:
    """Start ``[s/p, ...] -> [s, ...]`` (rank order), outside autograd; ``.wait()`` returns it."""
    if _is_trivial(group):
        return _Pending(x)
    x = x.contiguous()
    return _launch(_all_gather_single, _gathered_buffer(x, group_size(group)), x, group)


def start_reduce_scatter_along_sequence(x: torch.Tensor, group) -> _Pending:
    """Start the sum over the TP ranks of ``x [s, ...]``, keeping this rank's ``[s/p, ...]``, outside
    autograd; ``.wait()`` returns it."""
    if _is_trivial(group):
        return _Pending(x)
    out = _scattered_buffer(x, group_size(group))
    return _launch(_reduce_scatter_single, out, x.contiguous(), group)


def all_reduce_in_tensor_model_parallel_group(x: torch.Tensor, group, op: str = "sum") -> torch.Tensor:
    """All-reduce ``x`` in place over the TP group (``op``: ``"sum"`` or ``"max"``); no autograd."""
    if not _is_trivial(group):
        dist.all_reduce(x, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=group)
    return x


def all_reduce_coalesced(tensors: Iterable[torch.Tensor], group) -> None:
    """Sum ``tensors`` in place over ``group`` with one all-reduce per dtype (flattened together)."""
    if _is_trivial(group):
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        flat = torch._utils._flatten_dense_tensors(same)
        dist.all_reduce(flat, group=group)
        for t, reduced in zip(same, torch._utils._unflatten_dense_tensors(flat, same)):
            t.copy_(reduced)


def all_reduce_sequence_parallel_grads(params: Iterable[torch.nn.Parameter], group) -> None:
    """Sum the gradients of parameters used on sequence-parallel shards over the TP group.

    With ``--sequence-parallel`` each TP rank applies the replicated norm weights and row-parallel
    biases to its own part of the sequence, so each rank's gradient covers only that part. The
    training step calls this (with the parameters whose ``shard_layout.sequence_parallel`` is set,
    see :meth:`mcore.models.gpt.gpt_model.GPTModel.sequence_parallel_parameters`) after backward and before
    the data-parallel reduction, as Megatron's ``finalize_model_grads`` does. One coalesced all-reduce
    (:func:`all_reduce_coalesced`). Gradients are read from ``param.main_grad`` when present (a DDP
    grad buffer), else ``param.grad``.
    """
    grads = []
    for p in params:
        g = getattr(p, "main_grad", None)
        g = p.grad if g is None else g
        if g is not None:
            grads.append(g)
    all_reduce_coalesced(grads, group)
