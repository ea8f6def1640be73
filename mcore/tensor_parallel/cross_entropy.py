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
"""

from __future__ import annotations

import torch

from mcore.backend import get_ops
from mcore.tensor_parallel.mappings import all_reduce_in_tensor_model_parallel_group, group_rank, group_size


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


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, group=None, label_smoothing: float = 0.0
) -> torch.Tensor:
    """Per-token cross-entropy (fp32) of vocab-parallel logits.

    Args:
        logits: ``[..., V/p]``, this rank's slice of the vocabulary (any float dtype).
        labels: ``[...]`` int64 ids in ``[0, V)``.
        group: the tensor-parallel group (``None`` or size 1: the backend's ``cross_entropy`` op).
        label_smoothing: ``e`` in ``[0, 1)``, as in ``torch.nn.functional.cross_entropy``.

    Returns:
        ``[...]`` fp32 losses, identical on every TP rank.
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 1)")
    if group_size(group) == 1:
        return get_ops().cross_entropy(logits, labels, label_smoothing)
    return _VocabParallelCrossEntropy.apply(logits, labels, group, label_smoothing)
