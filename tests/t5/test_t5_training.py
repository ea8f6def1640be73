"""T5 pretraining through ``pretrain``: every parallel layout reproduces the single-process losses (real
processes, gloo), the encoder-decoder pipeline split included, and a resumed run continues exactly."""

import pytest
import torch

from mcore.pipeline.encoder_decoder import ModelType
from mcore.testing.distributed import run_distributed
from mcore.training.pretrain import pretrain
from mcore.training.t5 import forward_step, model_provider, t5_datasets_provider


def _argv(corpus, *extra, iters=4):
    return [
        "--device-backend", "cpu",
        "--encoder-num-layers", "2", "--decoder-num-layers", "2",
        "--hidden-size", "32", "--num-attention-heads", "4", "--kv-channels", "8", "--ffn-hidden-size", "64",
        "--encoder-seq-length", "64", "--decoder-seq-length", "32", "--max-position-embeddings", "64",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", str(iters),
        "--lr", "3e-3", "--clip-grad", "1.0", "--weight-decay", "0.01",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "7",
        "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", corpus["vocab"], "--vocab-extra-ids", "100",
        "--data-path", corpus["prefix"], "--split", "100,0,0", "--eval-iters", "0",
        "--data-cache-path", str(corpus["root"] / "cache"), "--num-workers", "0", "--log-interval", "1000",
        *extra,
    ]  # fmt: skip


def _train(argv):
    result = pretrain(
        model_provider,
        forward_step,
        t5_datasets_provider,
        argv=argv,
        model_type=ModelType.encoder_and_decoder,
    )
    return result.train_losses


RELATIVE = [
    "--position-embedding-type", "relative", "--normalization", "RMSNorm", "--disable-bias-linear",
    "--untie-embeddings-and-output-weights",
]  # fmt: skip


def _close(parallel, single):
    assert len(parallel) == len(single)
    torch.testing.assert_close(torch.tensor(parallel), torch.tensor(single), rtol=2e-5, atol=2e-5)


def test_tensor_sequence_and_data_parallel_reproduce_the_single_process_losses(t5_corpus):
    single = _train(_argv(t5_corpus))
    assert single[-1] < single[0]
    assert (
        _train(
            _argv(
                t5_corpus,
                "--recompute-granularity",
                "full",
                "--recompute-method",
                "uniform",
                "--recompute-num-layers",
                "1",
            )
        )
        == single
    )
    for extra in (
        ["--tensor-model-parallel-size", "2"],
        ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
        ["--use-distributed-optimizer"],
    ):
        ranks = run_distributed(_train, 2, _argv(t5_corpus, *extra), timeout=120)
        _close(ranks[-1], single)


@pytest.mark.parametrize("variant", ["megatron", "relative"])
def test_encoder_and_decoder_on_separate_pipeline_stages(t5_corpus, variant):
    """Stage 0 the encoder, stages 1-2 the decoder (--encoder-pipeline-model-parallel-size 1 on top of
    2 decoder stages): the encoder output travels through both decoder stages and its gradients come
    back summed; the tied embedding (3 copies), the position embeddings and the relative-position tables
    held by several stages take the single-stage step."""
    extra = RELATIVE if variant == "relative" else []
    ranks = run_distributed(
        _train,
        3,
        _argv(
            t5_corpus, *extra, "--pipeline-model-parallel-size", "2", "--encoder-pipeline-model-parallel-size",
            "1", "--micro-batch-size", "1",
        ),
        timeout=120,
    )  # fmt: skip
    assert ranks[0] == [] and ranks[1] == []
    _close(ranks[2], _train(_argv(t5_corpus, *extra, "--micro-batch-size", "1")))


def test_pipeline_split_with_data_parallel_resumes_exactly(t5_corpus, tmp_path):
    """PP=2 (--pipeline-model-parallel-split-rank 1) x DP=2 with the distributed optimizer: 2 steps, save,
    exit; resumed for 2 more, the 4 losses are the single-process run's (the decoder's embedding copy is
    saved once and filled from the original on load), also when one process resumes it."""
    layout = [
        "--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-split-rank", "1",
        "--use-distributed-optimizer", "--save-interval", "2",
    ]  # fmt: skip
    ckpt = str(tmp_path / "ckpt")
    first = run_distributed(
        _train, 4, _argv(t5_corpus, *layout, "--save", ckpt, "--exit-interval", "2"), timeout=120
    )
    resumed = run_distributed(
        _train, 4, _argv(t5_corpus, *layout, "--load", ckpt, "--save", str(tmp_path / "later")), timeout=120
    )
    assert len(first[-1]) == 2 and len(resumed[-1]) == 2
    single = _train(_argv(t5_corpus))
    _close(first[-1] + resumed[-1], single)
    # The same checkpoint resumed in one process (another layout) continues the same curve.
    _close(_train(_argv(t5_corpus, "--load", ckpt)), single[2:])
