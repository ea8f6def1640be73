"""Megatron state-dict names -> mcore logical names, and how each tensor is split over TP.

mcore's logical names are megatron-core's GPTModel names (local layer spec) with global layer numbers,
so megatron-core checkpoints map almost one to one:

==========================================================  ===========================================
Megatron (``--ckpt-format torch``, stage-local layer ``i``)   mcore logical name (global layer ``g``)
==========================================================  ===========================================
``embedding.word_embeddings.weight``                          same (vocabulary rows, TP dim 0)
``embedding.position_embeddings.weight``                      same (replicated)
``decoder.layers.i.input_layernorm.{weight,bias}``            ``decoder.layers.g.input_layernorm.*``
``...self_attention.linear_qkv.layer_norm_{weight,bias}``     ``...input_layernorm.*`` (TE spelling)
``...self_attention.linear_qkv.{weight,bias}``                same (per-group ``[q_1..q_r, k, v]``, dim 0)
``...self_attention.linear_proj.weight`` / ``.bias``          same (TP dim 1 / replicated)
``...self_attention.{q,k}_layernorm.*`` (``--qk-layernorm``)   same (``[kv_channels]``, replicated)
``...pre_mlp_layernorm.*``, ``...mlp.linear_fc1.layer_norm_*``  ``...pre_mlp_layernorm.*``
``...mlp.linear_fc1.{weight,bias}``                           same (dim 0; SwiGLU: ``[gate; up]`` per rank)
``...mlp.linear_fc2.weight`` / ``.bias``                      same (TP dim 1 / replicated)
``decoder.final_layernorm.*``                                 same
``output_layer.weight``                                       same when untied; the tied copy is skipped
``...mlp.router.weight`` / ``.expert_bias``, ``...mlp.shared_experts.*``  same (replicated; shared MLP split as an MLP)
``...mlp.experts.local_experts.N.linear_fcK.weight``          ``...mlp.experts.linear_fcK.weight[e]`` (``[E, ...]``,
``...mlp.experts.linear_fcK.weightN`` (grouped)                 ``e`` = EP rank x local experts + ``N``)
``...self_attention.linear_q_proj`` / ``linear_q_up_proj`` /   same (MLA, ``--multi-latent-attention``: up
``linear_kv_up_proj.weight``                                    projections column-parallel, dim 0)
``...self_attention.linear_{q,kv}_down_proj.weight``          same (replicated; TP=1 only, see ``args``)
``...self_attention.{q,kv}_layernorm.weight``, TE's fused     ``...self_attention.{q,kv}_layernorm.weight``
``linear_{q,kv}_up_proj.layer_norm_weight``
``mtp.layers.k.{enorm,hnorm,final_layernorm}.weight``         same (MTP, ``--mtp-num-layers``; replicated)
``mtp.layers.k.eh_proj.weight``                               same (column-parallel)
``mtp.layers.k.transformer_layer.*`` (0.16; later             ``mtp.layers.k.mtp_model_layer.*`` (mapped as
``mtp_model_layer.*``)                                          a decoder layer's rest)
``*._extra_state``                                            skipped (Transformer-Engine FP8 metadata)
==========================================================  ===========================================

Legacy Megatron-LM (``megatron/legacy/model``, nested under ``language_model``; formats.md 5.3):
``embedding.word_embeddings`` / ``position_embeddings``, ``encoder.`` (older: ``transformer.``)
``layers.i.input_norm`` (older ``input_layernorm``), ``self_attention.query_key_value`` (older
``attention.``), ``self_attention.dense``, ``post_attention_norm`` (older ``post_attention_layernorm``),
``mlp.dense_h_to_4h``, ``mlp.dense_4h_to_h``, ``final_norm`` (older ``final_layernorm``),
``output_layer``; ``word_embeddings_for_head`` is the tied copy on the last stage (skipped).

Split kinds (formats.md 5.5): ``replicated``; ``column`` (dim 0: contiguous row blocks); ``row`` (dim 1);
``vocab`` (dim 0, padded vocabulary); ``qkv`` (dim 0, whole query groups per rank); ``swiglu`` (dim 0,
each rank holds ``[gate_t; up_t]``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

REPLICATED, COLUMN, ROW, VOCAB, QKV, SWIGLU = "replicated", "column", "row", "vocab", "qkv", "swiglu"


class UnsupportedTensor(ValueError):
    """A Megatron tensor mcore has no place for (MoE experts, MLA, ...)."""


@dataclass(frozen=True)
class Target:
    """Where a Megatron tensor goes: the mcore logical name and its TP split kind."""

    name: str
    split: str
    expert: int | None = None
    """A routed expert's tensor: its (local) expert index, dim 0 of the logical ``[E, ...]`` tensor."""


_LAYER_PARAMS = {
    # megatron-core local spec
    "input_layernorm.weight": ("input_layernorm.weight", REPLICATED),
    "input_layernorm.bias": ("input_layernorm.bias", REPLICATED),
    "self_attention.linear_qkv.weight": ("self_attention.linear_qkv.weight", QKV),
    "self_attention.linear_qkv.bias": ("self_attention.linear_qkv.bias", QKV),
    "self_attention.linear_proj.weight": ("self_attention.linear_proj.weight", ROW),
    "self_attention.linear_proj.bias": ("self_attention.linear_proj.bias", REPLICATED),
    # --qk-layernorm: one [kv_channels] weight per layer, shared by all heads (local and TE specs)
    "self_attention.q_layernorm.weight": ("self_attention.q_layernorm.weight", REPLICATED),
    "self_attention.q_layernorm.bias": ("self_attention.q_layernorm.bias", REPLICATED),
    "self_attention.k_layernorm.weight": ("self_attention.k_layernorm.weight", REPLICATED),
    "self_attention.k_layernorm.bias": ("self_attention.k_layernorm.bias", REPLICATED),
    "pre_mlp_layernorm.weight": ("pre_mlp_layernorm.weight", REPLICATED),
    "pre_mlp_layernorm.bias": ("pre_mlp_layernorm.bias", REPLICATED),
    # multi-latent attention: the down projections and their norms replicated, the up projections by heads
    "self_attention.linear_q_proj.weight": ("self_attention.linear_q_proj.weight", COLUMN),
    "self_attention.linear_q_down_proj.weight": ("self_attention.linear_q_down_proj.weight", REPLICATED),
    "self_attention.linear_q_up_proj.weight": ("self_attention.linear_q_up_proj.weight", COLUMN),
    "self_attention.linear_kv_down_proj.weight": ("self_attention.linear_kv_down_proj.weight", REPLICATED),
    "self_attention.linear_kv_up_proj.weight": ("self_attention.linear_kv_up_proj.weight", COLUMN),
    "self_attention.kv_layernorm.weight": ("self_attention.kv_layernorm.weight", REPLICATED),
    "self_attention.linear_q_up_proj.layer_norm_weight": ("self_attention.q_layernorm.weight", REPLICATED),
    "self_attention.linear_kv_up_proj.layer_norm_weight": ("self_attention.kv_layernorm.weight", REPLICATED),
    # mixture of experts (--num-experts): the router, the shared expert, mcore's stacked expert tensors
    "mlp.router.weight": ("mlp.router.weight", REPLICATED),
    "mlp.router.expert_bias": ("mlp.router.expert_bias", REPLICATED),
    "mlp.shared_experts.linear_fc1.weight": ("mlp.shared_experts.linear_fc1.weight", COLUMN),
    "mlp.shared_experts.linear_fc2.weight": ("mlp.shared_experts.linear_fc2.weight", ROW),
    "mlp.shared_experts.gate_weight": ("mlp.shared_experts.gate_weight", REPLICATED),
    "mlp.experts.linear_fc1.weight": ("mlp.experts.linear_fc1.weight", COLUMN),
    "mlp.experts.linear_fc2.weight": ("mlp.experts.linear_fc2.weight", ROW),
    # torch_dist: SequentialMLP's sharded key of all experts (the global-expert axis after the layer axis)
    "mlp.experts.experts.linear_fc1.weight": ("mlp.experts.linear_fc1.weight", COLUMN),
    "mlp.experts.experts.linear_fc2.weight": ("mlp.experts.linear_fc2.weight", ROW),
    "mlp.linear_fc1.weight": ("mlp.linear_fc1.weight", COLUMN),
    "mlp.linear_fc1.bias": ("mlp.linear_fc1.bias", COLUMN),
    "mlp.linear_fc2.weight": ("mlp.linear_fc2.weight", ROW),
    "mlp.linear_fc2.bias": ("mlp.linear_fc2.bias", REPLICATED),
    # Transformer-Engine spec: the norms are fused into the next linear
    "self_attention.linear_qkv.layer_norm_weight": ("input_layernorm.weight", REPLICATED),
    "self_attention.linear_qkv.layer_norm_bias": ("input_layernorm.bias", REPLICATED),
    "mlp.linear_fc1.layer_norm_weight": ("pre_mlp_layernorm.weight", REPLICATED),
    "mlp.linear_fc1.layer_norm_bias": ("pre_mlp_layernorm.bias", REPLICATED),
    # legacy Megatron-LM
    "input_norm.weight": ("input_layernorm.weight", REPLICATED),
    "input_norm.bias": ("input_layernorm.bias", REPLICATED),
    "self_attention.query_key_value.weight": ("self_attention.linear_qkv.weight", QKV),
    "self_attention.query_key_value.bias": ("self_attention.linear_qkv.bias", QKV),
    "self_attention.dense.weight": ("self_attention.linear_proj.weight", ROW),
    "self_attention.dense.bias": ("self_attention.linear_proj.bias", REPLICATED),
    "post_attention_norm.weight": ("pre_mlp_layernorm.weight", REPLICATED),
    "post_attention_norm.bias": ("pre_mlp_layernorm.bias", REPLICATED),
    "post_attention_layernorm.weight": ("pre_mlp_layernorm.weight", REPLICATED),
    "post_attention_layernorm.bias": ("pre_mlp_layernorm.bias", REPLICATED),
    "mlp.dense_h_to_4h.weight": ("mlp.linear_fc1.weight", COLUMN),
    "mlp.dense_h_to_4h.bias": ("mlp.linear_fc1.bias", COLUMN),
    "mlp.dense_4h_to_h.weight": ("mlp.linear_fc2.weight", ROW),
    "mlp.dense_4h_to_h.bias": ("mlp.linear_fc2.bias", REPLICATED),
}

_TOP_PARAMS = {
    "embedding.word_embeddings.weight": ("embedding.word_embeddings.weight", VOCAB),
    "embedding.position_embeddings.weight": ("embedding.position_embeddings.weight", REPLICATED),
    "decoder.final_layernorm.weight": ("decoder.final_layernorm.weight", REPLICATED),
    "decoder.final_layernorm.bias": ("decoder.final_layernorm.bias", REPLICATED),
    "output_layer.weight": ("output_layer.weight", VOCAB),
}

_LEGACY_TOP = {
    "language_model.embedding.word_embeddings.weight": "embedding.word_embeddings.weight",
    "language_model.embedding.position_embeddings.weight": "embedding.position_embeddings.weight",
    "language_model.output_layer.weight": "output_layer.weight",
    "word_embeddings_for_head.weight": "output_layer.weight",
}

_UNSUPPORTED = (("experts", "this mixture-of-experts tensor layout"),)

_MTP_PARAMS = {
    "enorm.weight": REPLICATED,
    "hnorm.weight": REPLICATED,
    "eh_proj.weight": COLUMN,
    "final_layernorm.weight": REPLICATED,
    "final_layernorm.bias": REPLICATED,
}
"""An MTP depth's own tensors (megatron-core's ``MultiTokenPredictionLayer``; mcore's same names)."""
MTP_LAYER_NAMES = ("transformer_layer.", "mtp_model_layer.")
"""megatron-core 0.16's name of an MTP depth's transformer layer, and the later (and mcore's) one."""
_MTP = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")

_EXPERT_PARAM = re.compile(
    r"^mlp\.experts\.(?:local_experts\.(?P<n>\d+)\.(?P<fc>linear_fc[12])\.weight"
    r"|(?P<gfc>linear_fc[12])\.weight(?P<gn>\d+))$"
)
"""megatron-core's routed experts: ``local_experts.N.linear_fcK.weight`` (SequentialMLP) or the
grouped ``linear_fcK.weightN`` (TEGroupedMLP); ``N`` is the expert's index on its EP rank."""
_MCORE_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_LEGACY_LAYER = re.compile(r"^language_model\.(?:encoder|transformer)\.layers\.(\d+)\.(.+)$")
_LEGACY_FINAL = re.compile(
    r"^language_model\.(?:encoder|transformer)\.(final_norm|final_layernorm)\.(weight|bias)$"
)


def is_skipped(key: str) -> bool:
    """Entries that hold no weights: Transformer-Engine ``_extra_state`` blobs and derived buffers."""
    return key.endswith("._extra_state") or key.endswith("rotary_pos_emb.inv_freq")


def _refuse_unknown(key: str) -> UnsupportedTensor:
    for part, what in _UNSUPPORTED:
        if part in key:
            return UnsupportedTensor(f"tensor {key!r}: {what} is not implemented in mcore")
    return UnsupportedTensor(f"tensor {key!r} has no mcore counterpart (an architecture mcore lacks?)")


def map_layer_param(rest: str, swiglu: bool) -> tuple[str, str]:
    """``(mcore suffix, split kind)`` of a layer parameter's name after ``layers.i.``."""
    rest = rest.replace("attention.", "self_attention.", 1) if rest.startswith("attention.") else rest
    found = _LAYER_PARAMS.get(rest)
    if found is None:
        raise _refuse_unknown(rest)
    suffix, split = found
    fc1 = suffix.startswith("mlp.linear_fc1.") or suffix.endswith("experts.linear_fc1.weight")
    if swiglu and fc1 and split == COLUMN:
        split = SWIGLU
    return suffix, split


def map_expert_param(rest: str, swiglu: bool) -> tuple[str, str, int] | None:
    """``(mcore suffix, split kind, local expert index)`` of a routed expert's Megatron name, else None."""
    match = _EXPERT_PARAM.match(rest)
    if match is None:
        return None
    fc = match.group("fc") or match.group("gfc")
    n = int(match.group("n") if match.group("n") is not None else match.group("gn"))
    split = ROW if fc == "linear_fc2" else SWIGLU if swiglu else COLUMN
    return f"mlp.experts.{fc}.weight", split, n


def mtp_split(rest: str) -> str:
    """The TP split kind of an MTP depth's own tensor (``enorm.weight``, ``eh_proj.weight``, ...)."""
    return _MTP_PARAMS[rest]


def _layer_target(prefix: str, rest: str, swiglu: bool) -> Target:
    """A transformer layer's tensor (a decoder layer's or an MTP depth's) under ``prefix``."""
    expert = map_expert_param(rest, swiglu)
    if expert is not None:
        suffix, split, n = expert
        return Target(prefix + suffix, split, n)
    suffix, split = map_layer_param(rest, swiglu)
    return Target(prefix + suffix, split)


def map_name(key: str, layer_offset: int, *, swiglu: bool, tied: bool) -> Target | None:
    """The mcore target of a flat Megatron state-dict key (stage-local layer numbers plus
    ``layer_offset``); None for entries to skip (``_extra_state``, the tied output copy).

    Raises:
        UnsupportedTensor: a tensor of an architecture mcore lacks, naming the key.
    """
    if is_skipped(key):
        return None
    match = _MCORE_LAYER.match(key) or _LEGACY_LAYER.match(key)
    if match:
        return _layer_target(f"decoder.layers.{int(match.group(1)) + layer_offset}.", match.group(2), swiglu)
    mtp = _MTP.match(key)
    if mtp:  # MTP depths sit on the last stage with global depth numbers
        prefix, rest = f"mtp.layers.{mtp.group(1)}.", mtp.group(2)
        if rest in _MTP_PARAMS:
            return Target(prefix + rest, _MTP_PARAMS[rest])
        for layer in MTP_LAYER_NAMES:
            if rest.startswith(layer):
                return _layer_target(prefix + "mtp_model_layer.", rest[len(layer) :], swiglu)
        raise _refuse_unknown(key)
    legacy_final = _LEGACY_FINAL.match(key)
    if legacy_final:
        return Target(f"decoder.final_layernorm.{legacy_final.group(2)}", REPLICATED)
    name = _LEGACY_TOP.get(key, key)
    found = _TOP_PARAMS.get(name)
    if found is None:
        raise _refuse_unknown(key)
    if name == "output_layer.weight" and tied:
        return None  # the last stage's copy of the tied word embedding
    return Target(*found)


def flatten_state(tree: dict, prefix: str = "") -> dict:
    """Nested legacy state dicts (``model['language_model']['embedding'][...]``) -> dotted keys."""
    out = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten_state(v, key + "."))
        else:
            out[key] = v
    return out


def local_layer_count(keys) -> int:
    """Layers in one pipeline stage's state dict (the highest stage-local layer number + 1)."""
    top = -1
    for key in keys:
        match = _MCORE_LAYER.match(key) or _LEGACY_LAYER.match(key)
        if match:
            top = max(top, int(match.group(1)))
    return top + 1
