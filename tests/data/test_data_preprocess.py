"""mcore-preprocess-data and mcore-merge-datasets: round trips, Megatron's rules, and every bad input."""

from __future__ import annotations

import gzip
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from mcore.data.indexed_dataset import IndexedDataset
from mcore.data.merge import main as merge_main
from mcore.data.preprocess import main as preprocess_main
from mcore.data.tokenizers import GPT2BPETokenizer

from .conftest import CORPUS, write_jsonl, write_toy_dataset

RECORDS = [{"text": text, "meta": i} for i, text in enumerate(CORPUS[:12])]


def _args(bpe_files, inp, out, *extra):
    vocab_path, merges_path = bpe_files
    return [
        "--input", str(inp), "--output-prefix", str(out), "--tokenizer-type", "GPT2BPETokenizer",
        "--vocab-file", vocab_path, "--merge-file", merges_path, *extra,
    ]  # fmt: skip


def _files(folder):
    return sorted(os.listdir(folder))


@pytest.mark.parametrize("workers", ["1", "2"])
def test_round_trip(bpe_files, tmp_path, workers):
    records = [*RECORDS, {"text": ""}, {"text": "last one"}]
    inp = write_jsonl(tmp_path / "in.jsonl", records)
    out = tmp_path / "out" / "my-gpt2"
    assert (
        preprocess_main(_args(bpe_files, inp, out, "--append-eod", "--workers", workers, "--chunk-size", "3"))
        == 0
    )
    ds = IndexedDataset(str(out) + "_text_document")
    tok = GPT2BPETokenizer(*bpe_files)
    assert ds.dtype == np.uint16
    # one sequence per non-empty document, EOD appended; the empty line is an empty document (Megatron)
    assert len(ds.document_indices) == len(records) + 1 and len(ds) == len(records) - 1
    seq = 0
    for d, record in enumerate(records):
        first, last = ds.document_indices[d], ds.document_indices[d + 1]
        if not record["text"]:
            assert first == last
            continue
        assert ds[seq].tolist() == tok.tokenize(record["text"]) + [tok.eod]
        seq += 1
    assert _files(tmp_path / "out") == [  # the .tokenizer.json: the vocabulary's identity (vocab_identity)
        "my-gpt2_text_document.bin",
        "my-gpt2_text_document.idx",
        "my-gpt2_text_document.tokenizer.json",
    ]


def test_worker_counts_give_identical_bytes(bpe_files, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", RECORDS * 5)
    for workers in ("1", "2"):
        preprocess_main(
            _args(bpe_files, inp, tmp_path / f"w{workers}", "--workers", workers, "--chunk-size", "4")
        )
    for suffix in (".bin", ".idx"):
        one = open(tmp_path / f"w1_text_document{suffix}", "rb").read()
        two = open(tmp_path / f"w2_text_document{suffix}", "rb").read()
        assert one == two


def test_sentence_lists_and_several_keys(bpe_files, tmp_path):
    records = [
        {"text": ["First sentence.", "", "Second one."], "title": "A title"},
        {"text": [], "title": "T"},
    ]
    inp = write_jsonl(tmp_path / "in.jsonl", records)
    preprocess_main(_args(bpe_files, inp, tmp_path / "o", "--json-keys", "text", "title", "--append-eod"))
    tok = GPT2BPETokenizer(*bpe_files)
    text = IndexedDataset(str(tmp_path / "o_text_document"))
    # each non-empty sentence is a sequence; EOD goes on the last; the empty list is an empty document
    assert text.document_indices.tolist() == [0, 2, 2]
    assert text[0].tolist() == tok.tokenize("First sentence.")
    assert text[1].tolist() == tok.tokenize("Second one.") + [tok.eod]
    title = IndexedDataset(str(tmp_path / "o_title_document"))
    assert title.document_indices.tolist() == [0, 1, 2] and title[1].tolist() == tok.tokenize("T") + [tok.eod]


def test_directory_glob_and_gzip_inputs(bpe_files, tmp_path):
    folder = tmp_path / "shards"
    folder.mkdir()
    write_jsonl(folder / "b.jsonl", RECORDS[6:])
    write_jsonl(folder / "a.jsonl", RECORDS[:3])
    with gzip.open(folder / "a2.jsonl.gz", "wb") as f:
        f.write(b"".join(f'{{"text": "{r["text"][:20]}"}}\n'.encode() for r in RECORDS[3:6]))
    (folder / "notes.txt").write_text("ignored")
    preprocess_main(_args(bpe_files, folder, tmp_path / "dir"))
    preprocess_main(_args(bpe_files, str(folder / "*.json*"), tmp_path / "glob"))
    tok = GPT2BPETokenizer(*bpe_files)
    for name in ("dir", "glob"):
        ds = IndexedDataset(str(tmp_path / f"{name}_text_document"))
        assert len(ds) == 12  # a.jsonl, a2.jsonl.gz, b.jsonl in sorted order
        assert ds[0].tolist() == tok.tokenize(RECORDS[0]["text"])
        assert ds[3].tolist() == tok.tokenize(RECORDS[3]["text"][:20])
        assert ds[6].tolist() == tok.tokenize(RECORDS[6]["text"])


def test_null_tokenizer_preprocessing(tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"text": "1 2 3"}, {"text": "70000 5"}])
    args = ["--input", inp, "--output-prefix", str(tmp_path / "n"), "--tokenizer-type", "NullTokenizer"]
    assert preprocess_main([*args, "--vocab-size", "100000", "--append-eod"]) == 0
    ds = IndexedDataset(str(tmp_path / "n_text_document"))
    assert ds.dtype == np.int32  # vocab 100001 >= 65500
    assert ds[0].tolist() == [1, 2, 3, 100000] and ds[1].tolist() == [70000, 5, 100000]


def test_progress_line(bpe_files, tmp_path, capsys):
    inp = write_jsonl(tmp_path / "in.jsonl", RECORDS)
    preprocess_main(_args(bpe_files, inp, tmp_path / "o", "--log-interval", "4", "--chunk-size", "4"))
    err = capsys.readouterr().err
    assert "processed 4 documents" in err and "docs/s" in err and "MB/s" in err
    assert "done: 12 documents" in err


def test_module_entry_point(bpe_files, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", RECORDS[:2])
    cmd = [sys.executable, "-m", "mcore.data.preprocess", *_args(bpe_files, inp, tmp_path / "m")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert len(IndexedDataset(str(tmp_path / "m_text_document"))) == 2


# ---- bad input -------------------------------------------------------------------------------------


BAD_LINES = [
    (b'{"text": "x",,}\n', r"in\.jsonl:3: malformed JSON: Expecting property name .*\(column 14\)"),
    (b'{"body": "no text key"}\n', r"in\.jsonl:3: missing json key 'text' \(the line has keys: body\)"),
    (b'{"text": 42}\n', r"in\.jsonl:3: json key 'text' holds a int, expected a string or a list of strings"),
    (b'["a", "list"]\n', r"in\.jsonl:3: expected a JSON object, got a JSON list"),
    (b'{"text": "caf\xe9"}\n', r"in\.jsonl:3: invalid UTF-8 at byte offset \d+ \(byte 13 of the line\)"),
    (b'{"text": "\\ud800 lone surrogate"}\n', r"in\.jsonl:3: the tokenizer cannot encode the text"),
]


@pytest.mark.parametrize(
    "bad, message", BAD_LINES, ids=["json", "key", "type", "object", "utf8", "surrogate"]
)
def test_bad_line_is_one_clear_error(bpe_files, tmp_path, capsys, bad, message):
    inp = write_jsonl(tmp_path / "in.jsonl", RECORDS[:2], raw_lines=[bad, b'{"text": "fine"}\n'])
    assert preprocess_main(_args(bpe_files, inp, tmp_path / "o", "--chunk-size", "2")) == 1
    err = capsys.readouterr().err
    assert err.count("error:") == 1
    assert re.search(message, err), err
    assert "--bad-lines skip" in err
    assert _files(tmp_path) == ["in.jsonl"]  # nothing half-written left behind


@pytest.mark.parametrize("workers", ["1", "2"])
def test_bad_lines_skip_counts_them(bpe_files, tmp_path, capsys, workers):
    raw = [bad for bad, _ in BAD_LINES]
    inp = write_jsonl(tmp_path / "in.jsonl", RECORDS[:2], raw_lines=[*raw, b"   \n", b'{"text": "fine"}\n'])
    args = _args(
        bpe_files, inp, tmp_path / "o", "--bad-lines", "skip", "--workers", workers, "--chunk-size", "2"
    )
    assert preprocess_main(args) == 0
    err = capsys.readouterr().err
    assert f"skipped {len(raw)} bad lines" in err and "in.jsonl:3: malformed JSON" in err
    assert len(IndexedDataset(str(tmp_path / "o_text_document"))) == 3  # two records + "fine"


def test_empty_document_policies(bpe_files, tmp_path, capsys):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"text": "a"}, {"text": ""}, {"text": "b"}])
    assert preprocess_main(_args(bpe_files, inp, tmp_path / "keep")) == 0
    assert IndexedDataset(str(tmp_path / "keep_text_document")).document_indices.tolist() == [0, 1, 1, 2]
    assert "1 empty documents written as empty documents" in capsys.readouterr().err
    assert preprocess_main(_args(bpe_files, inp, tmp_path / "skip", "--empty-documents", "skip")) == 0
    assert IndexedDataset(str(tmp_path / "skip_text_document")).document_indices.tolist() == [0, 1, 2]
    assert "1 empty documents left out" in capsys.readouterr().err
    assert preprocess_main(_args(bpe_files, inp, tmp_path / "err", "--empty-documents", "error")) == 1
    assert "in.jsonl:2: the document is empty after tokenization" in capsys.readouterr().err
    assert not any(f.startswith("err") for f in _files(tmp_path))


def test_bad_lines_skip_that_skips_every_line_is_an_error_and_writes_nothing(bpe_files, tmp_path, capsys):
    # e.g. a binary file given as JSON Lines: every line is malformed, and skipping them all left nothing
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(b"PAR1\x15\x04\x15\x10\n\x00\x01garbage\n" * 3)
    args = _args(bpe_files, inp, tmp_path / "out" / "o", "--bad-lines", "skip")
    assert preprocess_main(args) == 1
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "done:" not in err
    assert re.search(
        r"error: --input .*in\.jsonl: --bad-lines skip skipped every line \(6; the first, .*in\.jsonl:1: "
        r"malformed JSON.*\): no document to write, so no dataset is written",
        err,
    ), err
    assert _files(tmp_path / "out") == []  # no empty dataset left behind
    # an empty input file: the same, one line, nothing written
    (tmp_path / "empty.jsonl").write_text("")
    assert preprocess_main(_args(bpe_files, tmp_path / "empty.jsonl", tmp_path / "out" / "e")) == 1
    assert "the input holds no line, so no dataset is written" in capsys.readouterr().err
    assert _files(tmp_path / "out") == []


@pytest.mark.parametrize("kind", ["parent-is-a-file", "output-is-a-directory", "read-only-directory"])
def test_an_unwritable_output_is_one_line_naming_the_path(bpe_files, tmp_path, capsys, kind):
    inp = write_jsonl(tmp_path / "in.jsonl", RECORDS[:2])
    if kind == "parent-is-a-file":
        (tmp_path / "file").write_text("not a directory")
        out, named = tmp_path / "file" / "sub" / "o", f"{tmp_path / 'file' / 'sub'}: a file is in the way"
    elif kind == "output-is-a-directory":
        (tmp_path / "o_text_document.bin").mkdir()  # the finished .bin cannot be renamed onto it
        out, named = tmp_path / "o", str(tmp_path / "o_text_document.bin")
    else:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        out, named = locked / "o", str(locked / "o_text_document.bin")
        if os.geteuid() == 0:  # root writes anyway: model the refusal the kernel gives other users
            real_open = open

            def refusing_open(path, *args, **kwargs):
                if str(path).startswith(str(locked)):
                    raise PermissionError(13, "Permission denied", str(path))
                return real_open(path, *args, **kwargs)

            monkeypatch = pytest.MonkeyPatch()
            monkeypatch.setattr("builtins.open", refusing_open)
    try:
        code = preprocess_main(_args(bpe_files, inp, out))
    finally:
        if kind == "read-only-directory" and os.geteuid() == 0:
            monkeypatch.undo()
    err = capsys.readouterr().err
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"mcore-preprocess-data: error: --output-prefix {out}: cannot write {named}"
    ), err
    assert "Traceback" not in err
    assert not [f for f in _files(tmp_path) if ".tmp" in f]


def test_parquet_input_gives_the_bytes_of_the_same_rows_as_json_lines(bpe_files, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [{"text": r["text"], "title": f"title {i}", "other": i} for i, r in enumerate(RECORDS)] + [
        {"text": "", "title": "empty text", "other": 99},
        {"text": "café ünïcode", "title": "", "other": 7},
    ]
    jsonl = write_jsonl(tmp_path / "rows.jsonl", records)
    folder = tmp_path / "shards"
    folder.mkdir()
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "rows.parquet", row_group_size=5)
    pq.write_table(pa.Table.from_pylist(records[:7]), folder / "a.parquet")
    pq.write_table(pa.Table.from_pylist(records[7:]), folder / "b.parquet")
    keys = ["--json-keys", "text", "title", "--append-eod", "--chunk-size", "3"]
    assert preprocess_main(_args(bpe_files, jsonl, tmp_path / "from_json", *keys)) == 0
    runs = {
        "from_parquet": (tmp_path / "rows.parquet", "1"),
        "from_parquet_w2": (tmp_path / "rows.parquet", "2"),
        "from_dir": (folder, "1"),
        "from_glob": (str(folder / "*.parquet"), "2"),
    }
    for name, (inp, workers) in runs.items():
        assert preprocess_main(_args(bpe_files, inp, tmp_path / name, *keys, "--workers", workers)) == 0
        for key in ("text", "title"):
            for suffix in (".bin", ".idx"):
                ours = (tmp_path / f"{name}_{key}_document{suffix}").read_bytes()
                assert ours == (tmp_path / f"from_json_{key}_document{suffix}").read_bytes(), (name, key)
    assert len(IndexedDataset(str(tmp_path / "from_parquet_text_document"))) == len(records) - 1


def test_parquet_lists_of_sentences_and_bad_rows_follow_the_json_rules(bpe_files, tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"text": ["First sentence.", "", "Second one."]}, {"text": ["Only"]}, {"text": None}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "s.parquet")
    assert preprocess_main(_args(bpe_files, tmp_path / "s.parquet", tmp_path / "o")) == 1
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and re.search(
        r"s\.parquet:3: json key 'text' holds a NoneType, expected a string or a list of strings", err
    ), err
    assert (
        preprocess_main(_args(bpe_files, tmp_path / "s.parquet", tmp_path / "o", "--bad-lines", "skip")) == 0
    )
    ds = IndexedDataset(str(tmp_path / "o_text_document"))
    tok = GPT2BPETokenizer(*bpe_files)
    assert ds.document_indices.tolist() == [0, 2, 3]
    assert ds[1].tolist() == tok.tokenize("Second one.")


@pytest.mark.parametrize(
    "table, message",
    [
        ({"body": ["x"]}, r"no column 'text' for --json-keys \(the file's columns: body\)"),
        ({"text": [1, 2]}, r"column 'text' is int64, expected strings or lists of strings"),
    ],
    ids=["missing-column", "int-column"],
)
def test_a_parquet_file_without_a_usable_key_column_is_named(bpe_files, tmp_path, capsys, table, message):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(table), tmp_path / "t.parquet")
    assert preprocess_main(_args(bpe_files, tmp_path / "t.parquet", tmp_path / "out" / "o")) == 1
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and re.search(r"t\.parquet: " + message, err), err
    assert not (tmp_path / "out").exists()


def test_parquet_without_pyarrow_names_the_extra_to_install(bpe_files, tmp_path, capsys, monkeypatch):
    (tmp_path / "x.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow -> ImportError, as when not installed
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    assert preprocess_main(_args(bpe_files, tmp_path / "x.parquet", tmp_path / "out" / "o")) == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        f"mcore-preprocess-data: error: {tmp_path / 'x.parquet'}: reading parquet needs pyarrow, which is not "
        "installed: pip install 'mcore[parquet]' (or pip install pyarrow)"
    ]
    assert not (tmp_path / "out").exists()


def test_missing_input(bpe_files, tmp_path, capsys):
    assert preprocess_main(_args(bpe_files, tmp_path / "nope.jsonl", tmp_path / "o")) == 1
    assert re.search(r"error: --input .*nope\.jsonl: no such file or directory", capsys.readouterr().err)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--keep-newlines"], "--keep-newlines applies to --split-sentences"),
        (["--split-sentences", "--lang", "german"], "--lang german: mcore's rule-based sentence splitter"),
        (["--partitions", "2"], "drop --partitions"),
        (["--dataset-impl", "lazy"], "invalid choice"),
        (["--workers", "0"], "workers=0 must be >= 1"),
    ],
)
def test_refused_flags(bpe_files, tmp_path, capsys, extra, message):
    inp = write_jsonl(tmp_path / "in.jsonl", RECORDS[:1])
    with pytest.raises(SystemExit) as exit_info:
        preprocess_main(_args(bpe_files, inp, tmp_path / "o", *extra))
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_merge_tool(tmp_path, capsys):
    a = write_toy_dataset(str(tmp_path / "shards" / "a"), num_docs=30)
    b = write_toy_dataset(str(tmp_path / "shards" / "b"), num_docs=20)
    assert merge_main(["--input", a, b, "--output-prefix", str(tmp_path / "ab")]) == 0
    assert merge_main(["--input", str(tmp_path / "shards"), "--output-prefix", str(tmp_path / "dir")]) == 0
    assert merge_main(["--input", b + ".idx", a + ".bin", "--output-prefix", str(tmp_path / "ba")]) == 0
    ab, da, ba = (IndexedDataset(str(tmp_path / n)) for n in ("ab", "dir", "ba"))
    da_, db_ = IndexedDataset(a), IndexedDataset(b)
    assert len(ab) == 50 and ab.document_indices.tolist() == list(range(51))
    assert (
        open(str(tmp_path / "ab.bin"), "rb").read()
        == open(a + ".bin", "rb").read() + open(b + ".bin", "rb").read()
    )
    assert open(str(tmp_path / "dir.idx"), "rb").read() == open(str(tmp_path / "ab.idx"), "rb").read()
    assert ba[0].tolist() == db_[0].tolist() and ba[20].tolist() == da_[0].tolist()
    assert "merged 2 datasets" in capsys.readouterr().err


def test_merge_bad_inputs(tmp_path, capsys):
    shards = tmp_path / "shards"
    write_toy_dataset(str(shards / "a"), num_docs=3)
    (shards / "lonely.idx").write_bytes(b"")
    assert merge_main(["--input", str(shards), "--output-prefix", str(tmp_path / "o")]) == 1
    assert "lonely.idx has no matching lonely.bin" in capsys.readouterr().err
    assert (
        merge_main(
            ["--input", str(shards / "a"), str(tmp_path / "missing"), "--output-prefix", str(tmp_path / "o")]
        )
        == 1
    )
    assert "missing data path" in capsys.readouterr().err
    assert not any(f.startswith("o") for f in _files(tmp_path))
    # a prefix beside a directory of the same name (its index cache, PREFIX/cache/) is the prefix
    (shards / "a" / "cache").mkdir(parents=True)
    assert merge_main(["--input", str(shards / "a"), "--output-prefix", str(tmp_path / "one")]) == 0
    assert len(IndexedDataset(str(tmp_path / "one"))) == len(IndexedDataset(str(shards / "a")))
