"""Chunked cross-entropy in Triton that never holds fp32 logits for the whole vocabulary.

``logits [..., V]`` (bf16, fp16 or fp32, any row stride) and ``labels [...]``: one program per row
walks the vocabulary in ``BLOCK_V`` chunks with an online log-sum-exp (running max and rescaled sum,
fp32 scalars), plus the running sum of the logits when label smoothing is on, and writes the fp32
per-token loss and ``lse``. The backward makes one more pass per row and writes
``dlogits = dloss * (softmax - (1 - eps) onehot(label) - eps / V)`` straight in the logits' dtype.
Labels equal to ``ignore_index`` (-100, as ``F.cross_entropy``) give loss 0 and zero gradient.

Traffic: forward reads the logits once; backward reads them once and writes the gradient once.

The two halves of the vocab-parallel in-place cross-entropy (``--cross-entropy-loss-fusion``) use the
same row walk: :func:`cross_entropy_local_stats` writes each row's local ``lse``, the logit at the
local label (0 where the label is outside this rank's slice) and, under label smoothing, the row sum;
:func:`cross_entropy_grad_inplace_` reads each row once and writes
``dloss * (exp(x - logZ) - (1 - eps) onehot - eps / V)`` over it (``logZ`` the global log-sum-exp,
``V`` the full vocabulary). Rows are told apart from ignored labels only by the ``outside`` flag.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import next_pow2

IGNORE_INDEX = -100


@triton.jit
def _row_lse(base, V, SMOOTHING: tl.constexpr, BLOCK_V: tl.constexpr):
    """``(log(sum_j exp(x_j)), sum_j x_j)`` of the ``V`` values at ``base`` (the sum 0 unless SMOOTHING).

    One pass in ``BLOCK_V`` chunks with an online log-sum-exp (running max, rescaled sum; fp32).
    """
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([], dtype=tl.float32)
    sx = tl.zeros([], dtype=tl.float32)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < V
        x = tl.load(base + cols, mask=mask, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
        if SMOOTHING:
            sx += tl.sum(tl.where(mask, x, 0.0), axis=0)
    return m + tl.log(s), sx


@triton.jit
def _ce_fwd_kernel(
    LOGITS,
    LABELS,
    LOSS,
    LSE,
    V,
    stride_l,
    smoothing,
    ignore_index,
    SMOOTHING: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * stride_l
    label = tl.load(LABELS + row).to(tl.int64)
    lse, sx = _row_lse(base, V, SMOOTHING, BLOCK_V)
    valid = label != ignore_index
    in_range = valid & (label >= 0) & (label < V)
    x_y = tl.load(base + tl.where(in_range, label, 0)).to(tl.float32)
    if SMOOTHING:
        loss = lse - (1.0 - smoothing) * x_y - smoothing * sx / V
    else:
        loss = lse - x_y
    tl.store(LOSS + row, tl.where(valid, loss, 0.0))
    tl.store(LSE + row, lse)


@triton.jit
def _ce_bwd_kernel(
    LOGITS,
    LABELS,
    LSE,
    DLOSS,
    DLOGITS,
    V,
    stride_l,
    stride_d,
    smoothing,
    ignore_index,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * stride_l
    dbase = DLOGITS + row * stride_d
    label = tl.load(LABELS + row).to(tl.int64)
    lse = tl.load(LSE + row)
    dl = tl.load(DLOSS + row).to(tl.float32)
    dl = tl.where(label != ignore_index, dl, 0.0)
    on_label = 1.0 - smoothing
    uniform = smoothing / V
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < V
        x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.exp(x - lse) - uniform - tl.where(cols == label, on_label, 0.0)
        tl.store(dbase + cols, (g * dl).to(DLOGITS.dtype.element_ty), mask=mask)


@triton.jit
def _ce_local_stats_kernel(
    LOGITS,
    LABELS,
    OUTSIDE,
    LSE,
    PRED,
    SUMX,
    V,
    stride_l,
    SMOOTHING: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * stride_l
    label = tl.load(LABELS + row).to(tl.int64)
    outside = tl.load(OUTSIDE + row) != 0
    lse, sx = _row_lse(base, V, SMOOTHING, BLOCK_V)
    x_y = tl.load(base + tl.where(outside, 0, label)).to(tl.float32)
    tl.store(LSE + row, lse)
    tl.store(PRED + row, tl.where(outside, 0.0, x_y))
    if SMOOTHING:
        tl.store(SUMX + row, sx)


@triton.jit
def _ce_grad_inplace_kernel(
    LOGITS,
    LABELS,
    OUTSIDE,
    LOGZ,
    DLOSS,
    V,
    stride_l,
    smoothing,
    uniform,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * stride_l
    label = tl.load(LABELS + row).to(tl.int64)
    outside = tl.load(OUTSIDE + row) != 0
    log_z = tl.load(LOGZ + row)
    dl = tl.load(DLOSS + row).to(tl.float32)
    target = tl.where(outside, -1, label)
    on_label = (smoothing - 1.0) * dl
    off = uniform * dl
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < V
        x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.exp(x - log_z) * dl + tl.where(cols == target, on_label, 0.0) - off
        tl.store(base + cols, g.to(LOGITS.dtype.element_ty), mask=mask)


def _config(v: int, config: dict | None, backward: bool = False) -> dict:
    # Measured on H100 (benchmarks/kernels --sweep, V = 50304): forward 8192-wide chunks with 4 warps,
    # backward 16384-wide chunks with 16 warps (both about 96% of the copy bandwidth).
    block_v = min(next_pow2(v), 16384 if backward else 8192)
    cfg = {"BLOCK_V": block_v}
    cfg.update(config or {})
    per_thread = 32 if backward else 64
    cfg.setdefault("num_warps", int(min(16, max(1, cfg["BLOCK_V"] // (32 * per_thread)))))
    return cfg


def cross_entropy_fwd(logits2, labels1, smoothing: float, config=None):
    m, v = logits2.shape
    loss = torch.empty((m,), dtype=torch.float32, device=logits2.device)
    lse = torch.empty((m,), dtype=torch.float32, device=logits2.device)
    cfg = _config(v, config)
    _ce_fwd_kernel[(m,)](
        logits2, labels1, loss, lse, v, logits2.stride(0), float(smoothing), IGNORE_INDEX,
        SMOOTHING=smoothing > 0.0, **cfg,
    )  # fmt: skip
    return loss, lse


def cross_entropy_bwd(dloss1, logits2, labels1, lse, smoothing: float, config=None):
    m, v = logits2.shape
    dlogits = torch.empty((m, v), dtype=logits2.dtype, device=logits2.device)
    cfg = _config(v, config, backward=True)
    _ce_bwd_kernel[(m,)](
        logits2, labels1, lse, dloss1, dlogits, v, logits2.stride(0), dlogits.stride(0),
        float(smoothing), IGNORE_INDEX, **cfg,
    )  # fmt: skip
    return dlogits


class CrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, smoothing):
        v = logits.shape[-1]
        logits2 = logits if logits.dim() == 2 and logits.stride(-1) == 1 else logits.reshape(-1, v)
        if logits2.stride(-1) != 1:
            logits2 = logits2.contiguous()
        labels1 = labels.reshape(-1)
        if not labels1.is_contiguous():
            labels1 = labels1.contiguous()
        loss, lse = cross_entropy_fwd(logits2, labels1, smoothing)
        ctx.save_for_backward(logits2, labels1, lse)
        ctx.smoothing, ctx.logits_shape = smoothing, logits.shape
        return loss.view(labels.shape)

    @staticmethod
    def backward(ctx, dloss):
        logits2, labels1, lse = ctx.saved_tensors
        dloss1 = dloss.reshape(-1)
        if not dloss1.is_contiguous():
            dloss1 = dloss1.contiguous()
        dlogits = cross_entropy_bwd(dloss1, logits2, labels1, lse, ctx.smoothing)
        return dlogits.view(ctx.logits_shape), None, None


def cross_entropy_local_stats(logits2, local_labels, outside, with_sum: bool, config=None):
    """The reference ``cross_entropy_local_stats`` in one pass over each row (fp32 results).

    ``logits2 [m, v]`` (last dim contiguous, any row stride), ``local_labels [m]`` int32/int64 and
    ``outside [m]`` bool, both contiguous.
    """
    m, v = logits2.shape
    lse = torch.empty((m,), dtype=torch.float32, device=logits2.device)
    pred = torch.empty((m,), dtype=torch.float32, device=logits2.device)
    sum_z = torch.empty((m,), dtype=torch.float32, device=logits2.device) if with_sum else None
    cfg = _config(v, config)
    _ce_local_stats_kernel[(m,)](
        logits2, local_labels, outside.view(torch.uint8), lse, pred, lse if sum_z is None else sum_z,
        v, logits2.stride(0), SMOOTHING=bool(with_sum), **cfg,
    )  # fmt: skip
    return lse, pred, sum_z


def cross_entropy_grad_inplace_(
    logits2, local_labels, outside, log_z, dloss, label_smoothing: float, vocab_size: int, config=None
):
    """The reference ``cross_entropy_grad_inplace_``: one read and one write of each row, in place.

    ``log_z [m]`` fp32 and ``dloss [m]`` (any float dtype) contiguous; the rest as above.
    """
    m, v = logits2.shape
    cfg = _config(v, config, backward=True)
    _ce_grad_inplace_kernel[(m,)](
        logits2, local_labels, outside.view(torch.uint8), log_z, dloss, v, logits2.stride(0),
        float(label_smoothing), float(label_smoothing) / vocab_size, **cfg,
    )  # fmt: skip
    return logits2


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    return CrossEntropyFunction.apply(logits, labels, float(label_smoothing))
