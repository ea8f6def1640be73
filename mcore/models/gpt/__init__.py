"""The GPT family (GPT-2/3, Llama-style, ALiBi): its layer spec and model (``gpt_model``).

Its provider (flags to a model chunk) is :mod:`mcore.training.gpt`; its Hugging Face mappings are
:mod:`mcore.hf.gpt2` and :mod:`mcore.hf.llama`.
"""

from mcore.models.gpt.gpt_model import GPTModel, gpt_layer_spec

__all__ = ["GPTModel", "gpt_layer_spec"]
