"""MoE convergence: an aux-loss router against an aux-loss-free (expert-bias) router on real text.

The question (issue 39): do both load-balancing schemes train a MoE GPT to the same loss (within 2%
of each other) without diverging, and does the expert bias keep the experts balanced (the most loaded
expert's tokens over the mean, averaged over the MoE layers, at most 1.3 at the end)?

Runs (``examples/pretrain_gpt.py`` with ``--log-json``, one seed each, ``RUNS``):

* ``aux_loss``: softmax router, top-2, Switch aux loss (``--moe-aux-loss-coeff 1e-2``), Mixtral-style;
* ``expert_bias``: sigmoid router with the aux-loss-free expert bias
  (``--moe-router-enable-expert-bias --moe-router-bias-update-rate 1e-3``), no aux loss, DeepSeek-V3-style.

Per run: the training loss and the ``tokens_per_expert max/mean`` of every log interval, the final
validation loss (one evaluation after the last step). Data: the quickstart corpus (the Python standard
library, ``--corpus-mb``), a BPE tokenizer trained on it, ``.bin/.idx`` (``fp8_convergence.prepare``).

    python benchmarks/moe_convergence.py --workdir /tmp/moe-conv --out benchmarks/moe_convergence.json
    python benchmarks/moe_convergence.py --plot benchmarks/moe_convergence.json --png benchmarks/moe_convergence.png
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import time

from fp8_convergence import REPO, SPLIT, prepare, write_atomic  # benchmarks/, next to this file

MODEL = (
    "--num-layers 8 --hidden-size 512 --num-attention-heads 8 --seq-length 1024 "
    "--max-position-embeddings 1024 --micro-batch-size 8 --global-batch-size 32 "
    "--normalization RMSNorm --swiglu --position-embedding-type rope --disable-bias-linear "
    "--untie-embeddings-and-output-weights --num-experts 16 --moe-router-topk 2 --moe-ffn-hidden-size 512 "
    "--moe-grouped-gemm --moe-token-dispatcher-type alltoall "
    "--lr 6e-4 --min-lr 6e-5 --lr-decay-style cosine --lr-warmup-iters 50 --clip-grad 1.0 "
    f"--weight-decay 0.1 --hidden-dropout 0 --attention-dropout 0 --split {SPLIT} "
    "--num-workers 2 --log-interval 5"
).split()
RUNS = {
    "aux_loss": ["--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "1e-2"],
    "expert_bias": [
        "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
        "--moe-router-bias-update-rate", "1e-3", "--moe-router-load-balancing-type", "none",
    ],
}  # fmt: skip
IMBALANCE = "tokens_per_expert max/mean"
LOSS_GAP_TARGET, IMBALANCE_TARGET = 0.02, 1.3


def train(
    work: pathlib.Path, data, vocab, merges, name: str, iters: int, backend: str, seed: int, more=()
) -> dict:
    """One run; its loss and imbalance curves, final validation loss and wall time."""
    log, console = work / f"log_{name}.jsonl", work / f"stdout_{name}.txt"
    log.unlink(missing_ok=True)
    cmd = [
        sys.executable, str(REPO / "examples" / "pretrain_gpt.py"), "--device-backend", backend, "--bf16",
        *MODEL, *more, *RUNS[name], "--seed", str(seed), "--train-iters", str(iters),
        "--eval-iters", "20", "--eval-interval", str(iters + 1), "--data-path", data,
        "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges,
        "--log-json", str(log),
    ]  # fmt: skip
    start = time.perf_counter()
    with console.open("w") as out:
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed (exit {done.returncode}); its output: {console}")
    records = [json.loads(line) for line in log.read_text().splitlines()]
    train_records = [r for r in records if r["kind"] == "train"]
    finals = [r["lm loss"] for r in records if r["kind"] == "validation" and r.get("final")]
    if not train_records or IMBALANCE not in train_records[-1]:
        raise SystemExit(f"{log}: no training record with {IMBALANCE!r}")
    return {
        "train": [[r["iteration"], r["lm loss"]] for r in train_records],
        "imbalance": [[r["iteration"], r[IMBALANCE]] for r in train_records],
        "valid_loss": finals[-1] if finals else None,
        "wall_s": round(time.perf_counter() - start, 1),
    }


def summarize(runs: dict) -> dict:
    """The final validation losses, their relative gap, the final imbalance of each run, and the verdict."""
    summary = {
        name: {"valid_loss": r["valid_loss"], "final_imbalance": r["imbalance"][-1][1]}
        for name, r in runs.items()
    }
    if {"aux_loss", "expert_bias"} <= runs.keys():
        a, b = runs["aux_loss"]["valid_loss"], runs["expert_bias"]["valid_loss"]
        gap = abs(a - b) / min(a, b)
        summary["loss_gap"] = gap
        summary["loss_gap_ok"] = gap <= LOSS_GAP_TARGET
        summary["expert_bias_balance_ok"] = summary["expert_bias"]["final_imbalance"] <= IMBALANCE_TARGET
    return summary


def plot(results: pathlib.Path, png: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(results.read_text())
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, run in data["runs"].items():
        it, loss = zip(*run["train"])
        left.plot(it, loss, label=f"{name} (valid {run['valid_loss']:.3f})")
        it, imb = zip(*run["imbalance"])
        right.plot(it, imb, label=name)
    left.set(xlabel="iteration", ylabel="training loss", title=data.get("title", "MoE convergence"))
    right.axhline(IMBALANCE_TARGET, color="grey", linestyle="--", label=f"target {IMBALANCE_TARGET}")
    right.set(xlabel="iteration", ylabel="max / mean tokens per expert", yscale="log")
    left.legend()
    right.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default="moe-convergence")
    p.add_argument("--out", default="moe_convergence.json")
    p.add_argument("--iters", type=int, default=500)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--corpus-mb", type=int, default=24)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--device-backend", default="cuda")
    p.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    p.add_argument("--model-args", default="", help="extra flags after MODEL (they override it)")
    p.add_argument("--plot", default=None, help="render this results JSON to --png instead of training")
    p.add_argument("--png", default="moe_convergence.png")
    args = p.parse_args(argv)
    if args.plot:
        plot(pathlib.Path(args.plot), pathlib.Path(args.png))
        return 0
    work = pathlib.Path(args.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    data, vocab, merges = prepare(work, args.corpus_mb, args.vocab_size)
    out = pathlib.Path(args.out)
    results = json.loads(out.read_text()) if out.exists() else {"runs": {}}
    results["title"] = f"MoE GPT 8L h512, 16 experts top-2, {args.iters} steps, stdlib corpus"
    results["command"] = " ".join([sys.executable, *sys.argv])
    for name in args.runs:
        results["runs"][name] = train(
            work,
            data,
            vocab,
            merges,
            name,
            args.iters,
            args.device_backend,
            args.seed,
            args.model_args.split(),
        )
        results["summary"] = summarize(results["runs"])
        write_atomic(out, results)
        print(name, json.dumps(results["summary"][name]), flush=True)
    print(json.dumps(results["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
