"""The MLP: ``linear_fc2(act(linear_fc1(x)))`` with GeLU or SwiGLU, split over TP by hidden features.

Parameters (``F`` = ffn_hidden_size, ``p`` TP ranks):

* ``linear_fc1.weight``: logical ``[F, h]`` (GeLU) or ``[2F, h]`` = ``[gate; up]`` (SwiGLU).
  Column-parallel; for SwiGLU each rank holds ``[gate_t; up_t]`` (``[2F/p, h]``), its own rows of
  both halves (``num_stacked=2`` in its :class:`~mcore.tensor_parallel.sharding.ShardSpec`), so the
  activation ``silu(gate_t) * up_t`` is local. ``.bias`` follows the same layout.
* ``linear_fc2.weight``: logical ``[h, F]``, row-parallel (rank ``t`` holds columns
  ``[t F/p, (t+1) F/p)``); ``.bias`` ``[h]`` replicated.

``--recompute-granularity selective --recompute-modules mlp_act`` does not keep the activation's
output (fc2's input, ``[s, b, F/p]``): fc2 saves a recipe for it
(:class:`~mcore.tensor_parallel.recompute.RecomputeWhenSaved`), and fc2's backward recomputes it
(the same op of the table) from fc1's output, which the activation's own backward keeps anyway.
The op should therefore keep its input, not ``x + bias``, for backward, as the fused kernels and
the reference ``bias_gelu`` do; a SwiGLU with a bias adds the bias outside the op, so its
recipe keeps fc1's output on top of the sum the op saves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mcore.backend import get_ops
from mcore.models.transformer.build_context import BuildContext
from mcore.models.transformer.model_config import ModelConfig
from mcore.models.transformer.spec import build_module
from mcore.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from mcore.tensor_parallel.recompute import RecomputeWhenSaved, compiled_recompute_region
from mcore.tensor_parallel.sharding import init_method_normal, scaled_init_method_normal


@dataclass
class MLPSubmodules:
    """Which classes build the two projections of :class:`MLP`."""

    linear_fc1: Any = ColumnParallelLinear
    linear_fc2: Any = RowParallelLinear


class MLP(torch.nn.Module):
    """``h -> F -> h`` with GeLU (exact, or tanh with ``--openai-gelu``), SwiGLU (``--swiglu``) or
    gated GeLU (``--geglu``: ``gelu(gate) * up``, T5 v1.1's; fc1 stacked ``[gate; up]`` as SwiGLU)."""

    def __init__(
        self,
        config: ModelConfig,
        ctx: BuildContext,
        layer_number: int = 1,
        submodules: MLPSubmodules | None = None,
    ):
        super().__init__()
        submodules = submodules or MLPSubmodules()
        self.swiglu = config.swiglu
        self.geglu = config.geglu
        self.gelu_approximate = "tanh" if config.openai_gelu else "none"
        self.recompute_activation = "mlp_act" in config.selective_recompute_modules
        stacked = 2 if config.gated_linear_unit else 1
        self.linear_fc1 = build_module(
            submodules.linear_fc1,
            config.hidden_size,
            stacked * config.ffn_hidden_size,
            tp_group=ctx.tp_group,
            bias=config.add_bias_linear,
            gather_output=False,
            skip_bias_add=True,
            sequence_parallel=ctx.sequence_parallel,
            init_method=init_method_normal(config.init_method_std),
            num_stacked=stacked,
            gradient_accumulation_fusion=config.gradient_accumulation_fusion,
            **ctx.fp8_kwargs(layer_number),
            params_dtype=ctx.params_dtype,
            device=ctx.device,
        )
        self.linear_fc2 = build_module(
            submodules.linear_fc2,
            config.ffn_hidden_size,
            config.hidden_size,
            tp_group=ctx.tp_group,
            bias=config.add_bias_linear,
            input_is_parallel=True,
            skip_bias_add=True,
            sequence_parallel=ctx.sequence_parallel,
            init_method=scaled_init_method_normal(config.init_method_std, config.num_layers),
            gradient_accumulation_fusion=config.gradient_accumulation_fusion,
            **ctx.fp8_kwargs(layer_number),
            params_dtype=ctx.params_dtype,
            device=ctx.device,
        )

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[s, b, h]`` (``[s/p, b, h]`` with SP) -> (output of the same shape, the un-added fc2 bias)."""
        intermediate, bias = self.linear_fc1(hidden_states)  # [s, b, F/p] or [s, b, 2F/p]
        if not (self.recompute_activation and self.training and torch.is_grad_enabled()):
            return self.linear_fc2(self.activation(intermediate, bias))
        if torch.compiler.is_compiling():
            return self.linear_fc2(compiled_recompute_region(self.activation, intermediate, bias))
        activated = self.activation(intermediate, bias)
        with RecomputeWhenSaved(activated, self.activation, intermediate, bias):
            return self.linear_fc2(activated)

    def activation(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``act(x + bias)``: GeLU ``[s, b, F/p]`` or SwiGLU ``[s, b, 2F/p] -> [s, b, F/p]``."""
        ops = get_ops()
        if self.swiglu:
            if bias is not None:
                x = x + bias
            return ops.swiglu(x)
        if self.geglu:
            if bias is not None:
                x = x + bias
            gate, up = x.chunk(2, dim=-1)
            return ops.bias_gelu(gate, None, self.gelu_approximate) * up
        return ops.bias_gelu(x, bias, self.gelu_approximate)
