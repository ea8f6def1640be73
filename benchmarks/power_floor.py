"""The compute floor of one GPT training step under the device's power limit (NVIDIA, NVML).

A power-limited GPU runs a step in ``time >= energy / power limit``. This benchmark measures the
energy of the work every bf16 implementation of the step must do, whatever its framework: the
matmuls (forward, data gradient, weight gradient of every linear layer and of the output layer) and
causal attention forward and backward. Each workload runs back to back for a few seconds, so the
device sits at its power limit as it does in training, and the NVML energy counter gives joules per
step. A third workload, one copy of the bytes a bf16-state AdamW step must move, prices the optimizer.

Workloads (``L`` layers, ``T = mbs * seq`` tokens, hidden ``h``, FFN ``f``, vocabulary ``V``):

* ``gemms``: per layer, ``linear(x, W) + b`` forward for QKV ``[T, h] x [h, 3h]``, the projection
  ``[T, h] x [h, h]``, fc1 ``[T, h] x [h, f]`` and fc2 ``[T, f] x [f, h]``; in backward ``dY W`` and
  ``main_grad += dY^T X`` (bf16 ``main_grad``) for each; the output layer ``[T, h] x [h, V]`` forward,
  data and weight gradient. ``2 * 3 * T * (L * h * (3h + h + 2f) + h * V)`` FLOPs.
* ``attention``: ``scaled_dot_product_attention(q, k, v, is_causal=True)`` forward for every layer,
  then every backward (torch's default backend: cuDNN or flash on H100).
* ``gemms+attention``: both, interleaved in layer order as a step runs them.
* ``adam traffic``: a device copy moving ``14 * parameters`` bytes, what AdamW with bf16 parameters,
  gradients and moments reads and writes at the least (mcore's precision-aware state moves 18).

Reuse of one activation tensor per shape across layers lets part of it stay in L2, which can only
make the floor lower than the real step's. One more ``gemms+attention`` step timed right after two
idle seconds (the device cool, below its power limit) shows what the limit costs.

    python benchmarks/power_floor.py            # 24L h2048 s2048 mbs4 V50304, the issue's config
    python benchmarks/power_floor.py --num-layers 12 --hidden-size 768 --seq-length 1024 --micro-batch-size 16

One JSON line goes to stdout: milliseconds, joules and watts per step for each workload, the power
limit, the idle power, and the step time a given MFU needs (Megatron's formula, 989 TFLOP/s).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F


def _energy_counter():
    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
    return pynvml, handle


class StepWork:
    """The matmul and attention work of one training step, on preallocated tensors."""

    def __init__(self, layers: int, tokens: int, hidden: int, ffn: int, vocab: int, mbs: int, heads: int):
        dt, dev = torch.bfloat16, "cuda"
        self.layers = layers
        # (in, out) of the layer's four linears, in forward order
        self.shapes = {
            "qkv": (hidden, 3 * hidden),
            "proj": (hidden, hidden),
            "fc1": (hidden, ffn),
            "fc2": (ffn, hidden),
        }

        def randn(*shape, scale=1.0):
            return torch.randn(*shape, device=dev, dtype=dt) * scale

        self.x = {n: randn(tokens, i) for n, (i, o) in self.shapes.items()}
        self.dy = {n: randn(tokens, o, scale=1e-3) for n, (i, o) in self.shapes.items()}
        self.bias = {n: randn(o, scale=0.02) for n, (i, o) in self.shapes.items()}
        self.weight = {
            n: [randn(o, i, scale=0.02) for _ in range(layers)] for n, (i, o) in self.shapes.items()
        }
        self.main_grad = {
            n: [torch.zeros(o, i, device=dev, dtype=dt) for _ in range(layers)]
            for n, (i, o) in self.shapes.items()
        }
        self.embedding = randn(vocab, hidden, scale=0.02)
        self.embedding_grad = torch.zeros_like(self.embedding)
        self.final_hidden = randn(tokens, hidden)
        self.dlogits = randn(tokens, vocab, scale=1e-4)
        seq = tokens // mbs
        self.qkv = [randn(mbs, heads, seq, hidden // heads).requires_grad_() for _ in range(3)]
        self.dout = randn(mbs, heads, seq, hidden // heads)
        self.flops = 2 * 3 * tokens * (layers * sum(i * o for i, o in self.shapes.values()) + hidden * vocab)

    def forward_layer(self, layer: int) -> None:
        for name in self.shapes:
            F.linear(self.x[name], self.weight[name][layer], self.bias[name])

    def backward_layer(self, layer: int) -> None:
        for name in reversed(self.shapes):
            self.dy[name] @ self.weight[name][layer]
            self.main_grad[name][layer].addmm_(self.dy[name].t(), self.x[name])

    def output_layer(self) -> None:
        self.final_hidden @ self.embedding.t()
        self.dlogits @ self.embedding
        self.embedding_grad.addmm_(self.dlogits.t(), self.final_hidden)

    def attention_forward(self) -> torch.Tensor:
        return F.scaled_dot_product_attention(*self.qkv, is_causal=True)

    def attention_backward(self, out: torch.Tensor) -> None:
        torch.autograd.grad(out, self.qkv, self.dout)

    def gemms(self) -> None:
        for layer in range(self.layers):
            self.forward_layer(layer)
        self.output_layer()
        for layer in reversed(range(self.layers)):
            self.backward_layer(layer)

    def attention(self) -> None:
        outs = [self.attention_forward() for _ in range(self.layers)]
        for out in reversed(outs):
            self.attention_backward(out)

    def gemms_and_attention(self) -> None:
        outs = []
        for layer in range(self.layers):
            self.forward_layer(layer)
            outs.append(self.attention_forward())
        self.output_layer()
        for layer in reversed(range(self.layers)):
            self.backward_layer(layer)
            self.attention_backward(outs[layer])


def sustained(fn: Callable[[], None], energy_mj: Callable[[], int], seconds: float) -> dict:
    """Run ``fn`` back to back for ``seconds``: milliseconds, joules and watts per call."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    e0, t0, calls = energy_mj(), time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        fn()
        calls += 1
        if calls % 4 == 0:  # keep the host a few calls ahead, no further
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    wall, joules = time.perf_counter() - t0, (energy_mj() - e0) / 1e3
    return {"ms": wall / calls * 1e3, "joules": joules / calls, "watts": joules / wall}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-layers", type=int, default=24)
    p.add_argument("--hidden-size", type=int, default=2048)
    p.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 * hidden")
    p.add_argument("--num-attention-heads", type=int, default=16)
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=50304, help="padded")
    p.add_argument("--seconds", type=float, default=4.0, help="per sustained workload")
    p.add_argument("--peak-tflops", type=float, default=989.0)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("power_floor.py needs an NVIDIA device (NVML's energy counter)")
    nvml, handle = _energy_counter()

    def energy_mj() -> int:
        return nvml.nvmlDeviceGetTotalEnergyConsumption(handle)

    L, h, s, b, V = a.num_layers, a.hidden_size, a.seq_length, a.micro_batch_size, a.vocab_size
    work = StepWork(L, b * s, h, a.ffn_hidden_size or 4 * h, V, b, a.num_attention_heads)
    params = L * (12 * h * h + 13 * h) + (V + s) * h  # the classic GPT's, embeddings tied
    adam_bytes = 14 * params
    src = torch.empty(adam_bytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)

    time.sleep(2)
    e0 = energy_mj()
    time.sleep(2)
    result = {
        "device": torch.cuda.get_device_name(),
        "power_limit_w": nvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1e3,
        "idle_w": (energy_mj() - e0) / 2e3,
    }
    for name, fn in (
        ("gemms", work.gemms),
        ("attention", work.attention),
        ("gemms+attention", work.gemms_and_attention),
        ("adam traffic", lambda: dst.copy_(src)),  # reads and writes adam_bytes / 2 each
    ):
        result[name] = sustained(fn, energy_mj, a.seconds)
    result["gemms"]["tflops"] = work.flops / result["gemms"]["ms"] * 1e-9
    result["adam traffic"]["bytes"] = adam_bytes
    time.sleep(2)  # cool down below the limit, then one step
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    work.gemms_and_attention()
    end.record()
    torch.cuda.synchronize()
    result["gemms+attention after idle ms"] = start.elapsed_time(end)
    model_flops = 72 * b * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))
    result["step ms at"] = {
        f"{m}% MFU": model_flops / (m / 100 * a.peak_tflops * 1e12) * 1e3 for m in (57, 60)
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
