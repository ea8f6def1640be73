"""Every op of the table is called by training: a tracing plugin wraps every op (``registry.wrap``)
and two short ``pretrain`` runs on CPU processes, which between them take the code paths the flags
select, must call each op at least once (a vendor's kernel for an op is never silently unused)."""

from __future__ import annotations

from mcore.ops.registry import OP_NAMES
from mcore.plugins.manager import plugin_manager, register_plugin
from mcore.testing.conformance import TRAINING_ARGV, training_rank
from mcore.testing.distributed import run_distributed
from mcore.testing.op_trace import OpCallRecorder


def traced_training(argv: list[str]) -> list[str]:
    """A rank: register a recorder wrapping every op (a tracing plugin), train, name the ops called."""
    recorder = OpCallRecorder()
    register_plugin(plugin_manager(), recorder, "op-recorder")
    training_rank(argv)
    return sorted(recorder.calls)


LLAMA_TP2 = [*TRAINING_ARGV, "--tensor-model-parallel-size", "2", "--sequence-parallel", "--bf16"]
"""RMSNorm, RoPE, SwiGLU, GQA; the vocab-parallel loss; AdamW over flat buffers (adam_step_flat);
with FP8_FLAGS, the FP8 linears."""

GPT2_FP16 = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "32",
    "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2",
    "--lr", "1e-3", "--lr-warmup-iters", "0", "--seed", "7",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
    "--num-workers", "0", "--eval-iters", "0", "--log-interval", "1000",
    "--fp16", "--initial-loss-scale", "128",
]  # fmt: skip
"""LayerNorm, learned positions, bias-GeLU, dropout 0.1 (bias-dropout-add); the TP=1 loss op;
fp16 with a loss scaler: the per-parameter Adam step (adam_step)."""


FP8_FLAGS = ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--add-qkv-bias"]
"""The FP8 linears (the CPU backend emulates FP8): the amax, the per-tensor cast(-transpose), the
three GEMMs; the QKV bias's gradient from its output gradient's cast (fp8_cast_dbias)."""

FP8_ROWWISE_FLAGS = ["--fp8-format", "e4m3", "--fp8-recipe", "rowwise"]
"""The row-scaled FP8 linears: the row-scaled quantize."""

FP8_DELAYED_FLAGS = ["--fp8-format", "hybrid", "--fp8-recipe", "delayed"]
"""The delayed recipe without sequence parallelism: the fused FP8 producers (norm_fp8_forward,
norm_backward, act_fp8_forward/backward; the QKV output gradient cast from the attention's dq, dk,
dv with GPT-2's QKV bias, fp8_cast_packed)."""

GPT2_BF16_FP8_PARAM_GATHER = [
    *GPT2_FP16[: GPT2_FP16.index("--fp16")], "--bf16", "--use-distributed-optimizer", "--fp8-param-gather",
]  # fmt: skip
"""GPT-2 in bf16 with the distributed optimizer and ``--fp8-param-gather``: with the delayed recipe the
flat optimizer step writes the FP8 weights (adam_step_flat_fp8); with tensorwise at DP=2 they are
quantized after the step (fp8_quantize_flat) and the gathered ones dequantized (fp8_dequantize_flat)."""

CP2_RING = ["--context-parallel-size", "2", "--cp-comm-type", "p2p", "--attention-dropout", "0"]
"""Context parallelism over 2 ranks with the ring: attention_with_lse, its backward, attention_merge."""


MOE_OPS_BEFORE_THE_LAYER = {
    "moe_topk_routing",
    "moe_permute",
    "moe_unpermute",
    "grouped_gemm",
    "weighted_swiglu",
}
"""The MoE ops, in the table before the MoE layer that calls them is merged (wave 3: moe-layer adds a
``--num-experts`` run here and removes this set); tests/ops/test_moe_*.py and the conformance suite
check them meanwhile."""


MOE_FP8_OPS = {"scaled_grouped_gemm", "scaled_grouped_gemm_wgrad"}
"""The experts' FP8 GEMMs: an MoE model trained with ``--fp8-format`` calls them, traced by the same
recorder in tests/moe/test_moe_fp8.py (no MoE run here, to keep this launch's cost)."""


def test_training_calls_every_op_of_the_table():
    llama = run_distributed(
        traced_training, 2, [*LLAMA_TP2, *FP8_FLAGS, "--device-backend", "cpu"], timeout=300
    )
    gpt2 = run_distributed(
        traced_training, 1, [*GPT2_FP16, *FP8_ROWWISE_FLAGS, "--device-backend", "cpu"], timeout=300
    )
    delayed = run_distributed(
        traced_training,
        2,
        [*GPT2_BF16_FP8_PARAM_GATHER, *FP8_DELAYED_FLAGS, *CP2_RING, "--device-backend", "cpu"],
        timeout=300,
    )
    tensorwise = run_distributed(
        traced_training,
        2,
        [*GPT2_BF16_FP8_PARAM_GATHER, "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]
        + ["--device-backend", "cpu"],
        timeout=300,
    )
    called = {name for rank in llama + gpt2 + delayed + tensorwise for name in rank}
    assert {"cross_entropy_local_stats", "cross_entropy_grad_inplace_"} <= set(llama[0])  # TP=2 loss
    assert {"cross_entropy", "adam_step"} <= set(gpt2[0])
    assert {"fp8_amax", "fp8_cast", "fp8_cast_dbias"} <= set(llama[0]) and "fp8_quantize" in gpt2[0]
    assert {"scaled_linear_forward", "scaled_linear_dgrad", "scaled_linear_wgrad"} <= set(llama[0])
    fused = {"norm_fp8_forward", "norm_backward", "act_fp8_forward", "act_fp8_backward", "fp8_cast_packed"}
    assert fused <= set(delayed[0])
    assert "adam_step_flat_fp8" in delayed[0]
    assert {"fp8_quantize_flat", "fp8_dequantize_flat"} <= set(tensorwise[0]) & set(tensorwise[1])
    assert {"attention_with_lse", "attention_with_lse_backward", "attention_merge"} <= set(delayed[0])
    never = [
        name for name in OP_NAMES if name not in called and name not in MOE_OPS_BEFORE_THE_LAYER | MOE_FP8_OPS
    ]
    assert not never, f"ops of the table no training path calls: {never}"
