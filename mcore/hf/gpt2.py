"""mcore's GPT model <-> Hugging Face ``GPT2LMHeadModel``: the config and the tensors.

GPT-2: learned absolute positions, LayerNorm, GeLU (exact erf -> ``"gelu"``, tanh /
``--openai-gelu`` -> ``"gelu_new"``), biases (an mcore model without them is written with zero
biases, which is exact), tied or untied output layer, no GQA, ``kv_channels = h/np``. Whatever
``GPT2LMHeadModel`` cannot represent is refused *before* any tensor is converted, with a message that
names the setting and its value.

Tensors: GPT-2's Conv1D weights are stored transposed (``[in, out]``); its ``c_attn`` is
``[Q | K | V]`` (mcore's ``linear_qkv`` packs per head group, :func:`mcore.hf.tensors.split_qkv`)::

    decoder.layers.{i}.input_layernorm.*            transformer.h.{i}.ln_1.*
    decoder.layers.{i}.self_attention.linear_qkv.*  transformer.h.{i}.attn.c_attn.*   (transposed)
    decoder.layers.{i}.self_attention.linear_proj.* transformer.h.{i}.attn.c_proj.*   (transposed)
    decoder.layers.{i}.pre_mlp_layernorm.*          transformer.h.{i}.ln_2.*
    decoder.layers.{i}.mlp.linear_fc1.*             transformer.h.{i}.mlp.c_fc.*      (transposed)
    decoder.layers.{i}.mlp.linear_fc2.*             transformer.h.{i}.mlp.c_proj.*    (transposed)
    embedding.word_embeddings.weight [Vp, h]        transformer.wte.weight [V, h]
    embedding.position_embeddings.weight            transformer.wpe.weight
    decoder.final_layernorm.*                       transformer.ln_f.*
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
    GPT2,
    POSITION,
    check_family_exportable,
    common_config_fields,
    convert_from_hf,
    convert_to_hf,
    read_layer,
)
from mcore.hf.parity import check_logit_parity
from mcore.hf.tensors import TensorSource, merge_qkv, split_qkv, zeros
from mcore.models.transformer.model_config import ModelConfig

ARCHITECTURE = ARCHITECTURES[GPT2]
HF_WORD_KEY = "transformer.wte.weight"
GPT2_GELUS_TANH = ("gelu_new", "gelu_fast", "gelu_pytorch_tanh")
"""HF activation names that are the tanh approximation (mcore ``--openai-gelu``); ``gelu`` is exact."""


# -- configs ----------------------------------------------------------------------------------------


def check_exportable(cfg: ModelConfig) -> str:
    """Refuse what ``GPT2LMHeadModel`` cannot represent; return ``"gpt2"``."""
    problems: list[str] = []
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
    return check_family_exportable(cfg, GPT2, problems)


def hf_config_dict(
    cfg: ModelConfig,
    vocab_size: int,
    *,
    bos_token_id: int | None,
    eos_token_id: int | None,
    pad_token_id: int | None = None,
    dtype: str = "float32",
) -> dict[str, Any]:
    """The ``config.json`` of the ``GPT2LMHeadModel`` equivalent to ``cfg`` (vocabulary ``vocab_size``)."""
    check_exportable(cfg)
    common = common_config_fields(
        cfg,
        GPT2,
        vocab_size,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        dtype=dtype,
    )
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


def model_config_from_hf(hf: Mapping[str, Any], where: str = "config.json", **overrides: Any) -> ModelConfig:
    """The mcore :class:`ModelConfig` of a GPT-2 ``config.json`` (refusing what mcore cannot express)."""
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
    kwargs.update(overrides)
    return ModelConfig(**kwargs)


# -- tensors ----------------------------------------------------------------------------------------


def _layer_to_hf(src: TensorSource, cfg: ModelConfig, i: int, out: dict[str, torch.Tensor]) -> None:
    t = read_layer(src, cfg, i)
    h, n, g, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels
    p, hp = f"decoder.layers.{i}.", f"transformer.h.{i}."
    ln1_b, ln2_b = src.get(p + "input_layernorm.bias"), src.get(p + "pre_mlp_layernorm.bias")
    qkv_b = t["qkv_b"] if t["qkv_b"] is not None else zeros(t["qkv_w"].shape[0], t["qkv_w"])
    qb, kb, vb = split_qkv(qkv_b, n, g, d)
    proj_w, fc1_w, fc2_w = t["proj_w"], t["fc1_w"], t["fc2_w"]
    out[hp + "ln_1.weight"], out[hp + "ln_1.bias"] = t["ln1_w"], ln1_b
    out[hp + "attn.c_attn.weight"] = torch.cat([t["q"], t["k"], t["v"]]).t()
    out[hp + "attn.c_attn.bias"] = torch.cat([qb, kb, vb])
    out[hp + "attn.c_proj.weight"] = proj_w.t()
    out[hp + "attn.c_proj.bias"] = t["proj_b"] if t["proj_b"] is not None else zeros(h, proj_w)
    out[hp + "ln_2.weight"], out[hp + "ln_2.bias"] = t["ln2_w"], ln2_b
    out[hp + "mlp.c_fc.weight"] = fc1_w.t()
    out[hp + "mlp.c_fc.bias"] = t["fc1_b"] if t["fc1_b"] is not None else zeros(fc1_w.shape[0], fc1_w)
    out[hp + "mlp.c_proj.weight"] = fc2_w.t()
    out[hp + "mlp.c_proj.bias"] = t["fc2_b"] if t["fc2_b"] is not None else zeros(h, fc2_w)


def _top_to_hf(src: TensorSource, word: torch.Tensor, out: dict[str, torch.Tensor]) -> None:
    out["transformer.wte.weight"] = word
    out["transformer.wpe.weight"] = src.get(POSITION)
    out["transformer.ln_f.weight"] = src.get("decoder.final_layernorm.weight")
    out["transformer.ln_f.bias"] = src.get("decoder.final_layernorm.bias")


def mcore_to_hf(
    state: Mapping[str, torch.Tensor], cfg: ModelConfig, vocab_size: int
) -> dict[str, torch.Tensor]:
    """The ``GPT2LMHeadModel`` state dict (contiguous tensors) of an mcore logical state dict
    (see :func:`mcore.hf.families.mcore_to_hf`)."""
    check_exportable(cfg)
    return convert_to_hf(state, cfg, vocab_size, GPT2, _layer_to_hf, _top_to_hf)


def _layer_from_hf(src: TensorSource, cfg: ModelConfig, i: int, out: dict[str, torch.Tensor]) -> None:
    h, n, g, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels
    p, hp = f"decoder.layers.{i}.", f"transformer.h.{i}."
    c_attn = src.get(hp + "attn.c_attn.weight").t()  # [3h, h] rows Q | K | V
    q, k, v = c_attn.split(h, dim=0)
    qb, kb, vb = src.get(hp + "attn.c_attn.bias").split(h, dim=0)
    out[p + "input_layernorm.weight"] = src.get(hp + "ln_1.weight")
    out[p + "input_layernorm.bias"] = src.get(hp + "ln_1.bias")
    out[p + "self_attention.linear_qkv.weight"] = merge_qkv(q, k, v, n, g, d)
    out[p + "self_attention.linear_proj.weight"] = src.get(hp + "attn.c_proj.weight").t()
    out[p + "pre_mlp_layernorm.weight"] = src.get(hp + "ln_2.weight")
    out[p + "pre_mlp_layernorm.bias"] = src.get(hp + "ln_2.bias")
    out[p + "mlp.linear_fc1.weight"] = src.get(hp + "mlp.c_fc.weight").t()
    out[p + "mlp.linear_fc2.weight"] = src.get(hp + "mlp.c_proj.weight").t()
    # GPT-2 always has biases; an mcore model without some keeps them only if they are zero.
    biases = {
        "self_attention.linear_qkv.bias": (
            merge_qkv(qb, kb, vb, n, g, d),
            cfg.add_bias_linear or cfg.add_qkv_bias,
        ),
        "self_attention.linear_proj.bias": (src.get(hp + "attn.c_proj.bias"), cfg.add_bias_linear),
        "mlp.linear_fc1.bias": (src.get(hp + "mlp.c_fc.bias"), cfg.add_bias_linear),
        "mlp.linear_fc2.bias": (src.get(hp + "mlp.c_proj.bias"), cfg.add_bias_linear),
    }
    for name, (bias, kept) in biases.items():
        if kept:
            out[p + name] = bias
        elif bool(bias.ne(0).any()):
            raise ConversionError(
                f"{hp}: a non-zero bias maps to {p + name}, which the mcore model (without "
                "biases) does not have"
            )


def _top_from_hf(src: TensorSource, cfg: ModelConfig, _: int, out: dict[str, torch.Tensor]) -> None:
    out[POSITION] = src.get("transformer.wpe.weight")
    if out[POSITION].shape[0] != cfg.max_position_embeddings:
        raise ConversionError(
            f"transformer.wpe.weight has {out[POSITION].shape[0]} rows but n_positions="
            f"{cfg.max_position_embeddings}"
        )
    out["decoder.final_layernorm.weight"] = src.get("transformer.ln_f.weight")
    out["decoder.final_layernorm.bias"] = src.get("transformer.ln_f.bias")


def hf_to_mcore(
    hf_state: Mapping[str, torch.Tensor], cfg: ModelConfig, padded_vocab_size: int
) -> dict[str, torch.Tensor]:
    """The mcore logical state dict of a ``GPT2LMHeadModel`` state dict
    (see :func:`mcore.hf.families.hf_to_mcore`)."""
    check_exportable(cfg)
    return convert_from_hf(hf_state, cfg, padded_vocab_size, GPT2, HF_WORD_KEY, _layer_from_hf, _top_from_hf)


FAMILY = HfFamily(
    name=GPT2,
    architecture=ARCHITECTURE,
    hf_word_key=HF_WORD_KEY,
    check_exportable=check_exportable,
    hf_config_dict=hf_config_dict,
    mcore_to_hf=mcore_to_hf,
    model_config_from_hf=model_config_from_hf,
    hf_to_mcore=hf_to_mcore,
    check_parity=check_logit_parity,
)
"""GPT-2 in the table of :mod:`mcore.hf.families`."""
