"""BERT's heads beside the encoder: the masked-LM transform (:class:`BertLMHead`), the
:class:`Pooler` of the binary head, and the :class:`ReplicatedLinear` both are made of (whole on
every TP rank, as Megatron's ``get_linear_layer``)."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from mcore.backend import get_ops
from mcore.models.transformer.build_context import BuildContext
from mcore.models.transformer.model_config import ModelConfig
from mcore.models.transformer.norms import Norm
from mcore.tensor_parallel.mappings import gather_from_sequence_parallel_region
from mcore.tensor_parallel.sharding import ZEROS, NormalInit, ParamLayout, make_parameter


class ReplicatedLinear(torch.nn.Module):
    """``y = x W^T + b`` with ``W [out, in]`` and ``b [out]`` whole on every TP rank (Megatron's
    ``get_linear_layer``: weight ``N(0, std^2)``, bias 0).

    ``sequence_parallel``: the layer is applied to sequence shards, so its gradients need a TP sum.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        ctx: BuildContext,
        *,
        init_std: float,
        sequence_parallel: bool = False,
    ):
        super().__init__()
        weight = ParamLayout(
            (output_size, input_size), init=NormalInit(init_std), sequence_parallel=sequence_parallel
        )
        bias = ParamLayout((output_size,), init=ZEROS, sequence_parallel=sequence_parallel)
        self.weight = make_parameter(weight, ctx.tp_size, dtype=ctx.params_dtype, device=ctx.device)
        self.bias = make_parameter(bias, ctx.tp_size, dtype=ctx.params_dtype, device=ctx.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class BertLMHead(torch.nn.Module):
    """The masked-LM transform before the output layer: ``layer_norm(gelu(dense(y)))``, ``[.., h] -> [.., h]``.

    The GeLU is the exact (erf) one, as megatron-core's ``BertLMHead`` and Hugging Face's ``"gelu"``.
    """

    def __init__(self, config: ModelConfig, ctx: BuildContext):
        super().__init__()
        h = config.hidden_size
        self.dense = ReplicatedLinear(
            h, h, ctx, init_std=config.init_method_std, sequence_parallel=ctx.sequence_parallel
        )
        # Always a LayerNorm (megatron-core's LNImpl), whatever --normalization the layers use.
        self.layer_norm = Norm(replace(config, normalization="LayerNorm"), ctx)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        dense = self.dense
        return self.layer_norm(get_ops().bias_gelu(F.linear(hidden_states, dense.weight), dense.bias))


class Pooler(torch.nn.Module):
    """``tanh(dense(y[0]))``: the first token's final hidden state, ``[s, b, h] -> [b, h]``.

    With sequence parallelism the sequence is all-gathered first; every TP rank then runs the pooler
    whole, so the gradient of the gather keeps this rank's chunk (no sum over TP).
    """

    def __init__(self, config: ModelConfig, ctx: BuildContext):
        super().__init__()
        self.ctx = ctx
        self.dense = ReplicatedLinear(
            config.hidden_size, config.hidden_size, ctx, init_std=config.init_method_std
        )

    def forward(self, hidden_states: torch.Tensor, sequence_index: int = 0) -> torch.Tensor:
        if self.ctx.sequence_parallel:
            hidden_states = gather_from_sequence_parallel_region(
                hidden_states, self.ctx.tp_group, tensor_parallel_output_grad=False
            )
        return torch.tanh(self.dense(hidden_states[sequence_index]))
