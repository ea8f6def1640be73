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

Memory. With TP the default path keeps the fp32 softmax ``[s, b, V/p]`` (twice the bf16 logits) and
its forward makes several fp32 copies of the logits; at TP=1 the backend's ``cross_entropy`` op keeps
the logits and its backward allocates a second logits-sized tensor for their gradient.
``overwrite_logits=True`` (``--cross-entropy-loss-fusion``) keeps only the logits and three numbers
per token: the forward reduces the logits to per-row statistics (op ``cross_entropy_local_stats``),
and the backward recomputes the softmax and writes the gradient into the logits' own storage (op
``cross_entropy_grad_inplace_``), which it returns; the reference ops walk row chunks with fp32
temporaries of one chunk, the CUDA backend's Triton kernels one row per program. So one logits-sized buffer lives from the output layer to its backward, at any TP
size. The logits must have no other use after the loss (the model's are internal when it computes
the loss).

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


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Forward: per-token loss from vocab-split logits. Backward: the local slice of d loss / d logits."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, group, label_smoothing: float):
        ctx.logits_dtype = logits.dtype
        logits = logits.float()
        local_vocab = logits.shape[-1]
        vocab = local_vocab * group_size(group)
        start = group_rank(group) * local_vocab

        logits_max = logits.max(dim=-1).values
        all_reduce_in_tensor_model_parallel_group(logits_max, group, op="max")
        shifted = logits - logits_max.unsqueeze(-1)

        outside = (labels < start) | (labels >= start + local_vocab)
        local_labels = (labels - start).masked_fill(outside, 0)
        predicted = shifted.gather(-1, local_labels.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)

        exp = shifted.exp()
        stats = [exp.sum(dim=-1), predicted]
        if label_smoothing > 0:
            stats.append(shifted.sum(dim=-1))
        stats = torch.stack(stats)
        all_reduce_in_tensor_model_parallel_group(stats, group, op="sum")
        log_z = stats[0].log()
        loss = log_z - stats[1]
        if label_smoothing > 0:
            mean_shifted = stats[2] / vocab
            loss = (1.0 - label_smoothing) * loss + label_smoothing * (log_z - mean_shifted)

        softmax = exp.div_(stats[0].unsqueeze(-1))
        ctx.save_for_backward(softmax, local_labels, outside)
        ctx.label_smoothing, ctx.vocab = label_smoothing, vocab
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, local_labels, outside = ctx.saved_tensors
        grad = softmax  # reused in place, as Megatron does: the saved softmax is not needed again
        eps = ctx.label_smoothing
        onehot_weight = (1.0 - eps) * (~outside).to(grad.dtype)
        grad.scatter_add_(-1, local_labels.unsqueeze(-1), -onehot_weight.unsqueeze(-1))
        if eps > 0:
            grad.sub_(eps / ctx.vocab)
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None


class _InPlaceGradCrossEntropy(torch.autograd.Function):
    """Vocab-parallel cross-entropy keeping the logits and per-token statistics; the gradient
    overwrites the logits.

    The forward asks the op table for each row's local statistics (``cross_entropy_local_stats``:
    the log-sum-exp ``logZ_t`` over this rank's slice, the logit at the label, the row sum under
    label smoothing) and combines them over the ranks into ``logZ``; it keeps the logits and
    ``logZ``. The backward (``cross_entropy_grad_inplace_``) writes
    ``dloss * (exp(z - logZ) - (1-e) onehot - e/V)`` into the logits. The reference ops walk row
    chunks with fp32 temporaries of one chunk; a backend's kernels (Triton on CUDA) read the logits
    once in the forward, and read and write them once in the backward. The collectives stay here.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, group, label_smoothing: float):
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
        ctx.label_smoothing, ctx.vocab = label_smoothing, vocab
        return loss.view(labels.shape)

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        logits, log_z, local_labels, outside = ctx.saved_tensors
        z = logits.detach().reshape(-1, logits.shape[-1])  # written in place: the gradient
        get_ops().cross_entropy_grad_inplace_(
            z, local_labels, outside, log_z, grad_loss.reshape(-1), ctx.label_smoothing, ctx.vocab
        )
        return z.view(logits.shape), None, None, None


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
        group: the tensor-parallel group (``None`` or size 1: the backend's ``cross_entropy`` op).
        label_smoothing: ``e`` in ``[0, 1)``, as in ``torch.nn.functional.cross_entropy``.
        overwrite_logits: keep only the logits for backward and write their gradient into them (see
            the module docstring; at any TP size, instead of the backend's op at TP=1). The logits'
            values are destroyed by the backward.

    Returns:
        ``[...]`` fp32 losses, identical on every TP rank.
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 1)")
    if overwrite_logits:
        return _InPlaceGradCrossEntropy.apply(logits, labels, group, label_smoothing)
    if group_size(group) == 1:
        return get_ops().cross_entropy(logits, labels, label_smoothing)
    return _VocabParallelCrossEntropy.apply(logits, labels, group, label_smoothing)
