"""The model and tokenizer configs a run saved with its checkpoint (``run_config`` in ``metadata.json``,
or a live :class:`mcore.training.run_config.RunConfig`), as typed config objects.

Used by the checkpoint writers and readers (export to Megatron-LM, Hugging Face export, generation).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from mcore.data.config import TokenizerConfig
from mcore.models.transformer.model_config import ModelConfig

RunConfigLike = Any
"""A :class:`mcore.training.run_config.RunConfig`, or a mapping group name -> config object or field dict."""


def run_config_groups(run_config: RunConfigLike) -> dict[str, dict[str, Any]]:
    """``{group: {field: value}}`` from a RunConfig, a dict of config dataclasses, or a dict of dicts."""
    groups = run_config.as_dict() if hasattr(run_config, "as_dict") else dict(run_config)
    out: dict[str, dict[str, Any]] = {}
    for name, value in groups.items():
        if dataclasses.is_dataclass(value):
            out[name] = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        elif isinstance(value, Mapping):
            out[name] = dict(value)
    return out


def _construct(cls: type, values: Mapping[str, Any], **overrides: Any):
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    kwargs = {k: (tuple(v) if isinstance(v, list) else v) for k, v in values.items() if k in names}
    kwargs.update(overrides)
    return cls(**kwargs)


def model_config_from_run_config(run_config: RunConfigLike, **overrides: Any) -> ModelConfig:
    """The :class:`ModelConfig` saved with a run (``overrides`` replace fields, e.g. dropout)."""
    groups = run_config_groups(run_config)
    if "model" not in groups:
        raise ValueError(f"the run config has no 'model' group (groups: {', '.join(groups) or 'none'})")
    return _construct(ModelConfig, groups["model"], **overrides)


def tokenizer_config_from_run_config(run_config: RunConfigLike) -> TokenizerConfig | None:
    """The :class:`TokenizerConfig` saved with a run, or None if it names no tokenizer."""
    values = run_config_groups(run_config).get("tokenizer")
    if not values or not values.get("tokenizer_type"):
        return None
    return _construct(TokenizerConfig, values)
