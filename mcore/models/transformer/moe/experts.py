"""The routed experts: a SwiGLU or GeLU MLP per expert, run as grouped GEMMs of the op table.

Input rows ``x`` [N, H] arrive grouped by local expert in expert order with ``tokens_per_expert``
[E_local] and each row's routing probability ``p`` [N] fp32 (the dispatcher's output). Then::

    h = grouped_gemm(x, fc1, counts)        fc1 [E_local, 2F/etp, H] = [gate; up] (SwiGLU) or [E_local, F/etp, H]
    a = p * swiglu(h) or p * gelu(h)        (+ fc1's bias rows first, when biases are on)
    y = grouped_gemm(a, fc2, counts)        fc2 [E_local, H, F/etp]   (+ fc2's bias rows times p)

so ``y = p (W2 act(h) + b2)``: the rows come out weighted and the combine only sums them (Megatron's
``activation_func_with_probs``; ``W2 (p a) = p (W2 a)``, one rounding apart in bf16). The probability
is applied in the activation rather than on the output rows because its gradient
``dp = <dy, W2 act(h) + b2> = <dy W2, act(h)> + <dy, b2>`` then needs only the activation input ``h``
(kept for the activation's own backward), not the output rows ``[N, H]`` that a weighted combine
would keep: SwiGLU through the ``weighted_swiglu`` op, GeLU through :class:`_WeightedActivation`,
both keeping ``h`` and ``p`` only (the weighted activation itself is fc2's saved input, or its
recipe).

With expert tensor parallelism (``etp > 1``) each rank holds ``F/etp`` of every local expert's FFN
and ``y`` is a partial sum, reduced by the dispatcher's combine. ``--moe-grouped-gemm`` is accepted
for Megatron scripts: this grouped path (``get_ops().grouped_gemm``, one kernel per projection where
the backend has one) is the only one. With ``--fp8-format`` and a backend with a scaled grouped GEMM
both projections run FP8 (:mod:`mcore.fp8.grouped`: ``scaled_grouped_gemm`` of the op table). ``--recompute-modules moe_act`` keeps no activation output:
fc2 saves a recipe and its backward recomputes it from ``h`` (and ``p``).

Parameter names (Megatron's, section 4 of the interface notes): ``linear_fc1.weight``,
``linear_fc2.weight`` (and ``linear_fc1.bias`` [E, 2F], ``linear_fc2.bias`` [E, H] with biases).
"""

from __future__ import annotations

import torch

from mcore.backend import get_ops
from mcore.fp8.grouped import fp8_grouped_gemm
from mcore.models.transformer.moe.config import MoEConfig
from mcore.tensor_parallel.first_grad import opt_in_hook_writes
from mcore.tensor_parallel.layers import fusion_main_grad
from mcore.tensor_parallel.recompute import RecomputeWhenSaved
from mcore.tensor_parallel.sharding import (
    ZEROS,
    NormalInit,
    ParamLayout,
    make_parameter,
    scaled_init_method_normal,
)
from mcore.tensor_parallel.weight_grad import grad_into_main_grad


def _param(global_shape, partition_dim, init, etp: int, ep: int, dtype, device, num_stacked: int = 1):
    """An uninitialized expert parameter of this rank's shape: dim 0 indexes the global experts (split
    over EP in contiguous blocks), ``partition_dim`` is split over ETP; marked ``expert_parallel``."""
    layout = ParamLayout(
        tuple(global_shape), partition_dim=partition_dim, num_stacked=num_stacked, init=init, expert_dim=0
    )
    return make_parameter(layout, etp, dtype=dtype, device=device, ep_size=ep)


class GroupedMLP(torch.nn.Module):
    """``E_local`` experts of one layer (see module doc).

    Args:
        moe: the resolved MoE settings; ``ep_size``/``etp_size``/``etp_rank``: the expert layout.
        add_bias: biases on fc1 and fc2 (``not --disable-bias-linear``).
        activation: ``"swiglu"``, ``"gelu"`` or ``"gelu_tanh"``.
        recompute_activation: ``--recompute-modules moe_act``.
        fp8_margin: ``--fp8-margin`` when the experts run FP8 (:func:`mcore.fp8.grouped.experts_fp8_status`),
            else None.
        gradient_accumulation_fusion: the weights' gradients go to ``main_grad`` inside the backward
            pass (the step's first written over it, later ones added; :func:`grad_into_main_grad`);
            without it autograd hands them to the DDP hook, which does the same.
    """

    def __init__(
        self,
        moe: MoEConfig,
        *,
        ep_size: int,
        etp_size: int,
        etp_rank: int = 0,
        add_bias: bool,
        activation: str,
        recompute_activation: bool,
        params_dtype: torch.dtype,
        device,
        fp8_margin: int | None = None,
        gradient_accumulation_fusion: bool = True,
    ):
        super().__init__()
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        self.etp_rank = etp_rank  # fc2's bias joins the partial sum of ETP rank 0 only
        self.fp8_margin = fp8_margin  # not None: the grouped GEMMs run FP8 (mcore.fp8.grouped)
        e, h, f = moe.num_experts, moe.hidden_size, moe.ffn_hidden_size
        self.num_local_experts = e // ep_size
        self.activation_kind = activation
        self.recompute_activation = recompute_activation
        stacked = 2 if activation == "swiglu" else 1
        std = moe.init_method_std
        p = dict(etp=etp_size, ep=ep_size, dtype=params_dtype, device=device)
        self.linear_fc1 = torch.nn.Module()
        self.linear_fc2 = torch.nn.Module()
        self.linear_fc1.weight = _param((e, stacked * f, h), 1, NormalInit(std), num_stacked=stacked, **p)
        fc2_init = scaled_init_method_normal(std, moe.num_layers)
        self.linear_fc2.weight = _param((e, h, f), 2, fc2_init, **p)
        if add_bias:
            self.linear_fc1.bias = _param((e, stacked * f), 1, ZEROS, num_stacked=stacked, **p)
            self.linear_fc2.bias = _param((e, h), None, ZEROS, **p)
        else:
            self.linear_fc1.bias = self.linear_fc2.bias = None

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """``x`` [N, H] grouped by local expert, ``probs`` [N] each row's routing probability ->
        ``p * expert(x)`` [N, H] (partial over ETP)."""
        ops = get_ops()
        fc1_weight, fc2_weight = self._weight(self.linear_fc1.weight), self._weight(self.linear_fc2.weight)
        counts = tokens_per_expert.to(torch.int64)
        fc1_bias = self._bias_rows(self.linear_fc1.bias, counts, x.shape[0])
        gemm = ops.grouped_gemm if self.fp8_margin is None else self._fp8_gemm
        h = gemm(x, fc1_weight, counts)
        if self.recompute_activation and self.training and torch.is_grad_enabled():
            a = self.activation(h, fc1_bias, probs)
            with RecomputeWhenSaved(a, self.activation, h, fc1_bias, probs):
                y = gemm(a, fc2_weight, counts)
        else:
            y = gemm(self.activation(h, fc1_bias, probs), fc2_weight, counts)
        fc2_bias = self._bias_rows(self.linear_fc2.bias, counts, x.shape[0])
        if fc2_bias is None:
            return y
        first = self.etp_rank == 0  # the probs' gradient through the bias term, once over ETP
        return _AddOnFirstRank.apply(y, _scale_rows(fc2_bias, probs if first else probs.detach()), first)

    def _weight(self, weight: torch.Tensor) -> torch.Tensor:
        """A grouped weight as the GEMM takes it: its gradient goes to ``main_grad`` in the backward
        (fusion), or through autograd to the DDP hook, which writes the step's first one over
        ``main_grad`` (:func:`~mcore.tensor_parallel.first_grad.opt_in_hook_writes`)."""
        if self.gradient_accumulation_fusion:
            main_grad = fusion_main_grad(weight, True, False, overwrites_first=True)
            if main_grad is not None:
                return grad_into_main_grad(weight, main_grad)
        opt_in_hook_writes((weight,))
        return weight

    def _fp8_gemm(self, x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return fp8_grouped_gemm(x, weight, counts, self.fp8_margin)

    def activation(self, h: torch.Tensor, bias: torch.Tensor | None, probs: torch.Tensor) -> torch.Tensor:
        """``p * act(h + bias)`` [N, F] in ``h``'s dtype (the product in fp32)."""
        h = h if bias is None else h + bias  # per-row biases (each row's expert): added here
        if self.activation_kind == "swiglu":
            return get_ops().weighted_swiglu(h, probs)
        return _WeightedActivation.apply(h, probs, "tanh" if self.activation_kind == "gelu_tanh" else "none")

    @staticmethod
    def _bias_rows(bias: torch.Tensor | None, counts: torch.Tensor, rows: int) -> torch.Tensor | None:
        """Each row's expert bias [N, M] (the bias of the expert the row belongs to)."""
        if bias is None:
            return None
        return bias.repeat_interleave(counts.to(bias.device), dim=0, output_size=rows)


def _wide(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _scale_rows(rows: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """``rows * probs[:, None]`` in (at least) fp32, rounded to ``rows``' dtype."""
    return (_wide(rows) * _wide(probs)[:, None]).to(rows.dtype)


def _gelu(h: torch.Tensor, approximate: str) -> torch.Tensor:
    return get_ops().bias_gelu(h, None, approximate)


class _AddOnFirstRank(torch.autograd.Function):
    """``y + b`` on the first ETP rank, ``y`` on the others; ``b``'s gradient on every rank.

    With expert tensor parallelism each ETP rank's ``y`` is a partial sum that the combine adds up
    over ETP, so fc2's bias joins one of them; its gradient (the combined output's, the same on every
    ETP rank) reaches the bias on every rank, which all hold it whole. (The other ranks pass their
    bias rows scaled by detached probs: the probs' gradient, summed over ETP, counts the term once.)"""

    @staticmethod
    def forward(ctx, y: torch.Tensor, bias_rows: torch.Tensor, first: bool) -> torch.Tensor:
        return y + bias_rows if first else y.view_as(y)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        return dy, dy, None


class _WeightedActivation(torch.autograd.Function):
    """``(gelu(h) * p[:, None]).to(h.dtype)`` (the product in at least fp32) keeping ``h`` and ``p``
    only: backward recomputes ``gelu(h)`` (the op table's) for ``dp = sum_f dy gelu(h)`` (fp32) and
    takes ``dh = gelu'(h) (dy p)`` from aten's ``gelu_backward`` (traceable by torch.compile).

    Plain autograd would keep ``gelu(h)`` in fp32 for ``p``'s gradient: twice the activation this
    weighting exists not to keep."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, probs: torch.Tensor, approximate: str) -> torch.Tensor:
        ctx.save_for_backward(h, probs)
        ctx.approximate = approximate
        return _scale_rows(_gelu(h, approximate), probs)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        h, probs = ctx.saved_tensors
        dh = dp = None
        if ctx.needs_input_grad[0]:
            dh = torch.ops.aten.gelu_backward(
                _scale_rows(dy, probs).to(h.dtype), h, approximate=ctx.approximate
            )
        if ctx.needs_input_grad[1]:
            dp = (_wide(dy) * _wide(_gelu(h, ctx.approximate))).sum(-1).to(probs.dtype)
        return dh, dp, None
