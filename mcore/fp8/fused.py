"""Fused FP8 producers: ``norm -> column-parallel FP8 linear`` and ``norm -> fc1 -> act -> fc2`` as one
autograd Function each (the delayed recipe; Transformer Engine's ``LayerNormLinear`` / ``LayerNormMLP``).

With the delayed recipe the scale of every FP8 operand is fixed for the step before the operand is
produced, so the op that produces it writes it in FP8 (``q [M, K]`` for the forward GEMM, ``qT [K, M]``
for the weight-gradient GEMM) and records its amax in the same pass; the norm's or the activation's
output in the activations' dtype is never written, read back and cast. Per pre-norm layer::

    QKV (Fp8NormLinear):   x [M, h] --norm_fp8_forward--> xn_q, xn_qT   (linear_qkv's INPUT scale)
                           y = scaled_linear_forward(xn_q, W_q) + b      [M, N]
    MLP (Fp8NormMLP):      x --norm_fp8_forward--> xn_q, xn_qT          (fc1's INPUT scale)
                           h = scaled_linear_forward(xn_q, W1_q)        [M, F] (fc1's bias not added)
                           h --act_fp8_forward(h, b1)--> a_q, a_qT      (fc2's INPUT scale)
                           y = scaled_linear_forward(a_q, W2_q)         [M, h], partial over TP
                           (fc2's bias b2 not added: the layer's bias_dropout_add adds it)

and backward, with ``g`` the output gradient and ``r`` the residual stream's gradient::

    QKV:  fp8_cast_packed(gq, gk, gv) -> g_q, g_qT, db  (GRAD_OUTPUT scale; the attention's dq, dk,
          dv cast where they lie, as the packed [M, N] gradient: OutputSplit)
          dxn = dgrad(g_q, W_qT);  dW = wgrad(g_qT, xn_qT)
    MLP:  fp8_cast_dbias(g) -> g_q, g_qT, db2  (fc2's GRAD_OUTPUT; ``fp8_cast`` without fc2's bias)
          da = dgrad(g_q, W2_qT);  dW2 = wgrad(g_qT, a_qT)
          act_fp8_backward(da, h, b1) -> dh_q, dh_qT, db1   (fc1's GRAD_OUTPUT scale)
          dxn = dgrad(dh_q, W1_qT);  dW1 = wgrad(dh_qT, xn_qT)
    both: dxn all-reduced over TP (the column-parallel input's gradient, without sequence parallelism)
          dx, dgamma, dbeta = norm_backward(dxn, x, mean, rstd, residual_grad=r)

fc2's bias ``b2`` is added by the layer's ``bias_dropout_add`` (``out = r + dropout(y + b2)``, ``y`` the
TP all-reduced fc2 output), whose backward would sum ``d/d(y + b2)`` over the tokens for ``db2``. That
gradient is ``g``, which the MLP's backward reads anyway to cast it: the Function takes ``b2`` (for its
gradient only), sums it in the cast (``fp8_cast_dbias``, one read of ``g``) and the layer adds
``b2.detach()`` (``RowParallelLinear.bias_added_by_caller``; as the unfused row-parallel FP8 linear).

Saved for backward: the norm's input ``x`` and statistics, the FP8 ``qT`` of every GEMM input (the MLP
also keeps fc1's output ``h``, the activation's backward input), and each weight's ``W_q^T``, written
by the forward's cast of the weight, as :class:`~mcore.fp8.linear._Fp8LinearFunction` keeps
it (``--no-fp8-keep-weight-transpose``: the forward's weight scale, and the backward casts ``W^T``
again, :func:`~mcore.fp8.linear.weight_transpose_for_backward`). Nothing in the
activations' dtype besides ``x`` and ``h`` is kept, so ``--recompute-modules layernorm``/``mlp_act``
have nothing to free on this path.

Exactness: every op equals the unfused composition bit for bit (see :mod:`mcore.ops.reference`), and
the Functions call them with the same scales, amax slots and TP reductions as the unfused layers, so
losses, gradients, ``main_grad`` and the delayed states equal the unfused FP8 path exactly
(``tests/tensor_parallel/test_fp8_fused.py``).

The Functions take the existing modules' parameters and :class:`~mcore.fp8.linear.Fp8Linear`
descriptions (with their :class:`~mcore.fp8.scaling.Fp8DelayedState`): parameter names,
checkpoints and the delayed states are those of the unfused layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mcore.backend import get_ops
from mcore.fp8.linear import Fp8Linear, cast_weight, fp8_wgrad, weight_transpose_for_backward
from mcore.fp8.operand import Fp8Tensor
from mcore.fp8.scaling import GRAD_OUTPUT, INPUT
from mcore.ops.reference import ACTIVATIONS, pack_columns
from mcore.tensor_parallel.mappings import all_reduce_in_tensor_model_parallel_group

NORM_KINDS = ("LayerNorm", "RMSNorm")
"""The norms :func:`fp8_norm_linear` and :func:`fp8_norm_mlp` fuse (``norm_fp8_forward``'s ``kind``)."""


@dataclass(frozen=True)
class NormSpec:
    """The norm before the fused linear: ``kind`` (one of :data:`NORM_KINDS`) and ``eps``."""

    kind: str
    eps: float


@dataclass(frozen=True)
class OutputSplit:
    """:class:`Fp8NormLinear`'s output returned in parts: ``y [..., N]`` viewed as ``[..., groups, W]``
    (``W = sum(widths)``) and split along the last dim into ``[..., groups, w_i]`` views -- the
    attention's Q ``[..., g, r d]``, K and V ``[..., g, d]`` of the per-group QKV layout
    (:mod:`mcore.models.transformer.attention`). The backward then receives the parts' gradients apart (the
    attention's ``dq``, ``dk``, ``dv``) and casts them where they lie (the op ``fp8_cast_packed``)
    instead of autograd concatenating them into ``[..., N]`` first: one write and one read of the
    output gradient fewer (``CatArrayBatchedCopy``, 67 us a layer at GPT 24L h2048 s2048 mbs4 on an
    H100)."""

    groups: int
    widths: tuple[int, ...]


def fusable_call(call: Fp8Linear | None) -> bool:
    """Whether an FP8 linear's description allows the fused producers
    (:attr:`~mcore.fp8.config.Fp8Config.fuses_producers`: the delayed recipe, whose state the call
    holds, FP8 weight gradients, ``--no-fp8-fused-producers`` not given)."""
    return call is not None and call.state is not None and call.config.fuses_producers


def _input_slot(call: Fp8Linear, training: bool):
    """``(scale, amax_record)`` of the linear's INPUT role (the producer records only in training)."""
    state = call.state
    return state.scale[INPUT], (state.amax_record(INPUT) if training else None)


def _norm_fp8(call: Fp8Linear, x2d, norm_weight, norm_bias, norm: NormSpec, training: bool):
    """``(xn, (mean, rstd))``: the norm of ``x2d`` [t, h] cast to FP8 with the linear's INPUT scale
    (rows for the GEMM; the transpose too when training, for the weight gradient) and its statistics."""
    scale, amax_record = _input_slot(call, training)
    normed = get_ops().norm_fp8_forward(
        x2d, norm_weight, norm_bias, norm.eps, norm.kind, call.config.fwd_dtype, scale,
        amax_record=amax_record, rowwise=True, columnwise=training,
    )  # fmt: skip
    return Fp8Tensor.of(normed), normed[3:]


def _grad_slot(call: Fp8Linear):
    state = call.state
    return state.scale[GRAD_OUTPUT], state.amax_record(GRAD_OUTPUT)


def _dgrad(dy: Fp8Tensor, w_qT, w_sinv, out_dtype) -> torch.Tensor:
    """``dx = dy W`` from the FP8 ``dy`` and the forward's ``W_q^T``."""
    return get_ops().scaled_linear_dgrad(dy.data, w_qT, dy.scale_inv, w_sinv, out_dtype)


def _norm_backward(ctx, dxn, x2d, norm_weight, norm_bias, mean, rstd, grad_residual):
    """The column-parallel input's gradient all-reduced over TP, then the norm's backward with the
    residual stream's gradient folded in: ``(dx, dgamma, dbeta)``."""
    all_reduce_in_tensor_model_parallel_group(dxn, ctx.tp_group)
    residual = None if grad_residual is None else grad_residual.reshape(x2d.shape)
    norm: NormSpec = ctx.norm
    dx, dw, db = get_ops().norm_backward(
        dxn, x2d, norm_weight, norm_bias, norm.eps, norm.kind, mean, rstd, residual_grad=residual
    )
    return dx.reshape(ctx.x_shape), dw, db


class Fp8NormLinear(torch.autograd.Function):
    """``(norm(x) W^T + b, x)`` with the norm writing the FP8 GEMM input (module docstring).

    ``x [..., h]``, ``W [N, h]`` (this rank's column shard), ``b [N]`` or None. The second output is
    ``x`` itself, the residual stream of a pre-norm layer: its gradient is added inside
    ``norm_backward``.
    """

    @staticmethod
    def forward(
        ctx,
        x,
        norm_weight,
        norm_bias,
        weight,
        bias,
        main_grad,
        norm: NormSpec,
        call,
        training,
        gathered,
        split: OutputSplit | None = None,
    ):
        ops = get_ops()
        ctx.set_materialize_grads(False)
        x2d = x.reshape(-1, x.shape[-1])
        xn, (mean, rstd) = _norm_fp8(call, x2d, norm_weight, norm_bias, norm, training)
        need_x = training and any(ctx.needs_input_grad[:3])
        w, w_t = cast_weight(call, weight, training, gathered, transposed=need_x)
        y = ops.scaled_linear_forward(xn.data, w.data, xn.scale_inv, w.scale_inv, bias, x.dtype)
        ctx.norm, ctx.call, ctx.main_grad, ctx.tp_group = norm, call, main_grad, call.tp_group
        ctx.x_shape, ctx.has_bias, ctx.split = x.shape, bias is not None, split
        ctx.save_for_backward(
            x2d, norm_weight, norm_bias, mean, rstd, xn.transpose, xn.scale_inv, weight, w_t, w.scale_inv
        )
        y = y.reshape(*x.shape[:-1], y.shape[-1])
        if split is None:
            return y, x.view_as(x)
        parts = y.view(*y.shape[:-1], split.groups, -1).split(list(split.widths), dim=-1)
        return (*parts, x.view_as(x))

    @staticmethod
    def backward(ctx, *grads):
        x2d, norm_weight, norm_bias, mean, rstd, xn_qT, xn_sinv, weight, w_t, w_sinv = ctx.saved_tensors
        need_x = any(ctx.needs_input_grad[:3])
        need_w = ctx.needs_input_grad[3]
        grad_residual = grads[-1]
        need_dbias = ctx.has_bias and ctx.needs_input_grad[4]
        dy, grad_bias = _cast_output_grad(ctx, grads[:-1], x2d, weight.shape[0], need_x, need_w, need_dbias)
        grad_weight = (
            fp8_wgrad(weight, ctx.main_grad, dy.transpose, xn_qT, dy.scale_inv, xn_sinv) if need_w else None
        )
        dx = dnw = dnb = None
        if need_x:
            w_qT = weight_transpose_for_backward(ctx.call, weight, w_t)
            dxn = _dgrad(dy, w_qT, w_sinv, x2d.dtype)
            dx, dnw, dnb = _norm_backward(ctx, dxn, x2d, norm_weight, norm_bias, mean, rstd, grad_residual)
        return dx, dnw, dnb, grad_weight, grad_bias, None, None, None, None, None, None


def _cast_output_grad(ctx, grads, x2d, width: int, need_x: bool, need_w: bool, need_dbias: bool):
    """:class:`Fp8NormLinear`'s output gradient in FP8 (its GRAD_OUTPUT scale): ``(dy, dbias [N] or
    None)``, ``dy`` with ``data [M, N]`` and ``transpose [N, M]``, from the one gradient ``[..., N]``
    or, with an :class:`OutputSplit`, from the parts' gradients (``fp8_cast_packed``). A gradient that
    autograd did not give (an output that took no part in the loss) is zeros."""
    ops = get_ops()
    call: Fp8Linear = ctx.call
    bwd = call.config.bwd_dtype
    m = x2d.shape[0]
    split: OutputSplit | None = ctx.split
    if split is None:
        (grad_output,) = grads
        if grad_output is None:
            grad_output = x2d.new_zeros(m, width)
        dy2d = grad_output.reshape(m, width)
        scaling = call.scaling(GRAD_OUTPUT, dy2d)
        if need_dbias:
            return _with_dbias(ops.fp8_cast_dbias(dy2d, bwd, rowwise=need_x, columnwise=need_w, **scaling))
        return Fp8Tensor.of(ops.fp8_cast(dy2d, bwd, rowwise=need_x, columnwise=need_w, **scaling)), None
    parts = [
        x2d.new_zeros(m, split.groups * w) if g is None else g.reshape(m, split.groups * w)
        for g, w in zip(grads, split.widths, strict=True)
    ]
    scale, amax_record = _grad_slot(call)  # the fused path is the delayed recipe's (fusable_call)
    kwargs = dict(scale=scale, amax_record=amax_record, rowwise=need_x, columnwise=need_w)
    if ops.provider("fp8_cast_packed") == ops.provider("fp8_cast"):
        return _with_dbias(ops.fp8_cast_packed(parts, split.groups, bwd, dbias=need_dbias, **kwargs))
    # a backend with its own casts but no packed one: its casts of the concatenated gradient
    dy2d = pack_columns(parts, split.groups)
    if need_dbias:
        return _with_dbias(ops.fp8_cast_dbias(dy2d, bwd, **kwargs))
    return Fp8Tensor.of(ops.fp8_cast(dy2d, bwd, **kwargs)), None


def _with_dbias(result) -> tuple[Fp8Tensor, torch.Tensor | None]:
    """``(operand, dbias)`` of a cast that also sums the columns (``(q, qT, scale_inv, dbias)``)."""
    return Fp8Tensor.of(result), result[3]


class Fp8NormMLP(torch.autograd.Function):
    """``(fc2(act(fc1(norm(x)) + b1)), x)`` with the norm writing fc1's and the activation fc2's FP8
    input (module docstring).

    ``x [..., h]``, ``W1 [F', h]`` (``F' = F/p``, SwiGLU ``2F/p``: ``[gate_t; up_t]``), ``b1 [F']`` or
    None, ``W2 [h, F/p]``, ``b2 [h]`` or None (fc2's bias, gradient only). The first output is this
    rank's partial fc2 output ``[..., h]`` (the caller all-reduces it over TP and adds fc2's bias: with
    ``b2`` given, ``b2.detach()``, and ``b2``'s gradient comes from here); the second is ``x``, as in
    :class:`Fp8NormLinear`.
    """

    @staticmethod
    def forward(
        ctx,
        x,
        norm_weight,
        norm_bias,
        w1,
        b1,
        w2,
        b2,
        main_grads,
        norm: NormSpec,
        activation: str,
        calls,
        training,
        gathered,
    ):
        ops = get_ops()
        ctx.set_materialize_grads(False)
        fc1, fc2 = calls
        fwd = fc1.config.fwd_dtype
        x2d = x.reshape(-1, x.shape[-1])
        xn, (mean, rstd) = _norm_fp8(fc1, x2d, norm_weight, norm_bias, norm, training)
        need_x = training and any(ctx.needs_input_grad[:3])
        need_h = training and any(ctx.needs_input_grad[:5])  # anything below the activation
        w1q, w1_t = cast_weight(fc1, w1, training, gathered[0], transposed=need_x)
        h = ops.scaled_linear_forward(xn.data, w1q.data, xn.scale_inv, w1q.scale_inv, None, x.dtype)
        scale, amax_record = _input_slot(fc2, training)
        a = Fp8Tensor.of(
            ops.act_fp8_forward(
                h, b1, activation, fwd, scale, amax_record=amax_record, rowwise=True, columnwise=training
            )
        )
        w2q, w2_t = cast_weight(fc2, w2, training, gathered[1], transposed=need_h)
        y = ops.scaled_linear_forward(a.data, w2q.data, a.scale_inv, w2q.scale_inv, None, x.dtype)
        ctx.norm, ctx.activation, ctx.calls, ctx.main_grads = norm, activation, calls, main_grads
        ctx.tp_group, ctx.x_shape, ctx.has_b2 = fc1.tp_group, x.shape, b2 is not None
        ctx.save_for_backward(
            x2d, norm_weight, norm_bias, mean, rstd, xn.transpose, xn.scale_inv, w1, w1_t, w1q.scale_inv,
            h, b1, a.transpose, a.scale_inv, w2, w2_t, w2q.scale_inv,
        )  # fmt: skip
        return y.reshape(*x.shape[:-1], y.shape[-1]), x.view_as(x)

    @staticmethod
    def backward(ctx, grad_output, grad_residual):
        ops = get_ops()
        (
            x2d, norm_weight, norm_bias, mean, rstd, xn_qT, xn_sinv, w1, w1_t, w1_sinv,
            h, b1, a_qT, a_sinv, w2, w2_t, w2_sinv,
        ) = ctx.saved_tensors  # fmt: skip
        fc1, fc2 = ctx.calls
        main_grad1, main_grad2 = ctx.main_grads
        bwd = fc1.config.bwd_dtype
        need_x = any(ctx.needs_input_grad[:3])
        need_w1, need_b1, need_w2 = ctx.needs_input_grad[3], ctx.needs_input_grad[4], ctx.needs_input_grad[5]
        need_b2 = ctx.has_b2 and ctx.needs_input_grad[6]
        need_h = need_x or need_w1 or need_b1  # anything below the activation
        if grad_output is None:  # the MLP's output took no part in the loss
            grad_output = torch.zeros(*ctx.x_shape, dtype=x2d.dtype, device=x2d.device)
        dy2d = grad_output.reshape(-1, grad_output.shape[-1])
        # fc2's bias gradient dy.sum(0) from the cast's read of dy (module docstring)
        cast = ops.fp8_cast_dbias if need_b2 else ops.fp8_cast
        cast_dy = cast(dy2d, bwd, rowwise=need_h, columnwise=need_w2, **fc2.scaling(GRAD_OUTPUT, dy2d))
        dy = Fp8Tensor.of(cast_dy)
        grad_b2 = cast_dy[3] if need_b2 else None
        grad_w2 = fp8_wgrad(w2, main_grad2, dy.transpose, a_qT, dy.scale_inv, a_sinv) if need_w2 else None
        grad_w1 = grad_b1 = dx = dnw = dnb = None
        if need_h:
            da = _dgrad(dy, weight_transpose_for_backward(fc2, w2, w2_t), w2_sinv, x2d.dtype)
            scale, amax_record = _grad_slot(fc1)
            dh, grad_b1 = _with_dbias(
                ops.act_fp8_backward(
                    da,
                    h,
                    b1,
                    ctx.activation,
                    bwd,
                    scale,
                    amax_record=amax_record,
                    rowwise=need_x,
                    columnwise=need_w1,
                )
            )
            if need_w1:
                grad_w1 = fp8_wgrad(w1, main_grad1, dh.transpose, xn_qT, dh.scale_inv, xn_sinv)
            if need_x:
                dxn = _dgrad(dh, weight_transpose_for_backward(fc1, w1, w1_t), w1_sinv, x2d.dtype)
                dx, dnw, dnb = _norm_backward(
                    ctx, dxn, x2d, norm_weight, norm_bias, mean, rstd, grad_residual
                )
        return dx, dnw, dnb, grad_w1, grad_b1, grad_w2, grad_b2, None, None, None, None, None, None


def fp8_norm_linear(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_bias: torch.Tensor | None,
    norm: NormSpec,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    call: Fp8Linear,
    main_grad: torch.Tensor | None = None,
    gathered: Fp8Tensor | None = None,
    split: OutputSplit | None = None,
) -> tuple[torch.Tensor, ...]:
    """``(norm(x) W^T + b, x)``: a pre-norm column-parallel FP8 linear without sequence parallelism,
    ``x [..., h]`` -> ``([..., N], x)`` (the second output is the residual stream: use it, not ``x``,
    so that its gradient is added inside the norm's backward). With ``split`` the output comes in
    its parts: ``(*[..., groups, w_i], x)`` (:class:`OutputSplit`).

    ``call`` must pass :func:`fusable_call`; ``main_grad``: accumulate the weight gradient there
    (:func:`mcore.tensor_parallel.layers.fusion_main_grad`); ``gathered``: the weight's FP8 copy
    (``--fp8-param-gather``), used instead of casting ``weight``.
    """
    if norm.kind not in NORM_KINDS:
        raise ValueError(f"fp8_norm_linear: norm {norm.kind!r} is not one of {', '.join(NORM_KINDS)}")
    training = torch.is_grad_enabled()  # False inside the Function's forward: read it here
    if split is not None and weight.shape[0] != split.groups * sum(split.widths):
        raise ValueError(f"fp8_norm_linear: split {split} does not cover the output width {weight.shape[0]}")
    return Fp8NormLinear.apply(
        x, norm_weight, norm_bias, weight, bias, main_grad, norm, call, training, gathered, split
    )


def fp8_norm_mlp(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_bias: torch.Tensor | None,
    norm: NormSpec,
    fc1_weight: torch.Tensor,
    fc1_bias: torch.Tensor | None,
    fc2_weight: torch.Tensor,
    activation: str,
    calls: tuple[Fp8Linear, Fp8Linear],
    main_grads: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
    gathered: tuple[Fp8Tensor | None, Fp8Tensor | None] = (None, None),
    fc2_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fc2(act(fc1(norm(x)) + b1)), x)`` for a pre-norm MLP without sequence parallelism:
    ``x [..., h]`` -> (this rank's partial fc2 output ``[..., h]``, to all-reduce over TP and add
    fc2's bias to; the residual stream ``x``). ``activation`` one of ``gelu``, ``gelu_tanh``,
    ``swiglu``; ``calls``/``main_grads``/``gathered`` (``--fp8-param-gather``): fc1's and fc2's.
    ``fc2_bias``: fc2's bias, which the caller adds to the all-reduced output as is, as
    ``fc2_bias.detach()``: it is not added here, and its gradient comes from the cast of the output
    gradient (module docstring); None: the caller gives fc2's bias its gradient."""
    if norm.kind not in NORM_KINDS:
        raise ValueError(f"fp8_norm_mlp: norm {norm.kind!r} is not one of {', '.join(NORM_KINDS)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"fp8_norm_mlp: activation {activation!r} is not one of {', '.join(ACTIVATIONS)}")
    training = torch.is_grad_enabled()
    return Fp8NormMLP.apply(
        x,
        norm_weight,
        norm_bias,
        fc1_weight,
        fc1_bias,
        fc2_weight,
        fc2_bias,
        main_grads,
        norm,
        activation,
        calls,
        training,
        gathered,
    )


__all__ = [
    "NORM_KINDS",
    "Fp8NormLinear",
    "Fp8NormMLP",
    "NormSpec",
    "OutputSplit",
    "fp8_norm_linear",
    "fp8_norm_mlp",
    "fusable_call",
]
