"""Model configuration in both directions: mcore :class:`ModelConfig` <-> Hugging Face ``config.json``.

Two families are supported (the weight mapping is in :mod:`mcore.hf.mapping`):

* ``gpt2`` (``GPT2LMHeadModel``): learned absolute positions, LayerNorm, GeLU (exact erf ->
  ``"gelu"``, tanh / ``--openai-gelu`` -> ``"gelu_new"``), biases (an mcore model without them is
  written with zero biases, which is exact), tied or untied output layer, no GQA, ``kv_channels = h/np``.
* ``llama`` (``LlamaForCausalLM``): RoPE (rotate-half, full head), RMSNorm, SwiGLU, GQA, biases
  only as ``attention_bias`` (QKV + o_proj, ``--add-qkv-bias`` writes a zero o_proj bias) and
  ``mlp_bias`` (``add_bias_linear`` writes both), tied or untied.

The family follows from the mcore model (learned positions -> gpt2, RoPE -> llama); whatever the
target class cannot represent is refused *before* any tensor is converted, with a message that names
the setting and its value.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mcore.hf.errors import ConversionError
from mcore.models.transformer.model_config import ModelConfig

GPT2 = "gpt2"
LLAMA = "llama"
ARCHITECTURES = {GPT2: "GPT2LMHeadModel", LLAMA: "LlamaForCausalLM"}
FAMILY_OF_ARCHITECTURE = {arch: family for family, arch in ARCHITECTURES.items()}

GPT2_GELUS_TANH = ("gelu_new", "gelu_fast", "gelu_pytorch_tanh")
"""HF activation names that are the tanh approximation (mcore ``--openai-gelu``); ``gelu`` is exact."""


# -- mcore -> Hugging Face ---------------------------------------------------------------------------


def hf_family(cfg: ModelConfig) -> str:
    """``"gpt2"`` or ``"llama"`` for an mcore model, or :class:`ConversionError` naming what does not fit."""
    kind = cfg.position_embedding_type
    if kind == "learned_absolute":
        return GPT2
    if kind == "rope":
        return LLAMA
    raise ConversionError(
        f"position_embedding_type={kind!r} has no Hugging Face equivalent here: GPT2LMHeadModel needs "
        "learned_absolute positions and LlamaForCausalLM needs rope"
    )


def check_exportable(cfg: ModelConfig) -> str:
    """Refuse what the target class cannot represent; return the family."""
    family = hf_family(cfg)
    problems: list[str] = []
    if cfg.apply_residual_connection_post_layernorm:
        problems.append(
            "apply_residual_connection_post_layernorm=True (both HF classes take the residual before the norm)"
        )
    if family == GPT2:
        if cfg.normalization != "LayerNorm":
            problems.append(f"normalization={cfg.normalization!r} (GPT-2 uses LayerNorm)")
        if cfg.swiglu:
            problems.append("swiglu=True (GPT-2's MLP is not gated; use the llama family with rope)")
        if cfg.geglu:
            problems.append("geglu=True (GPT-2's MLP is not gated)")
        if cfg.num_query_groups != cfg.num_attention_heads:
            problems.append(
                f"num_query_groups={cfg.num_query_groups} != num_attention_heads={cfg.num_attention_heads} "
                "(GPT-2 has no grouped-query attention)"
            )
        if cfg.kv_channels * cfg.num_attention_heads != cfg.hidden_size:
            problems.append(
                f"kv_channels={cfg.kv_channels} != hidden_size/num_attention_heads="
                f"{cfg.hidden_size / cfg.num_attention_heads:g} (GPT-2's head dim is always h/heads)"
            )
    else:
        if cfg.normalization != "RMSNorm":
            problems.append(f"normalization={cfg.normalization!r} (Llama uses RMSNorm)")
        if not cfg.swiglu:
            problems.append("swiglu=False (Llama's MLP is SwiGLU; a GeLU MLP has no Llama equivalent)")
        if cfg.rotary_percent != 1.0:
            problems.append(
                f"rotary_percent={cfg.rotary_percent} (Llama rotates the whole head and would silently "
                "ignore a partial rotary factor)"
            )
    if problems:
        target = ARCHITECTURES[family]
        raise ConversionError(f"cannot export to {target} exactly: " + "; ".join(problems))
    return family


def hf_config_dict(
    cfg: ModelConfig,
    vocab_size: int,
    *,
    bos_token_id: int | None,
    eos_token_id: int | None,
    pad_token_id: int | None = None,
    dtype: str = "float32",
) -> dict[str, Any]:
    """The ``config.json`` of the Hugging Face model equivalent to ``cfg`` (vocabulary ``vocab_size``)."""
    family = check_exportable(cfg)
    for name, value in (("bos_token_id", bos_token_id), ("eos_token_id", eos_token_id)):
        if value is not None and not 0 <= value < vocab_size:
            raise ConversionError(f"{name}={value} is outside the vocabulary [0, {vocab_size})")
    common = {
        "architectures": [ARCHITECTURES[family]],
        "model_type": family,
        "vocab_size": vocab_size,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
        "tie_word_embeddings": cfg.share_embeddings_and_output_weights,
        "initializer_range": cfg.init_method_std,
        "use_cache": True,
        "dtype": dtype,
    }
    if family == GPT2:
        positions = cfg.max_position_embeddings
        return {
            **common,
            "n_positions": positions,
            "n_ctx": positions,
            "n_embd": cfg.hidden_size,
            "n_layer": cfg.num_layers,
            "n_head": cfg.num_attention_heads,
            "n_inner": cfg.ffn_hidden_size,
            "activation_function": "gelu_new" if cfg.openai_gelu else "gelu",
            "layer_norm_epsilon": cfg.norm_epsilon,
            "resid_pdrop": cfg.hidden_dropout,
            "embd_pdrop": cfg.hidden_dropout,
            "attn_pdrop": cfg.attention_dropout,
            "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False,
            "add_cross_attention": False,
        }
    attention_bias = cfg.add_bias_linear or cfg.add_qkv_bias
    return {
        **common,
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
        "attention_bias": attention_bias,
        "mlp_bias": cfg.add_bias_linear,
        "attention_dropout": cfg.attention_dropout,
        "pretraining_tp": 1,
    }


# -- Hugging Face -> mcore ---------------------------------------------------------------------------


def family_of_hf_config(hf: dict[str, Any], where: str = "config.json") -> str:
    """``"gpt2"`` or ``"llama"`` from ``architectures`` / ``model_type``, else :class:`ConversionError`."""
    archs = hf.get("architectures") or []
    model_type = hf.get("model_type")
    for arch in archs:
        if arch in FAMILY_OF_ARCHITECTURE:
            family = FAMILY_OF_ARCHITECTURE[arch]
            if model_type not in (None, family):
                raise ConversionError(f"{where}: architectures={archs} but model_type={model_type!r}")
            return family
    if not archs and model_type in ARCHITECTURES:
        return model_type
    supported = ", ".join(f"{a} (model_type {f!r})" for f, a in ARCHITECTURES.items())
    raise ConversionError(
        f"{where}: unsupported architecture {archs or None} (model_type {model_type!r}); "
        f"supported: {supported}"
    )


def _rope_settings(hf: dict[str, Any], where: str) -> tuple[float, dict[str, Any]]:
    """``(rope_theta, rope parameters)`` from 5.x ``rope_parameters`` or 4.x ``rope_theta``/``rope_scaling``."""
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
            f"{where}: partial_rotary_factor={factor}: Llama rotates the whole head and ignores it, so "
            "the model's meaning is ambiguous"
        )
    return float(theta), params


def model_config_from_hf(hf: dict[str, Any], where: str = "config.json", **overrides: Any) -> ModelConfig:
    """The mcore :class:`ModelConfig` of a GPT-2 or Llama ``config.json`` (refusing what mcore cannot express)."""
    family = family_of_hf_config(hf, where)
    if family == GPT2:
        act = hf.get("activation_function", "gelu_new")
        if act not in ("gelu", *GPT2_GELUS_TANH):
            raise ConversionError(
                f"{where}: activation_function={act!r} has no mcore equivalent "
                f"(gelu or one of {', '.join(GPT2_GELUS_TANH)})"
            )
        for name, bad, why in (
            ("scale_attn_weights", False, "mcore always scales scores by 1/sqrt(head_dim)"),
            ("scale_attn_by_inverse_layer_idx", True, "mcore has no per-layer score scaling"),
            ("add_cross_attention", True, "mcore's GPT has no cross-attention"),
        ):
            if hf.get(name, not bad) == bad:
                raise ConversionError(f"{where}: {name}={bad} is not supported: {why}")
        h, heads = hf["n_embd"], hf["n_head"]
        if h % heads:
            raise ConversionError(f"{where}: n_embd={h} is not divisible by n_head={heads}")
        positions = hf.get("n_positions", hf.get("n_ctx"))
        kwargs = dict(
            num_layers=hf["n_layer"],
            hidden_size=h,
            num_attention_heads=heads,
            ffn_hidden_size=hf.get("n_inner") or 4 * h,
            seq_length=positions,
            max_position_embeddings=positions,
            position_embedding_type="learned_absolute",
            normalization="LayerNorm",
            norm_epsilon=hf.get("layer_norm_epsilon", 1e-5),
            openai_gelu=act in GPT2_GELUS_TANH,
            untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", True),
            hidden_dropout=hf.get("resid_pdrop", 0.1),
            attention_dropout=hf.get("attn_pdrop", 0.1),
            init_method_std=hf.get("initializer_range", 0.02),
        )
    else:
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ConversionError(f"{where}: hidden_act={act!r}; mcore's SwiGLU is silu-gated")
        theta, _ = _rope_settings(hf, where)
        h, heads = hf["hidden_size"], hf["num_attention_heads"]
        groups = hf.get("num_key_value_heads") or heads
        head_dim = hf.get("head_dim") or h // heads
        if heads % groups:
            raise ConversionError(
                f"{where}: num_attention_heads={heads} is not divisible by num_key_value_heads={groups}"
            )
        if head_dim % 2:
            raise ConversionError(f"{where}: head_dim={head_dim} is odd (RoPE rotates channel pairs)")
        attention_bias, mlp_bias = bool(hf.get("attention_bias", False)), bool(hf.get("mlp_bias", False))
        if mlp_bias and not attention_bias:
            raise ConversionError(
                f"{where}: mlp_bias=True with attention_bias=False: mcore's --add-bias-linear puts biases "
                "on every linear layer, so only both or attention_bias alone convert"
            )
        positions = hf.get("max_position_embeddings", 2048)
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
            disable_bias_linear=not mlp_bias,
            add_qkv_bias=attention_bias and not mlp_bias,
            untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
            hidden_dropout=0.0,
            attention_dropout=float(hf.get("attention_dropout", 0.0)),
            init_method_std=hf.get("initializer_range", 0.02),
        )
    kwargs.update(overrides)
    return ModelConfig(**kwargs)


def megatron_model_flags(cfg: ModelConfig) -> list[str]:
    """The Megatron command-line flags that build ``cfg`` (only those that differ from the defaults)."""
    from mcore.config.fields import flag_name, turns_off

    always = {"num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "seq_length"}
    flags: list[str] = []
    for field in dataclasses.fields(ModelConfig):
        if not field.metadata.get("cli", False):
            continue
        value = getattr(cfg, field.name)
        if value is None:
            continue
        if field.name == "num_query_groups" and not cfg.group_query_attention:
            continue
        if field.name == "kv_channels" and value * cfg.num_attention_heads == cfg.hidden_size:
            continue
        # T5's layer counts and encoder length default to --num-layers / --seq-length (and vice versa)
        if field.name in ("encoder_num_layers", "decoder_num_layers") and value == cfg.num_layers:
            continue
        if field.name == "encoder_seq_length" and value == cfg.seq_length:
            continue
        if field.name not in always and value == field.default:
            continue
        spelling = flag_name(field)
        if isinstance(value, bool):
            if value != turns_off(spelling):
                flags.append(spelling)
        elif isinstance(value, (tuple, list)):  # nargs="+" (--recompute-modules)
            flags.extend([spelling, *map(str, value)])
        else:
            flags.extend([spelling, f"{value:g}" if isinstance(value, float) else str(value)])
    return flags
