"""The FP8 linear: its call description and autograd Function (tensorwise, delayed and rowwise recipes).

A linear ``y = x W^T + b`` (``x [M, K]`` tokens x input features, ``W [N, K]``) runs its three GEMMs on
FP8 operands through the op table's ``scaled_linear`` family (:mod:`mcore.ops.reference` documents
the "NT" layouts and the scale convention ``q = saturate(x * scale)``, ``x ~= q * scale_inv``)::

    forward  y  = nt(x_q,   W_q)   * sx  * sw  + b      x, W in the forward format (e4m3)
    dgrad    dx = nt(dy_q,  W_qT)  * sdy * sw           dy in the backward format (e5m2 with
    wgrad    dW = nt(dy_qT, x_qT)  * sdy * sx           "hybrid", e4m3 with "e4m3")

The scales come from the recipe (:mod:`mcore.fp8.scaling`: tensorwise and rowwise from the operand's
own amax, delayed from the layer's :class:`~mcore.fp8.scaling.Fp8DelayedState`).

Tensor parallelism: a scale must not depend on how a tensor is split, so the amax of a tensor that
is split over the TP ranks is all-reduced (max) over the TP group before the scale is formed
(tensorwise: the weight and the output gradient of a column-parallel layer, the input and the
weight of a row-parallel one; rowwise: the row amaxes of the GEMM whose contraction dim is split).
Then each rank quantizes its shard exactly as one process quantizes the whole tensor, and TP=p
equals TP=1 up to the GEMMs' summation order.

Sequence parallelism (a column-parallel layer's input ``x [s/p, b, K]`` split along the sequence):
for the tensorwise and delayed recipes each rank casts its own rows (tensorwise: the amax max-reduced
over TP first, so all ranks use one scale) and the all-gather moves the FP8 bytes, half of bf16's,
instead of gathering bf16 and casting the whole ``[s, b, K]`` on every rank. Backward keeps only the
local FP8 rows, gathers them again for the weight gradient (``x_qT`` is the gathered ``x_q``
transposed), and reduce-scatters the input gradient, as the bf16 sequence-parallel linear does.

A bias the caller adds (``bias_added_by_caller``): a row-parallel linear with ``skip_bias_add``
returns its bias for the transformer layer's ``bias_dropout_add`` to add to the output as is,
``out = residual + dropout(y + b)``, so ``d/db = colsum(d/d(y + b)) = colsum(dy)`` with ``dy`` exactly
the output gradient this Function's backward casts. The Function then takes ``b`` for its gradient
only (it does not add it) and forms ``db`` in the cast's read of ``dy`` (``fp8_cast_dbias``), while the
caller adds ``b.detach()``: the separate column sum of ``dy`` in the bias-dropout-add's backward is
gone (:attr:`~mcore.fp8.config.Fp8Config.per_tensor_fp8_wgrad` says for which recipes).

Gradient-accumulation fusion: the wgrad GEMM adds into ``weight.main_grad`` (the op's
``main_grad`` argument) and the weight's ``.grad`` is a placeholder, as in
:class:`~mcore.tensor_parallel.layers._LinearWithGradAccumulationFusion`. The step's first wgrad GEMM
of a weight writes over ``main_grad`` instead (``accumulate=False``), which the DDP did not zero: the
main_grad of an opted-in weight is zero from zero_grad_buffer until its first gradient of the step is
written, not added (:mod:`mcore.tensor_parallel.first_grad`; the layers opt in with
:attr:`~mcore.fp8.config.Fp8Config.overwrites_first_grad`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mcore.backend import get_ops
from mcore.fp8.config import Fp8Config, Recipe, register_linear_factory
from mcore.fp8.operand import Fp8Tensor
from mcore.fp8.scaling import GRAD_OUTPUT, INPUT, WEIGHT, Fp8DelayedState, _amax, scale_from_amax
from mcore.tensor_parallel.first_grad import take_first_write
from mcore.tensor_parallel.mappings import (
    _gather_first,
    _reduce_scatter_first,
    all_reduce_in_tensor_model_parallel_group,
    group_size,
)
from mcore.tensor_parallel.weight_grad import weight_grad


@dataclass(frozen=True, eq=False)
class Fp8Linear:
    """Everything one FP8 linear call needs besides tensors (a constant of the autograd Function).

    Attributes:
        config: the FP8 config (recipe, formats, margin, ...).
        state: the delayed recipe's :class:`Fp8DelayedState` (None otherwise).
        tp_group: the tensor-parallel group.
        parallel_mode: ``"column"`` (weight split along N) or ``"row"`` (along K), for which amaxes
            need a TP reduction.
    """

    config: Fp8Config
    state: Fp8DelayedState | None
    tp_group: Any
    parallel_mode: str

    @property
    def _tp(self) -> bool:
        return group_size(self.tp_group) > 1

    def _reduce(self, amax: torch.Tensor, needed: bool) -> torch.Tensor:
        if needed and self._tp:
            all_reduce_in_tensor_model_parallel_group(amax, self.tp_group, op="max")
        return amax

    def scaling(
        self, role: int, t: torch.Tensor, record: bool = True, split: bool | None = None
    ) -> dict[str, Any]:
        """How the op ``fp8_cast`` scales ``t`` (role ``role``) for the tensorwise and delayed recipes:
        its keyword arguments ``scale=``/``amax=``, ``margin=``, ``amax_record=``.

        Tensorwise: ``amax=`` the amax of ``t`` (max-reduced over TP where ``t`` is split), from which
        the cast forms the scale on the device. Delayed: ``scale=`` the step's fixed scale and, with
        ``record``, ``amax_record=`` this role's running-max slot, which the cast updates in the same
        pass (training forwards and backwards record, evaluation does not). ``split``: whether ``t`` is
        split over the TP ranks (default: by role and parallel mode, for a full input)."""
        if self.state is not None:
            kwargs: dict[str, Any] = {"scale": self.state.scale[role]}
            if record:
                kwargs["amax_record"] = self.state.amax_record(role)
            return kwargs
        sharded = role == WEIGHT or (role == GRAD_OUTPUT) == (self.parallel_mode == "column")
        sharded = sharded if split is None else split
        amax = self._reduce(get_ops().fp8_amax(t), sharded)
        return {"amax": amax, "margin": self.config.fp8_margin}

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *args, **kwargs):
        """:func:`fp8_linear` with this call description (what the tensor-parallel layers call)."""
        return fp8_linear(x, weight, bias, self, *args, **kwargs)

    def row_scale(self, t: torch.Tensor, dtype: torch.dtype, contraction_split: bool) -> torch.Tensor:
        """Rowwise: one scale per row of the NT operand ``t [rows, K]`` (``[rows, 1]``), from the row
        amaxes reduced over TP when the contraction dim ``K`` is split over the TP ranks."""
        amax = self._reduce(_amax(t, dim=-1).contiguous(), contraction_split)
        return scale_from_amax(amax, dtype, self.config.fp8_margin)


def _quantize_rows(call: Fp8Linear, t: torch.Tensor, dtype: torch.dtype, split: bool) -> Fp8Tensor:
    """Rowwise: ``t [rows, K]`` quantized with one scale per row (:meth:`Fp8Linear.row_scale`)."""
    scale = call.row_scale(t, dtype, split)
    return Fp8Tensor(get_ops().fp8_quantize(t, scale, dtype), scale.reciprocal())


class _Fp8LinearFunction(torch.autograd.Function):
    """``y = x W^T + b`` with FP8 GEMMs (see the module docstring); ``x [..., K]``, ``W [N, K]``.

    Saved for backward (tensorwise/delayed): ``x_qT [K, M]`` in FP8 (half the bytes of the bf16 input a
    bf16 linear keeps) and, when the input needs a gradient, ``W_q^T [K, N]``: the forward's one cast
    of the weight writes ``W_q`` and ``W_q^T`` (as Transformer Engine keeps the transpose), which costs
    one byte per weight element between forward and backward and saves the backward a second read of
    the weight (2 bytes per element) and a kernel. With a gathered weight (``--fp8-param-gather``) the
    forward multiplies its ``W_q`` and keeps those bytes transposed (``W_q^T``, a copy).
    ``--no-fp8-keep-weight-transpose`` keeps the forward's scale instead and the backward makes
    ``W_q^T`` again, bit for bit (:func:`cast_weight`, :func:`weight_transpose_for_backward`).
    Rowwise (and ``--no-fp8-wgrad``) keep ``x`` itself: the wgrad operand needs other scales.

    ``bias_added_by_caller``: ``bias`` is not added to ``y`` (the caller adds it, see the module
    docstring); the backward still returns its gradient ``dy.sum(0)``.
    """

    @staticmethod
    def forward(
        ctx,
        x,
        weight,
        bias,
        main_grad,
        zero_placeholder,
        call: Fp8Linear,
        training: bool,
        gathered: Fp8Tensor | None,
        sp_group,
        bias_added_by_caller: bool,
    ):
        ops = get_ops()
        fp8 = call.config
        x2d = x.reshape(-1, x.shape[-1])
        ctx.call, ctx.main_grad, ctx.zero_placeholder = call, main_grad, zero_placeholder
        ctx.has_bias, ctx.x_shape, ctx.out_dtype = bias is not None, x.shape, x.dtype
        ctx.sp_group = sp_group
        fwd = fp8.fwd_dtype
        out_rows = x.shape[:-1]
        if fp8.recipe is Recipe.ROWWISE:
            row_split = call.parallel_mode == "row" and call._tp
            xq = _quantize_rows(call, x2d, fwd, row_split)
            wq = _quantize_rows(call, weight, fwd, row_split)
            ctx.save_for_backward(x2d, weight)
        else:
            if sp_group is not None:
                # x is this rank's sequence shard: cast it, gather the FP8 rows (module docstring)
                x_scaling = call.scaling(INPUT, x2d, training, split=True)
                local = Fp8Tensor.of(ops.fp8_cast(x2d, fwd, **x_scaling))
                xq = Fp8Tensor(_gather_fp8_rows(local.data, sp_group), local.scale_inv)
                x_saved = local.data  # gathered again (and transposed) for the weight gradient
                out_rows = (x.shape[0] * group_size(sp_group), *x.shape[1:-1])
            else:
                x_scaling = call.scaling(INPUT, x2d, training)
                xq = Fp8Tensor.of(ops.fp8_cast(x2d, fwd, columnwise=fp8.fp8_wgrad, **x_scaling))
                x_saved = xq.transpose if fp8.fp8_wgrad else x2d
            need_w_t = training and ctx.needs_input_grad[0]  # W_q^T for the input gradient
            wq, w_t = cast_weight(call, weight, training, gathered, transposed=need_w_t)
            ctx.save_for_backward(x_saved, xq.scale_inv, weight, w_t, wq.scale_inv)
        added_bias = None if bias_added_by_caller else bias
        y = ops.scaled_linear_forward(xq.data, wq.data, xq.scale_inv, wq.scale_inv, added_bias, x.dtype)
        return y.reshape(*out_rows, y.shape[-1])

    @staticmethod
    def backward(ctx, grad_output):
        ops = get_ops()
        call: Fp8Linear = ctx.call
        fp8 = call.config
        fwd, bwd = fp8.fwd_dtype, fp8.bwd_dtype
        dy2d = grad_output.reshape(-1, grad_output.shape[-1])
        need_dbias = ctx.has_bias and ctx.needs_input_grad[2]
        grad_bias = grad_input = grad_weight = None
        if fp8.recipe is Recipe.ROWWISE:
            grad_bias = dy2d.sum(0) if need_dbias else None
            x2d, weight = ctx.saved_tensors
            col_split = call.parallel_mode == "column" and call._tp
            if ctx.needs_input_grad[0]:
                dy = _quantize_rows(call, dy2d, bwd, col_split)
                w_t = _quantize_rows(call, weight.t(), fwd, col_split)  # rows of W^T: W_q^T
                grad_input = ops.scaled_linear_dgrad(
                    dy.data, w_t.data, dy.scale_inv, w_t.scale_inv, ctx.out_dtype
                )
            if ctx.needs_input_grad[1]:
                dy_t = _quantize_rows(call, dy2d.t(), bwd, False)  # rows of dy^T: dy_q^T
                x_t = _quantize_rows(call, x2d.t(), fwd, False)
                grad_weight = fp8_wgrad(
                    weight,
                    ctx.main_grad,
                    dy_t.data,
                    x_t.data,
                    dy_t.scale_inv,
                    x_t.scale_inv,
                    ctx.zero_placeholder,
                )
        else:
            x_saved, x_sinv, weight, w_t, w_sinv = ctx.saved_tensors
            if ctx.sp_group is not None and ctx.needs_input_grad[1]:
                x_saved = transpose_fp8(_gather_fp8_rows(x_saved, ctx.sp_group))  # the full x_qT
            dy_scaling = call.scaling(GRAD_OUTPUT, dy2d)
            need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1] and fp8.fp8_wgrad
            # with a bias, its gradient dy.sum(0) comes from the cast's read of dy (fp8_cast_dbias)
            cast = ops.fp8_cast_dbias if need_dbias else ops.fp8_cast
            cast_dy = cast(dy2d, bwd, rowwise=need_dgrad, columnwise=need_wgrad, **dy_scaling)
            dy = Fp8Tensor.of(cast_dy)
            grad_bias = cast_dy[3] if need_dbias else None
            if ctx.needs_input_grad[0]:
                w_qT = weight_transpose_for_backward(call, weight, w_t)
                grad_input = ops.scaled_linear_dgrad(dy.data, w_qT, dy.scale_inv, w_sinv, ctx.out_dtype)
            if ctx.needs_input_grad[1]:
                if fp8.fp8_wgrad:
                    grad_weight = fp8_wgrad(
                        weight,
                        ctx.main_grad,
                        dy.transpose,
                        x_saved,
                        dy.scale_inv,
                        x_sinv,
                        ctx.zero_placeholder,
                    )
                else:
                    grad_weight = weight_grad(ctx, weight, dy2d, x_saved)
        if grad_input is not None:
            if ctx.sp_group is not None:
                grad_input = _reduce_scatter_first(grad_input, ctx.sp_group)
            grad_input = grad_input.reshape(ctx.x_shape)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None, None, None


def _gather_fp8_rows(q_local: torch.Tensor, group) -> torch.Tensor:
    """All-gather FP8 rows ``[M/p, K] -> [M, K]`` (rank order) as bytes: collectives take uint8 where
    they may not know the FP8 dtypes."""
    return _gather_first(q_local.view(torch.uint8), group).view(q_local.dtype)


def transpose_fp8(q: torch.Tensor) -> torch.Tensor:
    """``q [M, K] -> q^T [K, M]`` contiguous (the op ``fp8_transpose``: the same bytes transposed)."""
    return get_ops().fp8_transpose(q)


def cast_weight(
    call: Fp8Linear,
    weight: torch.Tensor,
    training: bool,
    gathered: Fp8Tensor | None,
    transposed: bool,
) -> tuple[Fp8Tensor, torch.Tensor | None]:
    """``(W_q with its scale_inv, for_backward)`` for a tensorwise/delayed FP8 linear's forward; also used
    by :mod:`.fp8_fused`. ``transposed``: the backward needs ``W_q^T [K, N]`` (for the input
    gradient); ``for_backward`` (None without ``transposed``) is what to save for
    :func:`weight_transpose_for_backward`, the one place that turns it into ``W_q^T``.

    ``fp8_keep_weight_transpose`` (the default) keeps ``W_q^T`` itself: the one cast writes
    ``W_q`` and ``W_q^T`` (as Transformer Engine keeps the transpose), 1 byte a weight element held
    from forward to backward. Without it (``--no-fp8-keep-weight-transpose``) the cast writes ``W_q``
    only and ``for_backward`` is the scaling the forward used: the delayed recipe's WEIGHT scale (the
    state's slot, which changes only at the step's scale update, after every backward of the step:
    autograd's version check refuses a backward after an in-place change) or the tensorwise amax
    (the weight does not change between forward and backward); the backward casts ``W^T`` again with
    exactly that scale, bit for bit the kept ``W_q^T``.

    With ``--fp8-param-gather`` (``gathered``) ``W_q`` is the gathered weight (made after the optimizer
    step; its buffer is rewritten only at the next step's gather, after the backward): kept, its bytes
    transposed (a copy); not kept, the gathered ``W_q`` itself (no bytes of its own), transposed in
    the backward."""
    keep = call.config.fp8_keep_weight_transpose
    if gathered is not None:
        for_backward = None
        if transposed:
            for_backward = transpose_fp8(gathered.data) if keep else gathered.data
        return Fp8Tensor(gathered.data, gathered.scale_inv), for_backward
    w_scaling = call.scaling(WEIGHT, weight, training)
    w = Fp8Tensor.of(
        get_ops().fp8_cast(weight, call.config.fwd_dtype, columnwise=transposed and keep, **w_scaling)
    )
    if not transposed or keep:
        return Fp8Tensor(w.data, w.scale_inv), w.transpose
    return Fp8Tensor(w.data, w.scale_inv), w_scaling["scale"] if "scale" in w_scaling else w_scaling["amax"]


def weight_transpose_for_backward(
    call: Fp8Linear, weight: torch.Tensor, for_backward: torch.Tensor | None
) -> torch.Tensor | None:
    """``W_q^T [K, N]`` for the input gradient ``dx = dy W``, from what :func:`cast_weight` gave the
    forward to save: the kept ``W_q^T`` as is; else (``--no-fp8-keep-weight-transpose``) a gathered
    ``W_q`` (FP8) transposed, or ``weight [N, K]`` cast column-wise only with the forward's scale
    (fp32: the delayed scale or the tensorwise amax, with the recipe's margin). This cast records no
    amax (the forward's cast did) and reduces nothing over TP (the saved amax already is)."""
    if for_backward is None or call.config.fp8_keep_weight_transpose:
        return for_backward
    fwd = call.config.fwd_dtype
    if for_backward.dtype == fwd:  # a gathered W_q [N, K]
        return transpose_fp8(for_backward)
    if call.state is not None:
        scaling: dict[str, Any] = {"scale": for_backward}
    else:
        scaling = {"amax": for_backward, "margin": call.config.fp8_margin}
    _, w_qT, _ = get_ops().fp8_cast(weight, fwd, rowwise=False, columnwise=True, **scaling)
    return w_qT


def fp8_wgrad(weight, main_grad, dy_qT, x_qT, dy_sinv, x_sinv, shared: bool = False) -> torch.Tensor | None:
    """``dW = nt(dy_qT, x_qT)``, accumulated into ``main_grad`` when it is set (gradient-accumulation
    fusion: then a placeholder gradient the DDP hook discards is returned, None for a ``shared``
    weight), else returned in the weight's dtype. Also used by :mod:`.fp8_fused`.

    The weight's first gradient of the step is written over ``main_grad`` instead of added, when the
    DDP left it unzeroed (``weight.main_grad_unwritten``, :mod:`mcore.tensor_parallel.first_grad`): the
    GEMM writes ``main_grad`` directly, saving the add and the zeroing."""
    ops = get_ops()
    if main_grad is None:
        return ops.scaled_linear_wgrad(dy_qT, x_qT, dy_sinv, x_sinv, weight.dtype)
    accumulate = shared or not take_first_write(weight)
    ops.scaled_linear_wgrad(dy_qT, x_qT, dy_sinv, x_sinv, weight.dtype, main_grad, accumulate=accumulate)
    return None if shared else torch.empty_like(weight)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    call: Fp8Linear,
    main_grad: torch.Tensor | None = None,
    zero_placeholder: bool = False,
    sequence_parallel_group=None,
    gathered: Fp8Tensor | None = None,
    bias_added_by_caller: bool = False,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` on FP8 GEMMs (``x [..., K]`` -> ``[..., N]``, in ``x.dtype``).

    ``main_grad``: accumulate the weight gradient there (gradient-accumulation fusion; see
    :func:`mcore.tensor_parallel.layers.fusion_main_grad`). ``sequence_parallel_group``: ``x [s/p, b,
    K]`` is this rank's sequence shard of a column-parallel layer's input, gathered in FP8 (output
    ``[s, b, N]``); tensorwise and delayed recipes with the FP8 weight gradient only
    (:attr:`~mcore.fp8.config.Fp8Config.per_tensor_fp8_wgrad`). ``gathered``: ``weight``'s FP8 copy
    (``--fp8-param-gather``; tensorwise and delayed recipes), used instead of casting ``weight``, which then only receives
    the gradient. ``bias_added_by_caller``: return ``x weight^T`` without ``bias``, which the caller adds
    to the output as is (its ``bias.detach()``: only this call gives ``bias`` a gradient), and take
    ``bias``'s gradient from the cast of the output gradient (module docstring; for a recipe that
    passes :attr:`~mcore.fp8.config.Fp8Config.per_tensor_fp8_wgrad`).
    """
    training = torch.is_grad_enabled()  # False inside the Function's forward: read it here
    return _Fp8LinearFunction.apply(
        x, weight, bias, main_grad, zero_placeholder, call, training, gathered, sequence_parallel_group,
        bias_added_by_caller,
    )  # fmt: skip


def make_fp8_linear(config: Fp8Config, tp_group: Any, parallel_mode: str, device=None) -> Fp8Linear:
    """A parallel linear's :class:`Fp8Linear`, with a new :class:`Fp8DelayedState` for the delayed
    recipe (:meth:`Fp8Config.linear_call`)."""
    state = Fp8DelayedState(config, device=device) if config.recipe is Recipe.DELAYED else None
    return Fp8Linear(config, state, tp_group, parallel_mode)


register_linear_factory(make_fp8_linear)

__all__ = [
    "Fp8Linear",
    "cast_weight",
    "fp8_linear",
    "fp8_wgrad",
    "make_fp8_linear",
    "transpose_fp8",
    "weight_transpose_for_backward",
]
