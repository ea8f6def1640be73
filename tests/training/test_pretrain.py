"""End-to-end training with Megatron's flags on a small real corpus (the standard library's sources)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from mcore.testing.distributed import run_distributed
from mcore.training.gpt import forward_step, model_provider
from mcore.training.pretrain import pretrain

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A jsonl of stdlib Python files, a byte-level BPE trained on it, and its .bin/.idx dataset."""
    from mcore.data.preprocess import main as preprocess_main
    from mcore.data.tokenizers import train_bpe_tokenizer

    root = tmp_path_factory.mktemp("corpus")
    stdlib = pathlib.Path(os.__file__).parent
    files = sorted(stdlib.glob("*.py"))[:60]
    docs = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    jsonl = root / "stdlib.jsonl"
    with jsonl.open("w", encoding="utf-8") as out:
        for doc in docs:
            out.write(json.dumps({"text": doc}) + "\n")
    vocab, merges = train_bpe_tokenizer(docs, 512, root / "tokenizer")
    prefix = root / "stdlib"
    code = preprocess_main(
        [
            "--input",
            str(jsonl),
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
            "1",
            "--log-interval",
            "100000",
        ]
    )
    assert code in (0, None)
    return {"data": f"{prefix}_text_document", "vocab": vocab, "merges": merges, "root": root}


def _argv(corpus, *extra, iters=12):
    return [
        "--device-backend",
        "cpu",
        "--num-layers",
        "2",
        "--hidden-size",
        "64",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "64",
        "--max-position-embeddings",
        "64",
        "--micro-batch-size",
        "2",
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
        "2",
        "--weight-decay",
        "0.01",
        "--clip-grad",
        "1.0",
        "--hidden-dropout",
        "0",
        "--attention-dropout",
        "0",
        "--seed",
        "11",
        "--data-path",
        corpus["data"],
        "--split",
        "90,8,2",
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        corpus["vocab"],
        "--merge-file",
        corpus["merges"],
        "--log-interval",
        "1000",
        "--eval-interval",
        "1000",
        "--eval-iters",
        "2",
        "--num-workers",
        "0",
        "--data-cache-path",
        str(corpus["root"] / "cache"),
        *extra,
    ]


def _train(argv):
    result = pretrain(model_provider, forward_step, argv=argv)
    return result.train_losses, result.valid_loss, result.state.skipped_iterations


def test_eval_iters_zero_with_a_split_that_holds_no_sample_trains(tmp_path):
    """The default split (969,30,1) of a small dataset leaves the test share without one sample; with
    --eval-iters 0 nothing asks it for samples, so the run trains (it raised from the data loader)."""
    from mcore.data.preprocess import main as preprocess_main

    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("".join(json.dumps({"text": " ".join(["7"] * 40)}) + "\n" for _ in range(400)))
    null = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "64"]
    args = ["--input", str(jsonl), "--output-prefix", str(tmp_path / "d"), "--append-eod", *null]
    assert preprocess_main(args) == 0
    argv = [
        "--device-backend", "cpu", "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
        "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
        "--global-batch-size", "2", "--lr", "1e-3", "--train-iters", "2", "--num-workers", "0",
        "--eval-iters", "0", "--data-path", str(tmp_path / "d_text_document"), *null,
    ]  # fmt: skip
    losses, valid, _ = _train(argv)
    assert len(losses) == 2 and valid is None


def test_a_split_without_validation_says_so_once(corpus, capsys):
    losses, valid, _ = _train(
        _argv(corpus, "--split", "100,0,0", "--eval-interval", "1", "--lr-warmup-iters", "1", iters=3)
    )
    assert len(losses) == 3 and valid is None
    out = capsys.readouterr().out
    warnings = [line for line in out.splitlines() if "no validation data" in line]
    assert warnings == [
        "WARNING: --eval-iters 2 but there is no validation data (--split '100,0,0' gives validation a "
        "share of 0): this run does not validate. Give validation data (e.g. --split 969,30,1) or set "
        "--eval-iters 0."
    ], out
    # --eval-iters 0 asks for no validation: nothing to say
    _train(_argv(corpus, "--split", "100,0,0", "--eval-iters", "0", "--lr-warmup-iters", "1", iters=3))
    assert "no validation data" not in capsys.readouterr().out


def test_validation_loss_falls_on_stdlib_corpus(corpus):
    losses, valid, _ = _train(_argv(corpus, iters=40))
    assert len(losses) == 40
    assert valid is not None and valid < losses[0] - 0.5, (losses[0], valid)


def test_tensor_parallel_reproduces_the_single_process_curve(corpus):
    single, _, _ = _train(_argv(corpus))
    for extra in (
        ["--tensor-model-parallel-size", "2"],
        ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    ):
        ranks = run_distributed(_train, 2, _argv(corpus, *extra))
        parallel = ranks[-1][0]
        torch.testing.assert_close(torch.tensor(parallel), torch.tensor(single), rtol=2e-5, atol=2e-5)


def test_pipeline_and_data_parallel_reproduce_the_single_process_curve(corpus):
    """The real loop at PP=2 (interleaved, 2 virtual stages) and at DP=2 with the distributed optimizer."""
    single, _, _ = _train(_argv(corpus, "--num-layers", "4"))
    for extra in (
        ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
        ["--use-distributed-optimizer", "--overlap-grad-reduce"],
    ):
        ranks = run_distributed(_train, 2, _argv(corpus, "--num-layers", "4", *extra))
        torch.testing.assert_close(torch.tensor(ranks[-1][0]), torch.tensor(single), rtol=2e-5, atol=2e-5)


def test_gradient_accumulation_equals_one_large_batch(corpus):
    accumulated, _, _ = _train(_argv(corpus, "--micro-batch-size", "1", iters=6))
    large, _, _ = _train(_argv(corpus, "--micro-batch-size", "8", iters=6))
    torch.testing.assert_close(torch.tensor(accumulated), torch.tensor(large), rtol=2e-5, atol=2e-5)


class _InjectInf:
    """A forward step that turns the loss of one training iteration into inf."""

    def __init__(self, bad_call: int):
        self.calls = 0
        self.bad_call = bad_call

    def __call__(self, data_iterator, model):
        self.calls += 1
        output, loss_func = forward_step(data_iterator, model)
        if self.calls != self.bad_call:
            return output, loss_func

        def poisoned(out):
            loss, logs = loss_func(out)
            return loss * float("inf"), logs

        return output, poisoned


def test_fp16_inf_gradient_skips_that_step_and_lowers_the_scale(corpus, tmp_path):
    log = tmp_path / "log.jsonl"
    argv = _argv(
        corpus,
        "--fp16",
        "--initial-loss-scale",
        "1024",
        "--hysteresis",
        "1",
        "--log-interval",
        "1",
        "--log-json",
        str(log),
        "--eval-iters",
        "0",
        "--micro-batch-size",
        "8",
        iters=6,
    )
    result = pretrain(model_provider, _InjectInf(bad_call=3), argv=argv)
    assert result.state.skipped_iterations == 1
    records = [json.loads(line) for line in log.read_text().splitlines() if '"train"' in line]
    scales = [r["loss_scale"] for r in records]
    assert scales[:2] == [1024.0, 1024.0] and scales[2] == 512.0 and scales[-1] == 512.0, scales
    assert all(torch.isfinite(torch.tensor(r["lm loss"])) for i, r in enumerate(records) if i != 2)


def test_a_static_loss_scale_that_underflows_every_gradient_stops_with_one_line(corpus, capsys):
    argv = _argv(corpus, "--fp16", "--loss-scale", str(2.0**-40), "--lr-warmup-iters", "1", iters=3)
    with pytest.raises(SystemExit) as info:
        pretrain(model_provider, forward_step, argv=argv)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "error (rank 0): every gradient is zero at loss scale 9.09495e-13: the scaled gradients underflowed "
        "to zero and the update would not train the model; raise --loss-scale 9.09495e-13 (Megatron's "
        "static scales are powers of 2 such as 4096) or leave it out for the dynamic loss scale"
    ], err


@pytest.mark.parametrize(
    "extra",
    [
        ["--use-distributed-optimizer"],
        # no clipping: the flat step's norm is checked all the same; read every 2nd step only
        [
            "--use-distributed-optimizer",
            "--use-precision-aware-optimizer",
            "--clip-grad",
            "0",
            "--log-interval",
            "2",
        ],
    ],
    ids=["distopt", "precision-aware-no-clip"],
)
def test_bf16_static_loss_scale_that_underflows_on_the_flat_path_stops_with_one_line(corpus, capsys, extra):
    """The flat (one-pass, device-side) optimizer refuses all-zero gradients as the per-parameter
    path does, read where the step's results are read (no wait of its own)."""
    scale = 2.0**-126  # bf16 gradients of loss * scale flush to zero
    argv = _argv(corpus, "--bf16", "--loss-scale", str(scale), "--lr-warmup-iters", "1", *extra, iters=4)
    with pytest.raises(SystemExit) as info:
        pretrain(model_provider, forward_step, argv=argv)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"error (rank 0): every gradient is zero at loss scale {scale:g}: the scaled gradients underflowed "
        f"to zero and the update would not train the model; raise --loss-scale {scale:g} (Megatron's "
        "static scales are powers of 2 such as 4096) or leave it out for the dynamic loss scale"
    ], err


def test_bf16_with_a_static_loss_scale_trains_on_unscaled_gradients(corpus, tmp_path):
    """The losses and gradient norms equal those without a scale (up to the two optimizer paths' float
    rounding: the scaled run takes the per-parameter path, which unscales; the flat AdamW path never
    did, so its logged norm was 1024x and clipping saw the scaled gradients)."""
    runs = {}
    for name, extra in (("plain", []), ("scaled", ["--loss-scale", "1024"])):
        log = tmp_path / f"{name}.jsonl"
        argv = _argv(corpus, "--bf16", "--log-interval", "1", "--log-json", str(log), *extra, iters=4)
        losses, _, _ = _train(argv)
        norms = [json.loads(line)["grad_norm"] for line in log.read_text().splitlines() if '"train"' in line]
        runs[name] = (losses, norms)
    for scaled, plain in zip(runs["scaled"], runs["plain"]):
        torch.testing.assert_close(torch.tensor(scaled), torch.tensor(plain), rtol=1e-3, atol=0)


def test_megatron_style_launch_script_runs_under_torchrun(tmp_path):
    # PYTHON: the script launches `$PYTHON -m torch.distributed.run`; this interpreter, not PATH's.
    env = dict(
        os.environ, OMP_NUM_THREADS="1", TRAIN_ITERS="4", OUTPUT_DIR=str(tmp_path), PYTHON=sys.executable
    )
    proc = subprocess.run(
        ["bash", str(REPO / "examples" / "pretrain_gpt3_tp_pp.sh")],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "iteration        4/       4" in proc.stdout


_THREADS_AFTER_PRETRAIN = """
import os, sys
from mcore.training.gpt import forward_step, model_provider
from mcore.training.pretrain import pretrain

def threads():
    # torch's per-device autograd threads (pt_autograd_N, started by the first backward on a machine
    # with GPUs, even for CPU tensors) and the GPU driver's own threads (cuda*) are not ours to end.
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                name = f.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        if not name.startswith(("pt_autograd_", "cuda")):
            names.append(name)
    return names

before = threads()
pretrain(model_provider, forward_step, argv=sys.argv[1:])
# One file per rank: both ranks share torchrun's stdout, where their lines can interleave.
with open(f"threads_rank{os.environ['RANK']}.txt", "w") as f:
    f.write(f"{len(before)} {len(threads())}\\n{' '.join(sorted(threads()))}")
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc to count threads")
def test_pretrain_under_torchrun_leaves_no_communication_threads(tmp_path):
    """Every gloo worker thread ends before pretrain returns.

    A worker left to interpreter shutdown can need the GIL while the interpreter is torn down and
    abort the process (seen as a flaky "terminate called without an active exception" after a
    finished run); counting threads makes that race a deterministic check.
    """
    script = tmp_path / "train.py"
    script.write_text(_THREADS_AFTER_PRETRAIN)
    argv = [
        "--device-backend", "cpu", "--tensor-model-parallel-size", "2", "--num-layers", "2",
        "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", "2",
        "--train-iters", "2", "--eval-iters", "1", "--eval-interval", "2", "--lr", "1e-3",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--num-workers", "0",
        "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
        "--data-cache-path", str(tmp_path / "index_cache"),  # rank 0 builds the mock indices, rank 1 reads
    ]  # fmt: skip
    proc = subprocess.run(
        # mcore-run (torchrun with mcore's failure line) runs a job that succeeds as torchrun does.
        [sys.executable, "-m", "mcore.distributed.launcher", "--nproc_per_node", "2", str(script), *argv],
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in range(2):
        report = tmp_path / f"threads_rank{rank}.txt"
        assert report.exists(), f"rank {rank} wrote no thread count\n" + proc.stdout[-3000:]
        counts, names = report.read_text().split("\n")
        before, after = map(int, counts.split())
        assert after <= before, f"rank {rank}: {before} threads before pretrain, {after} after: {names}"


def test_unknown_flag_exits_with_one_message(capsys):
    with pytest.raises(SystemExit) as err:
        pretrain(model_provider, forward_step, argv=["--num-layers", "2", "--hiden-size", "8"])
    assert err.value.code == 2
    assert "unknown flag --hiden-size (did you mean --hidden-size?)" in capsys.readouterr().err


def test_impossible_layout_is_refused_before_training(capsys):
    argv = [
        "--num-layers",
        "2",
        "--hidden-size",
        "96",
        "--num-attention-heads",
        "6",
        "--seq-length",
        "16",
        "--max-position-embeddings",
        "16",
        "--train-iters",
        "1",
        "--lr",
        "1e-3",
        "--mock-data",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "100",
        "--tensor-model-parallel-size",
        "4",
    ]
    with pytest.raises(SystemExit) as err:
        pretrain(model_provider, forward_step, argv=argv)
    assert err.value.code == 2
    assert "tensor_model_parallel_size=4" in capsys.readouterr().err


def test_python_is_the_interpreter():
    assert sys.executable
