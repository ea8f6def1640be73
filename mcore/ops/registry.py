"""The named op table: every kernel the model uses, a pure-PyTorch reference for each, and overrides.

Layers call ops through the active table (``get_ops().rms_norm(x, w, eps)``), never by importing a
kernel, so a backend can serve an op faster without the model knowing. Every op has a reference in
:mod:`mcore.ops.reference`; a backend overrides by name during ``mcore_register_ops``. Overriding an
unknown name, or two providers overriding one op, is an error that names both.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

REFERENCE = "reference"

OP_NAMES: tuple[str, ...] = (
    "layer_norm",
    "rms_norm",
    "layer_norm_with_residual",
    "rms_norm_with_residual",
    "rotary_embedding",
    "bias_gelu",
    "swiglu",
    "bias_dropout_add",
    "scaled_masked_softmax",
    "attention",
    "cross_entropy",
    "cross_entropy_local_stats",
    "cross_entropy_grad_inplace_",
    "adam_step",
    "adam_step_flat",
    "accumulate_weight_grad",
    "fp8_quantize",
    "fp8_quantize_transpose",
    "scaled_linear_forward",
    "scaled_linear_dgrad",
    "scaled_linear_wgrad",
)
"""Every op name. The signatures and tensor layouts are documented in :mod:`mcore.ops.reference`."""


class OpConflictError(RuntimeError):
    """Two providers override the same op, or an override names an op that does not exist."""


@dataclass(frozen=True)
class OpEntry:
    fn: Callable
    provider: str


class OpTable:
    """A resolved, read-only op table: attribute access returns the callable (``table.rms_norm``)."""

    def __init__(self, entries: dict[str, OpEntry]):
        missing = set(OP_NAMES) - set(entries)
        if missing:
            raise OpConflictError(f"op table lacks {sorted(missing)}")
        object.__setattr__(self, "_entries", dict(entries))
        for name, entry in entries.items():
            object.__setattr__(self, name, entry.fn)

    def __setattr__(self, name, value):
        raise AttributeError("an OpTable is read-only; override ops through mcore_register_ops")

    def provider(self, name: str) -> str:
        """Who serves ``name``: ``"reference"`` or the overriding provider's name."""
        return self._entries[name].provider

    def __iter__(self) -> Iterator[tuple[str, OpEntry]]:
        return iter(self._entries.items())

    def __getitem__(self, name: str) -> Callable:
        return self._entries[name].fn


class OpRegistry:
    """Collects overrides on top of the reference ops, then freezes into an :class:`OpTable`."""

    def __init__(self, reference: dict[str, Callable]):
        unknown = set(reference) - set(OP_NAMES)
        if unknown:
            raise OpConflictError(f"reference ops {sorted(unknown)} are not in OP_NAMES")
        self._entries = {name: OpEntry(fn, REFERENCE) for name, fn in reference.items()}

    def override(self, name: str, fn: Callable, provider: str) -> None:
        """Serve op ``name`` with ``fn``. ``provider`` names the plugin, for messages and ``mcore-info``."""
        if name not in OP_NAMES:
            raise OpConflictError(
                f"{provider} overrides unknown op {name!r}; known ops: {', '.join(OP_NAMES)}"
            )
        current = self._entries[name]
        if current.provider not in (REFERENCE, provider):
            raise OpConflictError(
                f"op {name!r} is overridden by both {current.provider!r} and {provider!r}; "
                "uninstall or disable one of these plugins"
            )
        self._entries[name] = OpEntry(fn, provider)

    def freeze(self) -> OpTable:
        return OpTable(self._entries)


def reference_table() -> OpTable:
    """The table with every op served by its pure-PyTorch reference."""
    from mcore.ops import reference

    return OpRegistry(reference.REFERENCE_OPS).freeze()
