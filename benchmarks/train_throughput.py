"""Training-step throughput of mcore's GPT: tokens/s, TFLOP/s, MFU, peak memory, per-phase times.

It runs the real training path (GPTModel chunks, mcore's DDP wrapper, the mixed-precision optimizer
with fp32 master weights and the backend's fused Adam, the pipeline schedule) on synthetic tokens, with
any Megatron flags. ``--reference plain`` times the plain-PyTorch model (:mod:`plain_reference`) in the
same process first, so the ratio is trustworthy::

    python benchmarks/train_throughput.py --device-backend cuda --bf16 \
        --num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 \
        --max-position-embeddings 2048 --micro-batch-size 4 --vocab-size 50257
    torchrun --nproc_per_node 2 benchmarks/train_throughput.py ...      # data parallel 2

FLOPs use Megatron's formula, 72*B*s*L*h^2*(1 + s/(6h) + V/(12*L*h)) for the classic GPT (see
mcore.training.flops), against the backend's peak (989 TFLOP/s bf16 for H100/H200) or --peak-tflops.
One JSON line per run goes to stdout (and to --out).

FP8: Megatron's ``--fp8-format hybrid --fp8-recipe tensorwise|delayed|rowwise`` (any ``--fp8-*`` flag)
builds the model with FP8 linears exactly as ``pretrain`` does; the line's ``fp8`` field names the
recipe, and MFU is still counted against the bf16 peak (as Megatron reports it), so FP8 MFU can pass
what bf16 can reach.

Where the time goes (after the timed steps, so they do not disturb the throughput figure):

* ``--phases N``: N more steps with a device synchronisation between the phases of a step
  (``zero_grad``, ``forward_backward`` with the gradient finalisation, ``optimizer`` step, ``logs``:
  the step's on-device averaging of the logged losses); milliseconds per phase go into the JSON line.
* ``--profile-steps N``: N more steps under ``torch.profiler``: device-busy time against wall time
  (the device idles while the host is behind), device time per kernel category (GEMM, attention,
  mcore's Triton kernels, Inductor kernels, the optimizer's multi-tensor kernels, element-wise,
  reductions, copies) and the top kernels go into the JSON line (``profile``) and to stdout;
  ``--profile-out FILE`` also writes the profiler's full tables (device and host time per op),
  ``--profile-trace FILE`` the Chrome trace of the profiled steps.
* with ``--compile-layers``, dynamo's counters (frames compiled, graphs, graph breaks) go into the
  JSON line, to show that compilation engaged.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback

import torch
import torch.distributed as dist
from plain_moe_reference import MoEReferenceShape, time_moe_reference  # benchmarks/, next to this file
from plain_reference import ReferenceShape, time_reference

from mcore.distributed.groups import LaunchEnv, initialize_parallel
from mcore.models.transformer.model_config import padded_vocab_size
from mcore.training.flops import gpt_flops_per_sample
from mcore.training.gpt import forward_step, model_provider
from mcore.training.pretrain import Trainer, build_training, check_run_config, setup_backend
from mcore.training.run_config import parse_run_config
from mcore.utils.async_host import host_floats


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


# --------------------------------------------------------------------------------------------------
# where the time goes

_CATEGORIES = (  # first match wins; matched against the lower-cased kernel name
    ("communication", ("nccl", "hccl")),  # before "gather"/"scatter"/"reduce": a collective is no gather
    ("attention", ("flash", "fmha", "attention", "attn", "sdpa", "cudnn")),
    ("optimizer (multi-tensor)", ("multi_tensor", "fused_adam", "adamw", "_foreach")),
    ("mcore triton", ("_rms_", "_ln_fwd", "_ln_bwd", "_bda_", "_swiglu", "_bias_gelu", "_ce_", "_rotary")),
    ("inductor triton", ("triton_",)),
    ("gemm", ("gemm", "xmma", "cutlass", "nvjet", "cublas", "matmul", "splitk")),
    ("copy / fill", ("copy", "memcpy", "memset", "fill", "zero", "cat")),
    ("embedding / index", ("embedding", "index", "sort", "radix", "scatter", "gather")),
    ("reduction", ("reduce",)),
    ("element-wise", ("elementwise", "pointwise")),
)


_COLLECTIVES = (
    "AllGather",
    "ReduceScatter",
    "AllReduce",
    "Broadcast",
    "SendRecv",
    "AllToAll",
    "Send",
    "Recv",
)


def kernel_category(name: str) -> str:
    low = name.lower()
    for category, keys in _CATEGORIES:
        if any(k in low for k in keys):
            return category
    return "other"


def _busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals (device busy time, overlaps counted once)."""
    busy, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if a > end:
            busy += b - a
            end = b
        elif b > end:
            busy += b - end
            end = b
    return busy


def idle_gaps(kernels: list[tuple[str, float, float]], steps: int, top: int = 10) -> dict:
    """Where the device waits for the host: the idle gaps between kernels.

    Returns idle milliseconds per step in gaps shorter than 20 us (launch latency) and longer, and the
    longer gaps summed by the kernel that ended each one (the host was late to launch it) with the
    kernel before it, largest first: the host code between the two is the one to speed up.
    """
    short_us, long_us, by_pair = 0.0, 0.0, {}
    end, last = None, None
    for name, a, b in sorted(kernels, key=lambda k: k[1]):
        if end is not None and a > end:
            gap = a - end
            if gap < 20.0:
                short_us += gap
            else:
                long_us += gap
                entry = by_pair.setdefault((last[:60], name[:60]), [0, 0.0])
                entry[0] += 1
                entry[1] += gap
        if end is None or b > end:
            end, last = b, name
    per_step = lambda us: round(us / steps / 1000.0, 3)  # noqa: E731
    return {
        "idle_ms_per_step_short_gaps": per_step(short_us),
        "idle_ms_per_step_gaps_over_20us": per_step(long_us),
        "largest": [
            {"before": k[0], "after": k[1], "gaps_per_step": round(n / steps, 2), "ms_per_step": per_step(us)}
            for k, (n, us) in sorted(by_pair.items(), key=lambda kv: -kv[1][1])[:top]
        ],
    }


def summarize_kernels(kernels: list[tuple[str, float, float]], steps: int, wall_s: float, top: int = 15):
    """``kernels``: (name, start_us, end_us) of every device kernel in ``steps`` steps of ``wall_s``."""
    per_name: dict[str, list[float]] = {}
    for name, a, b in kernels:
        entry = per_name.setdefault(name, [0, 0.0])
        entry[0] += 1
        entry[1] += b - a
    total = sum(v[1] for v in per_name.values())
    categories: dict[str, float] = {}
    for name, (_, us) in per_name.items():
        cat = kernel_category(name)
        categories[cat] = categories.get(cat, 0.0) + us
    busy = _busy_us([(a, b) for _, a, b in kernels])
    ms = lambda us: round(us / steps / 1000.0, 3)  # noqa: E731
    collectives: dict[str, float] = {}  # by kind: an all-to-all is NCCL's SendRecv kernel
    for name, (_, us) in per_name.items():
        if kernel_category(name) == "communication":
            kind = next((k for k in _COLLECTIVES if k.lower() in name.lower()), "other")
            collectives[kind] = collectives.get(kind, 0.0) + us
    return {
        "steps": steps,
        "wall_ms_per_step": round(wall_s / steps * 1000.0, 3),
        "device_busy_ms_per_step": ms(busy),
        "device_idle_fraction": round(max(0.0, 1.0 - busy / 1e6 / wall_s), 4) if wall_s > 0 else None,
        "kernel_ms_per_step": ms(total),
        "kernels_per_step": round(sum(v[0] for v in per_name.values()) / steps, 1),
        "categories_ms_per_step": {k: ms(v) for k, v in sorted(categories.items(), key=lambda kv: -kv[1])},
        "collectives_ms_per_step": {k: ms(v) for k, v in sorted(collectives.items(), key=lambda kv: -kv[1])},
        "top_kernels": [
            {
                "name": name[:120],
                "calls_per_step": round(n / steps, 2),
                "ms_per_step": ms(us),
                "category": kernel_category(name),
            }
            for name, (n, us) in sorted(per_name.items(), key=lambda kv: -kv[1][1])[:top]
        ],  # fmt: skip
    }


def profile_steps(
    step, steps: int, backend, out_file: str | None, top: int = 15, trace_file: str | None = None
) -> dict:
    """Run ``step()`` ``steps`` times under torch.profiler; summarize device kernels (see module doc)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if backend.device_type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    step()  # one unprofiled step, so the profile starts with the device in its steady state
    backend.synchronize()
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        backend.synchronize()
        wall = time.perf_counter() - start
    kernels = []
    host_us = 0.0
    for evt in prof.events():
        if str(evt.device_type).endswith("CPU"):
            if evt.cpu_parent is None:  # top-level host ops: the host time the step spends in torch
                host_us += evt.time_range.elapsed_us()
            continue
        kernels.append((evt.name, evt.time_range.start, evt.time_range.end))
    summary = summarize_kernels(kernels, steps, wall, top=top)
    summary["idle_gaps"] = idle_gaps(kernels, steps)
    summary["host_top_level_op_ms_per_step"] = round(host_us / steps / 1000.0, 3)
    if trace_file:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            stem, dot, ext = trace_file.rpartition(".")  # one trace per rank: trace.rank1.json
            trace_file = (
                f"{stem}.rank{dist.get_rank()}.{ext}" if dot else f"{trace_file}.rank{dist.get_rank()}"
            )
        prof.export_chrome_trace(trace_file)
    if out_file:
        averages = prof.key_averages()
        with open(out_file, "w") as f:
            for sort_by in ("self_device_time_total", "self_cuda_time_total", "self_cpu_time_total"):
                try:
                    f.write(f"== sorted by {sort_by} ({steps} steps)\n")
                    f.write(averages.table(sort_by=sort_by, row_limit=40, max_name_column_width=90) + "\n")
                except Exception as err:  # a key this torch version does not know
                    f.write(f"({type(err).__name__}: {err})\n")
    return summary


def phase_times(trainer, data, iters: int, synchronize) -> dict[str, float]:
    """Milliseconds per phase of a training step, with a device synchronisation between phases."""
    names = ("zero_grad", "forward_backward", "optimizer", "logs")
    totals = dict.fromkeys(names, 0.0)
    for _ in range(iters):
        synchronize()
        t0 = time.perf_counter()
        trainer.optimizer.zero_grad()
        synchronize()
        t1 = time.perf_counter()
        logs = trainer._run_schedule(data, forward_only=False)
        synchronize()
        t2 = time.perf_counter()
        trainer.optimizer.step()
        synchronize()
        t3 = time.perf_counter()
        trainer._average_logs(logs)
        synchronize()
        t4 = time.perf_counter()
        for name, (a, b) in zip(names, ((t0, t1), (t1, t2), (t2, t3), (t3, t4))):
            totals[name] += b - a
    return {name: round(v / iters * 1000.0, 3) for name, v in totals.items()}


def dynamo_counters() -> dict:
    """dynamo's counters (frames compiled, unique graphs, graph breaks with reasons)."""
    from torch._dynamo.utils import counters

    out = {k: dict(v) for k, v in counters.items() if k in ("frames", "stats", "graph_break", "recompiles")}
    if "graph_break" in out:
        out["graph_break"] = {k[:160]: n for k, n in list(out["graph_break"].items())[:10]}
    return out


def parse_args(argv=None):
    """``(this script's options, mcore's RunConfig)`` of a command line (Megatron's flags plus ours)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", default=None)
    parser.add_argument("--label", default="mcore")
    parser.add_argument("--vocab-size", type=int, default=50257)
    parser.add_argument("--phases", type=int, default=0, help="steps timed phase by phase (see doc)")
    parser.add_argument("--profile-steps", type=int, default=0, help="steps under torch.profiler")
    parser.add_argument("--profile-out", default=None, help="write the profiler's tables here")
    parser.add_argument("--profile-top", type=int, default=15, help="kernels listed in the profile summary")
    parser.add_argument("--profile-trace", default=None, help="write the profiled steps' Chrome trace here")
    parser.add_argument(
        "--reference",
        choices=("none", "plain", "plain-eager", "plain-moe", "plain-moe-eager"),
        default="none",
        help="first time the plain-PyTorch GPT (plain_reference.py; plain: under torch.compile) at the "
        "same shapes in this process, and report mcore's tokens/s over its (one process, classic GPT); "
        "plain-moe: the plain MoE GPT (plain_moe_reference.py) for a --num-experts run",
    )
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
    return ours, parse_run_config(rest, prog="train_throughput.py")


def main(argv=None) -> int:
    ours, cfg = parse_args(argv)
    backend = setup_backend(cfg)

    world = dist.get_world_size() if dist.is_initialized() else LaunchEnv.from_environ().world_size
    cfg = check_run_config(cfg, backend, world)
    groups = initialize_parallel(cfg.parallel, backend)
    # NullTokenizer's vocabulary is vocab_size + 1 (its EOD); pad as Megatron would.
    vocab = padded_vocab_size(ours.vocab_size, cfg.model.make_vocab_size_divisible_by, groups.tp_size)
    t = cfg.training
    reference = None
    if ours.reference in ("plain", "plain-eager"):
        reference = time_reference(
            reference_shape(cfg, groups.world_size, vocab),
            backend,
            compile=ours.reference == "plain",
            warmup=ours.warmup,
            iters=ours.iters,
        )
        _emit(reference, ours.out)
    elif ours.reference in ("plain-moe", "plain-moe-eager"):
        reference = time_moe_reference(
            reference_moe_shape(cfg, groups.world_size, vocab),
            backend,
            compile=ours.reference == "plain-moe",
            warmup=ours.warmup,
            iters=ours.iters,
        )
        _emit(reference, ours.out)
    # pretrain's building, without its data (the steps get synthetic tokens) and its console lines
    ctx = build_training(
        cfg,
        groups,
        backend,
        model_provider,
        datasets_provider=None,
        vocab_size=ours.vocab_size,
        verbose=False,
    )
    model = ctx.model
    device = backend.device(groups.rank)
    data = synthetic_batches(
        ours.vocab_size, t.micro_batch_size, cfg.model.seq_length, device, groups.dp_rank
    )
    data = [data] * len(model) if len(model) > 1 else data
    needs_data = groups.is_first_stage or groups.is_last_stage
    trainer = Trainer.from_context(ctx, forward_step)

    step_data = data if needs_data else None
    backend.reset_peak_memory_stats()  # not the reference's peak (timed before, in this process)
    for _ in range(ours.warmup):
        trainer.train_step(step_data)
    backend.synchronize()
    # The warm-up's peak: its eager steps (and a device-graph capture) allocate every activation
    # through the allocator; a graph replay in the timed steps does not, so only this peak shows
    # the activations of a graphed run.
    warmup_peak = backend.memory_stats()["peak_allocated"]
    backend.reset_peak_memory_stats()
    if dist.is_initialized():
        dist.barrier()
    start, start_unix = time.perf_counter(), time.time()
    for _ in range(ours.iters):  # no host-device wait inside: the step returns device tensors
        losses, _, grad_norm = trainer.train_step(step_data)
    backend.synchronize()
    step_s = (time.perf_counter() - start) / ours.iters
    timed_unix = [start_unix, time.time()]
    # read after the timing: the last step's loss (averaged over data parallel) and gradient norm
    final_loss = trainer.reduce_logs([losses])[0].get("lm loss")
    final_grad_norm = host_floats([grad_norm])[0]

    flops = gpt_flops_per_sample(cfg.model, vocab) * t.global_batch_size
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
        "peak_mem_with_warmup_gib": max(warmup_peak, mem["peak_allocated"]) / 2**30,
        # Device graphs keep activations in their own pool, which the allocated peak does not see
        # during a replay: compare graph runs by what the allocator holds.
        "reserved_gib": mem["reserved"] / 2**30,
        "peak_reserved_gib": mem.get("peak_reserved", 0) / 2**30,
        "lm_loss": final_loss,
        "grad_norm": final_grad_norm,
        # wall-clock bounds of the timed steps, to line them up with an outside power or energy log
        "timed_unix": timed_unix,
        # --fp8-format/--fp8-recipe (the linears' GEMMs in FP8); MFU stays against the bf16 peak
        "fp8": None if not cfg.fp8.enabled else f"{cfg.fp8.fp8_format}/{cfg.fp8.fp8_recipe}",
    }
    if reference is not None:
        result["of_reference"] = result["tokens_per_s"] / reference["tokens_per_s"]
    if cfg.training.compile_layers:
        try:
            result["dynamo"] = dynamo_counters()
        except Exception:
            traceback.print_exc()
    is_last = groups.rank == groups.last_rank
    if is_last:  # the throughput line first: the analyses below must not be able to lose it
        _emit(result, ours.out)
    extra = {}
    if ours.phases > 0:
        try:
            extra["phases_ms"] = phase_times(trainer, step_data, ours.phases, backend.synchronize)
        except Exception:
            traceback.print_exc()
    if ours.profile_steps > 0:
        try:
            extra["profile"] = profile_steps(
                lambda: trainer.train_step(step_data),
                ours.profile_steps,
                backend,
                ours.profile_out,
                top=ours.profile_top,
                trace_file=ours.profile_trace,
            )
        except Exception:
            traceback.print_exc()
    if is_last and extra:
        _emit({"peer": ours.label, **extra}, ours.out)
    if dist.is_initialized():  # every rank done before the groups go (an exit mid-collective aborts)
        dist.barrier()
        dist.destroy_process_group()
    return 0


def _one_process_one_micro_batch(cfg, world_size: int) -> dict[str, bool]:
    """What both plain references share: one process, one micro-batch a step (True: this run differs)."""
    return {
        "world size": world_size != 1,
        "--micro-batch-size/--global-batch-size": cfg.training.global_batch_size
        != cfg.training.micro_batch_size,
    }


def _refuse_differences(differs: dict[str, bool], reference: str) -> None:
    """Exit naming every flag in ``differs`` that this run sets unlike the ``reference`` (its description)."""
    bad = [name for name, d in differs.items() if d]
    if bad:
        raise SystemExit(f"{reference}; this run differs in {', '.join(bad)}")


def reference_shape(cfg, world_size: int, vocab: int) -> ReferenceShape:
    """The plain reference at this run's sizes; it models one process of the classic GPT only."""
    m = cfg.model
    differs = {
        "--normalization": m.normalization != "LayerNorm",
        "--swiglu": m.swiglu,
        "--position-embedding-type": m.position_embedding_type != "learned_absolute",
        "--group-query-attention": m.group_query_attention,
        "--disable-bias-linear": m.disable_bias_linear,
        "--untie-embeddings-and-output-weights": m.untie_embeddings_and_output_weights,
        **_one_process_one_micro_batch(cfg, world_size),
    }
    _refuse_differences(
        differs,
        "--reference: the plain reference is the classic GPT (LayerNorm, GeLU, learned positions, "
        "biases, tied output layer) on one process with one micro-batch a step",
    )
    return ReferenceShape(
        layers=m.num_layers,
        hidden=m.hidden_size,
        heads=m.num_attention_heads,
        ffn_hidden=m.ffn_hidden_size or 4 * m.hidden_size,
        seq=m.seq_length,
        micro_batch=cfg.training.micro_batch_size,
        vocab=vocab,
    )


def reference_moe_shape(cfg, world_size: int, vocab: int) -> MoEReferenceShape:
    """The plain MoE reference at this run's sizes: RMSNorm, SwiGLU experts, no biases, untied output,
    full multi-head attention, dropless top-k, one process and one micro-batch a step. mcore may use
    RoPE where the reference has no positions (mcore then does a little more work than the reference)."""
    m = cfg.model
    moe = getattr(m, "moe", None)
    differs = {
        "--num-experts": moe is None,
        "--normalization RMSNorm": m.normalization != "RMSNorm",
        "--swiglu": not m.swiglu,
        "--disable-bias-linear": not m.disable_bias_linear,
        "--untie-embeddings-and-output-weights": not m.untie_embeddings_and_output_weights,
        "--group-query-attention": m.group_query_attention,
        **_one_process_one_micro_batch(cfg, world_size),
    }
    if moe is not None:
        differs["--moe-layer-freq (every layer MoE)"] = not all(moe.moe_layers)
        differs["--moe-shared-expert-intermediate-size"] = bool(moe.moe_shared_expert_intermediate_size)
        differs["--moe-expert-capacity-factor (dropless)"] = moe.moe_expert_capacity_factor is not None
    _refuse_differences(
        differs,
        "--reference plain-moe: the plain reference is a dropless top-k MoE GPT (RMSNorm, SwiGLU experts "
        "in every layer, no biases, untied output) on one process",
    )
    return MoEReferenceShape(
        layers=m.num_layers,
        hidden=m.hidden_size,
        heads=m.num_attention_heads,
        experts=moe.num_experts,
        topk=moe.topk,
        expert_ffn=moe.ffn_hidden_size,
        seq=m.seq_length,
        micro_batch=cfg.training.micro_batch_size,
        vocab=vocab,
    )


def _emit(record: dict, out: str | None) -> None:
    """Print one JSON line and append it to ``out``."""
    line = json.dumps(record)
    print(line, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    sys.exit(main())
