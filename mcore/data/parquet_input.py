"""Parquet input for ``mcore-preprocess-data`` (``--input x.parquet``, a directory or a glob of them).

Each row becomes the JSON line ``{key: value, ...}`` of its ``--json-keys`` columns, which then goes
through the same parsing and tokenizing as a JSON Lines input: the same rules (a string is one
sentence, a list of strings pre-split sentences, a null is an error naming the row) and byte-identical
``.bin/.idx`` output for the same rows given as JSONL. Error messages name ``file.parquet:ROW`` (rows
1-based, counted over the whole file). Only the key columns are read, one record batch at a time.

pyarrow is an optional dependency (``pip install 'mcore[parquet]'``); without it, a parquet input is
one error that says so.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

from mcore.data.errors import DataError

PARQUET_SUFFIX = ".parquet"


def is_parquet(path: str) -> bool:
    return path.endswith(PARQUET_SUFFIX)


def require_pyarrow(path: str) -> Any:
    """``pyarrow.parquet``, or a :class:`DataError` naming the extra that installs it."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(
            f"{path}: reading parquet needs pyarrow, which is not installed: "
            "pip install 'mcore[parquet]' (or pip install pyarrow)"
        ) from None
    return pq


def _text_column(column_type: Any) -> bool:
    """A string column, or a list of strings (pre-split sentences)."""
    import pyarrow as pa

    def is_string(t: Any) -> bool:
        return pa.types.is_string(t) or pa.types.is_large_string(t) or _is_string_view(pa, t)

    if is_string(column_type):
        return True
    if pa.types.is_list(column_type) or pa.types.is_large_list(column_type):
        return is_string(column_type.value_type)
    return False


def _is_string_view(pa: Any, t: Any) -> bool:
    check = getattr(pa.types, "is_string_view", None)  # pyarrow >= 16
    return bool(check and check(t))


def check_parquet_file(path: str, keys: Sequence[str]) -> None:
    """Open ``path``'s footer and check that every key is a string (or list-of-strings) column.

    Raises:
        DataError: pyarrow missing, not a parquet file, a missing key column, or a column of another type.
    """
    pq = require_pyarrow(path)
    try:
        schema = pq.read_schema(path)
    except Exception as err:  # noqa: BLE001 - pyarrow raises several types for a damaged file
        raise DataError(f"{path}: not a readable parquet file: {err}") from None
    for key in keys:
        index = schema.get_field_index(key)
        if index < 0:
            shown = ", ".join(schema.names[:8]) or "none"
            raise DataError(f"{path}: no column {key!r} for --json-keys (the file's columns: {shown})")
        column_type = schema.field(index).type
        if not _text_column(column_type):
            raise DataError(
                f"{path}: column {key!r} is {column_type}, expected strings or lists of strings (--json-keys)"
            )


def parquet_json_lines(path: str, keys: Sequence[str], batch_size: int) -> Iterator[list[bytes]]:
    """The rows of ``path`` as JSON lines of their ``keys`` columns, ``batch_size`` rows at a time."""
    pq = require_pyarrow(path)
    file = pq.ParquetFile(path)
    for batch in file.iter_batches(batch_size=batch_size, columns=list(dict.fromkeys(keys))):
        columns = [batch.column(key).to_pylist() for key in keys]
        yield [
            json.dumps(dict(zip(keys, values)), ensure_ascii=False).encode("utf-8") + b"\n"
            for values in zip(*columns)
        ]
