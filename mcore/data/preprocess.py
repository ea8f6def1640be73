"""``mcore-preprocess-data``: JSON Lines (or parquet) -> Megatron ``.bin/.idx``, with Megatron's flags and output.

    mcore-preprocess-data --input corpus.jsonl --output-prefix data/my-gpt2 \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \\
        --append-eod --workers 8

writes ``data/my-gpt2_text_document.{bin,idx}`` (one pair per ``--json-keys`` key), byte-identical to
what Megatron-LM's ``tools/preprocess_data.py`` writes for the same input and tokenizer. ``--input`` is a
file, a directory (its ``*.jsonl``/``*.json`` files, ``.gz`` too, and ``*.parquet`` files, in sorted
order) or a glob. Parquet files are read directly (pyarrow, the ``[parquet]`` extra): each row's
``--json-keys`` columns are one document, exactly as the same row written as a JSON line would be
(:mod:`mcore.data.parquet_input`).

Per line and key (Megatron's rules): the value is a string (one sentence) or a list of strings
(pre-split sentences); each non-empty tokenized sentence becomes one sequence; ``--append-eod`` adds the
EOD id to the last one; a line whose key tokenizes to nothing becomes an empty document.

``--split-sentences`` (BERT's sentence-level data) splits each string value into sentences first and
writes ``{prefix}_{key}_sentence.{bin,idx}`` (Megatron's names): one document per JSON line, one sequence
per sentence. Megatron splits with NLTK punkt, downloaded at run time; mcore uses the documented
rule-based splitter of :mod:`mcore.data.sentences` (English; ``--lang`` other than ``english`` is refused)
and needs nothing downloaded. ``--keep-newlines`` keeps the whitespace after each sentence with it. A list
value is taken as already split (Megatron's splitter does not accept one).

The input is streamed: the main process reads chunks of ``--chunk-size`` lines, ``--workers`` processes
parse and tokenize them, and the main process appends the results in input order (at most
``4 * workers`` chunks in flight, so memory stays bounded whatever the input size). A progress line
(docs/s, MB/s) goes to stderr every ``--log-interval`` documents.

Bad input. Each of these stops the run with one line naming the file and line (and byte offset for
bad UTF-8), unless ``--bad-lines skip`` is given, which skips such lines and reports how many were
skipped and where the first ones were (if every line is bad, that is an error all the same: nothing
is written): malformed JSON, a line that is not a JSON object, a missing
``--json-keys`` key, a value that is not a string or list of strings, bytes that are not UTF-8, and text
the tokenizer cannot encode. Lines that are only whitespace are ignored. Empty documents follow
``--empty-documents``: ``keep`` (default; written as empty documents, exactly as Megatron does, and
counted), ``skip`` (the whole line is left out of every key's dataset) or ``error``. Outputs are written
under temporary names and renamed only when complete; a failed run leaves nothing at the output paths.
An output that cannot be written (a read-only directory, a path through a file, a full disk) is one
error naming the path.
"""

from __future__ import annotations

import glob
import gzip
import itertools
import json
import multiprocessing
import os
import sys
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mcore.config.cli import parse_config
from mcore.config.fields import ConfigError, check, flag
from mcore.data.config import TokenizerConfig
from mcore.data.errors import DataError
from mcore.data.indexed_dataset import IndexedDatasetBuilder, bin_path, idx_path, optimal_dtype
from mcore.data.parquet_input import PARQUET_SUFFIX, check_parquet_file, is_parquet, parquet_json_lines
from mcore.data.sentences import split_sentences
from mcore.data.tokenizers import Tokenizer, build_tokenizer
from mcore.data.vocab_identity import tokenizer_identity, write_dataset_vocab
from mcore.utils.console import configure_console
from mcore.utils.outputs import OutputError, check_output_files

PROG = "mcore-preprocess-data"
_INPUT_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", PARQUET_SUFFIX)


@dataclass(frozen=True, kw_only=True)
class PreprocessConfig:
    """Input, output and worker settings of the preprocessing tool."""

    input: str | None = flag(None, "JSON Lines or parquet file, directory of them, or glob.")
    """One JSON object per line (JSON Lines), or one row per document (parquet)."""
    output_prefix: str | None = flag(
        None, "Output prefix; files are <prefix>_<key>_document.{bin,idx} (_sentence with --split-sentences)."
    )
    """Where the datasets go."""
    json_keys: tuple[str, ...] = flag(("text",), "JSON keys to tokenize, one dataset each.", nargs="+")
    """Keys whose values are tokenized."""
    append_eod: bool = flag(False, "Append the end-of-document token to every non-empty document.")
    """Documents end with EOD (what GPT training expects)."""
    workers: int = flag(1, "Tokenizer worker processes.")
    """Parallel workers (1: tokenize in the main process)."""
    chunk_size: int = flag(64, "Lines per task handed to a worker.")
    """Task granularity."""
    log_interval: int = flag(10000, "Print progress every this many documents.")
    """Progress cadence."""
    dataset_impl: str = flag("mmap", "Output format; only Megatron's mmap format exists.", choices=("mmap",))
    """Accepted for old scripts."""
    partitions: int = flag(1, "Megatron's input partitioning; mcore streams instead, so only 1 is accepted.")
    """Accepted for old scripts."""
    split_sentences: bool = flag(
        False,
        "Split each document into sentences (mcore's rule-based splitter, no download); writes "
        "<prefix>_<key>_sentence.{bin,idx}, one sequence per sentence (BERT's input).",
    )
    """String values are split by :func:`mcore.data.sentences.split_sentences`; lists are taken as split."""
    keep_newlines: bool = flag(
        False, "With --split-sentences: keep the whitespace (line breaks) after each sentence."
    )
    """Megatron's --keep-newlines: the whitespace between sentences stays with the sentence before it."""
    lang: str = flag(
        "english", "Language of the sentence splitter; the rule-based splitter knows English only."
    )
    """Megatron's punkt language; only english is accepted."""
    bad_lines: str = flag(
        "error", "On a malformed line: stop with an error, or skip it and count.", choices=("error", "skip")
    )
    """Policy for lines that cannot be used."""
    empty_documents: str = flag(
        "keep", "Empty documents: keep (as Megatron), skip, or error.", choices=("keep", "skip", "error")
    )
    """Policy for lines whose text tokenizes to nothing."""

    def __post_init__(self) -> None:
        check(self.input is not None, "--input is required")
        check(self.output_prefix is not None, "--output-prefix is required")
        check(len(self.json_keys) > 0, "--json-keys needs at least one key")
        check(self.workers >= 1, f"workers={self.workers} must be >= 1")
        check(self.chunk_size >= 1, f"chunk_size={self.chunk_size} must be >= 1")
        check(self.log_interval >= 1, f"log_interval={self.log_interval} must be >= 1")
        if self.keep_newlines and not self.split_sentences:
            raise ConfigError(
                "--keep-newlines applies to --split-sentences; add --split-sentences or drop it"
            )
        if self.lang != "english":
            raise ConfigError(
                f"--lang {self.lang}: mcore's rule-based sentence splitter knows only english (Megatron's punkt "
                "models are not downloaded); split the text yourself and give each document as a JSON list "
                "of sentences"
            )
        if self.partitions != 1:
            raise ConfigError(
                f"partitions={self.partitions}: mcore streams the input through --workers and needs no "
                "partitions; drop --partitions"
            )


def output_prefix(prefix: str, key: str, level: str = "document") -> str:
    """``{prefix}_{key}_{level}`` (Megatron's naming; level ``sentence`` with ``--split-sentences``)."""
    return f"{prefix}_{key}_{level}"


def resolve_inputs(spec: str) -> list[str]:
    """The input files a ``--input`` value names (file, directory, or glob), in sorted order."""
    if os.path.isfile(spec):
        return [spec]
    if os.path.isdir(spec):
        files = sorted(
            os.path.join(spec, name)
            for name in os.listdir(spec)
            if name.endswith(_INPUT_SUFFIXES) and os.path.isfile(os.path.join(spec, name))
        )
        if not files:
            raise DataError(f"--input {spec}: the directory has no {', '.join(_INPUT_SUFFIXES)} files")
        return files
    files = sorted(f for f in glob.glob(spec) if os.path.isfile(f))
    if not files:
        raise DataError(f"--input {spec}: no such file or directory, and no file matches it as a glob")
    return files


# ---- tasks and results -------------------------------------------------------------------------------


@dataclass
class _Chunk:
    """``lines`` of ``path`` starting at 1-based line ``first_line`` and byte ``first_offset``."""

    path: str
    first_line: int
    first_offset: int
    lines: list[bytes]


@dataclass
class _Encoded:
    """Tokens of one chunk, per key: flat tokens, sequence lengths, sequences per document."""

    tokens: dict[str, np.ndarray]
    lengths: dict[str, np.ndarray]
    per_doc: dict[str, np.ndarray]
    documents: int
    nbytes: int
    bad: list[tuple[int, str]] = field(default_factory=list)  # (line, reason)
    empty: list[int] = field(default_factory=list)  # lines with an empty document (kept or skipped)


# Worker state, set once per process by _init_worker (or directly for --workers 1).
_STATE: dict[str, Any] = {}


def _init_worker(tokenizer_config: TokenizerConfig, config: PreprocessConfig, dtype: str) -> None:
    # One core per worker: the tokenizer's own thread pool would oversubscribe the machine.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _STATE.update(
        tokenizer=build_tokenizer(tokenizer_config),
        keys=config.json_keys,
        append_eod=config.append_eod,
        skip_empty=config.empty_documents == "skip",
        split_sentences=config.split_sentences,
        keep_newlines=config.keep_newlines,
        dtype=np.dtype(dtype),
    )


def _parse_line(
    raw: bytes, offset: int, keys: Sequence[str], split: bool = False, keep_newlines: bool = False
) -> list[list[str]] | str:
    """The sentences of each key (a string value split when ``split``), or the reason the line is unusable."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        return f"invalid UTF-8 at byte offset {offset + err.start} (byte {err.start} of the line)"
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        return f"malformed JSON: {err.msg} (column {err.colno})"
    if not isinstance(obj, dict):
        return f"expected a JSON object, got a JSON {type(obj).__name__}"
    out = []
    for key in keys:
        if key not in obj:
            shown = ", ".join(list(obj)[:8]) or "none"
            return f"missing json key {key!r} (the line has keys: {shown})"
        value = obj[key]
        if isinstance(value, str):
            out.append(split_sentences(value, keep_newlines) if split else [value])
        elif isinstance(value, list) and all(isinstance(v, str) for v in value):
            out.append(value)
        else:
            return f"json key {key!r} holds a {type(value).__name__}, expected a string or a list of strings"
    return out


def _tokenize(tokenizer: Tokenizer, sentence: str) -> list[int] | None:
    try:
        return tokenizer.tokenize(sentence)
    except (TypeError, ValueError, UnicodeError) as err:  # e.g. a lone surrogate from a JSON escape
        _STATE["last_error"] = str(err)
        return None


def encode_chunk(chunk: _Chunk) -> _Encoded:
    """Parse and tokenize one chunk (runs in a worker)."""
    tokenizer: Tokenizer = _STATE["tokenizer"]
    keys: Sequence[str] = _STATE["keys"]
    eod = tokenizer.eod if _STATE["append_eod"] else None
    tokens: dict[str, list[list[int]]] = {k: [] for k in keys}
    lengths: dict[str, list[int]] = {k: [] for k in keys}
    per_doc: dict[str, list[int]] = {k: [] for k in keys}
    bad: list[tuple[int, str]] = []
    empty: list[int] = []
    documents = 0
    offset = chunk.first_offset
    for i, raw in enumerate(chunk.lines):
        line_no, line_offset = chunk.first_line + i, offset
        offset += len(raw)
        if not raw.strip():
            continue
        parsed = _parse_line(raw, line_offset, keys, _STATE["split_sentences"], _STATE["keep_newlines"])
        if isinstance(parsed, str):
            bad.append((line_no, parsed))
            continue
        docs: list[tuple[list[list[int]], list[int]]] = []
        failed = False
        for sentences in parsed:
            seqs, lens = [], []
            for sentence in sentences:
                ids = _tokenize(tokenizer, sentence)
                if ids is None:
                    failed = True
                    break
                if ids:
                    seqs.append(ids)
                    lens.append(len(ids))
            if failed:
                break
            if seqs and eod is not None:
                seqs[-1] = [*seqs[-1], eod]
                lens[-1] += 1
            docs.append((seqs, lens))
        if failed:
            bad.append((line_no, f"the tokenizer cannot encode the text: {_STATE.pop('last_error', '')}"))
            continue
        if any(not lens for _, lens in docs):
            empty.append(line_no)
            if _STATE["skip_empty"]:
                continue
        documents += 1
        for key, (seqs, lens) in zip(keys, docs):
            tokens[key].extend(seqs)
            lengths[key].extend(lens)
            per_doc[key].append(len(lens))
    dtype = _STATE["dtype"]
    out_tokens = {}
    for key in keys:
        count = sum(lengths[key])
        flat = np.fromiter(itertools.chain.from_iterable(tokens[key]), dtype=np.int64, count=count)
        if count and (flat.min() < 0 or flat.max() > np.iinfo(dtype).max):
            raise DataError(
                f"{chunk.path}: token id {int(flat.max())} does not fit the output dtype {dtype.name}"
            )
        out_tokens[key] = flat.astype(dtype)
    return _Encoded(
        tokens=out_tokens,
        lengths={k: np.asarray(v, dtype=np.int32) for k, v in lengths.items()},
        per_doc={k: np.asarray(v, dtype=np.int64) for k, v in per_doc.items()},
        documents=documents,
        nbytes=offset - chunk.first_offset,
        bad=bad,
        empty=empty,
    )


def _read_chunks(files: Sequence[str], chunk_size: int, keys: Sequence[str]) -> Iterator[_Chunk]:
    for path in files:
        try:
            yield from _read_file_chunks(path, chunk_size, keys)
        except OSError as err:  # an OSError out of preprocess() is about the outputs
            raise DataError(f"{path}: cannot read: {err.strerror or err}") from None


def _read_file_chunks(path: str, chunk_size: int, keys: Sequence[str]) -> Iterator[_Chunk]:
    """One input file in chunks of ``chunk_size`` lines (parquet: rows as JSON lines, numbered by row)."""
    if is_parquet(path):
        row = 1
        for lines in parquet_json_lines(path, keys, chunk_size):
            yield _Chunk(path, row, 0, lines)
            row += len(lines)
        return
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        line_no, offset, lines = 1, 0, []
        for raw in f:
            lines.append(raw)
            if len(lines) == chunk_size:
                yield _Chunk(path, line_no, offset, lines)
                line_no += len(lines)
                offset += sum(len(r) for r in lines)
                lines = []
        if lines:
            yield _Chunk(path, line_no, offset, lines)


# ---- driver ------------------------------------------------------------------------------------------


class _Progress:
    def __init__(self, interval: int, stream: Any) -> None:
        self.interval, self.stream = interval, stream
        self.start = time.perf_counter()
        self.documents = self.nbytes = self.tokens = 0
        self.next_report = interval

    def add(self, encoded: _Encoded) -> None:
        self.documents += encoded.documents
        self.nbytes += encoded.nbytes
        self.tokens += sum(int(t.size) for t in encoded.tokens.values())
        if self.documents >= self.next_report:
            self.next_report = (self.documents // self.interval + 1) * self.interval
            print(f"{PROG}: {self.line()}", file=self.stream, flush=True)

    def line(self) -> str:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        return (
            f"processed {self.documents} documents, {self.tokens} tokens "
            f"({self.documents / elapsed:.0f} docs/s, {self.nbytes / elapsed / 1e6:.2f} MB/s)"
        )


@dataclass
class PreprocessResult:
    """What a run wrote and saw."""

    outputs: dict[str, str]
    documents: int
    tokens: int
    nbytes: int
    seconds: float
    skipped_lines: list[tuple[str, int, str]]
    empty_documents: int


def preprocess(
    config: PreprocessConfig, tokenizer_config: TokenizerConfig, stream: Any = None
) -> PreprocessResult:
    """Run the tool (see module doc) and return what it did.

    Raises:
        DataError: a bad input line (unless skipped), a missing input, or an unusable tokenizer.
    """
    files = resolve_inputs(config.input)
    for path in filter(is_parquet, files):
        check_parquet_file(path, config.json_keys)  # pyarrow, columns and their types, before any output
    tokenizer = build_tokenizer(tokenizer_config)
    if config.append_eod:
        tokenizer.eod  # noqa: B018 -- fail now, naming the tokenizer, if it has no EOD
    dtype = optimal_dtype(tokenizer.vocab_size)
    level = "sentence" if config.split_sentences else "document"
    prefixes = {key: output_prefix(config.output_prefix, key, level) for key in config.json_keys}
    try:  # the output rule (mcore.utils.outputs): creatable, and none of the input files
        outputs = [path for p in prefixes.values() for path in (bin_path(p), idx_path(p))]
        check_output_files("--output-prefix", config.output_prefix, outputs, {"--input": files})
    except OutputError as err:
        raise DataError(str(err)) from None
    builders = _open_builders(config, prefixes, dtype)
    progress = _Progress(config.log_interval, sys.stderr if stream is None else stream)
    consume = _Consumer(config, builders, progress)
    try:
        _encode_inputs(files, config, tokenizer_config, dtype, consume)
        if progress.documents == 0 and consume.skipped:
            path, line_no, reason = consume.skipped[0]
            raise DataError(
                f"--input {config.input}: --bad-lines skip skipped every line ({len(consume.skipped)}; the "
                f"first, {path}:{line_no}: {reason}): no document to write, so no dataset is written"
            )
        if progress.documents == 0:  # a dataset of no document trains nothing and merges as nothing
            raise DataError(f"--input {config.input}: the input holds no line, so no dataset is written")
        identity = tokenizer_identity(tokenizer_config)
        for key, builder in builders.items():
            builder.finalize(idx_path(prefixes[key]))
            write_dataset_vocab(prefixes[key], identity)  # which tokenizer: checked when opened, merged
    except OSError as err:  # writing the outputs (reading the inputs fails earlier or as DataError)
        for builder in builders.values():
            builder.abort()
        raise _output_error(config, err) from None
    except BaseException:
        for builder in builders.values():
            builder.abort()
        raise
    seconds = time.perf_counter() - progress.start
    return PreprocessResult(
        outputs=prefixes,
        documents=progress.documents,
        tokens=progress.tokens,
        nbytes=progress.nbytes,
        seconds=seconds,
        skipped_lines=consume.skipped,
        empty_documents=consume.empty_count,
    )


def _open_builders(
    config: PreprocessConfig, prefixes: dict[str, str], dtype
) -> dict[str, IndexedDatasetBuilder]:
    """One ``.bin`` builder per JSON key (the output directory created first); on an error the ones
    opened are aborted.

    Raises:
        DataError: an output cannot be written (:func:`_output_error`).
    """
    builders: dict[str, IndexedDatasetBuilder] = {}
    try:
        out_dir = os.path.dirname(config.output_prefix)
        if out_dir:
            os.makedirs(out_dir, exist_ok=True)
        for key, p in prefixes.items():
            builders[key] = IndexedDatasetBuilder(bin_path(p), dtype=dtype)
    except OSError as err:
        for builder in builders.values():
            builder.abort()
        raise _output_error(config, err) from None
    return builders


class _Consumer:
    """Writes each encoded chunk to the builders, in input order: its bad lines raise or are skipped
    (``--bad-lines``), empty documents raise or are counted (``--empty-documents``)."""

    def __init__(self, config: PreprocessConfig, builders: dict[str, IndexedDatasetBuilder], progress):
        self.config, self.builders, self.progress = config, builders, progress
        self.skipped: list[tuple[str, int, str]] = []
        self.empty_count = 0

    def __call__(self, chunk_path: str, encoded: _Encoded) -> None:
        config = self.config
        for line_no, reason in encoded.bad:
            if config.bad_lines == "error":
                raise DataError(
                    f"{chunk_path}:{line_no}: {reason} (pass --bad-lines skip to skip such lines)"
                )
            self.skipped.append((chunk_path, line_no, reason))
        if encoded.empty and config.empty_documents == "error":
            raise DataError(
                f"{chunk_path}:{encoded.empty[0]}: the document is empty after tokenization "
                "(--empty-documents keep writes it as Megatron does; skip leaves it out)"
            )
        self.empty_count += len(encoded.empty)
        for key, builder in self.builders.items():
            builder.add_documents(encoded.tokens[key], encoded.lengths[key], encoded.per_doc[key])
        self.progress.add(encoded)


def _encode_inputs(
    files: list[str], config: PreprocessConfig, tokenizer_config: TokenizerConfig, dtype, consume: _Consumer
) -> None:
    """Encode the inputs chunk by chunk (``--workers`` processes, at most ``4 * workers`` chunks in
    flight) and hand each encoded chunk to ``consume`` in input order."""
    worker_args = (tokenizer_config, config, dtype.str)
    if config.workers == 1:
        _init_worker(*worker_args)
        for chunk in _read_chunks(files, config.chunk_size, config.json_keys):
            consume(chunk.path, encode_chunk(chunk))
        return
    # fork keeps start-up cheap; the parent has not run the tokenizer's thread pool yet.
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else None
    context = multiprocessing.get_context(method)
    with context.Pool(config.workers, initializer=_init_worker, initargs=worker_args) as pool:
        pending: deque = deque()
        for chunk in _read_chunks(files, config.chunk_size, config.json_keys):
            pending.append((chunk.path, pool.apply_async(encode_chunk, (chunk,))))
            if len(pending) >= 4 * config.workers:
                path, result = pending.popleft()
                consume(path, result.get())
        while pending:
            path, result = pending.popleft()
            consume(path, result.get())


def _output_error(config: PreprocessConfig, err: OSError) -> DataError:
    """One line for an output that cannot be written (permissions, a path through a file, a full disk)."""
    where = err.filename or config.output_prefix
    reason = err.strerror or str(err)
    if isinstance(err, (FileExistsError, NotADirectoryError)):  # makedirs through a file
        reason = "a file is in the way of the output directory"
    return DataError(f"--output-prefix {config.output_prefix}: cannot write {where}: {reason}")


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point; exit status 0 on success, 1 on bad data, 2 on bad flags."""
    configure_console()  # the library's lines (notes, checkpoint progress) on the console
    configs = parse_config({"input": PreprocessConfig, "tokenizer": TokenizerConfig}, argv, prog=PROG)
    config, tokenizer_config = configs["input"], configs["tokenizer"]
    if tokenizer_config.tokenizer_type is None:
        print(f"{PROG}: error: --tokenizer-type is required", file=sys.stderr)
        return 2
    try:
        result = preprocess(config, tokenizer_config)
    except DataError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 1
    print(
        f"{PROG}: done: {result.documents} documents, {result.tokens} tokens, {result.nbytes / 1e6:.1f} MB in "
        f"{result.seconds:.1f} s ({result.nbytes / max(result.seconds, 1e-9) / 1e6:.2f} MB/s)",
        file=sys.stderr,
    )
    if result.empty_documents:
        action = "left out" if config.empty_documents == "skip" else "written as empty documents"
        print(f"{PROG}: {result.empty_documents} empty documents {action}", file=sys.stderr)
    if result.skipped_lines:
        print(f"{PROG}: skipped {len(result.skipped_lines)} bad lines; first ones:", file=sys.stderr)
        for path, line_no, reason in result.skipped_lines[:5]:
            print(f"  {path}:{line_no}: {reason}", file=sys.stderr)
    for key, prefix in result.outputs.items():
        print(
            f"{PROG}: wrote {prefix}.bin and {prefix}.idx, and the tokenizer's identity {prefix}.tokenizer.json "
            f"(--json-keys {key})",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
