"""The models: transformer building blocks and the families built from them by layer specs.

* :mod:`mcore.models.transformer`: the building blocks (config, spec, embeddings, positions, norms,
  attention, MLP, layer, block, device graphs of the layers); MoE goes to its ``moe/`` subpackage;
* :mod:`mcore.models.gpt`: GPT-2/3, Llama-style, ALiBi;
* :mod:`mcore.models.bert`: Megatron's BERT;
* :mod:`mcore.models.t5`: the encoder-decoder model (Megatron's T5 and Hugging Face T5 v1.1);
* :mod:`mcore.models.fp8_producers`: the norms that write the next linear's FP8 input.
"""

# gpt: the model (whole or one pipeline chunk) and its layer spec
from mcore.models.gpt.gpt_model import GPTModel, gpt_layer_spec

# t5: the encoder-decoder model (Megatron's T5 and Hugging Face T5 v1.1)
from mcore.models.t5.t5_model import T5Model

# model_config: Megatron's model flags, padded vocabulary, checks against the parallel layout
from mcore.models.transformer.model_config import ModelConfig, padded_vocab_size, validate_model_parallel

# spec: ModuleSpec and build_module
from mcore.models.transformer.spec import ModuleSpec, build_module

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
