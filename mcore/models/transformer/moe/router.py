"""The top-k router (Megatron's ``TopKRouter``): which experts each token goes to, with what weight.

``logits = x @ weight.T`` [T, E] in the input's dtype (Megatron's default; ``--moe-router-dtype
fp32``/``fp64`` computes it in that dtype), then fp32 at least; ``weight`` [E, H] an fp32 parameter (replicated; with sequence parallelism each TP rank routes its own tokens, so its
gradient is summed over TP like a norm weight's). The op table's ``moe_topk_routing`` turns the
logits into ``probs`` [T, E] (zero where not routed) and ``routing_map`` [T, E] bool: softmax or
sigmoid scores, pre-softmax or not, group-limited top-k, the scaling factor and the expert bias
(which chooses experts and never scales them). Then, in order: the capacity limit
(:mod:`~mcore.models.transformer.moe.capacity`), the load-balancing losses attached to ``probs``
and the z-loss attached to the logits (:mod:`~mcore.models.transformer.moe.aux_losses`).

State besides the weight:

* ``expert_bias`` [E] fp32, a persistent buffer (checkpointed) with ``--moe-router-enable-expert-bias``;
* ``local_tokens_per_expert`` [E] fp32: tokens routed here since the last bias update (training
  forwards with grad only: a recomputed forward runs without grad and is not counted twice);
* ``global_tokens_per_expert`` / ``ga_steps``: ``global_aux_loss``'s running counts over the step;
* ``stats``: detached loss values and tokens-per-expert of the step, for the logs
  (:mod:`~mcore.models.transformer.moe.training`).
"""

from __future__ import annotations

import torch

from mcore.backend import get_ops
from mcore.models.transformer.moe import aux_losses
from mcore.models.transformer.moe.capacity import drop_tokens
from mcore.models.transformer.moe.config import MoEConfig
from mcore.models.transformer.moe.groups import MoEGroups, group_size
from mcore.tensor_parallel.sharding import NormalInit, ParamLayout, make_parameter

ROUTER_GEMM_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}
"""``--moe-router-dtype`` -> the router GEMM's dtype (unset: the input's, as in Megatron)."""


def _all_reduce(t: torch.Tensor, group) -> torch.Tensor:
    if group is not None and group_size(group) > 1:
        t = t.clone()
        torch.distributed.all_reduce(t, group=group)
    return t


class TopKRouter(torch.nn.Module):
    """Top-k routing of ``[s, b, H]`` tokens over ``moe.num_experts`` experts (see module doc).

    Args:
        moe: the resolved MoE settings.
        groups: the MoE process groups (token counts of the losses and the bias).
        layer_number: 1-based global layer number (for the per-layer logs).
        sequence_parallel: each TP rank routes its own sequence shard.
        device: where parameters and buffers live.
    """

    def __init__(self, moe: MoEConfig, groups: MoEGroups, layer_number: int, sequence_parallel: bool, device):
        super().__init__()
        self.moe = moe
        self.groups = groups
        self.layer_number = layer_number
        self.topk = moe.topk
        e = moe.num_experts
        self.weight = make_parameter(
            ParamLayout(
                (e, moe.hidden_size),
                init=NormalInit(moe.init_method_std),
                sequence_parallel=sequence_parallel,
            ),
            1,
            dtype=torch.float32,
            device=device,
        )
        self.weight.sequence_parallel = sequence_parallel
        zeros = lambda: torch.zeros(e, dtype=torch.float32, device=device)  # noqa: E731
        if moe.moe_router_enable_expert_bias:
            self.register_buffer("expert_bias", zeros())
            self.register_buffer("local_tokens_per_expert", zeros(), persistent=False)
        else:
            self.expert_bias = self.local_tokens_per_expert = None
        if moe.aux_loss_coeff("global_aux_loss") > 0:
            self.register_buffer("global_tokens_per_expert", zeros(), persistent=False)
            self.ga_steps = 0
        self.aux_loss_backward_scale = 1.0
        """Gradient the losses get in backward (set by the schedule: loss scale x CP / micro-batches)."""
        self.stats: dict[str, torch.Tensor] = {}
        """Detached per-step sums for the logs: loss values (by Megatron's names) and ``tokens_per_expert``;
        each made at its first forward and then added to in place and zeroed after each step."""

    # -- forward ---------------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` [s, b, H] -> ``probs`` [T, E] fp32 and ``routing_map`` [T, E] bool, T = s*b (row ``i``
        is token ``(i // b, i % b)``)."""
        seq, batch = x.shape[0], x.shape[1]
        training = self.training and torch.is_grad_enabled()
        if self.training and self.moe.moe_input_jitter_eps:  # (a recomputation replays the RNG: same noise)
            eps = self.moe.moe_input_jitter_eps
            x = x * torch.empty_like(x).uniform_(1.0 - eps, 1.0 + eps)
        # Megatron's default runs the router's GEMM in the input's dtype (--moe-router-dtype fp32/fp64
        # asks for more); the routing math after it is fp32 at least either way.
        dtype = ROUTER_GEMM_DTYPES.get(self.moe.moe_router_dtype, x.dtype)
        logits = torch.nn.functional.linear(x.reshape(-1, x.shape[-1]).to(dtype), self.weight.to(dtype))
        if logits.dtype not in (torch.float32, torch.float64):
            logits = logits.float()
        if training and self.moe.moe_z_loss_coeff:
            logits = self._apply_z_loss(logits)
        probs, routing_map = get_ops().moe_topk_routing(
            logits,
            self.topk,
            score_function=self.moe.moe_router_score_function,
            pre_softmax=self.moe.moe_router_pre_softmax,
            num_groups=self.moe.moe_router_num_groups,
            group_topk=self.moe.moe_router_group_topk,
            scaling_factor=self.moe.moe_router_topk_scaling_factor,
            expert_bias=self.expert_bias,
        )
        probs = probs if probs.dtype == torch.float64 else probs.float()
        if self.moe.moe_expert_capacity_factor is not None:
            probs, routing_map = drop_tokens(
                probs,
                routing_map,
                self.topk,
                self.moe.moe_expert_capacity_factor,
                self.moe.moe_token_drop_policy,
                self.moe.moe_pad_expert_input_to_capacity,
            )
        if training and self.moe.aux_losses:
            probs = self._apply_aux_losses(probs, logits, seq, batch)
        if training:
            with torch.no_grad():
                counts = routing_map.sum(dim=0).float()
                self._add_stat("tokens_per_expert", counts)
                if self.local_tokens_per_expert is not None:
                    self.local_tokens_per_expert += counts
        return probs, routing_map

    def _apply_z_loss(self, logits: torch.Tensor) -> torch.Tensor:
        coeff = self.moe.moe_z_loss_coeff / group_size(self.groups.tp_cp)
        loss = aux_losses.z_loss(logits, coeff)
        self._add_stat("z_loss", loss.detach() / coeff)
        return aux_losses.attach_loss(logits, loss, self.aux_loss_backward_scale)

    def _apply_aux_losses(self, probs, logits, seq: int, batch: int) -> torch.Tensor:
        """Attach each enabled load-balancing loss to ``probs`` (see :mod:`aux_losses`)."""
        routing_map, scores = aux_losses.scores_for_aux_loss(
            logits, self.topk, self.moe.moe_router_score_function
        )
        k, tokens, e = self.topk, scores.shape[0], self.moe.num_experts
        coeff = self.moe.aux_loss_coeff("aux_loss")
        if coeff:
            counts = _all_reduce(routing_map.sum(dim=0).float(), self.groups.tp_cp)
            total = tokens * group_size(self.groups.tp_cp)
            loss = aux_losses.switch_load_balancing_loss(scores, counts, total, k, e, coeff)
            probs = self._attach(probs, loss, coeff, "load_balancing_loss")
        coeff = self.moe.aux_loss_coeff("seq_aux_loss")
        if coeff:  # each sequence its own batch: fold the batch into the expert axis
            seq_scores = scores.reshape(seq, -1)
            counts = _all_reduce(routing_map.reshape(seq, -1).sum(dim=0).float(), self.groups.tp_cp)
            total = seq * group_size(self.groups.tp_cp)
            loss = aux_losses.switch_load_balancing_loss(seq_scores, counts, total, k, e, coeff) / batch
            probs = self._attach(probs, loss, coeff, "seq_load_balancing_loss")
        coeff = self.moe.aux_loss_coeff("global_aux_loss")
        if coeff:
            counts = _all_reduce(routing_map.sum(dim=0).float(), self.groups.tp_dp_cp)
            self.global_tokens_per_expert += counts
            self.ga_steps += 1
            total = tokens * group_size(self.groups.tp_dp_cp)
            loss = aux_losses.switch_load_balancing_loss(
                scores, self.global_tokens_per_expert / self.ga_steps, total, k, e, coeff
            )
            probs = self._attach(probs, loss, coeff, "global_load_balancing_loss")
        return probs

    def _attach(self, probs, loss, coeff: float, name: str) -> torch.Tensor:
        self._add_stat(name, loss.detach() / coeff)
        return aux_losses.attach_loss(probs, loss, self.aux_loss_backward_scale)

    def _add_stat(self, name: str, value: torch.Tensor) -> None:
        # Added in place into a tensor that lives across steps (zeroed by reset_step_state): a captured
        # device graph of the layer (layer_graphs) replays the add at that tensor's address.
        value = value.detach().float()
        if name in self.stats:
            self.stats[name].add_(value)
        else:
            self.stats[name] = value.clone()

    # -- device-graph capture (mcore.models.transformer.layer_graphs) ---------------------------------

    def snapshot_step_state(self) -> dict[str, torch.Tensor]:
        """Copies of what a training forward adds to (the log sums, the expert-bias counts): a graph
        capture's warm-up passes run the forward on a sample and must leave no count behind."""
        state = {f"stat:{name}": t.clone() for name, t in self.stats.items()}
        if self.local_tokens_per_expert is not None:
            state["local_tokens_per_expert"] = self.local_tokens_per_expert.clone()
        return state

    def restore_step_state(self, state: dict[str, torch.Tensor]) -> None:
        """Put back :meth:`snapshot_step_state`'s values, in place (sums it did not have: zero)."""
        for name, t in self.stats.items():
            kept = state.get(f"stat:{name}")
            if kept is None:
                t.zero_()
            else:
                t.copy_(kept)
        if self.local_tokens_per_expert is not None:
            self.local_tokens_per_expert.copy_(state["local_tokens_per_expert"])

    # -- once per step (after gradient accumulation) ------------------------------------------------

    @torch.no_grad()
    def update_expert_bias(self) -> None:
        """``bias += rate * sign(mean - count)`` with the step's token counts summed over TP x DP x CP
        (every rank then holds the same bias); the counts restart."""
        if self.expert_bias is None:
            return
        counts = _all_reduce(self.local_tokens_per_expert, self.groups.tp_dp_cp)
        self.expert_bias += torch.sign(counts.mean() - counts) * self.moe.moe_router_bias_update_rate
        self.local_tokens_per_expert.zero_()

    def reset_step_state(self) -> None:
        """Forget the step's ``global_aux_loss`` counts and log stats (after they were read)."""
        if hasattr(self, "global_tokens_per_expert"):
            self.global_tokens_per_expert.zero_()
            self.ga_steps = 0
        for t in self.stats.values():
            t.zero_()
