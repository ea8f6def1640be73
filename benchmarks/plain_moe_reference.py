"""The plain-PyTorch mixture-of-experts GPT that mcore's MoE throughput is measured against, in the same process.

This is the project's reference ``../shared/bench/moe_plain_bench.py`` as a module (same model, same
FLOP count): pre-RMSNorm blocks with one bias-free ``nn.Linear`` for Q, K and V, causal
``scaled_dot_product_attention``, no position embedding, and a dropless top-k MoE in place of the
MLP: an fp32 softmax router, top-k renormalised, tokens sorted by expert, SwiGLU experts on
``torch._grouped_mm`` (stored ``[E, out, in]`` like torchtitan), the weighted outputs summed back with
``index_add_``, the Switch aux loss (coefficient 0.01). Untied output layer, loss over fp32 logits,
bf16 parameters with torch's fused AdamW, the whole model under ``torch.compile``.

Layout: tokens ``[b, s]``, activations ``[b, s, h]``, heads ``[b, n, s, d]``, routed rows ``[T*k, h]``.

FLOPs (what the shared bench reports): ``T * (6 * N_active + 12 * L * s * h)`` with
``N_active = L * (4h^2 + k * 3 * h * F + h * E) + h * V``. ``train_throughput.py --reference plain-moe``
times it before mcore's model is built and reports mcore's tokens/s over its.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from plain_reference import timed_training  # benchmarks/, next to this file


@dataclass(frozen=True)
class MoEReferenceShape:
    layers: int
    hidden: int
    heads: int
    experts: int
    topk: int
    expert_ffn: int
    seq: int
    micro_batch: int
    vocab: int

    @property
    def active_params(self) -> int:
        h, L = self.hidden, self.layers
        return L * (4 * h * h + self.topk * 3 * h * self.expert_ffn + h * self.experts) + h * self.vocab

    def flops_per_step(self) -> float:
        tokens = self.micro_batch * self.seq
        return tokens * (6 * self.active_params + 12 * self.layers * self.seq * self.hidden)


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``x [T, K]`` sorted by expert, ``weight [E, N, K]``, ``offsets [E]`` cumulative row ends -> ``[T, N]``."""
    if x.device.type != "cpu":
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
    outs, start = [], 0
    for e, end in enumerate(offsets.tolist()):
        outs.append(x[start:end] @ weight[e].t())
        start = end
    return torch.cat(outs)


class PlainMoE(nn.Module):
    def __init__(self, shape: MoEReferenceShape):
        super().__init__()
        h, f, e = shape.hidden, shape.expert_ffn, shape.experts
        self.topk, self.experts = shape.topk, e
        self.router = nn.Linear(h, e, bias=False)
        self.w13 = nn.Parameter(torch.randn(e, 2 * f, h) * 0.02)
        self.w2 = nn.Parameter(torch.randn(e, h, f) * 0.02)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = self.router(x).float().softmax(-1)
        top_p, top_i = probs.topk(self.topk, -1)
        top_p = top_p / top_p.sum(-1, keepdim=True)
        flat = top_i.reshape(-1)
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.experts)
        offsets = counts.cumsum(0).to(torch.int32)
        token = order // self.topk
        gate, up = grouped_mm(x[token], self.w13, offsets).chunk(2, -1)
        y = grouped_mm(F.silu(gate) * up, self.w2, offsets)
        y = y * top_p.reshape(-1)[order].unsqueeze(-1).to(y.dtype)
        out = torch.zeros_like(x).index_add_(0, token, y)
        aux = self.experts * ((counts.float() / flat.numel()) * probs.mean(0)).sum()
        return out.reshape(shape), aux


class Block(nn.Module):
    def __init__(self, shape: MoEReferenceShape):
        super().__init__()
        h = shape.hidden
        self.heads = shape.heads
        self.norm1, self.norm2 = nn.RMSNorm(h), nn.RMSNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h, bias=False), nn.Linear(h, h, bias=False)
        self.moe = PlainMoE(shape)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, h))
        m, aux = self.moe(self.norm2(x))
        return x + m, aux


class PlainMoEGPT(nn.Module):
    def __init__(self, shape: MoEReferenceShape):
        super().__init__()
        self.vocab = shape.vocab
        self.embedding = nn.Embedding(shape.vocab, shape.hidden)
        self.blocks = nn.ModuleList(Block(shape) for _ in range(shape.layers))
        self.norm = nn.RMSNorm(shape.hidden)
        self.output = nn.Linear(shape.hidden, shape.vocab, bias=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        aux = x.new_zeros((), dtype=torch.float32)
        for block in self.blocks:
            x, layer_aux = block(x)
            aux = aux + layer_aux
        logits = self.output(self.norm(x)).float()
        return F.cross_entropy(logits.view(-1, self.vocab), labels.view(-1)) + 0.01 * aux


def time_moe_reference(shape: MoEReferenceShape, backend, *, compile: bool, warmup: int, iters: int) -> dict:
    """Train the reference for ``warmup`` then ``iters`` timed steps on one fixed random batch
    (:func:`plain_reference.timed_training`); tokens/s, step time, the timed steps' memory peak and the
    active-parameter TFLOP/s."""
    step_s, mem, loss = timed_training(
        lambda: PlainMoEGPT(shape), shape.vocab, shape.micro_batch, shape.seq, backend,
        compile=compile, warmup=warmup, iters=iters,
    )  # fmt: skip
    return {
        "peer": "plain-moe+compile" if compile else "plain-moe-eager",
        "step_s": step_s,
        "tokens_per_s": shape.micro_batch * shape.seq / step_s,
        "tflops_per_s": shape.flops_per_step() / step_s / 1e12,
        "peak_mem_gib": mem["peak_allocated"] / 2**30,
        "lm_loss": loss,
    }
