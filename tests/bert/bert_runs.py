"""Rank functions and a tiny in-memory BERT dataset for the BERT training tests (imported by the
spawned ranks).

Every run trains the same tiny BERT (4 layers, hidden 32, sequence 16, global batch 4) through the real
``pretrain`` loop of ``examples/pretrain_bert.py`` (its providers, ``data_on_every_stage``, the BERT
FLOPs) on fixed synthetic samples in Megatron's BERT batch contract, so runs at different layouts see
the same samples in the same order and differ only by floating-point summation order. The per-step
``lm loss`` and ``sop loss`` come from the ``--log-json`` records (``--log-interval 1``): the values
Megatron logs, averaged over micro-batches and data-parallel ranks.
"""

from __future__ import annotations

import json
import pathlib

import torch

from mcore.testing.distributed import test_backend_name

SEQ, VOCAB = 16, 128  # 128 = the padded vocabulary at TP=1, 2 and 4 alike (divisible by 8 x TP)
CLS, SEP, MASK, PAD = 2, 3, 4, 0  # a WordPiece vocab.txt's usual ids ([PAD] [UNK] [CLS] [SEP] [MASK])
MODEL_ARGV = [
    "--num-layers", "4",
    "--hidden-size", "32",
    "--num-attention-heads", "4",
    "--seq-length", str(SEQ),
    "--max-position-embeddings", str(SEQ),
    "--hidden-dropout", "0",
    "--attention-dropout", "0",
]  # fmt: skip
TRAIN_ARGV = [
    "--micro-batch-size", "1",
    "--global-batch-size", "4",
    "--lr", "5e-3",
    "--min-lr", "5e-4",
    "--lr-decay-style", "cosine",
    "--lr-warmup-iters", "1",
    "--weight-decay", "0.01",
    "--clip-grad", "1.0",
    "--tokenizer-type", "NullTokenizer",
    "--vocab-size", str(VOCAB - 1),
    "--make-vocab-size-divisible-by", "8",
    "--log-interval", "1",
    "--eval-iters", "0",
    "--num-workers", "0",
    "--seed", "7",
]  # fmt: skip


def argv(*extra: str) -> list[str]:
    return ["--device-backend", test_backend_name(), *MODEL_ARGV, *TRAIN_ARGV, *extra]


class TinyBertDataset(torch.utils.data.Dataset):
    """``n`` synthetic BERT samples (sample ``i`` depends only on ``seed`` and ``i``), with the keys of
    Megatron's ``BERTMaskedWordPieceDataset``: ``[CLS] a [SEP] b [SEP]`` then padding, token types 0/1,
    about 15% of the real tokens replaced by ``[MASK]`` with their ids as ``labels`` (-1 elsewhere),
    ``loss_mask`` on them, ``padding_mask`` 1 on the tokens, ``is_random`` the sentence-order label."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed = n, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + int(i))
        length = int(torch.randint(SEQ // 2, SEQ + 1, (1,), generator=gen))
        first = int(torch.randint(1, length - 3, (1,), generator=gen))  # words in segment a
        words = torch.randint(5, VOCAB, (length,), generator=gen)
        text = torch.full((SEQ,), PAD, dtype=torch.int64)
        text[:length] = words
        text[0], text[first + 1], text[length - 1] = CLS, SEP, SEP
        types = torch.zeros(SEQ, dtype=torch.int64)
        types[first + 2 : length] = 1
        real = (text >= 5) & (torch.arange(SEQ) < length)
        chosen = real & (torch.rand(SEQ, generator=gen) < 0.15)
        chosen[int(real.nonzero()[0])] = True  # at least one prediction per sample
        labels = torch.where(chosen, text, torch.full_like(text, -1))
        text = torch.where(chosen, torch.full_like(text, MASK), text)
        return {
            "text": text,
            "types": types,
            "labels": labels,
            "is_random": torch.randint(0, 2, (), generator=gen),
            "loss_mask": chosen.to(torch.int64),
            "padding_mask": (torch.arange(SEQ) < length).to(torch.int64),
            "truncated": torch.tensor(0),
        }


def tiny_bert_datasets_provider(cfg, tokenizer, num_samples):
    return TinyBertDataset(max(int(num_samples[0]), 1), cfg.training.seed), None, None


def train(extra: list[str], log_json: str, *, data_on_every_stage: bool = True) -> dict:
    """One ``pretrain`` run with ``examples/pretrain_bert.py``'s pieces; the last rank returns the
    per-iteration ``lm loss`` / ``sop loss`` of the ``--log-json`` records it wrote."""
    from mcore.training.bert import bert_flops_per_sample, forward_step, model_provider
    from mcore.training.pretrain import pretrain

    result = pretrain(
        model_provider,
        forward_step,
        tiny_bert_datasets_provider,
        argv=argv(*extra, "--log-json", log_json),
        data_on_every_stage=data_on_every_stage,
        flops_per_sample=bert_flops_per_sample,
    )
    path = pathlib.Path(log_json)
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return {
        "iteration": result.state.iteration,
        "lm": [r["lm loss"] for r in records if r["kind"] == "train"],
        "sop": [r.get("sop loss") for r in records if r["kind"] == "train"],
        "flops": [r["tflops_per_device"] for r in records if r["kind"] == "train"],
    }
