"""The models' configuration (Megatron-LM's model flags) and its checks against the layout.

One flag namespace, as Megatron's: the transformer's fields, and beside them the few that only one
family reads (T5's encoder/decoder sizes and relative positions, BERT's binary head), each group
marked. The ``--recompute-*`` names and their checks are in
:mod:`mcore.models.transformer.recompute_options`.

``ModelConfig`` resolves Megatron's derived defaults in ``__post_init__`` (``ffn_hidden_size``,
``kv_channels``, ``num_query_groups``, ``max_position_embeddings``), so a constructed config holds
concrete numbers. Note for ``dataclasses.replace``: derived fields keep their resolved values;
pass them again (or ``None``) when changing the sizes they derive from.

The vocabulary size is not a model flag: the tokenizer owns ``--vocab-size``; the model takes the
padded size from :func:`padded_vocab_size`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mcore.config.fields import ConfigError, check, flag
from mcore.config.parallel import ParallelConfig
from mcore.models.transformer.mla.config import MLAFlags, check_mla, check_mla_tensor_parallel
from mcore.models.transformer.moe.config import MoEConfig, MoEFlags, check_moe, check_moe_parallel, moe_view
from mcore.models.transformer.mtp.config import MTPFlags, check_mtp
from mcore.models.transformer.recompute_options import (
    RECOMPUTE_GRANULARITIES,
    RECOMPUTE_METHODS,
    check_recompute,
)

POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "alibi", "none", "relative")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")


def padded_vocab_size(
    vocab_size: int, make_vocab_size_divisible_by: int = 128, tensor_model_parallel_size: int = 1
) -> int:
    """Megatron's padded vocabulary: ``ceil(V / m) * m`` with ``m = divisible_by * tp``.

    GPT-2's 50257 gives 50304 at TP=1, 50432 at TP=2, 50688 at TP=4, 51200 at TP=8.
    """
    check(vocab_size >= 1, f"vocab_size={vocab_size} must be positive")
    check(
        make_vocab_size_divisible_by >= 1,
        f"make_vocab_size_divisible_by={make_vocab_size_divisible_by} must be positive",
    )
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    return int(math.ceil(vocab_size / multiple) * multiple)


@dataclass(frozen=True, kw_only=True)
class ModelConfig(MTPFlags, MLAFlags, MoEFlags):
    """GPT-style decoder: sizes, positions, attention, MLP, norms, initialization, dropout, recompute
    (and the mixture-of-experts flags of :class:`~mcore.models.transformer.moe.config.MoEFlags`, the
    multi-latent attention flags of :class:`~mcore.models.transformer.mla.config.MLAFlags`, the
    multi-token prediction flags of :class:`~mcore.models.transformer.mtp.config.MTPFlags`)."""

    # sizes
    num_layers: int | None = flag(None, "Number of transformer layers.")
    hidden_size: int | None = flag(None, "Transformer hidden size h.")
    ffn_hidden_size: int | None = flag(
        None, "MLP hidden size (default 4h; with --swiglu int(8h/3 / 64) * 64, as Megatron)."
    )
    num_attention_heads: int | None = flag(None, "Number of attention (query) heads.")
    kv_channels: int | None = flag(None, "Head dim (default hidden_size / num_attention_heads).")
    group_query_attention: bool = flag(False, "Use grouped-query attention (--num-query-groups KV heads).")
    num_query_groups: int | None = flag(
        None, "Key/value heads with --group-query-attention (default 1: multi-query)."
    )
    seq_length: int | None = flag(None, "Training sequence length.")
    max_position_embeddings: int | None = flag(
        None, "Rows of the learned position table / longest sequence (default --seq-length)."
    )

    # positions
    position_embedding_type: str = flag(
        "learned_absolute", "Position encoding.", choices=POSITION_EMBEDDING_TYPES
    )
    rotary_base: float = flag(10000.0, "RoPE base theta.")
    rotary_percent: float = flag(1.0, "Fraction of the head dim that RoPE rotates.")

    # layers
    normalization: str = flag("LayerNorm", "Norm layer.", choices=NORMALIZATIONS)
    norm_epsilon: float = flag(1e-5, "Epsilon of the norm layers.", aliases=("--layernorm-epsilon",))
    swiglu: bool = flag(False, "SwiGLU MLP (gated SiLU) instead of GeLU.")
    openai_gelu: bool = flag(False, "GeLU with the tanh approximation (GPT-2's gelu_new).")
    disable_bias_linear: bool = flag(False, "No biases in the linear layers.")
    add_qkv_bias: bool = flag(False, "Bias on the QKV projection even with --disable-bias-linear.")
    qk_layernorm: bool = flag(
        False,
        "Normalize each query and key head (--normalization over the head dim, weights "
        "self_attention.q_layernorm / k_layernorm [kv_channels]) after the QKV projection and before "
        "RoPE (Megatron's placement; Qwen3).",
    )
    qk_layernorm_full_width: bool = flag(
        False,
        "With --qk-layernorm: one norm over all query heads together (weight [heads x kv_channels]) and "
        "one over all key heads ([query groups x kv_channels]) instead of per head (OLMoE, OLMo 2); "
        "needs --tensor-model-parallel-size 1 (the norm spans every TP rank's heads).",
    )
    untie_embeddings_and_output_weights: bool = flag(
        False, "Separate output-layer weight instead of the word-embedding table."
    )
    apply_residual_connection_post_layernorm: bool = flag(
        False, "Residual taken after the norm (BERT-style) instead of before."
    )
    fp32_residual_connection: bool = flag(False, "Keep the residual stream in fp32.")
    apply_query_key_layer_scaling: bool = flag(
        False, "Accepted for Megatron scripts; no effect (the attention softmax is always fp32)."
    )
    make_vocab_size_divisible_by: int = flag(
        128, "Pad the vocabulary to a multiple of this times the TP size."
    )
    cross_entropy_loss_fusion: bool = flag(
        False,
        "Loss memory: keep only the logits for backward (no fp32 softmax with TP) and write their "
        "gradient into them (no second logits-sized tensor); mcore's fused vocab-parallel loss.",
    )
    output_layer_loss_chunks: int = flag(
        0,
        "Compute the output layer and loss over this many chunks of tokens and recompute each chunk's "
        "logits in backward, so the full logits never exist (saves s*b*V/p logits memory for one more "
        "output-layer GEMM); 0: off",
    )

    # T5 (encoder-decoder; :mod:`mcore.models.t5.t5_model`)
    encoder_num_layers: int | None = flag(
        None, "T5: encoder layers (default --num-layers; gives --num-layers when that is absent)."
    )
    decoder_num_layers: int | None = flag(None, "T5: decoder layers (default --num-layers).")
    encoder_seq_length: int | None = flag(
        None, "T5: encoder sequence length (default --seq-length; gives --seq-length when that is absent)."
    )
    decoder_seq_length: int | None = flag(None, "T5: decoder sequence length.")
    relative_attention_num_buckets: int = flag(
        32, "T5 relative positions (--position-embedding-type relative): number of buckets."
    )
    relative_attention_max_distance: int = flag(
        128, "T5 relative positions: distance beyond which every relative position shares one bucket."
    )
    geglu: bool = flag(
        False,
        "Gated GeLU MLP, gelu(x W_gate) * (x W_up) (Hugging Face T5 v1.1 / mT5 'gated-gelu'; the tanh "
        "approximation with --openai-gelu).",
    )

    # initialization and dropout
    init_method_std: float = flag(0.02, "Std of the normal init; output projections use std/sqrt(2L).")
    use_cpu_initialization: bool = flag(
        False, "Accepted for Megatron scripts; no effect (init never depends on the layout)."
    )
    hidden_dropout: float = flag(0.1, "Dropout on the embedding and residual branches.")
    attention_dropout: float = flag(0.1, "Dropout on the attention probabilities.")

    # activation recomputation
    recompute_granularity: str | None = flag(
        None,
        "Recompute activations: full layers or the core attention only.",
        choices=RECOMPUTE_GRANULARITIES,
    )
    recompute_method: str | None = flag(
        None,
        "Full recompute: uniform (chunks of N layers) or block (first N layers).",
        choices=RECOMPUTE_METHODS,
    )
    recompute_num_layers: int | None = flag(None, "N for --recompute-method (per pipeline stage/chunk).")
    recompute_modules: tuple[str, ...] | None = flag(
        None,
        "Selective recompute: which parts (default core_attn). core_attn: the core attention; "
        "layernorm: the input/pre-MLP norm outputs; mlp_act: the MLP activation output (fc2's "
        "input); mlp: the whole MLP. layernorm and mlp_act free the output and recompute it in "
        "backward (Megatron's output-discarding checkpoint).",
        nargs="+",
        metavar="MODULE",
    )

    # gradients
    gradient_accumulation_fusion: bool = flag(
        True,
        "Do not accumulate the linear layers' weight gradients into the DDP gradient buffer inside "
        "their backward GEMM (fused only where the buffer has the weight's dtype).",
        name="--no-gradient-accumulation-fusion",
    )

    # BERT
    bert_binary_head: bool = flag(
        True,
        "BERT without the binary (sentence-order) head, its pooler and its token types "
        "(Megatron's pretrain_bert.py); the loss is the masked-LM loss alone.",
        name="--bert-no-binary-head",
    )

    def __post_init__(self) -> None:
        self._resolve_encoder_decoder()
        for name in ("num_layers", "hidden_size", "num_attention_heads"):
            value = getattr(self, name)
            flag_ = "--" + name.replace("_", "-")
            check(value is not None, f"{name} must be given ({flag_})")
            check(isinstance(value, int) and value >= 1, f"{name}={value} must be a positive integer")
        check(
            self.position_embedding_type in POSITION_EMBEDDING_TYPES,
            f"position_embedding_type={self.position_embedding_type!r} is unknown; "
            f"choose one of {', '.join(POSITION_EMBEDDING_TYPES)}",
        )
        check(
            self.normalization in NORMALIZATIONS,
            f"normalization={self.normalization!r} is unknown; choose one of {', '.join(NORMALIZATIONS)}",
        )

        self._resolve_widths()
        self._resolve_positions()
        check(0.0 < self.rotary_percent <= 1.0, f"rotary_percent={self.rotary_percent} must be in (0, 1]")
        if self.position_embedding_type == "rope" and not self.multi_latent_attention:
            rot = self.kv_channels * self.rotary_percent
            check(
                rot == int(rot) and int(rot) % 2 == 0,
                f"kv_channels={self.kv_channels} x rotary_percent={self.rotary_percent} = {rot:g} "
                "must be an even integer (the rotated channels come in pairs)",
            )
            check(self.rotary_base > 0, f"rotary_base={self.rotary_base} must be positive")
        check(
            self.qk_layernorm or not self.qk_layernorm_full_width,
            "qk_layernorm_full_width=True (--qk-layernorm-full-width) needs qk_layernorm=True (--qk-layernorm)",
        )
        check(self.norm_epsilon > 0, f"norm_epsilon={self.norm_epsilon} must be positive")
        check(self.init_method_std > 0, f"init_method_std={self.init_method_std} must be positive")
        check(
            self.make_vocab_size_divisible_by >= 1,
            f"make_vocab_size_divisible_by={self.make_vocab_size_divisible_by} must be positive",
        )
        for name in ("hidden_dropout", "attention_dropout"):
            value = getattr(self, name)
            check(0.0 <= value < 1.0, f"{name}={value} must be in [0, 1)")
        chunks = self.output_layer_loss_chunks
        check(
            isinstance(chunks, int) and not isinstance(chunks, bool) and chunks >= 0,
            f"output_layer_loss_chunks={chunks!r} (--output-layer-loss-chunks) must be an integer >= 0 "
            "(0: off, N: the output layer and loss over N chunks of tokens)",
        )
        check_recompute(self)
        check_moe(self)  # also puts --moe-layer-freq in one spelling (printed flags parse back equal)
        check_mla(self)
        check_mtp(self)

    def _resolve_widths(self) -> None:
        """Megatron's derived widths: ``ffn_hidden_size`` (4h, or SwiGLU's 8h/3 rounded to 64),
        ``kv_channels`` (h/n, or MLA's query/key head dim), ``num_query_groups`` (n without GQA)."""
        h, n = self.hidden_size, self.num_attention_heads
        if self.ffn_hidden_size is None:
            self._set("ffn_hidden_size", int((4 * h * 2 / 3) / 64) * 64 if self.swiglu else 4 * h)
        check(self.ffn_hidden_size >= 1, f"ffn_hidden_size={self.ffn_hidden_size} must be positive")

        if self.kv_channels is None and self.multi_latent_attention:  # MLA's query/key head dim
            self._set("kv_channels", self.qk_head_dim + self.qk_pos_emb_head_dim)
        if self.kv_channels is None:
            check(
                h % n == 0,
                f"hidden_size={h} is not divisible by num_attention_heads={n}; give --kv-channels",
            )
            self._set("kv_channels", h // n)
        check(self.kv_channels >= 1, f"kv_channels={self.kv_channels} must be positive")

        if not self.group_query_attention:
            check(
                self.num_query_groups in (None, n),
                f"num_query_groups={self.num_query_groups} needs --group-query-attention",
            )
            self._set("num_query_groups", n)
        elif self.num_query_groups is None:
            self._set("num_query_groups", 1)
        g = self.num_query_groups
        check(g >= 1, f"num_query_groups={g} must be positive")
        check(n % g == 0, f"num_attention_heads={n} is not divisible by num_query_groups={g}")

    def _resolve_positions(self) -> None:
        """``max_position_embeddings`` defaults to ``seq_length``; learned positions need it."""
        if self.max_position_embeddings is None:
            self._set("max_position_embeddings", self.seq_length)
        if self.position_embedding_type == "learned_absolute":
            check(
                self.max_position_embeddings is not None,
                "learned_absolute positions need --max-position-embeddings (or --seq-length)",
            )
        if self.seq_length is not None and self.max_position_embeddings is not None:
            check(
                self.seq_length <= self.max_position_embeddings,
                f"seq_length={self.seq_length} exceeds max_position_embeddings={self.max_position_embeddings}",
            )

    def _resolve_encoder_decoder(self) -> None:
        """T5's layer counts and lengths, as Megatron's ``validate_args``: ``--num-layers`` and
        ``--seq-length`` default the encoder's values and the reverse; the decoder's layers default
        to ``--num-layers``; learned positions must cover both sequences."""
        if self.num_layers is None and self.encoder_num_layers is not None:
            self._set("num_layers", self.encoder_num_layers)
        if self.num_layers is not None:
            if self.encoder_num_layers is None:
                self._set("encoder_num_layers", self.num_layers)
            if self.decoder_num_layers is None:
                self._set("decoder_num_layers", self.num_layers)
        if self.seq_length is None and self.encoder_seq_length is not None:
            self._set("seq_length", self.encoder_seq_length)
        if self.encoder_seq_length is None and self.seq_length is not None:
            self._set("encoder_seq_length", self.seq_length)
        if self.max_position_embeddings is None and self.decoder_seq_length is not None:
            self._set("max_position_embeddings", max(self.seq_length or 0, self.decoder_seq_length))
        for name in ("encoder_num_layers", "decoder_num_layers", "encoder_seq_length", "decoder_seq_length"):
            value = getattr(self, name)
            flag_ = "--" + name.replace("_", "-")
            check(
                value is None or (isinstance(value, int) and value >= 1),
                f"{name}={value} ({flag_}) must be a positive integer",
            )
        for name in ("relative_attention_num_buckets", "relative_attention_max_distance"):
            value = getattr(self, name)
            check(value >= 1, f"{name}={value} (--{name.replace('_', '-')}) must be a positive integer")
        check(not (self.swiglu and self.geglu), "--swiglu and --geglu are two MLPs; choose one")
        if (
            self.position_embedding_type == "learned_absolute"
            and self.decoder_seq_length is not None
            and self.max_position_embeddings is not None
        ):
            check(
                self.decoder_seq_length <= self.max_position_embeddings,
                f"decoder_seq_length={self.decoder_seq_length} exceeds "
                f"max_position_embeddings={self.max_position_embeddings}",
            )

    def _set(self, name: str, value) -> None:
        object.__setattr__(self, name, value)

    # derived views
    @property
    def moe(self) -> MoEConfig | None:
        """The resolved mixture-of-experts settings, None for a dense model (no ``--num-experts``)."""
        return moe_view(self)

    @property
    def selective_recompute_modules(self) -> frozenset[str]:
        """What ``--recompute-granularity selective`` recomputes (``--recompute-modules``, default
        ``core_attn``); empty for full or no recomputation."""
        if self.recompute_granularity != "selective":
            return frozenset()
        return frozenset(("core_attn",) if self.recompute_modules is None else self.recompute_modules)

    @property
    def add_bias_linear(self) -> bool:
        """Biases on every linear layer (Megatron's ``add_bias_linear``)."""
        return not self.disable_bias_linear

    @property
    def share_embeddings_and_output_weights(self) -> bool:
        """The output layer multiplies by the word-embedding table."""
        return not self.untie_embeddings_and_output_weights

    @property
    def gated_linear_unit(self) -> bool:
        """The MLP's fc1 holds a gate and an up projection (SwiGLU or GeGLU; megatron-core's name)."""
        return self.swiglu or self.geglu

    @property
    def rotary_dim(self) -> int:
        """Channels of each head that RoPE rotates."""
        return int(self.kv_channels * self.rotary_percent)


def validate_model_parallel(config: ModelConfig, parallel: ParallelConfig) -> None:
    """Check that the model splits over the layout; raise :class:`ConfigError` naming the values."""
    check_tensor_parallel(config, parallel.tensor_model_parallel_size, parallel.sequence_parallel)
    ep = getattr(parallel, "expert_model_parallel_size", 1)
    etp = getattr(parallel, "expert_tensor_parallel_size", None) or parallel.tensor_model_parallel_size
    check_moe_parallel(config, ep, etp)
    cp = getattr(parallel, "context_parallel_size", 1) or 1
    for name, on in (
        ("multi_latent_attention", config.multi_latent_attention),
        ("mtp_num_layers", config.mtp_num_layers),
    ):
        check(
            not on or cp == 1,
            f"{name}={on} with context_parallel_size={cp}: multi-latent attention and multi-token "
            "prediction do not run under context parallelism yet",
        )


def check_tensor_parallel(
    config: ModelConfig, tp: int, sequence_parallel: bool = False, training: bool = True
) -> None:
    """The TP part of :func:`validate_model_parallel` (the model calls it with its group's size and
    ``training=False``: MoE without sequence parallelism is then refused by the MoE layer's training
    forward, so that generation runs MoE at TP > 1)."""
    check_mla_tensor_parallel(config, tp)
    check(
        config.num_attention_heads % tp == 0,
        f"num_attention_heads={config.num_attention_heads} is not divisible by tensor_model_parallel_size={tp}",
    )
    check(
        config.num_query_groups % tp == 0,
        f"num_query_groups={config.num_query_groups} is not divisible by tensor_model_parallel_size={tp}",
    )
    check(
        config.ffn_hidden_size % tp == 0,
        f"ffn_hidden_size={config.ffn_hidden_size} is not divisible by tensor_model_parallel_size={tp}",
    )
    check(
        tp == 1 or not config.qk_layernorm_full_width,
        f"qk_layernorm_full_width=True (--qk-layernorm-full-width) needs tensor_model_parallel_size=1 "
        f"(got {tp}): its norm spans the heads of every TP rank; per-head --qk-layernorm splits over TP",
    )
    if config.num_experts is not None and tp > 1 and training:
        check(
            sequence_parallel,
            f"num_experts={config.num_experts} with tensor_model_parallel_size={tp} needs --sequence-parallel "
            "(as Megatron: each TP rank routes its own sequence shard)",
        )
    if sequence_parallel:
        check(tp > 1, f"--sequence-parallel needs tensor_model_parallel_size > 1 (got {tp})")
        if config.seq_length is not None:
            check(
                config.seq_length % tp == 0,
                f"seq_length={config.seq_length} is not divisible by tensor_model_parallel_size={tp} "
                "(sequence parallelism splits the sequence)",
            )


__all__ = [
    "ConfigError",
    "ModelConfig",
    "check_tensor_parallel",
    "padded_vocab_size",
    "validate_model_parallel",
]
