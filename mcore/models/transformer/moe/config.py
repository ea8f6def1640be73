"""Mixture-of-experts flags (Megatron-LM's ``--num-experts``, ``--moe-*``) and their checks.

The flags are fields of :class:`MoEFlags`, which :class:`~mcore.models.transformer.model_config.ModelConfig`
inherits: they sit flat on the model config (``config.num_experts``), as on Megatron's
``TransformerConfig``, so the command line, ``--use-checkpoint-args`` and the Hugging Face
converters see them like every other model flag. ``ModelConfig.moe`` gives the resolved view,
:class:`MoEConfig` (``None`` for a dense model), which the MoE modules take.

Semantics (Megatron's): ``--moe-layer-freq N`` makes every N-th layer (layers 1, N+1, 2N+1, ...;
Megatron's ``i % N == 0`` on 0-based indices) an MoE layer; a list ``[1,0,1,...]`` (or Megatron's
python string ``"([0]*3+[1]*29)"``: DeepSeek's first-k-dense) gives one entry per layer.
``--moe-router-load-balancing-type`` takes one type or several, with one ``--moe-aux-loss-coeff``
each.
"""

from __future__ import annotations

import ast
import dataclasses
from dataclasses import dataclass

from mcore.config.fields import ConfigError, check, flag

SCORE_FUNCTIONS = ("softmax", "sigmoid")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")
AUX_LOSS_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss")
DROP_POLICIES = ("probs", "position")
DISPATCHER_TYPES = ("allgather", "alltoall", "flex")
ROUTER_DTYPES = ("fp32", "fp64")


@dataclass(frozen=True, kw_only=True)
class MoEFlags:
    """Mixture-of-experts flags (Megatron's ``--num-experts`` and ``--moe-*``; see docs/moe.md)."""

    num_experts: int | None = flag(None, "Routed experts per MoE layer (None: a dense model).")
    moe_ffn_hidden_size: int | None = flag(None, "Each expert's FFN hidden size (default --ffn-hidden-size).")
    moe_router_topk: int = flag(2, "Experts each token is routed to.")
    moe_router_score_function: str = flag(
        "softmax", "Router score function (DeepSeek-V3: sigmoid).", choices=SCORE_FUNCTIONS
    )
    moe_router_pre_softmax: bool = flag(
        False, "softmax over all experts before top-k (default: top-k of the logits, then softmax over k)."
    )
    moe_router_topk_scaling_factor: float | None = flag(
        None, "Multiply the routing probabilities by this (DeepSeek's routed_scaling_factor)."
    )
    moe_router_num_groups: int | None = flag(
        None, "Group-limited routing: experts in this many contiguous groups (DeepSeek's n_group)."
    )
    moe_router_group_topk: int | None = flag(
        None, "Group-limited routing: tokens choose experts from this many groups (topk_group)."
    )
    moe_router_dtype: str | None = flag(
        None, "dtype of the routing math (the router weight is always fp32).", choices=ROUTER_DTYPES
    )
    moe_router_load_balancing_type: tuple[str, ...] = flag(
        ("aux_loss",),
        "Load-balancing loss(es): aux_loss (per micro-batch), seq_aux_loss (per sequence), "
        "global_aux_loss (over the global batch), none; several combine, one coefficient each.",
        choices=LOAD_BALANCING_TYPES,
        nargs="+",
    )
    moe_aux_loss_coeff: tuple[float, ...] = flag(
        (0.0,), "Coefficient of each load-balancing loss (0: off).", nargs="+"
    )
    moe_z_loss_coeff: float | None = flag(None, "Router z-loss coefficient (ST-MoE).")
    moe_input_jitter_eps: float | None = flag(
        None, "Multiply the router input by uniform noise in [1-eps, 1+eps] while training."
    )
    moe_router_enable_expert_bias: bool = flag(
        False,
        "Aux-loss-free balancing: a per-expert bias added to the scores for choosing experts only, "
        "updated once per step by --moe-router-bias-update-rate * sign(mean count - count).",
    )
    moe_router_bias_update_rate: float = flag(1e-3, "Step of the expert-bias update.")
    moe_expert_capacity_factor: float | None = flag(
        None, "Expert capacity = ceil(tokens * topk / experts * factor); extra tokens drop (None: dropless)."
    )
    moe_pad_expert_input_to_capacity: bool = flag(
        False, "With a capacity factor: every expert receives exactly its capacity (padded)."
    )
    moe_token_drop_policy: str = flag(
        "probs", "Which tokens an expert over capacity keeps: highest probs or first positions.",
        choices=DROP_POLICIES,
    )  # fmt: skip
    moe_token_dispatcher_type: str = flag(
        "allgather",
        "Token dispatch over expert parallelism: allgather or alltoall (flex, DeepEP's, runs alltoall).",
        choices=DISPATCHER_TYPES,
    )
    moe_grouped_gemm: bool = flag(
        False, "Accepted for Megatron scripts: the experts always run one grouped GEMM (the op table's)."
    )
    moe_shared_expert_intermediate_size: int | None = flag(
        None, "FFN size of the shared expert(s) every token passes through (None: none)."
    )
    moe_shared_expert_gate: bool = flag(False, "Scale the shared experts' output by sigmoid(x @ gate).")
    moe_layer_freq: int | str | tuple[int, ...] = flag(
        1,
        "MoE layer pattern: N (every N-th layer from the first) or a list, e.g. '([0]*3+[1]*29)' or 0 1 1 1.",
        metavar="FREQ",
        nargs="+",
    )
    moe_per_layer_logging: bool = flag(
        False, "Log the load-balancing losses and tokens-per-expert max/mean of every MoE layer."
    )


def parse_layer_freq(value, num_layers: int) -> tuple[bool, ...]:
    """Which of ``num_layers`` layers are MoE layers, from ``--moe-layer-freq``.

    ``value``: an int N (layer ``i`` (0-based) is MoE when ``i % N == 0``), a sequence of 0/1, or
    their string forms (``"2"``, ``"[1,0,1,0]"``, ``"([0]*3+[1]*29)"``: list literals, ``*``, ``+``).
    """
    if isinstance(value, tuple | list) and all(isinstance(v, str) for v in value):  # from the command line
        value = value[0] if len(value) == 1 else "[" + ",".join(value) + "]"
    text = value
    if isinstance(value, str):
        try:
            value = _eval_list_expr(ast.parse(value.strip(), mode="eval").body)
        except (SyntaxError, ValueError) as err:
            raise ConfigError(
                f"moe_layer_freq={text!r} (--moe-layer-freq): not an int or a list of 0/1 ({err})"
            ) from None
    if isinstance(value, int) and not isinstance(value, bool):
        check(value >= 1, f"moe_layer_freq={value} (--moe-layer-freq) must be >= 1")
        return tuple(i % value == 0 for i in range(num_layers))
    pattern = tuple(value)
    check(
        all(v in (0, 1) for v in pattern),
        f"moe_layer_freq={text!r} (--moe-layer-freq): list entries must be 0 (dense) or 1 (MoE)",
    )
    check(
        len(pattern) == num_layers,
        f"moe_layer_freq={text!r} (--moe-layer-freq) has {len(pattern)} entries; "
        f"num_layers={num_layers} needs one per layer",
    )
    return tuple(bool(v) for v in pattern)


def _eval_list_expr(node):
    """Evaluate ints, list/tuple literals, ``*`` and ``+`` (Megatron's ``--moe-layer-freq`` strings)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.List | ast.Tuple):
        return [_eval_list_expr(e) for e in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult | ast.Add):
        left, right = _eval_list_expr(node.left), _eval_list_expr(node.right)
        return left * right if isinstance(node.op, ast.Mult) else left + right
    raise ValueError(f"unsupported expression {ast.unparse(node)!r}")


@dataclass(frozen=True)
class MoEConfig:
    """The resolved MoE settings the MoE modules take (``ModelConfig.moe``).

    Attributes beyond the flags' values: ``ffn_hidden_size`` (each expert's, resolved),
    ``moe_layers`` (one bool per global layer), ``aux_losses`` (``(type, coeff)`` pairs with a
    nonzero coefficient), ``hidden_size``, ``gated`` (SwiGLU experts), ``add_bias_linear``,
    ``init_method_std``, ``num_layers``.
    """

    flags: MoEFlags
    hidden_size: int
    num_layers: int
    ffn_hidden_size: int
    moe_layers: tuple[bool, ...]
    aux_losses: tuple[tuple[str, float], ...]
    gated: bool
    init_method_std: float

    def __getattr__(self, name: str):  # the flags by name: moe.moe_router_topk, moe.num_experts
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(object.__getattribute__(self, "flags"), name)

    @property
    def topk(self) -> int:
        return self.flags.moe_router_topk

    def aux_loss_coeff(self, kind: str) -> float:
        """The coefficient of load-balancing loss ``kind`` (0.0 when not enabled)."""
        return dict(self.aux_losses).get(kind, 0.0)

    @property
    def dispatcher(self) -> str:
        """``allgather`` or ``alltoall`` (``flex`` runs the all-to-all dispatcher)."""
        kind = self.flags.moe_token_dispatcher_type
        return "alltoall" if kind == "flex" else kind


def moe_view(config) -> MoEConfig | None:
    """``config.moe``: the resolved :class:`MoEConfig` of a model config, None for a dense one."""
    if config.num_experts is None:
        return None
    names = [f.name for f in dataclasses.fields(MoEFlags)]
    flags = MoEFlags(**{n: getattr(config, n) for n in names})
    types, coeffs = flags.moe_router_load_balancing_type, flags.moe_aux_loss_coeff
    return MoEConfig(
        flags=flags,
        hidden_size=config.hidden_size,
        num_layers=config.num_layers,
        ffn_hidden_size=flags.moe_ffn_hidden_size or config.ffn_hidden_size,
        moe_layers=parse_layer_freq(flags.moe_layer_freq, config.num_layers),
        aux_losses=tuple((t, float(c)) for t, c in zip(types, coeffs, strict=True) if t != "none" and c),
        gated=config.swiglu,
        init_method_std=config.init_method_std,
    )


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_moe(config) -> None:
    """Validate the MoE flags of a model config (``ModelConfig.__post_init__`` calls this); every
    error names the flags and values. Normalises list-valued flags to tuples."""
    for name in ("moe_router_load_balancing_type", "moe_aux_loss_coeff"):
        value = getattr(config, name)
        if isinstance(value, str | int | float):
            object.__setattr__(config, name, (value,))
    e = config.num_experts
    if e is None:
        moe_modules = sorted({"moe", "moe_act"} & set(config.recompute_modules or ()))
        check(
            not moe_modules, f"--recompute-modules {' '.join(moe_modules)} needs an MoE model (--num-experts)"
        )
        return
    check(isinstance(e, int) and e >= 1, f"num_experts={e} (--num-experts) must be a positive integer")
    k = config.moe_router_topk
    check(k >= 1, f"moe_router_topk={k} (--moe-router-topk) must be >= 1")
    check(k <= e, f"moe_router_topk={k} exceeds num_experts={e} (--moe-router-topk, --num-experts)")
    for name in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
        value = getattr(config, name)
        check(value is None or value >= 1, f"{name}={value} ({_flag(name)}) must be positive")
    _check_groups(config, e, k)
    types, coeffs = config.moe_router_load_balancing_type, config.moe_aux_loss_coeff
    check(
        len(types) == len(coeffs) or len(coeffs) == 1,
        f"moe_router_load_balancing_type={list(types)} has {len(types)} entries but "
        f"moe_aux_loss_coeff={list(coeffs)} has {len(coeffs)} (--moe-aux-loss-coeff: one per type)",
    )
    if len(coeffs) == 1 and len(types) > 1:
        object.__setattr__(config, "moe_aux_loss_coeff", tuple(coeffs) * len(types))
    for t in types:
        check(
            t in LOAD_BALANCING_TYPES,
            f"moe_router_load_balancing_type={t!r} is unknown; choose from {', '.join(LOAD_BALANCING_TYPES)}",
        )
    check(len(set(types)) == len(types), f"moe_router_load_balancing_type={list(types)} repeats a type")
    check(all(c >= 0 for c in coeffs), f"moe_aux_loss_coeff={list(coeffs)} must be >= 0")
    z = config.moe_z_loss_coeff
    check(z is None or z >= 0, f"moe_z_loss_coeff={z} (--moe-z-loss-coeff) must be >= 0")
    jitter = config.moe_input_jitter_eps
    check(jitter is None or 0 <= jitter < 1, f"moe_input_jitter_eps={jitter} must be in [0, 1)")
    cf = config.moe_expert_capacity_factor
    check(cf is None or cf > 0, f"moe_expert_capacity_factor={cf} (--moe-expert-capacity-factor) must be > 0")
    check(
        not config.moe_pad_expert_input_to_capacity or cf is not None,
        "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor",
    )
    check(
        config.moe_router_score_function in SCORE_FUNCTIONS,
        f"moe_router_score_function={config.moe_router_score_function!r} is unknown; "
        f"choose from {', '.join(SCORE_FUNCTIONS)}",
    )
    check(
        not (config.moe_router_pre_softmax and config.moe_router_score_function != "softmax"),
        "--moe-router-pre-softmax applies to --moe-router-score-function softmax only "
        f"(got {config.moe_router_score_function})",
    )
    check(
        not (k == 1 and config.moe_router_score_function == "softmax" and not config.moe_router_pre_softmax),
        "moe_router_topk=1 with --moe-router-score-function softmax needs --moe-router-pre-softmax "
        "(a softmax over one selected logit is 1 and gives the router no gradient)",
    )
    check(
        not config.moe_router_enable_expert_bias or config.moe_router_score_function == "sigmoid",
        "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid (Megatron's rule: "
        f"the bias picks experts among sigmoid scores; got {config.moe_router_score_function})",
    )
    check(
        config.moe_router_bias_update_rate >= 0,
        f"moe_router_bias_update_rate={config.moe_router_bias_update_rate} must be >= 0",
    )
    parse_layer_freq(config.moe_layer_freq, config.num_layers)


def _check_groups(config, e: int, k: int) -> None:
    groups, group_topk = config.moe_router_num_groups, config.moe_router_group_topk
    if groups is None and group_topk is None:
        return
    check(
        groups is not None and group_topk is not None,
        f"group-limited routing needs both --moe-router-num-groups and --moe-router-group-topk "
        f"(got moe_router_num_groups={groups}, moe_router_group_topk={group_topk})",
    )
    check(
        groups >= 1 and group_topk >= 1,
        f"moe_router_num_groups={groups}, group_topk={group_topk} must be >= 1",
    )
    check(
        e % groups == 0,
        f"num_experts={e} is not divisible by moe_router_num_groups={groups} (--moe-router-num-groups)",
    )
    check(
        group_topk <= groups,
        f"moe_router_group_topk={group_topk} exceeds moe_router_num_groups={groups}",
    )
    check(
        k % group_topk == 0 and k // group_topk <= e // groups,
        f"moe_router_topk={k} must be a multiple of moe_router_group_topk={group_topk}, with "
        f"topk/group_topk={k // group_topk} <= the {e // groups} experts of a group "
        f"(num_experts={e} in moe_router_num_groups={groups})",
    )


def refuse_moe(config, family: str) -> None:
    """Refuse MoE flags on a family whose layers have no MoE slot (BERT, T5), naming the flag."""
    check(
        config.num_experts is None,
        f"num_experts={config.num_experts} (--num-experts): mixture-of-experts layers are built for GPT "
        f"models; {family} has none",
    )


def check_moe_parallel(config, expert_model_parallel_size: int, expert_tensor_parallel_size: int) -> None:
    """The MoE part of the layout check: experts split over EP, expert FFNs over ETP."""
    if config.num_experts is None:
        return
    ep, etp = expert_model_parallel_size, expert_tensor_parallel_size
    check(
        config.num_experts % ep == 0,
        f"num_experts={config.num_experts} is not divisible by expert_model_parallel_size={ep}",
    )
    ffn = config.moe_ffn_hidden_size or config.ffn_hidden_size
    check(
        ffn % etp == 0,
        f"moe_ffn_hidden_size={ffn} is not divisible by expert_tensor_parallel_size={etp}",
    )


__all__ = [
    "AUX_LOSS_TYPES",
    "MoEConfig",
    "MoEFlags",
    "check_moe",
    "check_moe_parallel",
    "moe_view",
    "parse_layer_freq",
    "refuse_moe",
]
