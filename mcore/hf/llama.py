"""mcore's GPT model <-> the Llama-style Hugging Face classes: ``LlamaForCausalLM``,
``MistralForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM`` and the mixtures of experts
``MixtralForCausalLM`` (as Mistral), ``Qwen2MoeForCausalLM`` (as Qwen2), ``Qwen3MoeForCausalLM`` (as
Qwen3), ``OlmoeForCausalLM`` (attention_bias, full-width q/k norms: ``--qk-layernorm-full-width``):
the configs and the tensors (the experts' mapping: :mod:`mcore.hf.moe_mapping`).

All four: RoPE (rotate-half, full head), RMSNorm, SwiGLU, GQA, tied or untied, the same tensor names.
They differ only in what a :class:`Variant` says:

* Llama: biases from ``attention_bias`` (q, k, v, o) and ``mlp_bias``; no q/k norms; no window.
* Mistral: no biases; no q/k norms; window ``sliding_window``.
* Qwen2: q, k, v biases always (``--add-qkv-bias``), nothing else; no q/k norms; window
  ``use_sliding_window`` (with ``sliding_window``, ``layer_types``).
* Qwen3: biases from ``attention_bias`` (q, k, v, o); per-head ``q_norm``/``k_norm`` ``[d]``
  (``--qk-layernorm``); window as Qwen2.

An o_proj bias maps to ``--add-bias-linear`` only together with ``mlp_bias`` (Llama); alone it must
be zero (``--add-qkv-bias`` writes a zero one). mcore has no sliding-window attention: a config whose
window is shorter than ``max_position_embeddings`` is refused naming the field (Mistral v0.1:
``sliding_window=4096``); exports write no window. Whatever the class cannot represent is refused
*before* any tensor is converted, with a message that names the setting and its value.

Tensors (mcore's ``linear_qkv`` packs per head group, :func:`mcore.hf.tensors.split_qkv`; SwiGLU's
``linear_fc1`` ``[2F, h]`` is ``[gate; up]``)::

    decoder.layers.{i}.input_layernorm.weight       model.layers.{i}.input_layernorm.weight
    decoder.layers.{i}.self_attention.linear_qkv.*  model.layers.{i}.self_attn.{q,k,v}_proj.*
    decoder.layers.{i}.self_attention.q_layernorm.weight  model.layers.{i}.self_attn.q_norm.weight (Qwen3)
    decoder.layers.{i}.self_attention.k_layernorm.weight  model.layers.{i}.self_attn.k_norm.weight (Qwen3)
    decoder.layers.{i}.self_attention.linear_proj.* model.layers.{i}.self_attn.o_proj.*
    decoder.layers.{i}.pre_mlp_layernorm.weight     model.layers.{i}.post_attention_layernorm.weight
    decoder.layers.{i}.mlp.linear_fc1.*             model.layers.{i}.mlp.{gate,up}_proj.*
    decoder.layers.{i}.mlp.linear_fc2.*             model.layers.{i}.mlp.down_proj.*
    embedding.word_embeddings.weight [Vp, h]        model.embed_tokens.weight [V, h]
    decoder.final_layernorm.weight                  model.norm.weight
    output_layer.weight (untied only)               lm_head.weight
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from mcore.hf.errors import ConversionError
from mcore.hf.family import HfFamily
from mcore.hf.gpt_state import (
    ARCHITECTURES,
    LLAMA,
    MISTRAL,
    MIXTRAL,
    OLMOE,
    QWEN2,
    QWEN2_MOE,
    QWEN3,
    QWEN3_MOE,
    check_family_exportable,
    common_config_fields,
    convert_from_hf,
    convert_to_hf,
    read_layer,
)
from mcore.hf.moe_mapping import (
    config_fields,
    export_problems,
    flags_from_hf,
    is_moe_layer,
    mlp_from_hf,
    mlp_to_hf,
)
from mcore.hf.parity import check_logit_parity
from mcore.hf.tensors import TensorSource, merge_qkv, split_qkv, zeros
from mcore.models.transformer.model_config import ModelConfig

HF_WORD_KEY = "model.embed_tokens.weight"
ARCHITECTURE = ARCHITECTURES[LLAMA]


@dataclass(frozen=True)
class Variant:
    """What one Llama-style class has (see the module docstring's table)."""

    name: str
    """``model_type`` (the family's name)."""
    biases: str
    """``"llama"``: attention_bias (q, k, v, o) and mlp_bias; ``"attention"``: attention_bias only
    (Qwen3); ``"qkv"``: q, k, v biases always (Qwen2); ``"none"`` (Mistral)."""
    qk_norm: bool = False
    """Per-head ``q_norm`` / ``k_norm`` (Qwen3): needs ``--qk-layernorm``."""
    window: str = ""
    """How the config spells sliding-window attention: ``"mistral"`` (``sliding_window``),
    ``"qwen"`` (``use_sliding_window``, ``sliding_window``, ``layer_types``), or ``""`` (none)."""
    qk_full_width: bool = False
    """The q/k norms span all heads (OLMoE: ``--qk-layernorm-full-width``)."""
    moe: str = ""
    """Experts (:mod:`mcore.hf.moe_mapping`): ``"mixtral"`` (``block_sparse_moe``), ``"qwen"``
    (``mlp.experts``, Qwen2/3-MoE and OLMoE), or ``""`` (dense)."""
    shared_expert: bool = False
    """One gated shared expert (Qwen2-MoE)."""

    @property
    def architecture(self) -> str:
        return ARCHITECTURES[self.name]

    @property
    def o_bias(self) -> bool:
        """The class puts a bias on o_proj whenever its attention has biases."""
        return self.biases in ("llama", "attention")


LLAMA_VARIANT = Variant(LLAMA, biases="llama")
MISTRAL_VARIANT = Variant(MISTRAL, biases="none", window="mistral")
QWEN2_VARIANT = Variant(QWEN2, biases="qkv", window="qwen")
QWEN3_VARIANT = Variant(QWEN3, biases="attention", qk_norm=True, window="qwen")
MIXTRAL_VARIANT = Variant(MIXTRAL, biases="none", window="mistral", moe="mixtral")
QWEN2_MOE_VARIANT = Variant(QWEN2_MOE, biases="qkv", window="qwen", moe="qwen", shared_expert=True)
QWEN3_MOE_VARIANT = Variant(QWEN3_MOE, biases="attention", qk_norm=True, window="qwen", moe="qwen")
OLMOE_VARIANT = Variant(OLMOE, biases="attention", qk_norm=True, qk_full_width=True, moe="qwen")


# -- configs ----------------------------------------------------------------------------------------


def check_exportable(v: Variant, cfg: ModelConfig) -> str:
    """Refuse what ``v``'s class cannot represent; return its name."""
    problems: list[str] = []
    if cfg.normalization != "RMSNorm":
        problems.append(f"normalization={cfg.normalization!r} ({v.architecture} uses RMSNorm)")
    if not cfg.swiglu:
        problems.append(f"swiglu=False ({v.architecture}'s MLP is SwiGLU; a GeLU MLP has no equivalent)")
    if cfg.rotary_percent != 1.0:
        problems.append(
            f"rotary_percent={cfg.rotary_percent} ({v.architecture} rotates the whole head and would "
            "silently ignore a partial rotary factor)"
        )
    if v.biases != "llama" and cfg.add_bias_linear:
        problems.append(f"add_bias_linear=True ({v.architecture} has no MLP biases)")
    if v.biases == "none" and cfg.add_qkv_bias:
        problems.append(f"add_qkv_bias=True ({v.architecture} has no attention biases)")
    if v.qk_norm and not cfg.qk_layernorm:
        problems.append(f"qk_layernorm=False ({v.architecture} always norms q and k)")
    if v.name == OLMOE and cfg.kv_channels * cfg.num_attention_heads != cfg.hidden_size:
        problems.append(f"kv_channels={cfg.kv_channels} ({v.architecture}'s head dim is hidden/heads)")
    problems += export_problems(v.moe, v.shared_expert, v.architecture, cfg)
    return check_family_exportable(cfg, v.name, problems)


def hf_config_dict(
    v: Variant,
    cfg: ModelConfig,
    vocab_size: int,
    *,
    bos_token_id: int | None,
    eos_token_id: int | None,
    pad_token_id: int | None = None,
    dtype: str = "float32",
) -> dict[str, Any]:
    """The ``config.json`` of ``v``'s class equivalent to ``cfg`` (vocabulary ``vocab_size``)."""
    check_exportable(v, cfg)
    tokens = dict(bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id)
    out = {
        **common_config_fields(cfg, v.name, vocab_size, **tokens, dtype=dtype),
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_query_groups,
        "head_dim": cfg.kv_channels,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings or cfg.seq_length or 2048,
        "rms_norm_eps": cfg.norm_epsilon,
        # transformers 5.x reads rope_parameters, 4.x reads rope_theta: write both.
        "rope_parameters": {"rope_type": "default", "rope_theta": float(cfg.rotary_base)},
        "rope_theta": float(cfg.rotary_base),
        "attention_dropout": cfg.attention_dropout,
    }
    if v.biases == "llama":
        out.update(
            attention_bias=cfg.add_bias_linear or cfg.add_qkv_bias,
            mlp_bias=cfg.add_bias_linear,
            pretraining_tp=1,
        )
    elif v.biases == "attention":
        out["attention_bias"] = cfg.add_qkv_bias
    elif v.biases == "qkv" and v.moe:
        out["qkv_bias"] = True
    if v.window == "mistral":
        out["sliding_window"] = None
    elif v.window == "qwen":
        out.update(
            use_sliding_window=False,
            sliding_window=None,
            max_window_layers=cfg.num_layers,
            layer_types=["full_attention"] * cfg.num_layers,
        )
    if v.moe:
        out.update(config_fields(v.moe, v.name, cfg))
    return out


def _rope_theta(hf: Mapping[str, Any], where: str) -> float:
    """``rope_theta`` from 5.x ``rope_parameters`` or 4.x ``rope_theta``/``rope_scaling``."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling")
    if scaling:
        params = {**scaling, **params}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ConversionError(
            f"{where}: rope_type={rope_type!r} (RoPE scaling) has no mcore equivalent; only the plain "
            "'default' RoPE converts exactly"
        )
    factor = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if factor is not None and float(factor) != 1.0:
        raise ConversionError(
            f"{where}: partial_rotary_factor={factor}: the class rotates the whole head and ignores it, "
            "so the model's meaning is ambiguous"
        )
    return float(theta)


def _check_no_window(v: Variant, hf: Mapping[str, Any], positions: int, where: str) -> None:
    """Refuse a sliding window shorter than the positions (mcore attends to every earlier token)."""
    window = hf.get("sliding_window")
    active = window is not None and (v.window == "mistral" or bool(hf.get("use_sliding_window")))
    if active and window < positions:
        raise ConversionError(
            f"{where}: sliding_window={window} (< max_position_embeddings={positions}): mcore has no "
            "sliding-window attention; only a model whose window covers every position converts exactly"
        )
    kinds = set(hf.get("layer_types") or ()) - {"full_attention"}
    if kinds:
        raise ConversionError(
            f"{where}: layer_types has {sorted(kinds)}: mcore has only full attention ('full_attention')"
        )


def _bias_flags(v: Variant, hf: Mapping[str, Any], where: str) -> tuple[bool, bool]:
    """``(disable_bias_linear, add_qkv_bias)`` of the class's bias fields."""
    attention_bias, mlp_bias = bool(hf.get("attention_bias", False)), bool(hf.get("mlp_bias", False))
    if v.biases == "qkv":  # Qwen2 always; Qwen2-MoE unless qkv_bias=False
        return True, bool(hf.get("qkv_bias", True))
    if v.biases == "none":
        return True, False
    if v.biases == "attention":
        return True, attention_bias
    if mlp_bias and not attention_bias:
        raise ConversionError(
            f"{where}: mlp_bias=True with attention_bias=False: mcore's --add-bias-linear puts biases "
            "on every linear layer, so only both or attention_bias alone convert"
        )
    return not mlp_bias, attention_bias and not mlp_bias


def model_config_from_hf(
    v: Variant, hf: Mapping[str, Any], where: str = "config.json", **overrides: Any
) -> ModelConfig:
    """The mcore :class:`ModelConfig` of ``v``'s ``config.json`` (refusing what mcore cannot express)."""
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ConversionError(f"{where}: hidden_act={act!r}; mcore's SwiGLU is silu-gated")
    theta = _rope_theta(hf, where)
    h, heads = hf["hidden_size"], hf["num_attention_heads"]
    groups = hf.get("num_key_value_heads") or heads
    head_dim = hf.get("head_dim") or h // heads
    if heads % groups:
        raise ConversionError(
            f"{where}: num_attention_heads={heads} is not divisible by num_key_value_heads={groups}"
        )
    if head_dim % 2:
        raise ConversionError(f"{where}: head_dim={head_dim} is odd (RoPE rotates channel pairs)")
    positions = hf.get("max_position_embeddings", 2048)
    _check_no_window(v, hf, positions, where)
    no_bias, qkv_bias = _bias_flags(v, hf, where)
    kwargs = dict(
        num_layers=hf["num_hidden_layers"],
        hidden_size=h,
        num_attention_heads=heads,
        group_query_attention=groups != heads,
        num_query_groups=groups if groups != heads else None,
        kv_channels=head_dim,
        ffn_hidden_size=hf["intermediate_size"],
        seq_length=positions,
        max_position_embeddings=positions,
        position_embedding_type="rope",
        rotary_base=theta,
        normalization="RMSNorm",
        norm_epsilon=hf.get("rms_norm_eps", 1e-6),
        swiglu=True,
        disable_bias_linear=no_bias,
        add_qkv_bias=qkv_bias,
        qk_layernorm=v.qk_norm,
        qk_layernorm_full_width=v.qk_full_width,
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        hidden_dropout=0.0,
        attention_dropout=float(hf.get("attention_dropout", 0.0)),
        init_method_std=hf.get("initializer_range", 0.02),
    )
    if v.moe:
        kwargs.update(flags_from_hf(v.moe, v.name, hf, where))
    kwargs.update(overrides)
    return ModelConfig(**kwargs)


# -- tensors ----------------------------------------------------------------------------------------


def _layer_to_hf(v: Variant, src: TensorSource, cfg: ModelConfig, i: int, out: dict[str, torch.Tensor]):
    t = read_layer(src, cfg, i)
    h, n, g, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels
    hp = f"model.layers.{i}."
    out[hp + "input_layernorm.weight"] = t["ln1_w"]
    for name in ("q", "k", "v"):
        out[hp + f"self_attn.{name}_proj.weight"] = t[name]
    out[hp + "self_attn.o_proj.weight"] = t["proj_w"]
    qkv_b = t["qkv_b"]
    if qkv_b is None and v.biases == "qkv":  # Qwen2 always has them: zeros are exact
        qkv_b = zeros(t["qkv_w"].shape[0], t["qkv_w"])
    if qkv_b is not None:
        for name, bias in zip(("q", "k", "v"), split_qkv(qkv_b, n, g, d)):
            out[hp + f"self_attn.{name}_proj.bias"] = bias
        if v.o_bias:  # attention_bias puts one on o_proj too; --add-qkv-bias alone means a zero one
            proj_b = t["proj_b"]
            out[hp + "self_attn.o_proj.bias"] = proj_b if proj_b is not None else zeros(h, t["proj_w"])
    if v.qk_norm:
        out[hp + "self_attn.q_norm.weight"], out[hp + "self_attn.k_norm.weight"] = t["q_norm"], t["k_norm"]
    out[hp + "post_attention_layernorm.weight"] = t["ln2_w"]
    if is_moe_layer(cfg, i):
        mlp_to_hf(v.moe, src, cfg, i, out)
        return
    gate, up = t["fc1_w"].chunk(2, dim=0)
    out[hp + "mlp.gate_proj.weight"], out[hp + "mlp.up_proj.weight"] = gate, up
    out[hp + "mlp.down_proj.weight"] = t["fc2_w"]
    if t["fc1_b"] is not None:
        gate_b, up_b = t["fc1_b"].chunk(2, dim=0)
        out[hp + "mlp.gate_proj.bias"], out[hp + "mlp.up_proj.bias"] = gate_b, up_b
        out[hp + "mlp.down_proj.bias"] = t["fc2_b"]


def _top_to_hf(src: TensorSource, word: torch.Tensor, out: dict[str, torch.Tensor]) -> None:
    out[HF_WORD_KEY] = word
    out["model.norm.weight"] = src.get("decoder.final_layernorm.weight")


def mcore_to_hf(
    v: Variant, state: Mapping[str, torch.Tensor], cfg: ModelConfig, vocab_size: int
) -> dict[str, torch.Tensor]:
    """``v``'s state dict (contiguous tensors) of an mcore logical state dict
    (see :func:`mcore.hf.families.mcore_to_hf`)."""
    check_exportable(v, cfg)
    return convert_to_hf(state, cfg, vocab_size, v.name, functools.partial(_layer_to_hf, v), _top_to_hf)


def _attention_from_hf(v: Variant, src: TensorSource, cfg: ModelConfig, i: int, out: dict) -> None:
    n, g, d = cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels
    p, a = f"decoder.layers.{i}.", f"model.layers.{i}.self_attn."
    qkv = [src.get(a + f"{name}_proj.weight") for name in ("q", "k", "v")]
    out[p + "self_attention.linear_qkv.weight"] = merge_qkv(*qkv, n, g, d)
    out[p + "self_attention.linear_proj.weight"] = src.get(a + "o_proj.weight")
    if v.qk_norm:
        out[p + "self_attention.q_layernorm.weight"] = src.get(a + "q_norm.weight")
        out[p + "self_attention.k_layernorm.weight"] = src.get(a + "k_norm.weight")
    if not (cfg.add_bias_linear or cfg.add_qkv_bias):
        return
    biases = [src.get(a + f"{name}_proj.bias") for name in ("q", "k", "v")]
    out[p + "self_attention.linear_qkv.bias"] = merge_qkv(*biases, n, g, d)
    if not v.o_bias:
        return
    o_bias = src.get(a + "o_proj.bias")
    if cfg.add_bias_linear:
        out[p + "self_attention.linear_proj.bias"] = o_bias
    elif bool(o_bias.ne(0).any()):
        raise ConversionError(
            f"{a}o_proj.bias is not zero, but attention_bias=True without MLP biases maps to "
            "mcore's --add-qkv-bias, which has no output-projection bias"
        )


def _layer_from_hf(v: Variant, src: TensorSource, cfg: ModelConfig, i: int, out: dict) -> None:
    p, hp = f"decoder.layers.{i}.", f"model.layers.{i}."
    out[p + "input_layernorm.weight"] = src.get(hp + "input_layernorm.weight")
    _attention_from_hf(v, src, cfg, i, out)
    out[p + "pre_mlp_layernorm.weight"] = src.get(hp + "post_attention_layernorm.weight")
    if is_moe_layer(cfg, i):
        mlp_from_hf(v.moe, src, cfg, i, out)
        return
    mlp = {name: hp + f"mlp.{name}_proj." for name in ("gate", "up", "down")}
    out[p + "mlp.linear_fc1.weight"] = torch.cat(
        [src.get(mlp["gate"] + "weight"), src.get(mlp["up"] + "weight")]
    )
    out[p + "mlp.linear_fc2.weight"] = src.get(mlp["down"] + "weight")
    if cfg.add_bias_linear:
        out[p + "mlp.linear_fc1.bias"] = torch.cat(
            [src.get(mlp["gate"] + "bias"), src.get(mlp["up"] + "bias")]
        )
        out[p + "mlp.linear_fc2.bias"] = src.get(mlp["down"] + "bias")


def _top_from_hf(src: TensorSource, cfg: ModelConfig, _: int, out: dict[str, torch.Tensor]) -> None:
    out["decoder.final_layernorm.weight"] = src.get("model.norm.weight")


def hf_to_mcore(
    v: Variant, hf_state: Mapping[str, torch.Tensor], cfg: ModelConfig, padded_vocab_size: int
) -> dict[str, torch.Tensor]:
    """The mcore logical state dict of ``v``'s state dict (see :func:`mcore.hf.families.hf_to_mcore`)."""
    check_exportable(v, cfg)
    layer = functools.partial(_layer_from_hf, v)
    return convert_from_hf(hf_state, cfg, padded_vocab_size, v.name, HF_WORD_KEY, layer, _top_from_hf)


def family(v: Variant) -> HfFamily:
    """``v`` in the table of :mod:`mcore.hf.families`."""
    return HfFamily(
        name=v.name,
        architecture=v.architecture,
        hf_word_key=HF_WORD_KEY,
        check_exportable=functools.partial(check_exportable, v),
        hf_config_dict=functools.partial(hf_config_dict, v),
        mcore_to_hf=functools.partial(mcore_to_hf, v),
        model_config_from_hf=functools.partial(model_config_from_hf, v),
        hf_to_mcore=functools.partial(hf_to_mcore, v),
        check_parity=check_logit_parity,
    )


FAMILY = family(LLAMA_VARIANT)
"""Llama in the table of :mod:`mcore.hf.families`."""
VARIANTS = (
    LLAMA_VARIANT,
    MISTRAL_VARIANT,
    QWEN2_VARIANT,
    QWEN3_VARIANT,
    MIXTRAL_VARIANT,
    QWEN2_MOE_VARIANT,
    QWEN3_MOE_VARIANT,
    OLMOE_VARIANT,
)
FAMILIES = tuple(family(v) for v in VARIANTS)
"""Every Llama-style family."""
