"""The ops ``act_fp8_forward`` and ``act_fp8_backward`` on CUDA: the MLP activation fused with its FP8 cast.

Each dispatcher runs the Triton kernel of :mod:`mcore.backends.cuda.triton_kernels.act_fp8` when the
call fits it (2-D tensors with a unit stride on the last dim, on one CUDA device or under Triton's
interpreter; a float dtype; a bias of ``h``'s width and dtype; a one-element fp32 scale and amax
slot) and the reference otherwise, and inside ``torch.compile``. The kernel writes exactly the bytes
of the unfused path (the activation kernel, then ``fp8_cast``).
"""

from __future__ import annotations

import torch

from mcore.ops import reference

from ..device import on_kernel_device

_FLOAT = (torch.float32, torch.bfloat16, torch.float16)
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _fits(h, bias, kind, fp8_dtype, scale, amax_record, *others) -> bool:
    width = h.shape[-1] if h.dim() == 2 else 0
    return (
        not torch.compiler.is_compiling()
        and kind in reference.ACTIVATIONS
        and h.dim() == 2
        and h.numel() > 0
        and h.dtype in _FLOAT
        and h.stride(1) == 1
        and (kind != "swiglu" or width % 2 == 0)
        and (bias is None or (bias.shape == (width,) and bias.dtype == h.dtype and bias.is_contiguous()))
        and fp8_dtype in _FP8
        and scale.numel() == 1
        and scale.dtype == torch.float32
        and (amax_record is None or (amax_record.numel() == 1 and amax_record.dtype == torch.float32))
        and on_kernel_device(h, bias, scale, amax_record, *others)
    )


def act_fp8_forward(
    h, bias, kind, fp8_dtype, scale, amax_record=None, rowwise=True, columnwise=True
):  # fmt: skip
    if not _fits(h, bias, kind, fp8_dtype, scale, amax_record):
        return reference.act_fp8_forward(h, bias, kind, fp8_dtype, scale, amax_record, rowwise, columnwise)
    from ..triton_kernels import act_fp8 as kernels

    return kernels.act_fp8_forward(h, bias, kind, fp8_dtype, scale, amax_record, rowwise, columnwise)


def act_fp8_backward(
    grad_output, h, bias, kind, fp8_dtype, scale, amax_record=None, rowwise=True, columnwise=True
):  # fmt: skip
    width = h.shape[-1] // 2 if kind == "swiglu" else h.shape[-1]
    fits = (
        grad_output.dim() == 2
        and grad_output.shape == (h.shape[0], width)
        and grad_output.dtype in _FLOAT
        and grad_output.stride(1) == 1
        and _fits(h, bias, kind, fp8_dtype, scale, amax_record, grad_output)
    )
    if not fits:
        return reference.act_fp8_backward(
            grad_output, h, bias, kind, fp8_dtype, scale, amax_record, rowwise, columnwise
        )
    from ..triton_kernels import act_fp8 as kernels

    return kernels.act_fp8_backward(
        grad_output, h, bias, kind, fp8_dtype, scale, amax_record, rowwise, columnwise
    )


ACT_FP8_OPS = {"act_fp8_forward": act_fp8_forward, "act_fp8_backward": act_fp8_backward}
"""The ops this module serves (``triton`` in ``mcore-info`` where Triton is installed)."""
