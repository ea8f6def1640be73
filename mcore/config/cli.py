"""Megatron-LM's command line, generated from the typed config dataclasses.

``build_parser(groups)`` turns each dataclass field made with :func:`mcore.config.fields.flag` into
an argparse option; ``parse_config(groups, argv)`` parses, reports unknown flags by name (with the
closest known flag, or the reason a Megatron flag is deliberately not supported), and constructs
every config object, whose own validation then runs. User mistakes end in one line on stderr and
exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from mcore.config.fields import ConfigError, flag_name
from mcore.config.megatron_flags import IGNORED_MEGATRON_FLAGS, UNSUPPORTED_MEGATRON_FLAGS

ConfigGroups = Mapping[str, type]


def _strip_optional(annotation: Any) -> Any:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _parse_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def _add_field(group: argparse._ArgumentGroup, field: dataclasses.Field, annotation: Any, dest: str) -> None:
    meta = field.metadata
    names = [flag_name(field), *meta.get("aliases", ())]
    kwargs: dict[str, Any] = {"dest": dest, "help": meta.get("help", ""), "default": argparse.SUPPRESS}
    base = _strip_optional(annotation)
    origin = typing.get_origin(base)
    if base is bool:
        # "--no-X" clears a field that defaults to True (--no-gradient-accumulation-fusion); a field
        # named no_x (--no-load-optim) is an ordinary switch that sets True.
        negative = flag_name(field).startswith("--no-") and field.default is True
        kwargs["action"] = "store_false" if negative else "store_true"
    else:
        if origin in (list, tuple, Sequence):
            item = typing.get_args(base)[0] if typing.get_args(base) else str
            kwargs["type"] = item if item in (int, float, str) else str
            kwargs["nargs"] = meta.get("nargs") or "+"
        else:
            kwargs["type"] = base if base in (int, float, str) else str
            if meta.get("nargs") is not None:
                kwargs["nargs"] = meta["nargs"]
        if meta.get("choices") is not None:
            kwargs["choices"] = meta["choices"]
        kwargs["metavar"] = meta.get("metavar") or field.name.upper()
    group.add_argument(*names, **kwargs)


def _cli_fields(cls: type):
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if field.metadata.get("cli", False) and field.init:
            yield field, hints[field.name]


class _Parser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line (the full usage of ~200 flags would bury it)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser(groups: ConfigGroups, prog: str | None = None, description: str | None = None):
    """An argparse parser with one argument group per config class."""
    parser = _Parser(prog=prog, description=description, allow_abbrev=False)
    seen: dict[str, str] = {}
    for group_name, cls in groups.items():
        group = parser.add_argument_group(group_name, (cls.__doc__ or "").strip().splitlines()[0])
        for field, annotation in _cli_fields(cls):
            spelling = flag_name(field)
            if spelling in seen:
                raise TypeError(f"flag {spelling} is declared by both {seen[spelling]} and {cls.__name__}")
            seen[spelling] = cls.__name__
            _add_field(group, field, annotation, dest=f"{group_name}.{field.name}")
    for ignored in IGNORED_MEGATRON_FLAGS:
        parser.add_argument(ignored, nargs="?", const=True, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return parser


def known_flags(parser: argparse.ArgumentParser) -> list[str]:
    return [s for action in parser._actions for s in action.option_strings if s.startswith("--")]


def explain_unknown_flags(parser: argparse.ArgumentParser, unknown: Sequence[str]) -> str | None:
    """One message naming every unknown flag, with a suggestion or the reason it is unsupported."""
    problems = []
    flags = known_flags(parser)
    for token in unknown:
        if not token.startswith("--"):
            continue
        spelling = token.split("=", 1)[0]
        if spelling in UNSUPPORTED_MEGATRON_FLAGS:
            problems.append(
                f"{spelling} is a Megatron-LM flag mcore does not support: "
                f"{UNSUPPORTED_MEGATRON_FLAGS[spelling]}"
            )
            continue
        close = difflib.get_close_matches(spelling, flags, n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]}?)" if close else ""
        problems.append(f"unknown flag {spelling}{hint}")
    if not problems and unknown:
        problems.append(f"unexpected arguments: {' '.join(unknown)}")
    return "; ".join(problems) if problems else None


def namespace_values(namespace: argparse.Namespace, group_name: str) -> dict[str, Any]:
    prefix = group_name + "."
    values = {}
    for key, value in vars(namespace).items():
        if key.startswith(prefix):
            values[key[len(prefix) :]] = tuple(value) if isinstance(value, list) else value
    return values


def build_configs(groups: ConfigGroups, namespace: argparse.Namespace) -> dict[str, Any]:
    """Construct each config class from the parsed values (its ``__post_init__`` validates)."""
    return {name: cls(**namespace_values(namespace, name)) for name, cls in groups.items()}


def parse_config(
    groups: ConfigGroups,
    argv: Sequence[str] | None = None,
    prog: str | None = None,
    extra_args: Sequence[str] = (),
) -> dict[str, Any]:
    """Parse ``argv`` into one config object per group; exit 2 with one message on a user mistake.

    ``extra_args`` are flags another parser owns (kept out of the unknown-flag check).
    """
    parser = build_parser(groups, prog=prog)
    argv = list(sys.argv[1:] if argv is None else argv)
    namespace, unknown = parser.parse_known_args(argv)
    unknown = [u for u in unknown if u.split("=", 1)[0] not in set(extra_args)]
    message = explain_unknown_flags(parser, unknown)
    if message:
        parser.error(message)
    try:
        return build_configs(groups, namespace)
    except ConfigError as err:
        parser.error(str(err))
