"""Multi-latent attention against standard attention of the same FLOPs: one layer's forward and backward.

Issue 42's target: MLA's attention within 1.3x the time of standard attention with the same FLOPs. Both
layers run through mcore's modules on the selected backend (bf16 parameters by default): MLA
(:class:`mcore.models.transformer.mla.attention.MLASelfAttention`, DeepSeek-V2-Lite's shape by default:
hidden 2048, 16 heads, no q_lora_rank, kv_lora_rank 512, dims 128 + 64 / 128) and a standard
:class:`~mcore.models.transformer.attention.SelfAttention` whose head dim and head count give the same
forward FLOPs (projections and scores, counted as :mod:`mcore.training.flops` does). One JSON line:
milliseconds per forward+backward of each, their TFLOP/s, and ``time_ratio_per_flop`` (MLA's time per
FLOP over the standard layer's; the target is <= 1.3)::

    python benchmarks/mla_attention.py --device-backend cuda --seq-length 4096 --micro-batch-size 2
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from mcore.models.transformer.attention import SelfAttention
from mcore.models.transformer.build_context import BuildContext
from mcore.models.transformer.mla.attention import MLASelfAttention, rotary_embedding_for
from mcore.models.transformer.model_config import ModelConfig
from mcore.plugins.manager import select_backend


def mla_flops(cfg: ModelConfig, s: int) -> float:
    h, n, dq, dv, c = (
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.q_head_dim,
        cfg.v_head_dim,
        cfg.kv_lora_rank,
    )
    q = h * n * dq if cfg.q_lora_rank is None else h * cfg.q_lora_rank + cfg.q_lora_rank * n * dq
    per_token = (
        q
        + h * (c + cfg.qk_pos_emb_head_dim)
        + c * n * (cfg.qk_head_dim + dv)
        + n * dv * h
        + s * n * (dq + dv)
    )
    return 6.0 * s * per_token


def standard_flops(cfg: ModelConfig, s: int) -> float:
    h, n, d = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_channels
    return 6.0 * s * (4 * n * d * h + 2 * s * n * d)


def time_layer(layer, x, freqs, iters: int, warmup: int, sync) -> float:
    for i in range(warmup + iters):
        if i == warmup:
            sync()
            start = time.perf_counter()
        out, _ = layer(x, None, freqs)
        out.float().square().mean().backward()
    sync()
    return (time.perf_counter() - start) / iters


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device-backend", default="cpu")
    p.add_argument("--seq-length", type=int, default=4096)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=2048)
    p.add_argument("--num-attention-heads", type=int, default=16)
    p.add_argument("--q-lora-rank", type=int, default=None)
    p.add_argument("--kv-lora-rank", type=int, default=512)
    p.add_argument("--qk-head-dim", type=int, default=128)
    p.add_argument("--qk-pos-emb-head-dim", type=int, default=64)
    p.add_argument("--v-head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    a = p.parse_args(argv)
    backend = select_backend(a.device_backend)
    device = backend.device(0)
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    s, b, h, n = a.seq_length, a.micro_batch_size, a.hidden_size, a.num_attention_heads
    common = dict(num_layers=1, hidden_size=h, num_attention_heads=n, seq_length=s, position_embedding_type="rope",
                  normalization="RMSNorm", disable_bias_linear=True, attention_dropout=0.0, hidden_dropout=0.0)  # fmt: skip
    mla_cfg = ModelConfig(**common, multi_latent_attention=True, q_lora_rank=a.q_lora_rank, kv_lora_rank=a.kv_lora_rank,
                          qk_head_dim=a.qk_head_dim, qk_pos_emb_head_dim=a.qk_pos_emb_head_dim, v_head_dim=a.v_head_dim,
                          rope_type="rope")  # fmt: skip
    target = mla_flops(mla_cfg, s)
    # the standard layer's head dim (even, n heads) whose FLOPs come closest to MLA's
    d = min(
        range(8, 1025, 8), key=lambda d: abs(standard_flops(ModelConfig(**common, kv_channels=d), s) - target)
    )
    std_cfg = ModelConfig(**common, kv_channels=d)
    ctx = BuildContext(params_dtype=dtype, device=device)
    results = {}
    for name, cfg, cls, flops in (("mla", mla_cfg, MLASelfAttention, target),
                                  ("standard", std_cfg, SelfAttention, standard_flops(std_cfg, s))):  # fmt: skip
        layer = cls(cfg, ctx).train()
        with torch.no_grad():
            for param in layer.parameters():
                param.normal_(0.0, 0.02) if param.dim() > 1 else param.fill_(1.0)
        x = torch.randn(s, b, h, device=device, dtype=dtype, requires_grad=True)
        freqs = rotary_embedding_for(cfg).to(device)(s, device=device)
        seconds = time_layer(layer, x, freqs, a.iters, a.warmup, backend.synchronize)
        results[name] = {"ms": 1e3 * seconds, "tflops": b * flops / seconds / 1e12, "flops": b * flops}
        del layer, x
    results["standard"]["kv_channels"] = d
    results["time_ratio_per_flop"] = (results["mla"]["ms"] / results["mla"]["flops"]) / (
        results["standard"]["ms"] / results["standard"]["flops"]
    )
    print(json.dumps({"backend": a.device_backend, "seq": s, "mbs": b, "dtype": a.dtype, **results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
