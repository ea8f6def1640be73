"""Megatron-LM's command line, generated from the typed config dataclasses.

``build_parser(groups)`` turns each dataclass field made with :func:`mcore.config.fields.flag` into
an argparse option; ``parse_config(groups, argv)`` parses, reports unknown flags by name (with the
closest known flag, or the reason a Megatron flag is deliberately not supported), and constructs
every config object, whose own validation then runs. User mistakes end in one line on stderr and
exit status 2, never a traceback.

As Megatron-LM's argparse does, an unambiguous prefix of a flag is accepted (``--vocab-f`` for
``--vocab-file``); an ambiguous one is an error naming the candidates. Old spellings
(``LEGACY_MEGATRON_FLAGS``) are rewritten to their current meaning with a one-line note, and the
Megatron flags that change nothing in mcore (``IGNORED_MEGATRON_FLAGS``) are listed once with the reason.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import logging
import os
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from mcore.config.fields import ConfigError, flag_name, turns_off
from mcore.config.megatron_flags import (
    IGNORED_MEGATRON_FLAG_VALUES,
    IGNORED_MEGATRON_FLAGS,
    LEGACY_FLAG_VALUES,
    LEGACY_MEGATRON_FLAGS,
    UNSUPPORTED_MEGATRON_FLAGS,
)

ConfigGroups = Mapping[str, type]


def _strip_optional(annotation: Any) -> Any:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _add_field(group: argparse._ArgumentGroup, field: dataclasses.Field, annotation: Any, dest: str) -> None:
    meta = field.metadata
    names = [flag_name(field), *meta.get("aliases", ())]
    kwargs: dict[str, Any] = {"dest": dest, "help": meta.get("help", ""), "default": argparse.SUPPRESS}
    base = _strip_optional(annotation)
    origin = typing.get_origin(base)
    if base is bool:
        # "--no-X" clears a field that defaults to True (--no-gradient-accumulation-fusion); a field
        # named no_x (--no-load-optim) is an ordinary switch that sets True.
        negative = turns_off(flag_name(field)) and field.default is True
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
    parser = _Parser(prog=prog, description=description, allow_abbrev=True)
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
        if ignored not in seen:
            parser.add_argument(
                ignored, nargs="?", const=True, dest=_IGNORED_DEST + ignored, default=argparse.SUPPRESS,
                help=argparse.SUPPRESS,
            )  # fmt: skip
    return parser


_IGNORED_DEST = "ignored:"


def _say(message: str) -> None:
    """A note for the user (an INFO record: on stdout, as Megatron's notes), once per job (rank 0 of a
    launcher, or a lone process)."""
    if os.environ.get("RANK", "0") == "0":
        logging.getLogger(__name__).info(message)


def rewrite_legacy_flags(parser: argparse.ArgumentParser, argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """``argv`` with every old spelling (:data:`LEGACY_MEGATRON_FLAGS`, :data:`LEGACY_FLAG_VALUES`) in
    its current form, and the deprecation notes. A flag this parser declares itself is left alone.

    Raises:
        ConfigError: an old flag with a value that has no current meaning (named with the value).
    """
    known = set(known_flags(parser))
    out: list[str] = []
    notes: list[str] = []
    tokens = list(argv)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        i += 1
        spelling, eq, inline = token.partition("=")
        legacy = LEGACY_MEGATRON_FLAGS.get(spelling)
        if legacy is not None and spelling not in known:
            value = None
            if legacy.takes_value:
                if eq:
                    value = inline
                elif i < len(tokens):
                    value, i = tokens[i], i + 1
                else:
                    raise ConfigError(f"{spelling} needs a value")
            try:
                out.extend(legacy.replace(value))
            except ValueError as err:
                raise ConfigError(f"{spelling} {err}") from None
            if legacy.note not in notes:
                notes.append(legacy.note)
            continue
        values = LEGACY_FLAG_VALUES.get(spelling)
        if values is not None:
            value = inline if eq else (tokens[i] if i < len(tokens) else None)
            if value in values:
                notes.append(f"{spelling} {value} is deprecated: using {spelling} {values[value]}")
                out.extend([spelling, values[value]])
                i += 0 if eq else 1
                continue
        out.append(token)
    return out, notes


def ignored_flags_note(namespace: argparse.Namespace, argv: Sequence[str] = ()) -> str | None:
    """One line naming each accepted-but-ignored Megatron flag that was given, with the reason (and
    each given flag value of :data:`IGNORED_MEGATRON_FLAG_VALUES`, found in ``argv``)."""
    given = [k[len(_IGNORED_DEST) :] for k in vars(namespace) if k.startswith(_IGNORED_DEST)]
    reasons = [f"{name} ({IGNORED_MEGATRON_FLAGS[name]})" for name in given]
    for i, token in enumerate(argv):
        spelling, eq, inline = token.partition("=")
        value = inline if eq else (argv[i + 1] if i + 1 < len(argv) else None)
        reason = IGNORED_MEGATRON_FLAG_VALUES.get(spelling, {}).get(value)
        if reason:
            reasons.append(f"{spelling} {value} ({reason})")
    if not reasons:
        return None
    reasons = "; ".join(reasons)
    return f"NOTE: these Megatron-LM flags change nothing in mcore: {reasons}"


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
    defaults: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Parse ``argv`` into one config object per group; exit 2 with one message on a user mistake.

    ``extra_args`` are flags another parser owns (kept out of the unknown-flag check). ``defaults``
    maps field names to the defaults a script sets for them (Megatron's ``args_defaults``, e.g.
    ``{"tokenizer_type": "GPT2BPETokenizer"}`` in ``pretrain_gpt.py``); a flag given wins. Its notes
    are INFO records (the entry point shows them: :func:`mcore.utils.console.configure_console`).
    """
    parser = build_parser(groups, prog=prog)
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        argv, notes = rewrite_legacy_flags(parser, argv)
    except ConfigError as err:
        parser.error(str(err))
    known = set(known_flags(parser))
    # A refused Megatron flag is named as such, even where it happens to abbreviate a flag of ours.
    refused = [a for a in argv if a.split("=", 1)[0] in UNSUPPORTED_MEGATRON_FLAGS and a not in known]
    namespace, unknown = parser.parse_known_args(argv)
    unknown = refused + [u for u in unknown if u.split("=", 1)[0] not in set(extra_args)]
    message = explain_unknown_flags(parser, unknown)
    if message:
        parser.error(message)
    for group_name, cls in groups.items():
        for field in dataclasses.fields(cls):
            dest = f"{group_name}.{field.name}"
            if defaults and field.name in defaults and not hasattr(namespace, dest):
                setattr(namespace, dest, defaults[field.name])
    try:
        configs = build_configs(groups, namespace)
    except ConfigError as err:
        parser.error(str(err))
    for note in notes:
        _say(f"WARNING: {note}")
    ignored = ignored_flags_note(namespace, argv)
    if ignored:
        _say(ignored)
    return configs
