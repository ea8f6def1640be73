"""Compiling transformer layers with ``torch.compile`` (capability ``"compile_layers"``).

The training loop compiles each transformer layer, not the whole model: a layer is the unit that
repeats, so one compiled graph serves every layer (the layers share their code and shapes), the
pipeline and activation-checkpointing boundaries stay outside compiled code, and compile time stays
that of one layer. Usage from the core, asking for the capability and never for a vendor::

    backend = current_backend()
    if config.compile_layers and "compile_layers" in backend.capabilities():
        for layer in model.decoder.layers:
            backend.compile_layer(layer)

Compilation is in place (``nn.Module.compile``): the module object, its parameters and its
``state_dict`` keys are unchanged (no ``_orig_mod.`` prefix), so checkpoints, DDP hooks, the
distributed optimizer and the RNG tracker see the same module. Under compilation the table's
norm/rotary/SwiGLU/GeLU/dropout-add ops trace their reference definitions, which Inductor fuses
with the surrounding residual adds and casts; attention stays SDPA/flash.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

_MIN_RECOMPILE_LIMIT = 64


def _raise_recompile_limit() -> None:
    # Every layer instance is a separate guard set for dynamo; a deep model must not hit the default
    # limit of 8 and silently fall back to eager for the remaining layers.
    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(config, name) and getattr(config, name) < _MIN_RECOMPILE_LIMIT:
            setattr(config, name, _MIN_RECOMPILE_LIMIT)
    if hasattr(config, "accumulated_recompile_limit"):
        config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 4 * _MIN_RECOMPILE_LIMIT)
    elif hasattr(config, "accumulated_cache_size_limit"):
        config.accumulated_cache_size_limit = max(
            config.accumulated_cache_size_limit, 4 * _MIN_RECOMPILE_LIMIT
        )


def compile_layer(
    module: torch.nn.Module,
    *,
    mode: str | None = None,
    dynamic: bool | None = False,
    fullgraph: bool = False,
    backend: str = "inductor",
) -> torch.nn.Module:
    """Compile ``module`` in place with ``torch.compile`` and return it.

    Args:
        mode: ``torch.compile`` mode (``None`` = default; ``"max-autotune-no-cudagraphs"`` tunes
            matmuls longer). CUDA-graph modes are not advised per layer (activations are freed
            across layers by the autograd graph, which CUDA graphs pin).
        dynamic: ``False`` (default) specialises on the training shapes, which never change;
            ``None`` lets dynamo decide after a shape change.
        fullgraph: raise on a graph break instead of running the rest eagerly.
        backend: the ``torch.compile`` backend.
    """
    _raise_recompile_limit()
    module.compile(mode=mode, dynamic=dynamic, fullgraph=fullgraph, backend=backend)
    return module


def compile_layers(layers: Iterable[torch.nn.Module], **kwargs) -> list[torch.nn.Module]:
    """:func:`compile_layer` on each module of ``layers`` (same keyword arguments)."""
    return [compile_layer(layer, **kwargs) for layer in layers]
