"""The ``scaled_linear`` op family and the FP8 casts on CUDA: ``torch._scaled_mm`` and Inductor.

Why ``torch._scaled_mm`` and not torchao's float8 training: torchao is not installed on the
machines this backend targets (and is not a dependency of mcore), and its ``Float8Linear`` swaps
modules and owns the autograd function, which would bypass mcore's op table: the table is the
backend contract (every op has a CPU reference the CI checks, another vendor can serve the same
ops), so mcore keeps the FP8 linear in the core (:mod:`mcore.fp8.linear`) and this backend
serves only its kernels. ``torch._scaled_mm`` is the cuBLASLt FP8 GEMM torchao itself calls:

* per-tensor scales: any output dtype (bf16 for activations, fp32 for the weight gradient that is
  added into an fp32 ``main_grad``);
* per-row scales (``[M, 1]`` x ``[1, N]``): Hopper (sm_90) only, bf16 output.

The per-tensor casts of the tensorwise and delayed recipes (``fp8_amax``, ``fp8_cast``) are the
hand-written Triton kernels of :mod:`mcore.backends.cuda.triton_kernels.fp8_cast`: an amax pass
(grid-strided, one atomic per program), then one kernel that forms the scale on the device, casts, writes the FP8
tensor and its transpose with coalesced stores (the other GEMMs' NT operand) and, for the delayed
recipe, records the amax in the same pass; ``fp8_cast_dbias`` (an output gradient with its bias
gradient) is a variant of that kernel that also sums the columns, and ``fp8_cast_packed`` (a fused QKV
projection's output gradient, from the attention's separate ``dq``, ``dk``, ``dv``) the same kernel
reading each column band from the part it lies in. The row-scaled cast (``fp8_quantize``, rowwise recipe) is
an Inductor-generated kernel (``torch.compile`` of the reference, dynamic shapes). Inside an outer
``torch.compile`` (``--compile-layers``) all of them trace the reference, which Inductor fuses with
the neighbouring ops. Shapes ``_scaled_mm`` refuses (a contraction or output dim not a multiple of 16,
e5m2 x e5m2) and CPU tensors run the reference (dequantize, matmul in fp32).

The forward GEMM uses fast (single-level) fp32 accumulation and the two gradient GEMMs the split
accumulator, as Transformer Engine does by default.
"""

from __future__ import annotations

import functools
import types

import torch

from mcore.ops import reference

from ..device import on_kernel_device

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _compiling() -> bool:
    return torch.compiler.is_compiling()


@functools.cache
def _compiled(fn, key: tuple):
    """``torch.compile(fn)`` for one kind of call (input dtype, FP8 dtype, strides, scale shape).

    Each kind gets its own copy of ``fn``'s code: dynamo counts recompilations per code object and a
    shared one would hit its limit (8) across the dtype/layout combinations of a training run."""
    clone = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__)
    return torch.compile(clone, dynamic=True, fullgraph=True)


def _key(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> tuple:
    return (x.dtype, fp8_dtype, x.dim(), x.is_contiguous(), scale.dim(), scale.numel() == 1)


def fp8_quantize(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    if not x.is_cuda or _compiling():
        return reference.fp8_quantize(x, scale, fp8_dtype)
    return _compiled(reference.fp8_quantize, _key(x, scale, fp8_dtype))(x, scale, fp8_dtype)


def _triton_cast_fits(x: torch.Tensor, *tensors: torch.Tensor | None) -> bool:
    return x.dtype in (torch.float32, torch.bfloat16, torch.float16) and on_kernel_device(x, *tensors)


def fp8_amax(x: torch.Tensor) -> torch.Tensor:
    if _compiling() or not x.is_contiguous() or not _triton_cast_fits(x):
        return reference.fp8_amax(x)
    from ..triton_kernels import fp8_cast as kernels

    return kernels.amax(x)


def _cast_fits(x, fp8_dtype, scale, amax, amax_record) -> bool:
    """The Triton cast kernels take this call (else the reference runs)."""
    given = amax if amax is not None else scale
    return (
        not _compiling()
        and (scale is None) != (amax is None)
        and x.dim() == 2
        and given.numel() == 1
        and fp8_dtype in _FP8
        and given.dtype == torch.float32
        and (amax_record is None or (amax_record.numel() == 1 and amax_record.dtype == torch.float32))
        and _triton_cast_fits(x, given, amax_record)
    )


def fp8_cast(
    x, fp8_dtype, *, scale=None, amax=None, margin=0, rowwise=True, columnwise=False, amax_record=None
):
    if not _cast_fits(x, fp8_dtype, scale, amax, amax_record):
        return reference.fp8_cast(
            x,
            fp8_dtype,
            scale=scale,
            amax=amax,
            margin=margin,
            rowwise=rowwise,
            columnwise=columnwise,
            amax_record=amax_record,
        )
    from ..triton_kernels import fp8_cast as kernels

    return kernels.cast(
        x,
        fp8_dtype,
        scale=scale,
        amax=amax,
        margin=margin,
        rowwise=rowwise,
        columnwise=columnwise,
        amax_record=amax_record,
    )


def fp8_cast_dbias(
    x, fp8_dtype, *, scale=None, amax=None, margin=0, rowwise=True, columnwise=False, amax_record=None
):
    args = dict(
        scale=scale, amax=amax, margin=margin, rowwise=rowwise, columnwise=columnwise, amax_record=amax_record
    )
    if x.numel() == 0 or not _cast_fits(x, fp8_dtype, scale, amax, amax_record):
        return reference.fp8_cast_dbias(x, fp8_dtype, **args)
    from ..triton_kernels import fp8_cast as kernels

    return kernels.cast_dbias(x, fp8_dtype, **args)


def fp8_cast_packed(
    parts,
    groups,
    fp8_dtype,
    *,
    dbias,
    scale=None,
    amax=None,
    margin=0,
    rowwise=True,
    columnwise=False,
    amax_record=None,
):
    args = dict(
        scale=scale, amax=amax, margin=margin, rowwise=rowwise, columnwise=columnwise, amax_record=amax_record
    )
    first = parts[0]
    fits = (
        len(parts) == 3
        and first.numel() > 0
        and all(
            p.dim() == 2 and p.dtype == first.dtype and p.shape[0] == first.shape[0] and p.stride(1) == 1
            and p.shape[1] % groups == 0
            for p in parts
        )
        and _cast_fits(first, fp8_dtype, scale, amax, amax_record)
        and _triton_cast_fits(*parts)
    )  # fmt: skip
    if fits:
        from ..triton_kernels import fp8_cast as kernels

        fits = kernels.packed_block_fits(tuple(p.shape[1] // groups for p in parts))
    if not fits:  # this backend's casts of the concatenation
        x = reference.pack_columns(parts, groups)
        if dbias:
            return fp8_cast_dbias(x, fp8_dtype, **args)
        return (*fp8_cast(x, fp8_dtype, **args), None)
    return kernels.cast_packed(parts, groups, fp8_dtype, dbias=dbias, **args)


def fp8_transpose(q: torch.Tensor) -> torch.Tensor:
    """The Triton transpose for a 2-D FP8 tensor with contiguous rows on the kernel device."""
    if _compiling() or q.dim() != 2 or q.element_size() != 1 or q.stride(1) != 1 or not on_kernel_device(q):
        return reference.fp8_transpose(q)
    from ..triton_kernels import fp8_transpose as kernels

    return kernels.transpose(q)


def _fits_scaled_mm(a: torch.Tensor, b: torch.Tensor, a_sinv: torch.Tensor, b_sinv: torch.Tensor) -> bool:
    """``_scaled_mm`` takes ``a [M, K]`` row-major x ``b^T [K, N]`` column-major with K and N
    multiples of 16, not two e5m2 operands, and scales that are both per-tensor or both per-row."""
    if not (a.is_cuda and b.is_cuda and a.dtype in _FP8 and b.dtype in _FP8):
        return False
    if a.dtype == b.dtype == torch.float8_e5m2:
        return False
    if a.shape[1] % 16 or b.shape[0] % 16 or not (a.is_contiguous() and b.is_contiguous()):
        return False
    return (a_sinv.numel() == 1) == (b_sinv.numel() == 1)


SCALE_ALIGN_BYTES = 16
"""cuBLASLt refuses FP8 GEMM scale pointers that are not 16-byte aligned (CUBLAS_STATUS_NOT_SUPPORTED;
measured on an H100 with ``torch._scaled_mm``: a 0-d scale viewed at byte offset 4, 8, 12 or 380 of an
fp32 buffer fails, at 0 or 16 it runs)."""


def _aligned_scale(scale: torch.Tensor) -> torch.Tensor:
    """``scale``, or a copy of it when its address is not :data:`SCALE_ALIGN_BYTES`-aligned (a view
    into a table of scales, say): the GEMM then reads the copy."""
    if scale.data_ptr() % SCALE_ALIGN_BYTES == 0:
        return scale
    return scale.clone()


def _scaled_mm_nt(a, b, a_sinv, b_sinv, out_dtype, *, fast_accum: bool, bias=None, out=None) -> torch.Tensor:
    """``(a * a_sinv) @ (b * b_sinv)^T`` on the FP8 tensor cores, in ``out_dtype`` (written into ``out``
    when given: a contiguous ``[M, N]`` tensor of ``out_dtype``)."""
    rowwise = a_sinv.numel() != 1
    if rowwise:
        sa, sb = a_sinv.reshape(-1, 1).float(), b_sinv.reshape(1, -1).float()
        gemm_dtype = torch.bfloat16
    else:
        sa, sb = a_sinv.reshape(()).float(), b_sinv.reshape(()).float()
        gemm_dtype = out_dtype
    sa, sb = _aligned_scale(sa), _aligned_scale(sb)
    fuse_bias = bias is not None and bias.dtype == gemm_dtype and gemm_dtype != torch.float32
    if out is not None and gemm_dtype == out.dtype and not (bias is not None and not fuse_bias):
        # the GEMM's epilogue writes ``out`` (cuBLASLt D): no temporary, no copy
        return torch._scaled_mm(
            a, b.t(), scale_a=sa, scale_b=sb, bias=bias if fuse_bias else None, out_dtype=gemm_dtype,
            use_fast_accum=fast_accum, out=out,
        )  # fmt: skip
    result = torch._scaled_mm(
        a,
        b.t(),
        scale_a=sa,
        scale_b=sb,
        bias=bias if fuse_bias else None,
        out_dtype=gemm_dtype,
        use_fast_accum=fast_accum,
    )
    if bias is not None and not fuse_bias:
        result = (result.float() + bias.float()).to(out_dtype)
    if out is not None:
        return out.copy_(result)
    return result.to(out_dtype)


def scaled_linear_forward(x_q, w_q, x_scale_inv, w_scale_inv, bias, out_dtype) -> torch.Tensor:
    if not _fits_scaled_mm(x_q, w_q, x_scale_inv, w_scale_inv):
        return reference.scaled_linear_forward(x_q, w_q, x_scale_inv, w_scale_inv, bias, out_dtype)
    return _scaled_mm_nt(x_q, w_q, x_scale_inv, w_scale_inv, out_dtype, fast_accum=True, bias=bias)


def scaled_linear_dgrad(dy_q, w_qT, dy_scale_inv, w_scale_inv, out_dtype) -> torch.Tensor:
    if not _fits_scaled_mm(dy_q, w_qT, dy_scale_inv, w_scale_inv):
        return reference.scaled_linear_dgrad(dy_q, w_qT, dy_scale_inv, w_scale_inv, out_dtype)
    return _scaled_mm_nt(dy_q, w_qT, dy_scale_inv, w_scale_inv, out_dtype, fast_accum=False)


def scaled_linear_wgrad(
    dy_qT, x_qT, dy_scale_inv, x_scale_inv, out_dtype, main_grad=None, accumulate=True
) -> torch.Tensor:
    """``torch._scaled_mm`` has no beta (it cannot add into its output): the accumulating form computes
    ``dW`` into a temporary and adds it; the overwriting form (``accumulate=False``, a step's first
    gradient) lets the GEMM write ``main_grad`` itself (``out=``), which saves that add and the
    zeroing of ``main_grad`` that the DDP then skips."""
    if not _fits_scaled_mm(dy_qT, x_qT, dy_scale_inv, x_scale_inv):
        return reference.scaled_linear_wgrad(
            dy_qT, x_qT, dy_scale_inv, x_scale_inv, out_dtype, main_grad, accumulate
        )
    if main_grad is None:
        return _scaled_mm_nt(dy_qT, x_qT, dy_scale_inv, x_scale_inv, out_dtype, fast_accum=False)
    # cuBLASLt's output must be 16-byte aligned; a main_grad view may start anywhere in its buffer
    if not accumulate and main_grad.is_contiguous() and main_grad.data_ptr() % 16 == 0:
        return _scaled_mm_nt(
            dy_qT, x_qT, dy_scale_inv, x_scale_inv, main_grad.dtype, fast_accum=False, out=main_grad
        )
    dw = _scaled_mm_nt(dy_qT, x_qT, dy_scale_inv, x_scale_inv, main_grad.dtype, fast_accum=False)
    return main_grad.add_(dw) if accumulate else main_grad.copy_(dw)


FP8_OPS = {
    "fp8_quantize": fp8_quantize,
    "fp8_amax": fp8_amax,
    "fp8_cast": fp8_cast,
    "fp8_cast_dbias": fp8_cast_dbias,
    "fp8_cast_packed": fp8_cast_packed,
    "fp8_transpose": fp8_transpose,
    "scaled_linear_forward": scaled_linear_forward,
    "scaled_linear_dgrad": scaled_linear_dgrad,
    "scaled_linear_wgrad": scaled_linear_wgrad,
}
"""The ops this module serves (``cuda:scaled_mm`` / ``cuda:inductor`` in ``mcore-info``)."""


def fp8_capabilities() -> set[str]:
    """``fp8`` on compute capability >= 8.9 (Ada, Hopper, Blackwell), ``fp8_rowwise`` on Hopper (9.0),
    where ``torch._scaled_mm`` takes row scales."""
    if not torch.cuda.is_available():
        return set()
    caps = set()
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) >= (8, 9) and hasattr(torch, "_scaled_mm"):
        caps.add("fp8")
        if major == 9:
            caps.add("fp8_rowwise")
    return caps
