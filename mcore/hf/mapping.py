"""Tensor mapping between mcore *logical* state dicts and Hugging Face GPT-2 / Llama state dicts.

A logical state dict maps mcore's logical parameter names (global layer numbers, see
:meth:`mcore.models.gpt.gpt_model.GPTModel.sharded_parameters`) to whole, unsharded tensors; the word embedding
(and an untied ``output_layer.weight``) has the padded vocabulary ``Vp`` rows of the layout it came
from, and a tied model has no ``output_layer.weight``. Working on these dicts keeps the converters
independent of the checkpoint file format and of the TP/PP layout.

* ``linear_qkv`` ``[(np + 2 ng) d, h]`` is ``ng`` blocks of ``[q_1..q_r, k, v]`` (``r = np/ng``);
  :func:`split_qkv` / :func:`merge_qkv` convert it to and from separate Q, K, V.
* SwiGLU ``linear_fc1`` ``[2F, h]`` is ``[gate; up]``.
* GPT-2's Conv1D weights are stored transposed (``[in, out]``); its ``c_attn`` is ``[Q | K | V]``.
* The vocabulary is cut to the tokenizer's ``V`` rows on export and zero-padded to the target ``Vp``
  on import.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from mcore.hf.config import GPT2, LLAMA, check_exportable
from mcore.hf.errors import ConversionError
from mcore.models.transformer.model_config import ModelConfig

WORD = "embedding.word_embeddings.weight"
POSITION = "embedding.position_embeddings.weight"
OUTPUT = "output_layer.weight"
IGNORED_HF_KEYS = ("attn.bias", "attn.masked_bias", "rotary_emb.inv_freq")
"""HF keys that are buffers, not weights (older savers wrote them); skipped on import."""


def split_qkv(
    fused: torch.Tensor, num_heads: int, num_groups: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q ``[np d, ...]``, K and V ``[ng d, ...]`` from mcore's grouped ``[(np + 2 ng) d, ...]`` rows."""
    r = num_heads // num_groups
    rest = fused.shape[1:]
    blocks = fused.reshape(num_groups, r + 2, head_dim, *rest)
    q = blocks[:, :r].reshape(num_heads * head_dim, *rest)
    k = blocks[:, r].reshape(num_groups * head_dim, *rest)
    v = blocks[:, r + 1].reshape(num_groups * head_dim, *rest)
    return q, k, v


def merge_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int, num_groups: int, head_dim: int
) -> torch.Tensor:
    """Inverse of :func:`split_qkv`."""
    r = num_heads // num_groups
    rest = q.shape[1:]
    blocks = torch.cat(
        [
            q.reshape(num_groups, r, head_dim, *rest),
            k.reshape(num_groups, 1, head_dim, *rest),
            v.reshape(num_groups, 1, head_dim, *rest),
        ],
        dim=1,
    )
    return blocks.reshape((num_heads + 2 * num_groups) * head_dim, *rest)


def _vocab_rows(tensor: torch.Tensor, vocab_size: int, name: str) -> torch.Tensor:
    if tensor.shape[0] < vocab_size:
        raise ConversionError(
            f"{name} has {tensor.shape[0]} rows, fewer than the vocabulary size {vocab_size}"
        )
    return tensor[:vocab_size]


def pad_vocab_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """``tensor`` with zero rows appended up to ``rows`` (the padded vocabulary of the target layout)."""
    if tensor.shape[0] > rows:
        raise ConversionError(f"vocabulary of {tensor.shape[0]} rows does not fit a padded size of {rows}")
    if tensor.shape[0] == rows:
        return tensor
    pad = torch.zeros(rows - tensor.shape[0], *tensor.shape[1:], dtype=tensor.dtype)
    return torch.cat([tensor, pad.to(tensor.device)])


class _Source:
    """A logical state dict that records which keys were read (so leftovers can be reported)."""

    def __init__(self, state: Mapping[str, torch.Tensor], what: str):
        self.state, self.what, self.used = state, what, set()

    def get(self, key: str) -> torch.Tensor:
        if key not in self.state:
            raise ConversionError(f"{self.what} has no tensor {key!r}")
        self.used.add(key)
        return self.state[key]

    def optional(self, key: str) -> torch.Tensor | None:
        return self.get(key) if key in self.state else None

    def leftovers(self, ignore: tuple[str, ...] = ()) -> list[str]:
        return sorted(k for k in self.state if k not in self.used and not k.endswith(ignore))


def _zeros(n: int, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros(n, dtype=like.dtype, device=like.device)


def mcore_to_hf(
    state: Mapping[str, torch.Tensor], cfg: ModelConfig, vocab_size: int
) -> dict[str, torch.Tensor]:
    """The Hugging Face state dict (contiguous tensors) of an mcore logical state dict.

    Args:
        state: logical name -> whole tensor (padded vocabulary rows allowed).
        cfg: the model's configuration (decides the family, see :mod:`mcore.hf.config`).
        vocab_size: the real vocabulary ``V``; embedding rows ``[V, Vp)`` are dropped.
    """
    family = check_exportable(cfg)
    if WORD not in state:
        raise ConversionError(f"the mcore checkpoint has no {WORD}")
    check_logical_state(state, cfg, state[WORD].shape[0], "the mcore checkpoint")
    src = _Source(state, "the mcore checkpoint")
    h, n, g, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels
    tied = cfg.share_embeddings_and_output_weights
    out: dict[str, torch.Tensor] = {}
    word = _vocab_rows(src.get(WORD), vocab_size, WORD)
    head = None if tied else _vocab_rows(src.get(OUTPUT), vocab_size, OUTPUT)

    for i in range(cfg.num_layers):
        p = f"decoder.layers.{i}."
        qkv_w = src.get(p + "self_attention.linear_qkv.weight")
        qkv_b = src.optional(p + "self_attention.linear_qkv.bias")
        q, k, v = split_qkv(qkv_w, n, g, d)
        proj_w = src.get(p + "self_attention.linear_proj.weight")
        proj_b = src.optional(p + "self_attention.linear_proj.bias")
        fc1_w = src.get(p + "mlp.linear_fc1.weight")
        fc1_b = src.optional(p + "mlp.linear_fc1.bias")
        fc2_w = src.get(p + "mlp.linear_fc2.weight")
        fc2_b = src.optional(p + "mlp.linear_fc2.bias")
        ln1_w, ln2_w = src.get(p + "input_layernorm.weight"), src.get(p + "pre_mlp_layernorm.weight")
        if family == GPT2:
            hp = f"transformer.h.{i}."
            ln1_b, ln2_b = src.get(p + "input_layernorm.bias"), src.get(p + "pre_mlp_layernorm.bias")
            if qkv_b is None:
                qkv_b = _zeros(qkv_w.shape[0], qkv_w)
            qb, kb, vb = split_qkv(qkv_b, n, g, d)
            out[hp + "ln_1.weight"], out[hp + "ln_1.bias"] = ln1_w, ln1_b
            out[hp + "attn.c_attn.weight"] = torch.cat([q, k, v]).t()
            out[hp + "attn.c_attn.bias"] = torch.cat([qb, kb, vb])
            out[hp + "attn.c_proj.weight"] = proj_w.t()
            out[hp + "attn.c_proj.bias"] = proj_b if proj_b is not None else _zeros(h, proj_w)
            out[hp + "ln_2.weight"], out[hp + "ln_2.bias"] = ln2_w, ln2_b
            out[hp + "mlp.c_fc.weight"] = fc1_w.t()
            out[hp + "mlp.c_fc.bias"] = fc1_b if fc1_b is not None else _zeros(fc1_w.shape[0], fc1_w)
            out[hp + "mlp.c_proj.weight"] = fc2_w.t()
            out[hp + "mlp.c_proj.bias"] = fc2_b if fc2_b is not None else _zeros(h, fc2_w)
        else:
            hp = f"model.layers.{i}."
            out[hp + "input_layernorm.weight"] = ln1_w
            out[hp + "self_attn.q_proj.weight"] = q
            out[hp + "self_attn.k_proj.weight"] = k
            out[hp + "self_attn.v_proj.weight"] = v
            out[hp + "self_attn.o_proj.weight"] = proj_w
            if qkv_b is not None:
                qb, kb, vb = split_qkv(qkv_b, n, g, d)
                out[hp + "self_attn.q_proj.bias"] = qb
                out[hp + "self_attn.k_proj.bias"] = kb
                out[hp + "self_attn.v_proj.bias"] = vb
                # attention_bias puts a bias on o_proj too; --add-qkv-bias alone means a zero one.
                out[hp + "self_attn.o_proj.bias"] = proj_b if proj_b is not None else _zeros(h, proj_w)
            out[hp + "post_attention_layernorm.weight"] = ln2_w
            gate, up = fc1_w.chunk(2, dim=0)
            out[hp + "mlp.gate_proj.weight"], out[hp + "mlp.up_proj.weight"] = gate, up
            out[hp + "mlp.down_proj.weight"] = fc2_w
            if fc1_b is not None:
                gate_b, up_b = fc1_b.chunk(2, dim=0)
                out[hp + "mlp.gate_proj.bias"], out[hp + "mlp.up_proj.bias"] = gate_b, up_b
                out[hp + "mlp.down_proj.bias"] = fc2_b

    if family == GPT2:
        out["transformer.wte.weight"] = word
        out["transformer.wpe.weight"] = src.get(POSITION)
        out["transformer.ln_f.weight"] = src.get("decoder.final_layernorm.weight")
        out["transformer.ln_f.bias"] = src.get("decoder.final_layernorm.bias")
    else:
        out["model.embed_tokens.weight"] = word
        out["model.norm.weight"] = src.get("decoder.final_layernorm.weight")
    if head is not None:
        out["lm_head.weight"] = head
    leftovers = src.leftovers()
    if leftovers:
        raise ConversionError(
            f"the mcore checkpoint has tensors that {family} cannot hold: {', '.join(leftovers[:8])}"
            + (" ..." if len(leftovers) > 8 else "")
        )
    return {k: v.contiguous() for k, v in out.items()}


def hf_to_mcore(
    hf_state: Mapping[str, torch.Tensor], cfg: ModelConfig, padded_vocab_size: int
) -> dict[str, torch.Tensor]:
    """The mcore logical state dict of a Hugging Face GPT-2 / Llama state dict.

    ``cfg`` is the mcore config of the model (:func:`mcore.hf.config.model_config_from_hf`); the
    vocabulary rows are zero-padded to ``padded_vocab_size``. Buffers older savers wrote
    (``attn.bias``, ``attn.masked_bias``, ``rotary_emb.inv_freq``) are ignored; any other unknown key,
    a missing key, a non-zero o_proj bias without an mcore place, or a shape mismatch is an error.
    """
    family = check_exportable(cfg)
    src = _Source(hf_state, "the Hugging Face model")
    h, n, g, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels
    tied = cfg.share_embeddings_and_output_weights
    out: dict[str, torch.Tensor] = {}
    for i in range(cfg.num_layers):
        p = f"decoder.layers.{i}."
        if family == GPT2:
            hp = f"transformer.h.{i}."
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
        else:
            hp = f"model.layers.{i}."
            a = hp + "self_attn."
            out[p + "input_layernorm.weight"] = src.get(hp + "input_layernorm.weight")
            out[p + "self_attention.linear_qkv.weight"] = merge_qkv(
                src.get(a + "q_proj.weight"),
                src.get(a + "k_proj.weight"),
                src.get(a + "v_proj.weight"),
                n,
                g,
                d,
            )
            out[p + "self_attention.linear_proj.weight"] = src.get(a + "o_proj.weight")
            if cfg.add_bias_linear or cfg.add_qkv_bias:
                out[p + "self_attention.linear_qkv.bias"] = merge_qkv(
                    src.get(a + "q_proj.bias"),
                    src.get(a + "k_proj.bias"),
                    src.get(a + "v_proj.bias"),
                    n,
                    g,
                    d,
                )
                o_bias = src.get(a + "o_proj.bias")
                if cfg.add_bias_linear:
                    out[p + "self_attention.linear_proj.bias"] = o_bias
                elif bool(o_bias.ne(0).any()):
                    raise ConversionError(
                        f"{a}o_proj.bias is not zero, but attention_bias=True with mlp_bias=False maps to "
                        "mcore's --add-qkv-bias, which has no output-projection bias"
                    )
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

    prefix = "transformer." if family == GPT2 else "model."
    word_key = prefix + ("wte.weight" if family == GPT2 else "embed_tokens.weight")
    word = src.get(word_key)
    out[WORD] = pad_vocab_rows(word, padded_vocab_size)
    if family == GPT2:
        out[POSITION] = src.get("transformer.wpe.weight")
        if out[POSITION].shape[0] != cfg.max_position_embeddings:
            raise ConversionError(
                f"transformer.wpe.weight has {out[POSITION].shape[0]} rows but n_positions="
                f"{cfg.max_position_embeddings}"
            )
        out["decoder.final_layernorm.weight"] = src.get("transformer.ln_f.weight")
        out["decoder.final_layernorm.bias"] = src.get("transformer.ln_f.bias")
    else:
        out["decoder.final_layernorm.weight"] = src.get("model.norm.weight")
    if tied:
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
        shapes[p + "self_attention.linear_qkv.weight"] = ((n + 2 * g) * d, h)
        if cfg.add_bias_linear or cfg.add_qkv_bias:
            shapes[p + "self_attention.linear_qkv.bias"] = ((n + 2 * g) * d,)
        shapes[p + "self_attention.linear_proj.weight"] = (h, n * d)
        fc1 = 2 * f if cfg.swiglu else f
        shapes[p + "mlp.linear_fc1.weight"] = (fc1, h)
        shapes[p + "mlp.linear_fc2.weight"] = (h, f)
        if cfg.add_bias_linear:
            shapes[p + "self_attention.linear_proj.bias"] = (h,)
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


__all__ = [
    "GPT2",
    "LLAMA",
    "check_logical_state",
    "expected_logical_shapes",
    "hf_to_mcore",
    "mcore_to_hf",
    "merge_qkv",
    "pad_vocab_rows",
    "split_qkv",
]
