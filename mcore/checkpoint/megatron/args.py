"""Megatron-LM ``args`` (the ``argparse.Namespace`` in every checkpoint) <-> mcore's model flags.

:func:`model_flags_from_args` gives the ``ModelConfig`` fields a Megatron checkpoint was trained with
(``--use-checkpoint-args`` applies them, as Megatron does); :func:`check_supported` refuses, naming
the arg, what mcore lacks. :func:`args_from_model_config` writes the Namespace an export stores.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from mcore.checkpoint.format import CheckpointError
from mcore.models.transformer.moe.config import MoEFlags

MOE_FLAGS = tuple(f.name for f in dataclasses.fields(MoEFlags))
"""The mixture-of-experts fields: Megatron's arg names (``--num-experts``, ``--moe-*``)."""

MLA_FLAGS = (
    "multi_latent_attention",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_head_dim",
    "qk_pos_emb_head_dim",
    "v_head_dim",
    "rope_type",
    "rotary_scaling_factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
)
"""Multi-latent attention's fields: megatron-core's ``MLATransformerConfig`` names (Megatron-LM's args,
except YaRN's ``original_max_position_embeddings`` / ``beta_*``, also read as ``yarn_*``)."""

MODEL_FLAGS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "kv_channels",
    "group_query_attention",
    "num_query_groups",
    "seq_length",
    "max_position_embeddings",
    "position_embedding_type",
    "rotary_base",
    "rotary_percent",
    "normalization",
    "norm_epsilon",
    "swiglu",
    "openai_gelu",
    "disable_bias_linear",
    "add_qkv_bias",
    "qk_layernorm",
    "untie_embeddings_and_output_weights",
    "apply_residual_connection_post_layernorm",
    "make_vocab_size_divisible_by",
    *MOE_FLAGS,
    *MLA_FLAGS,
    "mtp_num_layers",
    "mtp_loss_scaling_factor",
)
"""The ``ModelConfig`` fields a checkpoint's args determine (Megatron's ``load_args_from_checkpoint``
overrides the same architecture args)."""

# (arg, value that is fine, what mcore lacks)
_REFUSED = (
    ("num_experts", (None, 0, 1), "mixture-of-experts models"),
    ("rotary_interleaved", (None, False), "interleaved RoPE"),
    ("squared_relu", (None, False), "the squared-ReLU MLP"),
    ("apply_layernorm_1p", (None, False), "zero-centred norm weights (--apply-layernorm-1p)"),
    ("attention_output_gate", (None, False), "gated attention output"),
    ("heterogeneous_layers_config_path", (None,), "heterogeneous layers"),
)


def _get(args: Any, name: str, default: Any = None) -> Any:
    return getattr(args, name, default)


def check_supported(args: Any, where: str, moe: bool = False) -> None:
    """Refuse a Megatron model mcore cannot load, naming the arg and its value (``moe``: the ``torch``
    reader, which takes experts, multi-latent attention at TP=1 and MTP; the ``torch_dist`` one does not).

    Raises:
        CheckpointError: e.g. ``args.num_experts=8: mixture-of-experts models are not implemented``.
    """
    for name, fine, what in _REFUSED:
        if moe and name == "num_experts":  # the reader takes experts (EP=1 torch format)
            continue
        value = _get(args, name)
        if value not in fine:
            raise CheckpointError(f"{where}: args.{name}={value!r}: {what} are not implemented in mcore")
    for name, what in (
        ("multi_latent_attention", "multi-latent attention"),
        ("mtp_num_layers", "multi-token prediction"),
    ):
        if not moe and _get(args, name):  # moe=False: the torch_dist reader
            raise CheckpointError(
                f"{where}: args.{name}={_get(args, name)!r}: {what} is read from --ckpt-format torch "
                "checkpoints only (torch_dist's MLA/MTP keys are not mapped)"
            )
    tp = _get(args, "tensor_model_parallel_size", 1) or 1
    if _get(args, "multi_latent_attention") and tp != 1:
        raise CheckpointError(
            f"{where}: args.multi_latent_attention=True with args.tensor_model_parallel_size={tp}: "
            "multi-latent attention checkpoints are read at TP=1 only (megatron-core's local spec splits "
            "the down projections over TP, its Transformer-Engine spec replicates them); reshard it to TP=1 "
            "with Megatron first"
        )
    vp = _get(args, "virtual_pipeline_model_parallel_size")
    if vp not in (None, 1):
        raise CheckpointError(
            f"{where}: args.virtual_pipeline_model_parallel_size={vp}: interleaved-pipeline checkpoints "
            "(model0, model1, ... chunks) are not read; save it with one chunk per stage or through "
            "torch_dist"
        )
    pos = _get(args, "position_embedding_type", "learned_absolute")
    if pos not in ("learned_absolute", "rope", "none"):
        raise CheckpointError(f"{where}: args.position_embedding_type={pos!r} is not implemented in mcore")
    norm = _get(args, "normalization", "LayerNorm")
    if norm not in ("LayerNorm", "RMSNorm"):
        raise CheckpointError(f"{where}: args.normalization={norm!r} is not implemented in mcore")


def model_flags_from_args(args: Any) -> dict[str, Any]:
    """mcore ``ModelConfig`` field values from Megatron's args (fields the args lack are left out)."""
    swiglu = bool(_get(args, "swiglu", False))
    add_bias_linear = bool(_get(args, "add_bias_linear", True))
    # Megatron's fused bias-GeLU (--bias-gelu-fusion, on by default in Megatron-LM) is the tanh
    # approximation; it applies to the GeLU MLP with biases (formats.md 6.6).
    tanh_gelu = bool(_get(args, "openai_gelu", False)) or (
        bool(_get(args, "bias_gelu_fusion", False)) and not swiglu and add_bias_linear
    )
    gqa = bool(_get(args, "group_query_attention", False))
    flags: dict[str, Any] = {
        "num_layers": _get(args, "num_layers"),
        "hidden_size": _get(args, "hidden_size"),
        "ffn_hidden_size": _get(args, "ffn_hidden_size"),
        "num_attention_heads": _get(args, "num_attention_heads"),
        "kv_channels": _get(args, "kv_channels"),
        "group_query_attention": gqa,
        "num_query_groups": _get(args, "num_query_groups") if gqa else None,
        "seq_length": _get(args, "seq_length"),
        "max_position_embeddings": _get(args, "max_position_embeddings"),
        "position_embedding_type": _get(args, "position_embedding_type", "learned_absolute"),
        "rotary_base": float(_get(args, "rotary_base", 10000)),
        "rotary_percent": float(_get(args, "rotary_percent", 1.0)),
        "normalization": _get(args, "normalization", "LayerNorm"),
        "norm_epsilon": float(_get(args, "norm_epsilon", _get(args, "layernorm_epsilon", 1e-5))),
        "swiglu": swiglu,
        "openai_gelu": tanh_gelu,
        "disable_bias_linear": not add_bias_linear,
        "add_qkv_bias": bool(_get(args, "add_qkv_bias", False)) and not add_bias_linear,
        "qk_layernorm": bool(_get(args, "qk_layernorm", False)),
        "untie_embeddings_and_output_weights": bool(_get(args, "untie_embeddings_and_output_weights", False)),
        "apply_residual_connection_post_layernorm": bool(
            _get(args, "apply_residual_connection_post_layernorm", False)
        ),
        "make_vocab_size_divisible_by": _get(args, "make_vocab_size_divisible_by", 128),
    }
    if _get(args, "num_experts"):  # Megatron's MoE args have mcore's names
        flags.update({name: _get(args, name) for name in MOE_FLAGS})
    if _get(args, "multi_latent_attention"):
        flags.update({name: _get(args, name, _get(args, "yarn_" + name)) for name in MLA_FLAGS})
        if "q_lora_rank" not in vars(args):  # megatron-core's default (512) when the args lack it
            flags.pop("q_lora_rank")
        elif _get(args, "q_lora_rank") is None:
            flags["q_lora_rank"] = None  # kept: no query compression (DeepSeek-V2-Lite)
    if _get(args, "mtp_num_layers"):
        flags.update(mtp_num_layers=_get(args, "mtp_num_layers"))
        flags.update(mtp_loss_scaling_factor=_get(args, "mtp_loss_scaling_factor", 0.1))
    return {k: v for k, v in flags.items() if v is not None or k == "q_lora_rank"}


_TOKENIZERS = (
    "GPT2BPETokenizer",
    "HuggingFaceTokenizer",
    "NullTokenizer",
    "BertWordPieceLowerCase",
    "BertWordPieceCase",
)


def tokenizer_flags_from_args(args: Any) -> dict[str, Any] | None:
    """The tokenizer a Megatron checkpoint's ``args`` name, as mcore's ``tokenizer`` group (None: a type
    mcore does not build, or none): an export then needs no ``--vocab-size`` when its files exist."""
    kind = _get(args, "tokenizer_type")
    if kind not in _TOKENIZERS:
        return None
    group: dict[str, Any] = {"tokenizer_type": kind}
    for name in ("vocab_file", "merge_file", "tokenizer_model", "vocab_extra_ids"):
        if _get(args, name) is not None:
            group[name] = _get(args, name)
    if kind == "NullTokenizer":
        group["vocab_size"] = _get(args, "vocab_size")
    return group


def args_from_model_config(
    cfg,
    *,
    padded_vocab_size: int,
    vocab_size: int | None,
    tp: int,
    pp: int,
    iteration: int,
    fmt: str,
    consumed_train_samples: int = 0,
    params_dtype=None,
    tokenizer: dict | None = None,
) -> argparse.Namespace:
    """The ``args`` Namespace an exported checkpoint stores: Megatron-LM's names for the model
    (what ``--use-checkpoint-args`` and the Hugging Face converters read), and the tokenizer of the
    source run (``tokenizer``: its ``tokenizer`` group) so that a reader needs no ``--vocab-size``."""
    import torch

    dtype = params_dtype or torch.float32
    args = argparse.Namespace(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        kv_channels=cfg.kv_channels,
        group_query_attention=cfg.group_query_attention,
        num_query_groups=cfg.num_query_groups,
        seq_length=cfg.seq_length,
        max_position_embeddings=cfg.max_position_embeddings,
        position_embedding_type=cfg.position_embedding_type,
        add_position_embedding=cfg.position_embedding_type == "learned_absolute",
        use_rotary_position_embeddings=cfg.position_embedding_type == "rope",
        rotary_base=int(cfg.rotary_base) if float(cfg.rotary_base).is_integer() else cfg.rotary_base,
        rotary_percent=cfg.rotary_percent,
        rotary_interleaved=False,
        normalization=cfg.normalization,
        norm_epsilon=cfg.norm_epsilon,
        layernorm_epsilon=cfg.norm_epsilon,
        swiglu=cfg.swiglu,
        openai_gelu=cfg.openai_gelu,
        bias_gelu_fusion=False,
        squared_relu=False,
        add_bias_linear=cfg.add_bias_linear,
        add_qkv_bias=cfg.add_bias_linear or cfg.add_qkv_bias,
        untie_embeddings_and_output_weights=cfg.untie_embeddings_and_output_weights,
        apply_residual_connection_post_layernorm=cfg.apply_residual_connection_post_layernorm,
        apply_query_key_layer_scaling=False,
        qk_layernorm=cfg.qk_layernorm,
        **{name: getattr(cfg, name) for name in MOE_FLAGS},
        **{name: getattr(cfg, name) for name in MLA_FLAGS},
        mtp_num_layers=cfg.mtp_num_layers,
        mtp_loss_scaling_factor=cfg.mtp_loss_scaling_factor,
        padded_vocab_size=padded_vocab_size,
        orig_vocab_size=vocab_size,
        vocab_size=vocab_size,
        make_vocab_size_divisible_by=cfg.make_vocab_size_divisible_by,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=None,
        transformer_impl="local",
        ckpt_format=fmt,
        params_dtype=dtype,
        fp16=dtype == torch.float16,
        bf16=dtype == torch.bfloat16,
        hidden_dropout=cfg.hidden_dropout,
        attention_dropout=cfg.attention_dropout,
        init_method_std=cfg.init_method_std,
        iteration=iteration,
        consumed_train_samples=consumed_train_samples,
        consumed_valid_samples=0,
        tokenizer_type=None,
    )
    if tokenizer and tokenizer.get("tokenizer_type") in _TOKENIZERS:
        for name in ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model", "vocab_extra_ids"):
            if tokenizer.get(name) is not None:
                setattr(args, name, tokenizer[name])
        if tokenizer["tokenizer_type"] == "NullTokenizer":
            args.vocab_size = tokenizer.get("vocab_size")  # Megatron's flag V (the tokenizer has V + 1 ids)
    return args
