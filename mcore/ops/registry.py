"""The named op table: every kernel the model uses, a pure-PyTorch reference for each, and overrides.

Layers call ops through the active table (``get_ops().rms_norm(x, w, eps)``), never by importing a
kernel, so a backend can serve an op faster without the model knowing. Every op has a reference in
:mod:`mcore.ops.reference`. While a backend is selected, its ``register_ops`` method and then every
``mcore_register_ops`` hook see an :class:`OpRegistry`, in which a plugin can

* **replace** an op (:meth:`OpRegistry.override`): one provider per op; a second provider replacing
  the same op, or an unknown name, is an error naming both;
* **read** who serves an op and its implementation (:meth:`OpRegistry.provider`,
  :meth:`OpRegistry.current`);
* **wrap** an op (:meth:`OpRegistry.wrap`): declare a wrapper that receives the implementation below
  it (the replacement, or the reference) and returns the function to call instead; a tracer or
  profiler wraps whatever backend serves the op. Wrappers stack in the order they were declared and
  are applied when the table is frozen, after every replacement, so a wrap never hides a kernel.

Ops are local computations: collectives stay in the core (:mod:`mcore.tensor_parallel`), so an op's
contract does not depend on the parallel layout.
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
    "weighted_swiglu",
    "bias_dropout_add",
    "attention",
    "cross_entropy",
    "cross_entropy_local_stats",
    "cross_entropy_grad_inplace_",
    "adam_step",
    "adam_step_flat",
    "adam_step_flat_fp8",
    "accumulate_weight_grad",
    "fp8_quantize",
    "fp8_quantize_flat",
    "fp8_dequantize_flat",
    "fp8_amax",
    "fp8_cast",
    "fp8_cast_dbias",
    "fp8_cast_packed",
    "fp8_transpose",
    "norm_fp8_forward",
    "norm_backward",
    "act_fp8_forward",
    "act_fp8_backward",
    "scaled_linear_forward",
    "scaled_linear_dgrad",
    "scaled_linear_wgrad",
    "moe_topk_routing",
    "moe_permute",
    "moe_unpermute",
    "grouped_gemm",
    "scaled_grouped_gemm",
    "scaled_grouped_gemm_wgrad",
    # context parallelism: attention by key blocks (mcore.ops.reference.attention_lse)
    "attention_with_lse",
    "attention_with_lse_backward",
    "attention_merge",
)
"""Every op name. The signatures and tensor layouts are documented in :mod:`mcore.ops.reference`.

Every op here is called in training (``docs/writing_a_backend.md`` lists which code path and flags
reach each). Softmax is not an op of its own: the model calls ``attention`` as one op, so a backend
with a fused softmax but no fused attention uses it inside its ``attention``."""


class OpConflictError(RuntimeError):
    """Two providers override the same op, or an override names an op that does not exist."""


@dataclass(frozen=True)
class OpEntry:
    fn: Callable
    """What the table calls (the wrapped implementation where wrappers are declared)."""
    provider: str
    """Who serves the op: ``"reference"`` or the replacing provider's name."""
    wrapped_by: tuple[str, ...] = ()
    """Providers whose wrappers sit around it, innermost first."""

    def describe(self) -> str:
        """``provider`` with its wrappers, as ``python -m mcore.backends`` prints it."""
        return self.provider + "".join(f" (wrapped by {w})" for w in self.wrapped_by)


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

    def wrappers(self, name: str) -> tuple[str, ...]:
        """The providers wrapping ``name``, innermost first."""
        return self._entries[name].wrapped_by

    def __iter__(self) -> Iterator[tuple[str, OpEntry]]:
        return iter(self._entries.items())

    def __getitem__(self, name: str) -> Callable:
        return self._entries[name].fn


class OpRegistry:
    """Collects replacements and wrappers on top of the reference ops, then freezes into an
    :class:`OpTable`."""

    def __init__(self, reference: dict[str, Callable]):
        unknown = set(reference) - set(OP_NAMES)
        if unknown:
            raise OpConflictError(f"reference ops {sorted(unknown)} are not in OP_NAMES")
        self._entries = {name: OpEntry(fn, REFERENCE) for name, fn in reference.items()}
        self._wrappers: dict[str, list[tuple[Callable[[Callable], Callable], str]]] = {}

    def _check_name(self, name: str, provider: str, verb: str) -> None:
        if name not in OP_NAMES:
            raise OpConflictError(f"{provider} {verb} unknown op {name!r}; known ops: {', '.join(OP_NAMES)}")

    def provider(self, name: str) -> str:
        """Who serves op ``name`` so far: ``"reference"`` or the replacing provider's name."""
        self._check_name(name, "provider()", "asks for")
        return self._entries[name].provider

    def current(self, name: str) -> Callable:
        """The implementation of op ``name`` so far (the replacement, or the reference; wrappers are
        applied at :meth:`freeze`)."""
        self._check_name(name, "current()", "asks for")
        return self._entries[name].fn

    def wrap(self, name: str, wrapper: Callable[[Callable], Callable], provider: str) -> None:
        """Declare that ``provider`` wraps op ``name``: at :meth:`freeze`, ``wrapper(implementation)``
        is called with the implementation below it and must return the function the table calls.

        Several providers may wrap one op (each receives the previous one's result, in declaration
        order); wrapping never conflicts with a replacement, which always sits below every wrapper.
        """
        self._check_name(name, provider, "wraps")
        if not callable(wrapper):
            raise TypeError(f"{provider} wraps op {name!r} with {wrapper!r}, which is not callable")
        self._wrappers.setdefault(name, []).append((wrapper, provider))

    def override(self, name: str, fn: Callable, provider: str) -> None:
        """Serve op ``name`` with ``fn`` (replace it). ``provider`` names the plugin, for messages and
        ``mcore-info``. A second provider replacing the same op is an error naming both."""
        self._check_name(name, provider, "overrides")
        current = self._entries[name]
        if current.provider not in (REFERENCE, provider):
            raise OpConflictError(
                f"op {name!r} is overridden by both {current.provider!r} and {provider!r}; "
                "uninstall or disable one of these plugins"
            )
        self._entries[name] = OpEntry(fn, provider)

    def freeze(self) -> OpTable:
        """The table: every replacement, with the declared wrappers applied around it."""
        entries = dict(self._entries)
        for name, wrappers in self._wrappers.items():
            entry = entries[name]
            fn, wrapped_by = entry.fn, entry.wrapped_by
            for wrapper, provider in wrappers:
                fn = wrapper(fn)
                if not callable(fn):
                    raise OpConflictError(
                        f"{provider}'s wrapper of op {name!r} returned {fn!r}, which is not callable"
                    )
                wrapped_by += (provider,)
            entries[name] = OpEntry(fn, entry.provider, wrapped_by)
        return OpTable(entries)


def reference_table() -> OpTable:
    """The table with every op served by its pure-PyTorch reference."""
    from mcore.ops import reference

    return OpRegistry(reference.REFERENCE_OPS).freeze()
