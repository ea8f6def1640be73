"""The whole Megatron-style workflow on one machine, in a few minutes, with nothing downloaded.

    python examples/quickstart.py                         # CPU backend, 2 processes (gloo)
    python examples/quickstart.py --device-backend cuda   # the same on GPUs
    python examples/quickstart.py --quick                 # fewer iterations (what CI runs)

Steps (each prints where its output went):

1. corpus: the Python standard library's own source files as JSON Lines, a small code corpus in the
   spirit of Megatron's CodeParrot example;
2. tokenizer: a byte-level BPE trained on that corpus (vocab.json + merges.txt, GPT-2 format);
3. preprocessing: ``mcore-preprocess-data`` into Megatron ``.bin/.idx``;
4. pretraining: ``python -m torch.distributed.run examples/pretrain_gpt.py`` with tensor parallel 2, stopped halfway by
   ``--exit-interval`` (a checkpoint is saved), then resumed from it with ``--load`` to the end;
5. export: the checkpoint to a Hugging Face directory (parity-checked by the exporter);
6. generation: a completion of ``def hello_world():`` with mcore and with transformers;
7. a loss-curve PNG from the run's JSON log.

Every run starts clean: a work directory left by an earlier quickstart run (it holds the marker file
``.mcore-quickstart``) is emptied first, and the run says so; a directory that is not the
quickstart's and not empty is refused (choose another ``--workdir``). Each step checks its result
(the checkpoint's iteration, the logged iterations) before it reports progress, and the plot is
refused when the log holds no training record.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
PROMPT = "def hello_world():"
MARKER = ".mcore-quickstart"


class QuickstartError(SystemExit):
    """A step whose result is not what it should be: the message says which and why."""

    def __init__(self, message: str):
        super().__init__(f"quickstart: {message}")


def prepare_workdir(work: pathlib.Path) -> None:
    """Make ``work`` an empty quickstart directory: remove an earlier quickstart run's outputs (said
    on stdout), refuse a non-empty directory that is not the quickstart's."""
    if work.exists() and any(work.iterdir()):
        if not (work / MARKER).exists():
            raise QuickstartError(
                f"{work} is not empty and was not made by the quickstart; choose another --workdir "
                "or remove it"
            )
        print(f"starting clean: removing the previous quickstart run's outputs in {work}")
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    (work / MARKER).write_text("made by examples/quickstart.py; emptied at the start of every run\n")


def checkpoint_iteration(ckpt: pathlib.Path) -> int | None:
    tracker = ckpt / "latest_checkpointed_iteration.txt"
    return int(tracker.read_text().strip()) if tracker.exists() else None


def logged_iterations(log: pathlib.Path) -> list[int]:
    if not log.exists():
        return []
    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    return [r["iteration"] for r in records if r["kind"] == "train"]


def expect_trained(ckpt: pathlib.Path, log: pathlib.Path, iteration: int) -> None:
    """The checkpoint is at ``iteration`` and the log has that iteration's training record."""
    saved = checkpoint_iteration(ckpt)
    if saved != iteration:
        raise QuickstartError(f"expected a checkpoint at iteration {iteration} in {ckpt}, found {saved}")
    if iteration not in logged_iterations(log):
        raise QuickstartError(f"{log} has no training record of iteration {iteration}")


def step(title: str) -> None:
    print(f"\n=== {title}", flush=True)


def run(cmd: list[str], env: dict | None = None) -> None:
    print("$ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env={**os.environ, **(env or {})})


def build_corpus(work: pathlib.Path, max_bytes: int) -> pathlib.Path:
    """Standard-library .py files (sorted, so every machine with the same Python gets the same corpus)."""
    stdlib = pathlib.Path(os.__file__).parent
    out = work / "stdlib.jsonl"
    total = docs = 0
    with out.open("w", encoding="utf-8") as f:
        for path in sorted(stdlib.rglob("*.py")):
            if "site-packages" in path.parts or "test" in path.parts or "tests" in path.parts:
                continue
            text = path.read_text(encoding="utf-8", errors="replace")
            if not text.strip():
                continue
            f.write(json.dumps({"text": text, "path": str(path.relative_to(stdlib))}) + "\n")
            total += len(text.encode("utf-8"))
            docs += 1
            if total >= max_bytes:
                break
    print(f"corpus: {docs} files, {total / 1e6:.1f} MB -> {out}")
    return out


def plot_losses(log: pathlib.Path, png: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    its = [r["iteration"] for r in train if r["kind"] == "train"]
    if not its:
        raise QuickstartError(f"{log} holds no training record: nothing to plot")
    loss = [r["lm loss"] for r in train if r["kind"] == "train"]
    val = [(r["iteration"], r["lm loss"]) for r in train if r["kind"] == "validation" and not r.get("final")]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(its, loss, label="train lm loss")
    if val:
        ax.plot(*zip(*val), "o-", label="validation lm loss")
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss")
    ax.set_title("mcore quickstart: GPT on the Python standard library")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png)
    print(f"loss curve -> {png}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device-backend", default="cpu", help="cpu, cuda, npu or auto")
    parser.add_argument("--workdir", default="quickstart-output", help="where everything is written")
    parser.add_argument("--iters", type=int, default=300, help="training iterations")
    parser.add_argument(
        "--quick", action="store_true", help="a short run (CI): 40 iterations, a smaller corpus"
    )
    parser.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="processes = tensor parallel size (default 2; on accelerators at most the device count)",
    )
    args = parser.parse_args(argv)
    iters = 40 if args.quick else args.iters
    args.nproc = args.nproc or default_nproc(args.device_backend)
    work = pathlib.Path(args.workdir).resolve()
    prepare_workdir(work)
    started = time.time()
    env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}

    step("1. corpus")
    corpus = build_corpus(work, max_bytes=(2 if args.quick else 8) * 1_000_000)

    step("2. tokenizer")
    from mcore.data.tokenizers import train_bpe_tokenizer

    vocab, merges = train_bpe_tokenizer(_texts(corpus), 2048, work / "tokenizer")
    print(f"tokenizer -> {vocab}, {merges}")

    step("3. preprocessing")
    prefix = work / "data" / "stdlib"
    prefix.parent.mkdir(exist_ok=True)
    run(
        [
            sys.executable,
            "-m",
            "mcore.data.preprocess",
            "--input",
            str(corpus),
            "--output-prefix",
            str(prefix),
            "--tokenizer-type",
            "GPT2BPETokenizer",
            "--vocab-file",
            vocab,
            "--merge-file",
            merges,
            "--append-eod",
            "--workers",
            "2",
        ]
    )
    data = f"{prefix}_text_document"

    step(f"4. pretraining (tensor parallel {args.nproc}), stop halfway, resume")
    ckpt = work / "checkpoints"
    log = work / "train_log.jsonl"
    train = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(args.nproc),
        str(REPO / "examples" / "pretrain_gpt.py"),
        "--device-backend",
        args.device_backend,
        "--tensor-model-parallel-size",
        str(args.nproc),
        "--num-layers",
        "4",
        "--hidden-size",
        "128",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "128",
        "--max-position-embeddings",
        "128",
        "--micro-batch-size",
        "4",
        "--global-batch-size",
        "8",
        "--train-iters",
        str(iters),
        "--lr",
        "3e-3",
        "--min-lr",
        "3e-4",
        "--lr-decay-style",
        "cosine",
        "--lr-warmup-iters",
        str(max(1, iters // 20)),
        "--clip-grad",
        "1.0",
        "--weight-decay",
        "0.01",
        "--hidden-dropout",
        "0",
        "--attention-dropout",
        "0",
        "--data-path",
        data,
        "--split",
        "90,8,2",
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        vocab,
        "--merge-file",
        merges,
        "--num-workers",
        "0",
        "--log-interval",
        "10",
        "--eval-interval",
        str(max(10, iters // 4)),
        "--eval-iters",
        "4",
        "--save",
        str(ckpt),
        "--save-interval",
        str(iters),
        "--load",
        str(ckpt),
        "--log-json",
        str(log),
        "--tensorboard-dir",
        str(work / "tensorboard"),
    ]
    if args.device_backend != "cpu":
        train += ["--bf16"]
    run(train + ["--exit-interval", str(iters // 2)], env)
    expect_trained(ckpt, log, iters // 2)
    print(f"checkpoint after {iters // 2} iterations -> {ckpt}")
    run(train, env)
    expect_trained(ckpt, log, iters)
    print(f"resumed and finished {iters} iterations -> {ckpt}")

    step("5. export to Hugging Face (the exporter checks logit parity itself)")
    hf_dir = work / "hf_model"
    run([sys.executable, "-m", "mcore.hf.export", "--load", str(ckpt), "--save", str(hf_dir), "--overwrite"])
    print(f"Hugging Face model -> {hf_dir}")

    step(f"6. generation: a completion of {PROMPT!r}")
    mcore_out = work / "generation_mcore.json"
    run(
        [
            sys.executable,
            "-m",
            "mcore.inference.generate",
            "--load",
            str(ckpt),
            "--device-backend",
            args.device_backend,
            "--prompt",
            PROMPT,
            "--max-new-tokens",
            "32",
            "--greedy",
            "--output-json",
            str(mcore_out),
        ],
        env,
    )
    hf_text = generate_with_transformers(hf_dir, PROMPT, 32)
    (work / "generation_transformers.txt").write_text(hf_text, encoding="utf-8")
    print(f"transformers: {hf_text!r} -> {work / 'generation_transformers.txt'}")
    print(f"mcore:        -> {mcore_out}")

    step("7. loss curve")
    plot_losses(log, work / "loss_curve.png")
    print(f"\nAll done in {time.time() - started:.0f}s. Outputs under {work}")
    return 0


def default_nproc(backend_name: str) -> int:
    """Two processes (TP=2); on an accelerator no more than its devices (one rank per device)."""
    from mcore.plugins.manager import select_backend

    backend = select_backend(backend_name, activate=False)
    if backend.device_type == "cpu":
        return 2
    import torch

    count = torch.get_device_module(backend.device_type).device_count()
    if count < 2:
        print(f"only {count} {backend.device_type} device(s): training with 1 process (TP=1)")
    return max(1, min(2, count))


def generate_with_transformers(hf_dir: pathlib.Path, prompt: str, max_new_tokens: int) -> str:
    """Greedy completion through transformers' own pipeline, from the exported directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    model = AutoModelForCausalLM.from_pretrained(hf_dir)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    generate = pipeline("text-generation", model=model, tokenizer=tokenizer)
    return generate(prompt, max_new_tokens=max_new_tokens, do_sample=False)[0]["generated_text"]


def _texts(corpus: pathlib.Path):
    with corpus.open(encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)["text"]


if __name__ == "__main__":
    sys.exit(main())
