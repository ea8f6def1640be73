"""``mcore-merge-datasets``: concatenate several ``.bin/.idx`` datasets into one.

    mcore-merge-datasets --input data/shards --output-prefix data/all_text_document
    mcore-merge-datasets --input a_text_document b_text_document --output-prefix ab_text_document

With one directory (Megatron's ``tools/merge_datasets.py``): every ``X.idx``/``X.bin`` pair in it, in
sorted order; an ``.idx`` without its ``.bin`` (or the reverse) is an error. Otherwise each value is a
dataset prefix, merged in the order given. Documents keep their order; all inputs must share one token
dtype. The output is written under temporary names and renamed when complete.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from mcore.config.cli import parse_config
from mcore.config.fields import check, flag
from mcore.data.errors import DataError
from mcore.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, bin_path, exists, idx_path
from mcore.data.vocab_identity import describe, read_dataset_vocab, write_dataset_vocab
from mcore.utils.console import configure_console
from mcore.utils.outputs import OutputError, check_output_files

PROG = "mcore-merge-datasets"


@dataclass(frozen=True, kw_only=True)
class MergeConfig:
    """Inputs and output of the merge tool."""

    input: tuple[str, ...] = flag(
        (), "A directory of .bin/.idx pairs, or dataset prefixes in order.", nargs="+"
    )
    """What to merge."""
    output_prefix: str | None = flag(None, "Prefix of the merged dataset.")
    """Where the merged pair goes."""

    def __post_init__(self) -> None:
        check(len(self.input) > 0, "--input is required")
        check(self.output_prefix is not None, "--output-prefix is required")


def _strip_suffix(value: str) -> str:
    for suffix in (".idx", ".bin"):
        if value.endswith(suffix):
            return value[: -len(suffix)]
    return value


def resolve_prefixes(inputs: Sequence[str]) -> list[str]:
    """The dataset prefixes to merge, in order (see module doc)."""
    # A directory named like a dataset prefix beside its pair is the prefix's index cache (Megatron's
    # default cache is PREFIX/cache/): the pair is meant.
    if len(inputs) == 1 and os.path.isdir(inputs[0]) and not exists(inputs[0]):
        folder = inputs[0]
        names = os.listdir(folder)
        stems = {n[:-4] for n in names if n.endswith((".idx", ".bin"))}
        prefixes = []
        for stem in sorted(stems):
            for own, partner in ((".idx", ".bin"), (".bin", ".idx")):
                if stem + own in names and stem + partner not in names:
                    raise DataError(f"{os.path.join(folder, stem + own)} has no matching {stem + partner}")
            prefixes.append(os.path.join(folder, stem))
        if not prefixes:
            raise DataError(f"--input {folder}: the directory holds no .idx/.bin pairs")
        return prefixes
    return [_strip_suffix(v) for v in inputs]


def merge_datasets(prefixes: Sequence[str], out_prefix: str) -> IndexedDataset:
    """Write the concatenation of ``prefixes`` to ``out_prefix``; returns the merged dataset.

    Raises:
        DataError: a missing or corrupted input, or inputs of different token dtypes.
    """
    if not prefixes:
        raise DataError("nothing to merge")
    _check_output(prefixes, out_prefix)
    identity = _common_vocab(prefixes)
    first = IndexedDataset(prefixes[0])
    out_dir = os.path.dirname(out_prefix)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
    with IndexedDatasetBuilder(bin_path(out_prefix), dtype=first.dtype) as builder:
        for prefix in prefixes:
            builder.add_index(prefix)
        builder.finalize(idx_path(out_prefix))
    write_dataset_vocab(out_prefix, identity)
    return IndexedDataset(out_prefix)


def _common_vocab(prefixes: Sequence[str]) -> dict | None:
    """The tokenizer identity the inputs record (:mod:`mcore.data.vocab_identity`); inputs made with
    different tokenizers are refused, naming two of them (one that records none is not compared)."""
    known = [(p, v) for p in prefixes if (v := read_dataset_vocab(p)) is not None]
    for prefix, identity in known[1:]:
        if identity != known[0][1]:
            raise DataError(
                f"--input {prefix} was made with another tokenizer ({describe(identity)}) than "
                f"{known[0][0]} ({describe(known[0][1])}): the merged ids would mean different tokens"
            )
    return known[0][1] if known and len(known) == len(prefixes) else None


def _check_output(prefixes: Sequence[str], out_prefix: str) -> None:
    """The output rule (:mod:`mcore.utils.outputs`): the merged pair is none of the inputs' files."""
    inputs = [path for p in prefixes for path in (bin_path(p), idx_path(p))]
    try:
        check_output_files(
            "--output-prefix", out_prefix, [bin_path(out_prefix), idx_path(out_prefix)], {"--input": inputs}
        )
    except OutputError as err:
        raise DataError(str(err)) from None


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point; exit status 0 on success, 1 on bad data, 2 on bad flags."""
    configure_console()  # the library's lines (notes, checkpoint progress) on the console
    config = parse_config({"merge": MergeConfig}, argv, prog=PROG)["merge"]
    try:
        prefixes = resolve_prefixes(config.input)
        merged = merge_datasets(prefixes, config.output_prefix)
    except DataError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 1
    print(
        f"{PROG}: merged {len(prefixes)} datasets into {config.output_prefix} "
        f"({len(merged.document_indices) - 1} documents, {len(merged)} sequences, {merged.num_tokens} tokens)",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
