"""What a Hugging Face family gives the generic export and import (:class:`HfFamily`).

A family module (:mod:`mcore.hf.gpt2`, :mod:`mcore.hf.llama`, :mod:`mcore.hf.t5`,
:mod:`mcore.hf.bert_io`) builds one :class:`HfFamily` from its own functions; the table in
:mod:`mcore.hf.families` lists them, and :mod:`mcore.hf.export` / :mod:`mcore.hf.importer` look the
family up there and call what it gives: the standard pipeline's parts (config both ways, tensors both
ways, the parity check), or, for a family that needs its own (BERT: its heads, its WordPiece files),
its whole export and import.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class HfFamily:
    """One Hugging Face model family mcore converts."""

    name: str
    """``"gpt2"``, ``"llama"``, ``"t5"``, ``"bert"`` (the tokenizer import keys on it)."""
    architecture: str = ""
    """The ``transformers`` class written to ``config.json`` (BERT decides it per model)."""
    hf_word_key: str = ""
    """The Hugging Face word-embedding tensor (import checks its rows against ``vocab_size``)."""
    is_state: Callable[[Mapping[str, Any]], bool] | None = None
    """Recognizes the family's mcore logical state by its tensors (None: by the model config)."""
    is_hf_config: Callable[[Mapping[str, Any]], bool] | None = None
    """Recognizes the family's ``config.json`` before the GPT families' table is asked."""

    # The standard pipeline's parts (mcore.hf.export / mcore.hf.importer).
    check_exportable: Callable[..., str] | None = None
    hf_config_dict: Callable[..., dict[str, Any]] | None = None
    mcore_to_hf: Callable[..., dict[str, Any]] | None = None
    model_config_from_hf: Callable[..., Any] | None = None
    hf_to_mcore: Callable[..., dict[str, Any]] | None = None
    check_parity: Callable[..., Any] | None = None

    # A family with a pipeline of its own: same arguments and reports as the standard one.
    export_to_hf: Callable[..., Any] | None = None
    import_from_hf: Callable[..., Any] | None = None
