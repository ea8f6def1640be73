"""A pre-norm transformer layer with selective recomputation (the block stacking the layers:
:mod:`mcore.models.transformer.block`).

Hidden states are ``[s, b, h]`` (``[s/p, b, h]`` with sequence parallelism). Each layer::

    x = x + dropout(attention(norm_1(x)) + proj_bias)
    x = x + dropout(mlp(norm_2(x)) + fc2_bias)

(``--apply-residual-connection-post-layernorm`` takes the residual after each norm instead.)

Selective recomputation (``--recompute-granularity selective --recompute-modules ...``, Megatron's
names): ``core_attn`` (the default) checkpoints the core attention (:mod:`mcore.models.transformer.attention`);
``layernorm`` keeps neither norm output: the QKV projection and fc1 save a recipe for it
(:class:`~mcore.tensor_parallel.recompute.RecomputeWhenSaved`), and it is recomputed from ``x``
(kept anyway: the norm's own backward needs it) when that projection's backward reads it;
``mlp_act`` does the same for the MLP activation (:mod:`mcore.models.transformer.mlp`); ``mlp`` checkpoints the
whole MLP. ``layernorm`` and ``mlp_act`` run no backward pass of their own, so they also work with
device graphs (``--cuda-graph-impl local``) and keep the fused norm-and-residual op.

FP8 with the delayed recipe: the norms write the next linear's FP8 input themselves, as one autograd
Function with it (:mod:`mcore.fp8.producers` says when); that path keeps only FP8 operands,
so ``layernorm`` and ``mlp_act`` have nothing to free there, and ``mlp`` checkpoints the fused norm
and MLP together.

What ``layernorm`` frees is the tensor the projection saves for its weight gradient. With sequence
parallelism the column-parallel linear all-gathers the ``[s/p, b, h]`` norm output along ``s`` and
keeps a recipe (all-gather this rank's norm output again) whose argument, the local norm output,
becomes the norm's own recipe: the layer keeps neither.

Parameter names inside a layer: ``input_layernorm.{weight,bias}``, ``self_attention.*``
(:mod:`mcore.models.transformer.attention`), ``pre_mlp_layernorm.{weight,bias}``, ``mlp.*``
(:mod:`mcore.models.transformer.mlp`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch

from mcore.backend import get_ops
from mcore.fp8 import producers as fp8_producers
from mcore.models.transformer.attention import SelfAttention
from mcore.models.transformer.build_context import BuildContext
from mcore.models.transformer.cross_attention import CrossAttention
from mcore.models.transformer.mlp import MLP
from mcore.models.transformer.model_config import ModelConfig
from mcore.models.transformer.norms import Norm
from mcore.models.transformer.spec import ModuleSpec, build_module
from mcore.tensor_parallel.layers import RowParallelLinear
from mcore.tensor_parallel.random import get_rng_tracker
from mcore.tensor_parallel.recompute import RecomputeWhenSaved, checkpoint, compiled_recompute_region


@dataclass
class TransformerLayerSubmodules:
    """Specs of the four parts of a :class:`TransformerLayer`."""

    input_layernorm: Any = field(default_factory=lambda: ModuleSpec(Norm))
    self_attention: Any = field(default_factory=lambda: ModuleSpec(SelfAttention))
    pre_mlp_layernorm: Any = field(default_factory=lambda: ModuleSpec(Norm))
    mlp: Any = field(default_factory=lambda: ModuleSpec(MLP))


def mark_bias_added_by_caller(*parts: torch.nn.Module | None) -> None:
    """Tell the row-parallel output projections of a layer's stock parts (:class:`SelfAttention`,
    :class:`~mcore.models.transformer.cross_attention.CrossAttention`, :class:`MLP`), whose forward returns the
    projection's ``(output, bias)`` unchanged, that the layer's ``bias_dropout_add`` adds that bias to
    the output as is: an FP8 projection then gives the bias its gradient from its own backward
    (:attr:`~mcore.tensor_parallel.layers.RowParallelLinear.bias_added_by_caller`). A part of another
    class (a spec's own) may use the bias otherwise and is left alone."""
    for part in parts:
        if type(part) in (SelfAttention, CrossAttention):
            linear = part.linear_proj
        elif type(part) is MLP:
            linear = part.linear_fc2
        else:
            continue
        if isinstance(linear, RowParallelLinear):
            linear.bias_added_by_caller = True


class TransformerLayer(torch.nn.Module):
    """Norm, self-attention, residual; norm, MLP, residual.

    Args:
        config, ctx: what to build and how it is split.
        layer_number: 1-based global index of the layer in the whole model (Megatron's convention).
        submodules: the part specs (default: :class:`TransformerLayerSubmodules`).
    """

    def __init__(
        self,
        config: ModelConfig,
        ctx: BuildContext,
        layer_number: int = 1,
        submodules: TransformerLayerSubmodules | None = None,
    ):
        super().__init__()
        submodules = submodules or TransformerLayerSubmodules()
        self.layer_number = layer_number
        self.sequence_parallel = ctx.sequence_parallel
        self.hidden_dropout = config.hidden_dropout
        self.residual_post_norm = config.apply_residual_connection_post_layernorm
        self.fp32_residual = config.fp32_residual_connection
        self.params_dtype = ctx.params_dtype
        recompute = config.selective_recompute_modules
        self.recompute_layernorm = "layernorm" in recompute
        self.recompute_mlp = "mlp" in recompute
        self.input_layernorm = build_module(submodules.input_layernorm, config, ctx)
        self.self_attention = build_module(submodules.self_attention, config, ctx, layer_number=layer_number)
        self.pre_mlp_layernorm = build_module(submodules.pre_mlp_layernorm, config, ctx)
        self.mlp = build_module(submodules.mlp, config, ctx, layer_number=layer_number)
        # bias_dropout_add adds linear_proj's and linear_fc2's returned biases to their outputs as is
        mark_bias_added_by_caller(self.self_attention, self.mlp)
        # FP8 (delayed recipe): the norms write the next linear's FP8 input (mcore.fp8.producers), for
        # the stock parts only (a spec that swaps one in keeps its own forward)
        fusable = fp8_producers.layer_allows(self)
        stock_qkv = type(self.input_layernorm) is Norm and type(self.self_attention) is SelfAttention
        stock_mlp = type(self.pre_mlp_layernorm) is Norm and type(self.mlp) is MLP
        self.fp8_fused_qkv = (
            fusable and stock_qkv and fp8_producers.qkv_fusable(self.input_layernorm, self.self_attention)
        )
        self.fp8_fused_mlp = (
            fusable and stock_mlp and fp8_producers.mlp_fusable(self.pre_mlp_layernorm, self.mlp)
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        rotary_freqs: torch.Tensor | None = None,
        inference_context=None,
    ) -> torch.Tensor:
        recompute = self._may_recompute(inference_context)
        hidden_states = self._self_attention_branch(
            hidden_states, recompute, attention_mask, rotary_freqs, inference_context
        )
        return self._mlp_branch(hidden_states, recompute)

    def _may_recompute(self, inference_context) -> bool:
        """Selective recomputation applies: training with gradients, no KV cache."""
        return self.training and inference_context is None and torch.is_grad_enabled()

    def _self_attention_branch(
        self,
        hidden_states,
        recompute: bool,
        attention_mask,
        rotary_freqs,
        inference_context,
        **attention_kwargs,
    ) -> torch.Tensor:
        """The self-attention branch; ``attention_kwargs`` go to the attention (T5's ``attention_bias``)."""
        if self.fp8_fused_qkv and fp8_producers.qkv_ops_ready(self.input_layernorm, self.self_attention):
            *qkv, residual = fp8_producers.norm_qkv(self.input_layernorm, self.self_attention, hidden_states)
            out, bias = self.self_attention.forward_from_split(
                *qkv, attention_mask, rotary_freqs, inference_context=inference_context, **attention_kwargs
            )
            return self._bias_dropout_add(out, bias, residual)
        return self._residual_branch(
            self.input_layernorm,
            hidden_states,
            recompute,
            lambda normed: self.self_attention(
                normed, attention_mask, rotary_freqs, inference_context=inference_context, **attention_kwargs
            ),
        )

    def _residual_branch(self, norm: torch.nn.Module, hidden_states: torch.Tensor, recompute: bool, branch):
        """``residual + dropout(out + bias)`` with ``(out, bias) = branch(norm(hidden_states))``.

        ``recompute``: this step may recompute (training, no KV cache); the norm is then recomputed
        under ``--recompute-modules layernorm``.
        """
        recompute_norm = recompute and self.recompute_layernorm
        normed, residual = self._norm_and_residual(norm, hidden_states, recompute_norm)
        with self._recompute_norm_when_saved(recompute_norm, normed, norm, hidden_states):
            out, bias = branch(normed)
        del normed  # with recomputation nothing else holds it: its memory is free from here on
        return self._bias_dropout_add(out, bias, residual)

    def _mlp_branch(self, hidden_states: torch.Tensor, recompute: bool) -> torch.Tensor:
        """The MLP branch (``--recompute-modules mlp`` checkpoints the MLP)."""
        if self.fp8_fused_mlp and fp8_producers.mlp_ops_ready(self.pre_mlp_layernorm, self.mlp):
            if recompute and self.recompute_mlp:  # the fused norm and MLP, recomputed together
                out = checkpoint(self._fused_mlp_with_bias, hidden_states)
                return self._bias_dropout_add(out, None, hidden_states)
            out, bias, residual = fp8_producers.norm_mlp(self.pre_mlp_layernorm, self.mlp, hidden_states)
            return self._bias_dropout_add(out, bias, residual)

        def mlp(normed: torch.Tensor):
            if recompute and self.recompute_mlp:
                return checkpoint(self._mlp_with_bias, normed), None
            return self.mlp(normed)

        return self._residual_branch(self.pre_mlp_layernorm, hidden_states, recompute, mlp)

    def _norm_and_residual(
        self, norm: torch.nn.Module, x: torch.Tensor, recompute: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The norm's output and the residual for the branch that follows.

        The residual is the norm's input (pre-norm) or output (``--apply-residual-connection-post-
        layernorm``). Pre-norm without an fp32 residual stream asks the norm for both
        (:meth:`Norm.forward_with_residual`), so the two uses' gradients are summed in its backward.
        A recomputed norm under ``torch.compile`` is a recompute region instead (see
        :class:`~mcore.tensor_parallel.recompute.RecomputeWhenSaved`).
        """
        if recompute and torch.compiler.is_compiling():
            normed = compiled_recompute_region(self._norm, norm, x)
            return normed, (normed if self.residual_post_norm else x)
        if not self.residual_post_norm and not self.fp32_residual:
            forward_with_residual = getattr(norm, "forward_with_residual", None)
            if forward_with_residual is not None:
                return forward_with_residual(x)
        normed = self._norm(norm, x)
        return normed, (normed if self.residual_post_norm else x)

    def _norm(self, norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = norm(x)
        # With an fp32 residual stream the branches still compute in the parameter dtype.
        return out.to(self.params_dtype) if self.fp32_residual else out

    def _recompute_norm_when_saved(self, recompute: bool, normed, norm, x):
        """``--recompute-modules layernorm``: the branch saves a recipe for ``normed``, not ``normed``.

        It is recomputed from ``x`` (kept anyway: the norm's own backward reads it) when the branch's
        first projection needs it for its weight gradient.
        """
        if not recompute:  # (under torch.compile the context is inactive: a recompute region instead)
            return contextlib.nullcontext()
        return RecomputeWhenSaved(normed, self._norm, norm, x)

    def _mlp_with_bias(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP output with its bias added (``--recompute-modules mlp`` checkpoints this)."""
        out, bias = self.mlp(x)
        return out if bias is None else out + bias

    def _fused_mlp_with_bias(self, x: torch.Tensor) -> torch.Tensor:
        """The fused norm and MLP's output with fc2's bias added (``--recompute-modules mlp`` on the
        fused path checkpoints this; the residual stream is ``x``, outside)."""
        out, bias, _ = fp8_producers.norm_mlp(self.pre_mlp_layernorm, self.mlp, x)
        return out if bias is None else out + bias

    def _bias_dropout_add(self, x, bias, residual) -> torch.Tensor:
        p = self.hidden_dropout if self.training else 0.0
        # Sequence shards differ per TP rank, so their dropout masks must too (the TP RNG stream);
        # replicated activations use the default stream, identical on every TP rank.
        rng = get_rng_tracker().fork() if self.sequence_parallel and p > 0.0 else contextlib.nullcontext()
        with rng:
            return get_ops().bias_dropout_add(x, bias, residual, p, self.training)
