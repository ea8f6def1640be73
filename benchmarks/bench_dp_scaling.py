"""Data-parallel scaling of GPT-2 small: per-device throughput at DP=N against one device.

Not a test (pytest does not collect it). Launch once per world size, e.g. on a 2-GPU machine::

    torchrun --nproc_per_node 1 benchmarks/bench_dp_scaling.py --device-backend cuda
    torchrun --nproc_per_node 2 benchmarks/bench_dp_scaling.py --device-backend cuda

Each rank trains GPT-2 small (12 layers, hidden 768, 12 heads, seq 1024, vocab 50304, bf16) on random
tokens with a fixed per-device batch (``--micro-batch-size`` x ``--num-microbatches``), so per-device
work is the same at every DP size, for each DDP/optimizer variant in turn. Rank 0 prints one JSON
line per variant: tokens/s per device and milliseconds per step (the mean over ``--steps`` steps run
back to back after ``--warmup`` steps).
Scaling efficiency = (tokens/s per device at DP=N) / (tokens/s at DP=1).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist

from mcore.config.parallel import ParallelConfig
from mcore.distributed.ddp import DDPConfig, DistributedDataParallel
from mcore.distributed.finalize import finalize_model_grads
from mcore.distributed.groups import initialize_parallel
from mcore.models.gpt.gpt_model import GPTModel
from mcore.models.transformer.model_config import ModelConfig
from mcore.optimizer import OptimizerConfig, PrecisionConfig, build_optimizer, format_memory_report
from mcore.plugins.manager import select_backend

VARIANTS = {
    "overlap": dict(overlap=True),
    "overlap-10M": dict(overlap=True, bucket=10_000_000),
    "no-overlap": dict(overlap=False),
    "distopt-overlap": dict(overlap=True, distopt=True, overlap_param_gather=True),
    "distopt-overlap-10M": dict(overlap=True, distopt=True, overlap_param_gather=True, bucket=10_000_000),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device-backend", default="auto")
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--num-microbatches", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    parser.add_argument("--num-layers", type=int, default=12)
    parser.add_argument("--hidden-size", type=int, default=768)
    parser.add_argument("--vocab-size", type=int, default=50304)
    args = parser.parse_args()

    backend = select_backend(args.device_backend)
    groups = initialize_parallel(ParallelConfig(device_backend=backend.name))
    seq, mbs = args.seq_length, args.micro_batch_size
    model_cfg = ModelConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=12,
        seq_length=seq,
        max_position_embeddings=seq,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    vocab = args.vocab_size
    precision = PrecisionConfig(bf16=True)
    for name in args.variants:
        v = VARIANTS[name]
        opt_cfg = OptimizerConfig(
            use_distributed_optimizer=v.get("distopt", False),
            overlap_param_gather=v.get("overlap_param_gather", False),
        )
        ddp_cfg = DDPConfig(overlap_grad_reduce=v["overlap"], ddp_bucket_size=v.get("bucket"))
        ddp_cfg = ddp_cfg.with_training(opt_cfg, precision)
        model = GPTModel(model_cfg, groups, vocab, params_dtype=torch.bfloat16)
        model = DistributedDataParallel(model, ddp_cfg, groups)
        optimizer = build_optimizer(opt_cfg, precision, [model], groups, lr=1e-4)
        device = next(model.parameters()).device
        gen = torch.Generator(device=device).manual_seed(1 + groups.dp_rank)
        losses = []
        for step in range(args.warmup + args.steps):
            if step == args.warmup:  # time the steps back to back: the param all-gather of one step
                backend.synchronize()  # overlaps the next step's forward
                start = time.perf_counter()
            optimizer.zero_grad()
            total = torch.zeros((), device=device)
            for i in range(args.num_microbatches):
                tokens = torch.randint(0, vocab, (mbs, seq + 1), device=device, generator=gen)
                last = i == args.num_microbatches - 1
                model.enable_grad_sync() if last else model.disable_grad_sync()
                loss = model(tokens[:, :-1], labels=tokens[:, 1:]).mean() / args.num_microbatches
                loss.backward()
                total += loss.detach()
            finalize_model_grads([model])
            optimizer.step()
            losses.append(total)
        backend.synchronize()
        step_s = (time.perf_counter() - start) / args.steps
        losses = [x.item() for x in losses]
        tokens_per_step = mbs * seq * args.num_microbatches
        if groups.rank == 0:
            print(
                json.dumps(
                    {
                        "variant": name,
                        "dp": groups.dp_size,
                        "step_ms": round(step_s * 1e3, 2),
                        "tokens_per_s_per_device": round(tokens_per_step / step_s),
                        "buckets": len(model.buckets),
                        "memory": format_memory_report(optimizer.memory_report()),
                        "loss_last": round(losses[-1], 4),
                    }
                ),
                flush=True,
            )
        del model, optimizer
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
