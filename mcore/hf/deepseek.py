"""mcore's GPT model with multi-latent attention <-> ``DeepseekV3ForCausalLM`` and ``DeepseekV2ForCausalLM``.

What the classes are in mcore's flags (see docs/deepseek.md):

* attention: ``--multi-latent-attention`` with ``q_lora_rank`` (None: DeepSeek-V2-Lite's plain
  ``q_proj``), ``kv_lora_rank``, ``qk_nope_head_dim`` (``--qk-head-dim``), ``qk_rope_head_dim``
  (``--qk-pos-emb-head-dim``), ``v_head_dim``; ``rope_interleave`` (V3) / the complex RoPE (V2) are the
  pair-wise RoPE mcore's MLA applies; ``rope_parameters`` ``default`` -> ``--rope-type rope``, ``yarn``
  -> ``--rope-type yarn`` with ``factor`` (``--rotary-scaling-factor``),
  ``original_max_position_embeddings``, ``beta_fast``, ``beta_slow``, ``mscale``, ``mscale_all_dim``;
* experts: the first ``first_k_dense_replace`` layers dense (``intermediate_size``), the others MoE
  (``--moe-layer-freq`` list) with ``n_routed_experts`` / ``n_shared_experts`` (one shared expert of
  ``moe_intermediate_size * n_shared_experts``, ungated), ``num_experts_per_tok``,
  ``routed_scaling_factor`` (``--moe-router-topk-scaling-factor``);
  V3: sigmoid scores, ``e_score_correction_bias`` (``--moe-router-enable-expert-bias``), group-limited
  (``n_group``, ``topk_group``; the group score is the sum of its top 2 scores, so ``num_experts_per_tok
  / topk_group`` must be 2), renormalized top-k (``norm_topk_prob``);
  V2: softmax over all experts then top-k, not renormalized (``--moe-router-pre-softmax``), ``greedy`` or
  ``group_limited_greedy`` (group score = its max: ``num_experts_per_tok / topk_group`` must be 1).

Tensors of layer ``i`` (``P = model.layers.i.``; MoE layers as :mod:`mcore.hf.moe_mapping` with the shared
expert under ``mlp.shared_experts.``)::

    decoder.layers.i.self_attention.linear_q_down_proj.weight   P self_attn.q_a_proj.weight
    decoder.layers.i.self_attention.q_layernorm.weight          P self_attn.q_a_layernorm.weight
    decoder.layers.i.self_attention.linear_q_up_proj.weight     P self_attn.q_b_proj.weight
    decoder.layers.i.self_attention.linear_q_proj.weight        P self_attn.q_proj.weight (no q_lora_rank)
    decoder.layers.i.self_attention.linear_kv_down_proj.weight  P self_attn.kv_a_proj_with_mqa.weight
    decoder.layers.i.self_attention.kv_layernorm.weight         P self_attn.kv_a_layernorm.weight
    decoder.layers.i.self_attention.linear_kv_up_proj.weight    P self_attn.kv_b_proj.weight
    decoder.layers.i.self_attention.linear_proj.weight          P self_attn.o_proj.weight
    decoder.layers.i.mlp.router.expert_bias                     P mlp.gate.e_score_correction_bias (V3)
    decoder.layers.i.mlp.shared_experts.linear_fc1.weight       P mlp.shared_experts.{gate_proj; up_proj}.weight
    decoder.layers.i.mlp.shared_experts.linear_fc2.weight       P mlp.shared_experts.down_proj.weight

Multi-token prediction (DeepSeek-V3): the Hub's checkpoints carry MTP depth ``k`` as the extra layer
``M = model.layers.{num_hidden_layers + k}.`` (``num_nextn_predict_layers``, transformers'
``num_mtp_layers``), which transformers' model does not run. Imported only when asked
(``mcore-import-hf --mtp-num-layers D``, as Megatron-Bridge's and MindSpeed-LLM's converters take the
MTP depth), exported only when asked (``mcore-export-hf --mtp-num-layers D``); otherwise the import
skips them with a note and the export writes ``num_mtp_layers`` 0::

    mtp.layers.k.enorm.weight / hnorm.weight / eh_proj.weight   M enorm.weight / hnorm.weight / eh_proj.weight
    mtp.layers.k.final_layernorm.weight                         M shared_head.norm.weight
    mtp.layers.k.mtp_model_layer.*                              M the decoder layer's names (above)
    (the shared word embedding, output layer)                   M embed_tokens.weight, M shared_head.head.weight

``eh_proj`` takes ``[enorm(embedding); hnorm(hidden)]`` in both (megatron-core's and vLLM's order).
The depth's ``embed_tokens`` / ``shared_head.head`` are copies of the model's: the import refuses
them when they differ (mcore's MTP shares the embedding and output layer).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import torch

from mcore.hf.deepseek_mtp import HF_WORD_KEY, check_mtp_import, mtp_from_hf, mtp_to_hf, split_mtp_layers
from mcore.hf.errors import ConversionError
from mcore.hf.family import HfFamily
from mcore.hf.gpt_state import (
    ARCHITECTURES,
    DEEPSEEK_V2,
    DEEPSEEK_V3,
    check_family_exportable,
    common_config_fields,
    convert_from_hf,
    convert_to_hf,
)
from mcore.hf.parity import check_logit_parity
from mcore.hf.tensors import TensorSource, zeros
from mcore.models.transformer.model_config import ModelConfig

MLA_NAMES = {
    "linear_q_down_proj": "q_a_proj",
    "q_layernorm": "q_a_layernorm",
    "linear_q_up_proj": "q_b_proj",
    "linear_q_proj": "q_proj",
    "linear_kv_down_proj": "kv_a_proj_with_mqa",
    "kv_layernorm": "kv_a_layernorm",
    "linear_kv_up_proj": "kv_b_proj",
    "linear_proj": "o_proj",
}
ROPE_FIELDS = ("rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast",
               "beta_slow", "mscale", "mscale_all_dim", "truncate", "attention_factor")  # fmt: skip


# -- configs ----------------------------------------------------------------------------------------


def _dense_first(cfg: ModelConfig) -> int | None:
    """``k`` when the layers are k dense then MoE (DeepSeek's ``first_k_dense_replace``), else None."""
    layers = cfg.moe.moe_layers
    k = layers.index(True) if True in layers else len(layers)
    return k if all(layers[k:]) else None


def check_exportable(name: str, cfg: ModelConfig) -> str:
    """Refuse what the DeepSeek class ``name`` cannot represent (every problem named at once)."""
    arch, p = ARCHITECTURES[name], []
    if not cfg.multi_latent_attention:
        p.append(f"multi_latent_attention=False ({arch} has multi-latent attention)")
    for field, value, why in (
        ("normalization", "RMSNorm", "RMSNorm"),
        ("swiglu", True, "a SwiGLU MLP"),
        ("add_bias_linear", False, "no linear biases"),
        ("add_qkv_bias", False, "no attention biases"),
        ("qk_layernorm", True, "the latent norms q_a_layernorm / kv_a_layernorm (--qk-layernorm)"),
    ):
        if getattr(cfg, field, value) != value:
            p.append(f"{field}={getattr(cfg, field)!r} ({arch} has {why})")
    if (
        cfg.multi_latent_attention
        and cfg.mla_rope_type == "yarn"
        and cfg.mscale_all_dim == 0
        and cfg.mscale != 1
    ):
        p.append(
            f"mscale={cfg.mscale} with mscale_all_dim=0 ({arch}'s YaRN ignores mscale without mscale_all_dim)"
        )
    if not cfg.num_experts:
        p.append(f"num_experts=None ({arch} is a mixture of experts)")
        return check_family_exportable(cfg, name, p)
    p += _router_problems(name, cfg)
    shared, f = cfg.moe_shared_expert_intermediate_size, cfg.moe.ffn_hidden_size
    if shared is None or shared % f or cfg.moe_shared_expert_gate:
        p.append(
            f"moe_shared_expert_intermediate_size={shared}, moe_shared_expert_gate={cfg.moe_shared_expert_gate} "
            f"({arch} has ungated shared experts of n x moe_ffn_hidden_size={f})"
        )
    if _dense_first(cfg) is None:
        p.append(f"moe_layer_freq={cfg.moe_layer_freq!r} ({arch} has dense layers first, then MoE layers)")
    if cfg.moe_expert_capacity_factor is not None:
        p.append(f"moe_expert_capacity_factor={cfg.moe_expert_capacity_factor} ({arch} drops no tokens)")
    return check_family_exportable(cfg, name, p)


def _router_problems(name: str, cfg: ModelConfig) -> list[str]:
    arch, topk, groups, chosen = (
        ARCHITECTURES[name],
        cfg.moe_router_topk,
        cfg.moe_router_num_groups,
        cfg.moe_router_group_topk,
    )
    want = ("sigmoid", 2) if name == DEEPSEEK_V3 else ("softmax", 1)
    p = []
    if cfg.moe_router_score_function != want[0]:
        p.append(
            f"moe_router_score_function={cfg.moe_router_score_function!r} ({arch} scores with {want[0]})"
        )
    if name == DEEPSEEK_V2 and not cfg.moe_router_pre_softmax:
        p.append(f"moe_router_pre_softmax=False ({arch} takes the top-k of a softmax over all experts)")
    if name == DEEPSEEK_V2 and cfg.moe_router_enable_expert_bias:
        p.append(f"moe_router_enable_expert_bias=True ({arch} has no expert bias)")
    if groups is not None and topk // chosen != want[1]:
        p.append(
            f"moe_router_topk={topk}, moe_router_group_topk={chosen} ({arch} scores a group by its top "
            f"{want[1]}: topk / group_topk must be {want[1]})"
        )
    return p


def _rope_parameters(cfg: ModelConfig) -> dict[str, Any]:
    if cfg.mla_rope_type == "rope":
        return {"rope_type": "default", "rope_theta": float(cfg.rotary_base)}
    return {
        "rope_type": "yarn",
        "rope_theta": float(cfg.rotary_base),
        "factor": float(cfg.rotary_scaling_factor),
        "original_max_position_embeddings": cfg.original_max_position_embeddings,
        "beta_fast": float(cfg.beta_fast),
        "beta_slow": float(cfg.beta_slow),
        "mscale": float(cfg.mscale),
        "mscale_all_dim": float(cfg.mscale_all_dim),
    }


def hf_config_dict(
    name: str,
    cfg: ModelConfig,
    vocab_size: int,
    *,
    bos_token_id,
    eos_token_id,
    pad_token_id=None,
    dtype="float32",
) -> dict[str, Any]:
    """The ``config.json`` of the DeepSeek class ``name`` equivalent to ``cfg``."""
    check_exportable(name, cfg)
    tokens = dict(bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id)
    m, rope = cfg.moe, _rope_parameters(cfg)
    out = {
        **common_config_fields(cfg, name, vocab_size, **tokens, dtype=dtype),
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_hidden_size,
        "moe_intermediate_size": m.ffn_hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_attention_heads,
        "n_shared_experts": cfg.moe_shared_expert_intermediate_size // m.ffn_hidden_size,
        "n_routed_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.moe_router_topk,
        "routed_scaling_factor": float(cfg.moe_router_topk_scaling_factor or 1.0),
        "n_group": cfg.moe_router_num_groups or 1,
        "topk_group": cfg.moe_router_group_topk or 1,
        "first_k_dense_replace": _dense_first(cfg),
        "kv_lora_rank": cfg.kv_lora_rank,
        "q_lora_rank": cfg.q_lora_rank,
        "qk_rope_head_dim": cfg.qk_pos_emb_head_dim,
        "qk_nope_head_dim": cfg.qk_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings or cfg.seq_length or 4096,
        "rms_norm_eps": cfg.norm_epsilon,
        "rope_parameters": rope,
        "rope_theta": rope["rope_theta"],
        "attention_bias": False,
        "attention_dropout": cfg.attention_dropout,
    }
    if name == DEEPSEEK_V3:
        # the Hub's name (transformers 5 aliases it as num_mtp_layers; vLLM reads this one)
        out.update(
            norm_topk_prob=True, rope_interleave=True, num_nextn_predict_layers=cfg.mtp_num_layers or 0
        )
    else:
        out.update(
            num_experts=cfg.num_experts,
            topk_method="greedy" if cfg.moe_router_num_groups is None else "group_limited_greedy",
            norm_topk_prob=False,
            mlp_bias=False,
        )
    return out


def _rope_flags(hf: Mapping[str, Any], where: str) -> dict[str, Any]:
    """mcore's RoPE flags of ``rope_parameters`` (5.x) / ``rope_scaling`` + ``rope_theta`` (4.x)."""
    params = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return dict(rope_type="rope", rotary_base=theta)
    if kind != "yarn":
        raise ConversionError(
            f"{where}: rope_type={kind!r} is not supported for multi-latent attention; mcore has 'default' "
            "(--rope-type rope) and 'yarn' (--rope-type yarn)"
        )
    for field, fine in (("attention_factor", (None,)), ("truncate", (None, True))):
        if params.get(field) not in fine:
            raise ConversionError(
                f"{where}: rope_parameters {field}={params[field]!r} has no mcore equivalent"
            )
    mscale_all_dim = float(params.get("mscale_all_dim") or 0.0)
    mscale = float(params.get("mscale") or 1.0) if mscale_all_dim else 1.0  # HF ignores mscale alone
    return dict(
        rope_type="yarn",
        rotary_base=theta,
        rotary_scaling_factor=float(params["factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=mscale,
        mscale_all_dim=mscale_all_dim,
    )


def _moe_flags(name: str, hf: Mapping[str, Any], where: str) -> dict[str, Any]:
    layers, k = hf["num_hidden_layers"], hf.get("first_k_dense_replace", 0) or 0
    experts = hf.get("n_routed_experts") or hf.get("num_experts")
    topk, groups, chosen = hf.get("num_experts_per_tok"), hf.get("n_group"), hf.get("topk_group")
    flags: dict[str, Any] = dict(
        num_experts=experts,
        moe_router_topk=topk,
        moe_ffn_hidden_size=hf["moe_intermediate_size"],
        moe_shared_expert_intermediate_size=hf["moe_intermediate_size"] * hf.get("n_shared_experts", 1),
        moe_router_topk_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        moe_layer_freq="[" + ",".join("0" if i < k else "1" for i in range(layers)) + "]",
        moe_aux_loss_coeff=(0.0,),
    )
    if hf.get("moe_layer_freq", 1) not in (1, None):
        raise ConversionError(
            f"{where}: moe_layer_freq={hf['moe_layer_freq']} (mcore maps only 1: every layer after the dense ones)"
        )
    if not hf.get("n_shared_experts"):
        raise ConversionError(
            f"{where}: n_shared_experts={hf.get('n_shared_experts')} (the class always runs its shared experts; give >= 1)"
        )
    if name == DEEPSEEK_V3:
        if not hf.get("norm_topk_prob", True) and topk > 1:
            raise ConversionError(
                f"{where}: norm_topk_prob=False: mcore's sigmoid router renormalizes the top-k"
            )
        if groups and topk // chosen != 2:
            raise ConversionError(
                f"{where}: num_experts_per_tok={topk}, topk_group={chosen}: the group score sums the top 2, mcore's the top num_experts_per_tok/topk_group"
            )
        flags.update(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    else:
        method = hf.get("topk_method", "greedy")
        if method not in ("greedy", "group_limited_greedy"):
            raise ConversionError(
                f"{where}: topk_method={method!r} (mcore maps greedy and group_limited_greedy)"
            )
        if method == "greedy":
            groups = chosen = None
        elif topk // chosen != 1:
            raise ConversionError(
                f"{where}: num_experts_per_tok={topk}, topk_group={chosen}: the group score is its max, mcore's the sum of the top num_experts_per_tok/topk_group"
            )
        flags.update(moe_router_score_function="softmax", moe_router_pre_softmax=True)
    if groups and groups > 1:
        flags.update(moe_router_num_groups=groups, moe_router_group_topk=chosen)
    return flags


def model_config_from_hf(
    name: str, hf: Mapping[str, Any], where: str = "config.json", **overrides: Any
) -> ModelConfig:
    """The mcore :class:`ModelConfig` of a DeepSeek ``config.json`` (refusing what mcore cannot express)."""
    if hf.get("hidden_act", "silu") != "silu":
        raise ConversionError(f"{where}: hidden_act={hf['hidden_act']!r}; mcore's SwiGLU is silu-gated")
    for field in ("attention_bias", "mlp_bias"):
        if hf.get(field):
            raise ConversionError(
                f"{where}: {field}=True (mcore's multi-latent attention and experts have no biases)"
            )
    if name == DEEPSEEK_V3 and hf.get("rope_interleave", True) is False:
        raise ConversionError(
            f"{where}: rope_interleave=False (mcore's MLA rotates DeepSeek's interleaved pairs)"
        )
    positions = hf.get("max_position_embeddings", 4096)
    kwargs = dict(
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        num_attention_heads=hf["num_attention_heads"],
        ffn_hidden_size=hf["intermediate_size"],
        seq_length=positions,
        max_position_embeddings=positions,
        position_embedding_type="rope",
        normalization="RMSNorm",
        norm_epsilon=hf.get("rms_norm_eps", 1e-6),
        swiglu=True,
        disable_bias_linear=True,
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        hidden_dropout=0.0,
        attention_dropout=float(hf.get("attention_dropout", 0.0)),
        init_method_std=hf.get("initializer_range", 0.02),
        multi_latent_attention=True,
        qk_layernorm=True,  # the latent norms (megatron-core's MLA has them with --qk-layernorm)
        q_lora_rank=hf.get("q_lora_rank"),
        kv_lora_rank=hf["kv_lora_rank"],
        qk_head_dim=hf["qk_nope_head_dim"],
        qk_pos_emb_head_dim=hf["qk_rope_head_dim"],
        v_head_dim=hf["v_head_dim"],
        **_rope_flags(hf, where),
        **_moe_flags(name, hf, where),
    )
    kwargs.update(overrides)
    check_mtp_import(name == DEEPSEEK_V3, ARCHITECTURES[name], hf, where, overrides.get("mtp_num_layers"))
    return ModelConfig(**kwargs)


# -- tensors ----------------------------------------------------------------------------------------


def _mla_names(cfg: ModelConfig) -> dict[str, str]:
    skip = (
        ("linear_q_down_proj", "q_layernorm", "linear_q_up_proj")
        if cfg.q_lora_rank is None
        else ("linear_q_proj",)
    )
    return {k: v for k, v in MLA_NAMES.items() if k not in skip}


def _mlp_pairs(cfg: ModelConfig, p: str, hp: str, moe: bool) -> list[tuple[str, str]]:
    """(mcore name, HF name) of the layer's (mcore ``p``, HF ``hp``) non-expert MLP tensors; fc1
    entries are [gate; up] pairs."""
    p, hp = p + "mlp.", hp + "mlp."
    if not moe:
        return [
            (p + "linear_fc1.weight", hp + "{gate,up}_proj.weight"),
            (p + "linear_fc2.weight", hp + "down_proj.weight"),
        ]
    pairs = [(p + "router.weight", hp + "gate.weight")]
    if cfg.moe_router_enable_expert_bias:
        pairs.append((p + "router.expert_bias", hp + "gate.e_score_correction_bias"))
    s = hp + "shared_experts."
    pairs += [
        (p + "shared_experts.linear_fc1.weight", s + "{gate,up}_proj.weight"),
        (p + "shared_experts.linear_fc2.weight", s + "down_proj.weight"),
    ]
    return pairs


def _layer_to_hf(
    name: str, src: TensorSource, cfg: ModelConfig, i: int, out: dict[str, torch.Tensor]
) -> None:
    _layer_tensors_to_hf(
        name, src, cfg, f"decoder.layers.{i}.", f"model.layers.{i}.", cfg.moe.moe_layers[i], out
    )


def _layer_tensors_to_hf(
    name: str, src: TensorSource, cfg: ModelConfig, p: str, hp: str, moe: bool, out: dict[str, torch.Tensor]
) -> None:
    """One transformer layer (mcore names under ``p``, the Hub's under ``hp``)."""
    out[hp + "input_layernorm.weight"] = src.get(p + "input_layernorm.weight")
    out[hp + "post_attention_layernorm.weight"] = src.get(p + "pre_mlp_layernorm.weight")
    for ours, theirs in _mla_names(cfg).items():
        out[hp + f"self_attn.{theirs}.weight"] = src.get(p + f"self_attention.{ours}.weight")
    for ours, theirs in _mlp_pairs(cfg, p, hp, moe):
        t = src.get(ours)
        if "{gate,up}" in theirs:
            gate, up = t.chunk(2, dim=0)
            out[theirs.replace("{gate,up}", "gate")], out[theirs.replace("{gate,up}", "up")] = gate, up
        else:
            out[theirs] = t
    if moe:
        if name == DEEPSEEK_V3 and not cfg.moe_router_enable_expert_bias:  # no bias: a zero one is exact
            out[hp + "mlp.gate.e_score_correction_bias"] = zeros(
                cfg.num_experts, out[hp + "mlp.gate.weight"]
            ).float()
        fc1, fc2 = src.get(p + "mlp.experts.linear_fc1.weight"), src.get(p + "mlp.experts.linear_fc2.weight")
        for e in range(fc1.shape[0]):
            gate, up = fc1[e].chunk(2, dim=0)
            x = hp + f"mlp.experts.{e}."
            out[x + "gate_proj.weight"], out[x + "up_proj.weight"], out[x + "down_proj.weight"] = (
                gate,
                up,
                fc2[e],
            )


def _top_to_hf(src: TensorSource, word: torch.Tensor, out: dict[str, torch.Tensor]) -> None:
    out[HF_WORD_KEY] = word
    out["model.norm.weight"] = src.get("decoder.final_layernorm.weight")


def mcore_to_hf(
    name: str, state: Mapping[str, torch.Tensor], cfg: ModelConfig, vocab_size: int
) -> dict[str, torch.Tensor]:
    """The DeepSeek state dict of an mcore logical state dict; ``cfg.mtp_num_layers`` MTP depths are
    written as the Hub's extra layers (the export passes the ``--mtp-num-layers`` asked for, else None)."""
    check_exportable(name, cfg)
    base = {k: v for k, v in state.items() if not k.startswith("mtp.")}
    out = convert_to_hf(
        base, dataclasses.replace(cfg, mtp_num_layers=None), vocab_size, name,
        functools.partial(_layer_to_hf, name), _top_to_hf,
    )  # fmt: skip
    if cfg.mtp_num_layers:
        mtp_to_hf(state, cfg, out, functools.partial(_layer_tensors_to_hf, name))
    return out


def _layer_from_hf(
    name: str, src: TensorSource, cfg: ModelConfig, i: int, out: dict[str, torch.Tensor]
) -> None:
    _layer_tensors_from_hf(src, cfg, f"decoder.layers.{i}.", f"model.layers.{i}.", cfg.moe.moe_layers[i], out)


def _layer_tensors_from_hf(
    src: TensorSource, cfg: ModelConfig, p: str, hp: str, moe: bool, out: dict[str, torch.Tensor]
) -> None:
    """One transformer layer (the Hub's names under ``hp``, mcore's under ``p``)."""
    out[p + "input_layernorm.weight"] = src.get(hp + "input_layernorm.weight")
    out[p + "pre_mlp_layernorm.weight"] = src.get(hp + "post_attention_layernorm.weight")
    for ours, theirs in _mla_names(cfg).items():
        out[p + f"self_attention.{ours}.weight"] = src.get(hp + f"self_attn.{theirs}.weight")
    for ours, theirs in _mlp_pairs(cfg, p, hp, moe):
        if "{gate,up}" in theirs:
            out[ours] = torch.cat(
                [src.get(theirs.replace("{gate,up}", "gate")), src.get(theirs.replace("{gate,up}", "up"))]
            )
        else:
            out[ours] = src.get(theirs)
    if moe:
        out[p + "mlp.experts.linear_fc1.weight"], out[p + "mlp.experts.linear_fc2.weight"] = _experts_from_hf(
            src, cfg, hp
        )


def _experts_from_hf(src: TensorSource, cfg: ModelConfig, hp: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fc1 [E, 2F, H], fc2 [E, H, F])`` from the Hub's per-expert names or transformers 5's stacked ones."""
    x = hp + "mlp.experts."
    if x + "gate_up_proj" in src.state:
        return src.get(x + "gate_up_proj"), src.get(x + "down_proj")
    fc1 = [
        torch.cat([src.get(x + f"{e}.gate_proj.weight"), src.get(x + f"{e}.up_proj.weight")])
        for e in range(cfg.num_experts)
    ]
    fc2 = [src.get(x + f"{e}.down_proj.weight") for e in range(cfg.num_experts)]
    return torch.stack(fc1), torch.stack(fc2)


def _top_from_hf(src: TensorSource, cfg: ModelConfig, _: int, out: dict[str, torch.Tensor]) -> None:
    out["decoder.final_layernorm.weight"] = src.get("model.norm.weight")


def hf_to_mcore(
    name: str, hf_state: Mapping[str, torch.Tensor], cfg: ModelConfig, padded_vocab_size: int
) -> dict[str, torch.Tensor]:
    """The mcore logical state of a DeepSeek state dict, with ``cfg.mtp_num_layers`` MTP depths from
    the Hub's extra layers (``model.layers.{L..}`` past ``num_hidden_layers``); extra layers not asked
    for are skipped with a note."""
    check_exportable(name, cfg)
    kept, mtp = split_mtp_layers(hf_state, cfg.num_layers, cfg.mtp_num_layers or 0)
    out = convert_from_hf(
        kept, dataclasses.replace(cfg, mtp_num_layers=None), padded_vocab_size, name, HF_WORD_KEY,
        functools.partial(_layer_from_hf, name), _top_from_hf,
    )  # fmt: skip
    if mtp:
        out.update(mtp_from_hf(mtp, hf_state, cfg, out, _layer_tensors_from_hf))
    return out


def family(name: str) -> HfFamily:
    """The DeepSeek class ``name`` in the table of :mod:`mcore.hf.families`."""
    return HfFamily(
        name=name,
        architecture=ARCHITECTURES[name],
        hf_word_key=HF_WORD_KEY,
        check_exportable=functools.partial(check_exportable, name),
        hf_config_dict=functools.partial(hf_config_dict, name),
        mcore_to_hf=functools.partial(mcore_to_hf, name),
        model_config_from_hf=functools.partial(model_config_from_hf, name),
        hf_to_mcore=functools.partial(hf_to_mcore, name),
        check_parity=check_logit_parity,
    )


FAMILIES = (family(DEEPSEEK_V3), family(DEEPSEEK_V2))
"""DeepSeek-V3 and -V2 in the table of :mod:`mcore.hf.families`."""
