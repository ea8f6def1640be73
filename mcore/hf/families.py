"""The Hugging Face families mcore converts, in one table, and the entry points that look one up.

:data:`FAMILIES` maps a name to the :class:`~mcore.hf.family.HfFamily` its module builds
(:mod:`mcore.hf.gpt2`, :mod:`mcore.hf.llama` (Llama, Mistral, Qwen2, Qwen3), :mod:`mcore.hf.deepseek`
(DeepSeek-V3, -V2), :mod:`mcore.hf.t5`,
:mod:`mcore.hf.bert_io`). A family is recognized

* from an mcore logical state: BERT, then T5, by their tensors (:func:`family_of_state`); otherwise
  a GPT-style one by the architecture asked for, else by the model config (positions, QK layernorm:
  :func:`mcore.hf.gpt_state.hf_family`);
* from a ``config.json``: BERT, then T5 (:func:`family_of_hf`); otherwise a GPT-style one by
  ``architectures`` / ``model_type`` (:func:`mcore.hf.gpt_state.family_of_hf_config`).

The library's GPT-family functions (:func:`check_exportable`, :func:`hf_config_dict`,
:func:`model_config_from_hf`, :func:`mcore_to_hf`, :func:`hf_to_mcore`) pick the GPT-style family
from the model config the same way and call that family's own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mcore.hf import bert_io, deepseek, gpt2, llama, t5
from mcore.hf.family import HfFamily
from mcore.hf.gpt_state import family_of_hf_config, hf_family
from mcore.models.transformer.model_config import ModelConfig

FAMILIES: dict[str, HfFamily] = {
    f.name: f for f in (gpt2.FAMILY, *llama.FAMILIES, *deepseek.FAMILIES, t5.FAMILY, bert_io.FAMILY)
}
"""Every family, by name."""
_BY_TENSORS = (bert_io.FAMILY.name, t5.FAMILY.name)
"""The families recognized before the GPT ones, in this order."""


def family_of_state(state: Mapping[str, Any]) -> HfFamily | None:
    """BERT or T5 when the logical state has their tensors, else None (a GPT family: see the config)."""
    for name in _BY_TENSORS:
        if FAMILIES[name].is_state(state):
            return FAMILIES[name]
    return None


def family_of_hf(hf: Mapping[str, Any], where: str = "config.json") -> HfFamily:
    """The family of a ``config.json``, or :class:`~mcore.hf.errors.ConversionError` naming the
    supported architectures."""
    for name in _BY_TENSORS:
        if FAMILIES[name].is_hf_config(hf):
            return FAMILIES[name]
    return FAMILIES[family_of_hf_config(hf, where)]


def check_exportable(cfg: ModelConfig) -> str:
    """Refuse what the target class (GPT-2 or Llama, from the positions) cannot represent; return the family."""
    return FAMILIES[hf_family(cfg)].check_exportable(cfg)


def hf_config_dict(
    cfg: ModelConfig,
    vocab_size: int,
    *,
    bos_token_id: int | None,
    eos_token_id: int | None,
    pad_token_id: int | None = None,
    dtype: str = "float32",
) -> dict[str, Any]:
    """The ``config.json`` of the Hugging Face model equivalent to ``cfg`` (vocabulary ``vocab_size``)."""
    return FAMILIES[hf_family(cfg)].hf_config_dict(
        cfg,
        vocab_size,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        dtype=dtype,
    )


def model_config_from_hf(hf: dict[str, Any], where: str = "config.json", **overrides: Any) -> ModelConfig:
    """The mcore :class:`ModelConfig` of a GPT-2 or Llama ``config.json`` (refusing what mcore cannot express)."""
    return FAMILIES[family_of_hf_config(hf, where)].model_config_from_hf(hf, where, **overrides)


def mcore_to_hf(
    state: Mapping[str, torch.Tensor], cfg: ModelConfig, vocab_size: int
) -> dict[str, torch.Tensor]:
    """The Hugging Face state dict (contiguous tensors) of an mcore logical state dict.

    Args:
        state: logical name -> whole tensor (padded vocabulary rows allowed).
        cfg: the model's configuration (decides the family: GPT-2 or Llama).
        vocab_size: the real vocabulary ``V``; embedding rows ``[V, Vp)`` are dropped.
    """
    return FAMILIES[hf_family(cfg)].mcore_to_hf(state, cfg, vocab_size)


def hf_to_mcore(
    hf_state: Mapping[str, torch.Tensor], cfg: ModelConfig, padded_vocab_size: int
) -> dict[str, torch.Tensor]:
    """The mcore logical state dict of a Hugging Face GPT-2 / Llama state dict.

    ``cfg`` is the mcore config of the model (:func:`model_config_from_hf`); the vocabulary rows are
    zero-padded to ``padded_vocab_size``. Buffers older savers wrote (``attn.bias``,
    ``attn.masked_bias``, ``rotary_emb.inv_freq``) are ignored; any other unknown key, a missing key, a
    non-zero o_proj bias without an mcore place, or a shape mismatch is an error.
    """
    return FAMILIES[hf_family(cfg)].hf_to_mcore(hf_state, cfg, padded_vocab_size)
