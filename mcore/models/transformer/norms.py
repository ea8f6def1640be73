"""LayerNorm and RMSNorm over the hidden dim, computed by the backend's op table."""

from __future__ import annotations

import torch

from mcore.backend import get_ops
from mcore.models.transformer.build_context import BuildContext
from mcore.models.transformer.model_config import ModelConfig
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

    def forward_with_residual(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x), x)``: for a pre-norm layer, whose residual stream is the norm's input.

        The ``*_with_residual`` op may sum the two uses' gradients of ``x`` inside the norm's backward
        (no separate add). It serves only when the provider of the norm itself provides it too: a
        backend or adaptor that overrides just ``rms_norm`` keeps its kernel for the norm.
        """
        ops = get_ops()
        name = "layer_norm" if self.kind == "LayerNorm" else "rms_norm"
        if ops.provider(f"{name}_with_residual") != ops.provider(name):
            return self(x), x
        if self.kind == "LayerNorm":
            return ops.layer_norm_with_residual(x, self.weight, self.bias, self.eps)
        return ops.rms_norm_with_residual(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.kind}({self.weight.shape[0]}, eps={self.eps})"
