"""Persistent buffers in checkpoints: state that is not a parameter but belongs to the weights, such as
the MoE router's ``expert_bias`` [E] (aux-loss-free balancing, moved by the token counts every step).

Stored with ``kind = "buffer"`` under the logical name (global layer numbers, e.g.
``decoder.layers.3.mlp.router.expert_bias``), whole (such buffers are replicated over TP, DP and EP),
written once per pipeline stage (dp index 0, tp rank 0) in the stage's model file. A checkpoint without
a buffer (written before it existed, or by a model without it) leaves the fresh value, said once.
"""

from __future__ import annotations

import logging

import torch

from mcore.checkpoint.geometry import full_placement

BUFFER = "buffer"
BUFFER_SUFFIXES = (".expert_bias",)
"""Logical names a converter's whole-model state dict stores as buffers, not parameters
(:func:`mcore.checkpoint.logical.save_logical_model_checkpoint`)."""


def persistent_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``local name -> tensor`` of the module's persistent buffers (in its ``state_dict``, not a
    parameter, not a module's extra state)."""
    params = {name for name, _ in module.named_parameters()}
    return {
        name: value
        for name, value in module.state_dict(keep_vars=True).items()
        if name not in params and isinstance(value, torch.Tensor) and not name.endswith("_extra_state")
    }


def logical_buffer_name(module: torch.nn.Module, local_name: str) -> str:
    logical = getattr(module, "_logical_name", None)
    return logical(local_name) if callable(logical) else local_name


def logical_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``logical name -> tensor`` of the module's persistent buffers (what a save writes)."""
    return {logical_buffer_name(module, n): v for n, v in persistent_buffers(module).items()}


@torch.no_grad()
def load_buffers(reader, module: torch.nn.Module) -> None:
    """Fill the module's persistent buffers from the checkpoint where it has them (same shape)."""
    missing = []
    for local_name, value in persistent_buffers(module).items():
        name = logical_buffer_name(module, local_name)
        if not reader.has(name, BUFFER) or reader.global_shape(name, BUFFER) != tuple(value.shape):
            missing.append(name)
            continue
        host = torch.empty(tuple(value.shape), dtype=value.dtype)
        reader.fill(name, BUFFER, full_placement(value.shape), host.view(-1))
        value.copy_(host)
    if missing and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0):
        logging.getLogger("mcore.checkpoint").info(
            f"checkpoint {reader.dir}: no stored value for {len(missing)} buffers (e.g. {missing[0]}); "
            "they keep their initial values"
        )
