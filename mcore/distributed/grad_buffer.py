"""Contiguous gradient buffers cut into buckets, and the collectives that reduce them.

Layout of one buffer (all parameters of one (param dtype, grad dtype) pair, in the reverse order of
``module.parameters()``, which is roughly the order in which backward produces their gradients)::

    grad_data:  | bucket 0                  | bucket 1          | ...
                | p9 | p8 | p7 ...| padding | p3 | p2 | p1 ... |
    param.main_grad = grad_data[start:end].view(param.shape)

With the distributed optimizer every bucket is padded to a multiple of the data-parallel size and
split into ``dp`` equal shards; data-parallel rank ``r`` owns shard ``r`` of every bucket. A
parameter may straddle shards: each rank owns the (possibly empty) contiguous piece of it that falls
in its shard (see :meth:`GradBuffer.local_range`). Gradients are reduce-scattered, so after the sync
only the owned shard holds the averaged gradient. Parameters then live in ``param_data``, a buffer of
the same layout in the parameter dtype (``param.data`` is a view into it), so that updated shards
are all-gathered with one collective per bucket. The one-pass optimizer keeps parameters in
``param_data`` without the distributed optimizer too, so it can update a whole buffer at once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mcore.tensor_parallel.first_grad import UNWRITTEN, opts_in, zero_if_unwritten

# torch 2.10 renamed the tensor-in/tensor-out collectives; the signatures are the same.
reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_into_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_DISTOPT_BUCKET_ALIGN = 128
"""Distributed-optimizer buckets end on a multiple of lcm(dp, 128) elements, as in Megatron."""


@dataclass(frozen=True)
class CommSpec:
    """How gradients are reduced across the data-parallel group."""

    group: dist.ProcessGroup | None
    size: int
    rank: int
    average_in_collective: bool
    use_distributed_optimizer: bool
    grad_scale: float | None = None
    """What the summed gradients are multiplied by; ``None`` is ``1 / size`` (the average over the
    group). Expert buffers reduce over edp but average over the dense dp x cp size (see
    :mod:`mcore.distributed.ddp`)."""
    expert: bool = False
    """The buffer holds expert-parallel parameters (reduced over ``groups.edp``)."""

    @property
    def scale(self) -> float:
        return 1.0 / self.size if self.grad_scale is None else self.grad_scale

    @property
    def active(self) -> bool:
        return self.size > 1 and dist.is_available() and dist.is_initialized()


class Bucket:
    """A contiguous range of a buffer whose gradients are reduced by one collective."""

    def __init__(
        self, buffer: GradBuffer, index: int, start: int, end: int, params: list[torch.nn.Parameter]
    ):
        self.buffer = buffer
        self.index = index
        self.start = start
        self.end = end
        self.params = params
        self.grad_data = buffer.grad_data[start:end]
        self.param_data = buffer.param_data[start:end] if buffer.param_data is not None else None
        self.ready: set[int] = set()
        self.grad_handle = None
        self.grad_started = False
        self.param_handle = None
        self.nan_flag: torch.Tensor | None = None
        self.local_norm_sq: torch.Tensor | None = None
        """``||grad_data||^2`` (fp32, on the device) as the NaN check read it, when no reduction follows;
        the optimizer's clipping norm may use it instead of reading the gradients again, as long as
        :attr:`local_norm_version` is still the buffer's version (see
        ``FlatBufferState.grad_norm_squared``). None otherwise."""
        self.local_norm_version = -1
        """The gradient buffer's version counter (bumped by every in-place write to any of its views)
        when :attr:`local_norm_sq` was taken."""
        self.unwritten: list[torch.nn.Parameter] = []
        """This step's parameters of the bucket whose ``main_grad`` the buffer's reset did not zero
        (:mod:`mcore.tensor_parallel.first_grad`); those still unwritten are zeroed before the reduction."""

    @property
    def numel(self) -> int:
        return self.end - self.start

    def shard_range(self, dp_rank: int) -> tuple[int, int]:
        """Buffer indices of the shard of this bucket owned by ``dp_rank`` (distributed optimizer)."""
        size = self.numel // self.buffer.comm.size
        return self.start + dp_rank * size, self.start + (dp_rank + 1) * size

    def _local_view(self, data: torch.Tensor) -> torch.Tensor:
        size = self.numel // self.buffer.comm.size
        r = self.buffer.comm.rank
        return data[r * size : (r + 1) * size]

    def reset(self) -> None:
        self.ready.clear()
        self.grad_handle = None
        self.grad_started = False
        self.nan_flag = None
        self.local_norm_sq = None

    def mark_ready(self, param: torch.nn.Parameter) -> bool:
        """Record that ``param``'s gradient is complete; return True when the whole bucket is."""
        if self.grad_started:
            raise RuntimeError(
                f"a gradient of {self.buffer.name_of(param)} arrived after its bucket's reduction started: "
                "a parameter was used again after the last micro-batch's backward reached it "
                "(turn off --overlap-grad-reduce, or run that backward inside no_sync())"
            )
        self.ready.add(id(param))
        return len(self.ready) == len(self.params)

    def start_grad_sync(self, check_for_nan: bool) -> None:
        """Launch the (asynchronous) all-reduce or reduce-scatter of this bucket's gradients."""
        if self.grad_started:
            return
        self.grad_started = True
        # a parameter that got no gradient this step: its skipped zeroing happens now, before the read
        zero_if_unwritten(self.unwritten)
        self.finish_param_sync()  # the all-gather of the last step must not race the gradient reduce
        if check_for_nan:
            # The 2-norm is NaN exactly when an element is NaN (squares are never negative, so an inf
            # cannot cancel into a NaN; overflow gives inf), and it is one read of the bucket with no
            # temporary: ``isnan(grad_data).any()`` also wrote and re-read a bool per element (1.3 GB
            # at 1.3B parameters). Megatron checks the bucket's norm the same way.
            norm = torch.linalg.vector_norm(self.grad_data, dtype=torch.float32)
            self.nan_flag = torch.isnan(norm)
        comm = self.buffer.comm
        if not comm.active:
            if comm.grad_scale is not None and comm.grad_scale != 1.0:
                # an expert buffer with edp = 1: nothing to reduce, but still the 1/(dp*cp) average
                self.grad_data.mul_(comm.grad_scale)
                return
            if check_for_nan:
                self.local_norm_sq = norm.square()
                self.local_norm_version = self.grad_data._version
            return
        op = dist.ReduceOp.SUM
        if comm.average_in_collective:
            op = dist.ReduceOp.AVG
            if comm.grad_scale is not None:  # AVG divides by size; the rest of the scale first
                self.grad_data.mul_(comm.grad_scale * comm.size)
        else:
            self.grad_data.mul_(comm.scale)
        if comm.use_distributed_optimizer:
            self.grad_handle = reduce_scatter_tensor(
                self._local_view(self.grad_data), self.grad_data, op=op, group=comm.group, async_op=True
            )
        else:
            self.grad_handle = dist.all_reduce(self.grad_data, op=op, group=comm.group, async_op=True)

    def finish_grad_sync(self, check_for_nan: bool) -> None:
        self.start_grad_sync(check_for_nan)
        if self.grad_handle is not None:
            self.grad_handle.wait()
            self.grad_handle = None

    def start_param_sync(self) -> None:
        """Launch the all-gather of updated parameter shards (distributed optimizer only)."""
        comm = self.buffer.comm
        if (
            self.param_data is None
            or not comm.use_distributed_optimizer
            or not comm.active
            or self.param_handle is not None
        ):
            return
        fp8 = self.buffer.fp8_gather  # --fp8-param-gather: the FP8 copy's bytes instead
        data = self.param_data if fp8 is None else fp8.bucket_bytes(self)
        self.param_handle = all_gather_into_tensor(
            data, self._local_view(data), group=comm.group, async_op=True
        )

    def finish_param_sync(self) -> None:
        if self.param_handle is not None:
            self.param_handle.wait()
            self.param_handle = None
            if self.buffer.fp8_gather is not None:
                self.buffer.fp8_gather.after_gather(self)


class GradBuffer:
    """The gradient buffer (and, for the distributed optimizer, parameter buffer) of one dtype pair.

    Args:
        params: the parameters, in buffer order (reverse of ``module.parameters()``).
        param_dtype: their dtype.
        grad_dtype: the dtype gradients accumulate and are reduced in.
        bucket_size: elements per bucket (a bucket closes once it holds at least this many);
            ``None`` puts everything in one bucket.
        comm: the data-parallel group and how to reduce over it.
        needs_own_bucket: parameters for which this is true get a bucket of their own (the tied
            word embedding under the distributed optimizer, so that its shards line up on the first
            and last pipeline stage).
        names: parameter names for messages.
        contiguous_params: also keep the parameters in ``param_data`` without the distributed
            optimizer (the one-pass optimizer updates whole buffers).
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        param_dtype: torch.dtype,
        grad_dtype: torch.dtype,
        bucket_size: int | None,
        comm: CommSpec,
        needs_own_bucket: Callable[[torch.nn.Parameter], bool] = lambda p: False,
        names: dict[int, str] | None = None,
        contiguous_params: bool = False,
    ):
        self.param_dtype = param_dtype
        self.grad_dtype = grad_dtype
        self.comm = comm
        self.params = list(params)
        self._names = names or {}
        device = self.params[0].device

        # Lay out parameters and bucket boundaries.
        self.index: dict[int, tuple[int, int, int]] = {}  # id(param) -> (start, end, bucket index)
        bucket_bounds: list[tuple[int, int, list[torch.nn.Parameter]]] = []
        offset, bucket_start, members = 0, 0, []

        def close_bucket() -> None:
            nonlocal offset, bucket_start, members
            if not members:
                return
            end = self._pad_bucket_end(offset)
            bucket_bounds.append((bucket_start, end, members))
            offset = bucket_start = end
            members = []

        for param in self.params:
            own = needs_own_bucket(param)
            if own:
                close_bucket()
            self.index[id(param)] = (offset, offset + param.numel(), len(bucket_bounds))
            offset += param.numel()
            members.append(param)
            if own or (bucket_size is not None and offset - bucket_start >= bucket_size):
                close_bucket()
        close_bucket()
        self.numel = offset

        self.grad_data = torch.zeros(self.numel, dtype=grad_dtype, device=device)
        self.param_data = None
        if comm.use_distributed_optimizer or contiguous_params:
            self.param_data = torch.zeros(self.numel, dtype=param_dtype, device=device)
        for param in self.params:
            start, end, _ = self.index[id(param)]
            if self.param_data is not None:
                view = self.param_data[start:end].view(param.shape)
                view.copy_(param.data)
                param.data = view
            param.main_grad = self.grad_data[start:end].view(param.shape)
        self.buckets = [Bucket(self, i, s, e, m) for i, (s, e, m) in enumerate(bucket_bounds)]
        self._unwritten: list[torch.nn.Parameter] = []  # the last reset's skipped parameters
        self._skipped_key: tuple[int, ...] = ()
        self._zero_views: list[torch.Tensor] = []  # the buffer outside the skipped parameters
        self.fp8_gather = None
        """``--fp8-param-gather``: the buffer's :class:`~mcore.fp8.param_gather.Fp8ParamGather`
        (its buckets all-gather FP8 bytes instead of ``param_data``), set by the DDP wrapper."""

    def _pad_bucket_end(self, end: int) -> int:
        if not self.comm.use_distributed_optimizer:
            return end
        align = math.lcm(self.comm.size, _DISTOPT_BUCKET_ALIGN)
        return -(-end // align) * align

    def name_of(self, param: torch.nn.Parameter) -> str:
        return self._names.get(id(param), f"a parameter of shape {tuple(param.shape)}")

    def bucket_of(self, param: torch.nn.Parameter) -> Bucket:
        return self.buckets[self.index[id(param)][2]]

    def buffer_range(self, param: torch.nn.Parameter) -> tuple[int, int]:
        """``[start, end)`` of ``param`` in this buffer."""
        start, end, _ = self.index[id(param)]
        return start, end

    def local_range(self, param: torch.nn.Parameter) -> tuple[int, int] | None:
        """The piece of ``param`` (flattened ``[start, end)``) this data-parallel rank owns, or None.

        Without the distributed optimizer every rank owns all of every parameter.
        """
        start, end, bucket_index = self.index[id(param)]
        if not self.comm.use_distributed_optimizer:
            return 0, end - start
        lo, hi = self.buckets[bucket_index].shard_range(self.comm.rank)
        lo, hi = max(lo, start), min(hi, end)
        if lo >= hi:
            return None
        return lo - start, hi - start

    def reset(self, overwrite_first: bool = False) -> None:
        """Zero the gradients and forget which buckets were reduced.

        ``overwrite_first``: leave the ``main_grad`` of the parameters that opt in
        (:func:`~mcore.tensor_parallel.first_grad.opts_in`) as it is and flag it unwritten instead (their
        first gradient of the step is written over it, see :mod:`mcore.tensor_parallel.first_grad`); the
        rest of the buffer, padding included, is zeroed with one multi-tensor zero of its ranges.
        """
        for param in self._unwritten:  # left from a step that did not reduce: zeroed now or flagged again
            setattr(param, UNWRITTEN, False)
        skipped = [p for p in self.params if opts_in(p)] if overwrite_first else []
        if not skipped:
            self.grad_data.zero_()
            if self._skipped_key:
                self._skipped_key = ()
                for bucket in self.buckets:
                    bucket.unwritten = []
        else:
            key = tuple(id(p) for p in skipped)
            if key != self._skipped_key:
                self._plan_skipped_zeroing(skipped)
                self._skipped_key = key
            if self._zero_views:
                torch._foreach_zero_(self._zero_views)
            for param in skipped:
                setattr(param, UNWRITTEN, True)
        self._unwritten = skipped
        for bucket in self.buckets:
            bucket.reset()

    def _plan_skipped_zeroing(self, skipped: list[torch.nn.Parameter]) -> None:
        """The views that zero the buffer outside ``skipped`` (maximal ranges between them, in buffer
        order) and each bucket's share of ``skipped``."""
        views, at = [], 0
        for param in sorted(skipped, key=lambda p: self.index[id(p)][0]):
            start, end, _ = self.index[id(param)]
            if start > at:
                views.append(self.grad_data[at:start])
            at = end
        if at < self.numel:
            views.append(self.grad_data[at:])
        self._zero_views = views
        for bucket in self.buckets:
            bucket.unwritten = [p for p in skipped if self.index[id(p)][2] == bucket.index]

    @property
    def grad_bytes(self) -> int:
        return self.grad_data.numel() * self.grad_data.element_size()
