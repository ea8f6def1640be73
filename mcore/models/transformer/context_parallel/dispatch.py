"""Context-parallel core attention: one entry point choosing the communication (``--cp-comm-type``)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mcore.models.transformer.context_parallel.allgather import allgather_attention
from mcore.models.transformer.context_parallel.ring import ring_attention
from mcore.models.transformer.context_parallel.ulysses import ulysses_attention

_IMPLEMENTATIONS = {"p2p": ring_attention, "a2a": ulysses_attention, "allgather": allgather_attention}


def context_parallel_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    group: dist.ProcessGroup,
    comm_type: str,
    *,
    causal: bool,
    scale: float,
    attention_mask: torch.Tensor | None = None,
    attention_bias: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Attention of this rank's zigzag-local queries over the whole sequence's keys.

    ``query [s_l, b, n_p, d]``, ``key``/``value [s_l, b, g_p, d]`` -> ``[s_l, b, n_p, d]``, where the
    ``s_l`` local tokens are chunks ``r`` and ``2 cp - 1 - r`` of the sequence
    (:mod:`~mcore.models.transformer.context_parallel.layout`). Masks, additive biases (ALiBi, T5)
    and attention dropout are not supported under context parallelism (refused at set-up by
    :func:`~mcore.models.transformer.context_parallel.checks.check_context_parallel`; checked again here).
    """
    if attention_mask is not None or attention_bias is not None or dropout_p > 0.0:
        raise ValueError(
            "context parallelism supports neither an attention mask (--reset-attention-mask), an additive "
            "attention bias (ALiBi, relative positions) nor --attention-dropout > 0"
        )
    if query.shape[0] % 2 != 0:
        raise ValueError(f"a context-parallel rank needs an even local sequence length, got {query.shape[0]}")
    return _IMPLEMENTATIONS[comm_type](query, key, value, group, causal=causal, scale=scale)
