"""Rank functions for the DeepSeek-V3-style model through the real ``pretrain`` loop (imported by the
spawned ranks): a tiny model with every part of the family (MLA with YaRN, first layer dense, sigmoid
group-limited router with scaling and expert bias, a shared expert, seq_aux_loss, MTP) on fixed
learnable samples (``tests/checkpoint/ckpt_runs.TinyDataset``), so layouts differ only by summation
order."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "checkpoint"))
from ckpt_runs import TinyDataset  # noqa: E402

from mcore.testing.distributed import test_backend_name  # noqa: E402

SEQ, VOCAB = 8, 64
DS_ARGV = [
    "--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2", "--ffn-hidden-size", "24",
    "--swiglu", "--disable-bias-linear", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
    "--untie-embeddings-and-output-weights",
    "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ),
    "--hidden-dropout", "0", "--attention-dropout", "0",
    "--multi-latent-attention", "--qk-layernorm", "--q-lora-rank", "8", "--kv-lora-rank", "8",
    "--qk-head-dim", "4", "--qk-pos-emb-head-dim", "4", "--v-head-dim", "4",
    "--rotary-scaling-factor", "4", "--mscale-all-dim", "0.8",
    "--num-experts", "8", "--moe-ffn-hidden-size", "8", "--moe-router-topk", "2",
    "--moe-router-score-function", "sigmoid", "--moe-router-num-groups", "4", "--moe-router-group-topk", "2",
    "--moe-router-topk-scaling-factor", "2.5", "--moe-router-enable-expert-bias",
    "--moe-router-bias-update-rate", "1e-2", "--moe-router-load-balancing-type", "seq_aux_loss",
    "--moe-aux-loss-coeff", "1e-2", "--moe-shared-expert-intermediate-size", "8",
    "--moe-layer-freq", "[0,1]", "--moe-token-dispatcher-type", "alltoall",
    "--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0.3",
    "--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "1e-2", "--lr-decay-style", "constant",
    "--clip-grad", "1.0", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB),
    "--make-vocab-size-divisible-by", "64", "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0",
]  # fmt: skip


def tiny_provider(cfg, tokenizer, num_samples):
    return (
        TinyDataset(max(int(num_samples[0]), 1), cfg.model.seq_length, VOCAB, cfg.training.seed),
        None,
        None,
    )


def run_case(extra: list[str]) -> dict:
    """One ``pretrain`` run of the family; its losses (on the last pipeline stage) and iteration."""
    from mcore.training.gpt import forward_step, model_provider
    from mcore.training.pretrain import pretrain

    result = pretrain(model_provider, forward_step, tiny_provider, argv=[
        "--device-backend", test_backend_name(), *DS_ARGV, *extra])  # fmt: skip
    return {"losses": list(result.train_losses), "iteration": result.state.iteration}


def run_cases(cases: list[tuple[str, list[str]]]) -> dict:
    """Every ``(name, argv)`` case in a row, in the same processes (each ``pretrain`` builds its groups)."""
    return {name: run_case(extra) for name, extra in cases}
