"""The transformer block: a stack of layers (:mod:`mcore.models.transformer.layer`) and the final norm,
with full activation recomputation and the layers' device graphs.

Parameter names in the block: ``layers.{i}.*`` with ``i`` local to this chunk, and
``final_layernorm.*`` on the last chunk.
"""

from __future__ import annotations

import torch

from mcore.models.transformer.build_context import BuildContext
from mcore.models.transformer.layer_graphs import LayerGraphs
from mcore.models.transformer.model_config import ModelConfig
from mcore.models.transformer.norms import Norm
from mcore.models.transformer.spec import ModuleSpec, build_module
from mcore.tensor_parallel.recompute import checkpoint


class TransformerBlock(torch.nn.Module):
    """``num_layers`` consecutive layers (global numbers ``layer_offset+1 ..``) and the final norm.

    Activation recomputation (``--recompute-granularity full``):

    * ``uniform``: the layers are cut into chunks of ``recompute_num_layers``; only each chunk's
      input is kept and the chunk is recomputed in backward;
    * ``block``: the first ``recompute_num_layers`` layers of this chunk are recomputed one by one,
      the rest keep their activations.

    ``selective`` recomputes parts of every layer, see ``--recompute-modules`` (module docstring).
    """

    def __init__(
        self,
        config: ModelConfig,
        ctx: BuildContext,
        layer_spec: ModuleSpec,
        *,
        num_layers: int,
        layer_offset: int = 0,
        post_process: bool = True,
    ):
        super().__init__()
        self.recompute_method = config.recompute_method if config.recompute_granularity == "full" else None
        self.recompute_num_layers = config.recompute_num_layers
        self.fp32_residual = config.fp32_residual_connection
        self.params_dtype = ctx.params_dtype
        self.layers = torch.nn.ModuleList(
            build_module(layer_spec, config, ctx, layer_number=layer_offset + i + 1)
            for i in range(num_layers)
        )
        self.final_layernorm = Norm(config, ctx) if post_process else None
        self.layer_graphs: LayerGraphs | None = None
        """Device graphs of the layers (``--cuda-graph-impl local``), attached by the training setup."""

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        rotary_freqs: torch.Tensor | None = None,
        inference_context=None,
    ) -> torch.Tensor:
        if inference_context is not None:  # generation with a key/value cache (no recomputation)
            for layer in self.layers:
                hidden_states = layer(
                    hidden_states, attention_mask, rotary_freqs, inference_context=inference_context
                )
        elif self.recompute_method is not None and self.training and torch.is_grad_enabled():
            hidden_states = self._recomputed_forward(hidden_states, attention_mask, rotary_freqs)
        elif self.layer_graphs is not None and self.layer_graphs.applies(
            hidden_states, (attention_mask, rotary_freqs)
        ):
            hidden_states = self.layer_graphs(hidden_states, (attention_mask, rotary_freqs))
        else:
            for layer in self.layers:
                hidden_states = layer(hidden_states, attention_mask, rotary_freqs)
        if self.final_layernorm is not None:
            hidden_states = self.final_layernorm(hidden_states)
            if self.fp32_residual:
                hidden_states = hidden_states.to(self.params_dtype)
        return hidden_states

    def _recomputed_forward(self, hidden_states, attention_mask, rotary_freqs) -> torch.Tensor:
        n, k = len(self.layers), self.recompute_num_layers
        if self.recompute_method == "uniform":
            for start in range(0, n, k):
                run = self._run_layers(start, min(start + k, n))
                hidden_states = checkpoint(run, hidden_states, attention_mask, rotary_freqs)
            return hidden_states
        for i, layer in enumerate(self.layers):  # block
            if i < k:
                hidden_states = checkpoint(layer, hidden_states, attention_mask, rotary_freqs)
            else:
                hidden_states = layer(hidden_states, attention_mask, rotary_freqs)
        return hidden_states

    def _run_layers(self, start: int, end: int):
        def run(hidden_states, attention_mask, rotary_freqs):
            for layer in self.layers[start:end]:
                hidden_states = layer(hidden_states, attention_mask, rotary_freqs)
            return hidden_states

        return run
