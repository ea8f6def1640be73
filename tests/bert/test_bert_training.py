"""BERT through the real ``pretrain`` loop (``examples/pretrain_bert.py``'s pieces) on CPU processes (gloo).

* TP=2, TP=2 with sequence parallelism and full recomputation, PP=2 (interleaved, 2 virtual stages),
  PP=4 (middle stages read the padding mask from their own data iterator), DP=2 with the distributed
  optimizer: the single-process ``lm loss`` and ``sop loss`` of every step (fp32, within the GPT tests'
  2e-5).
* bf16 at TP=2 with sequence parallelism: the single-process bf16 run's losses.
* A TP=2 checkpoint: resumed at TP=2 bit for bit; loaded at TP=1 x PP=2 it continues like the run that
  never changed layout. With Megatron's dropout (0.1) a TP=2 resume is bit for bit too.
* ``--bert-no-binary-head``: no ``sop loss``, no token types. BERT's FLOPs: GPT's plus its heads.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # bert_runs, here and in the spawned ranks
from bert_runs import train  # noqa: E402

from mcore.testing.distributed import DistributedTestError, run_distributed  # noqa: E402

pytestmark = pytest.mark.slow
ITERS = ["--train-iters", "6"]
TOL = dict(rtol=2e-5, atol=2e-5)  # tests/training/test_pretrain.py's


def _close(actual: dict, expected: dict, **tol) -> None:
    for key in ("lm", "sop"):
        assert len(actual[key]) == len(expected[key]) == 6, (key, actual, expected)
        torch.testing.assert_close(torch.tensor(actual[key]), torch.tensor(expected[key]), **(tol or TOL))


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The single-process run every layout must reproduce (in this process)."""
    return train(ITERS, str(tmp_path_factory.mktemp("single") / "log.jsonl"))


@pytest.fixture(scope="module")
def tp2_run(tmp_path_factory):
    """6 iterations at TP=2, saving at 3 and 6: ``(save dir, last rank's result)``."""
    root = tmp_path_factory.mktemp("tp2")
    extra = [
        *ITERS,
        "--tensor-model-parallel-size",
        "2",
        "--save",
        str(root / "ckpt"),
        "--save-interval",
        "3",
    ]
    return root / "ckpt", run_distributed(train, 2, extra, str(root / "log.jsonl"))[-1]


def test_single_process_run_logs_both_losses(single):
    assert len(single["lm"]) == 6 and all(v is not None and v > 0 for v in single["sop"])
    # The steps change the model (learning itself is shown by the README quickstart test: six steps on
    # this tiny random-token data need not lower the loss, and on a GPU they did not).
    assert len(set(single["lm"])) == 6 and all(v > 0 for v in single["lm"])


def test_tensor_parallel_reproduces_the_single_process_losses(single, tp2_run):
    _close(tp2_run[1], single)


@pytest.mark.parametrize(
    ("nprocs", "layout"),
    [
        (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--recompute-granularity", "full",
             "--recompute-method", "uniform", "--recompute-num-layers", "1"]),
        (2, ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]),
        (2, ["--use-distributed-optimizer", "--overlap-grad-reduce"]),
        (4, ["--pipeline-model-parallel-size", "4"]),
    ],
    ids=["tp2-sp-recompute", "pp2-interleaved", "dp2-distopt", "pp4"],
)  # fmt: skip
def test_parallel_layouts_reproduce_the_single_process_losses(single, tmp_path, nprocs, layout):
    result = run_distributed(train, nprocs, [*ITERS, *layout], str(tmp_path / "log.jsonl"))[-1]
    _close(result, single)


def test_middle_pipeline_stages_need_their_own_data(tmp_path):
    """Without ``data_on_every_stage`` a middle stage of PP=4 has no batch (no padding mask) and fails:
    what ``examples/pretrain_bert.py`` turns on."""
    with pytest.raises(DistributedTestError, match=r"needs the micro-batch on every pipeline stage"):
        run_distributed(
            train, 4, ["--train-iters", "2", "--pipeline-model-parallel-size", "4"], str(tmp_path / "log.jsonl"),
            data_on_every_stage=False,
        )  # fmt: skip


def test_bf16_at_tp2_with_sequence_parallelism_matches_one_process(single, tmp_path):
    bf16 = [*ITERS, "--bf16"]
    one = train(bf16, str(tmp_path / "one.jsonl"))
    two = run_distributed(
        train,
        2,
        [*bf16, "--tensor-model-parallel-size", "2", "--sequence-parallel"],
        str(tmp_path / "two.jsonl"),
    )[-1]
    # bf16 activations: summation order shows at the bf16 resolution (2^-8 relative)
    _close(two, one, rtol=1e-2, atol=1e-2)
    assert one["lm"] != single["lm"]  # it did run in bf16


def test_checkpoint_resumes_bit_exact_and_reshards_to_tp1_pp2(tp2_run, tmp_path):
    save, straight = tp2_run
    resume = [*ITERS, "--load", str(save), "--ckpt-step", "3"]
    resumed = run_distributed(
        train, 2, [*resume, "--tensor-model-parallel-size", "2"], str(tmp_path / "tp2.jsonl")
    )[-1]
    assert resumed["iteration"] == 6
    assert resumed["lm"] == straight["lm"][3:] and resumed["sop"] == straight["sop"][3:]  # bit for bit
    moved = run_distributed(
        train, 2, [*resume, "--pipeline-model-parallel-size", "2"], str(tmp_path / "pp2.jsonl")
    )[-1]
    # the loaded weights and optimizer state at another layout: summation order only
    assert moved["lm"] == pytest.approx(straight["lm"][3:], rel=1e-5, abs=0)
    assert moved["sop"] == pytest.approx(straight["sop"][3:], rel=1e-5, abs=0)


def test_no_binary_head_trains_the_masked_lm_alone(tmp_path):
    with_head = train(["--train-iters", "2"], str(tmp_path / "head.jsonl"))
    without = train(["--train-iters", "2", "--bert-no-binary-head"], str(tmp_path / "nohead.jsonl"))
    assert without["sop"] == [None, None] and all(v > 0 for v in without["lm"])
    assert without["lm"][0] != with_head["lm"][0]  # no token-type embedding in the input


def test_bert_flops_add_the_lm_head_transform_and_the_pooler_to_gpts():
    from mcore.models.transformer.model_config import ModelConfig
    from mcore.training.flops import bert_flops_per_sample, gpt_flops_per_sample

    h, s, vocab = 64, 32, 1024
    base = dict(num_layers=2, hidden_size=h, num_attention_heads=4, seq_length=s)
    with_head = ModelConfig(**base)
    without = ModelConfig(**base, bert_binary_head=False)
    gpt = gpt_flops_per_sample(with_head, vocab)
    assert bert_flops_per_sample(without, vocab) - gpt == 6 * s * h * h
    assert bert_flops_per_sample(with_head, vocab) - gpt == 6 * s * h * h + 6 * h * h + 12 * h


def test_resume_with_megatrons_dropout_is_bit_exact(single, tmp_path):
    """Dropout 0.1 (Megatron's default) at TP=2: the resumed run draws the masks the straight run drew."""
    common = [
        *ITERS,
        "--hidden-dropout",
        "0.1",
        "--attention-dropout",
        "0.1",
        "--tensor-model-parallel-size",
        "2",
    ]
    save = ["--save", str(tmp_path / "ckpt"), "--save-interval", "3"]
    straight = run_distributed(train, 2, [*common, *save], str(tmp_path / "straight.jsonl"))[-1]
    load = ["--load", str(tmp_path / "ckpt"), "--ckpt-step", "3"]
    resumed = run_distributed(train, 2, [*common, *load], str(tmp_path / "resumed.jsonl"))[-1]
    assert resumed["lm"] == straight["lm"][3:] and resumed["sop"] == straight["sop"][3:]
    assert straight["lm"] != single["lm"]  # dropout was on (without it TP=2 gives the single run's losses)


def test_megatron_bert_flags_parse_or_are_refused_by_name(capsys):
    from mcore.training.run_config import parse_run_config

    base = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16"]
    cfg = parse_run_config([*base, "--bert-no-binary-head", "--mask-prob", "0.2", "--short-seq-prob", "0.05"])
    assert (cfg.model.bert_binary_head, cfg.data.mask_prob, cfg.data.short_seq_prob) == (False, 0.2, 0.05)
    assert parse_run_config(base).model.bert_binary_head is True  # Megatron's default: the binary head
    with pytest.raises(SystemExit):
        parse_run_config([*base, "--bert-load", "ict_ckpt"])
    err = capsys.readouterr().err
    assert "--bert-load is a Megatron-LM flag mcore does not support" in err and "--load" in err
