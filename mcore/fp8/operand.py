"""The FP8 operand of the core: an FP8 tensor with its transpose and its scale, as one value.

The op table keeps its contract (``fp8_cast`` and the producers return ``(q, qT, scale_inv, ...)``
tuples, :mod:`mcore.ops.reference`); the core wraps those results where it calls the ops
(:meth:`Fp8Tensor.of`) and reads the operand's parts by name when it calls the GEMMs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class Fp8Tensor:
    """An FP8 operand of the ``scaled_linear`` GEMMs.

    Attributes:
        data: ``q [M, K]`` in an FP8 format, ``x ~= q * scale_inv`` (None when a cast wrote only the
            transpose, ``rowwise=False``).
        scale_inv: fp32, one element (per-tensor recipes) or ``[M, 1]`` (rowwise): ``1 / scale``.
        transpose: ``q^T [K, M]`` contiguous, the NT operand of the other GEMMs (the weight gradient's,
            the input gradient's), written by the same cast; None when not asked for.

    A weight quantized once per optimizer step and all-gathered in FP8 (``--fp8-param-gather``,
    :mod:`mcore.fp8.param_gather`) is one too: ``data`` is ``W_q [N, K]`` in the forward format
    (e4m3), a view into the all-gathered buffer, with its 0-dim ``scale_inv`` (the same on every
    data-parallel rank); the FP8 linear uses it instead of casting ``W``.
    """

    data: torch.Tensor | None
    scale_inv: torch.Tensor
    transpose: torch.Tensor | None = None

    @classmethod
    def of(cls, result) -> Fp8Tensor:
        """The operand in an op's result ``(q, qT, scale_inv, ...)`` (``fp8_cast``, ``fp8_cast_dbias``,
        ``fp8_cast_packed``, ``act_fp8_*``, ``norm_fp8_forward``: their first three results)."""
        q, q_t, scale_inv = result[:3]
        return cls(q, scale_inv, q_t)


__all__ = ["Fp8Tensor"]
