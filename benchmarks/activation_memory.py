"""Activation memory of one GPT forward/backward with each selective-recompute setting.

For every ``--modules`` setting (``none``, or comma-joined ``--recompute-modules`` names; a ``+ce``
suffix adds ``--cross-entropy-loss-fusion``, e.g. ``layernorm,mlp_act+ce``) it builds
the GPT model (bf16 parameters by default, the backend's op table), runs forward + backward on
random tokens and reports, as one JSON line each and a table at the end:

* ``kept_gib``: the activation bytes autograd keeps for backward at the end of the forward
  (:class:`mcore.testing.memory.SavedActivations`, parameters excluded, discarded storages at 0);
* ``layer_units``: the same for one transformer layer (the middle one: the storages first saved
  during its forward), in units of ``s*b*h`` elements of the parameter dtype, the unit of the
  activation-memory accounting of Korthikanti et al. (LN input and output, QKV, ...);
* ``fwd_gib``: memory allocated after the forward minus before (activations, logits, loss);
* ``peak_gib``: the peak allocation of forward + backward above the memory before the forward;
* ``step_ms``: forward + backward time (mean of ``--iters`` after one warm-up).

No optimizer is built: the peak is that of the activations and gradients. The real training step's
peak (with optimizer state) comes from ``train_throughput.py`` with the same model flags plus
``--recompute-granularity selective --recompute-modules ...``::

    python benchmarks/activation_memory.py --device-backend cuda --num-layers 24 --hidden-size 2048 \
        --num-attention-heads 16 --seq-length 2048 --micro-batch-size 4 \
        --modules none layernorm mlp_act layernorm,mlp_act core_attn,layernorm,mlp_act
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time

import torch

from mcore.distributed.groups import ProcessGroups
from mcore.models.gpt.gpt_model import GPTModel
from mcore.models.transformer.model_config import ModelConfig, padded_vocab_size
from mcore.plugins.manager import select_backend
from mcore.testing.memory import SavedActivations

GIB = 2**30


def measure(args, spec: str, backend) -> dict:
    spec, _, extra = spec.partition("+")
    modules = None if spec == "none" else tuple(spec.split(","))
    recompute = {} if modules is None else dict(recompute_granularity="selective", recompute_modules=modules)
    cfg = ModelConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        seq_length=args.seq_length,
        swiglu=args.swiglu,
        normalization=args.normalization,
        disable_bias_linear=args.disable_bias_linear,
        position_embedding_type=args.position_embedding_type,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        cross_entropy_loss_fusion=extra == "ce",
        **recompute,
        **getattr(args, "model_extra", {}),  # other ModelConfig fields (GQA, MoE: scaling_memory.py)
    )
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    device = backend.device(0)
    vocab = padded_vocab_size(args.vocab_size, cfg.make_vocab_size_divisible_by, 1)
    model = GPTModel(cfg, ProcessGroups.single(), vocab, params_dtype=dtype, device=device)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab_size, (args.micro_batch_size, args.seq_length), generator=gen)
    tokens, labels = tokens.to(device), tokens.roll(-1, dims=1).to(device)
    s, b, h, L = args.seq_length, args.micro_batch_size, args.hidden_size, args.num_layers
    unit = s * b * h * dtype.itemsize
    middle = model.decoder.layers[L // 2]

    def step(saved: SavedActivations | None = None):
        marks = {}
        if saved is not None:
            pre = middle.register_forward_pre_hook(lambda *_: marks.update(start=saved.mark()))
            post = middle.register_forward_hook(lambda *_: marks.update(end=saved.mark()))
        before = backend.memory_stats()["allocated"]
        backend.reset_peak_memory_stats()
        with saved if saved is not None else contextlib.nullcontext():
            loss = model(tokens, labels=labels).float().mean()
        backend.synchronize()
        out = {"fwd_gib": (backend.memory_stats()["allocated"] - before) / GIB}
        if saved is not None:
            pre.remove(), post.remove()
            out["kept_gib"] = saved.nbytes() / GIB
            layer = saved.tensors(marks["start"])[: marks["end"] - marks["start"]]
            out["layer_units"] = sum(n for _, _, n in layer) / unit
            out["layer_tensors"] = [(list(shape), str(dt)[6:], round(n / unit, 3)) for shape, dt, n in layer]
            saved.clear()
        loss.backward()
        backend.synchronize()
        out["peak_gib"] = (backend.memory_stats()["peak_allocated"] - before) / GIB
        model.zero_grad(set_to_none=True)
        return out

    step()  # warm-up (kernel compilation, allocator)
    result = {
        "modules": f"{spec}+{extra}" if extra else spec,
        **step(SavedActivations(model.parameters())),
    }
    backend.synchronize()
    start = time.perf_counter()
    for _ in range(args.iters):
        step()
    backend.synchronize()
    result["step_ms"] = (time.perf_counter() - start) / args.iters * 1000
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device-backend", default="cpu")
    parser.add_argument("--num-layers", type=int, default=24)
    parser.add_argument("--hidden-size", type=int, default=2048)
    parser.add_argument("--num-attention-heads", type=int, default=16)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=50257)
    parser.add_argument("--swiglu", action="store_true")
    parser.add_argument("--disable-bias-linear", action="store_true")
    parser.add_argument("--normalization", default="LayerNorm")
    parser.add_argument("--position-embedding-type", default="learned_absolute")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--modules", nargs="+", default=["none", "layernorm", "mlp_act", "layernorm,mlp_act"])
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    backend = select_backend(args.device_backend)
    results = []
    for spec in args.modules:
        result = measure(args, spec, backend)
        results.append(result)
        print(json.dumps(result), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(result) + "\n")
    base = results[0]
    print(
        f"\n{'modules':<28} {'layer s*b*h':>12} {'saved/layer':>12} {'kept GiB':>9} {'fwd GiB':>8} "
        f"{'peak GiB':>9} {'step ms':>8}"
    )
    for r in results:
        print(
            f"{r['modules']:<28} {r['layer_units']:>12.2f} {base['layer_units'] - r['layer_units']:>12.2f} "
            f"{r['kept_gib']:>9.2f} {r['fwd_gib']:>8.2f} {r['peak_gib']:>9.2f} {r['step_ms']:>8.1f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
