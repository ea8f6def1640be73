"""Pure-PyTorch reference for every op in the table: the definition that fused kernels must match.

One module per kind of op, mirroring the kernel files of ``backends/cuda/triton_kernels/``:

* :mod:`.norms`: LayerNorm, RMSNorm (and with their residual stream);
* :mod:`.rotary`: rotary position embedding;
* :mod:`.activations`: bias-GeLU, SwiGLU (and weighted per row, the MoE experts'), bias-dropout-add;
* :mod:`.dot_product_attention`: scaled dot-product attention with its softmax;
* :mod:`.attention_lse`: attention by key blocks for context parallelism (with its log-sum-exp, the
  merge of two blocks, a block's backward);
* :mod:`.loss`: cross-entropy, per token and the vocab-parallel fused loss's two halves;
* :mod:`.adam`: the optimizer step, per tensor and over flat buffers (with FP8 weight copies);
* :mod:`.linear`: weight-gradient accumulation and the FP8 ``scaled_linear`` GEMMs;
* :mod:`.fp8`, :mod:`.fp8_flat`: FP8 casts and transposes, and casts over flat parameter buffers;
* :mod:`.norm_fp8`, :mod:`.act_fp8`: the fused producers of FP8 operands (norm, activation);
* :mod:`.moe`: mixture of experts: the router's top-k, token permute/unpermute, the grouped GEMM;
* :mod:`.grouped_fp8`: the experts' grouped GEMM on FP8 (or int8) operands with per-row scales.

No module is named after an op (``attention``, ``cross_entropy``, ``fp8_cast`` are functions), so
``mcore.ops.reference.<op>`` always names the op. This package's namespace is the API: ``from mcore.ops import reference; reference.<op>`` and
:data:`REFERENCE_OPS`, the table the op registry starts from.

Shape legend: ``b`` batch, ``s`` sequence (``sq`` queries, ``sk`` keys), ``n`` attention heads,
``g`` key/value heads (query groups), ``d`` head dim, ``h`` hidden, ``V`` vocabulary.

Precision: reductions (norm statistics, softmax, log-sum-exp) are computed in at least fp32 (fp16/bf16
inputs are promoted to fp32, float64 stays float64 so gradcheck can be strict), and results are
returned in the input dtype, as Megatron's fused kernels do.
"""

from __future__ import annotations

from mcore.ops.reference.act_fp8 import ACTIVATIONS, act_fp8_backward, act_fp8_forward
from mcore.ops.reference.activations import bias_dropout_add, bias_gelu, swiglu, weighted_swiglu
from mcore.ops.reference.adam import adam_step, adam_step_flat, adam_step_flat_fp8
from mcore.ops.reference.attention_lse import (
    attention_merge,
    attention_with_lse,
    attention_with_lse_backward,
)
from mcore.ops.reference.dot_product_attention import attention
from mcore.ops.reference.fp8 import (
    fp8_amax,
    fp8_cast,
    fp8_cast_dbias,
    fp8_cast_packed,
    fp8_quantize,
    fp8_scale_from_amax,
    fp8_transpose,
    pack_columns,
)
from mcore.ops.reference.fp8_flat import fp8_dequantize_flat, fp8_quantize_flat
from mcore.ops.reference.grouped_fp8 import scaled_grouped_gemm, scaled_grouped_gemm_wgrad
from mcore.ops.reference.linear import (
    accumulate_weight_grad,
    scaled_linear_dgrad,
    scaled_linear_forward,
    scaled_linear_wgrad,
    scaled_mm_nt,
)
from mcore.ops.reference.loss import (
    cross_entropy,
    cross_entropy_grad_inplace_,
    cross_entropy_local_stats,
)
from mcore.ops.reference.moe import grouped_gemm, moe_permute, moe_topk_routing, moe_unpermute
from mcore.ops.reference.norm_fp8 import norm_backward, norm_fp8_forward
from mcore.ops.reference.norms import layer_norm, layer_norm_with_residual, rms_norm, rms_norm_with_residual
from mcore.ops.reference.rotary import rotary_embedding

REFERENCE_OPS = {
    "layer_norm": layer_norm,
    "rms_norm": rms_norm,
    "layer_norm_with_residual": layer_norm_with_residual,
    "rms_norm_with_residual": rms_norm_with_residual,
    "rotary_embedding": rotary_embedding,
    "bias_gelu": bias_gelu,
    "swiglu": swiglu,
    "weighted_swiglu": weighted_swiglu,
    "bias_dropout_add": bias_dropout_add,
    "attention": attention,
    "cross_entropy": cross_entropy,
    "cross_entropy_local_stats": cross_entropy_local_stats,
    "cross_entropy_grad_inplace_": cross_entropy_grad_inplace_,
    "adam_step": adam_step,
    "adam_step_flat": adam_step_flat,
    "adam_step_flat_fp8": adam_step_flat_fp8,
    "accumulate_weight_grad": accumulate_weight_grad,
    "fp8_quantize": fp8_quantize,
    "fp8_quantize_flat": fp8_quantize_flat,
    "fp8_dequantize_flat": fp8_dequantize_flat,
    "fp8_amax": fp8_amax,
    "fp8_cast": fp8_cast,
    "fp8_cast_dbias": fp8_cast_dbias,
    "fp8_cast_packed": fp8_cast_packed,
    "fp8_transpose": fp8_transpose,
    "norm_fp8_forward": norm_fp8_forward,
    "norm_backward": norm_backward,
    "act_fp8_forward": act_fp8_forward,
    "act_fp8_backward": act_fp8_backward,
    "scaled_linear_forward": scaled_linear_forward,
    "scaled_linear_dgrad": scaled_linear_dgrad,
    "scaled_linear_wgrad": scaled_linear_wgrad,
    "moe_topk_routing": moe_topk_routing,
    "moe_permute": moe_permute,
    "moe_unpermute": moe_unpermute,
    "grouped_gemm": grouped_gemm,
    "scaled_grouped_gemm": scaled_grouped_gemm,
    "scaled_grouped_gemm_wgrad": scaled_grouped_gemm_wgrad,
    # context parallelism
    "attention_with_lse": attention_with_lse,
    "attention_with_lse_backward": attention_with_lse_backward,
    "attention_merge": attention_merge,
}

__all__ = [
    "ACTIVATIONS",
    "REFERENCE_OPS",
    "fp8_scale_from_amax",
    "pack_columns",
    "scaled_mm_nt",
    *REFERENCE_OPS,
]
"""The names above and every op of :data:`REFERENCE_OPS`, by its name."""
