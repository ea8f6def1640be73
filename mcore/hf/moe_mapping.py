"""The mixture-of-experts part of the Llama-style mappings (:mod:`mcore.hf.llama`): ``MixtralForCausalLM``,
``Qwen2MoeForCausalLM``, ``Qwen3MoeForCausalLM``, ``OlmoeForCausalLM``.

Routing. All four score experts with a softmax of the router logits (``x @ gate.weight.T``) and take
the top ``num_experts_per_tok``; Mixtral always renormalizes the chosen probabilities (Megatron's
top-k of the logits, then softmax over k: ``--moe-router-pre-softmax`` off), the others do when
``norm_topk_prob`` (else the probabilities stay as the softmax over all experts gave them:
``--moe-router-pre-softmax``). None drops tokens (mcore's default: no capacity factor).
Qwen2-MoE adds a shared expert scaled by ``sigmoid(x @ shared_expert_gate.weight.T)``
(``--moe-shared-expert-intermediate-size``, ``--moe-shared-expert-gate``). Qwen2/3-MoE may keep dense
MLPs (``intermediate_size``) in ``mlp_only_layers`` or off the ``decoder_sparse_step``: they become a
``--moe-layer-freq`` list.

Tensors of an MoE layer ``i`` (``P`` = ``model.layers.i.block_sparse_moe.`` for Mixtral, else
``model.layers.i.mlp.``; mcore's expert ``linear_fc1`` is ``[E, 2F, H]`` = per expert ``[gate; up]``)::

    decoder.layers.i.mlp.router.weight [E, H]                 P gate.weight
    decoder.layers.i.mlp.experts.linear_fc1.weight[e]         P experts.e.{w1; w3} (Mixtral) / {gate_proj; up_proj}
    decoder.layers.i.mlp.experts.linear_fc2.weight[e]         P experts.e.w2 (Mixtral) / down_proj
    decoder.layers.i.mlp.shared_experts.linear_fc1.weight     P shared_expert.{gate_proj; up_proj} (Qwen2-MoE)
    decoder.layers.i.mlp.shared_experts.linear_fc2.weight     P shared_expert.down_proj
    decoder.layers.i.mlp.shared_experts.gate_weight [1, H]    P shared_expert_gate.weight

The export writes these per-expert Hub names. The import also takes the stacked tensors a live
transformers 5 model holds (``model.layers.i.mlp.experts.gate_up_proj`` ``[E, 2I, H]`` and
``down_proj`` ``[E, H, I]``, ``mlp.gate.weight`` for Mixtral too), as its ``state_dict()`` gives them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mcore.hf.errors import ConversionError
from mcore.hf.tensors import TensorSource
from mcore.models.transformer.model_config import ModelConfig

MIXTRAL_NAMES = {"gate": "w1", "up": "w3", "down": "w2"}
QWEN_NAMES = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


def _prefix(moe: str, i: int) -> str:
    return f"model.layers.{i}." + ("block_sparse_moe." if moe == "mixtral" else "mlp.")


def is_moe_layer(cfg: ModelConfig, i: int) -> bool:
    return cfg.moe is not None and cfg.moe.moe_layers[i]


# -- configs ----------------------------------------------------------------------------------------


def export_problems(moe: str, shared: bool, arch: str, cfg: ModelConfig) -> list[str]:
    """What ``arch`` (an MoE class when ``moe``) cannot hold of ``cfg``'s experts."""
    if not moe:
        return [f"num_experts={cfg.num_experts} ({arch} has no experts)"] if cfg.num_experts else []
    if not cfg.num_experts:
        return [f"num_experts=None ({arch} is a mixture of experts)"]
    problems = []
    for name, fine, why in (
        ("moe_router_score_function", ("softmax",), "a softmax router"),
        ("moe_router_num_groups", (None,), "no group-limited routing"),
        ("moe_router_topk_scaling_factor", (None, 1.0), "no routed scaling factor"),
        ("moe_router_enable_expert_bias", (False,), "no expert bias"),
        ("moe_expert_capacity_factor", (None,), "dropless experts"),
        ("add_bias_linear", (False,), "no expert biases"),
    ):
        if getattr(cfg, name) not in fine:
            problems.append(f"{name}={getattr(cfg, name)!r} ({arch} has {why})")
    if moe == "mixtral" and cfg.moe_router_pre_softmax:
        problems.append(f"moe_router_pre_softmax=True ({arch} renormalizes the top-k probabilities)")
    has_shared = cfg.moe_shared_expert_intermediate_size is not None
    if has_shared != shared or (shared and not cfg.moe_shared_expert_gate):
        problems.append(
            f"moe_shared_expert_intermediate_size={cfg.moe_shared_expert_intermediate_size}, "
            f"moe_shared_expert_gate={cfg.moe_shared_expert_gate} ({arch} has "
            + ("one gated shared expert)" if shared else "no shared expert)")
        )
    if moe != "qwen" and not all(cfg.moe.moe_layers):
        problems.append(f"moe_layer_freq={cfg.moe_layer_freq!r} ({arch} has experts in every layer)")
    return problems


def config_fields(moe: str, name: str, cfg: ModelConfig) -> dict[str, Any]:
    """The expert fields of ``config.json``."""
    m = cfg.moe
    expert_size = m.ffn_hidden_size
    aux = m.aux_loss_coeff("aux_loss")
    if moe == "mixtral":
        return dict(
            num_local_experts=cfg.num_experts,
            num_experts_per_tok=cfg.moe_router_topk,
            intermediate_size=expert_size,
            router_aux_loss_coef=aux,
            router_jitter_noise=cfg.moe_input_jitter_eps or 0.0,
            output_router_logits=False,
        )
    out = dict(
        num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.moe_router_topk,
        norm_topk_prob=not cfg.moe_router_pre_softmax,
        router_aux_loss_coef=aux,
        output_router_logits=False,
    )
    if name == "olmoe":
        return {**out, "intermediate_size": expert_size, "clip_qkv": None}
    dense = [i for i, sparse in enumerate(m.moe_layers) if not sparse]
    out.update(
        moe_intermediate_size=expert_size,
        intermediate_size=cfg.ffn_hidden_size,
        decoder_sparse_step=1,
        mlp_only_layers=dense,
    )
    if cfg.moe_shared_expert_intermediate_size is not None:
        out["shared_expert_intermediate_size"] = cfg.moe_shared_expert_intermediate_size
    return out


def flags_from_hf(moe: str, name: str, hf: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The MoE ``ModelConfig`` fields of an MoE ``config.json`` (refusing what mcore lacks)."""
    experts = hf.get("num_local_experts") or hf.get("num_experts")
    layers = hf["num_hidden_layers"]
    if name == "olmoe" and hf.get("clip_qkv") is not None:
        raise ConversionError(f"{where}: clip_qkv={hf['clip_qkv']}: mcore does not clamp q, k and v")
    flags: dict[str, Any] = dict(
        num_experts=experts,
        moe_router_topk=hf.get("num_experts_per_tok", 2),
        moe_router_pre_softmax=False if moe == "mixtral" else not hf.get("norm_topk_prob", False),
        moe_router_load_balancing_type=("aux_loss",),
        moe_aux_loss_coeff=(float(hf.get("router_aux_loss_coef", 0.0)),),
    )
    if moe == "mixtral":
        flags["moe_input_jitter_eps"] = float(hf.get("router_jitter_noise") or 0.0) or None
        return {**flags, "ffn_hidden_size": hf["intermediate_size"]}
    if name == "olmoe":
        return {**flags, "ffn_hidden_size": hf["intermediate_size"]}
    step, dense = hf.get("decoder_sparse_step", 1) or 1, set(hf.get("mlp_only_layers") or ())
    sparse = tuple(int(i not in dense and (i + 1) % step == 0) for i in range(layers))
    flags.update(
        moe_ffn_hidden_size=hf["moe_intermediate_size"],
        ffn_hidden_size=hf["intermediate_size"],
        moe_layer_freq=1 if all(sparse) else "[" + ",".join(map(str, sparse)) + "]",  # as Megatron spells it
    )
    if hf.get("shared_expert_intermediate_size"):
        flags.update(
            moe_shared_expert_intermediate_size=hf["shared_expert_intermediate_size"],
            moe_shared_expert_gate=True,
        )
    return flags


# -- tensors ----------------------------------------------------------------------------------------


def mlp_to_hf(moe: str, src: TensorSource, cfg: ModelConfig, i: int, out: dict[str, torch.Tensor]) -> None:
    """MoE layer ``i``'s router, experts (per-expert Hub names) and shared expert."""
    p, hp = f"decoder.layers.{i}.mlp.", _prefix(moe, i)
    names = MIXTRAL_NAMES if moe == "mixtral" else QWEN_NAMES
    out[hp + "gate.weight"] = src.get(p + "router.weight")
    fc1, fc2 = src.get(p + "experts.linear_fc1.weight"), src.get(p + "experts.linear_fc2.weight")
    for e in range(fc1.shape[0]):
        gate, up = fc1[e].chunk(2, dim=0)
        out[hp + f"experts.{e}.{names['gate']}.weight"] = gate
        out[hp + f"experts.{e}.{names['up']}.weight"] = up
        out[hp + f"experts.{e}.{names['down']}.weight"] = fc2[e]
    if cfg.moe_shared_expert_intermediate_size is not None:
        gate, up = src.get(p + "shared_experts.linear_fc1.weight").chunk(2, dim=0)
        out[hp + "shared_expert.gate_proj.weight"], out[hp + "shared_expert.up_proj.weight"] = gate, up
        out[hp + "shared_expert.down_proj.weight"] = src.get(p + "shared_experts.linear_fc2.weight")
        out[hp + "shared_expert_gate.weight"] = src.get(p + "shared_experts.gate_weight")


def _experts_from_hf(
    moe: str, src: TensorSource, cfg: ModelConfig, i: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fc1 [E, 2F, H], fc2 [E, H, F])`` from per-expert names or transformers 5's stacked tensors."""
    hp, fused = _prefix(moe, i), f"model.layers.{i}.mlp.experts."
    if fused + "gate_up_proj" in src.state:
        return src.get(fused + "gate_up_proj"), src.get(fused + "down_proj")
    names = MIXTRAL_NAMES if moe == "mixtral" else QWEN_NAMES
    fc1, fc2 = [], []
    for e in range(cfg.num_experts):
        x = hp + f"experts.{e}."
        fc1.append(torch.cat([src.get(x + f"{names['gate']}.weight"), src.get(x + f"{names['up']}.weight")]))
        fc2.append(src.get(x + f"{names['down']}.weight"))
    return torch.stack(fc1), torch.stack(fc2)


def mlp_from_hf(moe: str, src: TensorSource, cfg: ModelConfig, i: int, out: dict[str, torch.Tensor]) -> None:
    """The mcore tensors of MoE layer ``i``'s router, experts and shared expert."""
    p, hp = f"decoder.layers.{i}.mlp.", _prefix(moe, i)
    router = hp + "gate.weight"
    if router not in src.state:  # transformers 5 renames Mixtral's block_sparse_moe.gate in memory
        router = f"model.layers.{i}.mlp.gate.weight"
    out[p + "router.weight"] = src.get(router)
    out[p + "experts.linear_fc1.weight"], out[p + "experts.linear_fc2.weight"] = _experts_from_hf(
        moe, src, cfg, i
    )
    if cfg.moe_shared_expert_intermediate_size is not None:
        s = hp + "shared_expert."
        out[p + "shared_experts.linear_fc1.weight"] = torch.cat(
            [src.get(s + "gate_proj.weight"), src.get(s + "up_proj.weight")]
        )
        out[p + "shared_experts.linear_fc2.weight"] = src.get(s + "down_proj.weight")
        out[p + "shared_experts.gate_weight"] = src.get(hp + "shared_expert_gate.weight")


def expected_moe_shapes(cfg: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    """Logical name -> shape of MoE layer ``i``'s MLP tensors (no biases: the HF classes have none)."""
    p, m = f"decoder.layers.{i}.mlp.", cfg.moe
    e, h, f = cfg.num_experts, cfg.hidden_size, m.ffn_hidden_size
    shapes = {
        p + "router.weight": (e, h),
        p + "experts.linear_fc1.weight": (e, 2 * f if m.gated else f, h),
        p + "experts.linear_fc2.weight": (e, h, f),
    }
    if cfg.moe_router_enable_expert_bias:
        shapes[p + "router.expert_bias"] = (e,)
    s = cfg.moe_shared_expert_intermediate_size
    if s is not None:
        shapes[p + "shared_experts.linear_fc1.weight"] = (2 * s if m.gated else s, h)
        shapes[p + "shared_experts.linear_fc2.weight"] = (h, s)
        if cfg.moe_shared_expert_gate:
            shapes[p + "shared_experts.gate_weight"] = (1, h)
    return shapes
