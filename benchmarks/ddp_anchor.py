"""The anchor of the scaling table: torch DDP around the plain GPT (:mod:`plain_reference`).

Each rank trains the plain-PyTorch GPT (bf16 parameters and AdamW state, SDPA, the whole model under
``torch.compile`` unless ``--eager``) wrapped in ``torch.nn.parallel.DistributedDataParallel``
(100 MB buckets, gradients as bucket views), one micro-batch a step, with the loop of
:func:`plain_reference.timed_training`. The last rank prints one JSON line (``peer`` = ``--label``):
tokens/s per device and the step time. It takes the same model flags as ``train_throughput.py``
(the classic GPT's: layers, hidden, heads, sequence, micro-batch, vocabulary; others are ignored)::

    torchrun --nproc_per_node 8 benchmarks/ddp_anchor.py --device-backend cuda --num-layers 24 \\
        --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 --micro-batch-size 4 --vocab-size 50257
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
from plain_reference import PlainGPT, ReferenceShape, timed_training  # benchmarks/, next to this file

from mcore.models.transformer.model_config import padded_vocab_size
from mcore.plugins.manager import select_backend


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device-backend", default="cuda")
    p.add_argument("--num-layers", type=int, required=True)
    p.add_argument("--hidden-size", type=int, required=True)
    p.add_argument("--num-attention-heads", type=int, required=True)
    p.add_argument("--seq-length", type=int, required=True)
    p.add_argument("--micro-batch-size", type=int, required=True)
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--eager", action="store_true", help="no torch.compile (CPU smoke runs)")
    p.add_argument("--label", default="plain+ddp")
    p.add_argument("--out", default=None)
    a, _ = p.parse_known_args(argv)
    backend = select_backend(a.device_backend)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    backend.set_device(local_rank)
    device = backend.device(local_rank)
    dist.init_process_group(backend=backend.dist_backend)
    shape = ReferenceShape(
        layers=a.num_layers,
        hidden=a.hidden_size,
        heads=a.num_attention_heads,
        ffn_hidden=4 * a.hidden_size,
        seq=a.seq_length,
        micro_batch=a.micro_batch_size,
        vocab=padded_vocab_size(a.vocab_size, 128, 1),  # NullTokenizer's +1, padded as mcore's rows
    )

    def make_model():
        model = PlainGPT(shape).to(device, torch.bfloat16)
        ids = [device.index] if device.type != "cpu" and device.index is not None else None
        return torch.nn.parallel.DistributedDataParallel(
            model, device_ids=ids, bucket_cap_mb=100, gradient_as_bucket_view=True
        )

    step_s, mem, loss = timed_training(
        make_model, shape.vocab, shape.micro_batch, shape.seq, backend,
        compile=not a.eager, warmup=a.warmup, iters=a.iters, device=device,
    )  # fmt: skip
    world = dist.get_world_size()
    if dist.get_rank() == world - 1:
        tokens = shape.micro_batch * shape.seq
        line = json.dumps({
            "peer": a.label, "backend": backend.name, "world": world, "dp": world, "step_s": step_s,
            "tokens_per_s": tokens * world / step_s, "tokens_per_s_per_device": tokens / step_s,
            "peak_mem_gib": mem["peak_allocated"] / 2**30, "lm_loss": loss, "compiled": not a.eager,
        })  # fmt: skip
        print(line, flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.write(line + "\n")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
