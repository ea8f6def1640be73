"""One token id past the vocabulary, deep in a dataset where the open-time sample check does not look:
a real ``pretrain_gpt.py`` job (torchrun, TP=1 and TP=2) stops with ONE line that names the id, the
padded vocabulary, the iteration of the batch and the data, exit status 2 (not a bare IndexError, a
device-side assert, or silent training on zeros)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from mcore.data.config import DataConfig, TokenizerConfig
from mcore.data.indexed_dataset import (
    SAMPLE_WINDOW_TOKENS,
    SAMPLE_WINDOWS,
    IndexedDatasetBuilder,
    bin_path,
    idx_path,
)
from mcore.testing.distributed import free_port

REPO = pathlib.Path(__file__).resolve().parents[2]
SEQ, GBS, SEED, BAD_ID = 16, 4, 1234, 5000
BAD_ITERATION = 3
TOTAL_TOKENS = SAMPLE_WINDOWS * SAMPLE_WINDOW_TOKENS * 2  # the sample check reads half of the file


def _sampled_positions(total: int) -> np.ndarray:
    """Which tokens :func:`mcore.data.indexed_dataset.check_token_ids` reads (True)."""
    read = np.zeros(total, dtype=bool)
    for start in np.linspace(0, total - SAMPLE_WINDOW_TOKENS, SAMPLE_WINDOWS).astype(np.int64):
        read[start : start + SAMPLE_WINDOW_TOKENS] = True
    return read


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory):
    """A one-document dataset of random ids in [0, 1000) where one token that the batch of
    iteration ``BAD_ITERATION`` reads (and no earlier batch) is ``BAD_ID``, outside the sampled windows."""
    from mcore.data.builder import build_train_valid_test_datasets
    from mcore.data.tokenizers import build_tokenizer

    root = tmp_path_factory.mktemp("ids")
    prefix = str(root / "corpus")
    tokens = np.random.default_rng(0).integers(0, 1000, TOTAL_TOKENS).astype(np.uint16)
    with IndexedDatasetBuilder(bin_path(prefix), dtype=np.uint16) as builder:
        builder.add_document(tokens.tolist(), [len(tokens)])
        builder.finalize(idx_path(prefix))
    # the samples of iteration BAD_ITERATION, as the job will build them (same flags, seed, split)
    tokenizer = build_tokenizer(TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=1000))
    config = DataConfig(data_path=(prefix,), split="100,0,0", data_cache_path=str(root / "cache"))
    train, _, _ = build_train_valid_test_datasets(config, tokenizer, SEQ, SEED, (GBS * 8, 0, 0))
    read = _sampled_positions(TOTAL_TOKENS)
    for index in range((BAD_ITERATION - 1) * GBS, BAD_ITERATION * GBS):
        sample = np.concatenate([train[index]["tokens"].numpy(), train[index]["labels"].numpy()[-1:]])
        middle = sample[6:11]  # 5 random ids: one place in the file; their centre is in this sample only
        starts = np.flatnonzero(np.all(np.lib.stride_tricks.sliding_window_view(tokens, 5) == middle, axis=1))
        if len(starts) == 1 and not read[starts[0] + 2]:
            position = int(starts[0]) + 2
            break
    else:
        pytest.fail("no token of the batch lies outside the sample check's windows")
    data = np.memmap(bin_path(prefix), dtype=np.uint16, mode="r+")
    data[position] = BAD_ID
    data.flush()
    del data
    return {"prefix": prefix, "position": position, "cache": str(root / "cache")}


def _job(poisoned, tmp_path, nproc: int, *extra: str) -> tuple[list[int], str]:
    """The job's ranks as ``srun`` starts them (one process each, ``SLURM_PROCID``): their exit codes
    and their output, rank after rank."""
    command = [
        sys.executable, str(REPO / "examples" / "pretrain_gpt.py"),
        "--device-backend", "cpu", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ), "--micro-batch-size", "2",
        "--global-batch-size", str(GBS), "--train-iters", "6", "--lr", "1e-3", "--seed", str(SEED),
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--data-path", poisoned["prefix"],
        "--split", "100,0,0", "--eval-iters", "0", "--num-workers", "0",
        "--data-cache-path", poisoned["cache"], *extra,
    ]  # fmt: skip
    env = {
        **os.environ, "OMP_NUM_THREADS": "1", "SLURM_NTASKS": str(nproc), "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }  # fmt: skip
    logs = [tmp_path / f"rank{r}.log" for r in range(nproc)]
    procs = []
    for r, log in enumerate(logs):
        with open(log, "w") as out:
            rank_env = {**env, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)}
            procs.append(subprocess.Popen(command, env=rank_env, stdout=out, stderr=subprocess.STDOUT))
    try:
        codes = [p.wait(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return codes, "".join(log.read_text(errors="replace") for log in logs)


@pytest.mark.parametrize(
    "nproc, extra",
    [
        (1, ["--log-interval", "1"]),
        # TP=2 (an id no rank owns used to embed as zeros, silently), reading the losses every 4th step
        (2, ["--tensor-model-parallel-size", "2", "--log-interval", "4"]),
    ],
    ids=["tp1", "tp2-log-interval-4"],
)
def test_an_id_past_the_vocabulary_stops_the_job_naming_it(poisoned, tmp_path, nproc, extra):
    codes, output = _job(poisoned, tmp_path, nproc, *extra)
    errors = [line for line in output.splitlines() if line.startswith("error")]
    assert codes == [2] * nproc, output[-4000:]
    assert len(errors) == 1, output[-4000:]
    line = errors[0]
    assert f"token id {BAD_ID} (input id) in the batch of iteration {BAD_ITERATION}" in line, line
    assert "outside the padded vocabulary [0, 1024)" in line, line
    assert f"--data-path {poisoned['prefix']}" in line, line
    position = poisoned["position"]
    assert f"first found at {poisoned['prefix']}.bin: token {position} (byte offset {2 * position})" in line
    assert "Traceback" not in output and "IndexError" not in output, output[-4000:]
    if "--log-interval" in extra and extra[extra.index("--log-interval") + 1] == "1":
        # the iterations before the bad batch trained and logged
        assert output.count(" iteration ") >= BAD_ITERATION - 1, output[-4000:]
