"""All-to-all (DeepSpeed-Ulysses) context-parallel attention: sequence <-> heads.

Each CP rank holds ``s_l = s / cp`` tokens (the zigzag layout) of all ``n_p`` local heads. An
all-to-all gives it all ``s`` tokens of ``n_p / cp`` heads; the tokens are put in position order, a
plain causal attention runs (the op table's ``attention``: whole sequences, so nothing is merged),
and the inverse permutation and all-to-all bring the output back to ``[s_l, b, n_p, d]``.

GQA: keys/values have ``g_p`` heads. When ``g_p`` is a multiple of ``cp`` they are split like the
queries (query heads ``c n_p/cp ..`` use key heads ``c g_p/cp ..``: the group-major head order keeps
them together). Otherwise they are repeated to ``n_p`` heads first (their gradient is summed back by
autograd through the repeat), which costs the all-to-all of ``n_p`` instead of ``g_p`` heads.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mcore.backend import get_ops
from mcore.models.transformer.context_parallel.comm import heads_to_seq, seq_to_heads
from mcore.models.transformer.context_parallel.layout import gathered_to_global


def ulysses_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    causal: bool,
    scale: float,
) -> torch.Tensor:
    """``query [s_l, b, n_p, d]``, ``key``/``value [s_l, b, g_p, d]`` (zigzag-local) -> ``[s_l, b, n_p, d]``."""
    cp = dist.get_world_size(group)
    n, g = query.shape[2], key.shape[2]
    if n % cp != 0:
        raise ValueError(
            f"--cp-comm-type a2a needs the local attention heads ({n}) divisible by context_parallel_size={cp}"
        )
    if g % cp != 0:
        key = key.repeat_interleave(n // g, dim=2)
        value = value.repeat_interleave(n // g, dim=2)
    q, k, v = (seq_to_heads(x, group) for x in (query, key, value))  # [s, b, heads/cp, d], rank-major
    s = q.shape[0]
    order = gathered_to_global(s, cp, device=q.device)
    q, k, v = (x.index_select(0, order).permute(1, 2, 0, 3) for x in (q, k, v))  # [b, heads, s, d]
    out = get_ops().attention(q, k, v, causal=causal, scale=scale)  # [b, n/cp, s, d]
    inverse = torch.argsort(order)
    out = out.permute(2, 0, 1, 3).index_select(0, inverse)  # [s, b, n/cp, d], rank-major
    return heads_to_seq(out, group)
