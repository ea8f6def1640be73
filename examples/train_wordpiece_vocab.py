"""Train a BERT WordPiece ``vocab.txt`` with the ``tokenizers`` library (nothing is downloaded).

    python examples/train_wordpiece_vocab.py --output-dir bert --vocab-size 4000
    python examples/train_wordpiece_vocab.py --input my_corpus.jsonl --output-dir bert

Without ``--input`` the corpus is the Python documentation that ships with every Python
(``pydoc_data.topics``: the language reference, about 80 topics of English prose and examples),
written to ``{output-dir}/corpus.jsonl`` as one JSON line per group of paragraphs (``{"text": ...}``), the input
``mcore-preprocess-data --split-sentences`` expects. With ``--input`` the ``--json-keys`` fields of
your JSON Lines file are read (``text`` by default) and no corpus is written.

The vocabulary is what Megatron's ``BertWordPieceLowerCase`` (default) or, with ``--cased``,
``BertWordPieceCase`` reads: one token per line, ``[PAD]`` (id 0), ``[UNK]``, ``[CLS]``, ``[SEP]``,
``[MASK]`` first, then the WordPiece pieces (``##`` marks a continuation), trained with the BERT
normalizer and pre-tokenizer of the same casing.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import sys
from collections.abc import Iterator


def python_docs_corpus(min_chars: int = 400) -> list[str]:
    """The Python documentation topics as documents of consecutive paragraphs (at least ``min_chars``
    characters each, a topic's last one may be shorter): about 800 documents, enough for Megatron's
    document-level ``--split 949,50,1`` to give every split at least one."""
    from pydoc_data.topics import topics

    documents = []
    for name in sorted(topics):
        current = ""
        for paragraph in re.split(r"\n\s*\n", topics[name]):
            if paragraph.strip():
                current = f"{current}\n\n{paragraph.strip()}" if current else paragraph.strip()
            if len(current) >= min_chars:
                documents.append(current)
                current = ""
        if current:
            documents.append(current)
    return documents


def read_jsonl(path: pathlib.Path, keys: list[str]) -> Iterator[str]:
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise SystemExit(f"error: {path}:{number} is not a JSON line ({err.msg})") from None
            for key in keys:
                if key not in record:
                    raise SystemExit(f"error: {path}:{number} has no key {key!r} (see --json-keys)")
                yield str(record[key])


def write_atomically(path: pathlib.Path, text: str) -> None:
    """Write ``text`` under a temporary name, then rename: a reader never sees a partial file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def train_vocab(texts: list[str], vocab_size: int, output_dir: pathlib.Path, lowercase: bool) -> list[str]:
    """Train with :func:`mcore.data.tokenizers.train_wordpiece_vocab` (the ``tokenizers`` library's
    WordPiece trainer) and return the vocabulary it wrote, special tokens first."""
    from mcore.data.tokenizers import train_wordpiece_vocab

    path = train_wordpiece_vocab(texts, vocab_size, output_dir, lower_case=lowercase)
    return pathlib.Path(path).read_text(encoding="utf-8").splitlines()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", required=True, type=pathlib.Path, help="where vocab.txt is written")
    parser.add_argument("--input", type=pathlib.Path, help="a JSON Lines corpus (default: the Python docs)")
    parser.add_argument("--json-keys", nargs="+", default=["text"], help="fields of --input to read")
    parser.add_argument(
        "--vocab-size", type=int, default=4000, help="vocabulary size, special tokens included"
    )
    parser.add_argument("--cased", action="store_true", help="keep case and accents (BertWordPieceCase)")
    args = parser.parse_args(argv)
    if args.vocab_size < 105:
        parser.error(f"--vocab-size {args.vocab_size} is too small for a WordPiece vocabulary (at least 105)")
    args.output_dir.mkdir(parents=True, exist_ok=True)
    if args.input is None:
        texts = python_docs_corpus()
        corpus = args.output_dir / "corpus.jsonl"
        write_atomically(corpus, "".join(json.dumps({"text": text}) + "\n" for text in texts))
        print(f"corpus: {len(texts)} documents (the Python documentation) -> {corpus}")
    else:
        if not args.input.is_file():
            parser.error(f"--input {args.input}: no such file")
        texts = list(read_jsonl(args.input, args.json_keys))
        if not texts:
            parser.error(f"--input {args.input} holds no text")
    vocab = train_vocab(texts, args.vocab_size, args.output_dir, lowercase=not args.cased)
    out = args.output_dir / "vocab.txt"
    print(f"vocab: {len(vocab)} WordPiece tokens ({'cased' if args.cased else 'lowercase'}) -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
