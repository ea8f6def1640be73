"""The context-parallel attention ops on CUDA: ``attention_with_lse`` and its backward on PyTorch's
FlashAttention-2 kernels (``aten::_scaled_dot_product_flash_attention`` returns the log-sum-exp, and
``aten::_scaled_dot_product_flash_attention_backward`` takes any ``out``/``lse``, so a ring block's
backward runs from the merged results as the contract asks); ``attention_merge`` is the reference's
few element-wise passes (memory-bound, a small fraction of a block's attention: see
``benchmarks/ring_attention_bench.py``).

What the kernel serves: CUDA tensors in bf16/fp16 (one dtype), 4-D ``[b, n, s, d]``, ``d % 8 == 0``,
``d <= 256``; GQA natively (K/V keep their ``g`` heads; the backward sums ``dk``/``dv`` itself).
Anything else (fp32, CPU tensors, odd head dims, under ``torch.compile`` tracing) runs the reference.

Causal alignment: mcore's triangle is aligned at the end (query ``i`` sees keys ``j <= i + sk - sq``);
the kernel's ``is_causal`` is used only for ``sq == sk``, where the alignments agree. Other shapes are
split exactly:

* ``sq < sk``: keys ``[0, sk - sq)`` are visible to every query (``is_causal=False``), the last ``sq``
  keys form a square causal block; the two partials are merged through their log-sum-exps and the
  backward runs once per part (``dq`` summed, ``dk``/``dv`` concatenated);
* ``sq > sk``: the first ``sq - sk`` rows see no key (``out`` 0, ``lse`` -inf, ``dq`` 0), the last
  ``sk`` rows are a square causal block.

The LSE: ``[b, n, sq]`` fp32, unpadded for FlashAttention (the efficient kernel pads its last dim to a
multiple of 32; it is not used here). In the backward an ``lse`` of -inf (a row without any visible
key in any block) is passed as +inf so ``exp(S - lse)`` is 0 there, not NaN.
"""

from __future__ import annotations

import torch

from mcore.ops import reference

from .device import tracing

_FLASH_DTYPES = (torch.float16, torch.bfloat16)


def flash_fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the FlashAttention kernels serve these inputs (see the module docstring)."""
    return (
        q.is_cuda
        and q.dim() == 4
        and q.dtype in _FLASH_DTYPES
        and q.dtype == k.dtype == v.dtype
        and q.shape[-1] == k.shape[-1] == v.shape[-1]
        and q.shape[-1] % 8 == 0
        and q.shape[-1] <= 256
        and q.shape[1] % k.shape[1] == 0
        and not tracing()
    )


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _flash_forward(q, k, v, causal: bool, scale: float | None):
    """One kernel call: ``(out [b, n, sq, d], lse [b, n, sq] fp32)``."""
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return res[0], res[1]


def _flash_backward(dout, q, k, v, out, lse, causal: bool, scale: float | None):
    """One kernel call of the backward from ``out``/``lse`` (dropout 0: the Philox state is unused)."""
    q, k, v, dout, out = (_last_dim_contiguous(t) for t in (q, k, v, dout, out))
    lse = torch.where(torch.isneginf(lse), float("inf"), lse).contiguous()
    # dense batches: no cumulative lengths (None, as the forward returns them; an empty tensor would
    # mean variable lengths); the Philox state is read only with dropout
    seed = torch.empty(2, dtype=torch.uint64, device=q.device)
    offset = torch.empty((), dtype=torch.uint64, device=q.device)
    sq, sk = q.shape[2], k.shape[2]
    grads = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, None, None, sq, sk, 0.0, causal, seed, offset, scale=scale
    )
    dq, dk, dv = grads
    return dq, dk, dv


def attention_with_lse(q, k, v, *, causal: bool = True, scale: float | None = None):
    """The reference ``attention_with_lse`` on FlashAttention (bf16/fp16 CUDA tensors), else the reference."""
    if not flash_fits(q, k, v):
        return reference.attention_with_lse(q, k, v, causal=causal, scale=scale)
    sq, sk = q.shape[2], k.shape[2]
    if not causal or sq == sk:
        return _flash_forward(q, k, v, causal, scale)
    if sq < sk:  # earlier keys in full, the last sq keys causal
        cut = sk - sq
        early = _flash_forward(q, k[:, :, :cut], v[:, :, :cut], False, scale)
        own = _flash_forward(q, k[:, :, cut:], v[:, :, cut:], True, scale)
        return reference.attention_merge(*early, *own)
    cut = sq - sk  # rows [0, cut) see no key
    tail_out, tail_lse = _flash_forward(q[:, :, cut:], k, v, True, scale)
    out = torch.cat([tail_out.new_zeros(*q.shape[:2], cut, v.shape[-1]), tail_out], dim=2)
    lse = torch.cat([tail_lse.new_full((*q.shape[:2], cut), float("-inf")), tail_lse], dim=2)
    return out, lse


def attention_with_lse_backward(dout, q, k, v, out, lse, *, causal: bool = True, scale: float | None = None):
    """The reference ``attention_with_lse_backward`` on FlashAttention's backward, else the reference."""
    if not (flash_fits(q, k, v) and dout.dtype == out.dtype == q.dtype):
        return reference.attention_with_lse_backward(dout, q, k, v, out, lse, causal=causal, scale=scale)
    lse = lse.float()
    sq, sk = q.shape[2], k.shape[2]
    if not causal or sq == sk:
        return _flash_backward(dout, q, k, v, out, lse, causal, scale)
    if sq < sk:
        cut = sk - sq
        dq_a, dk_a, dv_a = _flash_backward(dout, q, k[:, :, :cut], v[:, :, :cut], out, lse, False, scale)
        dq_b, dk_b, dv_b = _flash_backward(dout, q, k[:, :, cut:], v[:, :, cut:], out, lse, True, scale)
        return dq_a + dq_b, torch.cat([dk_a, dk_b], dim=2), torch.cat([dv_a, dv_b], dim=2)
    cut = sq - sk
    rows = slice(cut, sq)
    dq_t, dk, dv = _flash_backward(
        dout[:, :, rows], q[:, :, rows], k, v, out[:, :, rows], lse[:, :, rows], True, scale
    )
    dq = torch.cat([dq_t.new_zeros(*q.shape[:2], cut, q.shape[-1]), dq_t], dim=2)
    return dq, dk, dv


ATTENTION_LSE_OPS = {
    "attention_with_lse": attention_with_lse,
    "attention_with_lse_backward": attention_with_lse_backward,
}
"""The ops this module serves (``attention_merge`` stays the reference on CUDA)."""
