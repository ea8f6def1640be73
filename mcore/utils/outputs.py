"""One rule for every command that writes (export-hf, import-hf, export-megatron, preprocess, merge,
training ``--save``), implemented once here:

1. **Never an input.** An output path that is, contains or lies inside an input path
   (``--save`` and ``--load``, ``--output-prefix`` and ``--input``) is refused before anything is read
   or written (:func:`check_not_input`): writing there would overwrite, or delete, what is being read.
2. **Never a non-empty foreign directory.** A tool replaces a non-empty directory only when the
   directory carries the marker file (:data:`MARKER`) that the same tool wrote into an earlier output of
   its own, and only with its ``--overwrite``; anything else needs a more specific flag that the
   message names (:func:`check_output_dir`).
3. **Written under a temporary name in the target's directory, renamed when complete**
   (:func:`staged_dir`): a failure (an error, a full disk, a kill) leaves the target as it was; the
   temporary directory is removed on an error, and a later run of the tool ignores it.
4. **Found before the work starts:** a target under a file or in a non-writable directory is one
   line naming the flag (:func:`check_writable`), not ``[Errno 17] File exists`` hours later.

Every refusal is an :class:`OutputError`: one line that starts with the flag and its value.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
from collections.abc import Iterable, Iterator, Mapping, Sequence

MARKER = ".mcore-output.json"
"""The file each tool writes into a directory it produced: ``{"tool": "mcore-export-hf"}``."""


class OutputError(ValueError):
    """An output path that the rule above refuses; its message is one line naming the flag."""


def _real(path: str | os.PathLike) -> str:
    return os.path.realpath(os.path.abspath(os.fspath(path)))


def relation(output: str | os.PathLike, other: str | os.PathLike) -> str | None:
    """How ``output`` sits against ``other``: ``"is"``, ``"contains"``, ``"lies inside"`` or None."""
    a, b = _real(output), _real(other)
    if a == b:
        return "is"
    if b.startswith(a.rstrip(os.sep) + os.sep):
        return "contains"
    if a.startswith(b.rstrip(os.sep) + os.sep):
        return "lies inside"
    return None


def check_not_input(
    flag: str, output: str | os.PathLike, inputs: Mapping[str, str | os.PathLike | Sequence[str]]
) -> None:
    """Refuse an ``output`` (given as ``flag``) that is, contains or lies inside one of ``inputs``
    (input flag -> path, or a list of paths)."""
    for in_flag, paths in inputs.items():
        for path in [paths] if isinstance(paths, (str, os.PathLike)) else paths:
            if path is None:
                continue
            how = relation(output, path)
            if how is not None:
                raise OutputError(
                    f"{flag} {os.fspath(output)} {how} the input {in_flag} {os.fspath(path)}: writing "
                    f"there would overwrite what is being read; choose another {flag}"
                )


def check_writable(
    flag: str, output: str | os.PathLike, *, directory: bool = True, value: str | None = None
) -> None:
    """Refuse an ``output`` that cannot be created: a file where a directory goes (``directory``:
    the output itself is a directory), a directory where a file goes, a file among its parents, or a
    non-writable parent. ``value``: the flag's value, when it is not ``output`` itself (a prefix)."""
    path = os.path.abspath(os.fspath(output))
    head = f"{flag} {value if value is not None else os.fspath(output)}: cannot write"
    if os.path.exists(path):
        if directory != os.path.isdir(path):
            raise OutputError(f"{head} {path}: {'a file' if directory else 'a directory'} is in the way")
        where = path if directory else os.path.dirname(path)
    else:
        where = os.path.dirname(path)
        while not os.path.exists(where):
            where = os.path.dirname(where)
        if not os.path.isdir(where):
            blocked = path if directory else os.path.dirname(path)
            raise OutputError(f"{head} {blocked}: a file is in the way ({where})")
    if not os.access(where, os.W_OK | os.X_OK):
        raise OutputError(f"{head} {path}: {where} is not writable")


def read_marker(path: str | os.PathLike) -> dict | None:
    """The marker of a directory a tool wrote (None: it has none, or it cannot be read)."""
    try:
        with open(os.path.join(path, MARKER), encoding="utf-8") as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def write_marker(path: str | os.PathLike, tool: str) -> None:
    with open(os.path.join(path, MARKER), "w", encoding="utf-8") as f:
        json.dump({"tool": tool}, f)
        f.write("\n")


def _some_entries(path: str, limit: int = 3) -> str:
    names = sorted(n for n in os.listdir(path) if n != MARKER)
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def check_output_dir(
    flag: str,
    output: str | os.PathLike,
    *,
    tool: str,
    inputs: Mapping[str, str | os.PathLike | Sequence[str]] | None = None,
    overwrite: bool = False,
    overwrite_flag: str | None = "--overwrite",
    replace_flag: str | None = None,
    replace_foreign: bool = False,
) -> bool:
    """Check an output directory against the rule (module docstring); True when it holds an earlier
    output of ``tool`` that may be replaced (or, with ``replace_foreign``, anything).

    Args:
        overwrite_flag: the tool's flag that replaces its own earlier output (None: it has none, a
            non-empty directory is always refused).
        replace_flag: the more specific flag that replaces a directory which is not an output of ``tool``
            (named in the message; None: the tool has none).
    """
    check_writable(flag, output, directory=True)
    check_not_input(flag, output, inputs or {})
    path = os.fspath(output)
    if not os.path.isdir(path) or not os.listdir(path):
        return False
    marker = read_marker(path)
    own = marker is not None and marker.get("tool") == tool
    if replace_foreign or (own and overwrite):
        return True
    if own:
        hint = f"give {overwrite_flag} to replace it" if overwrite_flag else "choose another " + flag
        raise OutputError(f"{flag} {path}: holds an earlier {tool} output ({hint})")
    hint = f"; {replace_flag} replaces it anyway" if replace_flag else f"; choose another {flag}"
    raise OutputError(
        f"{flag} {path}: the directory is not empty and is not an earlier {tool} output "
        f"(it holds {_some_entries(path)}){hint}"
    )


@contextlib.contextmanager
def staged_dir(output: str | os.PathLike, *, tool: str | None = None) -> Iterator[str]:
    """A fresh directory beside ``output`` to write into. When the block ends without an error, the
    marker of ``tool`` is written into it and it takes ``output``'s place (an existing ``output`` is
    first renamed aside and removed only once the new one is in place); on any error it is removed
    and ``output`` is left as it was. The caller has checked ``output`` (:func:`check_output_dir`)."""
    final = os.path.abspath(os.fspath(output))
    parent = os.path.dirname(final)
    os.makedirs(parent, exist_ok=True)
    token = secrets.token_hex(4)
    staging = os.path.join(parent, f".{os.path.basename(final)}.tmp-{token}")
    os.makedirs(staging)
    try:
        yield staging
        if tool is not None:
            write_marker(staging, tool)
        _swap_into_place(staging, final, token)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _swap_into_place(staging: str, final: str, token: str) -> None:
    """Rename ``staging`` to ``final``. A directory cannot atomically replace a non-empty one, so an
    existing ``final`` goes aside first and is removed last: a kill in between leaves both complete."""
    if os.path.isdir(final) and os.listdir(final):
        aside = os.path.join(os.path.dirname(final), f".{os.path.basename(final)}.old-{token}")
        os.rename(final, aside)
        os.rename(staging, final)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.replace(staging, final)  # absent, or an empty directory (rename(2) replaces it)


def check_output_files(
    flag: str, value: str, outputs: Iterable[str | os.PathLike], inputs: Mapping[str, Sequence[str]]
) -> None:
    """Check the files a tool writes (a dataset's ``.bin``/``.idx``; ``value``: the flag's value, a
    prefix): each creatable, none an input file nor inside an input directory (``inputs``: input flag
    -> its files or directories)."""
    for out in outputs:
        check_writable(flag, out, directory=False, value=value)
        check_not_input(flag, out, inputs)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def with_umask(path: str | os.PathLike, *, directory: bool = False) -> None:
    """Give ``path`` the mode a plain ``open``/``mkdir`` would under the user's umask: files that a
    library writes through a private temporary file (safetensors, ``tempfile``) come out 0600, which a
    shared cluster's other users cannot read."""
    os.chmod(path, (0o777 if directory else 0o666) & ~_umask())


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """``text`` into ``path`` under a temporary name in its directory, renamed when complete."""
    final = os.path.abspath(os.fspath(path))
    tmp = os.path.join(os.path.dirname(final), f".{os.path.basename(final)}.tmp-{secrets.token_hex(4)}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
