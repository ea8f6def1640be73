"""Module specs: which class builds each part of a layer, decided apart from the model code.

A :class:`ModuleSpec` names a module class (or a dotted import path) plus keyword ``params`` and
``submodules`` (a dataclass of nested specs, or anything the module accepts). :func:`build_module`
instantiates it, so a backend or an experiment can swap one block (say, the core attention) by
editing a spec, without touching the model (Megatron's ``spec_utils``).

Example: the GPT layer spec (see :func:`mcore.models.gpt.gpt_model.gpt_layer_spec`)::

    ModuleSpec(TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=ModuleSpec(Norm),
        self_attention=ModuleSpec(SelfAttention, submodules=SelfAttentionSubmodules(
            linear_qkv=ColumnParallelLinear, core_attention=CoreAttention,
            linear_proj=RowParallelLinear)),
        pre_mlp_layernorm=ModuleSpec(Norm),
        mlp=ModuleSpec(MLP, submodules=MLPSubmodules(
            linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)),
    ))
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ModuleSpec:
    """What to build: ``module(*args, **params, **kwargs, submodules=submodules)``.

    Attributes:
        module: a class (or callable), or a dotted path ``"package.module.Name"``.
        params: keyword arguments fixed by the spec.
        submodules: nested specs handed to the module as ``submodules=`` (omitted when None).
    """

    module: Any
    params: dict[str, Any] = field(default_factory=dict)
    submodules: Any = None


def import_module_attr(path: str) -> Any:
    """``"a.b.C"`` -> the attribute ``C`` of module ``a.b``."""
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise ValueError(f"{path!r} is not a dotted path 'package.module.Name'")
    return getattr(importlib.import_module(module_name), attr)


def build_module(spec: ModuleSpec | type | Any, *args: Any, **kwargs: Any) -> Any:
    """Instantiate ``spec`` with ``*args`` and ``**kwargs`` (merged over ``spec.params``).

    A plain class or callable is called directly. A spec whose ``module`` is a string is imported.
    """
    if not isinstance(spec, ModuleSpec):
        return spec(*args, **kwargs)
    module = import_module_attr(spec.module) if isinstance(spec.module, str) else spec.module
    params = {**spec.params, **kwargs}
    if spec.submodules is not None:
        params["submodules"] = spec.submodules
    return module(*args, **params)
