"""What a training step does for mixture-of-experts models after its forward and backward passes
(Megatron's ``finalize_model_grads`` bias update and ``track_moe_metrics``).

* The expert-bias update, once per step after gradient accumulation: each router's token counts of
  the step, summed over TP x DP x CP, move its bias by ``rate * sign(mean - count)``.
* The logged values, as 0-d device tensors joined to the step's logs (so they reach the iteration
  line, TensorBoard and ``--log-json`` as the ``lm loss`` does):

  - ``load_balancing_loss`` / ``seq_load_balancing_loss`` / ``global_load_balancing_loss`` and
    ``z_loss`` (Megatron's names): the losses without their coefficients, per micro-batch, summed
    over the TP x CP ranks that each hold part of a sequence (z-loss: averaged), averaged over the
    MoE layers (and over data-parallel ranks by the log reduction);
  - ``tokens_per_expert max/mean``: per MoE layer, the most loaded expert's token count over the
    mean count (1.0 is perfect balance; the counts summed over TP x DP x CP), averaged over layers;
  - with ``--moe-per-layer-logging``, each of these per layer: ``<name> layer <L>`` (global 1-based).

Pipeline stages each hold some MoE layers: the per-layer values are summed over the pipeline ranks
(every stage joins, MoE layers or not) and logged by the last stage.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mcore.distributed.groups import ProcessGroups
from mcore.models.transformer.moe.router import TopKRouter

LOSS_NAMES = {
    "aux_loss": "load_balancing_loss",
    "seq_aux_loss": "seq_load_balancing_loss",
    "global_aux_loss": "global_load_balancing_loss",
}


def find_routers(model_chunks) -> list[TopKRouter]:
    return [m for chunk in model_chunks for m in chunk.modules() if isinstance(m, TopKRouter)]


def _all_reduce(t: torch.Tensor, group) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)


_ROW_INDEX: dict = {}


def _row_index(rows: tuple[int, ...], device) -> torch.Tensor:
    """The MoE layers' rows as a device index, made once: a host list copied to the device each step
    would wait for the device's whole queue (a pageable host-to-device copy synchronises), and a
    boolean mask would too (its ``nonzero``), stalling the host at every step's end."""
    key = (rows, str(device))
    if key not in _ROW_INDEX:
        _ROW_INDEX[key] = torch.tensor(rows, dtype=torch.long, device=device)
    return _ROW_INDEX[key]


def finish_moe_step(
    routers: list[TopKRouter], moe, groups: ProcessGroups, num_microbatches: int, device
) -> dict[str, torch.Tensor]:
    """Update the expert biases and return the step's MoE log values (on the last pipeline stage;
    ``{}`` elsewhere). ``moe``: the model's :class:`~mcore.models.transformer.moe.config.MoEConfig`.
    Every rank calls it every training step (it runs collectives)."""
    for router in routers:
        router.update_expert_bias()
    names = [LOSS_NAMES[kind] for kind, _ in moe.aux_losses] + (["z_loss"] if moe.moe_z_loss_coeff else [])
    layers, e = moe.num_layers, moe.num_experts
    losses = torch.zeros(layers, len(names), device=device)
    counts = torch.zeros(layers, e, device=device)
    for router in routers:
        row = router.layer_number - 1
        for j, name in enumerate(names):
            if name in router.stats:
                losses[row, j] = router.stats[name].to(device) / num_microbatches
        if "tokens_per_expert" in router.stats:
            counts[row] = router.stats["tokens_per_expert"].to(device)
        router.reset_step_state()
    tp_cp = getattr(groups, "tp_cp", None)
    _all_reduce(losses, tp_cp)
    if "z_loss" in names and tp_cp is not None:
        losses[:, names.index("z_loss")] /= dist.get_world_size(tp_cp)
    _all_reduce(counts, getattr(groups, "tp_dp_cp", None))
    if groups.pp_size > 1:
        both = torch.cat([losses, counts], dim=1)
        _all_reduce(both, groups.pp)
        losses, counts = both[:, : len(names)], both[:, len(names) :]
    if not groups.is_last_stage or not any(moe.moe_layers):
        return {}
    rows = [row for row, is_moe in enumerate(moe.moe_layers) if is_moe]
    moe_rows = _row_index(tuple(rows), device)
    imbalance = counts.max(dim=1).values / counts.mean(dim=1).clamp(min=1e-20)
    moe_losses = losses.index_select(0, moe_rows)
    logs = {name: moe_losses[:, j].mean() for j, name in enumerate(names)}
    logs["tokens_per_expert max/mean"] = imbalance.index_select(0, moe_rows).mean()
    if moe.moe_per_layer_logging:
        for row in rows:
            for j, name in enumerate(names):
                logs[f"{name} layer {row + 1}"] = losses[row, j]
            logs[f"tokens_per_expert max/mean layer {row + 1}"] = imbalance[row]
    return logs
