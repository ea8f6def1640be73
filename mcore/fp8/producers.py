"""When a transformer layer takes the fused FP8 producers, and the calls that bind its modules to them.

:mod:`mcore.fp8.fused` has the math: ``input_layernorm -> linear_qkv`` as one autograd
Function (the norm writes QKV's FP8 input), ``pre_mlp_layernorm -> fc1 -> activation -> fc2`` as
another (the norm writes fc1's FP8 input, the activation fc2's). A layer takes them when all hold
(else the unfused modules run, with the same parameters and FP8 states):

* the linears run FP8 with the delayed recipe and FP8 weight gradients, and
  ``--no-fp8-fused-producers`` is not given (:func:`~mcore.fp8.fused.fusable_call`);
* pre-norm (no ``--apply-residual-connection-post-layernorm``), no ``--fp32-residual-connection``,
  no ``--sequence-parallel``;
* the layer's parts are the stock classes: :class:`~mcore.models.transformer.norms.Norm` (LayerNorm or RMSNorm),
  :class:`~mcore.models.transformer.attention.SelfAttention` / :class:`~mcore.models.transformer.mlp.MLP` with
  :class:`~mcore.tensor_parallel.layers.ColumnParallelLinear` / ``RowParallelLinear`` projections
  (a spec that swaps one in keeps its own forward), and a GeLU, tanh-GeLU or SwiGLU MLP. The layer
  checks the classes of its own parts (it builds them; this package sits below :mod:`mcore.models`
  and imports none of it) and asks :func:`qkv_fusable` / :func:`mlp_fusable` only about stock parts;
* not under ``torch.compile`` (the compiled layer fuses its own producers);
* the op table serves the fused op and the unfused ops it replaces alike: both by the reference or
  both by a backend (the fused op's bytes are defined as the unfused op's; a backend that overrides
  only ``layer_norm`` keeps its kernel).

Selective recomputation on this path: ``layernorm`` and ``mlp_act`` have nothing left to free (the
Functions keep only FP8 operands besides the layer input and fc1's output), so they do not apply;
``mlp`` checkpoints the fused norm and MLP together, and full recomputation checkpoints the layer.
"""

from __future__ import annotations

import logging

import torch

from mcore.backend import get_ops
from mcore.fp8.fused import NORM_KINDS, NormSpec, OutputSplit, fp8_norm_linear, fp8_norm_mlp, fusable_call
from mcore.ops.registry import REFERENCE
from mcore.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, fusion_main_grad
from mcore.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

logger = logging.getLogger(__name__)
_declined: set[tuple[str, str]] = set()  # (fused op, unfused op) pairs already logged


def _norm_spec(norm: torch.nn.Module) -> NormSpec | None:
    """The fused norm of a stock ``Norm`` (the caller checked its class), None for another kind."""
    if norm.kind not in NORM_KINDS:
        return None
    return NormSpec(norm.kind, norm.eps)


def _column(linear: torch.nn.Module) -> bool:
    return (
        type(linear) is ColumnParallelLinear
        and fusable_call(linear._fp8_call)
        and not linear.sequence_parallel
        and not linear.gather_output
        and linear.weight is not None
    )


def activation_kind(mlp: torch.nn.Module) -> str | None:
    """The fused activation of a stock MLP (``gelu``, ``gelu_tanh``, ``swiglu``), None for GeGLU."""
    if mlp.swiglu:
        return "swiglu"
    if mlp.geglu:
        return None
    return "gelu_tanh" if mlp.gelu_approximate == "tanh" else "gelu"


def layer_allows(layer) -> bool:
    """The layer-wide conditions (module docstring): pre-norm, no fp32 residual, no sequence parallelism."""
    return not (layer.residual_post_norm or layer.fp32_residual or layer.sequence_parallel)


def qkv_fusable(norm: torch.nn.Module, attention: torch.nn.Module) -> bool:
    """``norm -> attention.linear_qkv`` may run as one fused Function (static conditions; ``norm`` a
    stock ``Norm`` and ``attention`` a stock ``SelfAttention``, which the layer checked)."""
    return (
        _norm_spec(norm) is not None
        and _column(attention.linear_qkv)
        and not attention.linear_qkv.skip_bias_add
    )


def mlp_fusable(norm: torch.nn.Module, mlp: torch.nn.Module) -> bool:
    """``norm -> mlp`` may run as one fused Function (static conditions; ``norm`` a stock ``Norm`` and
    ``mlp`` a stock ``MLP``, which the layer checked)."""
    if _norm_spec(norm) is None or activation_kind(mlp) is None:
        return False
    fc1, fc2 = mlp.linear_fc1, mlp.linear_fc2
    return (
        _column(fc1)
        and fc1.skip_bias_add
        and type(fc2) is RowParallelLinear
        and fusable_call(fc2._fp8_call)
        and fc2.skip_bias_add
        and fc2.input_is_parallel
        and not fc2.sequence_parallel
    )


def _same_server(pairs) -> bool:
    """Each ``(fused op, unfused op)`` pair is served alike (both reference or both a backend's)."""
    ops = get_ops()
    for fused, unfused in pairs:
        if (ops.provider(fused) == REFERENCE) != (ops.provider(unfused) == REFERENCE):
            if (fused, unfused) not in _declined:
                _declined.add((fused, unfused))
                logger.info(
                    "FP8 fused producers off: op %s is served by %s but %s by %s",
                    fused, ops.provider(fused), unfused, ops.provider(unfused),
                )  # fmt: skip
            return False
    return True


def _norm_ops(norm: torch.nn.Module) -> list[tuple[str, str]]:
    name = "layer_norm" if norm.kind == "LayerNorm" else "rms_norm"
    return [("norm_fp8_forward", name), ("norm_backward", name)]


def qkv_ops_ready(norm: torch.nn.Module, attention: torch.nn.Module) -> bool:
    """The dynamic conditions of the fused QKV path: not compiling, the ops served alike."""
    if torch.compiler.is_compiling():
        return False
    pairs = _norm_ops(norm)
    if attention.linear_qkv.bias is not None:
        pairs.append(("fp8_cast_dbias", "fp8_cast"))
    return _same_server(pairs)


def mlp_ops_ready(norm: torch.nn.Module, mlp: torch.nn.Module) -> bool:
    """The dynamic conditions of the fused MLP path: not compiling, the ops served alike."""
    if torch.compiler.is_compiling():
        return False
    unfused_act = "swiglu" if mlp.swiglu else "bias_gelu"
    pairs = _norm_ops(norm) + [("act_fp8_forward", unfused_act), ("act_fp8_backward", unfused_act)]
    return _same_server(pairs)


def norm_qkv(norm: torch.nn.Module, attention: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(query, key, value, x)``: ``linear_qkv(norm(x))`` split as
    :meth:`~mcore.models.transformer.attention.SelfAttention.forward_from_qkv` splits it (``[s, b, g_p, r d]``,
    ``[s, b, g_p, d]`` twice), through :func:`~mcore.fp8.fused.fp8_norm_linear` with
    an :class:`~mcore.fp8.fused.OutputSplit` (the three gradients are cast to FP8
    where they lie), and the residual stream."""
    linear = attention.linear_qkv
    # the fused Functions write the step's first weight gradient over main_grad (fp8_wgrad): opt in
    main_grad = fusion_main_grad(linear.weight, linear.gradient_accumulation_fusion, False, True)
    groups, widths = attention.qkv_split()
    return fp8_norm_linear(
        x, norm.weight, norm.bias, _norm_spec(norm), linear.weight, linear.bias, linear._fp8_call, main_grad,
        gathered=linear.fp8_gathered_weight, split=OutputSplit(groups, widths),
    )  # fmt: skip


def norm_mlp(
    norm: torch.nn.Module, mlp: torch.nn.Module, x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``(fc2 output, fc2 bias un-added, residual)`` of ``mlp(norm(x))`` through
    :func:`~mcore.fp8.fused.fp8_norm_mlp`; the fc2 output is all-reduced over TP here,
    as :class:`~mcore.tensor_parallel.layers.RowParallelLinear` does, and when fc2 gives its bias the
    gradient (:meth:`~mcore.tensor_parallel.layers.RowParallelLinear.takes_bias_grad`: the layer adds
    it as is) the fused backward does so and the bias is returned detached, as fc2 would."""
    fc1, fc2 = mlp.linear_fc1, mlp.linear_fc2
    main_grads = (
        fusion_main_grad(fc1.weight, fc1.gradient_accumulation_fusion, False, True),
        fusion_main_grad(fc2.weight, fc2.gradient_accumulation_fusion, False, True),
    )
    bias_grad_here = fc2.takes_bias_grad()
    partial, residual = fp8_norm_mlp(
        x, norm.weight, norm.bias, _norm_spec(norm), fc1.weight, fc1.bias, fc2.weight,
        activation_kind(mlp), (fc1._fp8_call, fc2._fp8_call), main_grads,
        gathered=(fc1.fp8_gathered_weight, fc2.fp8_gathered_weight),
        fc2_bias=fc2.bias if bias_grad_here else None,
    )  # fmt: skip
    bias = fc2.bias.detach() if bias_grad_here else fc2.bias
    return reduce_from_tensor_model_parallel_region(partial, fc2.tp_group), bias, residual
