"""Multi-latent attention flags (Megatron-LM's ``--multi-latent-attention`` group) and their checks.

The fields sit flat on :class:`~mcore.models.transformer.model_config.ModelConfig` (which inherits
:class:`MLAFlags`), as on Megatron's ``MLATransformerConfig``. Shapes (``n`` heads):

* query: ``q_lora_rank`` (None: one plain projection ``h -> n (qk_head_dim + qk_pos_emb_head_dim)``,
  DeepSeek-V2-Lite) or ``h -> q_lora_rank`` (norm) ``-> n (qk_head_dim + qk_pos_emb_head_dim)``;
* key/value: ``h -> kv_lora_rank + qk_pos_emb_head_dim`` (the latent and the one shared RoPE key),
  the latent normed and up-projected to ``n (qk_head_dim + v_head_dim)``.

RoPE (``--rope-type``: ``rope``, or ``yarn``, MLA's default as in Megatron) rotates only the
``qk_pos_emb_head_dim`` channels. YaRN (:class:`~mcore.models.transformer.positions.YarnRotaryEmbedding`)
takes ``--rotary-scaling-factor``, ``--yarn-original-max-position-embeddings``, ``--yarn-beta-fast``,
``--yarn-beta-slow``; ``--mscale`` / ``--mscale-all-dim`` scale the rotated channels by
``m(s, mscale) / m(s, mscale_all_dim)`` and the softmax by ``m(s, mscale_all_dim)^2 / sqrt(d_q)``
with ``m(s, a) = 0.1 a ln s + 1`` (``s > 1``; else 1), DeepSeek's correction.
"""

from __future__ import annotations

from dataclasses import dataclass

from mcore.config.fields import check, flag

ROPE_TYPES = ("rope", "yarn")


@dataclass(frozen=True, kw_only=True)
class MLAFlags:
    """Multi-latent attention flags (Megatron's names; see docs/deepseek.md)."""

    multi_latent_attention: bool = flag(False, "Multi-latent attention (DeepSeek-V2/V3) instead of MHA/GQA.")
    q_lora_rank: int | None = flag(
        None, "MLA: rank of the query's low-rank projection (None: no compression)."
    )
    kv_lora_rank: int = flag(32, "MLA: rank of the key/value latent.")
    qk_head_dim: int = flag(128, "MLA: query/key head dim without the RoPE part.")
    qk_pos_emb_head_dim: int = flag(64, "MLA: the RoPE part of the query/key head dim.")
    v_head_dim: int = flag(128, "MLA: value head dim.")
    rope_type: str | None = flag(
        None, "RoPE of MLA: rope or yarn (default yarn, as Megatron's MLA).", choices=ROPE_TYPES
    )
    rotary_scaling_factor: float = flag(1.0, "YaRN scaling factor (DeepSeek's rope_scaling.factor).")
    original_max_position_embeddings: int = flag(
        4096,
        "YaRN: the pre-extension context length.",
        name="--yarn-original-max-position-embeddings",
    )
    beta_fast: float = flag(32.0, "YaRN beta_fast.", name="--yarn-beta-fast")
    beta_slow: float = flag(1.0, "YaRN beta_slow.", name="--yarn-beta-slow")
    mscale: float = flag(1.0, "YaRN mscale of MLA (the rotated channels' scale numerator).")
    mscale_all_dim: float = flag(0.0, "YaRN mscale_all_dim of MLA (softmax-scale correction).")

    @property
    def q_head_dim(self) -> int:
        """Query/key head dim of MLA: ``qk_head_dim + qk_pos_emb_head_dim``."""
        return self.qk_head_dim + self.qk_pos_emb_head_dim

    @property
    def mla_rope_type(self) -> str:
        """The RoPE MLA applies (``--rope-type``, default yarn)."""
        return self.rope_type or "yarn"


def check_mla(config) -> None:
    """MLA's own checks (on construction of the model config); errors name the flags and values."""
    modules = config.recompute_modules or ()
    if not config.multi_latent_attention:
        check(
            "mla_up_proj" not in modules,
            f"recompute_modules={list(modules)} (--recompute-modules): 'mla_up_proj' needs --multi-latent-attention",
        )
        return
    check(
        config.rope_type in (None, *ROPE_TYPES),
        f"rope_type={config.rope_type!r} (--rope-type) is not supported by multi-latent attention; "
        f"choose one of {', '.join(ROPE_TYPES)}",
    )
    for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
        value = getattr(config, name)
        check(
            isinstance(value, int) and value >= 1,
            f"{name}={value!r} (--{name.replace('_', '-')}) must be a positive integer",
        )
    q = config.q_lora_rank
    check(
        q is None or (isinstance(q, int) and q >= 1),
        f"q_lora_rank={q!r} (--q-lora-rank) must be positive or None",
    )
    check(
        config.qk_pos_emb_head_dim % 2 == 0,
        f"qk_pos_emb_head_dim={config.qk_pos_emb_head_dim} must be even (RoPE rotates channel pairs)",
    )
    check(
        config.position_embedding_type == "rope",
        f"multi_latent_attention needs --position-embedding-type rope (got "
        f"{config.position_embedding_type!r}): MLA rotates its qk_pos_emb_head_dim channels",
    )
    check(
        config.rotary_percent == 1.0,
        f"rotary_percent={config.rotary_percent} is not supported with multi_latent_attention "
        "(MLA rotates exactly qk_pos_emb_head_dim channels)",
    )
    check(
        not config.group_query_attention,
        "multi_latent_attention and --group-query-attention exclude each other (MLA has one latent per token)",
    )
    check(
        config.rotary_scaling_factor > 0,
        f"rotary_scaling_factor={config.rotary_scaling_factor} must be positive",
    )
    check(
        config.original_max_position_embeddings >= 1,
        f"original_max_position_embeddings={config.original_max_position_embeddings} must be positive",
    )
    check(config.position_embedding_type != "alibi", "multi_latent_attention does not take alibi positions")
    check(
        not config.qk_layernorm_full_width,
        "qk_layernorm_full_width=True (--qk-layernorm-full-width) does not apply to multi_latent_attention "
        "(--qk-layernorm norms its latents)",
    )


def check_mla_tensor_parallel(config, tp: int) -> None:
    """MLA splits its heads over TP (the up projections by heads, the output by columns)."""
    if not config.multi_latent_attention:
        return
    n = config.num_attention_heads
    check(
        n % tp == 0,
        f"multi_latent_attention: num_attention_heads={n} is not divisible by tensor_model_parallel_size={tp}",
    )
