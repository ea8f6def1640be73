"""Megatron's BERT family: its layer spec and model (``bert_model``) and its heads (``bert_heads``).

Its provider is :mod:`mcore.training.bert`; its Hugging Face mapping is :mod:`mcore.hf.bert`.
"""

from mcore.models.bert.bert_model import BertModel, bert_layer_spec

__all__ = ["BertModel", "bert_layer_spec"]
