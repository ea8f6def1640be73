"""The op cases, as data: :class:`OpCase` (an op, how to make its inputs, its gradients, its tolerance
kind, its dtypes and the capability it needs) and :data:`OP_CASES`, every case of every op. How a
case is checked is :mod:`mcore.testing.conformance.op_checks`'s."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mcore.testing.conformance.op_inputs import (
    accumulate_weight_grad_make,
    act_fp8_make,
    adam_flat_fp8_make,
    adam_flat_make,
    adam_l2_make,
    adam_make,
    attention_lse_backward_make,
    attention_lse_make,
    attention_merge_make,
    ce_rows_make,
    document_mask,
    fp8_amax_make,
    fp8_cast_make,
    fp8_cast_packed_make,
    fp8_dequantize_flat_make,
    fp8_quantize_flat_make,
    fp8_quantize_make,
    fp8_transpose_make,
    grouped_gemm_make,
    layer_norm_make,
    moe_permute_make,
    moe_routing_make,
    moe_unpermute_make,
    norm_backward_make,
    norm_fp8_make,
    padding_mask,
    randn,
    rms_norm_make,
    rotary_freqs,
    scaled_grouped_gemm_make,
    scaled_linear_make,
    weighted_swiglu_make,
)


@dataclass(frozen=True)
class OpCase:
    """One call of one op: how to make its inputs, which of them get gradients, how close to be."""

    name: str
    op: str
    make: Callable[[torch.dtype, torch.Generator], tuple[list, dict]]
    grad_args: tuple[int, ...] = ()
    kind: str = "elementwise"
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
    capability: str | None = None
    """A capability the backend must claim for this case to apply (``fp8``); skipped otherwise."""


def _attention_case(
    name: str, b=2, n=4, g=4, sq=16, sk=16, d=32, causal=True, mask=None, scale=None
) -> OpCase:
    def make(dtype, gen):
        q = randn(gen, b, n, sq, d, dtype=dtype)
        k = randn(gen, b, g, sk, d, dtype=dtype)
        v = randn(gen, b, g, sk, d, dtype=dtype)
        kwargs: dict[str, Any] = {"causal": causal}
        if mask == "padding":
            kwargs["mask"] = padding_mask(gen, b, sk)
        elif mask == "document":
            kwargs["mask"] = document_mask(b, sq)
        if scale is not None:
            kwargs["scale"] = scale
        return [q, k, v], kwargs

    return OpCase(name, "attention", make, grad_args=(0, 1, 2), kind="reduction")


_FP8: dict[str, Any] = {"dtypes": (torch.float32, torch.bfloat16), "capability": "fp8"}
"""The FP8 ops' cases: fp32 and bf16 inputs, on backends that claim ``fp8``."""

_MOE: dict[str, Any] = {"dtypes": (torch.float32, torch.bfloat16), "kind": "reduction"}
"""The MoE data-path cases (permute, unpermute, grouped GEMM): fp32 and bf16, reduction tolerances
(unpermute sums a token's rows, the GEMM its K products)."""

_ROUTER: dict[str, Any] = {"dtypes": (torch.float32,), "kind": "reduction", "grad_args": (0,)}
"""The router's cases: fp32 logits (``--moe-router-dtype fp32``; the routing map is compared exactly, so
no half-precision ties)."""

_FP32_STEP: dict[str, Any] = {"dtypes": (torch.float32,), "kind": "reduction"}
"""The optimizer steps' cases: fp32 state only, reduction tolerances."""


MOE_CASES: tuple[OpCase, ...] = (
    OpCase("moe_topk_routing_softmax", "moe_topk_routing", moe_routing_make(), **_ROUTER),
    OpCase("moe_topk_routing_pre_softmax", "moe_topk_routing", moe_routing_make(pre_softmax=True), **_ROUTER),
    OpCase(
        "moe_topk_routing_sigmoid_bias_scaled",
        "moe_topk_routing",
        moe_routing_make(score_function="sigmoid", with_bias=True, scaling_factor=2.5),
        **_ROUTER,
    ),
    OpCase(
        "moe_topk_routing_group_limited",
        "moe_topk_routing",
        moe_routing_make(score_function="sigmoid", num_groups=4, group_topk=2, with_bias=True),
        **_ROUTER,
    ),
    OpCase("moe_permute_probs", "moe_permute", moe_permute_make(), grad_args=(0, 2), **_MOE),
    OpCase("moe_permute", "moe_permute", moe_permute_make(with_probs=False), grad_args=(0,), **_MOE),
    OpCase("moe_permute_no_tokens", "moe_permute", moe_permute_make(empty=True), grad_args=(0, 2), **_MOE),
    OpCase("moe_unpermute_probs", "moe_unpermute", moe_unpermute_make(), grad_args=(0, 3), **_MOE),
    OpCase("moe_unpermute", "moe_unpermute", moe_unpermute_make(with_probs=False), grad_args=(0,), **_MOE),
    OpCase(
        "moe_unpermute_no_tokens", "moe_unpermute", moe_unpermute_make(empty=True), grad_args=(0, 3), **_MOE
    ),
    OpCase("grouped_gemm_empty_expert", "grouped_gemm", grouped_gemm_make(), grad_args=(0, 1), **_MOE),
    OpCase(
        "grouped_gemm_unaligned",
        "grouped_gemm",
        grouped_gemm_make((3, 4), k=20, m=12),
        grad_args=(0, 1),
        **_MOE,
    ),
    OpCase("grouped_gemm_no_tokens", "grouped_gemm", grouped_gemm_make((0, 0, 0)), grad_args=(0, 1), **_MOE),
    # the experts' FP8 GEMMs (forward and input gradient share scaled_grouped_gemm): an expert with no
    # token, a rank with none, and int8 operands (the NPU's per-token quantized form) on every backend
    *(
        OpCase(f"scaled_grouped_gemm_{name}", op, make, **_FP8, kind="reduction")
        for name, op, make in (
            ("forward_empty_expert", "scaled_grouped_gemm", scaled_grouped_gemm_make("forward")),
            ("forward_no_tokens", "scaled_grouped_gemm", scaled_grouped_gemm_make("forward", (0, 0))),
            ("wgrad_empty_expert", "scaled_grouped_gemm_wgrad", scaled_grouped_gemm_make("wgrad")),
            ("wgrad_no_tokens", "scaled_grouped_gemm_wgrad", scaled_grouped_gemm_make("wgrad", (0, 0, 0))),
        )
    ),
    OpCase(
        "scaled_grouped_gemm_int8",
        "scaled_grouped_gemm",
        scaled_grouped_gemm_make("forward", (7, 0, 9), quantized=torch.int8),
        dtypes=(torch.bfloat16,),
        kind="reduction",
    ),
)
"""The MoE ops' cases: an expert with no token, and calls where no token is routed to this rank
(``N = 0`` rows: an empty routing map, all-zero counts), as under expert parallelism."""


OP_CASES: tuple[OpCase, ...] = (
    # the *_with_residual variants return (norm(x), x): the same inputs, gradients through both
    *(
        OpCase(op, op, layer_norm_make, grad_args=(0, 1, 2), kind="reduction")
        for op in ("layer_norm", "layer_norm_with_residual")
    ),
    *(
        OpCase(op, op, rms_norm_make, grad_args=(0, 1), kind="reduction")
        for op in ("rms_norm", "rms_norm_with_residual")
    ),
    OpCase(
        "rotary_embedding",
        "rotary_embedding",
        lambda dt, g: ([randn(g, 6, 2, 4, 32, dtype=dt), rotary_freqs(6, 32)], {}),
        grad_args=(0,),
    ),
    OpCase(
        "rotary_embedding_partial",
        "rotary_embedding",
        lambda dt, g: ([randn(g, 6, 2, 4, 32, dtype=dt), rotary_freqs(6, 16)], {}),
        grad_args=(0,),
    ),
    OpCase(
        "rotary_embedding_position_ids",
        "rotary_embedding",
        lambda dt, g: (
            [
                randn(g, 6, 2, 4, 32, dtype=dt),
                rotary_freqs(6, 32, torch.tensor([[0, 1, 2, 0, 1, 2], [5, 6, 7, 8, 9, 10]])),
            ],
            {},
        ),
        grad_args=(0,),
    ),
    OpCase(
        "bias_gelu",
        "bias_gelu",
        lambda dt, g: ([randn(g, 4, 8, 64, dtype=dt), randn(g, 64, dtype=dt)], {"approximate": "none"}),
        grad_args=(0, 1),
    ),
    OpCase(
        "bias_gelu_tanh",
        "bias_gelu",
        lambda dt, g: ([randn(g, 4, 8, 64, dtype=dt), None], {"approximate": "tanh"}),
        grad_args=(0,),
    ),
    OpCase("swiglu", "swiglu", lambda dt, g: ([randn(g, 4, 8, 128, dtype=dt)], {}), grad_args=(0,)),
    # the MoE experts' activation: the weights' gradient sums a row (reduction bounds for the grads)
    OpCase("weighted_swiglu", "weighted_swiglu", weighted_swiglu_make(), grad_args=(0, 1)),
    OpCase("weighted_swiglu_odd_width", "weighted_swiglu", weighted_swiglu_make(7, 2 * 37), grad_args=(0, 1)),
    OpCase("weighted_swiglu_no_rows", "weighted_swiglu", weighted_swiglu_make(0), grad_args=(0, 1)),
    OpCase(
        "bias_dropout_add",
        "bias_dropout_add",
        lambda dt, g: (
            [randn(g, 4, 2, 64, dtype=dt), randn(g, 64, dtype=dt), randn(g, 4, 2, 64, dtype=dt)],
            {"p": 0.0, "training": True},
        ),
        grad_args=(0, 1, 2),
    ),
    _attention_case("attention_causal"),
    _attention_case("attention_gqa", n=8, g=2),
    _attention_case("attention_mqa", n=4, g=1),
    _attention_case("attention_full", causal=False),
    _attention_case("attention_padding", causal=False, mask="padding"),
    _attention_case("attention_causal_padding", mask="padding"),
    _attention_case("attention_document_mask", g=2, mask="document"),
    _attention_case("attention_kv_cache", sq=4, sk=16),
    _attention_case("attention_scale", scale=0.3, d=64),
    OpCase(
        "cross_entropy",
        "cross_entropy",
        lambda dt, g: (
            [randn(g, 4, 8, 96, dtype=dt, scale=3.0), torch.randint(0, 96, (4, 8), generator=g)],
            {},
        ),
        grad_args=(0,),
        kind="reduction",
    ),
    OpCase(
        "cross_entropy_local_stats",
        "cross_entropy_local_stats",
        ce_rows_make(smoothing=False),
        kind="reduction",
    ),
    OpCase(
        "cross_entropy_local_stats_smoothing",
        "cross_entropy_local_stats",
        ce_rows_make(smoothing=True),
        kind="reduction",
    ),
    OpCase("cross_entropy_grad_inplace", "cross_entropy_grad_inplace_", ce_rows_make(grad=True)),
    OpCase(
        "cross_entropy_grad_inplace_smoothing",
        "cross_entropy_grad_inplace_",
        ce_rows_make(smoothing=True, grad=True),
    ),
    OpCase("adam_step", "adam_step", adam_make, **_FP32_STEP),
    OpCase("adam_step_l2", "adam_step", adam_l2_make, **_FP32_STEP),
    OpCase("adam_flat_fp32", "adam_step_flat", adam_flat_make("fp32"), **_FP32_STEP),
    OpCase("adam_flat_masters", "adam_step_flat", adam_flat_make("masters"), **_FP32_STEP),
    OpCase("adam_flat_precision_aware", "adam_step_flat", adam_flat_make("remainders"), **_FP32_STEP),
    OpCase(
        "adam_flat_device_step", "adam_step_flat", adam_flat_make("masters", device_step=True), **_FP32_STEP
    ),
    *(
        OpCase(f"adam_flat_fp8_{mode}", "adam_step_flat_fp8", adam_flat_fp8_make(mode), **_FP32_STEP)
        for mode in ("masters", "remainders")
    ),
    OpCase("accumulate_weight_grad", "accumulate_weight_grad", accumulate_weight_grad_make, kind="reduction"),
    OpCase("fp8_quantize", "fp8_quantize", fp8_quantize_make, **_FP8),
    OpCase("fp8_quantize_flat", "fp8_quantize_flat", fp8_quantize_flat_make, **_FP8),
    OpCase("fp8_dequantize_flat", "fp8_dequantize_flat", fp8_dequantize_flat_make, **_FP8),
    OpCase("fp8_amax", "fp8_amax", fp8_amax_make, **_FP8),
    *(
        OpCase(f"fp8_cast_{how}", "fp8_cast", fp8_cast_make(from_amax=how == "from_amax"), **_FP8)
        for how in ("from_amax", "scale_recording_amax")
    ),
    *(
        OpCase(f"fp8_cast_dbias_{how}", "fp8_cast_dbias", fp8_cast_make(from_amax=how == "from_amax"), **_FP8)
        for how in ("from_amax", "scale_recording_amax")
    ),
    *(
        OpCase(
            f"fp8_cast_packed{'_dbias' if dbias else ''}",
            "fp8_cast_packed",
            fp8_cast_packed_make(dbias),
            **_FP8,
        )
        for dbias in (True, False)
    ),
    OpCase("fp8_transpose", "fp8_transpose", fp8_transpose_make, **_FP8),
    *(
        OpCase(
            f"{op}_{kind}{'' if bias else '_no_bias'}",
            op,
            act_fp8_make(kind, op == "act_fp8_backward", bias),
            **_FP8,
            kind="reduction",
        )
        for op in ("act_fp8_forward", "act_fp8_backward")
        for kind, bias in (("gelu", True), ("gelu_tanh", False), ("swiglu", True))
    ),
    *(
        OpCase(
            f"scaled_linear_{which}",
            f"scaled_linear_{which.removesuffix('_overwrite')}",
            scaled_linear_make(which),
            **_FP8,
            kind="reduction",
        )
        for which in ("forward", "dgrad", "wgrad", "wgrad_overwrite")
    ),
    *(
        OpCase(
            f"norm_fp8_forward_{name}", "norm_fp8_forward", norm_fp8_make(kind, fp8_dtype, rowwise), **_FP8
        )
        for name, kind, fp8_dtype, rowwise in (
            ("layer_norm_e4m3", "LayerNorm", torch.float8_e4m3fn, True),
            ("rms_norm_e5m2_columnwise", "RMSNorm", torch.float8_e5m2, False),
        )
    ),
    *(
        OpCase(f"norm_backward_{name}", "norm_backward", norm_backward_make(kind, residual), kind="reduction")
        for name, kind, residual in (
            ("layer_norm_residual", "LayerNorm", True),
            ("rms_norm", "RMSNorm", False),
        )
    ),
    *MOE_CASES,
    # context parallelism: a block's attention with its log-sum-exp, its backward from the merged
    # results, the merge (rows without a key: out 0, lse -inf)
    *(
        OpCase(
            f"attention_with_lse_{name}", "attention_with_lse", attention_lse_make(**shape), kind="reduction"
        )
        for name, shape in (
            ("causal", {}),
            ("gqa_full_rect", {"n": 8, "g": 2, "sq": 8, "causal": False}),
            ("causal_fewer_queries", {"g": 2, "sq": 8}),
            ("causal_masked_rows", {"sq": 16, "sk": 8}),
        )
    ),
    *(
        OpCase(
            f"attention_with_lse_backward_{name}",
            "attention_with_lse_backward",
            attention_lse_backward_make(causal),
            kind="reduction",
        )
        for name, causal in (("diagonal", True), ("earlier_keys", False))
    ),  # fmt: skip
    OpCase("attention_merge", "attention_merge", attention_merge_make, kind="reduction"),
)
"""Every op of :data:`mcore.ops.registry.OP_NAMES` appears at least once."""
