"""Config fields that carry their own command-line flag.

Every knob of mcore lives in a typed, frozen dataclass (``ParallelConfig``, ``ModelConfig``, ...).
The command line is generated from those fields, so a flag's name, type, default and help text
are written once, next to the field::

    @dataclass(frozen=True, kw_only=True)
    class ParallelConfig:
        tensor_model_parallel_size: int = flag(1, "Degree of tensor model parallelism.")

gives ``--tensor-model-parallel-size`` (Megatron's spelling: the field name with ``-``).
``name=`` overrides the spelling, ``aliases=`` adds old spellings, and a boolean whose Megatron flag
turns something *off* (``--no-masked-softmax-fusion``) is declared with ``name="--no-..."``,
which makes the flag store ``False``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

_MISSING = dataclasses.MISSING


def flag(
    default: Any = _MISSING,
    help: str = "",
    *,
    name: str | None = None,
    aliases: Sequence[str] = (),
    choices: Sequence[Any] | None = None,
    nargs: str | int | None = None,
    metavar: str | None = None,
    default_factory: Any = _MISSING,
    cli: bool = True,
) -> Any:
    """A dataclass field that is also a command-line flag.

    Args:
        default: the default value (use ``default_factory`` for lists).
        help: one sentence shown by ``--help``; keep it next to the field it documents.
        name: the flag spelling, when it is not ``--`` + the field name with dashes.
        aliases: extra spellings accepted for the same field.
        choices: the accepted values.
        nargs: argparse ``nargs`` (``"+"``, ``"*"``, an int) for list-valued fields.
        metavar: argparse metavar.
        default_factory: a factory for mutable defaults.
        cli: ``False`` keeps the field out of the command line (derived or internal values).
    """
    metadata = {
        "help": help,
        "flag": name,
        "aliases": tuple(aliases),
        "choices": tuple(choices) if choices is not None else None,
        "nargs": nargs,
        "metavar": metavar,
        "cli": cli,
    }
    if default_factory is not _MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def flag_name(field: dataclasses.Field) -> str:
    """The primary command-line spelling of a config field."""
    return field.metadata.get("flag") or "--" + field.name.replace("_", "-")


def turns_off(spelling: str) -> bool:
    """Whether a boolean flag's spelling says "off": ``--no-X``, or a model's ``--<model>-no-X``
    (Megatron's ``--bert-no-binary-head``). Such a flag stores ``False`` into a field defaulting to True."""
    return spelling.startswith("--no-") or "-no-" in spelling


class ConfigError(ValueError):
    """A configuration that cannot run. The message names every value involved."""


def check(condition: bool, message: str) -> None:
    """Raise :class:`ConfigError` with ``message`` unless ``condition`` holds."""
    if not condition:
        raise ConfigError(message)
