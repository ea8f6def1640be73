"""The T5 family (Megatron's T5 and Hugging Face T5 v1.1): the model (``t5_model``), its encoder and
decoder layers with their specs (``t5_layers``) and T5's relative position bias
(``relative_position``).

Its provider is :mod:`mcore.training.t5`; its Hugging Face mapping is :mod:`mcore.hf.t5`.
"""

from mcore.models.t5.t5_model import T5Model

__all__ = ["T5Model"]
