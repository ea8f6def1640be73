"""A declarative patch engine for adaptors: rows of data in, a revertible :class:`PatchSet` out.

An adaptor (``mcore.adaptors.npu``) carries what a backend hook cannot express as a table of
:class:`Patch` rows in one file. Each row names

* ``target``: a dotted path inside ``mcore.*`` (``"mcore.distributed.groups.initialize_parallel"``,
  or a class attribute, ``"mcore.models.transformer.attention.CoreAttention.forward"``);
* ``replacement``: a dotted path or the object itself;
* ``kind``: :attr:`Kind.REPLACE` (the replacement *is* the new attribute) or :attr:`Kind.WRAP` (the
  replacement is a factory, ``wrapper(original) -> new``); declared per row, never guessed from a
  function name as MindSpeed does;
* ``when``: an optional zero-argument predicate, evaluated at apply time; a row whose predicate is
  false is skipped (and reported as skipped);
* ``reason``: one line saying why the row exists and why a hook could not do its job.

:func:`apply_patches` follows these rules:

1. Every row is checked before anything changes: the target resolves (a moved or renamed target
   fails with :class:`PatchError` naming the row), the replacement resolves, WRAP targets are
   callable, a target has at most one REPLACE (also across active patch sets). Rows skipped by
   ``when`` are checked too, so a moved target fails on every machine, not only where it applies.
2. Per target, the REPLACE row (if any) gives the base, then the WRAP rows stack around it in row
   order (the first WRAP row is innermost). Targets are patched in the order they first appear.
3. Applying the same table again returns the already-active :class:`PatchSet` (idempotent).
4. :meth:`PatchSet.revert` restores every original (also inherited class attributes, by deleting
   the override) and refuses to clobber a patch applied on top of its own.

There is no scan of ``sys.modules`` for aliases (MindSpeed's ``from x import f`` chase): the core
calls kernels through the op table and patchable functions through their module, so patching the
attribute where it is defined is enough. A core module that re-exports a patched function by value
keeps the original; patch the module the caller reads from.
"""

from __future__ import annotations

import enum
import importlib
import inspect
import threading
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

ALLOWED_PREFIX = "mcore."
_MISSING = object()


class Kind(enum.Enum):
    """How a row changes its target."""

    REPLACE = "replace"
    """The replacement object becomes the attribute."""
    WRAP = "wrap"
    """``replacement(original)`` becomes the attribute (a decorator factory)."""


class PatchError(RuntimeError):
    """A patch table cannot be applied or reverted; the message names the row."""


@dataclass(frozen=True)
class Patch:
    """One row of a patch table (see the module docstring)."""

    target: str
    replacement: str | Callable[..., Any]
    kind: Kind
    reason: str
    when: Callable[[], bool] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kind, Kind):
            raise PatchError(f"{self.target}: kind must be Kind.REPLACE or Kind.WRAP, got {self.kind!r}")
        if not self.target.startswith(ALLOWED_PREFIX) or self.target.count(".") < 2:
            raise PatchError(
                f"patch target {self.target!r} must be an attribute inside mcore.* (module.attribute)"
            )
        if not self.reason.strip():
            raise PatchError(f"patch of {self.target}: every row needs a reason")

    def describe(self) -> str:
        replacement = self.replacement if isinstance(self.replacement, str) else _qualname(self.replacement)
        return f"{self.kind.value.upper():<7} {self.target} <- {replacement}"


@dataclass
class _Resolved:
    index: int
    patch: Patch
    owner: Any
    attr: str
    replacement: Any
    enabled: bool


@dataclass
class AppliedTarget:
    """One patched attribute: what was there before and what the table put there."""

    target: str
    owner: Any
    attr: str
    original: Any
    """The raw attribute (``owner.__dict__[attr]``), or a sentinel when it was inherited."""
    installed: Any
    rows: tuple[Patch, ...]


@dataclass
class PatchSet:
    """The outcome of :func:`apply_patches`: what changed, what was skipped, and how to undo it."""

    name: str
    table: tuple[Patch, ...]
    targets: tuple[AppliedTarget, ...] = ()
    skipped: tuple[Patch, ...] = ()
    active: bool = True

    @property
    def applied(self) -> tuple[Patch, ...]:
        """The rows that changed something, in table order."""
        rows = {id(row) for t in self.targets for row in t.rows}
        return tuple(row for row in self.table if id(row) in rows)

    def revert(self) -> None:
        """Restore every original attribute (in reverse order). Reverting twice is a no-op."""
        with _APPLY_LOCK:
            if not self.active:
                return
            for applied in self.targets:
                if _raw_attr(applied.owner, applied.attr) is not applied.installed:
                    raise PatchError(
                        f"cannot revert {self.name}: {applied.target} was changed again after this "
                        "patch set applied it (revert patch sets in the reverse order of applying them)"
                    )
            for applied in reversed(self.targets):
                if applied.original is _MISSING:
                    delattr(applied.owner, applied.attr)
                else:
                    setattr(applied.owner, applied.attr, applied.original)
            self.active = False
            _ACTIVE.pop(_table_key(self.table), None)

    def describe(self, reasons: bool = False) -> str:
        """One line per row, applied or skipped (the adaptor logs this once), optionally with reasons."""
        lines = []
        applied = {id(row) for row in self.applied}
        for row in self.table:
            state = "applied" if id(row) in applied else "skipped: condition false"
            lines.append(f"  {row.describe()}  [{state}]" + (f": {row.reason}" if reasons else ""))
        return "\n".join(lines)


_ACTIVE: dict[tuple[int, ...], PatchSet] = {}
_APPLY_LOCK = threading.RLock()


def _table_key(table: tuple[Patch, ...]) -> tuple[int, ...]:
    return tuple(id(row) for row in table)


def _qualname(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def _inside_mcore(module_name: str) -> bool:
    return module_name == ALLOWED_PREFIX[:-1] or module_name.startswith(ALLOWED_PREFIX)


def _is_class(obj: Any) -> bool:
    return isinstance(obj, type)


def resolve_dotted(path: str) -> tuple[Any, str]:
    """Resolve ``"pkg.module.Class.attr"`` to ``(owner, "attr")``, importing modules as needed.

    Raises:
        LookupError: some component does not exist (the message names the first missing one).
    """
    parts = path.split(".")
    obj: Any = importlib.import_module(parts[0])
    walked = parts[0]
    for part in parts[1:-1]:
        obj = _child(obj, walked, part)
        walked = f"{walked}.{part}"
    attr = parts[-1]
    if not hasattr(obj, attr):
        # A submodule that was never imported is not yet an attribute of its package.
        try:
            _child(obj, walked, attr)
        except LookupError:
            raise LookupError(f"{walked} has no attribute {attr!r}") from None
    return obj, attr


def _child(obj: Any, walked: str, part: str) -> Any:
    if hasattr(obj, part):
        return getattr(obj, part)
    if hasattr(obj, "__path__"):  # a package: the child may be a submodule not imported yet
        name = f"{walked}.{part}"
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name != name:
                raise  # the module exists but one of its own imports is missing: a real error
    raise LookupError(f"{walked} has no attribute {part!r}")


def _load(path_or_obj: str | Any) -> Any:
    if not isinstance(path_or_obj, str):
        return path_or_obj
    owner, attr = resolve_dotted(path_or_obj)
    return getattr(owner, attr)


def _raw_attr(owner: Any, attr: str) -> Any:
    """The attribute as stored (staticmethod/classmethod objects intact), or the sentinel if inherited."""
    if _is_class(owner):
        return owner.__dict__.get(attr, _MISSING)
    return getattr(owner, attr, _MISSING)


def _descriptor_type(raw: Any) -> type | None:
    return type(raw) if isinstance(raw, staticmethod | classmethod) else None


def _unwrap(raw: Any) -> Any:
    return raw.__func__ if _descriptor_type(raw) else raw


def _resolve_rows(table: tuple[Patch, ...], name: str) -> list[_Resolved]:
    resolved = []
    for index, row in enumerate(table):
        label = f"{name} row {index} ({row.describe()})"
        try:
            owner, attr = resolve_dotted(row.target)
        except (LookupError, ImportError) as err:
            raise PatchError(f"{label}: target {row.target} does not resolve: {err}") from err
        home = owner.__name__ if isinstance(owner, types.ModuleType) else getattr(owner, "__module__", "")
        if not (isinstance(owner, types.ModuleType | type) and _inside_mcore(home)):
            raise PatchError(
                f"{label}: target {row.target} lives in {home or type(owner).__name__}, not in an mcore "
                "module or class; adaptors patch mcore only"
            )
        try:
            replacement = _load(row.replacement)
        except (LookupError, ImportError) as err:
            raise PatchError(f"{label}: replacement {row.replacement} does not resolve: {err}") from err
        if not callable(replacement) and row.kind is Kind.WRAP:
            raise PatchError(f"{label}: a WRAP replacement must be a callable wrapper factory")
        original = getattr(owner, attr)
        if row.kind is Kind.WRAP and not callable(original):
            raise PatchError(f"{label}: WRAP needs a callable target, {row.target} is {type(original)}")
        try:
            enabled = True if row.when is None else bool(row.when())
        except Exception as err:
            raise PatchError(f"{label}: its condition raised {type(err).__name__}: {err}") from err
        resolved.append(_Resolved(index, row, owner, attr, replacement, enabled))
    return resolved


def _check_replace_conflicts(resolved: list[_Resolved], name: str) -> None:
    replaced: dict[tuple[int, str], _Resolved] = {}
    for item in resolved:
        if item.patch.kind is not Kind.REPLACE:
            continue
        key = (id(item.owner), item.attr)
        if key in replaced:
            first = replaced[key]
            raise PatchError(
                f"{name}: rows {first.index} and {item.index} both REPLACE {item.patch.target}; "
                "a target has at most one REPLACE (use WRAP to stack behaviour)"
            )
        replaced[key] = item
        if not item.enabled:
            continue
        for other in _ACTIVE.values():
            for applied in other.targets:
                if (id(applied.owner), applied.attr) == key and any(
                    r.kind is Kind.REPLACE for r in applied.rows
                ):
                    raise PatchError(
                        f"{name} row {item.index}: {item.patch.target} is already replaced by the "
                        f"active patch set {other.name!r}"
                    )


def apply_patches(table: Iterable[Patch], name: str = "patches") -> PatchSet:
    """Check every row, then apply the enabled ones; return the :class:`PatchSet` (see module doc).

    Args:
        table: the rows, in the order they are applied.
        name: a label for messages and logs (``"mcore.adaptors.npu"``).

    Raises:
        PatchError: a target or replacement does not resolve, a WRAP target is not callable, a target
            is replaced twice, or a condition raised. Nothing has been changed when it is raised.
    """
    table = tuple(table)
    for row in table:
        if not isinstance(row, Patch):
            raise PatchError(f"{name}: table rows must be Patch objects, got {type(row).__name__}")
    with _APPLY_LOCK:
        active = _ACTIVE.get(_table_key(table))
        if active is not None and active.active:
            return active
        resolved = _resolve_rows(table, name)
        _check_replace_conflicts(resolved, name)

        # Group the enabled rows by target, in order of first appearance.
        groups: dict[tuple[int, str], list[_Resolved]] = {}
        for item in resolved:
            if item.enabled:
                groups.setdefault((id(item.owner), item.attr), []).append(item)

        applied: list[AppliedTarget] = []
        try:
            for items in groups.values():
                owner, attr = items[0].owner, items[0].attr
                raw = _raw_attr(owner, attr)
                # A staticmethod/classmethod stays one: rows see and return the plain function.
                descriptor = _descriptor_type(
                    raw if raw is not _MISSING else inspect.getattr_static(owner, attr)
                )
                function = (
                    _unwrap(raw) if raw is not _MISSING else _unwrap(inspect.getattr_static(owner, attr))
                )
                for item in items:
                    if item.patch.kind is Kind.REPLACE:
                        function = _unwrap(item.replacement)
                for item in items:
                    if item.patch.kind is Kind.WRAP:
                        function = item.replacement(function)
                base_raw = descriptor(function) if descriptor else function
                setattr(owner, attr, base_raw)
                applied.append(
                    AppliedTarget(
                        target=items[0].patch.target,
                        owner=owner,
                        attr=attr,
                        original=raw,
                        installed=base_raw,
                        rows=tuple(item.patch for item in items),
                    )
                )
        except Exception as err:
            # A wrapper factory raised half-way: undo what was done, so the failure changes nothing.
            for done in reversed(applied):
                if done.original is _MISSING:
                    delattr(done.owner, done.attr)
                else:
                    setattr(done.owner, done.attr, done.original)
            raise PatchError(
                f"{name}: applying failed ({type(err).__name__}: {err}); nothing is patched"
            ) from err

        patch_set = PatchSet(
            name=name,
            table=table,
            targets=tuple(applied),
            skipped=tuple(item.patch for item in resolved if not item.enabled),
        )
        _ACTIVE[_table_key(table)] = patch_set
        return patch_set


def active_patch_sets() -> tuple[PatchSet, ...]:
    """Every patch set applied and not reverted (for diagnostics)."""
    return tuple(_ACTIVE.values())
