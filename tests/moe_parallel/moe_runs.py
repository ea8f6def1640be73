"""Rank functions for the MoE equivalence tests through the real ``pretrain`` loop (imported by the
spawned ranks).

A tiny MoE GPT (2 layers, both MoE, hidden 16, 4 experts of FFN 16, top-2, SwiGLU, sequence 8,
vocabulary 128, global batch 4 in micro-batches of 1, no dropout) on fixed learnable samples, so
every layout sees the same micro-batches and differs only by floating-point summation order.
:func:`run_cases` trains several layouts one after the other in the same processes and returns,
per case, the losses and the gradient norms (``--log-json``, written by the last rank).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "checkpoint"))
from ckpt_runs import TinyDataset  # noqa: E402

from mcore.testing.distributed import test_backend_name  # noqa: E402

SEQ, VOCAB = 8, 128
MOE_ARGV = [
    "--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2", "--ffn-hidden-size", "32",
    "--swiglu", "--disable-bias-linear", "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ),
    "--hidden-dropout", "0", "--attention-dropout", "0",
    "--num-experts", "4", "--moe-ffn-hidden-size", "16", "--moe-router-topk", "2",
    "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3", "--moe-token-dispatcher-type", "alltoall",
    "--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "1e-2", "--clip-grad", "1.0",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB), "--log-interval", "1",
    "--eval-iters", "0", "--num-workers", "0",
]  # fmt: skip

# the variants of the model each layout is compared under (one single-process reference each)
VARIANTS = {
    "dropless": [],
    "four-layers": ["--num-layers", "4"],  # for the interleaved pipeline (pp=2 x vp=2)
    "capacity": ["--moe-expert-capacity-factor", "1.0", "--moe-token-drop-policy", "probs"],
    "sigmoid-bias-shared": [
        "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
        "--moe-router-bias-update-rate", "1e-2", "--moe-shared-expert-intermediate-size", "16",
        "--moe-shared-expert-gate", "--moe-router-load-balancing-type", "seq_aux_loss",
    ],
}  # fmt: skip


def tiny_provider(cfg, tokenizer, num_samples):
    return (
        TinyDataset(max(int(num_samples[0]), 1), cfg.model.seq_length, VOCAB, cfg.training.seed),
        None,
        None,
    )


def run_case(extra: list[str], log_json: str | None = None) -> dict:
    """One ``pretrain`` run; the losses, and the per-step records of ``--log-json`` where this rank
    wrote them (the last rank)."""
    from mcore.training.gpt import forward_step, model_provider
    from mcore.training.pretrain import pretrain

    argv = ["--device-backend", test_backend_name(), *MOE_ARGV, *extra]
    if log_json is not None:
        argv += ["--log-json", log_json]
    result = pretrain(model_provider, forward_step, tiny_provider, argv=argv)
    records = []
    if log_json is not None and Path(log_json).exists():
        records = [json.loads(line) for line in Path(log_json).read_text().splitlines()]
    steps = [r for r in records if "grad_norm" in r]
    return {
        "losses": list(result.train_losses),
        "grad_norms": [r["grad_norm"] for r in steps],
        "lb_losses": [r.get("load_balancing_loss", r.get("seq_load_balancing_loss")) for r in steps],
        "iteration": result.state.iteration,
    }


def run_cases(cases: list[tuple[str, list[str]]], tmp: str) -> dict:
    """Every ``(name, argv)`` case in a row, in the same processes (each ``pretrain`` builds its groups)."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    out = {}
    for name, extra in cases:
        out[name] = run_case(extra, str(Path(tmp) / f"{name}.rank{rank}.jsonl"))
    return out
