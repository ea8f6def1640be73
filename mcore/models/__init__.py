"""The GPT model family built from layer specs (GPT-2/3, Llama-style, ALiBi)."""

# config: Megatron's model flags, padded vocabulary, checks against the parallel layout
from mcore.models.config import ModelConfig, padded_vocab_size, validate_model_parallel

# gpt: the model (whole or one pipeline chunk) and its layer spec
from mcore.models.gpt import GPTModel, gpt_layer_spec

# spec: ModuleSpec and build_module
from mcore.models.spec import ModuleSpec, build_module

# t5: the encoder-decoder model (Megatron's T5 and Hugging Face T5 v1.1)
from mcore.models.t5 import T5Model

__all__ = [
    "GPTModel",
    "ModelConfig",
    "ModuleSpec",
    "T5Model",
    "build_module",
    "gpt_layer_spec",
    "padded_vocab_size",
    "validate_model_parallel",
]
