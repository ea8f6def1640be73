"""The Megatron command-line flags that build a model config: what an import prints (and records)
so that training continues from the imported checkpoint with ``--load ... --finetune``."""

from __future__ import annotations

import dataclasses

from mcore.config.fields import flag_name, turns_off
from mcore.models.transformer.model_config import ModelConfig


def megatron_model_flags(cfg: ModelConfig) -> list[str]:
    """The Megatron command-line flags that build ``cfg`` (only those that differ from the defaults)."""
    always = {"num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "seq_length"}
    flags: list[str] = []
    for field in dataclasses.fields(ModelConfig):
        if not field.metadata.get("cli", False):
            continue
        value = getattr(cfg, field.name)
        if value is None:
            continue
        if field.name == "num_query_groups" and not cfg.group_query_attention:
            continue
        if field.name == "kv_channels" and value * cfg.num_attention_heads == cfg.hidden_size:
            continue
        # T5's layer counts and encoder length default to --num-layers / --seq-length (and vice versa)
        if field.name in ("encoder_num_layers", "decoder_num_layers") and value == cfg.num_layers:
            continue
        if field.name == "encoder_seq_length" and value == cfg.seq_length:
            continue
        if field.name not in always and value == field.default:
            continue
        spelling = flag_name(field)
        if isinstance(value, bool):
            if value != turns_off(spelling):
                flags.append(spelling)
        elif isinstance(value, (tuple, list)) and field.metadata.get("nargs"):  # --recompute-modules
            flags.extend([spelling, *map(str, value)])
        elif isinstance(value, (tuple, list)):  # one list value (--moe-layer-freq [1,0,1], Megatron's)
            flags.extend([spelling, "[" + ",".join(map(str, value)) + "]"])
        else:
            flags.extend([spelling, f"{value:g}" if isinstance(value, float) else str(value)])
    return flags
