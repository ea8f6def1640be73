"""mcore's GPT model as the GPT-2 and Llama mappings (:mod:`mcore.hf.gpt2`, :mod:`mcore.hf.llama`) see
it: the logical names, the shapes a config gives them, and the steps both mappings share.

A logical state dict maps mcore's logical parameter names (global layer numbers, see
:meth:`mcore.models.gpt.gpt_model.GPTModel.sharded_parameters`) to whole, unsharded tensors; the word
embedding (and an untied ``output_layer.weight``) has the padded vocabulary ``Vp`` rows of the layout
it came from, and a tied model has no ``output_layer.weight``. Working on these dicts keeps the
converters independent of the checkpoint file format and of the TP/PP layout.

The family follows from the mcore model (:func:`hf_family`: learned positions -> gpt2, RoPE ->
llama, or qwen3 with QK layernorm; or the architecture asked for) or from ``config.json``
(:func:`family_of_hf_config`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from mcore.hf.deepseek_shapes import mla_shapes
from mcore.hf.errors import ConversionError
from mcore.hf.moe_mapping import expected_moe_shapes
from mcore.hf.tensors import TensorSource, pad_vocab_rows, split_qkv, vocab_rows
from mcore.models.transformer.model_config import ModelConfig

GPT2 = "gpt2"
LLAMA = "llama"
MISTRAL = "mistral"
QWEN2 = "qwen2"
QWEN3 = "qwen3"
MIXTRAL = "mixtral"
QWEN2_MOE = "qwen2_moe"
QWEN3_MOE = "qwen3_moe"
OLMOE = "olmoe"
DEEPSEEK_V3 = "deepseek_v3"
DEEPSEEK_V2 = "deepseek_v2"
ARCHITECTURES = {
    GPT2: "GPT2LMHeadModel",
    LLAMA: "LlamaForCausalLM",
    MISTRAL: "MistralForCausalLM",
    QWEN2: "Qwen2ForCausalLM",
    QWEN3: "Qwen3ForCausalLM",
    MIXTRAL: "MixtralForCausalLM",
    QWEN2_MOE: "Qwen2MoeForCausalLM",
    QWEN3_MOE: "Qwen3MoeForCausalLM",
    OLMOE: "OlmoeForCausalLM",
    DEEPSEEK_V3: "DeepseekV3ForCausalLM",
    DEEPSEEK_V2: "DeepseekV2ForCausalLM",
}
"""The GPT-style families by their ``model_type``; the families' names are these keys."""
QK_NORMS = {
    QWEN3: "per head",
    QWEN3_MOE: "per head",
    OLMOE: "full width",
    DEEPSEEK_V3: "latent",
    DEEPSEEK_V2: "latent",
}
"""The families with q/k norms, and which kind (``--qk-layernorm``, ``--qk-layernorm-full-width``)."""
FAMILY_OF_ARCHITECTURE = {arch: family for family, arch in ARCHITECTURES.items()}

WORD = "embedding.word_embeddings.weight"
POSITION = "embedding.position_embeddings.weight"
OUTPUT = "output_layer.weight"
LayerFn = Callable[[TensorSource, ModelConfig, int, dict[str, torch.Tensor]], None]
"""``(source, config, layer index, out)``: put one layer's converted tensors into ``out``."""
IGNORED_HF_KEYS = ("attn.bias", "attn.masked_bias", "rotary_emb.inv_freq")
"""HF keys that are buffers, not weights (older savers wrote them); skipped on import."""


def hf_family(cfg: ModelConfig, architecture: str | None = None) -> str:
    """The GPT-style family of an mcore model, or :class:`ConversionError` naming what does not fit.

    ``architecture`` (a Hugging Face class, e.g. the one the checkpoint was imported from) decides
    when given; otherwise learned positions -> ``"gpt2"``, RoPE -> ``"qwen3"`` with
    ``--qk-layernorm``, else ``"llama"`` (Mistral and Qwen2 hold subsets of Llama: ask for them); with
    experts: ``"olmoe"`` (full-width q/k norms), ``"qwen3_moe"`` (per head), ``"qwen2_moe"`` (a shared
    expert), else ``"mixtral"``.
    """
    if architecture is not None:
        if architecture not in FAMILY_OF_ARCHITECTURE:
            supported = ", ".join(ARCHITECTURES.values())
            raise ConversionError(f"architecture {architecture!r} is not exported; supported: {supported}")
        return FAMILY_OF_ARCHITECTURE[architecture]
    kind = cfg.position_embedding_type
    if cfg.multi_latent_attention:  # DeepSeek's attention (mcore.hf.deepseek)
        return DEEPSEEK_V3
    if kind == "learned_absolute":
        return GPT2
    if kind == "rope" and cfg.num_experts:
        if cfg.qk_layernorm:
            return OLMOE if cfg.qk_layernorm_full_width else QWEN3_MOE
        return QWEN2_MOE if cfg.moe_shared_expert_intermediate_size is not None else MIXTRAL
    if kind == "rope":
        return QWEN3 if cfg.qk_layernorm else LLAMA
    raise ConversionError(
        f"position_embedding_type={kind!r} has no Hugging Face equivalent here: GPT2LMHeadModel needs "
        "learned_absolute positions and LlamaForCausalLM needs rope"
    )


def family_of_hf_config(hf: Mapping[str, Any], where: str = "config.json") -> str:
    """The family (a key of :data:`ARCHITECTURES`) from ``architectures`` / ``model_type``, else
    :class:`ConversionError` naming the supported ones."""
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


def check_family_exportable(cfg: ModelConfig, family: str, problems: list[str]) -> str:
    """Raise one :class:`ConversionError` naming every setting of ``cfg`` that ``family``'s class cannot
    represent (``problems``: the family's own; what no class here has, the residual after the norm
    and full-width q/k norms, comes first); return ``family``."""
    common = []
    if cfg.apply_residual_connection_post_layernorm:
        common.append(
            "apply_residual_connection_post_layernorm=True (the HF classes take the residual before the norm)"
        )
    kind = QK_NORMS.get(family)
    if cfg.qk_layernorm and kind is None:
        common.append(f"qk_layernorm=True ({ARCHITECTURES[family]} has no q/k norms)")
    elif cfg.qk_layernorm and cfg.qk_layernorm_full_width != (kind == "full width"):
        common.append(
            f"qk_layernorm_full_width={cfg.qk_layernorm_full_width} ({ARCHITECTURES[family]} norms q and k "
            f"{kind})"
        )
    problems = [*common, *problems]
    if problems:
        raise ConversionError(f"cannot export to {ARCHITECTURES[family]} exactly: " + "; ".join(problems))
    return family


def common_config_fields(
    cfg: ModelConfig,
    family: str,
    vocab_size: int,
    *,
    bos_token_id: int | None,
    eos_token_id: int | None,
    pad_token_id: int | None,
    dtype: str,
) -> dict[str, Any]:
    """The ``config.json`` fields GPT-2 and Llama share (the token ids checked against the vocabulary)."""
    for name, value in (("bos_token_id", bos_token_id), ("eos_token_id", eos_token_id)):
        if value is not None and not 0 <= value < vocab_size:
            raise ConversionError(f"{name}={value} is outside the vocabulary [0, {vocab_size})")
    return {
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


# -- mcore -> Hugging Face ---------------------------------------------------------------------------


def open_export(
    state: Mapping[str, torch.Tensor], cfg: ModelConfig, vocab_size: int
) -> tuple[TensorSource, torch.Tensor, torch.Tensor | None]:
    """The checked logical state as a :class:`TensorSource`, the word embedding and the untied output
    layer (None when tied), both cut to the real vocabulary ``vocab_size``."""
    if WORD not in state:
        raise ConversionError(f"the mcore checkpoint has no {WORD}")
    check_logical_state(state, cfg, state[WORD].shape[0], "the mcore checkpoint")
    src = TensorSource(state, "the mcore checkpoint")
    word = vocab_rows(src.get(WORD), vocab_size, WORD)
    head = (
        None if cfg.share_embeddings_and_output_weights else vocab_rows(src.get(OUTPUT), vocab_size, OUTPUT)
    )
    return src, word, head


def read_layer(src: TensorSource, cfg: ModelConfig, i: int) -> dict[str, torch.Tensor | None]:
    """The tensors of mcore layer ``i`` (``q``, ``k``, ``v`` split from ``linear_qkv``; an absent bias
    is None) under short names: ``qkv_w``, ``qkv_b``, ``proj_w``, ``proj_b``, ``fc1_w``, ``fc1_b``,
    ``fc2_w``, ``fc2_b``, ``ln1_w``, ``ln2_w``, ``q_norm``, ``k_norm`` (``--qk-layernorm``)."""
    p = f"decoder.layers.{i}."
    t = {
        "qkv_w": src.get(p + "self_attention.linear_qkv.weight"),
        "qkv_b": src.optional(p + "self_attention.linear_qkv.bias"),
    }
    t["q"], t["k"], t["v"] = split_qkv(
        t["qkv_w"], cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels
    )
    t["proj_w"] = src.get(p + "self_attention.linear_proj.weight")
    t["proj_b"] = src.optional(p + "self_attention.linear_proj.bias")
    dense = cfg.moe is None or not cfg.moe.moe_layers[i]  # an MoE layer's MLP: mcore.hf.moe_mapping
    t["fc1_w"] = src.get(p + "mlp.linear_fc1.weight") if dense else None
    t["fc1_b"] = src.optional(p + "mlp.linear_fc1.bias")
    t["fc2_w"] = src.get(p + "mlp.linear_fc2.weight") if dense else None
    t["fc2_b"] = src.optional(p + "mlp.linear_fc2.bias")
    t["ln1_w"], t["ln2_w"] = src.get(p + "input_layernorm.weight"), src.get(p + "pre_mlp_layernorm.weight")
    qk = cfg.qk_layernorm
    t["q_norm"] = src.get(p + "self_attention.q_layernorm.weight") if qk else None
    t["k_norm"] = src.get(p + "self_attention.k_layernorm.weight") if qk else None
    return t


def finish_export(
    src: TensorSource, out: dict[str, torch.Tensor], head: torch.Tensor | None, family: str
) -> dict[str, torch.Tensor]:
    """``out`` with the untied ``lm_head.weight``, contiguous, after refusing tensors no HF key took."""
    if head is not None:
        out["lm_head.weight"] = head
    leftovers = src.leftovers()
    if leftovers:
        raise ConversionError(
            f"the mcore checkpoint has tensors that {family} cannot hold: {', '.join(leftovers[:8])}"
            + (" ..." if len(leftovers) > 8 else "")
        )
    return {k: v.contiguous() for k, v in out.items()}


def convert_to_hf(
    state: Mapping[str, torch.Tensor],
    cfg: ModelConfig,
    vocab_size: int,
    family: str,
    layer_to_hf: LayerFn,
    top_to_hf: Callable[[TensorSource, torch.Tensor, dict[str, torch.Tensor]], None],
) -> dict[str, torch.Tensor]:
    """The export both mappings share: check the state, map every layer (``layer_to_hf(src, cfg, i,
    out)``), then the embedding and final norm (``top_to_hf(src, word, out)``, ``word`` cut to
    ``vocab_size`` rows), then the untied head; refuse tensors no Hugging Face key took."""
    src, word, head = open_export(state, cfg, vocab_size)
    out: dict[str, torch.Tensor] = {}
    for i in range(cfg.num_layers):
        layer_to_hf(src, cfg, i, out)
    top_to_hf(src, word, out)
    return finish_export(src, out, head, family)


# -- Hugging Face -> mcore ---------------------------------------------------------------------------


def convert_from_hf(
    hf_state: Mapping[str, torch.Tensor],
    cfg: ModelConfig,
    padded_vocab_size: int,
    family: str,
    word_key: str,
    layer_from_hf: LayerFn,
    top_from_hf: LayerFn,
) -> dict[str, torch.Tensor]:
    """The import both mappings share: every layer (``layer_from_hf(src, cfg, i, out)``), the word
    embedding ``word_key`` zero-padded to ``padded_vocab_size`` rows, the rest of the top
    (``top_from_hf(src, cfg, -1, out)``), the untied head, and the checks of :func:`finish_import`."""
    src = TensorSource(hf_state, "the Hugging Face model")
    out: dict[str, torch.Tensor] = {}
    for i in range(cfg.num_layers):
        layer_from_hf(src, cfg, i, out)
    out[WORD] = pad_vocab_rows(src.get(word_key), padded_vocab_size)
    top_from_hf(src, cfg, -1, out)
    return finish_import(src, out, cfg, padded_vocab_size, word_key, family)


def finish_import(
    src: TensorSource,
    out: dict[str, torch.Tensor],
    cfg: ModelConfig,
    padded_vocab_size: int,
    word_key: str,
    family: str,
) -> dict[str, torch.Tensor]:
    """``out`` with the untied output layer (the vocabulary zero-padded to ``padded_vocab_size``), after
    refusing Hugging Face tensors no mcore name took and checking every shape."""
    word = src.get(word_key)
    if cfg.share_embeddings_and_output_weights:
        src.optional("lm_head.weight")  # a tied model may still carry it: it is the embedding
    else:
        head = src.get("lm_head.weight")
        if head.shape != word.shape:
            raise ConversionError(
                f"lm_head.weight has shape {tuple(head.shape)}, {word_key} {tuple(word.shape)}"
            )
        out[OUTPUT] = pad_vocab_rows(head, padded_vocab_size)
    leftovers = src.leftovers(ignore=IGNORED_HF_KEYS)
    if leftovers:
        raise ConversionError(
            f"the Hugging Face model has tensors with no place in the mcore {family} model: "
            f"{', '.join(leftovers[:8])}" + (" ..." if len(leftovers) > 8 else "")
        )
    check_logical_state(out, cfg, padded_vocab_size, "the converted Hugging Face model")
    return {k: v.contiguous() for k, v in out.items()}


# -- shapes -----------------------------------------------------------------------------------------


def expected_logical_shapes(cfg: ModelConfig, padded_vocab_size: int) -> dict[str, tuple[int, ...]]:
    """Logical name -> shape of every tensor of an mcore GPT model with ``cfg`` (padded vocabulary)."""
    h, n, g, d, f = (
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_query_groups,
        cfg.kv_channels,
        cfg.ffn_hidden_size,
    )
    layer_norm = cfg.normalization == "LayerNorm"
    shapes: dict[str, tuple[int, ...]] = {WORD: (padded_vocab_size, h)}
    if cfg.position_embedding_type == "learned_absolute":
        shapes[POSITION] = (cfg.max_position_embeddings, h)
    for i in range(cfg.num_layers):
        p = f"decoder.layers.{i}."
        for norm in ("input_layernorm", "pre_mlp_layernorm"):
            shapes[p + norm + ".weight"] = (h,)
            if layer_norm:
                shapes[p + norm + ".bias"] = (h,)
        if cfg.multi_latent_attention:
            shapes.update(mla_shapes(cfg, i))
        else:
            shapes[p + "self_attention.linear_qkv.weight"] = ((n + 2 * g) * d, h)
            if cfg.add_bias_linear or cfg.add_qkv_bias:
                shapes[p + "self_attention.linear_qkv.bias"] = ((n + 2 * g) * d,)
            shapes[p + "self_attention.linear_proj.weight"] = (h, n * d)
        if cfg.qk_layernorm and not cfg.multi_latent_attention:  # MLA: its latent norms (mla_shapes)
            full = cfg.qk_layernorm_full_width
            for name, width in (("q_layernorm", n * d if full else d), ("k_layernorm", g * d if full else d)):
                shapes[p + f"self_attention.{name}.weight"] = (width,)
                if layer_norm:
                    shapes[p + f"self_attention.{name}.bias"] = (width,)
        fc1 = 2 * f if cfg.swiglu else f
        moe_layer = cfg.moe is not None and cfg.moe.moe_layers[i]
        if moe_layer:
            shapes.update(expected_moe_shapes(cfg, i))
        else:
            shapes[p + "mlp.linear_fc1.weight"] = (fc1, h)
            shapes[p + "mlp.linear_fc2.weight"] = (h, f)
        if cfg.add_bias_linear:
            shapes[p + "self_attention.linear_proj.bias"] = (h,)
        if cfg.add_bias_linear and not moe_layer:
            shapes[p + "mlp.linear_fc1.bias"] = (fc1,)
            shapes[p + "mlp.linear_fc2.bias"] = (h,)
    shapes["decoder.final_layernorm.weight"] = (h,)
    if layer_norm:
        shapes["decoder.final_layernorm.bias"] = (h,)
    if not cfg.share_embeddings_and_output_weights:
        shapes[OUTPUT] = (padded_vocab_size, h)
    return shapes


def check_logical_state(
    state: Mapping[str, torch.Tensor], cfg: ModelConfig, padded_vocab_size: int, what: str
) -> None:
    """Raise :class:`ConversionError` unless ``state`` has exactly the tensors and shapes of ``cfg``."""
    expected = expected_logical_shapes(cfg, padded_vocab_size)
    problems = [
        f"{k}: {tuple(state[k].shape)} (expected {shape})"
        for k, shape in expected.items()
        if k in state and tuple(state[k].shape) != shape
    ]
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    if problems or missing or extra:
        parts = []
        if problems:
            parts.append("shape mismatch " + "; ".join(problems[:6]))
        if missing:
            parts.append("missing " + ", ".join(missing[:6]))
        if extra:
            parts.append("unexpected " + ", ".join(extra[:6]))
        raise ConversionError(f"{what} does not fit the model config: " + " | ".join(parts))
