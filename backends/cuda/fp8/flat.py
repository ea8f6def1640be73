"""The flat FP8 maps of ``--fp8-param-gather`` (:mod:`mcore.fp8.param_gather`) on CUDA: one Triton
launch over every weight's piece (:mod:`mcore.backends.cuda.triton_kernels.fp8_flat`), the reference
elsewhere."""

from __future__ import annotations

import torch

from mcore.ops import reference

from ..device import on_kernel_device, tracing

_FLOAT = (torch.float32, torch.bfloat16, torch.float16)


def fp8_quantize_flat(params, fp8):
    """The reference ``fp8_quantize_flat`` as one Triton launch over every piece (``--fp8-param-gather``,
    tensorwise: instead of a quantize and a copy per weight)."""
    if (
        not tracing()
        and params.dtype in _FLOAT
        and fp8.data.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
        and on_kernel_device(params, fp8.data, fp8.scales)
    ):
        from ..triton_kernels import fp8_flat

        fp8_flat.fp8_quantize_flat(params, fp8)
    else:
        reference.fp8_quantize_flat(params, fp8)


def fp8_dequantize_flat(params, data, scale_inv, ranges):
    """The reference ``fp8_dequantize_flat`` as one Triton launch over every run (``--fp8-param-gather``
    after a bucket's gather: instead of a multiply and a copy per weight and run)."""
    if (
        not tracing()
        and params.dtype in (torch.float32, torch.bfloat16)  # fp16: the reference (fp8_flat)
        and data.dtype == torch.float8_e4m3fn
        and on_kernel_device(params, data, scale_inv)
    ):
        from ..triton_kernels import fp8_flat

        fp8_flat.fp8_dequantize_flat(params, data, scale_inv, ranges)
    else:
        reference.fp8_dequantize_flat(params, data, scale_inv, ranges)
