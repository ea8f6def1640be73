"""FP8 against bf16 convergence over several seeds, judged on the final validation loss.

The question (issue 27): does training in FP8 reach the loss of bf16 (within 1%) without diverging?
One seed cannot answer it: two bf16 runs of different seeds, or two GPU runs of the same arithmetic,
already differ by ~0.5-1.5% here. So every configuration (``--runs``: bf16, FP8 hybrid tensorwise,
FP8 hybrid delayed) trains once per seed (``--seeds``, mcore's ``--seed``: it sets the weight init,
the data order and the validation windows), and FP8 is compared with bf16 seed by seed (the same
seed gives both the same training batches and the same validation sequences) and on the means, with
bf16's own seed-to-seed spread beside it as the yardstick.

Per run (``examples/pretrain_gpt.py`` with ``--log-json``): the training loss of every log interval,
the final training loss (the mean of the last log interval), the final validation loss (mcore's
trainer evaluates ``--eval-iters`` global batches of the validation split once, after the last step:
the ``{"kind": "validation", "final": true}`` record; ``--eval-interval`` is set past the run so no
evaluation happens during it) and the run's wall time.

Summary (printed, and stored under ``"summary"``), for the validation and the final training loss:
per configuration the value per seed and the mean ``m_c`` over its seeds; for FP8 the relative
difference to bf16 per seed ``(x_c,s - x_bf16,s) / x_bf16,s`` and of the means over the seeds both
have ``(m_c - m_bf16) / m_bf16``; per configuration the seed spread ``(max_s x - min_s x) / m``
(bf16's is the yardstick: an FP8 difference smaller than it cannot be told from seed noise).

Data: the quickstart's corpus (the Python standard library's .py files, up to ``--corpus-mb``), a BPE
tokenizer trained on it, Megatron ``.bin/.idx`` (``examples/quickstart.py``'s helpers), split
``98,2,0`` by sequence (document). Model: GPT 12L h768 s1024, global batch 32 (``MODEL``); extra flags
in ``--model-args`` come after ``MODEL`` and override it (the parser keeps a flag's last value).

Results JSON (``--out``; layout 2)::

    {"layout": 2, "title": str, "settings": {iters, eval_iters, corpus_mb, vocab_size, model_args,
     device_backend, data_digest}, "validation_split": {tokens, sequences, sequences_read},
     "runs": {config: {seed: {"train": [[iteration, loss], ...], "final_train_loss": float,
                              "valid_loss": float, "wall_s": float}}},
     "summary": {...}}

It is rewritten (under a temporary name, then renamed) after every run, so a crash keeps the finished
runs. An existing ``--out`` is resumed: the (config, seed) runs it holds are skipped, so the work can
be split over several invocations (one 500-step run takes under 2 minutes on an H100; 3 seeds x 3
configurations do not fit one 600 s call). Resuming refuses a file made with other settings or data.

``--plot`` renders a results JSON (matplotlib) on any machine: per configuration the mean over seeds
of the training loss at each logged iteration, a band from the minimum to the maximum over seeds,
and the final validation losses (mean and per seed) in the legend. The older layout (``"runs": {name:
[[iteration, loss], ...]}``, one seed, no validation) still plots::

    # all seeds and configurations in one go, or split over calls with the same --out:
    python benchmarks/fp8_convergence.py --workdir /tmp/conv --out benchmarks/fp8_convergence.json \\
        --seeds 1234 1235 1236 --eval-iters 20
    python benchmarks/fp8_convergence.py --workdir /tmp/conv --out benchmarks/fp8_convergence.json \\
        --seeds 1234 --runs bf16 "fp8 hybrid delayed"
    python benchmarks/fp8_convergence.py --plot benchmarks/fp8_convergence.json --png benchmarks/fp8_convergence.png
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))

SPLIT = "98,2,0"
MODEL = (
    "--num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024 "
    "--max-position-embeddings 1024 --micro-batch-size 8 --global-batch-size 32 "
    "--lr 6e-4 --min-lr 6e-5 --lr-decay-style cosine --lr-warmup-iters 50 --clip-grad 1.0 "
    f"--weight-decay 0.1 --hidden-dropout 0 --attention-dropout 0 --split {SPLIT} "
    "--num-workers 2 --log-interval 5"
).split()
RUNS = {
    "bf16": [],
    "fp8 hybrid tensorwise": ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"],
    "fp8 hybrid delayed": ["--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--fp8-amax-history-len", "16",
                           "--fp8-amax-compute-algo", "max"],
}  # fmt: skip
BASELINE = "bf16"
TARGET = 0.01  # the "final loss within 1%"
SEEDS = (1234, 1235, 1236)
LAYOUT = 2
# Flags the script sets per run from its own options: in --model-args they would silently change
# what the results JSON says was run.
OWN_FLAGS = {
    "--seed": "--seeds",
    "--train-iters": "--iters",
    "--eval-iters": "--eval-iters",
    "--eval-interval": "nothing (the script evaluates once, at the end)",
    "--log-json": "nothing (the script reads its own log)",
    "--split": f"nothing (the split is {SPLIT})",
}


# --------------------------------------------------------------------------------------------------
# data


def prepare(work: pathlib.Path, corpus_mb: int, vocab_size: int) -> tuple[str, str, str]:
    """Corpus, BPE tokenizer and ``.bin/.idx`` under ``work``; returns (data prefix, vocab, merges)."""
    from quickstart import _texts, build_corpus

    from mcore.data.tokenizers import train_bpe_tokenizer

    corpus = build_corpus(work, max_bytes=corpus_mb * 1_000_000)
    vocab, merges = train_bpe_tokenizer(_texts(corpus), vocab_size, work / "tokenizer")
    prefix = work / "data" / "stdlib"
    prefix.parent.mkdir(exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "mcore.data.preprocess", "--input", str(corpus), "--output-prefix", str(prefix),
         "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges,
         "--append-eod", "--workers", str(min(8, os.cpu_count() or 1))],
        check=True,
    )  # fmt: skip
    return f"{prefix}_text_document", vocab, merges


def data_digest(paths) -> str:
    """sha256 over the files' bytes: a resumed results file must hold runs on the same tokens."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(pathlib.Path(path).read_bytes())
    return digest.hexdigest()[:16]


def validation_split(prefix: str, seq_length: int, sequences_read: int) -> dict:
    """How much data the final evaluation reads: the tokens of the validation split (``SPLIT`` over
    the ``.idx`` sequences, as mcore's builder splits), the seq_length windows they make, and the
    windows ``--eval-iters`` global batches read. Reading more than the split holds reads it again
    (Megatron's dataset appends reshuffled epochs): the same loss, averaged over repeated windows."""
    from mcore.data.indexed_dataset import IndexedDataset
    from mcore.data.splits import normalize, parse_split, split_matrix, split_ranges

    lengths = IndexedDataset(prefix).sequence_lengths
    valid = split_ranges(split_matrix(normalize(parse_split(SPLIT))), len(lengths))[1]
    tokens = int(lengths[valid].sum()) if valid is not None else 0
    return {"tokens": tokens, "sequences": max(tokens - 1, 0) // seq_length, "sequences_read": sequences_read}


def flag_value(argv: list[str], flag: str, default: str) -> str:
    """The value the trainer will see for ``flag``: its last occurrence in ``argv`` wins."""
    value = default
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1 :]
    return value


# --------------------------------------------------------------------------------------------------
# one run


def train(work, data, vocab, merges, name, extra, iters, backend, seed, eval_iters, more=()) -> dict:
    """One ``pretrain_gpt.py`` run; returns its curve, final training and validation loss, wall time."""
    tag = f"{name.replace(' ', '_')}_seed{seed}"
    log = work / f"log_{tag}.jsonl"
    console = work / f"stdout_{tag}.txt"
    log.unlink(missing_ok=True)
    cmd = [
        sys.executable, str(REPO / "examples" / "pretrain_gpt.py"), "--device-backend", backend, "--bf16",
        *MODEL, *extra, *more, "--seed", str(seed), "--train-iters", str(iters),
        # one evaluation, after the last step: none during the run (iteration % interval never 0)
        "--eval-iters", str(eval_iters), "--eval-interval", str(iters + 1),
        "--data-path", data, "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab,
        "--merge-file", merges, "--log-json", str(log),
    ]  # fmt: skip
    start = time.perf_counter()
    with console.open("w") as out:
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        tail = "".join(console.read_text(errors="replace").splitlines(keepends=True)[-15:])
        raise SystemExit(f"{name} seed {seed} failed (exit {done.returncode}); its output: {console}\n{tail}")
    records = [json.loads(line) for line in log.read_text().splitlines()]
    curve = [[r["iteration"], r["lm loss"]] for r in records if r["kind"] == "train"]
    finals = [r["lm loss"] for r in records if r["kind"] == "validation" and r.get("final")]
    if not curve:
        raise SystemExit(f"{log}: no training loss was logged (--log-interval larger than --iters {iters}?)")
    if eval_iters > 0 and not finals:
        raise SystemExit(f"{log}: no final validation record (see {console})")
    return {
        "train": curve,
        "final_train_loss": curve[-1][1],
        "valid_loss": finals[-1] if finals else None,
        "wall_s": round(wall, 1),
    }


# --------------------------------------------------------------------------------------------------
# statistics


def relative(value: float, reference: float) -> float:
    """``(value - reference) / reference``."""
    return (value - reference) / reference


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def _stats(runs: dict, key: str, baseline: dict | None) -> dict | None:
    """Per-seed values of ``key``, their mean and relative spread, and against ``baseline`` (the
    baseline config's runs) the per-seed relative differences and that of the means over the shared
    seeds. None when no run has the value."""
    values = {seed: run[key] for seed, run in runs.items() if run.get(key) is not None}
    if not values:
        return None
    mean = _mean(values.values())
    out = {
        "per_seed": values,
        "mean": mean,
        "spread_rel": (max(values.values()) - min(values.values())) / mean,
    }
    if baseline is not None:
        ref = {seed: run[key] for seed, run in baseline.items() if run.get(key) is not None}
        paired = sorted(set(values) & set(ref), key=_seed_order)
        if paired:
            out["paired_seeds"] = paired
            out["rel_diff_per_seed"] = {s: relative(values[s], ref[s]) for s in paired}
            out["rel_diff_of_means"] = relative(
                _mean(values[s] for s in paired), _mean(ref[s] for s in paired)
            )
    return out


def summarize(runs: dict, baseline: str = BASELINE, target: float = TARGET) -> dict:
    """The comparison of every configuration with ``baseline``, on the final validation loss
    (``"valid"``) and on the final training loss (``"train"``).

    ``runs``: ``{config: {seed: {"valid_loss", "final_train_loss", ...}}}`` (seeds as strings).
    Per config and loss: ``per_seed``, ``mean``, ``spread_rel`` = (max - min) / mean over seeds; for
    the others against the baseline ``rel_diff_per_seed``, ``rel_diff_of_means`` (the means over the
    ``paired_seeds``, the seeds both have). ``verdict`` (validation loss, configs other than the
    baseline): ``within_target`` = |rel_diff_of_means| <= target; ``beyond_baseline_spread`` =
    |rel_diff_of_means| > the baseline's validation spread (None with fewer than 2 baseline seeds)."""
    base = runs.get(baseline)
    configs = {}
    for name, by_seed in runs.items():
        ref = None if name == baseline else base
        configs[name] = {
            "valid": _stats(by_seed, "valid_loss", ref),
            "train": _stats(by_seed, "final_train_loss", ref),
        }
    yardstick = configs.get(baseline, {}).get("valid")
    spread = yardstick["spread_rel"] if yardstick and len(yardstick["per_seed"]) >= 2 else None
    verdict = {}
    for name, stats in configs.items():
        diff = (stats["valid"] or {}).get("rel_diff_of_means")
        if name == baseline or diff is None:
            continue
        verdict[name] = {
            "rel_diff_of_means": diff,
            "within_target": abs(diff) <= target,
            "beyond_baseline_spread": None if spread is None else abs(diff) > spread,
        }
    return {
        "baseline": baseline,
        "target_rel": target,
        "baseline_valid_spread_rel": spread,
        "configs": configs,
        "verdict": verdict,
    }


def _seed_order(seed: str):
    return (0, int(seed)) if seed.lstrip("-").isdigit() else (1, seed)


def format_summary(summary: dict) -> str:
    """The summary as a text table per loss: value per seed, mean, and FP8 - bf16 in percent."""
    lines = []
    for key, title in (
        ("valid", "final validation loss"),
        ("train", "final training loss (last log interval)"),
    ):
        seeds = sorted(
            {s for c in summary["configs"].values() if c[key] for s in c[key]["per_seed"]}, key=_seed_order
        )
        if not seeds:
            continue
        lines.append(f"{title}:")
        lines.append(
            f"  {'config':24s}"
            + "".join(f"{'seed ' + s:>11s}" for s in seeds)
            + f"{'mean':>9s}{'spread':>9s}"
            f"  vs {summary['baseline']}: per seed | of the means"
        )
        for name, stats in summary["configs"].items():
            s = stats[key]
            if s is None:
                continue
            row = "".join(
                f"{s['per_seed'][seed]:11.4f}" if seed in s["per_seed"] else f"{'-':>11s}" for seed in seeds
            )
            row += f"{s['mean']:9.4f}{100 * s['spread_rel']:8.2f}%"
            if "rel_diff_of_means" in s:
                per = " ".join(f"{100 * s['rel_diff_per_seed'][p]:+.2f}%" for p in s["paired_seeds"])
                row += f"  {per} | {100 * s['rel_diff_of_means']:+.2f}%"
            lines.append(f"  {name:24s}{row}")
    spread = summary["baseline_valid_spread_rel"]
    for name, v in summary["verdict"].items():
        yardstick = (
            "one baseline seed: no spread to compare with"
            if spread is None
            else f"{'beyond' if v['beyond_baseline_spread'] else 'within'} {summary['baseline']}'s seed spread "
            f"{100 * spread:.2f}%"
        )
        lines.append(
            f"{name}: validation mean {100 * v['rel_diff_of_means']:+.2f}% vs {summary['baseline']}: "
            f"{'within' if v['within_target'] else 'NOT within'} {100 * summary['target_rel']:.0f}%; {yardstick}"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# the results file


def load_results(out: pathlib.Path, settings: dict) -> dict:
    """The results to extend: ``out``'s when it exists (made with the same ``settings``), else empty.

    Raises SystemExit naming ``out`` when it is not JSON, holds the old one-seed layout, or was made
    with other settings (its runs would not be comparable with new ones); the file is left as it is."""
    if not out.exists():
        return {"layout": LAYOUT, "settings": settings, "runs": {}}
    try:
        results = json.loads(out.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SystemExit(
            f"{out}: cannot resume from it, not a results JSON ({e}); give another --out"
        ) from None
    if not isinstance(results, dict) or results.get("layout") != LAYOUT:
        raise SystemExit(
            f"{out}: cannot resume from it: not a layout-{LAYOUT} results file (the old one-seed layout has "
            "no seeds or validation loss); give another --out"
        )
    theirs = results.get("settings", {})
    differ = [f"{k}: {theirs.get(k)!r} there, {v!r} now" for k, v in settings.items() if theirs.get(k) != v]
    if differ:
        raise SystemExit(f"{out}: cannot resume from it, made with other settings ({'; '.join(differ)})")
    return results


def pending(results: dict, names, seeds) -> list[tuple[str, int]]:
    """The (config, seed) runs asked for that ``results`` does not hold yet, in run order: seed by
    seed, so a partial result pairs every configuration with bf16 as early as possible."""
    done = results.get("runs", {})
    return [(name, seed) for seed in seeds for name in names if str(seed) not in done.get(name, {})]


def write_atomic(path: pathlib.Path, results: dict) -> None:
    """Write under a temporary name, then rename: a crash never leaves a half-written file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(results, indent=1))
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------------
# the plot


def _runs_by_seed(data: dict) -> dict:
    """``{config: {seed: run}}``; the old layout's ``{config: [[iteration, loss], ...]}`` becomes one
    run of an unknown seed with no validation loss."""
    runs = {}
    for name, value in data["runs"].items():
        if isinstance(value, list):
            value = {"?": {"train": value, "final_train_loss": value[-1][1] if value else None}}
        runs[name] = value
    return runs


def plot(results: pathlib.Path, png: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(results.read_text())
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for name, by_seed in _runs_by_seed(data).items():
        curves = [dict((it, loss) for it, loss in run["train"]) for run in by_seed.values()]
        iters = sorted(set.intersection(*(set(c) for c in curves)))
        losses = [[c[it] for c in curves] for it in iters]
        (line,) = ax.plot(iters, [_mean(v) for v in losses], linewidth=1.2)
        if len(curves) > 1:
            band = ([min(v) for v in losses], [max(v) for v in losses])
            ax.fill_between(iters, *band, color=line.get_color(), alpha=0.2, linewidth=0)
        seeds = sorted(by_seed, key=_seed_order)
        valid = {s: by_seed[s].get("valid_loss") for s in seeds if by_seed[s].get("valid_loss") is not None}
        if valid:
            per = ", ".join(f"{s}: {v:.4f}" for s, v in valid.items())
            label = f"{name}: valid mean {_mean(valid.values()):.4f} (seeds {per})"
        else:
            label = f"{name}: final train {_mean(by_seed[s]['train'][-1][1] for s in seeds):.4f}"
        line.set_label(label)
    ax.set_xlabel("iteration")
    ax.set_ylabel("lm loss (train, log-interval mean; band: min..max over seeds)")
    ax.set_ylim(top=min(8.0, ax.get_ylim()[1]))
    ax.set_title(data.get("title", "FP8 vs bf16"), fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"plot -> {png}")


# --------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default="fp8-convergence")
    p.add_argument("--out", default="fp8_convergence.json", help="results JSON; resumed when it exists")
    p.add_argument("--iters", type=int, default=500)
    p.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS), help="mcore --seed of each run")
    p.add_argument("--eval-iters", type=int, default=20, help="global batches of the final validation")
    p.add_argument("--corpus-mb", type=int, default=24)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--device-backend", default="cuda")
    p.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS), metavar="RUN")
    p.add_argument("--model-args", default="", help="extra flags after MODEL (they override it)")
    p.add_argument("--plot", default=None, help="render this results JSON to --png instead of training")
    p.add_argument("--png", default="fp8_convergence.png")
    args = p.parse_args(argv)
    if args.plot:
        plot(pathlib.Path(args.plot), pathlib.Path(args.png))
        return 0
    more = args.model_args.split()
    for flag, instead in OWN_FLAGS.items():
        if any(arg == flag or arg.startswith(flag + "=") for arg in more):
            p.error(f"--model-args may not set {flag}: use {instead}")
    if args.eval_iters < 1:
        p.error(f"--eval-iters {args.eval_iters}: the comparison needs the final validation loss (>= 1)")
    if len(set(args.seeds)) != len(args.seeds):
        p.error(f"--seeds {' '.join(map(str, args.seeds))}: a seed is repeated")

    work = pathlib.Path(args.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    out = pathlib.Path(args.out)
    data, vocab, merges = prepare(work, args.corpus_mb, args.vocab_size)
    settings = {
        "iters": args.iters, "eval_iters": args.eval_iters, "corpus_mb": args.corpus_mb,
        "vocab_size": args.vocab_size, "model_args": args.model_args, "device_backend": args.device_backend,
        "data_digest": data_digest([f"{data}.bin", vocab, merges]),
    }  # fmt: skip
    results = load_results(out, settings)
    argv_model = MODEL + more
    seq_length = int(flag_value(argv_model, "--seq-length", "1024"))
    gbs = int(flag_value(argv_model, "--global-batch-size", "32"))
    results["title"] = (
        f"GPT {flag_value(argv_model, '--num-layers', '?')}L h{flag_value(argv_model, '--hidden-size', '?')} "
        f"s{seq_length} gbs{gbs}, {args.iters} steps, stdlib corpus; validation: {args.eval_iters} x {gbs} "
        "sequences"
    )
    results["validation_split"] = validation_split(data, seq_length, args.eval_iters * gbs)
    split = results["validation_split"]
    print(
        f"validation split: {split['tokens']} tokens = {split['sequences']} sequences of {seq_length}; the final "
        f"evaluation reads {split['sequences_read']} (--eval-iters {args.eval_iters} x global batch {gbs})",
        flush=True,
    )
    todo = pending(results, args.runs, args.seeds)
    skipped = len(args.runs) * len(args.seeds) - len(todo)
    if skipped:
        print(f"{out}: {skipped} of the asked runs are there already (skipped)", flush=True)
    total = time.perf_counter()
    for name, seed in todo:
        run = train(
            work, data, vocab, merges, name, RUNS[name], args.iters, args.device_backend, seed,
            args.eval_iters, more,
        )  # fmt: skip
        results["runs"].setdefault(name, {})[str(seed)] = run
        results["summary"] = summarize(results["runs"])
        write_atomic(out, results)
        print(
            f"{name} seed {seed}: final validation loss {run['valid_loss']:.4f}, final training loss "
            f"{run['final_train_loss']:.4f} at iteration {run['train'][-1][0]}; {run['wall_s']:.1f} s",
            flush=True,
        )
    print(f"{len(todo)} runs in {time.perf_counter() - total:.0f} s -> {out}")
    if results["runs"]:
        results["summary"] = summarize(results["runs"])
        write_atomic(out, results)
        print(format_summary(results["summary"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
