"""The FP8 copies of the FP8 weights over a flat parameter buffer, and their inverse (kernels:
``backends/cuda/triton_kernels/fp8_flat.py``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mcore.ops.flat import FlatFp8Weights
from mcore.ops.reference.fp8 import fp8_quantize


def fp8_quantize_flat(params: torch.Tensor, fp8: FlatFp8Weights) -> None:
    """The FP8 copies of this rank's pieces of the FP8 weights, in place (``--fp8-param-gather`` with
    the tensorwise recipe: the quantization after the optimizer step, whose scales need the new
    weights' amax first; :mod:`mcore.fp8.param_gather`).

    ``params [N]`` (bf16, fp16 or fp32) is the flat parameter buffer, ``fp8`` a
    :class:`mcore.ops.flat.FlatFp8Weights` over the same buffer space: ``data [N]`` float8,
    ``scales [W]`` fp32 and ``ranges``, ``(start, end, i)`` per piece of FP8 weight ``i``::

        data[start:end] = saturate(params[start:end] * scales[i])  in fp8, round to nearest even

    exactly :func:`fp8_quantize` of each piece (its bytes). Empty pieces are skipped, every other byte
    of ``data`` is left as it is, and ``fp8.amax`` is neither read nor written (the scales were formed
    from it before). A backend writes every piece in one launch, without reading anything on the host.
    """
    for start, end, index in fp8.ranges:
        if end > start:
            fp8.data[start:end] = fp8_quantize(params[start:end], fp8.scales[index], fp8.data.dtype)


def fp8_dequantize_flat(
    params: torch.Tensor,
    data: torch.Tensor,
    scale_inv: torch.Tensor,
    ranges: Sequence[tuple[int, int, int]],
) -> None:
    """The inverse of :func:`fp8_quantize_flat` into the parameters, in place (``--fp8-param-gather``
    after a bucket's FP8 all-gather: the weights other ranks quantized, as the forward computes with
    them).

    ``params [N]`` (bf16, fp16 or fp32) and ``data [N]`` float8 share the buffer space,
    ``scale_inv [W]`` fp32 (any stride) holds weight ``i``'s ``1 / scale``, ``ranges`` lists
    ``(start, end, i)`` runs of FP8 weight ``i``::

        params[start:end] = (float(data[start:end]) * scale_inv[i])  rounded to params' dtype
                            (fp32 product, round to nearest even)

    Empty runs are skipped and every other element of ``params`` is left as it is.
    """
    for start, end, index in ranges:
        if end > start:
            params[start:end].copy_(data[start:end].float() * scale_inv[index])
