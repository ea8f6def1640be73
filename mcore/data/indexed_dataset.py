"""Megatron's ``.idx``/``.bin`` indexed dataset: a validating mmap reader and an atomic writer.

A dataset is a path prefix ``P``; its files are ``P + ".idx"`` and ``P + ".bin"``. Files written here
open in Megatron-LM's ``IndexedDataset`` and the reverse (byte-for-byte the same layout).

``.idx`` layout (version 1, all integers little-endian, no padding between fields)::

    offset       size  type       field
    0            9     bytes      magic  b"MMIDIDX\\x00\\x00"
    9            8     u64        version, always 1
    17           1     u8         dtype code of the tokens in .bin (table below)
    18           8     u64        S  = number of sequences
    26           8     u64        D1 = len(document_indices) = number of documents + 1
    34           4*S   int32[S]   sequence_lengths   (tokens)
    34+4S        8*S   int64[S]   sequence_pointers  (byte offset of each sequence in .bin)
    34+12S       8*D1  int64[D1]  document_indices   (document i = sequences [d[i], d[i+1]))
    34+12S+8D1   S     int8[S]    sequence_modes, only in multimodal datasets (the caller says so)

dtype codes: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16.

``.bin`` is the concatenation of every sequence's tokens in that dtype, nothing else, so
``size(.bin) == sum(sequence_lengths) * itemsize`` and ``sequence_pointers[i+1] = sequence_pointers[i]
+ sequence_lengths[i] * itemsize`` with ``sequence_pointers[0] == 0``.

The reader checks all of this when it opens a pair (vectorized, O(S)), so a truncated, corrupted or
mismatched pair fails at once with a :class:`DataError` that names the file and byte offset, instead of
producing garbage samples hours into a run. The writer writes both files under temporary names and
renames them only when complete, so an interrupted run never leaves a pair that looks valid.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import struct
from array import array
from collections.abc import Sequence
from typing import Any

import numpy as np

from mcore.data.errors import DataError

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
HEADER_SIZE = 34  # magic 9 + version 8 + dtype code 1 + S 8 + D1 8

# Explicit little-endian dtypes: the format is little-endian whatever the host is.
DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype("<u1"),
    2: np.dtype("<i1"),
    3: np.dtype("<i2"),
    4: np.dtype("<i4"),
    5: np.dtype("<i8"),
    6: np.dtype("<f8"),
    7: np.dtype("<f4"),
    8: np.dtype("<u2"),
}

# Beyond this size the data fingerprint digests sampled blocks of the .idx instead of all of it.
_FULL_DIGEST_LIMIT = 32 << 20
_DIGEST_BLOCK = 1 << 20
# Index entries checked per step when a file is opened (bounds the temporary memory to ~100 MB).
_VALIDATE_BLOCK = 1 << 22


def idx_path(prefix: str) -> str:
    """``prefix + ".idx"`` (the suffix is appended literally, as Megatron does)."""
    return prefix + ".idx"


def bin_path(prefix: str) -> str:
    """``prefix + ".bin"``."""
    return prefix + ".bin"


def code_from_dtype(dtype: Any) -> int:
    """The header dtype code of a numpy dtype (byte order ignored)."""
    wanted = np.dtype(dtype).newbyteorder("<")
    for code, candidate in DTYPE_CODES.items():
        if candidate == wanted:
            return code
    known = ", ".join(f"{c}={d.name}" for c, d in DTYPE_CODES.items())
    raise ValueError(f"dtype {np.dtype(dtype).name} has no Megatron dtype code (known: {known})")


def optimal_dtype(cardinality: int | None) -> np.dtype:
    """Megatron's on-disk token dtype for a vocabulary: uint16 if ``cardinality < 65500``, else int32.

    The threshold is 65500, not 65536, exactly as Megatron's ``DType.optimal_dtype`` has it, so that a
    dataset preprocessed here has the dtype Megatron's tool would have chosen.
    """
    if cardinality is not None and cardinality < 65500:
        return DTYPE_CODES[8]
    return DTYPE_CODES[4]


def exists(prefix: str) -> bool:
    """Whether both files of the dataset ``prefix`` exist."""
    return os.path.isfile(idx_path(prefix)) and os.path.isfile(bin_path(prefix))


def _known_codes() -> str:
    return ", ".join(f"{c}={d.name}" for c, d in DTYPE_CODES.items())


def _first_true(mask: np.ndarray) -> int:
    return int(np.argmax(mask))


class _Index:
    """The parsed and validated ``.idx`` file: header fields plus zero-copy array views of the mmap."""

    def __init__(self, path: str, multimodal: bool = False) -> None:
        self.path = path
        try:
            size = os.path.getsize(path)
        except FileNotFoundError:
            raise DataError(f"{path}: no such index file") from None
        if size < HEADER_SIZE:
            raise DataError(f"{path}: truncated index file: {size} bytes, the header alone is {HEADER_SIZE}")
        with open(path, "rb") as f:
            header = f.read(HEADER_SIZE)
        if header[:9] != INDEX_MAGIC:
            raise DataError(
                f"{path}: not a Megatron index file: bytes 0-8 are {header[:9].hex()}, expected "
                f"{INDEX_MAGIC.hex()} ('MMIDIDX' and two NUL bytes)"
            )
        (version,) = struct.unpack("<Q", header[9:17])
        if version != INDEX_VERSION:
            raise DataError(f"{path}: index version {version} at byte offset 9, only version 1 exists")
        code = header[17]
        if code not in DTYPE_CODES:
            raise DataError(f"{path}: unknown dtype code {code} at byte offset 17 (known: {_known_codes()})")
        self.dtype_code = code
        self.dtype = DTYPE_CODES[code]
        self.sequence_count, self.document_count = struct.unpack("<QQ", header[18:34])
        s, d1 = self.sequence_count, self.document_count
        needed = HEADER_SIZE + 12 * s + 8 * d1 + (s if multimodal else 0)
        if size < needed:
            raise DataError(
                f"{path}: truncated index file: the header (byte offsets 18 and 26) says {s} sequences and "
                f"{d1} document indices, which need {needed} bytes, but the file has {size}"
            )
        if d1 < 1:
            raise DataError(
                f"{path}: corrupted index: document index count {d1} at byte offset 26 must be >= 1"
            )
        # Trailing bytes after the arrays are legal (a multimodal file read as text): ignore them.
        self._mmap = np.memmap(path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
        buf = self._mmap
        self.lengths_offset = HEADER_SIZE
        self.pointers_offset = HEADER_SIZE + 4 * s
        self.documents_offset = HEADER_SIZE + 12 * s
        self.sequence_lengths = np.frombuffer(buf, np.dtype("<i4"), s, self.lengths_offset)
        self.sequence_pointers = np.frombuffer(buf, np.dtype("<i8"), s, self.pointers_offset)
        self.document_indices = np.frombuffer(buf, np.dtype("<i8"), d1, self.documents_offset)
        self.sequence_modes = (
            np.frombuffer(buf, np.dtype("<i1"), s, self.documents_offset + 8 * d1) if multimodal else None
        )
        self._validate()

    def _validate(self) -> None:
        path, s = self.path, self.sequence_count
        lengths, pointers, docs = self.sequence_lengths, self.sequence_pointers, self.document_indices
        if docs[0] != 0:
            raise DataError(
                f"{path}: corrupted index: document_indices[0] = {docs[0]} at byte offset "
                f"{self.documents_offset} must be 0"
            )
        if docs[-1] != s:
            i = len(docs) - 1
            raise DataError(
                f"{path}: corrupted index: the last document index {docs[-1]} at byte offset "
                f"{self.documents_offset + 8 * i} must equal the sequence count {s}"
            )
        # Blockwise, so that memory stays bounded on indices of hundreds of millions of sequences.
        for lo in range(1, len(docs), _VALIDATE_BLOCK):
            step = np.diff(docs[lo - 1 : lo + _VALIDATE_BLOCK])
            if (step < 0).any():
                i = lo + _first_true(step < 0)
                raise DataError(
                    f"{path}: corrupted index: document_indices[{i}] = {docs[i]} at byte offset "
                    f"{self.documents_offset + 8 * i} is smaller than the previous entry {docs[i - 1]}"
                )
        itemsize, offset = self.dtype.itemsize, 0
        for lo in range(0, s, _VALIDATE_BLOCK):
            block = lengths[lo : lo + _VALIDATE_BLOCK]
            if (block < 0).any():
                i = lo + _first_true(block < 0)
                raise DataError(
                    f"{path}: corrupted index: sequence_lengths[{i}] = {lengths[i]} at byte offset "
                    f"{self.lengths_offset + 4 * i} is negative"
                )
            ends = np.cumsum(block, dtype=np.int64) * itemsize + offset
            expected = np.concatenate(([offset], ends[:-1]))
            bad = pointers[lo : lo + len(block)] != expected
            if bad.any():
                j = _first_true(bad)
                i = lo + j
                raise DataError(
                    f"{path}: corrupted index: sequence_pointers[{i}] = {pointers[i]} at byte offset "
                    f"{self.pointers_offset + 8 * i} should be {expected[j]} (the byte sum of the lengths "
                    f"before it)"
                )
            offset = int(ends[-1])

    @property
    def bin_bytes(self) -> int:
        """The exact ``.bin`` size this index describes."""
        if not self.sequence_count:
            return 0
        return int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize


class IndexedDataset:
    """Read-only view of a Megatron ``.idx``/``.bin`` pair; item ``i`` is sequence ``i``'s tokens.

    Args:
        path_prefix: the dataset prefix (without ``.idx``/``.bin``), as given to ``--data-path``.
        multimodal: whether the ``.idx`` carries ``sequence_modes`` (Megatron's caller-supplied flag).
        mmap: memory-map the ``.bin`` (default) or read it with file reads (``--no-mmap-bin-files``).

    Raises:
        DataError: a missing file, a wrong magic, version or dtype code, a truncated or corrupted index,
            or a ``.bin`` whose size differs from what the index describes. The message names the file
            and the byte offset.
    """

    def __init__(self, path_prefix: str, multimodal: bool = False, mmap: bool = True) -> None:
        self.path_prefix = path_prefix
        self.multimodal = multimodal
        self.mmap = mmap
        self._open()

    def _open(self) -> None:
        prefix = self.path_prefix
        ipath, bpath = idx_path(prefix), bin_path(prefix)
        missing = [p for p in (ipath, bpath) if not os.path.isfile(p)]
        if missing:
            stem = prefix[:-4] if prefix.endswith((".bin", ".idx")) else None
            hint = f"; give the prefix without the suffix: {stem}" if stem and exists(stem) else ""
            raise DataError(
                f"missing data path {prefix!r}: no such file {' or '.join(missing)} (a dataset prefix needs "
                f"both {os.path.basename(ipath)} and {os.path.basename(bpath)}){hint}"
            )
        self._index = _Index(ipath, self.multimodal)
        want, have = self._index.bin_bytes, os.path.getsize(bpath)
        if have < want:
            ends = (
                self._index.sequence_pointers
                + self._index.sequence_lengths.astype(np.int64) * self.dtype.itemsize
            )
            i = _first_true(ends > have)
            raise DataError(
                f"{bpath}: the .bin is shorter than its index says: it has {have} bytes, {ipath} needs {want}; "
                f"sequence {i} (byte offset {self._index.sequence_pointers[i]}) runs past the end"
            )
        if have > want:
            raise DataError(
                f"{bpath}: the .bin is longer than its index says: it has {have} bytes, {ipath} describes "
                f"{want} (unexpected bytes from offset {want}); the pair does not belong together"
            )
        self._bin_size = have
        if self.mmap and have:
            self._bin: Any = np.memmap(bpath, dtype=np.uint8, mode="r")
            self._file = None
        else:
            self._bin = None
            self._file = open(bpath, "rb", buffering=0) if have else None

    def __getstate__(self) -> dict[str, Any]:
        # mmaps and file handles do not pickle; DataLoader workers that spawn reopen the files.
        return {"path_prefix": self.path_prefix, "multimodal": self.multimodal, "mmap": self.mmap}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._open()

    def __del__(self) -> None:
        f = getattr(self, "_file", None)
        if f is not None:
            f.close()

    def __len__(self) -> int:
        return self._index.sequence_count

    def __getitem__(self, idx: int | slice) -> np.ndarray | list[np.ndarray]:
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError(f"slices of an IndexedDataset must be contiguous (step 1), got step {step}")
            return [self.get(i) for i in range(start, stop)]
        return self.get(int(idx))

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens of sequence ``idx`` from token ``offset``, ``length`` of them (default: to its end)."""
        n = len(self)
        if idx < 0:
            idx += n
        if not 0 <= idx < n:
            raise IndexError(f"sequence {idx} out of range for {self.path_prefix} ({n} sequences)")
        seq_len = int(self._index.sequence_lengths[idx])
        if length is None:
            length = seq_len - offset
        if offset < 0 or length < 0 or offset + length > seq_len:
            raise IndexError(
                f"tokens [{offset}, {offset + length}) out of range for sequence {idx} of {self.path_prefix} "
                f"({seq_len} tokens)"
            )
        itemsize = self.dtype.itemsize
        start = int(self._index.sequence_pointers[idx]) + offset * itemsize
        if self._bin is not None:
            return np.frombuffer(self._bin, self.dtype, length, start)
        out = np.empty(length, self.dtype)
        if length:
            self._file.seek(start)
            self._file.readinto(memoryview(out).cast("B"))
        return out

    @property
    def dtype(self) -> np.dtype:
        """Token dtype (from the header)."""
        return self._index.dtype

    @property
    def sequence_lengths(self) -> np.ndarray:
        """int32[S]: tokens per sequence."""
        return self._index.sequence_lengths

    @property
    def sequence_pointers(self) -> np.ndarray:
        """int64[S]: byte offset of each sequence in ``.bin``."""
        return self._index.sequence_pointers

    @property
    def document_indices(self) -> np.ndarray:
        """int64[D+1]: document ``i`` is sequences ``[document_indices[i], document_indices[i+1])``."""
        return self._index.document_indices

    @property
    def sequence_modes(self) -> np.ndarray | None:
        """int8[S] for multimodal datasets, else None."""
        return self._index.sequence_modes

    @property
    def num_tokens(self) -> int:
        """Total tokens in ``.bin``."""
        return self._bin_size // self.dtype.itemsize

    def fingerprint(self) -> dict[str, Any]:
        """Identity of the data on disk, for index-cache keys: sizes, mtimes and a digest of the ``.idx``.

        The digest covers the whole ``.idx`` up to 32 MiB (about 2.5M sequences); beyond that, 16 evenly
        spaced 1 MiB blocks (the first holds the header) and the last MiB, so that opening a huge dataset
        stays cheap on every rank. The size and mtime already change on any rewrite; the digest guards
        against a rewrite that keeps both. Memoized per instance.
        """
        cached = getattr(self, "_fingerprint", None)
        if cached is None:
            ipath, bpath = idx_path(self.path_prefix), bin_path(self.path_prefix)
            ist, bst = os.stat(ipath), os.stat(bpath)
            cached = {
                "idx_size": ist.st_size,
                "idx_mtime_ns": ist.st_mtime_ns,
                "idx_md5": _digest(ipath, ist.st_size),
                "bin_size": bst.st_size,
                "bin_mtime_ns": bst.st_mtime_ns,
            }
            self._fingerprint = cached
        return dict(cached)


SAMPLE_WINDOWS = 64
SAMPLE_WINDOW_TOKENS = 4096


def check_token_ids(
    dataset: IndexedDataset,
    vocab_size: int,
    *,
    windows: int = SAMPLE_WINDOWS,
    window_tokens: int = SAMPLE_WINDOW_TOKENS,
) -> None:
    """Sample-check that the dataset's token ids are in ``[0, vocab_size)`` (the tokenizer's ids).

    The index records no largest id, so this reads ``windows`` runs of ``window_tokens`` consecutive
    tokens spread evenly over the ``.bin`` (first and last tokens included; the whole file when it is
    that small): at most 256 Ki tokens (0.5 MiB of uint16), whatever the dataset's size. A dataset
    tokenized with another tokenizer has ids out of range nearly everywhere, so a sample finds it;
    every batch is checked as well, on the device and read at the trainer's log intervals
    (:class:`mcore.training.token_id_check.TokenIdCheck`).

    Raises:
        DataError: naming the ``.bin``, the offending id, its token index and byte offset, and the bound.
    """
    itemsize = dataset.dtype.itemsize
    total = dataset._bin_size // itemsize
    if total == 0:
        return
    path = bin_path(dataset.path_prefix)
    tokens = np.memmap(path, dtype=dataset.dtype, mode="r", shape=(total,))
    if total <= windows * window_tokens:
        starts, length = np.zeros(1, dtype=np.int64), total
    else:
        starts, length = np.linspace(0, total - window_tokens, windows).astype(np.int64), window_tokens
    try:
        for start in starts:
            chunk = np.asarray(tokens[start : start + length])
            bad = (chunk < 0) | (chunk >= vocab_size)
            if bad.any():
                i = int(start) + _first_true(bad)
                raise DataError(
                    f"{path}: token id {tokens[i].item()} at token {i} (byte offset {i * itemsize}) is outside "
                    f"the tokenizer's vocabulary [0, {vocab_size}): {dataset.path_prefix} was tokenized with "
                    "another tokenizer (give the --tokenizer-type/--vocab-size it was preprocessed with)"
                )
    finally:
        del tokens


def _digest(path: str, size: int) -> str:
    md5 = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        if size <= _FULL_DIGEST_LIMIT:
            for block in iter(lambda: f.read(_DIGEST_BLOCK), b""):
                md5.update(block)
        else:
            for offset in [
                *np.linspace(0, size - _DIGEST_BLOCK, 16, dtype=np.int64).tolist(),
                size - _DIGEST_BLOCK,
            ]:
                f.seek(int(offset))
                md5.update(f.read(_DIGEST_BLOCK))
    return md5.hexdigest()


class IndexedDatasetBuilder:
    """Writes a Megatron ``.bin``/``.idx`` pair; the files appear only when :meth:`finalize` completes.

    Tokens go to ``<bin_path>.<pid>.tmp`` as they arrive (streaming, O(sequences) memory for the
    index); ``finalize`` writes the index to a temporary name too, then renames ``.bin`` and ``.idx``
    into place (removing an old ``.idx`` first, so an old index never pairs with the new ``.bin``).
    :meth:`abort` (or leaving a ``with`` block by an exception) deletes the temporaries.

    Args:
        bin_path: the final ``.bin`` path (``prefix + ".bin"``).
        dtype: token dtype; one of the table's (default int32, as Megatron's builder). Integer tokens
            outside the dtype's range are rejected instead of silently wrapping.
    """

    def __init__(self, bin_path: str, dtype: Any = np.int32) -> None:
        self.bin_path = bin_path
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.dtype_code = code_from_dtype(self.dtype)
        self._tmp_bin = f"{bin_path}.{os.getpid()}.tmp"
        self._tmp_idx: str | None = None
        self._file = open(self._tmp_bin, "wb", buffering=8 << 20)
        self._lengths = array("i")
        self._documents = array("q", [0])
        self._is_int = self.dtype.kind in "iu"
        info = np.iinfo(self.dtype) if self._is_int else None
        self._lo, self._hi = (int(info.min), int(info.max)) if info is not None else (0, 0)

    def __enter__(self) -> IndexedDatasetBuilder:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()

    def _as_tokens(self, tokens: Any) -> np.ndarray:
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            arr = arr.reshape(-1)
        if arr.dtype != self.dtype:
            if self._is_int and arr.size:
                if arr.dtype.kind not in "iub":
                    raise ValueError(f"token ids must be integers, got dtype {arr.dtype.name}")
                lo, hi = int(arr.min()), int(arr.max())
                if lo < self._lo or hi > self._hi:
                    raise ValueError(
                        f"token id {hi if hi > self._hi else lo} does not fit the dataset dtype "
                        f"{self.dtype.name} [{self._lo}, {self._hi}]; choose a wider dtype (int32 for "
                        "vocabularies of 65500 tokens or more)"
                    )
            arr = arr.astype(self.dtype)
        return np.ascontiguousarray(arr)

    def add_item(self, tokens: Any) -> None:
        """Append one sequence; it does not close a document (see :meth:`end_document`)."""
        arr = self._as_tokens(tokens)
        self._file.write(memoryview(arr).cast("B"))
        self._lengths.append(arr.size)

    def end_document(self) -> None:
        """Close the current document: it spans the sequences added since the previous close."""
        self._documents.append(len(self._lengths))

    def add_document(self, tokens: Any, lengths: Sequence[int]) -> None:
        """Append one document made of ``len(lengths)`` sequences whose tokens are concatenated in ``tokens``.

        ``add_document([], [])`` appends an empty document (as Megatron's tool does for an empty line).
        """
        arr = self._as_tokens(tokens)
        if sum(lengths) != arr.size:
            raise ValueError(
                f"sequence lengths {list(lengths)} sum to {sum(lengths)}, not the {arr.size} tokens given"
            )
        self._file.write(memoryview(arr).cast("B"))
        self._lengths.extend(lengths)
        self._documents.append(len(self._lengths))

    def add_documents(self, tokens: Any, sequence_lengths: Any, sequences_per_document: Any) -> None:
        """Append many documents at once (the preprocessing hot path).

        Args:
            tokens: all their tokens, concatenated.
            sequence_lengths: length of every sequence, in order.
            sequences_per_document: how many of those sequences each document has (0: an empty document).
        """
        arr = self._as_tokens(tokens)
        lengths = np.asarray(sequence_lengths, dtype=np.int64)
        per_doc = np.asarray(sequences_per_document, dtype=np.int64)
        if int(lengths.sum()) != arr.size or int(per_doc.sum()) != lengths.size:
            raise ValueError(
                f"{arr.size} tokens, {lengths.size} sequence lengths summing to {int(lengths.sum())} and "
                f"{per_doc.size} documents of {int(per_doc.sum())} sequences do not agree"
            )
        self._file.write(memoryview(arr).cast("B"))
        start = len(self._lengths)
        self._lengths.frombytes(lengths.astype(np.int32).tobytes())
        self._documents.frombytes((np.cumsum(per_doc) + start).astype(np.int64).tobytes())

    def add_index(self, path_prefix: str) -> None:
        """Append every document of another dataset (the merge operation); its dtype must match."""
        other = IndexedDataset(path_prefix)
        if other.dtype != self.dtype:
            raise DataError(
                f"{idx_path(path_prefix)}: token dtype {other.dtype.name} differs from the output's "
                f"{self.dtype.name}; datasets can only be merged when their dtypes match"
            )
        offset = len(self._lengths)
        self._lengths.extend(other.sequence_lengths.astype(np.int32).tolist())
        self._documents.extend((other.document_indices[1:] + offset).tolist())
        with open(bin_path(path_prefix), "rb") as src:
            shutil.copyfileobj(src, self._file, 16 << 20)

    def finalize(self, idx_path: str) -> None:
        """Write the index to ``idx_path`` and move both files into place (atomically each)."""
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            lengths = np.frombuffer(self._lengths, dtype=np.int32) if self._lengths else np.zeros(0, np.int32)
            documents = np.frombuffer(self._documents, dtype=np.int64)
            pointers = np.zeros(len(lengths), dtype=np.int64)
            if len(lengths) > 1:
                np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
            self._tmp_idx = f"{idx_path}.{os.getpid()}.tmp"
            with open(self._tmp_idx, "wb") as f:
                f.write(INDEX_MAGIC)
                f.write(struct.pack("<Q", INDEX_VERSION))
                f.write(struct.pack("<B", self.dtype_code))
                f.write(struct.pack("<QQ", len(lengths), len(documents)))
                f.write(lengths.astype("<i4").tobytes())
                f.write(pointers.astype("<i8").tobytes())
                f.write(documents.astype("<i8").tobytes())
                f.flush()
                os.fsync(f.fileno())
            # Drop an old index first: between the two renames no stale .idx may pair with the new .bin.
            if os.path.exists(idx_path):
                os.remove(idx_path)
            os.replace(self._tmp_bin, self.bin_path)
            os.replace(self._tmp_idx, idx_path)
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """Close and delete the temporary files; nothing is left at the final paths."""
        if not self._file.closed:
            self._file.close()
        for tmp in (self._tmp_bin, self._tmp_idx):
            if tmp and os.path.exists(tmp):
                os.remove(tmp)
