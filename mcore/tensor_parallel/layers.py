"""Tensor-parallel layers: column- and row-parallel linear, vocab-parallel embedding.

Notation: ``p`` TP ranks, ``t`` this rank. Weights use ``torch.nn.Linear``'s layout ``[out, in]``,
so ``Y = X A`` with ``A = W^T``. Parameters are created uninitialized with a
:class:`~mcore.tensor_parallel.sharding.ParamLayout` attached; the model fills them from the logical
tensors (:func:`~mcore.tensor_parallel.sharding.initialize_parameters`), so values do not depend on
``p``. Every layer returns ``(output, bias)`` as Megatron's do: ``bias`` is the not-yet-added bias when
``skip_bias_add=True`` (so it can be fused into the next op), else ``None``.

Sequence parallelism: activations outside the TP regions are ``[s/p, b, h]``. A column-parallel layer
all-gathers its input along ``s`` (gradient: reduce-scatter) and a row-parallel layer reduce-scatters
its output along ``s`` instead of all-reducing it (gradient: all-gather). See
:mod:`mcore.tensor_parallel.mappings`. The column-parallel layer keeps its ``[s/p, b, in]`` input,
not the gathered ``[s, b, in]``, for the weight gradient and all-gathers it again in backward, as
Megatron does: one more all-gather per layer and backward pass, for ``1/p`` of the activation memory.
That all-gather runs under the dgrad GEMM, and the reduce-scatter of the input gradient under the
weight-gradient GEMM (:class:`_SequenceParallelColumnLinear`).

Gradient-accumulation fusion (``gradient_accumulation_fusion=True``, on by default in models;
``--no-gradient-accumulation-fusion`` turns it off, as in Megatron): when the weight has a ``main_grad`` (a view into the DDP gradient
buffer, see :mod:`mcore.distributed.ddp`), the backward accumulates the weight gradient into it
(``main_grad += dY^T X``, the backend's ``accumulate_weight_grad``: one GEMM with beta=1) instead of
producing a gradient tensor that the DDP hook then adds. See :func:`linear_with_grad_accumulation_fusion`.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from mcore.data.token_ids import TokenIdRange
from mcore.tensor_parallel.first_grad import is_unwritten, set_opt_in, zero_if_unwritten
from mcore.tensor_parallel.mappings import (
    all_gather_along_sequence,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    group_rank,
    group_size,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
    start_all_gather_along_sequence,
    start_reduce_scatter_along_sequence,
)
from mcore.tensor_parallel.recompute import RecomputeWhenSaved
from mcore.tensor_parallel.sharding import ZEROS, InitMethod, NormalInit, ParamLayout, make_parameter
from mcore.tensor_parallel.weight_grad import weight_grad


class _LinearWithGradAccumulationFusion(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` whose backward adds ``dY^T X`` into ``main_grad`` in place.

    The weight's gradient is a placeholder, ``torch.empty_like(weight)``, when the caller owns the
    weight (the DDP hook discards it, see ``weight.grad_added_to_main_grad``): a tensor and not
    ``None``, so that the post-accumulate-grad hook still fires and marks the bucket ready. When the
    weight is shared with other autograd uses (the tied output layer) it is ``None``: the other use
    (the embedding lookup) gives the gradient that fires the hook, which adds it to ``main_grad``; a
    zero placeholder would cost a fill and an add over the whole ``[V, h]`` weight to give the same
    sum.
    The backward has no side effect besides the in-place accumulation, so dynamo can trace it.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, main_grad, zero_placeholder):
        ctx.save_for_backward(x, weight)
        ctx.main_grad = main_grad
        ctx.zero_placeholder = zero_placeholder
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        grad_input = grad_output.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_2d = grad_output.reshape(-1, grad_output.shape[-1])
        grad_bias = grad_2d.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        grad_weight = weight_grad(ctx, weight, grad_2d, x.reshape(-1, x.shape[-1]))
        return grad_input, grad_weight, grad_bias, None, None


class _SequenceParallelColumnLinear(torch.autograd.Function):
    """A column-parallel ``F.linear`` of a sequence-parallel input, with Megatron's overlap.

    Shapes: ``x_t [s/p, b, in]`` (this rank's part of the sequence), ``weight [out/p, in]``::

        forward:   X = all_gather_s(x_t)           [s, b, in]
                   Y = X W^T + bias                [s, b, out/p]
        backward:  X = all_gather_s(x_t)           started first, free to run under the dgrad GEMM
                   dX = dY W                       [s, b, in]
                   dx_t = reduce_scatter_s(dX)     started next, free to run under the wgrad GEMM
                   main_grad += dY^T X  (or dW = dY^T X),  dbias = sum dY

    Autograd keeps ``x_t``, not ``X``: ``1/p`` of the input's memory for one more all-gather per
    backward (on 2 x H200 at 24L h2048, 3.8% of the step with device graphs after the overlap;
    ``benchmarks/README.md``). ``main_grad``/``zero_placeholder`` as in :class:`_LinearWithGradAccumulationFusion`
    (``main_grad`` None: the weight gradient is returned).
    """

    @staticmethod
    def forward(ctx, x_local, weight, bias, main_grad, zero_placeholder, group):
        ctx.save_for_backward(x_local, weight)
        ctx.main_grad = main_grad
        ctx.zero_placeholder = zero_placeholder
        ctx.has_bias = bias is not None
        ctx.group = group
        return F.linear(all_gather_along_sequence(x_local, group), weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        x_local, weight = ctx.saved_tensors
        gather = start_all_gather_along_sequence(x_local, ctx.group)
        scatter = None
        if ctx.needs_input_grad[0]:
            scatter = start_reduce_scatter_along_sequence(grad_output.matmul(weight), ctx.group)
        grad_2d = grad_output.reshape(-1, grad_output.shape[-1])
        grad_bias = grad_2d.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        total = gather.wait()
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = weight_grad(ctx, weight, grad_2d, total.reshape(-1, total.shape[-1]))
        grad_input = None if scatter is None else scatter.wait()
        return grad_input, grad_weight, grad_bias, None, None, None


def linear_with_grad_accumulation_fusion(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    gradient_accumulation_fusion: bool,
    shared_weight: bool = False,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` (``x [..., in]``, ``weight [out, in]``), fusing the weight
    gradient into ``weight.main_grad`` when possible.

    Fusion happens when it is enabled, autograd records the call, and ``weight.main_grad`` exists;
    otherwise this is ``F.linear`` (no DDP wrapper, inference). The backend's
    ``accumulate_weight_grad`` does the accumulation: for an fp32 ``main_grad`` of bf16 weights (the
    default ``--bf16`` run) the CUDA backend accumulates in fp32 inside the GEMM; the reference adds
    the bf16 product, as the unfused path would.

    The DDP hook learns that ``weight.grad`` is a placeholder from ``weight.grad_added_to_main_grad``.
    That flag describes the layer that owns the weight, not one backward: it is written here, in the
    forward (dynamo replays attribute writes made in a compiled forward, but refuses them inside an
    autograd Function's backward), to True when the owner fuses and back to False when it does not.
    It is therefore constant over the micro-batches of a step, however the pipeline schedule
    interleaves their forwards and backwards. A weight used by fusing layers must get no gradient
    from other autograd uses unless they pass ``shared_weight=True``.

    Args:
        shared_weight: the weight belongs to another module and has other autograd uses (the tied
            output layer gets the word embedding): fuse, return no weight gradient and leave the flag
            alone, so the other uses' gradient still reaches ``main_grad`` through the hook.
    """
    main_grad = fusion_main_grad(weight, gradient_accumulation_fusion, shared_weight)
    if main_grad is None:
        return F.linear(x, weight, bias)
    return _LinearWithGradAccumulationFusion.apply(x, weight, bias, main_grad, shared_weight)


def fusion_main_grad(
    weight: torch.Tensor,
    gradient_accumulation_fusion: bool,
    shared_weight: bool,
    overwrites_first: bool = False,
) -> torch.Tensor | None:
    """The ``main_grad`` a fusing layer accumulates ``weight``'s gradient into, or None (no fusion:
    disabled, no DDP buffer, no autograd), after writing ``weight.grad_added_to_main_grad`` as
    :func:`linear_with_grad_accumulation_fusion` describes (left alone for a shared weight).

    ``overwrites_first``: the layer's backward writes the step's first gradient over ``main_grad``
    (:func:`mcore.tensor_parallel.first_grad.take_first_write`; the FP8 linears): with fusion, the weight
    opts in to the DDP's skipped zeroing, written here like ``grad_added_to_main_grad``. Any other use
    that will add to a ``main_grad`` still flagged unwritten zeroes it first."""
    main_grad = getattr(weight, "main_grad", None) if gradient_accumulation_fusion else None
    fuse = main_grad is not None and weight.requires_grad and torch.is_grad_enabled()
    overwrites = fuse and overwrites_first and not shared_weight
    if not shared_weight:
        if fuse:
            weight.grad_added_to_main_grad = True
        elif getattr(weight, "grad_added_to_main_grad", False) and torch.is_grad_enabled():
            weight.grad_added_to_main_grad = False  # fusion turned off since the last step
        if torch.is_grad_enabled():
            set_opt_in(weight, overwrites)
    if not overwrites and torch.is_grad_enabled() and is_unwritten(weight):
        zero_if_unwritten((weight,))  # this use adds: main_grad must hold real zeros
    return main_grad if fuse else None


def column_parallel_input(x: torch.Tensor, group, sequence_parallel: bool):
    """A column-parallel layer's full input, and the context to compute with it in.

    With sequence parallelism ``x [s/p, b, in]`` is all-gathered along ``s`` (gradient:
    reduce-scatter). The layer's weight gradient needs the gathered ``[s, b, in]``; inside the
    returned context autograd keeps ``x`` instead and gathers it again when backward reads it
    (:class:`~mcore.tensor_parallel.recompute.RecomputeWhenSaved`), as Megatron's linear does: one
    more all-gather in backward for ``1/p`` of the memory. Without it, ``x`` is the full input
    (gradient: all-reduce over TP) and the context does nothing.
    """
    if not sequence_parallel:
        return copy_to_tensor_model_parallel_region(x, group), contextlib.nullcontext()
    total = gather_from_sequence_parallel_region(x, group, tensor_parallel_output_grad=True)
    return total, RecomputeWhenSaved(total, all_gather_along_sequence, x, group)


def _setup_fp8(layer: torch.nn.Module, fp8, parallel_mode: str, device) -> None:
    """Give ``layer`` its FP8 call description (and the delayed recipe's state as ``layer.fp8_state``).

    ``fp8``: the :class:`~mcore.fp8.config.Fp8Config` (None or disabled: no FP8). The config builds
    the call (:meth:`~mcore.fp8.config.Fp8Config.linear_call`) and this module only calls it:
    :mod:`mcore.fp8` sits above the tensor-parallel layers (it uses their collectives)."""
    layer.fp8 = fp8 if fp8 is not None and fp8.enabled else None
    layer.fp8_state = None
    layer._fp8_call = None
    # the weight's FP8 copy, set by DDP with --fp8-param-gather (mcore.fp8.param_gather)
    layer.fp8_gathered_weight = None
    if layer.fp8 is None:
        return
    call = layer.fp8.linear_call(layer.tp_group, parallel_mode, device)
    layer.fp8_state = call.state
    layer._fp8_call = call


class ColumnParallelLinear(torch.nn.Module):
    """``Y = X A + b`` with ``A`` split by columns over the TP ranks.

    ``A = [A_1, ..., A_p]``, ``b = [b_1, ..., b_p]``: rank ``t`` computes ``Y_t = X A_t + b_t``, its
    ``1/p`` of the output features, from the full input ``X``. Its weight is ``[out/p, in]`` (rows
    ``[t*out/p, (t+1)*out/p)`` of the logical ``[out, in]`` weight, or the ``num_stacked`` analogue).

    Args:
        input_size, output_size: the logical (unsplit) sizes.
        tp_group: the tensor-parallel group (``groups.tp``); ``None`` for one process.
        bias: add a bias (split like the output).
        gather_output: all-gather ``Y`` so every rank returns the full ``[..., out]``; otherwise
            ``[..., out/p]``.
        skip_bias_add: return the bias instead of adding it.
        sequence_parallel: the input is ``[s/p, b, in]``; all-gather it along ``s`` first.
        init_method: init of the logical weight (default ``N(0, 0.02^2)``).
        num_stacked: the logical weight is that many sub-matrices stacked along the output dim, each
            split over TP (2 for SwiGLU's ``[gate; up]``).
        vocab_padded: the output dim is the padded vocabulary (the output layer).
        skip_weight_param_allocation: create no weight; ``forward`` receives it (tied output layer).
        gradient_accumulation_fusion: accumulate the weight gradient into ``weight.main_grad`` in the
            backward (:func:`linear_with_grad_accumulation_fusion`).
        fp8: run the GEMMs in FP8 with this :class:`~mcore.fp8.config.Fp8Config`
            (:mod:`mcore.fp8.linear`); with sequence
            parallelism the input is all-gathered in its own dtype and quantized after the gather.
        params_dtype, device: dtype and device of the parameters.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        tp_group=None,
        bias: bool = True,
        gather_output: bool = False,
        skip_bias_add: bool = False,
        sequence_parallel: bool = False,
        init_method: InitMethod | None = None,
        num_stacked: int = 1,
        vocab_padded: bool = False,
        skip_weight_param_allocation: bool = False,
        gradient_accumulation_fusion: bool = False,
        fp8=None,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
    ):
        super().__init__()
        if gather_output and sequence_parallel:
            raise ValueError("ColumnParallelLinear: gather_output is not supported with sequence_parallel")
        self.input_size, self.output_size = input_size, output_size
        self.tp_group = tp_group
        self.tp_size = group_size(tp_group)
        self.gather_output = gather_output
        self.skip_bias_add = skip_bias_add
        self.sequence_parallel = sequence_parallel
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        weight_layout = ParamLayout(
            (output_size, input_size),
            partition_dim=0,
            num_stacked=num_stacked,
            vocab_padded=vocab_padded,
            init=init_method or NormalInit(0.02),
        )
        self.output_size_per_partition = weight_layout.local_shape(self.tp_size)[0]
        if skip_weight_param_allocation:
            self.weight = None
        else:
            self.weight = make_parameter(weight_layout, self.tp_size, dtype=params_dtype, device=device)
        if bias:
            layout = ParamLayout((output_size,), partition_dim=0, num_stacked=num_stacked, init=ZEROS)
            self.bias = make_parameter(layout, self.tp_size, dtype=params_dtype, device=device)
        else:
            self.register_parameter("bias", None)
        _setup_fp8(self, fp8, "column", device)

    def forward(
        self, x: torch.Tensor, weight: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``x [..., in]`` (``[s/p, b, in]`` with SP) -> ``([..., out/p] or [..., out], bias)``."""
        weight = self.resolve_weight(weight)
        bias = None if self.skip_bias_add else self.bias
        shared_weight = weight is not self.weight
        sp = self.sequence_parallel and group_size(self.tp_group) > 1
        gathered = None if shared_weight else self.fp8_gathered_weight
        overwrites = self._fp8_call is not None and self.fp8.overwrites_first_grad
        if self._fp8_call is not None and sp and self.fp8.per_tensor_fp8_wgrad:  # gathered in FP8
            main_grad = fusion_main_grad(weight, self.gradient_accumulation_fusion, shared_weight, overwrites)
            y = self._fp8_call.linear(
                x, weight, bias, main_grad, shared_weight,
                sequence_parallel_group=self.tp_group, gathered=gathered,
            )  # fmt: skip
        elif self._fp8_call is not None:
            total, saved_input = column_parallel_input(x, self.tp_group, self.sequence_parallel)
            main_grad = fusion_main_grad(weight, self.gradient_accumulation_fusion, shared_weight, overwrites)
            with saved_input:
                y = self._fp8_call.linear(total, weight, bias, main_grad, shared_weight, gathered=gathered)
        elif self.sequence_parallel and group_size(self.tp_group) > 1 and torch.is_grad_enabled():
            main_grad = fusion_main_grad(weight, self.gradient_accumulation_fusion, shared_weight)
            y = _SequenceParallelColumnLinear.apply(x, weight, bias, main_grad, shared_weight, self.tp_group)
        else:
            total, saved_input = column_parallel_input(x, self.tp_group, self.sequence_parallel)
            with saved_input:
                y = linear_with_grad_accumulation_fusion(
                    total,
                    weight,
                    bias,
                    gradient_accumulation_fusion=self.gradient_accumulation_fusion,
                    shared_weight=shared_weight,
                )
        if self.gather_output:
            y = gather_from_tensor_model_parallel_region(y, self.tp_group)
        return y, (self.bias if self.skip_bias_add else None)

    def resolve_weight(self, weight: torch.Tensor | None) -> torch.Tensor:
        """The weight a call computes with: ``weight`` (checked to be ``[out/p, in]``) or the layer's own."""
        if weight is None:
            if self.weight is None:
                raise ValueError("this ColumnParallelLinear has no weight of its own: pass weight=")
            return self.weight
        if tuple(weight.shape) != (self.output_size_per_partition, self.input_size):
            raise ValueError(
                f"weight of shape {tuple(weight.shape)} given, expected "
                f"{(self.output_size_per_partition, self.input_size)}"
            )
        return weight

    def extra_repr(self) -> str:
        return (
            f"in={self.input_size}, out={self.output_size} (local {self.output_size_per_partition}), "
            f"bias={self.bias is not None}, sequence_parallel={self.sequence_parallel}"
        )


class RowParallelLinear(torch.nn.Module):
    """``Y = X A + b`` with ``A`` split by rows over the TP ranks.

    ``A = [A_1; ...; A_p]`` and ``X = [X_1, ..., X_p]`` (split along its last dim):
    ``Y = sum_t X_t A_t + b``. Rank ``t`` holds the weight columns ``[t*in/p, (t+1)*in/p)`` of the
    logical ``[out, in]`` weight, computes ``X_t A_t`` and the partial results are all-reduced (or
    reduce-scattered along the sequence with SP). The bias is replicated and added once, after the
    reduction.

    Args:
        input_size, output_size: the logical sizes.
        tp_group: the tensor-parallel group.
        bias: add a (replicated) bias.
        input_is_parallel: the input is already split (``[..., in/p]``, the output of a
            column-parallel layer); otherwise it is ``[..., in]`` and gets scattered.
        skip_bias_add: return the bias instead of adding it. A caller that adds the returned bias to
            the output as is (``out + bias``: the transformer layer's ``bias_dropout_add``) says so
            by setting :attr:`bias_added_by_caller` (the layer does it for its stock attention and
            MLP). The bias gradient is then the column sum of the output gradient, and an FP8 linear
            that casts that gradient anyway (:meth:`takes_bias_grad`) returns ``bias.detach()``,
            takes ``bias`` into its backward for the gradient only and sums it in the cast's read
            (``fp8_cast_dbias``; :mod:`mcore.fp8.linear`): the caller's add computes no
            bias gradient. Everywhere else the returned bias is the parameter itself.
        sequence_parallel: reduce-scatter the output to ``[s/p, b, out]`` (needs input_is_parallel).
        init_method: init of the logical weight (Megatron uses the scaled init for output layers).
        gradient_accumulation_fusion: accumulate the weight gradient into ``weight.main_grad`` in the
            backward (:func:`linear_with_grad_accumulation_fusion`).
        fp8: run the GEMMs in FP8 with this :class:`~mcore.fp8.config.Fp8Config` (:mod:`mcore.fp8.linear`).
        params_dtype, device: dtype and device of the parameters.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        tp_group=None,
        bias: bool = True,
        input_is_parallel: bool = True,
        skip_bias_add: bool = False,
        sequence_parallel: bool = False,
        init_method: InitMethod | None = None,
        gradient_accumulation_fusion: bool = False,
        fp8=None,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
    ):
        super().__init__()
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel needs input_is_parallel=True")
        self.input_size, self.output_size = input_size, output_size
        self.tp_group = tp_group
        self.tp_size = group_size(tp_group)
        self.input_is_parallel = input_is_parallel
        self.skip_bias_add = skip_bias_add
        self.sequence_parallel = sequence_parallel
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        layout = ParamLayout((output_size, input_size), partition_dim=1, init=init_method or NormalInit(0.02))
        self.weight = make_parameter(layout, self.tp_size, dtype=params_dtype, device=device)
        self.input_size_per_partition = self.weight.shape[1]
        if bias:
            layout = ParamLayout((output_size,), sequence_parallel=sequence_parallel, init=ZEROS)
            self.bias = make_parameter(layout, self.tp_size, dtype=params_dtype, device=device)
        else:
            self.register_parameter("bias", None)
        self.bias_added_by_caller = False
        """The caller adds the returned bias (``skip_bias_add``) to the output as is (see Args)."""
        _setup_fp8(self, fp8, "row", device)

    def takes_bias_grad(self) -> bool:
        """Whether this layer's backward gives its bias the gradient (and :meth:`forward` returns the
        bias detached): ``skip_bias_add`` with :attr:`bias_added_by_caller`, an FP8 recipe whose
        backward casts the output gradient (:attr:`~mcore.fp8.config.Fp8Config.per_tensor_fp8_wgrad`),
        and no sequence parallelism (each rank's bias gradient is then a partial sum over its
        sequence shard, all-reduced over TP later with the other sequence-parallel gradients,
        whereas the linear sees the gathered output gradient of the whole sequence)."""
        return (
            self.skip_bias_add
            and self.bias_added_by_caller
            and self.bias is not None
            and self.fp8 is not None
            and self.fp8.per_tensor_fp8_wgrad
            and not self.sequence_parallel
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``x [..., in/p]`` (or ``[..., in]``) -> ``([..., out]`` (``[s/p, b, out]`` with SP), bias)."""
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x, self.tp_group)
        bias_grad_here = self.takes_bias_grad()  # the caller adds bias.detach(): its gradient is ours
        if self._fp8_call is not None:
            overwrites = self.fp8.overwrites_first_grad
            main_grad = fusion_main_grad(self.weight, self.gradient_accumulation_fusion, False, overwrites)
            y = self._fp8_call.linear(
                x, self.weight, self.bias if bias_grad_here else None, main_grad,
                gathered=self.fp8_gathered_weight, bias_added_by_caller=bias_grad_here,
            )  # fmt: skip
        else:
            y = linear_with_grad_accumulation_fusion(
                x, self.weight, None, gradient_accumulation_fusion=self.gradient_accumulation_fusion
            )
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y, self.tp_group)
        else:
            y = reduce_from_tensor_model_parallel_region(y, self.tp_group)
        if bias_grad_here:
            return y, self.bias.detach()
        if self.skip_bias_add or self.bias is None:
            return y, self.bias if self.skip_bias_add else None
        return y + self.bias, None

    def extra_repr(self) -> str:
        return (
            f"in={self.input_size} (local {self.input_size_per_partition}), out={self.output_size}, "
            f"bias={self.bias is not None}, sequence_parallel={self.sequence_parallel}"
        )


class VocabParallelEmbedding(torch.nn.Module):
    """An embedding table split by vocabulary rows over the TP ranks.

    Rank ``t`` holds rows ``[t*V/p, (t+1)*V/p)`` of the logical ``[V, h]`` table (``V`` is the padded
    vocabulary, a multiple of ``p``). Each rank looks up the ids it owns, writes zeros for the others,
    and the partial results are summed over TP: ``E[ids] = sum_t E_t[ids]``.

    Args:
        num_embeddings: the (padded) vocabulary size ``V``.
        embedding_dim: ``h``.
        tp_group: the tensor-parallel group.
        init_method: init of the logical table.
        reduce_scatter_embeddings: return ``[s/p, b, h]`` (reduce-scatter along the sequence, for
            sequence parallelism) instead of ``[b, s, h]``.
        params_dtype, device: dtype and device of the table.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        tp_group=None,
        init_method: InitMethod | None = None,
        reduce_scatter_embeddings: bool = False,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
    ):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.tp_group = tp_group
        self.tp_size = group_size(tp_group)
        self.reduce_scatter_embeddings = reduce_scatter_embeddings
        layout = ParamLayout(
            (num_embeddings, embedding_dim),
            partition_dim=0,
            vocab_padded=True,
            init=init_method or NormalInit(0.02),
        )
        self.weight = make_parameter(layout, self.tp_size, dtype=params_dtype, device=device)
        per_rank = self.weight.shape[0]
        self.vocab_start_index = group_rank(tp_group) * per_rank
        self.vocab_end_index = self.vocab_start_index + per_rank
        self.token_id_range = TokenIdRange(num_embeddings, "input id")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids [b, s]`` -> ``[b, s, h]`` (or ``[s/p, b, h]`` with ``reduce_scatter_embeddings``).

        Every id must be in ``[0, V)``: :attr:`token_id_range` records each batch's range on the
        device for the trainer's check (with TP > 1 an id no rank owns would silently embed as zeros,
        at TP = 1 fail as a bare index error or a device-side assert); an id outside is looked up as 0.
        """
        ids = self.token_id_range.observe(ids)
        if self.tp_size > 1:
            outside = (ids < self.vocab_start_index) | (ids >= self.vocab_end_index)
            local_ids = (ids - self.vocab_start_index).masked_fill(outside, 0)
            partial = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        else:
            partial = F.embedding(ids, self.weight)
        if self.reduce_scatter_embeddings:
            return reduce_scatter_to_sequence_parallel_region(partial.transpose(0, 1), self.tp_group)
        return reduce_from_tensor_model_parallel_region(partial, self.tp_group)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim} (local rows "
            f"[{self.vocab_start_index}, {self.vocab_end_index}))"
        )
