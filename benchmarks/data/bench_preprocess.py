"""Throughput of ``mcore-preprocess-data`` against the tokenizer library alone, on the same text.

    python benchmarks/data/bench_preprocess.py                 # >= 100 MB corpus, 1, 2 and all workers
    python benchmarks/data/bench_preprocess.py --size-mb 20 --workers 1 4

The corpus is the Python standard library's source, one file per JSON line, repeated until it reaches
``--size-mb`` of text. A byte-level BPE (``--vocab-size``, GPT-2 style) is trained on a slice of it.

Reported for each worker count (each run in a fresh process, timed from the first chunk read to the
renamed outputs, so interpreter start-up is excluded): wall seconds, text MB/s and tokens/s in total
and per worker, and the CPU seconds used (main process plus workers). The reference is the tokenizer
library alone in one process (``TOKENIZERS_PARALLELISM=false``, the faster of per-document ``encode`` and
``encode_batch``) on the same texts: "per worker / raw" is the efficiency of the pipeline, whose target
is >= 85 %. Note that with W workers the main process (reading, writing) shares the cores too.
"CPU eff" compares tokens per CPU-second (pipeline: main process plus workers) with the raw tokenizer's
(per-document encode), which stays meaningful when other jobs load the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

_RUN_ONE = r"""
import json, os, resource, sys, time
os.environ["TOKENIZERS_PARALLELISM"] = "false"
from mcore.data.config import TokenizerConfig
from mcore.data.preprocess import PreprocessConfig, preprocess
args = json.loads(sys.argv[1])
tok = TokenizerConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=args["vocab"], merge_file=args["merges"])
cfg = PreprocessConfig(input=args["input"], output_prefix=args["output"], workers=args["workers"],
                       chunk_size=args["chunk_size"], append_eod=True, log_interval=10**9)
before = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
result = preprocess(cfg, tok, stream=open(os.devnull, "w"))
after = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
cpu = sum((a.ru_utime + a.ru_stime) - (b.ru_utime + b.ru_stime) for a, b in zip(after, before))
print(json.dumps({"seconds": result.seconds, "tokens": result.tokens, "documents": result.documents,
                  "input_bytes": result.nbytes, "cpu_seconds": cpu}))
"""


def build_corpus(path: Path, size_mb: float) -> tuple[int, int]:
    """Write stdlib sources as JSON lines until the text reaches ``size_mb``; (documents, text bytes)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    sources = []
    for file in sorted(stdlib.rglob("*.py")):
        try:
            text = file.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            sources.append(text)
    if not sources:
        raise SystemExit(f"no Python sources under {stdlib}")
    target, written, docs = int(size_mb * 1e6), 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target:
            for text in sources:
                f.write(json.dumps({"text": text}) + "\n")
                written += len(text.encode("utf-8"))
                docs += 1
                if written >= target:
                    break
    return docs, written


def load_texts(path: Path) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def raw_tokenizer_throughput(vocab: str, merges: str, texts: list[str]) -> dict[str, float]:
    """Tokens/s and MB/s of the tokenizer alone: per-document ``encode`` over all texts.

    ``encode_batch`` (no thread pool) is timed on the first tenth only, for information: it is slower
    than per-document ``encode`` for documents this long, so the reference is the faster of the two.
    """
    from mcore.data.tokenizers import GPT2BPETokenizer

    tok = GPT2BPETokenizer(vocab, merges)
    nbytes = sum(len(t.encode("utf-8")) for t in texts)
    start, cpu_start = time.perf_counter(), time.process_time()
    counts = [len(tok.tokenize(t)) for t in texts]
    single, single_cpu = time.perf_counter() - start, time.process_time() - cpu_start
    tenth = texts[: max(1, len(texts) // 10)]
    start = time.perf_counter()
    for i in range(0, len(tenth), 64):
        tok.tokenize_batch(tenth[i : i + 64])
    batch = time.perf_counter() - start
    batch_tokens_per_s = sum(counts[: len(tenth)]) / batch
    tokens = sum(counts)
    tokens_per_s = max(tokens / single, batch_tokens_per_s)
    return {
        "encode_seconds": single,
        "encode_cpu_seconds": single_cpu,
        "encode_tokens_per_s": tokens / single,
        "encode_batch_tokens_per_s": batch_tokens_per_s,
        "tokens": tokens,
        "text_bytes": nbytes,
        "tokens_per_s": tokens_per_s,
        "mb_per_s": tokens_per_s * nbytes / tokens / 1e6,
    }


def run_pipeline(args: dict) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _RUN_ONE, json.dumps(args)], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise SystemExit(f"preprocessing with {args['workers']} workers failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--size-mb", type=float, default=100.0, help="corpus size in MB of text (>= 100 for the report)"
    )
    parser.add_argument(
        "--workers", type=int, nargs="+", default=None, help="worker counts (default: 1 2 all)"
    )
    parser.add_argument("--vocab-size", type=int, default=32000, help="BPE vocabulary size to train")
    parser.add_argument("--chunk-size", type=int, default=64, help="--chunk-size of the tool")
    parser.add_argument(
        "--workdir", default=None, help="where the corpus and outputs go (default: a temp dir)"
    )
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    opts = parser.parse_args(argv)

    all_workers = os.cpu_count() or 1
    workers = opts.workers or sorted({1, 2, all_workers})
    workdir = Path(opts.workdir or tempfile.mkdtemp(prefix="bench-preprocess-"))
    workdir.mkdir(parents=True, exist_ok=True)
    corpus = workdir / "corpus.jsonl"
    docs, text_bytes = build_corpus(corpus, opts.size_mb)
    print(
        f"corpus: {docs} documents, {text_bytes / 1e6:.1f} MB of text, {corpus.stat().st_size / 1e6:.1f} MB JSONL"
    )

    from mcore.data.tokenizers import train_bpe_tokenizer

    texts = load_texts(corpus)
    start = time.perf_counter()
    sample, size = [], 0
    for text in texts:
        sample.append(text)
        size += len(text)
        if size > 5e6:
            break
    vocab, merges = train_bpe_tokenizer(sample, opts.vocab_size, workdir / "tokenizer")
    print(f"tokenizer: {opts.vocab_size}-token byte-level BPE trained in {time.perf_counter() - start:.1f} s")

    raw = raw_tokenizer_throughput(vocab, merges, texts)
    tenth = texts[: max(1, len(texts) // 10)]
    del texts
    print(
        f"raw tokenizer (1 process): {raw['mb_per_s']:.2f} MB/s, {raw['tokens_per_s'] / 1e3:.0f} k tokens/s "
        f"(encode: {raw['encode_seconds']:.1f} s wall, {raw['encode_cpu_seconds']:.1f} s CPU; encode_batch "
        f"on a tenth: {raw['encode_batch_tokens_per_s'] / 1e3:.0f} k tokens/s)"
    )

    rows = []
    header = (
        f"{'workers':>8} {'wall s':>8} {'MB/s':>8} {'ktok/s':>9} {'MB/s/w':>8} {'ktok/s/w':>9} "
        f"{'per w / raw':>11} {'CPU s':>8} {'CPU eff':>8}"
    )
    print(header)
    for w in workers:
        result = run_pipeline(
            {"input": str(corpus), "output": str(workdir / f"out_w{w}"), "workers": w, "vocab": vocab,
             "merges": merges, "chunk_size": opts.chunk_size}
        )  # fmt: skip
        seconds = result["seconds"]
        tokens_per_s = result["tokens"] / seconds
        row = {
            "workers": w,
            "label": f"{w}{' (all)' if w == all_workers else ''}",
            "seconds": seconds,
            "mb_per_s": text_bytes / seconds / 1e6,
            "tokens_per_s": tokens_per_s,
            "mb_per_s_per_worker": text_bytes / seconds / 1e6 / w,
            "tokens_per_s_per_worker": tokens_per_s / w,
            "efficiency_vs_raw": tokens_per_s / w / raw["tokens_per_s"],
            "cpu_seconds": result["cpu_seconds"],
            # tokens per CPU-second against the raw tokenizer's: insensitive to other load on the machine
            "cpu_efficiency_vs_raw": (result["tokens"] / result["cpu_seconds"])
            / (raw["tokens"] / raw["encode_cpu_seconds"]),
            "tokens": result["tokens"],
        }
        rows.append(row)
        print(
            f"{row['label']:>8} {seconds:8.1f} {row['mb_per_s']:8.2f} {tokens_per_s / 1e3:9.0f} "
            f"{row['mb_per_s_per_worker']:8.2f} {row['tokens_per_s_per_worker'] / 1e3:9.0f} "
            f"{row['efficiency_vs_raw']:10.0%} {row['cpu_seconds']:8.1f} {row['cpu_efficiency_vs_raw']:7.0%}"
        )
        for suffix in (".bin", ".idx"):
            (workdir / f"out_w{w}_text_document{suffix}").unlink(missing_ok=True)
    # The raw tokenizer again on a tenth of the text: if this differs much from the first measurement,
    # other load on the machine changed during the run and wall-clock ratios are unreliable.
    again = raw_tokenizer_throughput(vocab, merges, tenth)
    print(
        f"raw tokenizer again at the end (a tenth of the text): {again['tokens_per_s'] / 1e3:.0f} k tokens/s"
    )
    raw["tokens_per_s_at_end"] = again["tokens_per_s"]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"cores: {all_workers}, load average at the end: {load:.1f}")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"corpus_text_bytes": text_bytes, "documents": docs, "raw": raw, "runs": rows,
                       "cores": all_workers}, f, indent=2)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
