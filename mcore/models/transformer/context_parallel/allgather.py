"""All-gather context-parallel attention: every rank gathers the whole sequence's keys and values.

Rank ``r`` keeps its queries (chunks ``r`` and ``2 cp - 1 - r`` of length ``L``). The gathered keys
and values are put in position order; query chunk ``c`` sees keys ``[0, (c + 1) L)`` under the causal
mask aligned at the end (the ``attention`` op's convention), so each chunk is one plain attention call
on a prefix of the keys. No merge is needed. Not overlapped: the gather precedes the computation.
The gradient of the gather is a reduce-scatter (every rank's queries contribute to every key).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mcore.backend import get_ops
from mcore.models.transformer.context_parallel.layout import gathered_to_global, zigzag_chunks
from mcore.tensor_parallel.mappings import gather_from_sequence_parallel_region


def allgather_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    causal: bool,
    scale: float,
) -> torch.Tensor:
    """``query [s_l, b, n_p, d]``, ``key``/``value [s_l, b, g_p, d]`` (zigzag-local) -> ``[s_l, b, n_p, d]``."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    kv = gather_from_sequence_parallel_region(torch.stack([key, value]).transpose(0, 1), group)
    s_local = query.shape[0]
    s = s_local * cp
    kv = kv.index_select(0, gathered_to_global(s, cp, device=kv.device))  # [s, 2, b, g_p, d]
    k, v = (x.permute(1, 2, 0, 3) for x in kv.unbind(1))  # [b, g_p, s, d]
    chunk = s_local // 2
    q = query.permute(1, 2, 0, 3)  # [b, n_p, s_l, d]
    ops = get_ops()
    outs = []
    for half, c in enumerate(zigzag_chunks(rank, cp)):
        qc = q[:, :, half * chunk : (half + 1) * chunk]
        end = (c + 1) * chunk if causal else s
        outs.append(ops.attention(qc, k[:, :, :end], v[:, :, :end], causal=causal, scale=scale))
    return torch.cat(outs, dim=2).permute(2, 0, 1, 3)
