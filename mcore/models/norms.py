"""LayerNorm and RMSNorm over the hidden dim, computed by the backend's op table."""

from __future__ import annotations

import torch

from mcore.backend import get_ops
from mcore.models.config import ModelConfig
from mcore.models.context import BuildContext
from mcore.tensor_parallel.sharding import ONES, ZEROS, ParamLayout, make_parameter


class Norm(torch.nn.Module):
    """``config.normalization`` over the last dim: ``LayerNorm`` (weight, bias) or ``RMSNorm`` (weight).

    Parameters are replicated over TP. With sequence parallelism each rank normalizes its own part of
    the sequence, so the layouts say ``sequence_parallel=True`` (their gradients need a TP sum).
    """

    def __init__(self, config: ModelConfig, ctx: BuildContext, hidden_size: int | None = None):
        super().__init__()
        h = hidden_size or config.hidden_size
        self.kind = config.normalization
        self.eps = config.norm_epsilon
        self.weight = make_parameter(
            ParamLayout((h,), init=ONES, sequence_parallel=ctx.sequence_parallel),
            ctx.tp_size,
            dtype=ctx.params_dtype,
            device=ctx.device,
        )
        if self.kind == "LayerNorm":
            self.bias = make_parameter(
                ParamLayout((h,), init=ZEROS, sequence_parallel=ctx.sequence_parallel),
                ctx.tp_size,
                dtype=ctx.params_dtype,
                device=ctx.device,
            )
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "LayerNorm":
            return get_ops().layer_norm(x, self.weight, self.bias, self.eps)
        return get_ops().rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.kind}({self.weight.shape[0]}, eps={self.eps})"
