"""``--cross-entropy-loss-fusion``: the cross-entropy that keeps only the logits and writes their
gradient into them (``vocab_parallel_cross_entropy(..., overwrite_logits=True)``).

Checked against ``torch.nn.functional.cross_entropy`` in float64 (losses and logit gradients, with
label smoothing, uneven upstream gradients and several row chunks), at TP=1 and at TP=2 over a
vocabulary split in two processes; the gradient is the logits' own storage; the bytes kept for
backward are the logits' (the default TP path keeps an fp32 softmax, twice as large for bf16); and a
GPT model with the flag has the loss and gradients of the model without it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mcore.config.parallel import ParallelConfig
from mcore.distributed.groups import ProcessGroups, initialize_parallel
from mcore.models.gpt.gpt_model import GPTModel
from mcore.models.transformer.build_context import default_device
from mcore.models.transformer.model_config import ModelConfig
from mcore.ops.reference import loss as reference_loss
from mcore.tensor_parallel import cross_entropy as ce
from mcore.tensor_parallel.mappings import group_rank, group_size
from mcore.testing.distributed import run_distributed
from mcore.testing.memory import SavedActivations

ROWS, BATCH, VOCAB = 6, 3, 40
BOUND = {torch.float32: 2e-6, torch.bfloat16: 1e-2}  # of max |gradient| (bf16: one rounding of it)


def _inputs(dtype):
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(ROWS, BATCH, VOCAB, generator=gen) * 4).to(dtype)
    labels = torch.randint(0, VOCAB, (ROWS, BATCH), generator=gen)
    upstream = torch.rand(ROWS, BATCH, generator=gen)
    return logits, labels, upstream


def _gold(logits, labels, upstream, smoothing):
    x = logits.double().requires_grad_()
    loss = F.cross_entropy(
        x.reshape(-1, VOCAB), labels.reshape(-1), reduction="none", label_smoothing=smoothing
    ).view(labels.shape)
    (loss * upstream.double()).sum().backward()
    return loss.detach(), x.grad


def _fused(local_logits, labels, upstream, smoothing, group=None):
    """Loss, the logits' gradient, whether it was written into the logits' storage, bytes kept."""
    leaf = local_logits.clone().requires_grad_()
    logits = leaf * 1  # the output layer's result in the model: a non-leaf the loss may overwrite
    seen = {}
    logits.register_hook(lambda g: seen.update(in_place=g.data_ptr() == logits.data_ptr()))
    with SavedActivations(exclude=[leaf]) as saved:
        loss = ce.vocab_parallel_cross_entropy(logits, labels, group, smoothing, overwrite_logits=True)
    kept = saved.nbytes()
    saved.clear()
    (loss * upstream).sum().backward()
    return loss.detach(), leaf.grad, seen["in_place"], kept


@pytest.fixture
def small_chunks(monkeypatch):
    # 5 rows a chunk: 4 chunks of 18 rows
    monkeypatch.setattr(reference_loss, "_CE_CHUNK_ELEMENTS", 5 * VOCAB)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matches_torch_and_overwrites_the_logits(small_chunks, dtype, smoothing):
    logits, labels, upstream = _inputs(dtype)
    gold_loss, gold_grad = _gold(logits, labels, upstream, smoothing)
    loss, grad, in_place, kept = _fused(logits, labels, upstream, smoothing)
    assert loss.dtype == torch.float32 and grad.dtype == dtype
    torch.testing.assert_close(loss.double(), gold_loss, rtol=2e-6, atol=2e-6)
    scale = gold_grad.abs().max().item()
    assert (grad.double() - gold_grad).abs().max().item() <= BOUND[dtype] * scale
    assert in_place, "the gradient was not written into the logits' storage"
    # kept: the logits, plus per row logZ (fp32), the local label (int64) and the outside flag (bool)
    assert kept == logits.numel() * logits.element_size() + ROWS * BATCH * (4 + 8 + 1)


def _tp2_case():
    groups = initialize_parallel(ParallelConfig(tensor_model_parallel_size=2))
    group, rank, parts = groups.tp, group_rank(groups.tp), group_size(groups.tp)
    reference_loss._CE_CHUNK_ELEMENTS = 5 * VOCAB // parts
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        for smoothing in (0.0, 0.1):
            logits, labels, upstream = _inputs(dtype)
            gold_loss, gold_grad = _gold(logits, labels, upstream, smoothing)
            local = logits.chunk(parts, dim=-1)[rank].contiguous()
            loss, grad, in_place, kept = _fused(local, labels, upstream, smoothing, group)
            gold_local = gold_grad.chunk(parts, dim=-1)[rank]
            # the default vocab-parallel path, for the bytes it keeps
            leaf = local.clone().requires_grad_()
            with SavedActivations(exclude=[leaf]) as saved:
                ce.vocab_parallel_cross_entropy(leaf * 1, labels, group, smoothing)
            out[(str(dtype), smoothing)] = dict(
                loss=(loss.double() - gold_loss).abs().max().item(),
                grad=(grad.double() - gold_local).abs().max().item() / gold_grad.abs().max().item(),
                in_place=in_place,
                kept=kept,
                logits_bytes=local.numel() * local.element_size(),
                default_kept=saved.nbytes(),
            )
    return out


def test_vocab_parallel_tp2():
    results = run_distributed(_tp2_case, 2, timeout=300)
    for rank, result in enumerate(results):
        for (dtype, smoothing), r in result.items():
            where = f"rank {rank} {dtype} smoothing={smoothing}: {r}"
            assert r["loss"] <= 1e-5, where  # losses of about 5: fp32 rounding
            assert r["grad"] <= (2e-6 if dtype == "torch.float32" else 1e-2), where
            assert r["in_place"], where
            per_row = ROWS * BATCH * (4 + 8 + 1)
            assert r["kept"] == r["logits_bytes"] + per_row, where
            # the default path runs the same two ops (the gradient goes into a copy): it keeps the
            # logits in their dtype and the per-row statistics, not an fp32 softmax
            assert r["default_kept"] == r["logits_bytes"] + per_row, where


def test_gpt_model_with_the_flag_has_the_same_loss_and_gradients():
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16)
    base.update(hidden_dropout=0.0, attention_dropout=0.0, make_vocab_size_divisible_by=32)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 100, (2, 16), generator=gen).to(default_device())
    labels = torch.randint(0, 100, (2, 16), generator=gen).to(default_device())
    results = []
    for fused in (False, True):
        model = GPTModel(
            ModelConfig(**base, cross_entropy_loss_fusion=fused), ProcessGroups.single(), 128, seed=7
        )
        loss = model(tokens, labels=labels)
        (loss * torch.linspace(0.5, 1.5, 32, device=loss.device).view(2, 16)).sum().backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loss0, grads0), (loss1, grads1) = results
    torch.testing.assert_close(loss1, loss0, rtol=1e-6, atol=1e-6)
    for name in grads0:  # fp32: the two losses round differently, by about 1e-7 of the gradient
        error = (grads1[name] - grads0[name]).abs().max() / grads0[name].abs().max()
        assert error <= 1e-5, (name, error.item())
