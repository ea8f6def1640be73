"""The configurations of issue 45's scaling table: which runs, with which flags, on how many devices.

Every mcore row is one launch of ``train_throughput.py`` (``torchrun --nproc_per_node <world>``) with
Megatron's flags; every layout is *pure* (one parallel dimension at a time, ``world`` = its size) so a
row's cost is that dimension's alone, and tokens/s per device is compared with the one-device run
of the same model, precision and sequence (``baseline``). The rows:

* ``base``: one device, one micro-batch a step, ``--phases 2`` (the per-micro-batch forward+backward
  time that the pipeline rows' bubble is measured against);
* ``dp``: DP=N with ``--overlap-grad-reduce --use-distributed-optimizer --overlap-param-gather``;
* ``tp``: TP=t with ``--sequence-parallel`` (the column layers' backward all-gather and input-gradient
  reduce-scatter run on a side stream under the GEMMs: mcore's overlap, always on with SP);
* ``pp``: PP=p, 1F1B and interleaved (``--virtual-pipeline-model-parallel-size v``), ``m = k*p``
  micro-batches; the bubble is ``1 - m * t_fb(1 device) / (p * t_fb(PP))`` from the forward+backward
  phase times, against ``(p-1)/(m+p-1)`` and ``(p-1)/(v*m+p-1)``;
* ``cp``: CP=c (p2p ring) for the Llama-3-8B shape at 32k-128k, against torchtitan's per-GPU numbers;
* ``ep``: EP=e (world e, the dense part data parallel) for the OLMoE and Mixtral shapes, profiled
  (``--profile-steps 2``, added by :mod:`scaling_table` on a device backend) for the all-to-all's share
  of the step;
* ``anchor``: torch DDP around the plain compiled GPT (``ddp_anchor.py``) at 1 and N devices.

``small=True`` gives the same table at tiny shapes (2-16 layers, hidden 32, seq 32-256, vocab 128)
for CPU processes with gloo: the plumbing, not the speed.
"""

from __future__ import annotations

import dataclasses

FAMILIES = ("base", "dp", "tp", "pp", "cp", "ep", "anchor")
SIZES = (2, 4, 8)
TORCHTITAN_CP_H100 = {32768: 3890, 65536: 2540, 131072: 1071, 262144: 548}
"""torchtitan's published Llama-3-8B tokens/s per H100 with context parallelism, by sequence."""

DP_FLAGS = ("--overlap-grad-reduce", "--use-distributed-optimizer", "--overlap-param-gather")
PA_FLAGS = (  # the precision-aware optimizer of every measured row (benchmarks/README.md's (*))
    "--use-precision-aware-optimizer", "--main-grads-dtype", "bf16", "--exp-avg-dtype", "bf16",
    "--exp-avg-sq-dtype", "bf16",
)  # fmt: skip
FP8_FLAGS = ("--fp8-format", "hybrid", "--fp8-recipe", "delayed")
FULL_RECOMPUTE = (
    "--recompute-granularity",
    "full",
    "--recompute-method",
    "uniform",
    "--recompute-num-layers",
    "1",
)
LLAMA = (
    "--num-attention-heads", "32", "--group-query-attention", "--num-query-groups", "8",
    "--ffn-hidden-size", "14336", "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type",
    "rope", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
)  # fmt: skip
MOE = (
    "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
    "--position-embedding-type", "rope", "--moe-grouped-gemm", "--moe-token-dispatcher-type", "alltoall",
    "--moe-aux-loss-coeff", "0.01",
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Model:
    """A model shape: its flags without the sequence, layers and micro-batch (those are fields)."""

    key: str
    title: str
    layers: int
    hidden: int
    seq: int
    mbs: int
    vocab: int
    flags: tuple[str, ...]
    warmup_iters: tuple[int, int] = (5, 10)  # full runs; --quick uses (2, 3), or (1, 2) for big ones

    def args(self, seq: int | None = None) -> list[str]:
        s = str(seq or self.seq)
        return [
            "--num-layers", str(self.layers), "--hidden-size", str(self.hidden), "--seq-length", s,
            "--max-position-embeddings", s, "--micro-batch-size", str(self.mbs), "--vocab-size",
            str(self.vocab), *self.flags,
        ]  # fmt: skip


def models(small: bool) -> dict[str, Model]:
    """The four shapes of issue 45 (``small``: the same structure at tiny sizes)."""
    return _small_models() if small else _full_models()


def _full_models() -> dict[str, Model]:
    moe = (*MOE, "--num-attention-heads", "16")
    olmoe = "--num-experts 64 --moe-router-topk 8 --moe-ffn-hidden-size 1024".split()
    mixtral = "--num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 5632".split()
    return {
        "gpt": Model("gpt", "GPT 24L h2048 s2048", 24, 2048, 2048, 4, 50257, ("--num-attention-heads", "16")),
        "llama": Model(
            "llama", "Llama-3-8B shape (32L h4096 GQA8 SwiGLU)", 32, 4096, 8192, 1, 128256,
            (*LLAMA, *FULL_RECOMPUTE), (3, 5),
        ),
        "olmoe": Model("olmoe", "OLMoE-1B-7B shape (16L, 64 experts top-8)", 16, 2048, 4096, 2, 50257, (*moe, *olmoe)),
        "mixtral": Model(
            "mixtral", "Mixtral-shaped small (16L, 8 experts top-2)", 16, 2048, 4096, 2, 50257, (*moe, *mixtral)
        ),
    }  # fmt: skip


def _small_models() -> dict[str, Model]:
    tiny = ("--num-attention-heads", "8")  # TP=8 needs 8 heads (and 8 query groups)
    llama = (
        "--num-attention-heads 16 --group-query-attention --num-query-groups 8 --ffn-hidden-size 128 --swiglu "
        "--normalization RMSNorm --position-embedding-type rope --disable-bias-linear "
        "--untie-embeddings-and-output-weights"
    ).split()
    olmoe = "--num-experts 16 --moe-router-topk 4 --moe-ffn-hidden-size 16".split()
    mixtral = "--num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 32".split()
    return {
        "gpt": Model("gpt", "GPT tiny (16L h32)", 16, 32, 32, 2, 128, tiny, (1, 2)),
        "llama": Model("llama", "Llama tiny (16L h64 GQA8 SwiGLU)", 16, 64, 64, 1, 128, llama, (1, 2)),
        "olmoe": Model("olmoe", "OLMoE tiny (2L 16 experts top-4)", 2, 32, 32, 2, 128, (*MOE, *tiny, *olmoe), (1, 2)),
        "mixtral": Model(
            "mixtral", "Mixtral tiny (2L 8 experts top-2)", 2, 32, 32, 2, 128, (*MOE, *tiny, *mixtral), (1, 2)
        ),
    }  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Run:
    """One row: ``script`` launched on ``world`` processes with ``args``."""

    name: str
    family: str
    model: str
    precision: str
    world: int
    layout: str
    args: tuple[str, ...]
    seq: int
    baseline: str | None = None  # the one-device row it is compared with
    microbatches: int = 1
    theory_bubble: float | None = None
    anchor_tokens_per_gpu: float | None = None  # a published number to compare with
    script: str = "train_throughput.py"
    big: bool = False  # long steps: fewer warm-up and timed steps


@dataclasses.dataclass(frozen=True)
class Skip:
    name: str
    reason: str


def cp_seqs(small: bool) -> tuple[int, ...]:
    return (64, 128, 256) if small else (32768, 65536, 131072)


def _virtual_stages(layers: int, p: int) -> int | None:
    """The smallest v >= 2 that splits ``layers / p`` layers into v equal chunks."""
    per_stage = layers // p
    return next((v for v in range(2, per_stage + 1) if per_stage % v == 0), None)


def table(gpus: int, *, small: bool = False, families=FAMILIES, pp_k: int = 4):
    """``(runs, skips)`` of the table for ``gpus`` devices."""
    ms = models(small)
    runs: list[Run] = []
    skips: list[Skip] = []
    precisions = ("bf16", "fp8")  # the CPU backend emulates FP8 (reference ops): the plumbing runs there too

    def add(run: Run) -> None:
        if run.family not in families:
            return
        if run.world > gpus:
            skips.append(Skip(run.name, f"needs {run.world} devices, {gpus} present"))
        else:
            runs.append(run)

    def base_name(model: str, prec: str, seq: int | None = None) -> str:
        return f"{model}-{prec}-1" + (f"-s{seq}" if seq else "")

    for key in ("gpt", "llama"):
        m = ms[key]
        big = key == "llama" and not small
        for prec in precisions:
            pflags = (*m.args(), *(FP8_FLAGS if prec == "fp8" else ()))
            base = base_name(key, prec)
            add(Run(base, "base", key, prec, 1, "1 device", (*pflags, "--phases", "2"), m.seq, big=big))
            for n in SIZES:
                add(
                    Run(
                        f"{key}-{prec}-dp{n}",
                        "dp",
                        key,
                        prec,
                        n,
                        f"DP={n}",
                        (*pflags, *DP_FLAGS),
                        m.seq,
                        base,
                        big=big,
                    )
                )
                add(Run(
                    f"{key}-{prec}-tp{n}", "tp", key, prec, n, f"TP={n}+SP",
                    (*pflags, "--tensor-model-parallel-size", str(n), "--sequence-parallel"), m.seq, base, big=big,
                ))  # fmt: skip
                mb = pp_k * n
                pp = (
                    *pflags,
                    "--pipeline-model-parallel-size",
                    str(n),
                    "--global-batch-size",
                    str(m.mbs * mb),
                    "--phases",
                    "2",
                )
                add(Run(
                    f"{key}-{prec}-pp{n}", "pp", key, prec, n, f"PP={n} 1F1B m={mb}", pp, m.seq, base, mb,
                    theory_bubble=(n - 1) / (mb + n - 1), big=big,
                ))  # fmt: skip
                v = _virtual_stages(m.layers, n)
                if v is None:
                    skips.append(
                        Skip(f"{key}-{prec}-pp{n}v", f"{m.layers} layers on {n} stages: no v >= 2 chunks")
                    )
                    continue
                add(Run(
                    f"{key}-{prec}-pp{n}v{v}", "pp", key, prec, n, f"PP={n} interleaved v={v} m={mb}",
                    (*pp, "--virtual-pipeline-model-parallel-size", str(v)), m.seq, base, mb,
                    theory_bubble=(n - 1) / (v * mb + n - 1), big=big,
                ))  # fmt: skip
    _add_cp(ms["llama"], small, add, skips, base_name)
    _add_ep(ms, add, base_name)
    add(Run("gpt-bf16-ddp1", "anchor", "gpt", "bf16", 1, "torch DDP x1 (plain)", ms["gpt"].args(), ms["gpt"].seq, script="ddp_anchor.py"))  # fmt: skip
    if gpus > 1:
        add(Run(f"gpt-bf16-ddp{gpus}", "anchor", "gpt", "bf16", gpus, f"torch DDP x{gpus} (plain)", ms["gpt"].args(), ms["gpt"].seq, "gpt-bf16-ddp1", script="ddp_anchor.py"))  # fmt: skip
    if "anchor" in families:
        skips.append(
            Skip("llama-ddp*", "the torch DDP anchor is the classic GPT (plain_reference.py); no plain Llama")
        )
        skips.append(Skip("megatron-core anchor", "megatron-core is not installed on the lent machines"))
    return runs, skips


def _add_cp(m: Model, small: bool, add, skips: list[Skip], base_name) -> None:
    """CP=c (p2p ring) for the Llama shape at each long sequence, bf16, against one device and torchtitan."""
    flags = (*m.args(), "--output-layer-loss-chunks", "8")
    for seq in cp_seqs(small):
        seq_flags = ("--seq-length", str(seq), "--max-position-embeddings", str(seq))
        base = base_name("llama", "bf16", seq)
        if seq > 65536 and not small:  # 64k held 104 GiB on one H200 (benchmarks/README.md)
            skips.append(
                Skip(
                    base,
                    f"seq {seq} does not fit one H200 (64k held 104.2 GiB); compared with torchtitan only",
                )
            )
            base = None
        else:
            add(Run(base, "cp", "llama", "bf16", 1, f"1 device s={seq}", (*flags, *seq_flags), seq, big=True))
        anchor = None if small else TORCHTITAN_CP_H100[seq]
        for c in SIZES:
            add(Run(
                f"llama-bf16-cp{c}-s{seq}", "cp", "llama", "bf16", c, f"CP={c} p2p s={seq}",
                (*flags, *seq_flags, "--context-parallel-size", str(c), "--cp-comm-type", "p2p"),
                seq, base, anchor_tokens_per_gpu=anchor, big=True,
            ))  # fmt: skip


def _add_ep(ms: dict[str, Model], add, base_name) -> None:
    """EP=e for the two MoE shapes, world e (the dense part data parallel), profiled for the all-to-all."""
    for key in ("olmoe", "mixtral"):
        m = ms[key]
        base = base_name(key, "bf16")
        add(Run(base, "ep", key, "bf16", 1, "1 device", m.args(), m.seq))
        for e in SIZES:
            add(Run(
                f"{key}-bf16-ep{e}", "ep", key, "bf16", e, f"EP={e} (DP={e} dense)",
                (*m.args(), *DP_FLAGS, "--expert-model-parallel-size", str(e)), m.seq, base,
            ))  # fmt: skip
