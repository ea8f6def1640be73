"""Megatron's BERT <-> Hugging Face ``MegatronBertForPreTraining`` / ``MegatronBertForMaskedLM``: configs and tensors.

``MegatronBert*`` is the transformers port of Megatron's BERT: the same pre-LN layers (a norm before
attention and before the MLP, the residual taken before it), a final norm, no embedding norm, the
LM head ``LayerNorm(gelu(dense(y)))`` with a tied decoder and an output bias, a tanh pooler on the
first token and a 2-way ``seq_relationship`` head. So every tensor maps one to one::

    embedding.word_embeddings.weight [Vp, h]        bert.embeddings.word_embeddings.weight [V, h]
    embedding.position_embeddings.weight            bert.embeddings.position_embeddings.weight
    embedding.tokentype_embeddings.weight [T, h]    bert.embeddings.token_type_embeddings.weight
    encoder.layers.{i}.input_layernorm.*            bert.encoder.layer.{i}.attention.ln.*
    encoder.layers.{i}.self_attention.linear_qkv.*  bert.encoder.layer.{i}.attention.self.{query,key,value}.*
                                                    (mcore's per-head [q, k, v] rows, split_qkv)
    encoder.layers.{i}.self_attention.linear_proj.* bert.encoder.layer.{i}.attention.output.dense.*
    encoder.layers.{i}.pre_mlp_layernorm.*          bert.encoder.layer.{i}.ln.*
    encoder.layers.{i}.mlp.linear_fc1.*             bert.encoder.layer.{i}.intermediate.dense.*
    encoder.layers.{i}.mlp.linear_fc2.*             bert.encoder.layer.{i}.output.dense.*
    encoder.final_layernorm.*                       bert.encoder.ln.*
    lm_head.dense.*                                 cls.predictions.transform.dense.*
    lm_head.layer_norm.*                            cls.predictions.transform.LayerNorm.*
    output_layer.bias [Vp]                          cls.predictions.bias [V]
    output_layer.weight (untied only)               cls.predictions.decoder.weight
    pooler.dense.*                                  bert.pooler.dense.*           (binary head only)
    binary_head.*                                   cls.seq_relationship.*        (binary head only)

A model with the binary head becomes ``MegatronBertForPreTraining``; one without
(``--bert-no-binary-head``: no pooler, no binary head, no token types) ``MegatronBertForMaskedLM`` with
one all-zero token-type row (``type_vocab_size=1``; Hugging Face always adds row 0, zero adds
nothing). Importing a ``MegatronBertForMaskedLM`` (no binary head in Megatron's sense) folds its
token-type row 0 into the position table, which is exact for the token types such a model sees
(all 0; Megatron passes none without the binary head).

What Hugging Face's classes cannot express is refused before any tensor is converted: positions other
than learned absolute, RMSNorm, SwiGLU, grouped-query attention, a head dim other than ``h/heads``,
``--openai-gelu`` (Hugging Face's head would use the layers' tanh GeLU; Megatron's head is always the
exact one), ``--apply-residual-connection-post-layernorm``.

Original BERT (``BertForPreTraining``, ``model_type`` ``bert``, e.g. bert-base-uncased) is post-LN:
``x = LN(x + f(x))`` with a LayerNorm on the embeddings. No Megatron setting computes that (Megatron's
``--apply-residual-connection-post-layernorm`` still normalizes each branch's *input*), so no mcore
model reproduces its outputs; it is refused with a message naming ``MegatronBertForPreTraining``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from mcore.hf.errors import ConversionError
from mcore.hf.tensors import TensorSource, merge_qkv, pad_vocab_rows, split_qkv, vocab_rows
from mcore.models.transformer.model_config import ModelConfig

MODEL_TYPE = "megatron-bert"
PRETRAINING = "MegatronBertForPreTraining"
MASKED_LM = "MegatronBertForMaskedLM"
BERT_ARCHITECTURES = (PRETRAINING, MASKED_LM)
POST_LN_ARCHITECTURES = ("BertForPreTraining", "BertForMaskedLM", "BertModel", "BertLMHeadModel")

WORD = "embedding.word_embeddings.weight"
POSITION = "embedding.position_embeddings.weight"
TOKENTYPE = "embedding.tokentype_embeddings.weight"
OUTPUT = "output_layer.weight"
OUTPUT_BIAS = "output_layer.bias"
BERT_MARKER = "lm_head.dense.weight"
"""A logical tensor only a BERT model has: how a checkpoint is recognized as BERT."""

IGNORED_HF_KEYS = ("position_ids", "cls.predictions.decoder.bias")
"""Hugging Face keys that are buffers or tied copies (of ``cls.predictions.bias``); skipped on import."""

_LAYER = (
    ("input_layernorm", "attention.ln"),
    ("self_attention.linear_proj", "attention.output.dense"),
    ("pre_mlp_layernorm", "ln"),
    ("mlp.linear_fc1", "intermediate.dense"),
    ("mlp.linear_fc2", "output.dense"),
)
_HEADS = (
    ("encoder.final_layernorm", "bert.encoder.ln"),
    ("lm_head.dense", "cls.predictions.transform.dense"),
    ("lm_head.layer_norm", "cls.predictions.transform.LayerNorm"),
)
_BINARY = (("pooler.dense", "bert.pooler.dense"), ("binary_head", "cls.seq_relationship"))


@dataclass(frozen=True)
class BertHeads:
    """The BERT options that are not in :class:`ModelConfig`: Megatron's ``--bert-no-binary-head``."""

    add_binary_head: bool = True
    num_tokentypes: int = 2

    @property
    def architecture(self) -> str:
        return PRETRAINING if self.add_binary_head else MASKED_LM


def is_bert_state(state: Mapping[str, Any]) -> bool:
    """A logical state (or checkpoint record names) of a BERT model."""
    return BERT_MARKER in state


def bert_heads_of_state(state: Mapping[str, torch.Tensor]) -> BertHeads:
    """Binary head and token types, read from which tensors a BERT checkpoint holds."""
    tokentypes = state[TOKENTYPE].shape[0] if TOKENTYPE in state else 0
    return BertHeads(add_binary_head="binary_head.weight" in state, num_tokentypes=tokentypes)


def is_bert_hf_config(hf: Mapping[str, Any]) -> bool:
    """A Hugging Face ``config.json`` of any BERT flavour (Megatron's pre-LN or the original post-LN)."""
    archs = hf.get("architectures") or []
    return hf.get("model_type") in (MODEL_TYPE, "bert") or any(
        a in BERT_ARCHITECTURES or a in POST_LN_ARCHITECTURES for a in archs
    )


# -- configs ------------------------------------------------------------------------------------------


def check_bert_exportable(cfg: ModelConfig) -> None:
    """Refuse what ``MegatronBert*`` cannot compute exactly (one message naming every setting)."""
    problems = []
    if cfg.position_embedding_type != "learned_absolute":
        problems.append(f"position_embedding_type={cfg.position_embedding_type!r} (it has learned positions)")
    if cfg.normalization != "LayerNorm":
        problems.append(f"normalization={cfg.normalization!r} (it uses LayerNorm)")
    if cfg.swiglu:
        problems.append("swiglu=True (its MLP is not gated)")
    if cfg.openai_gelu:
        problems.append("openai_gelu=True (its LM head would use the tanh GeLU too; Megatron's is exact)")
    if cfg.num_query_groups != cfg.num_attention_heads:
        problems.append(f"num_query_groups={cfg.num_query_groups} (it has no grouped-query attention)")
    if cfg.kv_channels * cfg.num_attention_heads != cfg.hidden_size:
        problems.append(f"kv_channels={cfg.kv_channels} (its head dim is hidden_size/num_attention_heads)")
    if cfg.apply_residual_connection_post_layernorm:
        problems.append(
            "apply_residual_connection_post_layernorm=True (it takes the residual before the norm)"
        )
    if problems:
        raise ConversionError("cannot export this BERT to MegatronBert exactly: " + "; ".join(problems))


def bert_hf_config_dict(
    cfg: ModelConfig, vocab_size: int, heads: BertHeads, *, pad_token_id: int | None, dtype: str = "float32"
) -> dict[str, Any]:
    """The ``config.json`` of the ``MegatronBert*`` model equivalent to ``cfg`` and ``heads``."""
    check_bert_exportable(cfg)
    return {
        "architectures": [heads.architecture],
        "model_type": MODEL_TYPE,
        "vocab_size": vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "intermediate_size": cfg.ffn_hidden_size,
        "hidden_act": "gelu",
        "hidden_dropout_prob": cfg.hidden_dropout,
        "attention_probs_dropout_prob": cfg.attention_dropout,
        "max_position_embeddings": cfg.max_position_embeddings,
        "type_vocab_size": max(heads.num_tokentypes, 1),
        "initializer_range": cfg.init_method_std,
        "layer_norm_eps": cfg.norm_epsilon,
        "pad_token_id": pad_token_id,
        "tie_word_embeddings": cfg.share_embeddings_and_output_weights,
        "is_decoder": False,
        "add_cross_attention": False,
        "dtype": dtype,
    }


def bert_config_from_hf(
    hf: Mapping[str, Any], where: str = "config.json", **overrides: Any
) -> tuple[ModelConfig, BertHeads]:
    """The mcore config and heads of a ``MegatronBertForPreTraining`` / ``MegatronBertForMaskedLM`` config.

    Raises:
        ConversionError: post-LN BERT (``BertForPreTraining``), another MegatronBert class, or a
            setting mcore cannot express.
    """
    archs = list(hf.get("architectures") or [])
    if hf.get("model_type") == "bert" or any(a in POST_LN_ARCHITECTURES for a in archs):
        raise ConversionError(
            f"{where}: {archs[0] if archs else 'model_type bert'} is the original post-LN BERT "
            "(LayerNorm after each residual add, and on the embeddings); Megatron's BERT, and so mcore's, "
            "is pre-LN, so no mcore model computes the same outputs. Import a MegatronBertForPreTraining "
            "(or MegatronBertForMaskedLM) directory instead: transformers' class for Megatron's pre-LN BERT"
        )
    arch = next((a for a in archs if a in BERT_ARCHITECTURES), None)
    if arch is None:
        raise ConversionError(
            f"{where}: architectures={archs or None}: mcore imports BERT from {PRETRAINING} or {MASKED_LM}"
        )
    act = hf.get("hidden_act", "gelu")
    if act != "gelu":
        raise ConversionError(
            f"{where}: hidden_act={act!r}: Megatron's BERT uses the exact GeLU ('gelu') in its layers and LM head"
        )
    for name, bad in (("is_decoder", True), ("add_cross_attention", True)):
        if hf.get(name, False) == bad:
            raise ConversionError(f"{where}: {name}={bad} is not a BERT encoder")
    h, heads = hf["hidden_size"], hf["num_attention_heads"]
    if h % heads:
        raise ConversionError(f"{where}: hidden_size={h} is not divisible by num_attention_heads={heads}")
    positions = hf.get("max_position_embeddings", 512)
    kwargs = dict(
        num_layers=hf["num_hidden_layers"],
        hidden_size=h,
        num_attention_heads=heads,
        ffn_hidden_size=hf.get("intermediate_size") or 4 * h,
        seq_length=positions,
        max_position_embeddings=positions,
        position_embedding_type="learned_absolute",
        normalization="LayerNorm",
        norm_epsilon=hf.get("layer_norm_eps", 1e-12),
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", True),
        hidden_dropout=hf.get("hidden_dropout_prob", 0.1),
        attention_dropout=hf.get("attention_probs_dropout_prob", 0.1),
        init_method_std=hf.get("initializer_range", 0.02),
    )
    binary = arch == PRETRAINING
    if "bert_binary_head" in {f.name for f in dataclasses.fields(ModelConfig)}:
        kwargs["bert_binary_head"] = binary  # the training flag (--bert-no-binary-head), where it exists
    kwargs.update(overrides)
    return ModelConfig(**kwargs), BertHeads(binary, int(hf.get("type_vocab_size", 2)) if binary else 0)


# -- tensors ------------------------------------------------------------------------------------------


def expected_bert_shapes(
    cfg: ModelConfig, heads: BertHeads, padded_vocab_size: int
) -> dict[str, tuple[int, ...]]:
    """Logical name -> shape of every tensor of an mcore BertModel with ``cfg`` and ``heads``."""
    h, n, d, f = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_channels, cfg.ffn_hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        WORD: (padded_vocab_size, h),
        POSITION: (cfg.max_position_embeddings, h),
    }
    if heads.num_tokentypes:
        shapes[TOKENTYPE] = (heads.num_tokentypes, h)
    for i in range(cfg.num_layers):
        p = f"encoder.layers.{i}."
        for norm in ("input_layernorm", "pre_mlp_layernorm"):
            shapes[p + norm + ".weight"] = shapes[p + norm + ".bias"] = (h,)
        shapes[p + "self_attention.linear_qkv.weight"] = (3 * n * d, h)
        shapes[p + "self_attention.linear_proj.weight"] = (h, n * d)
        shapes[p + "mlp.linear_fc1.weight"] = (f, h)
        shapes[p + "mlp.linear_fc2.weight"] = (h, f)
        if cfg.add_bias_linear or cfg.add_qkv_bias:
            shapes[p + "self_attention.linear_qkv.bias"] = (3 * n * d,)
        if cfg.add_bias_linear:
            shapes[p + "self_attention.linear_proj.bias"] = (h,)
            shapes[p + "mlp.linear_fc1.bias"] = (f,)
            shapes[p + "mlp.linear_fc2.bias"] = (h,)
    for name in ("encoder.final_layernorm", "lm_head.layer_norm"):
        shapes[name + ".weight"] = shapes[name + ".bias"] = (h,)
    shapes["lm_head.dense.weight"], shapes["lm_head.dense.bias"] = (h, h), (h,)
    shapes[OUTPUT_BIAS] = (padded_vocab_size,)
    if not cfg.share_embeddings_and_output_weights:
        shapes[OUTPUT] = (padded_vocab_size, h)
    if heads.add_binary_head:
        shapes["pooler.dense.weight"], shapes["pooler.dense.bias"] = (h, h), (h,)
        shapes["binary_head.weight"], shapes["binary_head.bias"] = (2, h), (2,)
    return shapes


def check_bert_state(
    state: Mapping[str, torch.Tensor], cfg: ModelConfig, heads: BertHeads, padded_vocab_size: int, what: str
) -> None:
    """Raise :class:`ConversionError` unless ``state`` has exactly the tensors and shapes of the model."""
    expected = expected_bert_shapes(cfg, heads, padded_vocab_size)
    problems = [
        f"{k}: {tuple(state[k].shape)} (expected {shape})"
        for k, shape in expected.items()
        if k in state and tuple(state[k].shape) != shape
    ]
    missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if problems or missing or extra:
        parts = [
            f"{label} " + "; ".join(items[:6])
            for label, items in (("shape mismatch", problems), ("missing", missing), ("unexpected", extra))
            if items
        ]
        raise ConversionError(f"{what} does not fit the BERT config: " + " | ".join(parts))


def bert_mcore_to_hf(
    state: Mapping[str, torch.Tensor], cfg: ModelConfig, vocab_size: int
) -> tuple[dict[str, torch.Tensor], BertHeads]:
    """The ``MegatronBert*`` state dict of an mcore BERT logical state (vocabulary cut to ``vocab_size``)."""
    check_bert_exportable(cfg)
    if WORD not in state:
        raise ConversionError(f"the mcore checkpoint has no {WORD}")
    heads = bert_heads_of_state(state)
    check_bert_state(state, cfg, heads, state[WORD].shape[0], "the mcore checkpoint")
    src = TensorSource(state, "the mcore checkpoint")
    h, n, d = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_channels
    word = vocab_rows(src.get(WORD), vocab_size, WORD)
    out = {
        "bert.embeddings.word_embeddings.weight": word,
        "bert.embeddings.position_embeddings.weight": src.get(POSITION),
        "bert.embeddings.token_type_embeddings.weight": (
            src.get(TOKENTYPE) if heads.num_tokentypes else torch.zeros(1, h, dtype=word.dtype)
        ),
    }

    def bias_or_zeros(key: str, size: int) -> torch.Tensor:
        bias = src.optional(key)
        return bias if bias is not None else torch.zeros(size, dtype=word.dtype)

    for i in range(cfg.num_layers):
        p, hp = f"encoder.layers.{i}.", f"bert.encoder.layer.{i}."
        qkv_w = src.get(p + "self_attention.linear_qkv.weight")
        qkv_b = bias_or_zeros(p + "self_attention.linear_qkv.bias", qkv_w.shape[0])
        for part, w, b in zip(
            ("query", "key", "value"), split_qkv(qkv_w, n, n, d), split_qkv(qkv_b, n, n, d)
        ):
            out[f"{hp}attention.self.{part}.weight"], out[f"{hp}attention.self.{part}.bias"] = w, b
        for ours, theirs in _LAYER:
            weight = src.get(f"{p}{ours}.weight")
            out[f"{hp}{theirs}.weight"] = weight
            out[f"{hp}{theirs}.bias"] = bias_or_zeros(f"{p}{ours}.bias", weight.shape[0])
    pairs = _HEADS + (_BINARY if heads.add_binary_head else ())
    for ours, theirs in pairs:
        out[f"{theirs}.weight"], out[f"{theirs}.bias"] = src.get(f"{ours}.weight"), src.get(f"{ours}.bias")
    out["cls.predictions.bias"] = vocab_rows(src.get(OUTPUT_BIAS), vocab_size, OUTPUT_BIAS)
    if not cfg.share_embeddings_and_output_weights:
        out["cls.predictions.decoder.weight"] = vocab_rows(src.get(OUTPUT), vocab_size, OUTPUT)
    leftovers = src.leftovers()
    if leftovers:
        raise ConversionError(
            f"the mcore checkpoint has tensors MegatronBert cannot hold: {', '.join(leftovers[:8])}"
        )
    return {k: v.contiguous() for k, v in out.items()}, heads


def bert_hf_to_mcore(
    hf_state: Mapping[str, torch.Tensor], cfg: ModelConfig, heads: BertHeads, padded_vocab_size: int
) -> dict[str, torch.Tensor]:
    """The mcore BERT logical state of a ``MegatronBert*`` state dict (vocabulary zero-padded).

    Without the binary head the token-type row 0 is folded into the positions (module docstring).
    A missing or unknown key, or a non-zero bias the mcore model has no place for, is an error.
    """
    src = TensorSource(hf_state, "the Hugging Face model")
    n, d = cfg.num_attention_heads, cfg.kv_channels
    out: dict[str, torch.Tensor] = {}
    word_key = "bert.embeddings.word_embeddings.weight"
    word = src.get(word_key)
    out[WORD] = pad_vocab_rows(word, padded_vocab_size)
    positions = src.get("bert.embeddings.position_embeddings.weight")
    tokentypes = src.get("bert.embeddings.token_type_embeddings.weight")
    if heads.num_tokentypes:
        out[POSITION], out[TOKENTYPE] = positions, tokentypes
    else:
        out[POSITION] = positions + tokentypes[0]

    def bias(hf_key: str, mcore_key: str, kept: bool) -> None:
        value = src.get(hf_key)
        if kept:
            out[mcore_key] = value
        elif bool(value.ne(0).any()):
            raise ConversionError(
                f"{hf_key} is not zero, but the mcore model (without biases) has no {mcore_key}"
            )

    for i in range(cfg.num_layers):
        p, hp = f"encoder.layers.{i}.", f"bert.encoder.layer.{i}."
        qkv = [src.get(f"{hp}attention.self.{part}.weight") for part in ("query", "key", "value")]
        out[p + "self_attention.linear_qkv.weight"] = merge_qkv(*qkv, n, n, d)
        qkv_b = [src.get(f"{hp}attention.self.{part}.bias") for part in ("query", "key", "value")]
        merged = merge_qkv(*qkv_b, n, n, d)
        if cfg.add_bias_linear or cfg.add_qkv_bias:
            out[p + "self_attention.linear_qkv.bias"] = merged
        elif bool(merged.ne(0).any()):
            raise ConversionError(
                f"{hp}attention.self biases are not zero, but the mcore model has no QKV bias"
            )
        for ours, theirs in _LAYER:
            out[f"{p}{ours}.weight"] = src.get(f"{hp}{theirs}.weight")
            norm = ours.endswith("layernorm")
            bias(f"{hp}{theirs}.bias", f"{p}{ours}.bias", norm or cfg.add_bias_linear)
    pairs = _HEADS + (_BINARY if heads.add_binary_head else ())
    for ours, theirs in pairs:
        out[f"{ours}.weight"], out[f"{ours}.bias"] = src.get(f"{theirs}.weight"), src.get(f"{theirs}.bias")
    out[OUTPUT_BIAS] = pad_vocab_rows(src.get("cls.predictions.bias"), padded_vocab_size)
    decoder = src.optional("cls.predictions.decoder.weight")
    if not cfg.share_embeddings_and_output_weights:
        if decoder is None or decoder.shape != word.shape:
            raise ConversionError(
                f"tie_word_embeddings=False needs cls.predictions.decoder.weight of shape {tuple(word.shape)}"
            )
        out[OUTPUT] = pad_vocab_rows(decoder, padded_vocab_size)
    leftovers = src.leftovers(ignore=IGNORED_HF_KEYS)
    if not heads.add_binary_head:  # a MaskedLM export of a PreTraining model may keep them: unused
        leftovers = [k for k in leftovers if not k.startswith(("bert.pooler.", "cls.seq_relationship."))]
    if leftovers:
        raise ConversionError(
            f"the Hugging Face model has tensors with no place in the mcore BERT model: {', '.join(leftovers[:8])}"
        )
    check_bert_state(out, cfg, heads, padded_vocab_size, "the converted Hugging Face model")
    return {k: v.contiguous() for k, v in out.items()}
