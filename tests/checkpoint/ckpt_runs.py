"""Rank functions and a tiny in-memory dataset for the checkpoint tests (imported by the spawned ranks).

Every run trains the same tiny GPT (4 layers, hidden 32, SwiGLU, tied embeddings, sequence 16,
global batch 4) on fixed random tokens, so runs at different layouts see the same samples in the same
order and differ only by floating-point summation order.
"""

from __future__ import annotations

import os

import torch

from mcore.testing.distributed import test_backend_name

SEQ = 16
MODEL_ARGV = [
    "--num-layers", "4",
    "--hidden-size", "32",
    "--num-attention-heads", "4",
    "--ffn-hidden-size", "64",
    "--swiglu",
    "--seq-length", str(SEQ),
    "--max-position-embeddings", str(SEQ),
    "--hidden-dropout", "0",
    "--attention-dropout", "0",
]  # fmt: skip
TRAIN_ARGV = [
    "--micro-batch-size", "1",
    "--global-batch-size", "4",
    "--lr", "1e-2",
    "--min-lr", "1e-3",
    "--lr-decay-style", "cosine",
    "--lr-warmup-iters", "2",
    "--tokenizer-type", "NullTokenizer",
    "--vocab-size", "1000",
    "--log-interval", "1000",
    "--eval-iters", "0",
    "--num-workers", "0",
]  # fmt: skip


TP2_PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
DISTOPT_DP2 = ["--use-distributed-optimizer"]


def argv(*extra: str) -> list[str]:
    return ["--device-backend", test_backend_name(), *MODEL_ARGV, *TRAIN_ARGV, *extra]


class TinyDataset(torch.utils.data.Dataset):
    """``n`` learnable samples (arithmetic progressions modulo ``vocab`` with a random start and a
    stride of 1..4; sample ``i`` depends only on ``seed`` and ``i``), in the loader's batch contract."""

    def __init__(self, n: int, seq: int, vocab: int, seed: int):
        self.n, self.seq, self.vocab, self.seed = n, seq, vocab, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + int(i))
        start = int(torch.randint(0, self.vocab, (1,), generator=gen))
        stride = int(torch.randint(1, 5, (1,), generator=gen))
        t = (start + stride * torch.arange(self.seq + 1)) % self.vocab
        return {
            "tokens": t[:-1].clone(),
            "labels": t[1:].clone(),
            "loss_mask": torch.ones(self.seq),
            "position_ids": torch.arange(self.seq),
        }


def tiny_datasets_provider(cfg, tokenizer, num_samples):
    train = TinyDataset(max(int(num_samples[0]), 1), cfg.model.seq_length, 1000, cfg.training.seed)
    return train, None, None


def tiny_datasets_with_valid_provider(cfg, tokenizer, num_samples):
    """A training and a validation split (the validation samples come from another seed)."""
    train, _, _ = tiny_datasets_provider(cfg, tokenizer, num_samples)
    valid = TinyDataset(max(int(num_samples[1]), 1), cfg.model.seq_length, 1000, cfg.training.seed + 1)
    return train, valid, None


# Megatron's default dropout, background data workers, and validation every 3 iterations: a resume
# from iteration 5 crosses a validation (at 6) and the validation loader wraps around.
DROPOUT_VALID_ARGV = [
    "--hidden-dropout", "0.1",
    "--attention-dropout", "0.1",
    "--num-workers", "2",
    "--eval-iters", "1",
    "--eval-interval", "3",
]  # fmt: skip


def train(extra: list[str], with_valid: bool = False) -> dict:
    """One ``pretrain`` run; returns this rank's losses (last pipeline stage) and final state."""
    from mcore.training.gpt import forward_step, model_provider
    from mcore.training.pretrain import pretrain

    provider = tiny_datasets_with_valid_provider if with_valid else tiny_datasets_provider
    result = pretrain(model_provider, forward_step, provider, argv=argv(*extra))
    return {
        "losses": result.train_losses,
        "iteration": result.state.iteration,
        "consumed": result.state.consumed_train_samples,
        "exit_reason": result.exit_reason,
        "valid_loss": result.valid_loss,
    }


def train_with_failing_save(extra: list[str], fail_rank: int, fail_at_save: int, mode: str) -> dict:
    """Train, but make rank ``fail_rank`` fail during its ``fail_at_save``-th save (1-based), after it
    wrote its first file: ``mode="raise"`` raises from ``torch.save``; ``mode="kill"`` ends the
    process at once (``os._exit``), as a node failure would."""
    import mcore.checkpoint.save as save_module

    real_save = torch.save
    calls = {"saves": 0, "files": 0}
    real_snapshot = save_module._snapshot

    def counting_snapshot(*args, **kwargs):
        calls["saves"] += 1
        calls["files"] = 0
        return real_snapshot(*args, **kwargs)

    def failing_save(obj, path, *args, **kwargs):
        if torch.distributed.get_rank() == fail_rank and calls["saves"] == fail_at_save:
            calls["files"] += 1
            if calls["files"] == 2:
                if mode == "kill":
                    os._exit(17)
                raise OSError(28, "No space left on device (injected)")
        return real_save(obj, path, *args, **kwargs)

    save_module._snapshot = counting_snapshot
    save_module.torch.save = failing_save
    try:
        return train(extra)
    finally:
        save_module.torch.save = real_save
        save_module._snapshot = real_snapshot
