"""Megatron-LM flags that mcore accepts without a field, or refuses with a reason.

Users bring launch scripts written for Megatron-LM. A flag mcore implements is a config field
(see :mod:`mcore.config.fields`). The two tables here cover the rest, so that nothing a script
passes is silently dropped:

* ``IGNORED_MEGATRON_FLAGS``: flags that select an implementation detail mcore decides itself
  (the device backend picks kernels, fusions and the communication library). They are accepted,
  take an optional value, and change nothing.
* ``UNSUPPORTED_MEGATRON_FLAGS``: features mcore does not have; passing one is an error that says so.
* ``LEGACY_MEGATRON_FLAGS``: older spellings still found in launch scripts (Megatron's own deprecated
  flags, Accelerate's and BigCode's). Each is rewritten to its current meaning before parsing, with a
  one-line deprecation note (:func:`mcore.config.cli.rewrite_legacy_flags`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

IGNORED_MEGATRON_FLAGS: dict[str, str] = {
    "--use-mcore-models": "mcore has one model implementation",
    "--use-legacy-models": "mcore has one model implementation",
    "--transformer-impl": "kernels come from the device backend's op table",
    "--use-flash-attn": "the device backend serves flash attention when it has it",
    "--attention-backend": "the device backend picks the attention kernel (flash, fused or unfused)",
    "--no-masked-softmax-fusion": "the device backend decides fusions",
    "--no-bias-gelu-fusion": "the device backend decides fusions",
    "--no-bias-swiglu-fusion": "the device backend decides fusions",
    "--no-bias-dropout-fusion": "the device backend decides fusions",
    "--no-rope-fusion": "the device backend decides fusions",
    "--no-async-tensor-model-parallel-allreduce": "mcore's TP collectives are synchronous",
    "--distributed-backend": "the device backend names its torch.distributed backend",
    "--DDP-impl": "mcore has its own DDP wrapper",
    "--ckpt-format": "mcore writes its own sharded format (see the checkpoint docs)",
    "--use-dist-ckpt": "mcore checkpoints are always sharded",
    "--no-persist-layer-norm": "the device backend decides fusions",
    "--attention-softmax-in-fp32": "mcore always computes the attention softmax in fp32",
    "--log-num-zeros-in-grad": "the number of zeros in the gradients is not counted",
    "--log-memory-to-tensorboard": "the memory tags (mem-allocated-bytes, ...) are always written where the backend reports memory",
    "--log-throughput": "tokens/s (and TFLOP/s/device on accelerators) are always logged",
    "--no-create-attention-mask-in-dataloader": "mcore builds the causal mask inside attention",
    "--ckpt-fully-parallel-save": "every rank always writes its own shards",
    "--ckpt-fully-parallel-load": "every rank always reads only what it needs",
    "--manual-gc": "Python's garbage collector is left on",
    "--wandb-save-dir": "Weights & Biases writes to its default directory",
    "--mmap-bin-files": "memory-mapping .bin files is the default (--no-mmap-bin-files turns it off)",
    # mixture of experts: Transformer Engine / DeepEP kernel and overlap choices (docs/moe.md)
    "--moe-permute-fusion": "the device backend serves moe_permute/moe_unpermute from its op table",
    "--moe-router-fusion": "the device backend serves moe_topk_routing from its op table",
    "--moe-enable-deepep": "DeepEP is a CUDA kernel library; the alltoall dispatcher runs",
    "--moe-flex-dispatcher-backend": "DeepEP/HybridEP are CUDA kernel libraries; the alltoall dispatcher runs",
    "--moe-use-legacy-grouped-gemm": "the experts run the op table's grouped_gemm",
    "--moe-shared-expert-overlap": "the shared experts run after the routed ones (no stream overlap)",
    "--overlap-moe-expert-parallel-comm": "expert-parallel communication is not overlapped",
    "--moe-router-padding-for-fp8": "the experts' grouped GEMM needs no padded token counts",
}

IGNORED_MEGATRON_FLAG_VALUES: dict[str, dict[str, str]] = {
    "--moe-token-dispatcher-type": {
        "flex": "DeepEP/HybridEP are CUDA kernel libraries; the alltoall dispatcher runs",
    },
}
"""Values of implemented flags that select a kernel library mcore does not use: accepted, run as
the reason says, and listed with the ignored flags at start-up."""

UNSUPPORTED_MEGATRON_FLAGS: dict[str, str] = {
    "--fp8-hybrid": "use --fp8-format hybrid",
    "--fp8-e4m3": "use --fp8-format e4m3",
    "--fp8-interval": "deprecated in Megatron-LM and Transformer Engine; FP8 scales update every step",
    "--fp8-dot-product-attention": "FP8 attention needs Transformer Engine's fused attention; mcore runs "
    "attention in bf16 and the linear layers in FP8 (--fp8-format)",
    "--fp8-multi-head-attention": "FP8 attention needs Transformer Engine's fused attention; mcore runs "
    "attention in bf16 and the linear layers in FP8 (--fp8-format)",
    "--tp-comm-overlap": "overlapping TP communication with GEMMs needs Transformer Engine userbuffers",
    "--use-torch-fsdp2": "use --use-distributed-optimizer (ZeRO-1) instead of FSDP",
    "--use-custom-fsdp": "use --use-distributed-optimizer (ZeRO-1) instead of FSDP",
    "--spec": "mcore builds GPT layers from its own specs",
    "--retro-add-retriever": "RETRO is not implemented",
    "--encoder-tensor-model-parallel-size": "T5's encoder and decoder share --tensor-model-parallel-size "
    "(their word embeddings are one tensor)",
    "--use-mup": "muP is not implemented",
    # BERT: Megatron's retrieval (ICT / biencoder) and embedding tools, not pretrain_bert.py
    "--bert-load": "Megatron's ICT / biencoder pretraining (pretrain_ict.py) is not implemented; a BERT "
    "run continues from its own checkpoint with --load",
    "--bert-embedder-type": "biencoder retrieval models (pretrain_ict.py) are not implemented",
    "--output-bert-embeddings": "BERT embedding extraction (tools/bert_embedding) is not implemented",
}


@dataclasses.dataclass(frozen=True)
class LegacyFlag:
    """An old spelling and its current meaning.

    ``takes_value``: the flag consumes the next token (or ``--flag=value``). ``replace(value)`` gives
    the current flags (``value`` is None for a switch); it raises ``ValueError`` for a value with no
    current meaning. ``note`` is the deprecation line printed once.
    """

    takes_value: bool
    replace: Callable[[str | None], list[str]]
    note: str


def _data_impl(value: str | None) -> list[str]:
    if value not in ("mmap", "infer"):
        raise ValueError(
            f"{value!r}: Megatron's lazy/cached formats are gone; mcore reads and writes the mmap "
            "format (convert the data with mcore-preprocess-data)"
        )
    return []


def _attention_head_type(value: str | None) -> list[str]:
    if value == "multihead":
        return []
    if value == "multiquery":
        return ["--group-query-attention", "--num-query-groups", "1"]
    raise ValueError(f"{value!r}: choose multihead or multiquery")


LEGACY_MEGATRON_FLAGS: dict[str, LegacyFlag] = {
    "--recompute-activations": LegacyFlag(
        False,
        lambda _: ["--recompute-granularity", "selective"],
        "--recompute-activations is deprecated: using --recompute-granularity selective",
    ),
    "--checkpoint-activations": LegacyFlag(
        False,
        lambda _: [
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "uniform",
            "--recompute-num-layers",
            "1",
        ],
        "--checkpoint-activations is deprecated: using --recompute-granularity full "
        "--recompute-method uniform --recompute-num-layers 1",
    ),
    "--data-impl": LegacyFlag(
        True, _data_impl, "--data-impl is deprecated: .bin/.idx files are always Megatron's mmap format"
    ),
    "--dataset-impl": LegacyFlag(
        True, _data_impl, "--dataset-impl is deprecated: .bin/.idx files are always Megatron's mmap format"
    ),
    "--use-rotary-position-embeddings": LegacyFlag(
        False,
        lambda _: ["--position-embedding-type", "rope"],
        "--use-rotary-position-embeddings is deprecated: using --position-embedding-type rope",
    ),
    "--no-position-embedding": LegacyFlag(
        False,
        lambda _: ["--position-embedding-type", "none"],
        "--no-position-embedding is deprecated: using --position-embedding-type none",
    ),
    "--no-query-key-layer-scaling": LegacyFlag(
        False,
        lambda _: [],
        "--no-query-key-layer-scaling is deprecated: query-key layer scaling is off (it only matters "
        "for an fp16 softmax; mcore's attention softmax is always fp32)",
    ),
    "--fp16-lm-cross-entropy": LegacyFlag(
        False,
        lambda _: ["--cross-entropy-loss-fusion"],
        "--fp16-lm-cross-entropy is deprecated: using --cross-entropy-loss-fusion (the loss reads the "
        "half-precision logits without an fp32 copy; its sums stay fp32)",
    ),
    "--attention-head-type": LegacyFlag(
        True,
        _attention_head_type,
        "--attention-head-type is deprecated: multiquery is --group-query-attention --num-query-groups 1",
    ),
}
"""Old spellings, rewritten before parsing (only where the parser has no flag of that name)."""

LEGACY_FLAG_VALUES: dict[str, dict[str, str]] = {
    # Accelerate's MegatronLMPlugin and older Megatron scripts name the position types this way.
    "--position-embedding-type": {"rotary": "rope", "absolute": "learned_absolute"},
}
"""Old values of current flags: ``{flag: {old value: current value}}``."""
