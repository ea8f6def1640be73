"""Multi-token prediction modules (DeepSeek-V3 sec. 2.2; megatron-core's ``MultiTokenPredictionBlock``).

Depth ``k = 1..D`` (``--mtp-num-layers D``) predicts the token ``k + 1`` places ahead. With ``h^0``
the decoder's output (after its final norm, ``[s, b, h]``; ``[s/p, b, h]`` with SP) and ``t^k`` the
input tokens shifted left ``k`` places (the last ``k`` positions filled with 0)::

    x   = eh_proj([enorm(embed(t^k)) ; hnorm(h^{k-1})])      [s, b, 2h] -> [s, b, h]
    h^k = final_layernorm(mtp_model_layer(x))                  a transformer layer of the model's spec
    L_k = sum_i m^k_i CE(output_layer(h^k)_i, y_{i+k}) / sum_i m^k_i

``m^k`` is the loss mask shifted left ``k`` places (0 past the end), ``y`` the labels. The embedding
and the output layer are the model's (shared). The losses are not added to the model's output:
``(mtp_loss_scaling_factor / D) * L_k`` joins the backward through
:func:`~mcore.models.transformer.moe.aux_losses.attach_loss` with the main loss's backward scale
(``aux_loss_backward_scale``, set by the pipeline schedule), Megatron's ``MTPLossAutoScaler``; the
training loop logs ``mtp_k loss`` (:func:`mtp_step_logs`).

Parameter names (megatron-core's): ``mtp.layers.{k-1}.enorm.weight``, ``.hnorm.weight``,
``.eh_proj.weight [h/p, 2h]`` (column-parallel, output gathered), ``.mtp_model_layer.*`` (as a decoder
layer's), ``.final_layernorm.weight``. The inner layer is built as the model's last decoder layer
(MoE where that one is: its router's logs join that layer's).
"""

from __future__ import annotations

import torch

from mcore.models.transformer.build_context import BuildContext
from mcore.models.transformer.model_config import ModelConfig
from mcore.models.transformer.moe.aux_losses import attach_loss
from mcore.models.transformer.norms import Norm
from mcore.models.transformer.spec import build_module
from mcore.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from mcore.tensor_parallel.layers import ColumnParallelLinear
from mcore.tensor_parallel.mappings import (
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from mcore.tensor_parallel.sharding import init_method_normal


def shift_left(x: torch.Tensor, fill: int | float = 0) -> torch.Tensor:
    """``[b, s]`` -> ``[b, s]`` shifted one place left along ``s``, the last column ``fill`` (Megatron's
    ``roll_tensor(shifts=-1)``)."""
    return torch.cat((x[:, 1:], torch.full_like(x[:, :1], fill)), dim=1)


class MultiTokenPredictionLayer(torch.nn.Module):
    """One depth: ``h^k`` from ``h^{k-1}`` and the shifted tokens' embeddings (module docstring)."""

    def __init__(self, config: ModelConfig, ctx: BuildContext, layer_spec, depth: int):
        super().__init__()
        h = config.hidden_size
        self.ctx = ctx
        self.enorm = Norm(config, ctx)
        self.hnorm = Norm(config, ctx)
        self.eh_proj = ColumnParallelLinear(
            2 * h,
            h,
            tp_group=ctx.tp_group,
            bias=False,
            gather_output=False,
            sequence_parallel=ctx.sequence_parallel,
            init_method=init_method_normal(config.init_method_std),
            gradient_accumulation_fusion=config.gradient_accumulation_fusion,
            params_dtype=ctx.params_dtype,
            device=ctx.device,
        )
        # built as the last decoder layer (Megatron: the MTP layer takes the last layer's spec)
        self.mtp_model_layer = build_module(layer_spec, config, ctx, layer_number=config.num_layers)
        self.final_layernorm = Norm(config, ctx)
        self.depth = depth

    def forward(
        self,
        hidden_states: torch.Tensor,
        embedded: torch.Tensor,
        attention_mask: torch.Tensor | None,
        rotary_freqs: torch.Tensor | None,
    ) -> torch.Tensor:
        """``h^{k-1}`` and ``embed(t^k)`` (both ``[s, b, h]``, ``[s/p, b, h]`` with SP) -> ``h^k``."""
        x = torch.cat((self.enorm(embedded), self.hnorm(hidden_states)), dim=-1)
        x, _ = self.eh_proj(x)  # [s, b, h/p]
        x = gather_from_tensor_model_parallel_region(x, self.ctx.tp_group)  # [s, b, h]
        if self.ctx.sequence_parallel:
            x = scatter_to_sequence_parallel_region(x, self.ctx.tp_group)
        x = self.mtp_model_layer(x, attention_mask, rotary_freqs)
        return self.final_layernorm(x)


class MultiTokenPredictionBlock(torch.nn.Module):
    """The ``D`` depths (``layers``) and their losses; on the last pipeline stage.

    ``aux_loss_backward_scale``: the gradient the scaled MTP losses get (the pipeline schedule sets
    the main loss's backward scale, 1 outside it). ``step_losses``: the sum over this step's
    micro-batches of each depth's ``L_k`` (detached; read and reset by :func:`mtp_step_logs`).
    """

    def __init__(self, config: ModelConfig, ctx: BuildContext, layer_spec):
        super().__init__()
        self.num_layers = config.mtp_num_layers
        self.scaling = config.mtp_loss_scaling_factor / config.mtp_num_layers
        self.tp_group = ctx.tp_group
        self.layers = torch.nn.ModuleList(
            MultiTokenPredictionLayer(config, ctx, layer_spec, k) for k in range(1, self.num_layers + 1)
        )
        self.aux_loss_backward_scale = 1.0
        self.step_losses: torch.Tensor | None = None

    def forward(
        self,
        hidden_states: torch.Tensor,
        tokens: torch.Tensor,
        labels: torch.Tensor,
        loss_mask: torch.Tensor | None,
        embedding,
        output_logits,
        attention_mask: torch.Tensor | None = None,
        rotary_freqs: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``hidden_states`` (the decoder's output) returned unchanged, with the depths' scaled losses
        attached to its backward.

        Args:
            tokens, labels: ``[b, s]``; loss_mask: ``[b, s]`` (None: every position).
            embedding: ``tokens [b, s] -> [s, b, h]`` (the model's embedding).
            output_logits: ``[s, b, h] -> [s, b, Vp/p]`` (the model's output layer).
        """
        mask = torch.ones_like(labels, dtype=torch.float32) if loss_mask is None else loss_mask.float()
        h = hidden_states
        losses = []
        for layer in self.layers:
            tokens, labels, mask = shift_left(tokens), shift_left(labels), shift_left(mask)
            h = layer(h, embedding(tokens), attention_mask, rotary_freqs)
            logits = output_logits(h)
            per_token = vocab_parallel_cross_entropy(
                logits, labels.transpose(0, 1).contiguous(), self.tp_group
            )
            loss = (per_token.transpose(0, 1) * mask).sum() / mask.sum().clamp(min=1.0)
            losses.append(loss.detach())
            hidden_states = attach_loss(hidden_states, self.scaling * loss, self.aux_loss_backward_scale)
        if self.training and torch.is_grad_enabled():
            step = torch.stack(losses).float()
            self.step_losses = step if self.step_losses is None else self.step_losses + step
        return hidden_states


def find_mtp_blocks(model_chunks) -> list[MultiTokenPredictionBlock]:
    """The MTP blocks of ``model_chunks`` (wrapped or not)."""
    return [m for chunk in model_chunks for m in chunk.modules() if isinstance(m, MultiTokenPredictionBlock)]


def mtp_step_logs(
    model_chunks, groups, num_microbatches: int, num_layers: int, device
) -> dict[str, torch.Tensor]:
    """``{"mtp_k loss": mean over the step's micro-batches and the data-parallel ranks}`` on the last
    pipeline stage (``{}`` elsewhere), Megatron's names; resets the blocks' sums. Every rank calls
    it once per training step (it runs collectives over dp x cp and pp)."""
    import torch.distributed as dist

    losses = torch.zeros(num_layers, device=device)
    for block in find_mtp_blocks(model_chunks):
        if block.step_losses is not None:
            losses += block.step_losses.to(device)
            block.step_losses = None
    losses /= num_microbatches
    dp_cp = getattr(groups, "dp_cp", None)
    if dp_cp is not None and dist.get_world_size(dp_cp) > 1:
        dist.all_reduce(losses, group=dp_cp)
        losses /= dist.get_world_size(dp_cp)
    if groups.pp_size > 1:
        dist.all_reduce(losses, group=groups.pp)
    if not groups.is_last_stage:
        return {}
    return {f"mtp_{k + 1} loss": losses[k] for k in range(num_layers)}
