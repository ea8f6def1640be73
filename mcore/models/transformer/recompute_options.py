"""Activation recomputation's options (Megatron's ``--recompute-*`` flags): the names each flag takes
and :func:`check_recompute`, which :class:`~mcore.models.transformer.model_config.ModelConfig` runs
on construction. What each option recomputes is in :mod:`mcore.models.transformer.layer` (selective)
and :mod:`mcore.models.transformer.block` (full)."""

from __future__ import annotations

from mcore.config.fields import check

RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")
RECOMPUTE_MODULES = ("core_attn", "layernorm", "mlp_act", "mlp", "moe_act", "moe", "mla_up_proj")
"""``--recompute-modules`` names (with ``--recompute-granularity selective``; default ``core_attn``).

Megatron-core's meanings: ``core_attn`` and ``mlp`` recompute the core attention / the whole dense
MLP with a normal checkpoint; ``layernorm`` recomputes the input and pre-MLP norm outputs with the
output-discarding checkpoint. ``mlp_act`` (not a Megatron name: Megatron's ``moe_act`` does this for
MoE experts only) recomputes the dense MLP's activation (GeLU / SwiGLU) output, fc2's input, the
same way. ``moe`` checkpoints a whole MoE layer (router, dispatch, experts, combine); ``moe_act``
recomputes the routed experts' activation output (:mod:`mcore.models.transformer.moe.experts`).
``mla_up_proj`` recomputes multi-latent attention's up projections and RoPE (its query, key and value)
in backward (:mod:`mcore.models.transformer.mla.attention`).
"""
MEGATRON_ONLY_RECOMPUTE_MODULES = {
    "shared_experts": "the shared experts are recomputed with 'moe'",
    "gdn_norm_out": "mcore has no gated-delta-net layers",
    "gdp_in_proj": "mcore has no gated-delta-product layers",
    "gdp_qkv": "mcore has no gated-delta-product layers",
    "mhc": "mcore has no hyper-connections",
}


def check_recompute(config) -> None:
    """Check ``--recompute-granularity``, ``--recompute-method``, ``--recompute-num-layers`` and
    ``--recompute-modules`` together; raise :class:`~mcore.config.fields.ConfigError` naming the values."""
    gran, method, num = config.recompute_granularity, config.recompute_method, config.recompute_num_layers
    check(
        gran in (None, *RECOMPUTE_GRANULARITIES),
        f"recompute_granularity={gran!r} is unknown; choose full or selective",
    )
    check(
        method in (None, *RECOMPUTE_METHODS),
        f"recompute_method={method!r} is unknown; choose uniform or block",
    )
    if gran == "full":
        check(
            method is not None,
            "recompute_granularity='full' needs --recompute-method uniform or block",
        )
        check(
            num is not None and num >= 1,
            f"recompute_granularity='full' needs --recompute-num-layers >= 1 (got {num})",
        )
    else:
        check(
            method is None,
            f"recompute_method={method!r} applies only to recompute_granularity='full' (got {gran!r})",
        )
        check(
            num is None,
            f"recompute_num_layers={num} applies only to recompute_granularity='full' (got {gran!r})",
        )
    _check_recompute_modules(config)


def _check_recompute_modules(config) -> None:
    modules, gran = config.recompute_modules, config.recompute_granularity
    if modules is None:
        return
    check(
        not isinstance(modules, str) and all(isinstance(m, str) for m in modules),
        f"recompute_modules={modules!r} (--recompute-modules) must be a list of module names",
    )
    shown = list(modules)
    check(
        gran == "selective",
        f"recompute_modules={shown} (--recompute-modules) applies only to "
        f"recompute_granularity='selective' (got {gran!r}); add --recompute-granularity selective",
    )
    for name in modules:
        if name in MEGATRON_ONLY_RECOMPUTE_MODULES:
            check(
                False,
                f"recompute_modules={shown} (--recompute-modules): {name!r} is a Megatron-LM module "
                f"mcore does not have ({MEGATRON_ONLY_RECOMPUTE_MODULES[name]}); "
                f"choose from {', '.join(RECOMPUTE_MODULES)}",
            )
        check(
            name in RECOMPUTE_MODULES,
            f"recompute_modules={shown} (--recompute-modules): {name!r} is unknown; "
            f"choose from {', '.join(RECOMPUTE_MODULES)}",
        )
    check(
        not {"mlp", "mlp_act"} <= set(modules),
        f"recompute_modules={shown} (--recompute-modules): 'mlp' already recomputes the whole MLP, "
        "activation included; give 'mlp' or 'mlp_act', not both",
    )
