"""The one error the Hugging Face converters raise for inputs they cannot convert."""

from __future__ import annotations


class ConversionError(ValueError):
    """A model, directory, tokenizer or setting that cannot be converted exactly (the message names it)."""


class ParityError(ConversionError):
    """The converted model's logits differ from the original's by more than the tolerance."""
