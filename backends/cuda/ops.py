"""CUDA implementations of table ops. Each matches :mod:`mcore.ops.reference` (tested on the GPU).

Every op here is a dispatcher: when the call fits a kernel (CUDA tensors, a supported dtype and
shape, Triton installed) it runs the kernel, otherwise the reference op, so CPU tensors, odd shapes
and unusual dtype mixes stay correct. Triton and the kernel modules are imported at the first call
that uses them, never at import, so this module imports on a machine without Triton or a GPU.

Inside ``torch.compile`` (see :func:`mcore.backends.cuda.compile.compile_layer`) the element-wise and
normalisation ops trace the reference instead, which Inductor fuses with their neighbours into its
own Triton kernels; attention, cross-entropy and the optimizer step keep their fused kernels.

The FP8 ops' dispatchers are in :mod:`mcore.backends.cuda.fp8`, the MoE ops' (grouped GEMM on
``torch._grouped_mm``, permute/unpermute) in :mod:`mcore.backends.cuda.moe` (this module adds both to the table), the
device check every dispatcher makes in :mod:`mcore.backends.cuda.device`.

``PROVIDERS`` names the implementation behind each op, as ``mcore-info`` shows it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from mcore.ops import reference

from . import extensions
from .attention_lse import ATTENTION_LSE_OPS, MERGE_OPS
from .device import on_kernel_device, tracing
from .fp8.act import ACT_FP8_OPS
from .fp8.flat import fp8_dequantize_flat, fp8_quantize_flat
from .fp8.linear import FP8_OPS
from .grouped_fp8 import GROUPED_FP8_OPS, GROUPED_FP8_PROVIDER
from .moe import MOE_OPS, MOE_PROVIDERS

_FLOAT = (torch.float32, torch.bfloat16, torch.float16)
_MAX_NORM_WIDTH = 16384


# --- normalisation --------------------------------------------------------------------------------


def _norm_fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    n = x.shape[-1] if x.dim() else 0
    return (
        not tracing()
        and x.dtype in _FLOAT
        and weight.dtype in _FLOAT
        and x.numel() > 0
        and 0 < n <= _MAX_NORM_WIDTH
        and weight.dim() == 1
        and weight.shape[0] == n
        and weight.is_contiguous()
        and (bias is None or (bias.dim() == 1 and bias.shape[0] == n and bias.is_contiguous()))
        and (bias is None or bias.dtype in _FLOAT)
        and on_kernel_device(x, weight, bias)
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The reference ``rms_norm`` through a Triton kernel (fwd and bwd, weight gradient)."""
    if _norm_fits(x, weight):
        from .triton_kernels import norms

        return norms.rms_norm(x, weight, eps)
    return reference.rms_norm(x, weight, eps)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """The reference ``layer_norm`` through a Triton kernel (fwd and bwd, weight and bias gradients)."""
    if _norm_fits(x, weight, bias):
        from .triton_kernels import norms

        return norms.layer_norm(x, weight, bias, eps)
    return reference.layer_norm(x, weight, bias, eps)


def rms_norm_with_residual(x: torch.Tensor, weight: torch.Tensor, eps: float):
    """The reference ``rms_norm_with_residual``; the Triton backward adds the residual's gradient."""
    if _norm_fits(x, weight):
        from .triton_kernels import norms

        return norms.rms_norm_with_residual(x, weight, eps)
    return reference.rms_norm_with_residual(x, weight, eps)


def layer_norm_with_residual(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float):
    """The reference ``layer_norm_with_residual``; the Triton backward adds the residual's gradient."""
    if _norm_fits(x, weight, bias):
        from .triton_kernels import norms

        return norms.layer_norm_with_residual(x, weight, bias, eps)
    return reference.layer_norm_with_residual(x, weight, bias, eps)


def _norm_kind_fits(kind: str, bias: torch.Tensor | None) -> bool:
    return kind == "LayerNorm" or (kind == "RMSNorm" and bias is None)


def _fp32_rows(t: torch.Tensor | None, m: int) -> bool:
    """``t`` is a contiguous fp32 ``[m]`` vector of per-row statistics (or None)."""
    return t is None or (t.dtype == torch.float32 and t.shape == (m,) and t.is_contiguous())


def norm_fp8_forward(
    x, weight, bias, eps, kind, fp8_dtype, scale, amax_record=None, rowwise=True, columnwise=True
):
    """The reference ``norm_fp8_forward`` in two Triton kernels: the norm's row statistics, then its
    output formed tile by tile and written as the FP8 operand (never in the activations' dtype)."""
    if (
        _norm_kind_fits(kind, bias)
        and x.dim() == 2
        and fp8_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
        and scale.numel() == 1
        and scale.dtype == torch.float32
        and (amax_record is None or (amax_record.numel() == 1 and amax_record.dtype == torch.float32))
        and _norm_fits(x, weight, bias)
        and on_kernel_device(x, scale, amax_record)
    ):
        from .triton_kernels import norm_fp8
        from .triton_kernels._common import rows_2d

        return norm_fp8.norm_fp8_fwd(
            rows_2d(x), weight, bias, eps, kind, fp8_dtype, scale, amax_record, rowwise, columnwise
        )
    return reference.norm_fp8_forward(
        x, weight, bias, eps, kind, fp8_dtype, scale, amax_record, rowwise, columnwise
    )


def norm_backward(grad_output, x, weight, bias, eps, kind, mean, rstd, residual_grad=None):
    """The reference ``norm_backward`` through the norm's Triton backward kernel (from the saved
    statistics; ``residual_grad`` added to ``dx`` in the same pass)."""
    if (
        _norm_kind_fits(kind, bias)
        and x.dim() == 2
        and grad_output.shape == x.shape
        and grad_output.dtype in _FLOAT
        and (kind == "RMSNorm" or mean is not None)
        and _fp32_rows(mean, x.shape[0])
        and _fp32_rows(rstd, x.shape[0])
        and (residual_grad is None or (residual_grad.shape == x.shape and residual_grad.dtype == x.dtype))
        and _norm_fits(x, weight, bias)
        and on_kernel_device(x, grad_output, mean, rstd, residual_grad)
    ):
        from .triton_kernels import norm_fp8
        from .triton_kernels._common import rows_2d

        dres2 = None if residual_grad is None else rows_2d(residual_grad)
        return norm_fp8.norm_bwd(rows_2d(grad_output), rows_2d(x), weight, bias, kind, mean, rstd, dres2)
    return reference.norm_backward(grad_output, x, weight, bias, eps, kind, mean, rstd, residual_grad)


# --- rotary ---------------------------------------------------------------------------------------


def rotary_embedding(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """The reference ``rotary_embedding`` (rotate-half, partial rotary) through a Triton kernel."""
    if (
        not tracing()
        and x.dtype in _FLOAT
        and freqs.dtype in _FLOAT
        and not freqs.requires_grad
        and x.dim() >= 1
        and x.numel() > 0
        and freqs.dim() >= 1
        and 0 < freqs.shape[-1] <= x.shape[-1]
        and freqs.shape[-1] % 2 == 0
        and x.shape[-1] <= 4096
        and on_kernel_device(x, freqs)
    ):
        from .triton_kernels import rotary

        k = rotary.split_dims(x.shape, freqs.shape)
        if k is not None:
            return rotary.rotary_embedding(x, freqs, k)
    return reference.rotary_embedding(x, freqs)


# --- activations ----------------------------------------------------------------------------------


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """The reference ``swiglu`` (fused ``[gate, up]`` input) through a Triton kernel."""
    if (
        not tracing()
        and x.dtype in _FLOAT
        and x.dim() >= 1
        and x.numel() > 0
        and x.shape[-1] % 2 == 0
        and on_kernel_device(x)
    ):
        from .triton_kernels import swiglu as kernels

        return kernels.swiglu(x)
    return reference.swiglu(x)


def weighted_swiglu(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The reference ``weighted_swiglu`` (``[N, 2F]`` gate first, fp32 ``[N]`` weights) through Triton
    kernels; no rows, other shapes or dtypes run the reference."""
    if (
        not tracing()
        and x.dtype in _FLOAT
        and x.dim() == 2
        and x.numel() > 0
        and x.shape[-1] % 2 == 0
        and weights.dtype == torch.float32
        and weights.shape == (x.shape[0],)
        and on_kernel_device(x, weights)
    ):
        from .triton_kernels import swiglu as kernels

        return kernels.weighted_swiglu(x, weights)
    return reference.weighted_swiglu(x, weights)


def _bias_fits(x: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return bias is None or (
        bias.dim() == 1 and bias.shape[0] == x.shape[-1] and bias.dtype == x.dtype and bias.is_contiguous()
    )


def bias_gelu(x: torch.Tensor, bias: torch.Tensor | None, approximate: str = "none") -> torch.Tensor:
    """The reference ``bias_gelu`` (exact erf or tanh form) through a Triton kernel."""
    if (
        not tracing()
        and approximate in ("none", "tanh")
        and x.dtype in _FLOAT
        and x.dim() >= 1
        and x.numel() > 0
        and _bias_fits(x, bias)
        and on_kernel_device(x, bias)
    ):
        from .triton_kernels import activations

        return activations.bias_gelu(x, bias, approximate)
    return reference.bias_gelu(x, bias, approximate)


def bias_dropout_add(
    x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, p: float, training: bool
) -> torch.Tensor:
    """The reference ``bias_dropout_add`` through one Triton kernel (mask drawn in-kernel)."""
    if (
        not tracing()
        and x.dtype in _FLOAT
        and x.dim() >= 1
        and x.numel() > 0
        and x.numel() < 2**31
        and residual.shape == x.shape
        and residual.dtype == x.dtype
        and 0.0 <= p < 1.0
        and _bias_fits(x, bias)
        and on_kernel_device(x, bias, residual)
    ):
        from .triton_kernels import activations

        return activations.bias_dropout_add(x, bias, residual, p, training)
    return reference.bias_dropout_add(x, bias, residual, p, training)


# --- cross-entropy --------------------------------------------------------------------------------


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """The reference ``cross_entropy`` chunked over the vocabulary (no fp32 copy of the logits)."""
    if (
        logits.dtype in _FLOAT
        and logits.dim() >= 1
        and logits.numel() > 0
        and labels.shape == logits.shape[:-1]
        and labels.dtype in (torch.int64, torch.int32)
        and 0.0 <= label_smoothing <= 1.0
        and on_kernel_device(logits, labels)
    ):
        from .triton_kernels import cross_entropy as ce

        return ce.cross_entropy(logits, labels, label_smoothing)
    return reference.cross_entropy(logits, labels, label_smoothing)


def _ce_rows_fit(logits2: torch.Tensor, local_labels: torch.Tensor, outside: torch.Tensor, *rows) -> bool:
    """The in-place cross-entropy's ``[rows, V_local]`` logits and ``[rows]`` tensors fit the kernels."""
    return (
        logits2.dtype in _FLOAT
        and logits2.dim() == 2
        and logits2.numel() > 0
        and logits2.stride(-1) == 1
        and local_labels.shape == outside.shape == logits2.shape[:1]
        and local_labels.dtype in (torch.int64, torch.int32)
        and outside.dtype == torch.bool
        and all(r.shape == logits2.shape[:1] for r in rows)
        and on_kernel_device(logits2, local_labels, outside, *rows)
    )


def cross_entropy_local_stats(
    logits2: torch.Tensor, local_labels: torch.Tensor, outside: torch.Tensor, with_sum: bool = False
):
    """The reference ``cross_entropy_local_stats`` through a Triton kernel: one read of the logits."""
    if _ce_rows_fit(logits2, local_labels, outside):
        from .triton_kernels import cross_entropy as ce

        return ce.cross_entropy_local_stats(
            logits2, local_labels.contiguous(), outside.contiguous(), bool(with_sum)
        )
    return reference.cross_entropy_local_stats(logits2, local_labels, outside, with_sum)


def cross_entropy_grad_inplace_(
    logits2: torch.Tensor,
    local_labels: torch.Tensor,
    outside: torch.Tensor,
    log_z: torch.Tensor,
    dloss: torch.Tensor,
    label_smoothing: float,
    vocab_size: int,
):
    """The reference ``cross_entropy_grad_inplace_`` through a Triton kernel: one read, one write."""
    if (
        log_z.dtype == torch.float32
        and dloss.dtype in _FLOAT
        and 0.0 <= label_smoothing < 1.0
        and vocab_size > 0
        and _ce_rows_fit(logits2, local_labels, outside, log_z, dloss)
    ):
        from .triton_kernels import cross_entropy as ce

        return ce.cross_entropy_grad_inplace_(
            logits2, local_labels.contiguous(), outside.contiguous(), log_z.contiguous(),
            dloss.contiguous(), label_smoothing, vocab_size,
        )  # fmt: skip
    return reference.cross_entropy_grad_inplace_(
        logits2, local_labels, outside, log_z, dloss, label_smoothing, vocab_size
    )


# --- attention ------------------------------------------------------------------------------------


def _flash_attn(q, k, v, causal, dropout_p, scale):
    """flash-attn (>= 2.1) when installed and the call fits it, else None."""
    fn = extensions.flash_attn_func()
    if (
        fn is None
        or q.dtype not in (torch.float16, torch.bfloat16)
        or not (q.dtype == k.dtype == v.dtype)
        or q.shape[-1] > 256
        or q.shape[-1] % 8 != 0
        or q.shape[-2] > k.shape[-2]
    ):
        return None
    out = fn(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        dropout_p=dropout_p,
        softmax_scale=scale,
        causal=causal,
    )
    return out.transpose(1, 2)


def attention(q, k, v, *, causal=True, mask=None, bias=None, dropout_p=0.0, scale=None):
    """The reference ``attention`` through flash-attn when installed, else ``F.scaled_dot_product_attention``.

    Layout ``[b, n, s, d]``. torch's boolean mask means *attend* (the opposite of Megatron's), and its
    ``is_causal`` aligns the triangle at the top-left, so when queries and keys differ in length,
    or a mask or bias is given, one additive float mask carries causality, mask and bias together.
    """
    if not q.is_cuda:
        return reference.attention(
            q, k, v, causal=causal, mask=mask, bias=bias, dropout_p=dropout_p, scale=scale
        )
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if mask is None and bias is None and not tracing():
        out = _flash_attn(q, k, v, causal, dropout_p, scale)
        if out is not None:
            return out
    gqa = q.shape[1] != k.shape[1]
    sq, sk = q.shape[-2], k.shape[-2]
    if mask is None and bias is None and (not causal or sq == sk):
        return F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout_p, is_causal=causal, scale=scale, enable_gqa=gqa
        )
    additive = torch.zeros(sq, sk, dtype=q.dtype, device=q.device)
    if bias is not None:
        additive = additive + bias.to(q.dtype)
    neg_inf = torch.finfo(q.dtype).min
    if causal:
        future = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(sk - sq + 1)
        additive = additive.masked_fill(future, neg_inf)
    if mask is not None:
        additive = additive.masked_fill(mask, neg_inf)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=additive, dropout_p=dropout_p, scale=scale, enable_gqa=gqa
    )


# --- optimizer ------------------------------------------------------------------------------------


@torch.no_grad()
def adam_step(
    params: Sequence[torch.Tensor],
    grads,
    exp_avgs,
    exp_avg_sqs,
    *,
    step,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    decoupled_weight_decay=True,
):
    """The reference ``adam_step`` through torch's fused multi-tensor Adam/AdamW kernel.

    apex's ``multi_tensor_adam`` serves it instead with ``MCORE_CUDA_ADAM=apex`` (when installed).
    """
    if not params:
        return
    if not all(t.is_cuda for t in params) or any(p.dtype not in _FLOAT for p in params):
        return reference.adam_step(
            params, grads, exp_avgs, exp_avg_sqs, step=step, lr=lr, beta1=beta1, beta2=beta2,
            eps=eps, weight_decay=weight_decay, decoupled_weight_decay=decoupled_weight_decay,
        )  # fmt: skip
    # The multi-tensor kernels want each gradient in its parameter's dtype (e.g. bf16 grads, fp32 main params).
    grads = [g if g.dtype == p.dtype else g.to(p.dtype) for p, g in zip(params, grads)]
    apex = extensions.apex_multi_tensor_adam()
    if apex is not None:
        applier, kernel = apex
        noop = torch.zeros(1, dtype=torch.int, device=params[0].device)
        applier(
            kernel, noop, [list(grads), list(params), list(exp_avgs), list(exp_avg_sqs)],
            lr, beta1, beta2, eps, step, 1 if decoupled_weight_decay else 0, 1, weight_decay,
        )  # fmt: skip
        return
    # A fill kernel, not a host-to-device copy: no synchronisation with the host.
    step_tensor = torch.full((), float(step), dtype=torch.float32, device=params[0].device)
    kernel = torch._fused_adamw_ if decoupled_weight_decay else torch._fused_adam_
    kernel(
        list(params),
        list(grads),
        list(exp_avgs),
        list(exp_avg_sqs),
        [],
        [step_tensor] * len(params),
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        weight_decay=weight_decay,
        eps=eps,
        amsgrad=False,
        maximize=False,
    )


def adam_step_flat(
    grads, params, masters, remainders, exp_avgs, exp_avg_sqs, segments, *, step, lrs,
    weight_decays, beta1, beta2, eps, grad_scale=None, skip=None,
):  # fmt: skip
    """The reference ``adam_step_flat`` as one Triton launch over every tile of every segment."""
    tensors = (grads, params, masters, remainders, exp_avgs, exp_avg_sqs, grad_scale, skip)
    if not tracing() and len(lrs) <= 4 and on_kernel_device(*tensors):
        from .triton_kernels import adam

        fn = adam.adam_step_flat
    else:
        fn = reference.adam_step_flat
    fn(
        grads, params, masters, remainders, exp_avgs, exp_avg_sqs, segments, step=step, lrs=lrs,
        weight_decays=weight_decays, beta1=beta1, beta2=beta2, eps=eps, grad_scale=grad_scale, skip=skip,
    )  # fmt: skip


def adam_step_flat_fp8(
    grads, params, masters, remainders, exp_avgs, exp_avg_sqs, segments, fp8, *, step, lrs,
    weight_decays, beta1, beta2, eps, grad_scale=None, skip=None,
):  # fmt: skip
    """The reference ``adam_step_flat_fp8`` as one Triton launch: the flat step's kernel, whose tiles
    in an FP8 weight's piece also write its FP8 bytes and max its amax."""
    tensors = (grads, params, masters, remainders, exp_avgs, exp_avg_sqs, grad_scale, skip)
    fp8_tensors = (fp8.data, fp8.scales, fp8.amax)
    if not tracing() and len(lrs) <= 4 and on_kernel_device(*tensors, *fp8_tensors):
        from .triton_kernels import adam

        fn = adam.adam_step_flat_fp8
    else:
        fn = reference.adam_step_flat_fp8
    fn(
        grads, params, masters, remainders, exp_avgs, exp_avg_sqs, segments, fp8, step=step, lrs=lrs,
        weight_decays=weight_decays, beta1=beta1, beta2=beta2, eps=eps, grad_scale=grad_scale, skip=skip,
    )  # fmt: skip


# --- weight-gradient accumulation -----------------------------------------------------------------

_MIXED_ADDMM: dict[torch.device, bool] = {}


def _has_mixed_addmm(device: torch.device) -> bool:
    """Whether this torch offers ``addmm(..., out_dtype=float32, out=...)`` on ``device`` (probed once)."""
    if device not in _MIXED_ADDMM:
        try:
            acc = torch.zeros(8, 8, device=device)
            a = torch.ones(8, 8, device=device, dtype=torch.bfloat16)
            torch.addmm(acc, a.t(), a, out_dtype=torch.float32, out=acc)
            _MIXED_ADDMM[device] = bool(acc[0, 0].item() == 8.0)
        except (RuntimeError, NotImplementedError, TypeError):
            _MIXED_ADDMM[device] = False
    return _MIXED_ADDMM[device]


def accumulate_weight_grad(
    main_grad: torch.Tensor, grad_output_2d: torch.Tensor, input_2d: torch.Tensor
) -> None:
    """The reference ``accumulate_weight_grad``; an fp32 ``main_grad`` for bf16/fp16 activations in one
    cuBLAS GEMM that accumulates in fp32 into ``main_grad`` (``beta=1``), so the product is never
    rounded to 16 bits nor written out and read back (Megatron's ``fused_weight_gradient_mlp_cuda``)."""
    if (
        main_grad.dtype == torch.float32
        and grad_output_2d.dtype in (torch.bfloat16, torch.float16)
        and input_2d.dtype == grad_output_2d.dtype
        and main_grad.is_cuda
        and _has_mixed_addmm(main_grad.device)
    ):
        torch.addmm(main_grad, grad_output_2d.t(), input_2d, out_dtype=torch.float32, out=main_grad)
        return
    reference.accumulate_weight_grad(main_grad, grad_output_2d, input_2d)


_TRITON_OPS = {
    "layer_norm": layer_norm,
    "rms_norm": rms_norm,
    "layer_norm_with_residual": layer_norm_with_residual,
    "rms_norm_with_residual": rms_norm_with_residual,
    "norm_fp8_forward": norm_fp8_forward,
    "norm_backward": norm_backward,
    "rotary_embedding": rotary_embedding,
    "bias_gelu": bias_gelu,
    "swiglu": swiglu,
    "weighted_swiglu": weighted_swiglu,
    "bias_dropout_add": bias_dropout_add,
    "cross_entropy": cross_entropy,
    "cross_entropy_local_stats": cross_entropy_local_stats,
    "cross_entropy_grad_inplace_": cross_entropy_grad_inplace_,
    "adam_step_flat": adam_step_flat,
    "adam_step_flat_fp8": adam_step_flat_fp8,
    "fp8_quantize_flat": fp8_quantize_flat,
    "fp8_dequantize_flat": fp8_dequantize_flat,
}


def _build() -> tuple[dict, dict[str, str]]:
    ops: dict = {
        "attention": attention,
        "adam_step": adam_step,
        "accumulate_weight_grad": accumulate_weight_grad,
    }
    providers = {
        "accumulate_weight_grad": "cublas",
        "attention": "flash-attn" if extensions.flash_attn_func() is not None else "torch-sdpa",
        "adam_step": "apex" if extensions.apex_multi_tensor_adam() is not None else "torch-fused",
    }
    if extensions.triton_available():
        ops.update(_TRITON_OPS)
        providers.update(dict.fromkeys(_TRITON_OPS, "triton"))
    ops.update(MOE_OPS)  # torch ops only (no Triton); the router stays the reference (moe.py says why)
    providers.update(MOE_PROVIDERS)
    ops.update(GROUPED_FP8_OPS)  # the experts' FP8 GEMMs (backends/cuda/grouped_fp8.py)
    providers.update(dict.fromkeys(GROUPED_FP8_OPS, GROUPED_FP8_PROVIDER))
    ops.update(ATTENTION_LSE_OPS)  # context parallelism (backends/cuda/attention_lse.py)
    providers.update(dict.fromkeys(ATTENTION_LSE_OPS, "flash-sdpa"))
    if extensions.triton_available():
        ops.update(MERGE_OPS)
        providers.update(dict.fromkeys(MERGE_OPS, "triton"))
    ops.update(FP8_OPS)
    providers.update({name: "scaled_mm" if name.startswith("scaled_") else "inductor" for name in FP8_OPS})
    if extensions.triton_available():
        providers.update(
            fp8_amax="triton", fp8_cast="triton", fp8_cast_dbias="triton", fp8_cast_packed="triton",
            fp8_transpose="triton",
        )  # fmt: skip
        ops.update(ACT_FP8_OPS)
        providers.update(dict.fromkeys(ACT_FP8_OPS, "triton"))
    else:
        providers["fp8_transpose"] = "reference"  # PyTorch's strided copy
    return ops, providers


CUDA_OPS, PROVIDERS = _build()
"""The ops this backend overrides (the Triton ones only where Triton is installed) and who serves each."""

ALL_OPS = {
    **_TRITON_OPS,
    "attention": attention,
    "adam_step": adam_step,
    "accumulate_weight_grad": accumulate_weight_grad,
    **ATTENTION_LSE_OPS,
    **MERGE_OPS,
    **FP8_OPS,
    **ACT_FP8_OPS,
    **MOE_OPS,
    **GROUPED_FP8_OPS,
}
"""Every dispatcher, whatever is installed (tests call them directly: they fall back by themselves)."""
