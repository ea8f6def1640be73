"""Training-step throughput of mcore's GPT: tokens/s, TFLOP/s, MFU, peak memory, per-phase times.

It runs the real training path (GPTModel chunks, mcore's DDP wrapper, the mixed-precision optimizer
with fp32 master weights and the backend's fused Adam, the pipeline schedule) on synthetic tokens, with
any Megatron flags. Run it in the same device call as the baselines (../shared/bench/peer_bench.py) so
the ratio is trustworthy::

    python benchmarks/train_throughput.py --device-backend cuda --bf16 \
        --num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 \
        --max-position-embeddings 2048 --micro-batch-size 4 --vocab-size 50257
    torchrun --nproc_per_node 2 benchmarks/train_throughput.py ...      # data parallel 2

FLOPs use Megatron's formula, 72*B*s*L*h^2*(1 + s/(6h) + V/(12*L*h)) for the classic GPT (see
mcore.training.flops), against the backend's peak (989 TFLOP/s bf16 for H100/H200) or --peak-tflops.
One JSON line per run goes to stdout (and to --out).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from mcore.distributed.groups import initialize_parallel
from mcore.models.config import padded_vocab_size
from mcore.optimizer import build_optimizer
from mcore.tensor_parallel.random import model_parallel_seed
from mcore.training.configs import parse_run_config
from mcore.training.gpt import forward_step, model_provider
from mcore.training.lr_scheduler import LRScheduler
from mcore.training.microbatches import MicroBatchCalculator
from mcore.training.pretrain import Trainer, _flops_per_sample, build_model, check_run_config, setup_backend


def synthetic_batches(vocab: int, mbs: int, seq: int, device: torch.device, seed: int):
    """An endless iterator of one fixed random micro-batch in mcore's batch contract."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    tokens = torch.randint(0, vocab, (mbs, seq + 1), generator=g)
    batch = {
        "tokens": tokens[:, :-1].contiguous().to(device),
        "labels": tokens[:, 1:].contiguous().to(device),
        "loss_mask": torch.ones(mbs, seq, device=device),
        "position_ids": torch.arange(seq, device=device).unsqueeze(0).expand(mbs, seq).contiguous(),
    }
    while True:
        yield batch


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", default=None)
    parser.add_argument("--label", default="mcore")
    parser.add_argument("--vocab-size", type=int, default=50257)
    ours, rest = parser.parse_known_args(argv)
    rest += [
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        str(ours.vocab_size),
        "--mock-data",
        "--train-iters",
        str(ours.warmup + ours.iters),
        "--lr",
        "1e-4",
        "--hidden-dropout",
        "0",
        "--attention-dropout",
        "0",
    ]
    cfg = parse_run_config(rest, prog="train_throughput.py")
    backend = setup_backend(cfg)
    import torch.distributed as dist

    world = (
        dist.get_world_size() if dist.is_initialized() else int(__import__("os").environ.get("WORLD_SIZE", 1))
    )
    cfg = check_run_config(cfg, backend, world)
    groups = initialize_parallel(cfg.parallel, backend)
    model_parallel_seed(cfg.training.seed, groups.tp_rank, groups.pp_rank)
    # NullTokenizer's vocabulary is vocab_size + 1 (its EOD); pad as Megatron would.
    vocab = padded_vocab_size(ours.vocab_size, cfg.model.make_vocab_size_divisible_by, groups.tp_size)
    t = cfg.training
    model = build_model(cfg, groups, model_provider, vocab)
    optimizer = build_optimizer(cfg.optimizer, cfg.precision, model, groups, lr=1e-4)
    batches = MicroBatchCalculator(
        global_batch_size=t.global_batch_size,
        micro_batch_size=t.micro_batch_size,
        data_parallel_size=groups.dp_size,
    )
    scheduler = LRScheduler.from_config(
        optimizer,
        cfg.scheduler,
        global_batch_size=t.global_batch_size,
        train_iters=t.train_iters,
        train_samples=None,
    )
    device = backend.device(groups.rank)
    data = synthetic_batches(
        ours.vocab_size, t.micro_batch_size, cfg.model.seq_length, device, groups.dp_rank
    )
    data = [data] * len(model) if len(model) > 1 else data
    needs_data = groups.is_first_stage or groups.is_last_stage
    trainer = Trainer(cfg, groups, backend, model, optimizer, scheduler, forward_step, batches)

    for _ in range(ours.warmup):
        trainer.train_step(data if needs_data else None)
    backend.synchronize()
    backend.reset_peak_memory_stats()
    if dist.is_initialized():
        dist.barrier()
    start = time.perf_counter()
    for _ in range(ours.iters):
        trainer.train_step(data if needs_data else None)
    backend.synchronize()
    step_s = (time.perf_counter() - start) / ours.iters

    flops = _flops_per_sample(cfg, vocab) * t.global_batch_size
    peak = backend.peak_flops(cfg.precision.params_dtype)
    mem = backend.memory_stats()
    tokens = t.global_batch_size * cfg.model.seq_length
    result = {
        "peer": ours.label,
        "backend": backend.name,
        "world": groups.world_size,
        "tp": groups.tp_size,
        "pp": groups.pp_size,
        "dp": groups.dp_size,
        "layers": cfg.model.num_layers,
        "hidden": cfg.model.hidden_size,
        "seq": cfg.model.seq_length,
        "mbs": t.micro_batch_size,
        "gbs": t.global_batch_size,
        "vocab": vocab,
        "step_s": step_s,
        "tokens_per_s": tokens / step_s,
        "tokens_per_s_per_device": tokens / step_s / groups.world_size,
        "tflops_per_device": flops / step_s / groups.world_size / 1e12,
        "mfu": (flops / step_s / groups.world_size / peak) if peak else None,
        "peak_mem_gib": mem["peak_allocated"] / 2**30,
    }
    if groups.rank == groups.last_rank:
        print(json.dumps(result), flush=True)
        if ours.out:
            with open(ours.out, "a") as f:
                f.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
