"""FP8 against bf16 convergence: the same run (seed, data, schedule) in bf16 and with FP8 linears.

Data: the quickstart's corpus (the Python standard library's .py files) scaled up to ``--corpus-mb``,
a BPE tokenizer trained on it, Megatron ``.bin/.idx`` (``examples/quickstart.py``'s helpers). Each run
is ``examples/pretrain_gpt.py`` with ``--log-json``; the losses of every run go into one JSON file
(``--out``), which ``--plot`` renders (matplotlib) on any machine::

    python benchmarks/fp8_convergence.py --workdir /tmp/conv --out benchmarks/fp8_convergence.json
    python benchmarks/fp8_convergence.py --plot benchmarks/fp8_convergence.json --png benchmarks/fp8_convergence.png
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))

MODEL = (
    "--num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024 "
    "--max-position-embeddings 1024 --micro-batch-size 8 --global-batch-size 32 "
    "--lr 6e-4 --min-lr 6e-5 --lr-decay-style cosine --lr-warmup-iters 50 --clip-grad 1.0 "
    "--weight-decay 0.1 --hidden-dropout 0 --attention-dropout 0 --split 98,2,0 --seed 1234 "
    "--num-workers 2 --log-interval 5 --eval-interval 100000 --eval-iters 0"
).split()
RUNS = {
    "bf16": [],
    "fp8 hybrid tensorwise": ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"],
    "fp8 hybrid delayed": ["--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--fp8-amax-history-len", "16",
                           "--fp8-amax-compute-algo", "max"],
}  # fmt: skip


def prepare(work: pathlib.Path, corpus_mb: int, vocab_size: int) -> tuple[str, str, str]:
    from quickstart import _texts, build_corpus

    from mcore.data.tokenizers import train_bpe_tokenizer

    corpus = build_corpus(work, max_bytes=corpus_mb * 1_000_000)
    vocab, merges = train_bpe_tokenizer(_texts(corpus), vocab_size, work / "tokenizer")
    prefix = work / "data" / "stdlib"
    prefix.parent.mkdir(exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "mcore.data.preprocess", "--input", str(corpus), "--output-prefix", str(prefix),
         "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges,
         "--append-eod", "--workers", "8"],
        check=True,
    )  # fmt: skip
    return f"{prefix}_text_document", vocab, merges


def train(work, data, vocab, merges, name, extra, iters, backend, more=()) -> list[tuple[int, float]]:
    log = work / f"log_{name.replace(' ', '_')}.jsonl"
    log.unlink(missing_ok=True)
    cmd = [
        sys.executable, str(REPO / "examples" / "pretrain_gpt.py"), "--device-backend", backend, "--bf16",
        *MODEL, "--train-iters", str(iters), "--data-path", data, "--tokenizer-type", "GPT2BPETokenizer",
        "--vocab-file", vocab, "--merge-file", merges, "--log-json", str(log), *extra, *more,
    ]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    return [(r["iteration"], r["lm loss"]) for r in records if r["kind"] == "train"]


def plot(results: pathlib.Path, png: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(results.read_text())
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, points in data["runs"].items():
        it, loss = zip(*points)
        final = loss[-1]
        ax.plot(it, loss, label=f"{name} (final {final:.4f})", linewidth=1.2)
    ax.set_xlabel("iteration")
    ax.set_ylabel("lm loss (train, log-interval mean)")
    ax.set_ylim(top=min(8.0, ax.get_ylim()[1]))
    ax.set_title(data.get("title", "FP8 vs bf16"), fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"plot -> {png}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default="fp8-convergence")
    p.add_argument("--out", default="fp8_convergence.json")
    p.add_argument("--iters", type=int, default=500)
    p.add_argument("--corpus-mb", type=int, default=24)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--device-backend", default="cuda")
    p.add_argument("--runs", nargs="+", default=list(RUNS))
    p.add_argument("--model-args", default="", help="extra flags appended to every run (a smoke test)")
    p.add_argument("--plot", default=None, help="render this results JSON to --png instead of training")
    p.add_argument("--png", default="fp8_convergence.png")
    args = p.parse_args(argv)
    if args.plot:
        plot(pathlib.Path(args.plot), pathlib.Path(args.png))
        return 0
    work = pathlib.Path(args.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    data, vocab, merges = prepare(work, args.corpus_mb, args.vocab_size)
    out = {"title": f"GPT 12L h768 s1024 gbs32, {args.iters} steps, stdlib corpus", "runs": {}}
    for name in args.runs:
        out["runs"][name] = train(
            work,
            data,
            vocab,
            merges,
            name,
            RUNS[name],
            args.iters,
            args.device_backend,
            args.model_args.split(),
        )
        final = out["runs"][name][-1]
        print(f"{name}: final loss {final[1]:.4f} at iteration {final[0]}", flush=True)
        pathlib.Path(args.out).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
