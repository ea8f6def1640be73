"""The MoE benchmarks' arithmetic (benchmarks/): the plain reference's FLOP count agrees with
mcore's Megatron MoE FLOPs (they differ by the router's GEMM alone, which Megatron leaves out),
``--reference plain-moe`` refuses a run that is not the reference's model (naming the flags), and the
convergence summary's verdicts on hand-made numbers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import moe_convergence  # noqa: E402
from plain_moe_reference import MoEReferenceShape  # noqa: E402
from train_throughput import reference_moe_shape  # noqa: E402

from mcore.training.flops import gpt_flops_per_sample  # noqa: E402
from mcore.training.run_config import parse_run_config  # noqa: E402

OLMOE = (
    "--num-layers 16 --hidden-size 2048 --num-attention-heads 16 --seq-length 4096 "
    "--max-position-embeddings 4096 --micro-batch-size 2 --global-batch-size 2 --normalization RMSNorm "
    "--swiglu --disable-bias-linear --untie-embeddings-and-output-weights --position-embedding-type rope "
    "--num-experts 64 --moe-router-topk 8 --moe-ffn-hidden-size 1024 --vocab-size 50304 "
    "--tokenizer-type NullTokenizer --mock-data --train-iters 1 --lr 1e-4"
).split()


def test_reference_flops_match_megatron_moe_flops_but_the_router():
    cfg = parse_run_config(OLMOE, prog="t")
    shape = reference_moe_shape(cfg, world_size=1, vocab=50304)
    assert shape == MoEReferenceShape(16, 2048, 16, 64, 8, 1024, 4096, 2, 50304)
    ours = gpt_flops_per_sample(cfg.model, 50304) * 2
    router = 6 * 2 * 4096 * 16 * 2048 * 64  # 6 * tokens * layers * h * E
    assert ours == pytest.approx(shape.flops_per_step() - router, rel=1e-12)


def test_reference_refuses_another_model_naming_the_flags():
    dense = [a for a in OLMOE if a not in ("--swiglu",)]
    with pytest.raises(SystemExit, match="--swiglu"):
        reference_moe_shape(parse_run_config(dense, prog="t"), world_size=1, vocab=50304)
    with pytest.raises(SystemExit, match="world size"):
        reference_moe_shape(parse_run_config(OLMOE, prog="t"), world_size=2, vocab=50304)


def test_convergence_summary_verdicts():
    def run(loss, imbalance):
        return {"valid_loss": loss, "imbalance": [[5, 4.0], [500, imbalance]]}

    ok = moe_convergence.summarize({"aux_loss": run(3.65, 1.23), "expert_bias": run(3.59, 1.19)})
    assert ok["loss_gap"] == pytest.approx(0.06 / 3.59)
    assert ok["loss_gap_ok"] and ok["expert_bias_balance_ok"]
    bad = moe_convergence.summarize({"aux_loss": run(3.65, 1.2), "expert_bias": run(3.4, 1.5)})
    assert not bad["loss_gap_ok"] and not bad["expert_bias_balance_ok"]
