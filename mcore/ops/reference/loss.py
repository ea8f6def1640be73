"""Cross-entropy: the per-token loss, and the two halves of the vocab-parallel fused loss (one rank's
row statistics, then its gradient written over the logits), over row chunks (kernels:
``backends/cuda/triton_kernels/cross_entropy.py``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mcore.ops.reference._common import _wide


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-token cross-entropy in (at least) fp32: ``logits [..., V]``, ``labels [...]`` -> loss ``[...]``."""
    flat = _wide(logits.reshape(-1, logits.shape[-1]))
    loss = F.cross_entropy(flat, labels.reshape(-1), reduction="none", label_smoothing=label_smoothing)
    return loss.view(labels.shape)


_CE_CHUNK_ELEMENTS = 1 << 24
"""Elements of the fp32 temporaries of one row chunk of the two ops below (64 MiB)."""


def _ce_row_chunks(rows: int, width: int):
    step = max(1, _CE_CHUNK_ELEMENTS // max(width, 1))
    for start in range(0, rows, step):
        yield start, min(start + step, rows)


@torch.no_grad()
def cross_entropy_local_stats(
    logits2: torch.Tensor, local_labels: torch.Tensor, outside: torch.Tensor, with_sum: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per-row statistics of one rank's vocabulary slice, for the vocab-parallel cross-entropy.

    The first half of ``--cross-entropy-loss-fusion`` (:mod:`mcore.tensor_parallel.cross_entropy`):
    the caller all-reduces these over the tensor-parallel ranks and keeps only the logits.

    Args:
        logits2: ``[rows, V_local]`` logits ``z`` of this rank's slice, any float dtype, any row stride,
            last dim contiguous. Read only.
        local_labels: ``[rows]`` int64 label ``y - start`` (``start`` the slice's first vocabulary id),
            0 where ``outside``.
        outside: ``[rows]`` bool, True where the label is not in this slice (an ignore index of -100
            is outside every slice).
        with_sum: also return the row sums (label smoothing is on).

    Returns ``(local_log_z, predicted, sum_z)``, each ``[rows]`` in the compute dtype
    (``promote_types(logits2.dtype, float32)``): ``local_log_z = log(sum_j exp(z_j))`` over the slice,
    ``predicted = z[local_label]`` (0 where ``outside``) and ``sum_z = sum_j z_j`` (None unless
    ``with_sum``). Temporaries are fp32 row chunks, never the whole slice.
    """
    rows, width = logits2.shape
    compute = torch.promote_types(logits2.dtype, torch.float32)
    local_log_z = torch.empty(rows, dtype=compute, device=logits2.device)
    predicted = torch.empty_like(local_log_z)
    sum_z = torch.empty_like(local_log_z) if with_sum else None
    for a, b in _ce_row_chunks(rows, width):
        chunk = logits2[a:b]
        top, where = chunk.max(dim=-1)
        log_softmax = torch.log_softmax(chunk, dim=-1, dtype=compute)
        # log-sum-exp = x - log_softmax(x) at any entry; at the max it is exact to rounding
        local_log_z[a:b] = top.to(compute) - log_softmax.gather(-1, where.unsqueeze(-1)).squeeze(-1)
        del log_softmax
        predicted[a:b] = chunk.gather(-1, local_labels[a:b].unsqueeze(-1)).squeeze(-1).to(compute)
        if sum_z is not None:
            sum_z[a:b] = chunk.sum(dim=-1, dtype=compute)
    return local_log_z, predicted.masked_fill_(outside, 0.0), sum_z


@torch.no_grad()
def cross_entropy_grad_inplace_(
    logits2: torch.Tensor,
    local_labels: torch.Tensor,
    outside: torch.Tensor,
    log_z: torch.Tensor,
    dloss: torch.Tensor,
    label_smoothing: float,
    vocab_size: int,
) -> torch.Tensor:
    """Overwrite one rank's logits with their cross-entropy gradient; returns ``logits2``.

    The second half of ``--cross-entropy-loss-fusion``. Per row, with ``e = label_smoothing`` and
    ``V = vocab_size`` (the full vocabulary, all ranks)::

        logits2[j] <- dloss * (exp(z_j - logZ) - (1 - e) [j == local_label and not outside] - e / V)

    i.e. ``d loss / d z`` of ``loss = (1-e) (logZ - z_y) + e (logZ - mean_j z_j)``, where
    ``exp(z_j - logZ)`` is the global softmax restricted to this slice.

    Args:
        logits2: ``[rows, V_local]`` logits (any float dtype, any row stride, last dim contiguous),
            overwritten in place with the gradient (rounded to their dtype).
        local_labels, outside: as for :func:`cross_entropy_local_stats`.
        log_z: ``[rows]`` the global log-sum-exp over the whole vocabulary (compute dtype).
        dloss: ``[rows]`` the upstream gradient of each row's loss (any float dtype, any stride).
        label_smoothing: ``e`` in ``[0, 1)``.
        vocab_size: ``V``.

    Computed in the dtype of ``log_z`` over fp32 row chunks.
    """
    compute = log_z.dtype
    eps = label_smoothing
    upstream = dloss.reshape(-1).to(compute)
    onehot = ((eps - 1.0) * upstream * (~outside).to(compute)).unsqueeze(-1)
    for a, b in _ce_row_chunks(logits2.shape[0], logits2.shape[1]):
        grad = torch.sub(logits2[a:b], log_z[a:b].unsqueeze(-1))  # a new chunk in the compute dtype
        grad.exp_().mul_(upstream[a:b].unsqueeze(-1))
        grad.scatter_add_(-1, local_labels[a:b].unsqueeze(-1), onehot[a:b])
        if eps > 0:
            grad.sub_((eps / vocab_size) * upstream[a:b].unsqueeze(-1))
        logits2[a:b] = grad
    return logits2
