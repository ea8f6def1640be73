"""The output layer and the vocab-parallel cross-entropy fused over chunks of tokens
(``--output-layer-loss-chunks N``): the whole logits never exist.

The default loss path materialises the logits ``[s, b, V/p]`` in the output layer's forward and keeps
them (or an fp32 softmax) until its backward, on top of every saved activation at the memory peak.
Here one autograd Function takes the output layer's input ``X`` (``[s*b, h]`` after the TP/SP
mapping), its weight ``W [V/p, h]`` and the labels, and walks ``N`` chunks of token rows:

* forward, per chunk: ``Z_c = X_c W^T`` (the weight's dtype), then this rank's per-row statistics
  (op ``cross_entropy_local_stats``); after the loop the statistics of all rows are combined over
  the TP ranks in one MAX and one SUM all-reduce
  (:func:`mcore.tensor_parallel.cross_entropy.combine_local_stats`). Kept for backward: ``X`` (which
  the output layer keeps anyway), ``W``, and per token the global ``logZ`` (fp32), the local label
  (int64) and the outside flag (bool); not the logits.
* backward, per chunk: ``Z_c`` recomputed, overwritten with ``dL/dZ_c`` (op
  ``cross_entropy_grad_inplace_``), then ``dX_c = dZ_c W`` and ``dW += dZ_c^T X_c``, the latter into
  ``W.main_grad`` with gradient-accumulation fusion (op ``accumulate_weight_grad``, the placeholder
  protocol of :func:`mcore.tensor_parallel.layers.linear_with_grad_accumulation_fusion`).

Cost: one more output-layer GEMM (the recomputation). Live at once: one chunk's logits (and the
reference ops' fp32 temporaries of a row block) instead of the whole ``s*b*V/p``. The losses equal
``--cross-entropy-loss-fusion``'s (the same ops on the same logits); the communication of ``X`` is
the column-parallel layer's (all-gather / reduce-scatter along ``s`` with sequence parallelism,
identity / all-reduce of the gradient without it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mcore.backend import get_ops
from mcore.tensor_parallel.cross_entropy import combine_local_stats, local_label_masks
from mcore.tensor_parallel.layers import column_parallel_input, fusion_main_grad
from mcore.tensor_parallel.mappings import (
    group_rank,
    group_size,
)

FLAG = "--output-layer-loss-chunks"


def _row_chunks(rows: int, num_chunks: int):
    """``num_chunks`` (at most ``rows``) ranges ``[a, b)`` over ``rows``; the last may be shorter."""
    step = max(1, -(-rows // num_chunks))
    for start in range(0, rows, step):
        yield start, min(start + step, rows)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Per-token loss of ``x @ weight^T`` (vocab-parallel) over row chunks; logits recomputed in backward."""

    @staticmethod
    def forward(ctx, x, weight, labels, group, label_smoothing, num_chunks, main_grad, zero_placeholder):
        hidden = x.shape[-1]
        x2 = x.reshape(-1, hidden)
        local_vocab = weight.shape[0]
        vocab = local_vocab * group_size(group)
        local_labels, outside = local_label_masks(
            labels.reshape(-1), group_rank(group) * local_vocab, local_vocab
        )
        with_sum = label_smoothing > 0
        ops = get_ops()
        stats: list[list[torch.Tensor]] = [[], [], []]
        for a, b in _row_chunks(x2.shape[0], num_chunks):
            logits = F.linear(x2[a:b], weight)  # [rows_c, V/p], freed after its statistics
            chunk_stats = ops.cross_entropy_local_stats(logits, local_labels[a:b], outside[a:b], with_sum)
            for acc, value in zip(stats, chunk_stats):
                if value is not None:
                    acc.append(value)
            del logits
        local_log_z, predicted = torch.cat(stats[0]), torch.cat(stats[1])
        sum_z = torch.cat(stats[2]) if with_sum else None
        loss, log_z = combine_local_stats(local_log_z, predicted, sum_z, group, label_smoothing, vocab)
        ctx.save_for_backward(x, weight, local_labels, outside, log_z)
        ctx.label_smoothing, ctx.vocab, ctx.num_chunks = label_smoothing, vocab, num_chunks
        ctx.main_grad, ctx.zero_placeholder = main_grad, zero_placeholder
        return loss.view(labels.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        x, weight, local_labels, outside, log_z = ctx.saved_tensors
        x2 = x.reshape(-1, x.shape[-1])
        dloss = grad_loss.reshape(-1)
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        main_grad = ctx.main_grad
        ops = get_ops()
        grad_x2 = torch.empty_like(x2, memory_format=torch.contiguous_format) if need_x else None
        grad_w = None
        for a, b in _row_chunks(x2.shape[0], ctx.num_chunks):
            x_c = x2[a:b]
            dz = F.linear(x_c, weight)  # the chunk's logits again, overwritten with their gradient
            ops.cross_entropy_grad_inplace_(
                dz, local_labels[a:b], outside[a:b], log_z[a:b], dloss[a:b], ctx.label_smoothing, ctx.vocab
            )
            if need_x:
                torch.mm(dz, weight, out=grad_x2[a:b])
            if main_grad is not None:
                ops.accumulate_weight_grad(main_grad, dz, x_c)
            elif need_w:
                if grad_w is None:
                    grad_w = dz.t().mm(x_c)
                else:
                    grad_w.addmm_(dz.t(), x_c)
            del dz
        if main_grad is not None:
            # a placeholder so the DDP hook fires (it discards it, see grad_added_to_main_grad);
            # none for the tied embedding, whose lookup's gradient fires the hook (no zero fill
            # and add over [V, h])
            grad_w = None if ctx.zero_placeholder else torch.empty_like(weight)
        elif need_w and grad_w is None:
            grad_w = torch.zeros_like(weight)  # no tokens
        grad_x = grad_x2.view(x.shape) if need_x else None
        return grad_x, grad_w, None, None, None, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    num_chunks: int,
    group=None,
    sequence_parallel: bool = False,
    label_smoothing: float = 0.0,
    gradient_accumulation_fusion: bool = False,
    shared_weight: bool = False,
) -> torch.Tensor:
    """Per-token fp32 cross-entropy of a column-parallel output layer without bias, over chunks.

    The same losses and gradients as ``ColumnParallelLinear(hidden, weight)`` followed by
    ``vocab_parallel_cross_entropy``, without keeping the logits.

    Args:
        hidden: the output layer's input ``[s, b, h]`` (``[s/p, b, h]`` with ``sequence_parallel``:
            all-gathered along ``s``, gradient reduce-scattered, and kept un-gathered for backward;
            otherwise the gradient is all-reduced over TP), as a column-parallel layer does it
            (:func:`~mcore.tensor_parallel.layers.column_parallel_input`).
        weight: ``[V/p, h]``, this rank's vocabulary rows (possibly the tied word embedding).
        labels: ``[s, b]`` int64 ids in ``[0, V)`` (or an ignore index outside it, e.g. -100).
        num_chunks: chunks of the ``s*b`` token rows (at least 1; at most one row each).
        group: the tensor-parallel group.
        label_smoothing: ``e`` in ``[0, 1)``.
        gradient_accumulation_fusion, shared_weight: as for
            :func:`~mcore.tensor_parallel.layers.linear_with_grad_accumulation_fusion`.

    Returns:
        ``[s, b]`` fp32 losses, identical on every TP rank.
    """
    if not isinstance(num_chunks, int) or num_chunks < 1:
        raise ValueError(f"num_chunks={num_chunks} ({FLAG}) must be a positive integer")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 1)")
    x, saved_input = column_parallel_input(hidden, group, sequence_parallel)
    if tuple(labels.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"labels of shape {tuple(labels.shape)} given for hidden states {tuple(x.shape)}")
    # the placeholder protocol of linear_with_grad_accumulation_fusion (flag written in the forward)
    main_grad = fusion_main_grad(weight, gradient_accumulation_fusion, shared_weight)
    with saved_input:
        return _ChunkedLinearCrossEntropy.apply(
            x, weight, labels, group, label_smoothing, num_chunks, main_grad, shared_weight
        )


def output_layer_cross_entropy(
    layer,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    *,
    num_chunks: int,
    weight: torch.Tensor | None = None,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """:func:`linear_cross_entropy` with the settings of ``layer``, a
    :class:`~mcore.tensor_parallel.layers.ColumnParallelLinear` (the model's output layer), and its
    weight or ``weight`` (the tied word embedding), as ``layer(hidden, weight=weight)`` would use it.
    """
    if layer.bias is not None or layer.gather_output:
        raise ValueError(
            f"{FLAG} supports an output layer without bias and without gather_output "
            f"(got bias={layer.bias is not None}, gather_output={layer.gather_output})"
        )
    weight = layer.resolve_weight(weight)
    return linear_cross_entropy(
        hidden,
        weight,
        labels,
        num_chunks=num_chunks,
        group=layer.tp_group,
        sequence_parallel=layer.sequence_parallel,
        label_smoothing=label_smoothing,
        gradient_accumulation_fusion=layer.gradient_accumulation_fusion,
        shared_weight=weight is not layer.weight,
    )
