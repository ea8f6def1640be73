"""What DDP, the gradient finalization and the optimizer read from a parameter.

mcore layers attach ``param.shard_layout`` (:class:`mcore.tensor_parallel.sharding.ParamLayout`);
Megatron-style attributes are accepted as well, so hand-built modules (and tests) can say the same:

==========================  ===========================================  ===============================
question                    mcore layout                                 Megatron-style attribute
==========================  ===========================================  ===============================
split over tp ranks?        ``shard_layout.partition_dim is not None``   ``tensor_model_parallel=True``
gradient partial under SP?  ``shard_layout.sequence_parallel``           ``sequence_parallel=True``
last stage's tied copy?     ``shard_layout.logical_name is not None``    ``shared=True``
either tied-embedding copy  (tied copy, or the module's                  ``shared_embedding=True``
                            ``shared_embedding_or_output_weight()``)
a routed expert's weight?   ``shard_layout.expert_dim is not None``      ``expert_parallel=True``
                                                                         (Megatron: ``allreduce=False``)
==========================  ===========================================  ===============================

An expert-parallel parameter lives on the expert grid: its gradient is averaged over ``groups.edp``
(not dp x cp), the distributed optimizer shards it over ``edp``, and the gradient norm sums it over
``groups.expert_mp`` (etp x ep x pp), where its tp split is the expert-tensor-parallel split.
"""

from __future__ import annotations

import torch


def _layout(param: torch.nn.Parameter):
    return getattr(param, "shard_layout", None)


def is_expert_parallel(param: torch.nn.Parameter) -> bool:
    """A routed expert's weight: different on every ep rank, replicated over edp."""
    layout = _layout(param)
    return (
        bool(getattr(param, "expert_parallel", False))
        or getattr(param, "allreduce", True) is False
        or (layout is not None and getattr(layout, "expert_dim", None) is not None)
    )


def is_tensor_parallel(param: torch.nn.Parameter) -> bool:
    """Each tp rank holds a different slice of this parameter."""
    layout = _layout(param)
    return bool(getattr(param, "tensor_model_parallel", False)) or (
        layout is not None and layout.partition_dim is not None
    )


def is_sequence_parallel(param: torch.nn.Parameter) -> bool:
    """Replicated over tp, but each tp rank's gradient covers only its sequence shard."""
    layout = _layout(param)
    return bool(getattr(param, "sequence_parallel", False)) or (
        layout is not None and bool(layout.sequence_parallel)
    )


def is_tied_copy(param: torch.nn.Parameter) -> bool:
    """The last stage's copy of the tied word embedding (its gradient equals the original's)."""
    layout = _layout(param)
    return bool(getattr(param, "shared", False)) or (
        layout is not None and getattr(layout, "logical_name", None) is not None
    )


def is_shared_embedding(param: torch.nn.Parameter) -> bool:
    """Marked as one of the two copies of the tied word embedding (see :func:`shared_embedding_params`)."""
    return bool(getattr(param, "shared_embedding", False)) or is_tied_copy(param)


def is_pipeline_shared(param: torch.nn.Parameter) -> bool:
    """Held by several pipeline stages besides the tied word embedding (an encoder-decoder model's
    position embeddings and relative-position tables): its gradients are summed over the pipeline
    (:func:`mcore.distributed.finalize.all_reduce_pipeline_shared_grads`); ``pipeline_shared=True``."""
    return bool(getattr(param, "pipeline_shared", False))


def is_pipeline_copy(param: torch.nn.Parameter) -> bool:
    """A later stage's copy of a parameter that an earlier stage holds too (``pipeline_copy=True``):
    its gradient equals the original's after the pipeline sum."""
    return bool(getattr(param, "pipeline_copy", False))


def counts_in_grad_norm(param: torch.nn.Parameter, tp_rank: int) -> bool:
    """Whether this rank's copy of ``param`` adds to the global gradient norm.

    A parameter replicated over tp counts on tp rank 0 only; the tied copy and other pipeline copies
    never count (the first stage's original carries the same gradient). For an expert-parallel
    parameter pass the *expert* tensor-parallel rank (``groups.etp_rank``).
    """
    if is_tied_copy(param) or is_pipeline_copy(param):
        return False
    return is_tensor_parallel(param) or tp_rank == 0
