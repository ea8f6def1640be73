"""After the backward passes of a step: make every gradient the one the optimizer must apply.

:func:`finalize_model_grads` is the ``finalize_grads_func`` the pipeline schedule calls once, after
the last backward. In order (as in Megatron):

1. data parallel: each chunk's :meth:`~mcore.distributed.ddp.DistributedDataParallel.finish_grad_sync`
   (all-reduce, or reduce-scatter with the distributed optimizer);
2. sequence parallel: parameters replicated over tensor-parallel ranks whose gradients are partial
   under sequence parallelism (norm weights, row-parallel biases) are all-reduced over ``groups.tp``;
3. pipeline parallel: the tied word embedding (first stage) and its copy as the output layer (last
   stage) are all-reduced over ``groups.embedding`` so both copies take the same step.

The data-parallel reduction comes first because with ``--overlap-grad-reduce`` it has already been
launched during backward; the later sums are linear, so the order does not change the result. With
the distributed optimizer only this rank's shard of a gradient is data-parallel reduced; the later
all-reduces run over whole gradients, and the shards line up on every rank they span (the tied
embedding has a bucket of its own), so the owned shard ends up exact.

How parameters are marked (``shard_layout`` of mcore layers, or Megatron-style attributes) is in
:mod:`mcore.distributed.param_attrs`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mcore.distributed.ddp import DistributedDataParallel, unwrap_model
from mcore.distributed.groups import ProcessGroups
from mcore.distributed.param_attrs import is_sequence_parallel, is_shared_embedding
from mcore.tensor_parallel.mappings import all_reduce_coalesced, all_reduce_sequence_parallel_grads


def _grad_of(param: torch.nn.Parameter) -> torch.Tensor | None:
    grad = getattr(param, "main_grad", None)
    return grad if grad is not None else param.grad


def sequence_parallel_params(model_chunks: Sequence[torch.nn.Module]) -> list[torch.nn.Parameter]:
    """The parameters whose gradient is partial under sequence parallelism (norm weights, row-parallel
    biases: :func:`mcore.distributed.param_attrs.is_sequence_parallel`)."""
    return [
        param
        for chunk in model_chunks
        for param in chunk.parameters()
        if param.requires_grad and is_sequence_parallel(param)
    ]


def shared_embedding_params(model_chunks: Sequence[torch.nn.Module]) -> list[torch.nn.Parameter]:
    """This rank's copies of the tied word embedding.

    A chunk's ``shared_embedding_or_output_weight()`` (Megatron's method, on :class:`GPTModel`), and
    any parameter marked as a copy (:func:`mcore.distributed.param_attrs.is_shared_embedding`).
    """
    found: list[torch.nn.Parameter] = []

    def add(param) -> None:
        if param is not None and param.requires_grad and all(param is not f for f in found):
            found.append(param)

    for chunk in model_chunks:
        module = unwrap_model(chunk)
        method = getattr(module, "shared_embedding_or_output_weight", None)
        if callable(method):
            add(method())
        for param in module.parameters():
            if is_shared_embedding(param):
                add(param)
    return found


def all_reduce_embedding_grads(model_chunks: Sequence[torch.nn.Module], groups: ProcessGroups) -> None:
    """Sum the tied word embedding's gradient over its first- and last-stage copies (pp > 1).

    Every rank of ``groups.embedding`` must hold a copy marked ``shared_embedding``: models built
    with untied output weights mark none, and then nothing happens on either stage.
    """
    if groups.pp_size == 1 or groups.embedding is None:
        return
    grads = [g for p in shared_embedding_params(model_chunks) if (g := _grad_of(p)) is not None]
    if grads:
        all_reduce_coalesced(grads, groups.embedding)


def all_reduce_pipeline_shared_grads(model_chunks: Sequence[torch.nn.Module], groups: ProcessGroups) -> None:
    """Sum over ``groups.pp`` the gradients of parameters that several stages hold (an encoder-decoder
    model's position embeddings, relative-position tables, untied word embeddings).

    A model declares them with ``pipeline_shared_parameters() -> [(local_shape, param or None)]``, the
    same list (order and shapes) on every stage, ``None`` where this stage lacks the parameter; the
    stages without it add zeros. One all-reduce of the concatenation, in fp32.
    """
    if groups.pp_size == 1 or groups.pp is None:
        return
    entries = []
    for chunk in model_chunks:
        method = getattr(unwrap_model(chunk), "pipeline_shared_parameters", None)
        if callable(method):
            entries.extend(method())
    if not entries:
        return
    sizes = [int(torch.Size(shape).numel()) for shape, _ in entries]
    flat = torch.zeros(sum(sizes), dtype=torch.float32, device=groups.device)
    offset = 0
    for (_shape, param), size in zip(entries, sizes):
        grad = _grad_of(param) if param is not None else None
        if grad is not None:
            flat[offset : offset + size].copy_(grad.reshape(-1))
        offset += size
    torch.distributed.all_reduce(flat, group=groups.pp)
    offset = 0
    for (_shape, param), size in zip(entries, sizes):
        grad = _grad_of(param) if param is not None else None
        if grad is not None:
            grad.copy_(flat[offset : offset + size].view_as(grad))
        offset += size


def finalize_model_grads(
    model_chunks: Sequence[torch.nn.Module], groups: ProcessGroups | None = None
) -> None:
    """Finish the data-parallel reduction, then the sequence-parallel and tied-embedding reductions.

    Args:
        model_chunks: this rank's model chunks (usually :class:`DistributedDataParallel` wrappers).
        groups: the process groups; default: those the DDP chunks were built with (so
            ``finalize_model_grads`` itself is a valid ``finalize_grads_func(model_chunks)``).
    """
    if groups is None:
        wrapped = [c for c in model_chunks if isinstance(c, DistributedDataParallel)]
        if not wrapped:
            raise ValueError("finalize_model_grads needs groups= when no chunk is a DistributedDataParallel")
        groups = wrapped[0].groups
    for chunk in model_chunks:
        if isinstance(chunk, DistributedDataParallel):
            chunk.finish_grad_sync()
    if groups.tp_size > 1 and groups.tp is not None:
        all_reduce_sequence_parallel_grads(sequence_parallel_params(model_chunks), groups.tp)
    all_reduce_embedding_grads(model_chunks, groups)
    all_reduce_pipeline_shared_grads(model_chunks, groups)
