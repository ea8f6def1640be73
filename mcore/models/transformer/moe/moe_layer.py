"""The MoE layer (Megatron's ``MoELayer``): the MLP slot of an MoE transformer layer.

For hidden states ``x`` [s, b, H] (``[s/tp, b, H]`` with sequence parallelism: each TP rank routes
its own tokens)::

    probs, routing_map = router(x)                          [T, E], T = s*b
    rows, counts, p = dispatcher.dispatch(x, probs, map)    rows grouped by local expert, p [N] theirs
    y = dispatcher.combine(experts(rows, counts, p))        [T, H]: sum_e probs[t, e] * expert_e(x_t)
    y = y + shared_experts(x)                               (with --moe-shared-expert-intermediate-size)

The experts apply each row's probability inside their activation (``p * act(h)``, Megatron's way) and
combine sums the weighted rows: the probabilities' gradient then needs only the activation's input,
and the experts' output rows ``[T * topk, H]`` are not kept for backward (see :mod:`.experts`).

At TP > 1 without sequence parallelism (generation) every TP rank holds all tokens; the allgather
dispatcher then gathers TP copies of them over ``tp_ep``, and since combine's reduce-scatter returns
each rank the sum over all expert shards of its own copy, the output is exact; training that way is
refused (the experts' gradients would count each token TP times).

Returns ``(y [s, b, H], None)`` like the dense MLP (the experts' biases are added inside).
The experts' input rows are not kept for backward where they are a local permutation of ``x``
(no EP/ETP exchange): backward gathers them again (:func:`~.dispatcher.gather_rows`).
``--recompute-modules moe`` checkpoints this whole forward (the router's statistics are counted
once: the recomputation runs without grad-mode counting, see the router).

Parameter names: ``router.weight`` (+ ``router.expert_bias`` buffer), ``experts.linear_fc1.weight``,
``experts.linear_fc2.weight``, ``shared_experts.*``.
"""

from __future__ import annotations

import contextlib

import torch

from mcore.backend import current_backend
from mcore.fp8.grouped import experts_fp8_status
from mcore.models.transformer.build_context import BuildContext
from mcore.models.transformer.moe.dispatcher import build_dispatcher
from mcore.models.transformer.moe.experts import GroupedMLP
from mcore.models.transformer.moe.groups import MoEGroups
from mcore.models.transformer.moe.router import TopKRouter
from mcore.models.transformer.moe.shared_experts import SharedExpertMLP
from mcore.tensor_parallel.recompute import RecomputeWhenSaved, checkpoint


def _activation(config) -> str:
    if config.swiglu:
        return "swiglu"
    if config.geglu:
        raise ValueError("--geglu experts are not implemented; MoE layers take --swiglu or GeLU")
    return "gelu_tanh" if config.openai_gelu else "gelu"


class MoELayer(torch.nn.Module):
    """Router, dispatch, experts, combine (+ shared experts); see the module doc.

    Args:
        config: the model config (``config.moe`` must be set).
        ctx: the build context; ``ctx.groups`` gives the MoE groups (None: one process).
        layer_number: 1-based global layer number.
        groups: explicit MoE groups (tests); default from ``ctx.groups``.
    """

    def __init__(self, config, ctx: BuildContext, layer_number: int = 1, groups: MoEGroups | None = None):
        super().__init__()
        moe = config.moe
        if moe is None:
            raise ValueError("MoELayer needs --num-experts")
        self.groups = groups or MoEGroups.from_process_groups(getattr(ctx, "groups", None))
        self.layer_number = layer_number
        self.tp_size, self.sequence_parallel = ctx.tp_size, ctx.sequence_parallel
        self.recompute = "moe" in config.selective_recompute_modules
        backend = current_backend()
        self.experts_fp8, _ = experts_fp8_status(
            ctx.fp8_kwargs(layer_number).get("fp8"),
            backend.capabilities(),
            backend.name,
            self.groups.etp_size,
        )
        self.router = TopKRouter(moe, self.groups, layer_number, ctx.sequence_parallel, ctx.device)
        self.experts = GroupedMLP(
            moe,
            ep_size=self.groups.ep_size,
            etp_size=self.groups.etp_size,
            etp_rank=self.groups.etp_rank,
            add_bias=config.add_bias_linear,
            activation=_activation(config),
            recompute_activation="moe_act" in config.selective_recompute_modules,
            params_dtype=ctx.params_dtype,
            device=ctx.device,
            fp8_margin=ctx.fp8.fp8_margin if self.experts_fp8 else None,
            gradient_accumulation_fusion=config.gradient_accumulation_fusion,
        )
        self.dispatcher = build_dispatcher(moe.dispatcher, moe.num_experts, self.groups)
        self.shared_experts = (
            SharedExpertMLP(config, ctx, layer_number) if moe.moe_shared_expert_intermediate_size else None
        )

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, None]:
        if self.recompute and self.training and torch.is_grad_enabled():
            return checkpoint(self._forward, hidden_states), None
        return self._forward(hidden_states), None

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1 and not self.sequence_parallel and self.training and torch.is_grad_enabled():
            # Each TP rank holds every token: the forward is right (the gathered copies meet each expert
            # shard once per rank and the reduce-scatter keeps one sum per copy), the experts'
            # gradients would count each token TP times. Inference (generation) runs this way.
            raise ValueError(
                f"num_experts={self.router.moe.num_experts} with tensor_model_parallel_size={self.tp_size} "
                "trains only with --sequence-parallel (as Megatron)"
            )
        shape = x.shape
        probs, routing_map = self.router(x)
        tokens = x.reshape(-1, shape[-1])
        dropless = self.router.moe.moe_expert_capacity_factor is None
        rows, counts, row_probs = self.dispatcher.dispatch(
            tokens, probs, routing_map, self.router.topk if dropless else None
        )
        recipe = self.dispatcher.rows_recipe()  # the rows are saved as a recipe where they can be
        with RecomputeWhenSaved(rows, *recipe) if recipe is not None else contextlib.nullcontext():
            expert_out = self.experts(rows, counts, row_probs)
        out = self.dispatcher.combine(expert_out).reshape(shape)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)[0]
        return out


def mlp_or_moe(config, ctx: BuildContext, layer_number: int = 1, **kwargs):
    """The MLP slot of a layer spec: an :class:`MoELayer` where ``--moe-layer-freq`` puts one (global
    layer ``layer_number``, 1-based), else the dense MLP of ``kwargs["dense"]`` (a spec)."""
    from mcore.models.transformer.spec import build_module

    dense = kwargs.pop("dense")
    moe = config.moe
    if moe is not None and moe.moe_layers[layer_number - 1]:
        return MoELayer(config, ctx, layer_number)
    return build_module(dense, config, ctx, layer_number=layer_number, **kwargs)
