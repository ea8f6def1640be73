"""Shared T5 fixtures: a small sentence-level corpus (the standard library's docstrings), a WordPiece
vocabulary trained on it, and its sentence-level ``.bin/.idx`` (one item per sentence)."""

import ast
import os
import pathlib
import re

import pytest


def _documents(limit: int = 160) -> list[list[str]]:
    """Docstrings of stdlib modules, each a document of its sentences."""
    docs = []
    for path in sorted(pathlib.Path(os.__file__).parent.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Module)):
                text = ast.get_docstring(node)
                if not text:
                    continue
                sentences = [
                    s.strip() for s in re.split(r"(?<=[.!?])\s+", " ".join(text.split())) if s.strip()
                ]
                if len(sentences) >= 2:
                    docs.append(sentences)
        if len(docs) >= limit:
            break
    return docs[:limit]


@pytest.fixture(scope="session")
def t5_corpus(tmp_path_factory):
    from mcore.data.indexed_dataset import IndexedDatasetBuilder
    from mcore.data.tokenizers import BertWordPieceTokenizer, train_wordpiece_vocab

    root = tmp_path_factory.mktemp("t5corpus")
    docs = _documents()
    vocab = train_wordpiece_vocab([" ".join(d) for d in docs], 600, root / "vocab")
    tokenizer = BertWordPieceTokenizer(vocab, lower_case=True, vocab_extra_ids=100)
    prefix = str(root / "docstrings_text_sentence")
    builder = IndexedDatasetBuilder(prefix + ".bin")
    for doc in docs:
        for sentence in doc:
            ids = tokenizer.tokenize(sentence)
            if ids:
                builder.add_item(ids)
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return {"prefix": prefix, "vocab": vocab, "root": root, "documents": docs}
