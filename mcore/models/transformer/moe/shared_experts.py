"""The shared expert(s) (``--moe-shared-expert-intermediate-size``): a dense MLP every token passes
through, beside the routed experts (DeepSeek, Qwen2-MoE).

It is the layer's dense :class:`~mcore.models.transformer.mlp.MLP` with ``ffn_hidden_size`` = the
shared size (the total of all shared experts, Megatron's convention), TP-split like any MLP. With
``--moe-shared-expert-gate`` its output is scaled per token by ``sigmoid(x @ gate_weight.T)``,
``gate_weight`` [1, H] (Qwen2-MoE's ``shared_expert_gate``), replicated (with sequence parallelism
its gradient is summed over TP like a norm weight's).

Parameter names: ``linear_fc1.*``, ``linear_fc2.*``, ``gate_weight``.
"""

from __future__ import annotations

import dataclasses

import torch

from mcore.models.transformer.mlp import MLP
from mcore.tensor_parallel.sharding import NormalInit, ParamLayout, make_parameter


class SharedExpertMLP(MLP):
    """The shared MLP (see module doc); ``forward`` returns ``(output, None)`` with fc2's bias added."""

    def __init__(self, config, ctx, layer_number: int = 1):
        size = config.moe_shared_expert_intermediate_size
        super().__init__(dataclasses.replace(config, ffn_hidden_size=size), ctx, layer_number=layer_number)
        if config.moe_shared_expert_gate:
            self.gate_weight = make_parameter(
                ParamLayout(
                    (1, config.hidden_size),
                    init=NormalInit(config.init_method_std),
                    sequence_parallel=ctx.sequence_parallel,
                ),
                1,
                dtype=ctx.params_dtype,
                device=ctx.device,
            )
        else:
            self.gate_weight = None

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, None]:
        out, bias = super().forward(hidden_states)
        if bias is not None:
            out = out + bias
        if self.gate_weight is not None:
            gate = torch.sigmoid(torch.nn.functional.linear(hidden_states, self.gate_weight))
            out = out * gate
        return out, None
