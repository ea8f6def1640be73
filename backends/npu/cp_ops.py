"""Context-parallel attention ops on CANN: mcore's ``attention_with_lse``, its backward and
``attention_merge`` (:mod:`mcore.ops.reference.attention_lse`) on torch_npu's ring-attention kernels.

========================  ===========================================================================
op                        conversion
========================  ===========================================================================
``attention_with_lse``    ``npu_fusion_attention`` in ``"BNSD"`` (mcore's layout; K/V keep their ``g``
                          heads), explicit ``scale``, ``keep_prob=1``. The op returns the softmax
                          statistics ``softmax_max``/``softmax_sum`` ``[b, n, sq, 8]`` (8 equal
                          values): ``lse = max + log(sum)`` of the first. Causal with ``sq == sk``:
                          the compressed ``triu`` mask, ``sparse_mode=2``; ``sq < sk``: ``3``
                          (rightDownCausal, mcore's end alignment); ``sq > sk``: the first
                          ``sq - sk`` rows see no key (out 0, lse -inf, not sent to the kernel: the
                          op's result for such rows is implementation-defined), the rest is a square
                          causal block.
``..._backward``          ``npu_fusion_attention_grad`` with the MERGED statistics and output:
                          ``softmax_max = lse``, ``softmax_sum = 1`` (``exp(S - max) / sum`` is then
                          ``exp(S - lse)``), ``attention_in = out``, ``scale_value``; the same mask
                          and sparse mode as the forward. An lse of -inf (no key in any block) is sent
                          as +inf so the row's probabilities are 0.
``attention_merge``       ``npu_ring_attention_update`` on ``"SBH"`` (its default in torch_npu and in
                          MindSpeed's build alike, so the six tensors go positionally): out
                          ``[b, n, s, d] -> [s, b, n*d]`` and back, statistics ``max = lse``,
                          ``sum = 1``; a -inf lse is sent as a finite floor (``-1e30``) whose weight
                          underflows to 0 (the op wants finite statistics), and a merged max equal
                          to the floor (both inputs without keys) comes back as lse -inf.
========================  ===========================================================================

Inputs the kernels are not documented for (other dtypes, 3-D tensors, head dims over 768, query
heads not a multiple of K/V heads) run the reference, like :mod:`mcore.backends.npu.ops`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import ModuleType

import torch

from mcore.ops import reference

from .fusion_masks import FLOAT_DTYPES, compressed_causal_mask

LSE_FLOOR = -1e30
"""The finite stand-in for an lse of -inf sent to ``npu_ring_attention_update``."""


def _serves(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    return (
        q.dim() == 4
        and q.dtype in FLOAT_DTYPES
        and q.dtype == k.dtype == v.dtype
        and q.shape[-1] == k.shape[-1] == v.shape[-1] <= 768
        and q.shape[1] % k.shape[1] == 0
        and (q.shape[1] == k.shape[1] or q.shape[1] <= 256)
    )


def _mask_kwargs(q: torch.Tensor, sq: int, sk: int, causal: bool, scale: float | None) -> dict:
    """The scale and, for ``causal`` (``sq <= sk``), the compressed mask and its sparse mode."""
    kwargs: dict = {"keep_prob": 1.0, "scale": 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale}
    if causal:
        kwargs.update(atten_mask=compressed_causal_mask(q.device), sparse_mode=2 if sq == sk else 3)
    return kwargs


def _stats8(x: torch.Tensor) -> torch.Tensor:
    """``[b, n, s]`` -> the kernels' ``[b, n, s, 8]`` (8 equal values)."""
    return x.unsqueeze(-1).expand(*x.shape, 8)


def _attention_lse_ops(torch_npu: ModuleType) -> dict[str, Callable]:
    def block(q, k, v, causal, scale):
        n = q.shape[1]
        res = torch_npu.npu_fusion_attention(
            q, k, v, n, "BNSD", **_mask_kwargs(q, q.shape[2], k.shape[2], causal, scale)
        )
        return res[0], res[1][..., 0] + torch.log(res[2][..., 0])

    def attention_with_lse(q, k, v, *, causal=True, scale=None):
        """``attention_with_lse`` through ``npu_fusion_attention``'s softmax statistics."""
        if not _serves(q, k, v):
            return reference.attention_with_lse(q, k, v, causal=causal, scale=scale)
        sq, sk = q.shape[2], k.shape[2]
        if not (causal and sq > sk):
            return block(q, k, v, causal, scale)
        cut = sq - sk  # rows [0, cut) see no key
        out, lse = block(q[:, :, cut:].contiguous(), k, v, True, scale)
        out = torch.cat([out.new_zeros(*q.shape[:2], cut, v.shape[-1]), out], dim=2)
        return out, torch.cat([lse.new_full((*q.shape[:2], cut), float("-inf")), lse], dim=2)

    def grad_block(dout, q, k, v, out, lse, causal, scale):
        kwargs = _mask_kwargs(q, q.shape[2], k.shape[2], causal, scale)
        kwargs["scale_value"] = kwargs.pop("scale")
        lse = torch.where(torch.isneginf(lse), float("inf"), lse.float())
        dq, dk, dv, *_ = torch_npu.npu_fusion_attention_grad(
            q, k, v, dout, q.shape[1], "BNSD", softmax_max=_stats8(lse).contiguous(),
            softmax_sum=torch.ones_like(lse).unsqueeze(-1).expand(*lse.shape, 8).contiguous(),
            attention_in=out, **kwargs,
        )  # fmt: skip
        return dq, dk, dv

    def attention_with_lse_backward(dout, q, k, v, out, lse, *, causal=True, scale=None):
        """``attention_with_lse_backward`` through ``npu_fusion_attention_grad`` from the merged stats."""
        if not (_serves(q, k, v) and dout.dtype == out.dtype == q.dtype):
            return reference.attention_with_lse_backward(dout, q, k, v, out, lse, causal=causal, scale=scale)
        sq, sk = q.shape[2], k.shape[2]
        if not (causal and sq > sk):
            return grad_block(dout, q, k, v, out, lse, causal, scale)
        cut = sq - sk
        rows = slice(cut, sq)
        part = (t[:, :, rows].contiguous() for t in (dout, q))
        dq, dk, dv = grad_block(*part, k, v, out[:, :, rows].contiguous(), lse[:, :, rows], True, scale)
        return torch.cat([dq.new_zeros(*q.shape[:2], cut, q.shape[-1]), dq], dim=2), dk, dv

    return {
        "attention_with_lse": attention_with_lse,
        "attention_with_lse_backward": attention_with_lse_backward,
    }


def _merge_ops(torch_npu: ModuleType) -> dict[str, Callable]:
    def attention_merge(out_a, lse_a, out_b, lse_b):
        """``attention_merge`` through ``npu_ring_attention_update`` (SBH, ``max = lse``, ``sum = 1``)."""
        if out_a.dim() != 4 or out_a.dtype not in FLOAT_DTYPES or out_a.dtype != out_b.dtype:
            return reference.attention_merge(out_a, lse_a, out_b, lse_b)
        b, n, s, d = out_a.shape

        def sbh(out):
            return out.permute(2, 0, 1, 3).reshape(s, b, n * d)

        def stats(lse):
            return _stats8(torch.where(torch.isneginf(lse), LSE_FLOOR, lse.float()))

        ones = torch.ones(1, dtype=torch.float32, device=out_a.device).expand(b, n, s, 8)
        out, m, l_ = torch_npu.npu_ring_attention_update(
            sbh(out_a), stats(lse_a), ones, sbh(out_b), stats(lse_b), ones
        )
        m, l_ = m[..., 0], l_[..., 0]
        lse = torch.where(m == LSE_FLOOR, float("-inf"), m + torch.log(l_))
        return out.view(s, b, n, d).permute(1, 2, 0, 3), lse

    return {"attention_merge": attention_merge}


BUILDERS: tuple[tuple[str, Callable[[ModuleType], dict[str, Callable]]], ...] = (
    ("npu_fusion_attention_grad", _attention_lse_ops),
    ("npu_ring_attention_update", _merge_ops),
)
"""The torch_npu kernel each group needs (``npu_fusion_attention_grad`` implies the forward)."""
