"""SIMULATED torch_npu ops of ring attention (context parallelism), on the CPU: the merge of two
FlashAttention results through their softmax statistics (``npu_ring_attention_update``) and the
FlashAttention backward from given statistics and output (what ``npu_fusion_attention_grad`` does
with ``softmax_max``/``softmax_sum``/``attention_in``; :mod:`.ops` calls it from there).

``npu_ring_attention_update`` follows torch_npu's documented API (op-plugin
``npu_ring_attention_update``, CANN ``aclnnRingAttentionUpdateV2``)::

    npu_ring_attention_update(prev_attn_out, prev_softmax_max, prev_softmax_sum, cur_attn_out,
        cur_softmax_max, cur_softmax_sum, *, actual_seq_qlen=None, input_layout="SBH",
        input_softmax_layout="") -> (attn_out, softmax_max, softmax_sum)

MindSpeed's own build of the op (``mindspeed.ops.npu_ring_attention_update``) takes the layout as
``layout="SBH"``; both default to SBH, so a caller passing the six tensors alone works with either.
Math (the documented formula): ``m = max(m_p, m_c)``, ``l = l_p e^(m_p - m) + l_c e^(m_c - m)``,
``out = out_p e^(m_p - m) l_p / l + out_c e^(m_c - m) l_c / l``, in fp32, out cast to its dtype.
SBH: ``attn_out [S, B, H]`` (``H = N * D``), statistics ``[B, N, S, 8]``; TND: ``[T, N, D]`` with
``actual_seq_qlen`` (int64 tensor, cumulative) and statistics ``[T, N, 8]``. The 8 values of the
last axis are equal (the op reads the first).
"""

from __future__ import annotations

import torch
from mcore.backends.npu.simulated.ops import _from_bnsd as from_bnsd
from mcore.backends.npu.simulated.ops import _to_bnsd as to_bnsd

_ATTN_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_update(prev_out, cur_out, stats, actual_seq_qlen, input_layout, input_softmax_layout) -> None:
    """The op-plugin's checks of ``npu_ring_attention_update``'s arguments."""
    op = "npu_ring_attention_update"
    if input_layout not in ("SBH", "TND"):
        raise RuntimeError(f"{op}: input_layout only supports 'SBH' or 'TND', but got {input_layout!r}")
    if input_softmax_layout not in ("", "SBH", "TND"):
        raise RuntimeError(f"{op}: input_softmax_layout only supports '', 'SBH' or 'TND'")
    if prev_out.shape != cur_out.shape or prev_out.dtype != cur_out.dtype:
        raise RuntimeError(f"{op}: prev_attn_out and cur_attn_out must have the same shape and dtype")
    if prev_out.dtype not in _ATTN_DTYPES:
        raise TypeError(
            f"{op}: attn_out dtype only supports float16, float32 or bfloat16, got {prev_out.dtype}"
        )
    if any(s.shape != stats[0].shape for s in stats) or any(s.dtype != torch.float32 for s in stats):
        raise RuntimeError(f"{op}: softmax tensors must keep the same shape and use float32")
    if stats[0].shape[-1] != 8:
        raise RuntimeError(f"{op}: softmax tensors require the last dimension to be 8")
    if prev_out.dim() != 3:
        raise RuntimeError(f"{op}: attn_out must be a 3D tensor, but got {prev_out.dim()}D")
    if input_layout == "SBH" and stats[0].dim() != 4:
        raise RuntimeError(f"{op}: softmax tensors must be 4D when input_layout is 'SBH'")
    if input_layout == "TND":
        if actual_seq_qlen is None or stats[0].dim() != 3:
            raise RuntimeError(f"{op}: 'TND' needs actual_seq_qlen and 3D softmax tensors")
    if actual_seq_qlen is not None and actual_seq_qlen.dtype != torch.int64:
        raise TypeError(f"{op}: actual_seq_qlen must use int64 dtype")


def npu_ring_attention_update(
    prev_attn_out: torch.Tensor,
    prev_softmax_max: torch.Tensor,
    prev_softmax_sum: torch.Tensor,
    cur_attn_out: torch.Tensor,
    cur_softmax_max: torch.Tensor,
    cur_softmax_sum: torch.Tensor,
    *,
    actual_seq_qlen: torch.Tensor | None = None,
    input_layout: str = "SBH",
    input_softmax_layout: str = "",
):
    """Merge two FlashAttention results: ``(attn_out, softmax_max, softmax_sum)`` (module docstring)."""
    stats = (prev_softmax_max, prev_softmax_sum, cur_softmax_max, cur_softmax_sum)
    _check_update(prev_attn_out, cur_attn_out, stats, actual_seq_qlen, input_layout, input_softmax_layout)
    softmax_max = torch.maximum(prev_softmax_max, cur_softmax_max)
    prev_scaled = prev_softmax_sum * torch.exp(prev_softmax_max - softmax_max)
    cur_scaled = cur_softmax_sum * torch.exp(cur_softmax_max - softmax_max)
    softmax_sum = prev_scaled + cur_scaled
    prev_w, cur_w = (prev_scaled / softmax_sum)[..., 0], (cur_scaled / softmax_sum)[..., 0]
    if input_layout == "SBH":  # [B, N, S] weights -> [S, B, N, 1] against [S, B, N, D]
        s, b, h = prev_attn_out.shape
        n = prev_w.shape[1]
        prev_w, cur_w = (w.permute(2, 0, 1).unsqueeze(-1) for w in (prev_w, cur_w))
        prev, cur = (t.float().view(s, b, n, h // n) for t in (prev_attn_out, cur_attn_out))
        out = (prev * prev_w + cur * cur_w).reshape(s, b, h)
    else:  # TND: [T, N] weights against [T, N, D]
        out = prev_attn_out.float() * prev_w.unsqueeze(-1) + cur_attn_out.float() * cur_w.unsqueeze(-1)
    return out.to(prev_attn_out.dtype), softmax_max, softmax_sum


def fusion_attention_grad_from_stats(
    query, key, value, dy, head_num, input_layout, mask, scale, softmax_max, softmax_sum, attention_in
):
    """FlashAttention's backward from the forward's statistics and output (non-TND layouts):
    ``P = exp(S - max) / sum`` (0 where ``mask``), ``D = rowsum(dy * attention_in)``,
    ``dV = P^T dy``, ``dS = P (dy V^T - D)``, ``dQ = scale dS K``, ``dK = scale dS^T Q``; K/V's
    gradients summed over the query heads of each KV head (GQA). Returns ``(dq, dk, dv)``."""
    nq = head_num
    q = to_bnsd(query, input_layout, nq).float()
    nkv = key.shape[-1] * nq // query.shape[-1] if input_layout in ("BSH", "SBH") else None
    k = to_bnsd(key, input_layout, nkv).float()
    v = to_bnsd(value, input_layout, nkv).float()
    do = to_bnsd(dy, input_layout, nq).float()
    o = to_bnsd(attention_in, input_layout, nq).float()
    group = nq // k.shape[1]
    kx, vx = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = torch.matmul(q, kx.transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(mask, float("-inf"))
    p = torch.exp(s - softmax_max[..., :1]) / softmax_sum[..., :1]
    delta = (do * o).sum(dim=-1, keepdim=True)
    ds = p * (torch.matmul(do, vx.transpose(-1, -2)) - delta)
    dq = torch.matmul(ds, kx) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q) * scale
    dv = torch.matmul(p.transpose(-1, -2), do)
    if group > 1:
        b, _, sk, d = dk.shape
        dk = dk.view(b, k.shape[1], group, sk, d).sum(dim=2)
        dv = dv.view(b, k.shape[1], group, sk, dv.shape[-1]).sum(dim=2)
    return (
        from_bnsd(dq.to(query.dtype), input_layout),
        from_bnsd(dk.to(key.dtype), input_layout),
        from_bnsd(dv.to(value.dtype), input_layout),
    )
