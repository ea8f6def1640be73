"""Replacement implementations for the NPU patch table, one module per core module they patch
(``impl/attention.py`` patches ``mcore.models.transformer.attention``, ``impl/generation.py``
``mcore.inference.generation``)."""
