"""The tiny random models the generation tests share (imported by the spawned ranks too)."""

from __future__ import annotations

from mcore.models.transformer.model_config import ModelConfig

VOCAB, EOD = 100, 99
CONFIGS = {
    "gpt2": dict(num_attention_heads=4, max_position_embeddings=64),
    "llama": dict(
        num_attention_heads=8,
        group_query_attention=True,
        num_query_groups=2,
        ffn_hidden_size=96,
        position_embedding_type="rope",
        normalization="RMSNorm",
        swiglu=True,
        disable_bias_linear=True,
        untie_embeddings_and_output_weights=True,
    ),
    "alibi": dict(num_attention_heads=4, position_embedding_type="alibi", openai_gelu=True),
}
# Mixture of experts (Qwen3-MoE-like: per-head QK layernorm, plus Qwen2-MoE's gated shared expert); kept
# out of CONFIGS, whose every entry the one-process generation tests run
MOE = dict(
    CONFIGS["llama"],
    qk_layernorm=True,
    num_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=48,
    moe_shared_expert_intermediate_size=32,
    moe_shared_expert_gate=True,
)
PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15]]


def model_config(name: str) -> ModelConfig:
    # A large init std makes the random model's distributions peaked, so greedy choices are clear.
    return ModelConfig(
        num_layers=2, hidden_size=64, seq_length=64, init_method_std=0.2, **{**CONFIGS, "moe": MOE}[name]
    )
