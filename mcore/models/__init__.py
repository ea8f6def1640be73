"""The GPT model family built from layer specs (GPT-2/3, Llama-style, ALiBi)."""

# config: Megatron's model flags, padded vocabulary, checks against the parallel layout
from mcore.models.config import ModelConfig, padded_vocab_size, validate_model_parallel

# gpt: the model (whole or one pipeline chunk) and its layer spec
from mcore.models.gpt import GPTModel, gpt_layer_spec

# spec: ModuleSpec and build_module
from mcore.models.spec import ModuleSpec, build_module

__all__ = [
    "GPTModel",
    "ModelConfig",
    "ModuleSpec",
    "build_module",
    "gpt_layer_spec",
    "padded_vocab_size",
    "validate_model_parallel",
]
