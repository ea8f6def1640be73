"""Hugging Face ``T5ForConditionalGeneration`` (T5 v1.1 / mT5) <-> mcore :class:`~mcore.models.t5.t5_model.T5Model`.

Only the Hugging Face T5 v1.1 variant converts: relative position buckets
(``--position-embedding-type relative``), RMSNorm, no biases (``--disable-bias-linear``), gated GeLU
with the tanh approximation (``--geglu --openai-gelu``: HF ``feed_forward_proj="gated-gelu"``, whose
activation is ``gelu_new``) and an untied output layer (``--untie-embeddings-and-output-weights``;
HF's tied T5 multiplies the decoder output by ``d_model**-0.5``, which mcore's T5 does not).
Megatron's T5 variant is refused for export by :func:`check_t5_exportable`, with the reason: its
learned absolute positions, LayerNorm and biases have no place in Hugging Face's T5.

Weights (``i`` a layer; HF's ``layer.k`` index: encoder 0 = self-attention, 1 = MLP; decoder
0 = self-attention, 1 = cross-attention, 2 = MLP)::

    embedding.word_embeddings.weight [Vp, h]        shared.weight [V, h] (padding rows dropped)
    lm_head.output_layer.weight [Vp, h]             lm_head.weight [V, h]
    encoder_relative_pos_emb.relative_attention_bias.weight [B, n]
                                                    encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight
    decoder_relative_pos_emb...                     decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight
    {enc,dec}oder.layers.i.input_layernorm.weight   {enc,dec}oder.block.i.layer.0.layer_norm.weight
    ....self_attention.linear_qkv.weight [3nd, h]   ...layer.0.SelfAttention.{q,k,v}.weight [nd, h]
                                                    (mcore packs [q_j; k_j; v_j] per head j)
    ....self_attention.linear_proj.weight           ...layer.0.SelfAttention.o.weight
    decoder.layers.i.pre_cross_attn_layernorm       decoder.block.i.layer.1.layer_norm.weight
    ....cross_attention.linear_q.weight             ...layer.1.EncDecAttention.q.weight
    ....cross_attention.linear_kv.weight [2nd, h]   ...layer.1.EncDecAttention.{k,v}.weight ([k_j; v_j] per head)
    ....cross_attention.linear_proj.weight          ...layer.1.EncDecAttention.o.weight
    ....pre_mlp_layernorm.weight                    ...layer.{1 enc, 2 dec}.layer_norm.weight
    ....mlp.linear_fc1.weight [2F, h] = [gate; up]  ...DenseReluDense.wi_0 (gate, gelu'd), wi_1 (up)
    ....mlp.linear_fc2.weight                       ...DenseReluDense.wo
    {enc,dec}oder.final_layernorm.weight            {enc,dec}oder.final_layer_norm.weight

Attention: HF T5 does not scale the scores by ``1/sqrt(d)``; mcore's relative-position T5 does not
either (:class:`~mcore.models.t5.t5_layers.T5CoreAttention`), so the weights map unchanged.

Parity (:func:`check_t5_parity`): both models in fp32 on a fixed batch with encoder padding; the
largest difference of the encoder output and of the decoder logits must be within the tolerance
(1e-4), and greedy ``generate`` must give the same tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from mcore.hf.errors import ConversionError, ParityError
from mcore.hf.family import HfFamily
from mcore.hf.tensors import merge_qkv, split_qkv
from mcore.models.transformer.model_config import ModelConfig

T5 = "t5"
T5_ARCHITECTURE = "T5ForConditionalGeneration"
HF_WORD_KEY = "shared.weight"
WORD = "embedding.word_embeddings.weight"
OUTPUT = "lm_head.output_layer.weight"
DEFAULT_TOLERANCE = 1e-4


def is_t5_state(names) -> bool:
    """A logical state of an mcore T5 (it has encoder layers)."""
    return any(name.startswith("encoder.layers.") for name in names)


def is_t5_hf_config(hf: Mapping[str, Any]) -> bool:
    return hf.get("model_type") in ("t5", "mt5") or any(
        a in (T5_ARCHITECTURE, "MT5ForConditionalGeneration") for a in hf.get("architectures") or ()
    )


# -- configs ----------------------------------------------------------------------------------------


def check_t5_exportable(cfg: ModelConfig) -> str:
    """Refuse an mcore T5 that Hugging Face's T5 cannot hold exactly (one message with every reason)."""
    if cfg.position_embedding_type != "relative":
        megatron = [
            f"position_embedding_type={cfg.position_embedding_type!r} (HF T5 has relative position buckets, "
            "no position table)"
        ]
        if cfg.normalization != "RMSNorm":
            megatron.append(f"normalization={cfg.normalization!r} (HF T5's norm is RMSNorm)")
        if cfg.add_bias_linear:
            megatron.append("biases in the linear layers (HF T5 has none)")
        raise ConversionError(
            "cannot export Megatron's T5 variant to T5ForConditionalGeneration: "
            + "; ".join(megatron)
            + ". Only the Hugging Face T5 v1.1 variant exports (--position-embedding-type relative "
            "--normalization RMSNorm --disable-bias-linear --geglu --openai-gelu "
            "--untie-embeddings-and-output-weights)"
        )
    problems = []
    if cfg.normalization != "RMSNorm":
        problems.append(f"normalization={cfg.normalization!r} (HF T5 uses RMSNorm)")
    if cfg.add_bias_linear:
        problems.append("add_bias_linear=True (HF T5 has no biases; add --disable-bias-linear)")
    if not (cfg.geglu and cfg.openai_gelu):
        problems.append(
            "the MLP is not the tanh-approximated gated GeLU (HF 'gated-gelu' is gelu_new; "
            "use --geglu --openai-gelu)"
        )
    if cfg.share_embeddings_and_output_weights:
        problems.append(
            "tied output layer (HF T5 with tie_word_embeddings scales the decoder output by "
            "d_model**-0.5; train with --untie-embeddings-and-output-weights)"
        )
    if cfg.apply_residual_connection_post_layernorm:
        problems.append("apply_residual_connection_post_layernorm=True (HF T5 is pre-norm)")
    if cfg.num_query_groups != cfg.num_attention_heads:
        problems.append("grouped-query attention (HF T5 has none)")
    if problems:
        raise ConversionError(f"cannot export to {T5_ARCHITECTURE} exactly: " + "; ".join(problems))
    return T5


def t5_hf_config_dict(
    cfg: ModelConfig,
    vocab_size: int,
    *,
    eos_token_id: int | None,
    pad_token_id: int | None,
    dtype: str = "float32",
    **_ignored: Any,
) -> dict[str, Any]:
    """The ``config.json`` of the ``T5ForConditionalGeneration`` equivalent to ``cfg``."""
    check_t5_exportable(cfg)
    pad = 0 if pad_token_id is None else pad_token_id
    for name, value in (("eos_token_id", eos_token_id), ("pad_token_id", pad)):
        if value is not None and not 0 <= value < vocab_size:
            raise ConversionError(f"{name}={value} is outside the vocabulary [0, {vocab_size})")
    return {
        "architectures": [T5_ARCHITECTURE],
        "model_type": T5,
        "vocab_size": vocab_size,
        "d_model": cfg.hidden_size,
        "d_kv": cfg.kv_channels,
        "d_ff": cfg.ffn_hidden_size,
        "num_layers": cfg.encoder_num_layers,
        "num_decoder_layers": cfg.decoder_num_layers,
        "num_heads": cfg.num_attention_heads,
        "relative_attention_num_buckets": cfg.relative_attention_num_buckets,
        "relative_attention_max_distance": cfg.relative_attention_max_distance,
        "dropout_rate": cfg.hidden_dropout,
        "layer_norm_epsilon": cfg.norm_epsilon,
        "initializer_factor": 1.0,
        "feed_forward_proj": "gated-gelu",
        "is_encoder_decoder": True,
        "tie_word_embeddings": False,
        "use_cache": True,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad,
        "decoder_start_token_id": pad,
        "dtype": dtype,
    }


def t5_model_config_from_hf(
    hf: Mapping[str, Any], where: str = "config.json", **overrides: Any
) -> ModelConfig:
    """The mcore :class:`ModelConfig` of a T5 v1.1 / mT5 ``config.json`` (refusing what does not convert)."""
    proj = hf.get("feed_forward_proj", "relu")
    if proj != "gated-gelu":
        raise ConversionError(
            f"{where}: feed_forward_proj={proj!r}: mcore's T5 MLP is the gated GeLU of T5 v1.1 / mT5 "
            "('gated-gelu'); the original T5's ReLU MLP is not implemented"
        )
    # transformers < 5 scales the decoder output by d_model**-0.5 when tie_word_embeddings is not false;
    # transformers 5 writes that choice as scale_decoder_outputs (and always ties the weights unless
    # the checkpoint holds its own lm_head.weight)
    scale = hf.get("scale_decoder_outputs")
    if scale is None:
        scale = hf.get("tie_word_embeddings", True) is not False
    if scale:
        raise ConversionError(
            f"{where}: the decoder output is scaled by d_model**-0.5 (tie_word_embeddings is not false, or "
            "scale_decoder_outputs is true), which mcore's T5 does not do; only T5 v1.1 / mT5 models convert"
        )
    if hf.get("is_decoder") or not hf.get("is_encoder_decoder", True):
        raise ConversionError(f"{where}: not an encoder-decoder T5 (is_decoder / is_encoder_decoder)")
    try:
        kwargs = dict(
            encoder_num_layers=hf["num_layers"],
            decoder_num_layers=hf.get("num_decoder_layers") or hf["num_layers"],
            hidden_size=hf["d_model"],
            num_attention_heads=hf["num_heads"],
            kv_channels=hf["d_kv"],
            ffn_hidden_size=hf["d_ff"],
            position_embedding_type="relative",
            relative_attention_num_buckets=hf.get("relative_attention_num_buckets", 32),
            relative_attention_max_distance=hf.get("relative_attention_max_distance", 128),
            normalization="RMSNorm",
            norm_epsilon=hf.get("layer_norm_epsilon", 1e-6),
            disable_bias_linear=True,
            geglu=True,
            openai_gelu=True,
            untie_embeddings_and_output_weights=True,
            hidden_dropout=float(hf.get("dropout_rate", 0.1)),
            attention_dropout=float(hf.get("dropout_rate", 0.1)),
            init_method_std=0.02 * float(hf.get("initializer_factor", 1.0)),
        )
    except KeyError as err:
        raise ConversionError(f"{where}: not a T5 config: missing {err}") from None
    kwargs.update(overrides)
    return ModelConfig(**kwargs)


# -- weights ----------------------------------------------------------------------------------------


def _layer_pairs(cfg: ModelConfig) -> list[tuple[str, str]]:
    """``(mcore name, HF name)`` of every tensor except the vocabulary ones and the packed projections."""
    pairs = [
        (
            "encoder_relative_pos_emb.relative_attention_bias.weight",
            "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
        ),
        (
            "decoder_relative_pos_emb.relative_attention_bias.weight",
            "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
        ),
        ("encoder.final_layernorm.weight", "encoder.final_layer_norm.weight"),
        ("decoder.final_layernorm.weight", "decoder.final_layer_norm.weight"),
    ]
    for stack, layers, mlp in (
        ("encoder", cfg.encoder_num_layers, 1),
        ("decoder", cfg.decoder_num_layers, 2),
    ):
        for i in range(layers):
            m, h = f"{stack}.layers.{i}.", f"{stack}.block.{i}.layer."
            pairs += [
                (m + "input_layernorm.weight", h + "0.layer_norm.weight"),
                (m + "self_attention.linear_proj.weight", h + "0.SelfAttention.o.weight"),
                (m + "pre_mlp_layernorm.weight", h + f"{mlp}.layer_norm.weight"),
                (m + "mlp.linear_fc2.weight", h + f"{mlp}.DenseReluDense.wo.weight"),
            ]
            if stack == "decoder":
                pairs += [
                    (m + "pre_cross_attn_layernorm.weight", h + "1.layer_norm.weight"),
                    (m + "cross_attention.linear_q.weight", h + "1.EncDecAttention.q.weight"),
                    (m + "cross_attention.linear_proj.weight", h + "1.EncDecAttention.o.weight"),
                ]
    return pairs


def _take(state: Mapping[str, torch.Tensor], name: str, where: str) -> torch.Tensor:
    if name not in state:
        raise ConversionError(f"{where} has no tensor {name}")
    return state[name]


def _packed(cfg: ModelConfig):
    """``(stack, i, mcore prefix, HF prefix, HF MLP index)`` of every layer."""
    for stack, layers, mlp in (
        ("encoder", cfg.encoder_num_layers, 1),
        ("decoder", cfg.decoder_num_layers, 2),
    ):
        for i in range(layers):
            yield stack, f"{stack}.layers.{i}.", f"{stack}.block.{i}.layer.", mlp


def t5_mcore_to_hf(
    state: Mapping[str, torch.Tensor], cfg: ModelConfig, vocab_size: int
) -> dict[str, torch.Tensor]:
    """The Hugging Face T5 state dict of an mcore T5 logical state (vocabulary rows cut to ``vocab_size``)."""
    check_t5_exportable(cfg)
    where = "the mcore checkpoint"
    n, d = cfg.num_attention_heads, cfg.kv_channels
    used = {WORD, OUTPUT}
    out = {
        "shared.weight": _take(state, WORD, where)[:vocab_size],
        "lm_head.weight": _take(state, OUTPUT, where)[:vocab_size],
    }
    for mcore_name, hf_name in _layer_pairs(cfg):
        out[hf_name] = _take(state, mcore_name, where)
        used.add(mcore_name)
    for stack, m, h, mlp in _packed(cfg):
        q, k, v = split_qkv(_take(state, m + "self_attention.linear_qkv.weight", where), n, n, d)
        out[h + "0.SelfAttention.q.weight"], out[h + "0.SelfAttention.k.weight"] = q, k
        out[h + "0.SelfAttention.v.weight"] = v
        gate, up = _take(state, m + "mlp.linear_fc1.weight", where).chunk(2, dim=0)
        out[h + f"{mlp}.DenseReluDense.wi_0.weight"] = gate
        out[h + f"{mlp}.DenseReluDense.wi_1.weight"] = up
        used |= {m + "self_attention.linear_qkv.weight", m + "mlp.linear_fc1.weight"}
        if stack == "decoder":
            kv = _take(state, m + "cross_attention.linear_kv.weight", where).reshape(n, 2, d, -1)
            out[h + "1.EncDecAttention.k.weight"] = kv[:, 0].reshape(n * d, -1)
            out[h + "1.EncDecAttention.v.weight"] = kv[:, 1].reshape(n * d, -1)
            used.add(m + "cross_attention.linear_kv.weight")
    leftovers = sorted(set(state) - used)
    if leftovers:
        raise ConversionError(f"{where} has tensors HF's T5 cannot hold: {', '.join(leftovers[:8])}")
    return {k: v.contiguous() for k, v in out.items()}


def t5_hf_to_mcore(
    hf_state: Mapping[str, torch.Tensor], cfg: ModelConfig, padded_vocab_size: int
) -> dict[str, torch.Tensor]:
    """The mcore T5 logical state of a Hugging Face T5 state dict (vocabulary rows zero-padded)."""
    where = "the Hugging Face checkpoint"
    n, d = cfg.num_attention_heads, cfg.kv_channels

    def padded(t: torch.Tensor) -> torch.Tensor:
        extra = padded_vocab_size - t.shape[0]
        return torch.cat([t, t.new_zeros(extra, *t.shape[1:])]) if extra > 0 else t

    shared = _take(hf_state, "shared.weight", where)
    # a checkpoint without lm_head.weight shares it with shared.weight (transformers 5 ties them)
    out = {WORD: padded(shared), OUTPUT: padded(hf_state.get("lm_head.weight", shared))}
    used = {"shared.weight", "lm_head.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight"}
    for mcore_name, hf_name in _layer_pairs(cfg):
        out[mcore_name] = _take(hf_state, hf_name, where)
        used.add(hf_name)
    for stack, m, h, mlp in _packed(cfg):
        names = [h + f"0.SelfAttention.{x}.weight" for x in "qkv"]
        q, k, v = (_take(hf_state, name, where) for name in names)
        out[m + "self_attention.linear_qkv.weight"] = merge_qkv(q, k, v, n, n, d)
        wi = [h + f"{mlp}.DenseReluDense.wi_{j}.weight" for j in (0, 1)]
        out[m + "mlp.linear_fc1.weight"] = torch.cat([_take(hf_state, name, where) for name in wi])
        used |= {*names, *wi}
        if stack == "decoder":
            kv_names = [h + f"1.EncDecAttention.{x}.weight" for x in "kv"]
            k, v = (_take(hf_state, name, where).reshape(n, 1, d, -1) for name in kv_names)
            out[m + "cross_attention.linear_kv.weight"] = torch.cat([k, v], dim=1).reshape(2 * n * d, -1)
            used |= set(kv_names)
    leftovers = sorted(set(hf_state) - used)
    if leftovers:
        raise ConversionError(f"{where} has tensors mcore's T5 does not know: {', '.join(leftovers[:8])}")
    return out


# -- parity -----------------------------------------------------------------------------------------


@dataclass
class T5ParityReport:
    """Encoder-output and decoder-logit differences, and the greedy ``generate`` comparison."""

    encoder_max_abs_diff: float
    logits_max_abs_diff: float
    generate_equal: bool
    tolerance: float = DEFAULT_TOLERANCE
    mcore_tokens: list[list[int]] = field(default_factory=list)
    hf_tokens: list[list[int]] = field(default_factory=list)
    weights_dtype: str | None = None

    @property
    def max_abs_diff(self) -> float:
        return max(self.encoder_max_abs_diff, self.logits_max_abs_diff)

    @property
    def ok(self) -> bool:
        return self.max_abs_diff <= self.tolerance and self.generate_equal

    def describe(self) -> str:
        return (
            f"T5 parity: encoder output max |diff| {self.encoder_max_abs_diff:.3g}, decoder logits max |diff| "
            f"{self.logits_max_abs_diff:.3g} (tolerance {self.tolerance:g}); greedy generate "
            f"{'equal' if self.generate_equal else 'DIFFERS'} ({self.mcore_tokens} vs {self.hf_tokens})"
            + (f"; both sides' weights rounded to {self.weights_dtype}" if self.weights_dtype else "")
        )


def _load_hf_t5(hf_dir: str, round_to: torch.dtype | None):
    from mcore.hf.parity import load_hf_model

    # quiet: transformers 5 warns about the (intended) untied lm_head
    return load_hf_model("T5ForConditionalGeneration", hf_dir, round_to=round_to, quiet=True)


@torch.no_grad()
def check_t5_parity(
    cfg: ModelConfig,
    state: Mapping[str, torch.Tensor],
    vocab_size: int,
    hf_dir: str,
    *,
    tolerance: float = DEFAULT_TOLERANCE,
    round_to: torch.dtype | None = None,
    max_new_tokens: int = 8,
    raise_on_failure: bool = True,
    **_ignored: Any,
) -> T5ParityReport:
    """Compare the mcore T5 (``cfg`` + logical ``state``, fp32, CPU) with the HF model in ``hf_dir``.

    The batch: 2 encoder sequences of 12 ids (the second padded after 7), 2 decoder sequences of 8.
    Greedy generation starts from the HF config's ``decoder_start_token_id`` and stops at its
    ``eos_token_id`` (or after ``max_new_tokens``).

    Raises:
        ParityError: a difference above ``tolerance`` or different generated tokens.
    """
    from mcore.distributed.groups import ProcessGroups
    from mcore.inference.loading import load_logical_state
    from mcore.inference.t5_generation import T5TextGenerator
    from mcore.models.t5.t5_model import T5Model
    from mcore.models.transformer.model_config import padded_vocab_size

    theirs = _load_hf_t5(hf_dir, round_to)
    padded = padded_vocab_size(vocab_size, cfg.make_vocab_size_divisible_by, 1)
    ours = T5Model(cfg, ProcessGroups.single(), padded, device=torch.device("cpu")).eval()
    load_logical_state(ours, {k: v.float() for k, v in state.items()}, vocab_size)

    gen = torch.Generator().manual_seed(0)
    enc = torch.randint(0, vocab_size, (2, 12), generator=gen)
    dec = torch.randint(0, vocab_size, (2, 8), generator=gen)
    keep = torch.ones(2, 12, dtype=torch.long)
    keep[1, 7:] = 0
    key_mask = (keep == 0)[:, None, None, :]
    encoded = ours.encode(enc, key_mask)  # [s, b, h]
    logits = ours(enc, dec, key_mask, None, key_mask, encoder_hidden_states=encoded)[..., :vocab_size]
    out = theirs(input_ids=enc, attention_mask=keep, decoder_input_ids=dec)
    enc_diff = float((out.encoder_last_hidden_state - encoded.transpose(0, 1)).abs().max())
    logit_diff = float((out.logits[..., :vocab_size] - logits).abs().max())

    eos, start = theirs.config.eos_token_id, theirs.config.decoder_start_token_id
    prompts = [enc[0].tolist(), enc[1, :7].tolist()]
    from mcore.inference.generation import SamplingParams

    generator = T5TextGenerator(
        ours, ProcessGroups.single(), vocab_size, eod=eos, decoder_start_token_id=start
    )
    mine = generator.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens, greedy=True)).tokens
    hf_out = theirs.generate(
        input_ids=enc,
        attention_mask=keep,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        num_beams=1,
        use_cache=False,  # transformers 5.24 sizes its cache by the encoder's layer count
    )
    hf_tokens = []
    for row in hf_out[:, 1:].tolist():  # drop the decoder start token
        hf_tokens.append(row[: row.index(eos) + 1] if eos in row else row)
    report = T5ParityReport(enc_diff, logit_diff, mine == hf_tokens, tolerance, mine, hf_tokens)
    if round_to is not None:
        report.weights_dtype = str(round_to).removeprefix("torch.")
    if raise_on_failure and not report.ok:
        raise ParityError("parity check FAILED: " + report.describe())
    return report


FAMILY = HfFamily(
    name=T5,
    architecture=T5_ARCHITECTURE,
    hf_word_key=HF_WORD_KEY,
    is_state=is_t5_state,
    is_hf_config=is_t5_hf_config,
    check_exportable=check_t5_exportable,
    hf_config_dict=t5_hf_config_dict,
    mcore_to_hf=t5_mcore_to_hf,
    model_config_from_hf=t5_model_config_from_hf,
    hf_to_mcore=t5_hf_to_mcore,
    check_parity=check_t5_parity,
)
"""T5 in the table of :mod:`mcore.hf.families`."""


__all__ = [
    "FAMILY",
    "T5_ARCHITECTURE",
    "T5ParityReport",
    "check_t5_exportable",
    "check_t5_parity",
    "is_t5_hf_config",
    "is_t5_state",
    "t5_hf_config_dict",
    "t5_hf_to_mcore",
    "t5_mcore_to_hf",
    "t5_model_config_from_hf",
]
