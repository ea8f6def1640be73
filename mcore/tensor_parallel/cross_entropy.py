"""Cross-entropy over vocabulary-parallel logits, without gathering the full vocabulary anywhere.

Rank ``t`` holds the logits of vocabulary ids ``[t*V/p, (t+1)*V/p)``. With ``z`` the logits of one
token, ``y`` its label and ``m = max_j z_j``::

    loss = log(sum_j exp(z_j - m)) - (z_y - m)

so each rank contributes its local max (all-reduced with MAX), its local ``sum exp`` and, on the rank
that owns ``y``, ``z_y`` (both all-reduced with SUM, in one collective). With label smoothing ``e``
(the target is ``(1-e) onehot(y) + e/V``, as ``torch.nn.functional.cross_entropy`` defines it)::

    loss = (1 - e) * (logZ - z_y) + e * (logZ - mean_j z_j)

which needs one more summed statistic, ``sum_j z_j``. The gradient is
``softmax(z) - (1-e) onehot(y) - e/V``, computed from the saved local softmax.

Ops. The arithmetic on the logits runs through the op table, so a backend's kernels serve it at any
TP size: at TP=1 the backend's ``cross_entropy`` op; at TP >= 2 the forward reduces this rank's
logits to per-row statistics (op ``cross_entropy_local_stats``), :func:`combine_local_stats` combines
them over the ranks (the collectives stay here: ops are local), and the backward writes the gradient
(op ``cross_entropy_grad_inplace_``) into a copy of the logits, which it returns. The reference ops
walk row chunks with fp32 temporaries of one chunk, the CUDA backend's Triton kernels one row per
program; what is kept for backward is the logits (their dtype) and three numbers per token.

Memory. ``overwrite_logits=True`` (``--cross-entropy-loss-fusion``) takes the same path at any TP
size and writes the gradient into the logits' own storage instead of a copy, so one logits-sized
buffer lives from the output layer to its backward (at TP=1 the ``cross_entropy`` op's backward
allocates a second one). The logits must have no other use after the loss (the model's are internal
when it computes the loss).

``--output-layer-loss-chunks`` (:mod:`mcore.tensor_parallel.output_loss`) goes one step further with
the same two ops and :func:`combine_local_stats`: the output layer and the loss run over chunks of
tokens and each chunk's logits are recomputed in backward, so no logits-sized buffer is kept at all.
"""

from __future__ import annotations

import torch

from mcore.backend import get_ops
from mcore.tensor_parallel.mappings import all_reduce_in_tensor_model_parallel_group, group_rank, group_size


def local_label_masks(
    flat_labels: torch.Tensor, start: int, local_vocab: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(local_labels, outside)`` of labels for the vocabulary slice ``[start, start + local_vocab)``:
    ``outside`` is True where the label is not in the slice (an ignore index of -100 is outside every
    slice: its loss is ``logZ``, its gradient the softmax), ``local_labels = label - start`` (0 there).
    """
    outside = (flat_labels < start) | (flat_labels >= start + local_vocab)
    return (flat_labels - start).masked_fill(outside, 0), outside


def combine_local_stats(
    local_log_z: torch.Tensor,
    predicted: torch.Tensor,
    sum_z: torch.Tensor | None,
    group,
    label_smoothing: float,
    vocab: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``(loss, logZ)`` from every TP rank's ``cross_entropy_local_stats`` (op table):
    one MAX and one SUM all-reduce over ``group``. ``vocab`` is the whole (padded) vocabulary."""
    global_max = all_reduce_in_tensor_model_parallel_group(local_log_z.clone(), group, op="max")
    stats = [(local_log_z - global_max).exp_(), predicted]
    if label_smoothing > 0:
        stats.append(sum_z)
    stats = all_reduce_in_tensor_model_parallel_group(torch.stack(stats), group, op="sum")
    log_z = global_max + stats[0].log()
    loss = log_z - stats[1]
    if label_smoothing > 0:
        loss = (1.0 - label_smoothing) * loss + label_smoothing * (log_z - stats[2] / vocab)
    return loss, log_z


class _TableCrossEntropy(torch.autograd.Function):
    """Vocab-parallel cross-entropy keeping the logits and per-token statistics; the gradient goes
    into a copy of the logits, or (``overwrite``) into the logits themselves.

    The forward asks the op table for each row's local statistics (``cross_entropy_local_stats``:
    the log-sum-exp ``logZ_t`` over this rank's slice, the logit at the label, the row sum under
    label smoothing) and combines them over the ranks into ``logZ``; it keeps the logits and
    ``logZ``. The backward (``cross_entropy_grad_inplace_``) writes
    ``dloss * (exp(z - logZ) - (1-e) onehot - e/V)`` into the logits. The reference ops walk row
    chunks with fp32 temporaries of one chunk; a backend's kernels (Triton on CUDA) read the logits
    once in the forward, and read and write them once in the backward. The collectives stay here.
    """

    @staticmethod
    def forward(
        ctx, logits: torch.Tensor, labels: torch.Tensor, group, label_smoothing: float, overwrite: bool
    ):
        local_vocab = logits.shape[-1]
        vocab = local_vocab * group_size(group)
        start = group_rank(group) * local_vocab
        z = logits.reshape(-1, local_vocab)
        local_labels, outside = local_label_masks(labels.reshape(-1), start, local_vocab)
        local_log_z, predicted, sum_z = get_ops().cross_entropy_local_stats(
            z, local_labels, outside, label_smoothing > 0
        )
        loss, log_z = combine_local_stats(local_log_z, predicted, sum_z, group, label_smoothing, vocab)
        ctx.save_for_backward(logits, log_z, local_labels, outside)
        ctx.label_smoothing, ctx.vocab, ctx.overwrite = label_smoothing, vocab, overwrite
        return loss.view(labels.shape)

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        logits, log_z, local_labels, outside = ctx.saved_tensors
        z = logits.detach().reshape(-1, logits.shape[-1])  # written in place: the gradient
        if not ctx.overwrite:
            z = z.clone(memory_format=torch.contiguous_format)
        get_ops().cross_entropy_grad_inplace_(
            z, local_labels, outside, log_z, grad_loss.reshape(-1), ctx.label_smoothing, ctx.vocab
        )
        return z.view(logits.shape), None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    group=None,
    label_smoothing: float = 0.0,
    overwrite_logits: bool = False,
) -> torch.Tensor:
    """Per-token cross-entropy (fp32) of vocab-parallel logits.

    Args:
        logits: ``[..., V/p]``, this rank's slice of the vocabulary (any float dtype).
        labels: ``[...]`` int64 ids in ``[0, V)``.
        group: the tensor-parallel group (``None`` or size 1: the backend's ``cross_entropy`` op;
            larger: ops ``cross_entropy_local_stats`` and ``cross_entropy_grad_inplace_``).
        label_smoothing: ``e`` in ``[0, 1)``, as in ``torch.nn.functional.cross_entropy``.
        overwrite_logits: write the gradient into the logits instead of a copy (see the module
            docstring; at any TP size, instead of the ``cross_entropy`` op at TP=1). The logits'
            values are destroyed by the backward.

    Returns:
        ``[...]`` fp32 losses, identical on every TP rank.
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 1)")
    if group_size(group) == 1 and not overwrite_logits:
        return get_ops().cross_entropy(logits, labels, label_smoothing)
    return _TableCrossEntropy.apply(logits, labels, group, label_smoothing, overwrite_logits)
