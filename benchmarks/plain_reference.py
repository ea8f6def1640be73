"""The plain-PyTorch GPT that mcore's training throughput is measured against, in the same process.

It is what a careful user writes without a framework, and what the CUDA performance targets are
stated against: pre-LayerNorm GPT-2 blocks
(``nn.LayerNorm``; one ``nn.Linear`` for Q, K and V; causal ``scaled_dot_product_attention``; a tanh
GeLU MLP), learned positions, the output layer tied to the token embedding, bf16 parameters and
bf16 AdamW state (torch's fused AdamW), the whole model under ``torch.compile``, the loss over fp32
logits, no gradient clipping and no NaN check. Layout: tokens ``[b, s]``, activations ``[b, s, h]``,
attention heads ``[b, n, s, d]``.

``train_throughput.py --reference plain`` times it before mcore's model is built (same device,
same shapes, same warm-up and timed steps) and reports mcore's tokens/s over its.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class ReferenceShape:
    layers: int
    hidden: int
    heads: int
    ffn_hidden: int
    seq: int
    micro_batch: int
    vocab: int  # padded, as mcore's


class Block(nn.Module):
    def __init__(self, shape: ReferenceShape):
        super().__init__()
        h = shape.hidden
        self.heads = shape.heads
        self.ln1 = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.ln2 = nn.LayerNorm(h)
        self.fc1 = nn.Linear(h, shape.ffn_hidden)
        self.fc2 = nn.Linear(shape.ffn_hidden, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class PlainGPT(nn.Module):
    def __init__(self, shape: ReferenceShape):
        super().__init__()
        self.vocab = shape.vocab
        self.wte = nn.Embedding(shape.vocab, shape.hidden)
        self.wpe = nn.Embedding(shape.seq, shape.hidden)
        self.blocks = nn.ModuleList(Block(shape) for _ in range(shape.layers))
        self.lnf = nn.LayerNorm(shape.hidden)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.lnf(x), self.wte.weight)
        return F.cross_entropy(logits.float().view(-1, self.vocab), labels.view(-1))


def time_reference(shape: ReferenceShape, backend, *, compile: bool, warmup: int, iters: int) -> dict:
    """Train the reference for ``warmup`` then ``iters`` timed steps on one fixed random batch.

    Returns tokens/s, the step time, the memory peaks of the timed steps (``backend.memory_stats``)
    and the last loss. Everything it allocated is freed before it returns.
    """
    step_s, mem, loss = timed_training(
        lambda: PlainGPT(shape), shape.vocab, shape.micro_batch, shape.seq, backend,
        compile=compile, warmup=warmup, iters=iters,
    )  # fmt: skip
    return {
        "peer": "plain+compile" if compile else "plain-eager",
        "step_s": step_s,
        "tokens_per_s": shape.micro_batch * shape.seq / step_s,
        "peak_mem_gib": mem["peak_allocated"] / 2**30,
        "peak_reserved_gib": mem.get("peak_reserved", 0) / 2**30,
        "lm_loss": loss,
    }


def timed_training(
    make_model,
    vocab: int,
    micro_batch: int,
    seq: int,
    backend,
    *,
    compile: bool,
    warmup: int,
    iters: int,
    device: torch.device | None = None,
) -> tuple[float, dict, float]:
    """``(seconds per step, backend.memory_stats() of the timed steps, last loss)`` of a plain model
    (``make_model()`` -> a module ``(tokens, labels) -> loss``) in bf16 with torch's AdamW (fused on a
    device), under ``torch.compile`` if asked, on one fixed random batch; its memory is freed after.
    ``device``: where it trains (default the backend's first device; one rank of several gives its own)."""
    device = device or backend.device(0)
    result = _train(make_model, vocab, micro_batch, seq, backend, device, compile, warmup, iters)
    empty_cache = getattr(torch.get_device_module(device.type), "empty_cache", None)
    if empty_cache is not None:  # the model and optimizer are gone: give their memory back to mcore
        empty_cache()
    return result


def _train(make_model, vocab, micro_batch, seq, backend, device, compile, warmup, iters):
    with torch.random.fork_rng(devices=[]):  # torch's default init; the caller's RNG state stays as it was
        torch.random.default_generator.manual_seed(1234)  # the CPU generator only
        model = make_model().to(device, torch.bfloat16)
    gen = torch.Generator().manual_seed(1234)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type != "cpu")
    forward = torch.compile(model) if compile else model
    data = torch.randint(0, vocab, (micro_batch, seq + 1), generator=gen).to(device)
    tokens, labels = data[:, :-1].contiguous(), data[:, 1:].contiguous()

    def step() -> torch.Tensor:
        loss = forward(tokens, labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    for _ in range(warmup):
        step()
    backend.synchronize()
    backend.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(iters):
        loss = step()
    backend.synchronize()
    return (time.perf_counter() - start) / iters, backend.memory_stats(), float(loss.detach())
