"""The logical shapes of a multi-latent-attention layer's tensors (the DeepSeek mappings and the
shape check of :mod:`mcore.hf.gpt_state` share them; no import of either)."""

from __future__ import annotations

from mcore.models.transformer.model_config import ModelConfig


def mla_shapes(cfg: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    """Logical name -> shape of layer ``i``'s MLA tensors (megatron-core's names, no biases)."""
    p = f"decoder.layers.{i}.self_attention."
    h, n, dq = cfg.hidden_size, cfg.num_attention_heads, cfg.q_head_dim
    shapes = {
        p + "linear_kv_down_proj.weight": (cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim, h),
        p + "linear_kv_up_proj.weight": (n * (cfg.qk_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
        p + "linear_proj.weight": (h, n * cfg.v_head_dim),
    }
    if cfg.qk_layernorm:  # the latent norms (megatron-core: only with --qk-layernorm)
        shapes[p + "kv_layernorm.weight"] = (cfg.kv_lora_rank,)
        if cfg.q_lora_rank is not None:
            shapes[p + "q_layernorm.weight"] = (cfg.q_lora_rank,)
    if cfg.q_lora_rank is None:
        shapes[p + "linear_q_proj.weight"] = (n * dq, h)
    else:
        shapes[p + "linear_q_down_proj.weight"] = (cfg.q_lora_rank, h)
        shapes[p + "linear_q_up_proj.weight"] = (n * dq, cfg.q_lora_rank)
    return shapes
