"""The CUDA backend's FP8 grouped GEMMs (the experts' ``scaled_grouped_gemm`` and
``scaled_grouped_gemm_wgrad``) on ``torch._scaled_grouped_mm``:
``(self, mat2, scale_a, scale_b, offs=None, bias=None, scale_result=None, out_dtype=None,
use_fast_accum=False)`` in torch 2.11 and 2.13 (CUTLASS, Hopper, float32 rowwise scales).

* ``scaled_grouped_gemm``: 2-D x 3-D, groups along the rows: ``mat_a = a_q [N, K]`` (row-major),
  ``mat2 = b_q^T`` (the ``[E, M, K]`` operand viewed as ``[E, K, M]``, column-major), ``scale_a =
  a_scale_inv [N]``, ``scale_b = b_scale_inv [E, M]``, ``offs = cumsum(counts)`` int32.
* ``scaled_grouped_gemm_wgrad``: 2-D x 2-D, groups along the contraction dim (the tokens):
  ``mat_a = a_qT [M, N]``, ``mat2 = b_qT^T [N, K]`` (column-major), scales ``[E * M]`` and ``[E * K]``
  (one block per group). A group's first column must be 16-byte aligned for the kernel's loads, so
  the token columns are first copied into a buffer where each expert's block starts at a multiple of
  16 (zero columns between: they add nothing to the sums); its width ``N + 16 E`` (rounded up to 16) is
  known on the host, the positions are computed on the device: no host sync. An expert without
  tokens gets its block of ``dW`` zeroed explicitly.

The kernel takes e4m3 operands (both), K and M multiples of 16, bf16 output; anything else (e5m2
or int8 operands, fp32 output, other shapes, CPU tensors) runs the reference.
"""

from __future__ import annotations

import os

import torch

from mcore.ops import reference

_ALIGN = 16  # elements of an FP8 operand: 16 bytes

KERNEL_ON_CPU = False
"""Let the wrappers take CPU tensors (tests only: a stand-in for ``torch._scaled_grouped_mm``, which
has no CPU implementation, checks the layouts and offsets they pass)."""


def _kernel_fits(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, *dims: int) -> bool:
    return (
        hasattr(torch, "_scaled_grouped_mm")
        and (a.is_cuda or (KERNEL_ON_CPU and a.device.type == "cpu"))
        and b.device == a.device
        and a.dtype == b.dtype == torch.float8_e4m3fn
        and out_dtype == torch.bfloat16
        and a.is_contiguous()
        and b.is_contiguous()
        and all(d % _ALIGN == 0 for d in dims)
    )


def _offsets(tokens_per_expert: torch.Tensor, device) -> torch.Tensor:
    return torch.cumsum(tokens_per_expert.to(device), 0, dtype=torch.int32)


def scaled_grouped_gemm(a_q, b_q, a_scale_inv, b_scale_inv, tokens_per_expert, out_dtype) -> torch.Tensor:
    if not (
        a_q.dim() == 2
        and b_q.dim() == 3
        and a_q.shape[1] == b_q.shape[2]
        and tokens_per_expert.shape == (b_q.shape[0],)
        and _kernel_fits(a_q, b_q, out_dtype, a_q.shape[1], b_q.shape[1])
    ):
        return reference.scaled_grouped_gemm(a_q, b_q, a_scale_inv, b_scale_inv, tokens_per_expert, out_dtype)
    if a_q.shape[0] == 0:  # a rank that received no token
        return torch.empty(0, b_q.shape[1], dtype=out_dtype, device=a_q.device)
    return torch._scaled_grouped_mm(
        a_q,
        b_q.transpose(-2, -1),
        a_scale_inv.float().contiguous(),
        b_scale_inv.float().contiguous(),
        offs=_offsets(tokens_per_expert, a_q.device),
        out_dtype=out_dtype,
    )


def _aligned_columns(
    t: torch.Tensor, tokens_per_expert: torch.Tensor, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``t [R, N]`` (columns grouped by expert) copied into ``[R, width]`` where expert ``e``'s block
    starts at a multiple of 16, zeros elsewhere; with the int32 end offsets of the blocks (the last
    one extended to ``width``, over zero columns)."""
    counts = tokens_per_expert.to(t.device, torch.int64)
    n = t.shape[1]
    padded = (counts + _ALIGN - 1) // _ALIGN * _ALIGN
    starts = torch.cumsum(counts, 0) - counts
    padded_starts = torch.cumsum(padded, 0) - padded
    expert = torch.repeat_interleave(torch.arange(counts.numel(), device=t.device), counts, output_size=n)
    dest = padded_starts[expert] + torch.arange(n, device=t.device) - starts[expert]
    out = torch.zeros(t.shape[0], width, dtype=torch.uint8, device=t.device)
    out.index_copy_(1, dest, t.view(torch.uint8))
    ends = torch.cumsum(padded, 0)
    ends[-1] = width
    return out.view(t.dtype), ends.to(torch.int32)


def scaled_grouped_gemm_wgrad(
    a_qT, b_qT, a_scale_inv, b_scale_inv, tokens_per_expert, out_dtype
) -> torch.Tensor:
    experts = tokens_per_expert.shape[0] if tokens_per_expert.dim() == 1 else 0
    if not (
        experts > 0
        and a_qT.dim() == 2
        and b_qT.dim() == 2
        and a_qT.shape[1] == b_qT.shape[1]
        and a_scale_inv.shape == (experts, a_qT.shape[0])
        and b_scale_inv.shape == (experts, b_qT.shape[0])
        and _kernel_fits(a_qT, b_qT, out_dtype, a_qT.shape[0], b_qT.shape[0])
    ):
        return reference.scaled_grouped_gemm_wgrad(
            a_qT, b_qT, a_scale_inv, b_scale_inv, tokens_per_expert, out_dtype
        )
    if a_qT.shape[1] == 0:
        return torch.zeros(experts, a_qT.shape[0], b_qT.shape[0], dtype=out_dtype, device=a_qT.device)
    width = (a_qT.shape[1] + _ALIGN * experts + _ALIGN - 1) // _ALIGN * _ALIGN
    a_pad, offs = _aligned_columns(a_qT, tokens_per_expert, width)
    b_pad, _ = _aligned_columns(b_qT, tokens_per_expert, width)
    dw = torch._scaled_grouped_mm(
        a_pad,
        b_pad.t(),
        a_scale_inv.float().reshape(-1).contiguous(),
        b_scale_inv.float().reshape(-1).contiguous(),
        offs=offs,
        out_dtype=out_dtype,
    )
    empty = tokens_per_expert.to(dw.device) == 0
    return dw.masked_fill_(empty[:, None, None], 0)


GROUPED_FP8_OPS = {
    "scaled_grouped_gemm": scaled_grouped_gemm,
    "scaled_grouped_gemm_wgrad": scaled_grouped_gemm_wgrad,
}
GROUPED_FP8_PROVIDER = "scaled-grouped-mm"


OPT_IN_ENV = "MCORE_CUDA_FP8_EXPERTS"
"""Set to 1 to claim ``fp8_grouped_gemm`` (see :func:`grouped_fp8_capabilities`)."""


def grouped_fp8_capabilities() -> set[str]:
    """``fp8_grouped_gemm`` on Hopper (compute capability 9.x), where ``torch._scaled_grouped_mm``
    serves float32 rowwise scales, only when ``MCORE_CUDA_FP8_EXPERTS=1``.

    The ops are served either way (the table, the GPU test); the capability, which makes the MoE
    experts run FP8 under ``--fp8-format``, is opt-in because on an H200 with torch 2.11 the FP8
    experts measured slower than bf16 ones (benchmarks/README.md, 2026-11-29: the scaled grouped
    GEMMs alone 78.9 ms a step against the bf16 grouped GEMMs' 63 ms for OLMoE's shape, before the
    quantization's cost), so ``--fp8-format`` keeps the experts in bf16 and runs the dense linears FP8.
    """
    if os.environ.get(OPT_IN_ENV, "0") != "1":
        return set()
    if not (torch.cuda.is_available() and hasattr(torch, "_scaled_grouped_mm")):
        return set()
    return {"fp8_grouped_gemm"} if torch.cuda.get_device_capability()[0] == 9 else set()
