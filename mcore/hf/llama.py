"""mcore's GPT model <-> Hugging Face ``LlamaForCausalLM``: the config and the tensors.

Llama: RoPE (rotate-half, full head), RMSNorm, SwiGLU, GQA, biases only as ``attention_bias`` (QKV +
o_proj, ``--add-qkv-bias`` writes a zero o_proj bias) and ``mlp_bias`` (``add_bias_linear`` writes
both), tied or untied. Whatever ``LlamaForCausalLM`` cannot represent is refused *before* any tensor
is converted, with a message that names the setting and its value.

Tensors (mcore's ``linear_qkv`` packs per head group, :func:`mcore.hf.tensors.split_qkv`; SwiGLU's
``linear_fc1`` ``[2F, h]`` is ``[gate; up]``)::

    decoder.layers.{i}.input_layernorm.weight       model.layers.{i}.input_layernorm.weight
    decoder.layers.{i}.self_attention.linear_qkv.*  model.layers.{i}.self_attn.{q,k,v}_proj.*
    decoder.layers.{i}.self_attention.linear_proj.* model.layers.{i}.self_attn.o_proj.*
    decoder.layers.{i}.pre_mlp_layernorm.weight     model.layers.{i}.post_attention_layernorm.weight
    decoder.layers.{i}.mlp.linear_fc1.*             model.layers.{i}.mlp.{gate,up}_proj.*
    decoder.layers.{i}.mlp.linear_fc2.*             model.layers.{i}.mlp.down_proj.*
    embedding.word_embeddings.weight [Vp, h]        model.embed_tokens.weight [V, h]
    decoder.final_layernorm.weight                  model.norm.weight
    output_layer.weight (untied only)               lm_head.weight
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mcore.hf.errors import ConversionError
from mcore.hf.family import HfFamily
from mcore.hf.gpt_state import (
    ARCHITECTURES,
    LLAMA,
    WORD,
    check_family_exportable,
    common_config_fields,
    finish_export,
    finish_import,
    open_export,
    read_layer,
)
from mcore.hf.parity import check_logit_parity
from mcore.hf.tensors import TensorSource, merge_qkv, pad_vocab_rows, split_qkv, zeros
from mcore.models.transformer.model_config import ModelConfig

ARCHITECTURE = ARCHITECTURES[LLAMA]
HF_WORD_KEY = "model.embed_tokens.weight"


# -- configs ----------------------------------------------------------------------------------------


def check_exportable(cfg: ModelConfig) -> str:
    """Refuse what ``LlamaForCausalLM`` cannot represent; return ``"llama"``."""
    problems: list[str] = []
    if cfg.normalization != "RMSNorm":
        problems.append(f"normalization={cfg.normalization!r} (Llama uses RMSNorm)")
    if not cfg.swiglu:
        problems.append("swiglu=False (Llama's MLP is SwiGLU; a GeLU MLP has no Llama equivalent)")
    if cfg.rotary_percent != 1.0:
        problems.append(
            f"rotary_percent={cfg.rotary_percent} (Llama rotates the whole head and would silently "
            "ignore a partial rotary factor)"
        )
    return check_family_exportable(cfg, LLAMA, problems)


def hf_config_dict(
    cfg: ModelConfig,
    vocab_size: int,
    *,
    bos_token_id: int | None,
    eos_token_id: int | None,
    pad_token_id: int | None = None,
    dtype: str = "float32",
) -> dict[str, Any]:
    """The ``config.json`` of the ``LlamaForCausalLM`` equivalent to ``cfg`` (vocabulary ``vocab_size``)."""
    check_exportable(cfg)
    common = common_config_fields(
        cfg,
        LLAMA,
        vocab_size,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        dtype=dtype,
    )
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


def _rope_settings(hf: Mapping[str, Any], where: str) -> tuple[float, dict[str, Any]]:
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


def model_config_from_hf(hf: Mapping[str, Any], where: str = "config.json", **overrides: Any) -> ModelConfig:
    """The mcore :class:`ModelConfig` of a Llama ``config.json`` (refusing what mcore cannot express)."""
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


# -- tensors ----------------------------------------------------------------------------------------


def _layer_to_hf(src: TensorSource, cfg: ModelConfig, i: int, out: dict[str, torch.Tensor]) -> None:
    t = read_layer(src, cfg, i)
    h, n, g, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels
    hp = f"model.layers.{i}."
    out[hp + "input_layernorm.weight"] = t["ln1_w"]
    out[hp + "self_attn.q_proj.weight"] = t["q"]
    out[hp + "self_attn.k_proj.weight"] = t["k"]
    out[hp + "self_attn.v_proj.weight"] = t["v"]
    out[hp + "self_attn.o_proj.weight"] = t["proj_w"]
    if t["qkv_b"] is not None:
        qb, kb, vb = split_qkv(t["qkv_b"], n, g, d)
        out[hp + "self_attn.q_proj.bias"] = qb
        out[hp + "self_attn.k_proj.bias"] = kb
        out[hp + "self_attn.v_proj.bias"] = vb
        # attention_bias puts a bias on o_proj too; --add-qkv-bias alone means a zero one.
        proj_b = t["proj_b"]
        out[hp + "self_attn.o_proj.bias"] = proj_b if proj_b is not None else zeros(h, t["proj_w"])
    out[hp + "post_attention_layernorm.weight"] = t["ln2_w"]
    gate, up = t["fc1_w"].chunk(2, dim=0)
    out[hp + "mlp.gate_proj.weight"], out[hp + "mlp.up_proj.weight"] = gate, up
    out[hp + "mlp.down_proj.weight"] = t["fc2_w"]
    if t["fc1_b"] is not None:
        gate_b, up_b = t["fc1_b"].chunk(2, dim=0)
        out[hp + "mlp.gate_proj.bias"], out[hp + "mlp.up_proj.bias"] = gate_b, up_b
        out[hp + "mlp.down_proj.bias"] = t["fc2_b"]


def mcore_to_hf(
    state: Mapping[str, torch.Tensor], cfg: ModelConfig, vocab_size: int
) -> dict[str, torch.Tensor]:
    """The ``LlamaForCausalLM`` state dict (contiguous tensors) of an mcore logical state dict
    (see :func:`mcore.hf.families.mcore_to_hf`)."""
    check_exportable(cfg)
    src, word, head = open_export(state, cfg, vocab_size)
    out: dict[str, torch.Tensor] = {}
    for i in range(cfg.num_layers):
        _layer_to_hf(src, cfg, i, out)
    out["model.embed_tokens.weight"] = word
    out["model.norm.weight"] = src.get("decoder.final_layernorm.weight")
    return finish_export(src, out, head, LLAMA)


def _attention_from_hf(src: TensorSource, cfg: ModelConfig, i: int, out: dict[str, torch.Tensor]) -> None:
    n, g, d = cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels
    p, a = f"decoder.layers.{i}.", f"model.layers.{i}.self_attn."
    out[p + "self_attention.linear_qkv.weight"] = merge_qkv(
        src.get(a + "q_proj.weight"), src.get(a + "k_proj.weight"), src.get(a + "v_proj.weight"), n, g, d
    )
    out[p + "self_attention.linear_proj.weight"] = src.get(a + "o_proj.weight")
    if cfg.add_bias_linear or cfg.add_qkv_bias:
        out[p + "self_attention.linear_qkv.bias"] = merge_qkv(
            src.get(a + "q_proj.bias"), src.get(a + "k_proj.bias"), src.get(a + "v_proj.bias"), n, g, d
        )
        o_bias = src.get(a + "o_proj.bias")
        if cfg.add_bias_linear:
            out[p + "self_attention.linear_proj.bias"] = o_bias
        elif bool(o_bias.ne(0).any()):
            raise ConversionError(
                f"{a}o_proj.bias is not zero, but attention_bias=True with mlp_bias=False maps to "
                "mcore's --add-qkv-bias, which has no output-projection bias"
            )


def _layer_from_hf(src: TensorSource, cfg: ModelConfig, i: int, out: dict[str, torch.Tensor]) -> None:
    p, hp = f"decoder.layers.{i}.", f"model.layers.{i}."
    out[p + "input_layernorm.weight"] = src.get(hp + "input_layernorm.weight")
    _attention_from_hf(src, cfg, i, out)
    out[p + "pre_mlp_layernorm.weight"] = src.get(hp + "post_attention_layernorm.weight")
    out[p + "mlp.linear_fc1.weight"] = torch.cat(
        [src.get(hp + "mlp.gate_proj.weight"), src.get(hp + "mlp.up_proj.weight")]
    )
    out[p + "mlp.linear_fc2.weight"] = src.get(hp + "mlp.down_proj.weight")
    if cfg.add_bias_linear:
        out[p + "mlp.linear_fc1.bias"] = torch.cat(
            [src.get(hp + "mlp.gate_proj.bias"), src.get(hp + "mlp.up_proj.bias")]
        )
        out[p + "mlp.linear_fc2.bias"] = src.get(hp + "mlp.down_proj.bias")


def hf_to_mcore(
    hf_state: Mapping[str, torch.Tensor], cfg: ModelConfig, padded_vocab_size: int
) -> dict[str, torch.Tensor]:
    """The mcore logical state dict of a ``LlamaForCausalLM`` state dict
    (see :func:`mcore.hf.families.hf_to_mcore`)."""
    check_exportable(cfg)
    src = TensorSource(hf_state, "the Hugging Face model")
    out: dict[str, torch.Tensor] = {}
    for i in range(cfg.num_layers):
        _layer_from_hf(src, cfg, i, out)
    out[WORD] = pad_vocab_rows(src.get(HF_WORD_KEY), padded_vocab_size)
    out["decoder.final_layernorm.weight"] = src.get("model.norm.weight")
    return finish_import(src, out, cfg, padded_vocab_size, HF_WORD_KEY, LLAMA)


FAMILY = HfFamily(
    name=LLAMA,
    architecture=ARCHITECTURE,
    hf_word_key=HF_WORD_KEY,
    check_exportable=check_exportable,
    hf_config_dict=hf_config_dict,
    mcore_to_hf=mcore_to_hf,
    model_config_from_hf=model_config_from_hf,
    hf_to_mcore=hf_to_mcore,
    check_parity=check_logit_parity,
)
"""Llama in the table of :mod:`mcore.hf.families`."""
