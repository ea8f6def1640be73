"""The load-balanced (zigzag) sequence layout of context parallelism, and the ring's block schedule.

Pure index arithmetic, no communication.

Layout. A sequence of length ``s`` is cut into ``2 cp`` chunks of ``L = s / (2 cp)`` tokens; CP rank
``r`` keeps chunks ``r`` and ``2 cp - 1 - r`` (in that order), ``2 L`` tokens. Under a causal mask the
early chunks attend to few keys and the late ones to many; pairing chunk ``r`` with its mirror gives
every rank the same attention work (Megatron's ``get_batch_on_this_cp_rank``).

Ring schedule. At ring step ``i`` rank ``r`` holds the keys/values of rank ``src = (r - i) mod cp``
(chunks ``src`` and ``2 cp - 1 - src``). Which of its queries see which of those keys:

* ``src == r`` (``"diagonal"``): the rank's own two chunks, in increasing position order: the plain
  causal mask over the ``2 L`` local tokens.
* ``src < r`` (``"kv_first_half"``): both local query chunks come after key chunk ``src`` and before
  key chunk ``2 cp - 1 - src``: every query sees the first half of the keys, none the second half.
* ``src > r`` (``"q_second_half"``): query chunk ``r`` precedes both key chunks (sees nothing); query
  chunk ``2 cp - 1 - r`` follows both (sees all keys).
"""

from __future__ import annotations

import torch

DIAGONAL, KV_FIRST_HALF, Q_SECOND_HALF = "diagonal", "kv_first_half", "q_second_half"


def check_divisible(seq_length: int, cp_size: int) -> None:
    """Raise ValueError unless ``seq_length`` splits into ``2 cp`` equal chunks."""
    if seq_length % (2 * cp_size) != 0:
        raise ValueError(
            f"seq_length={seq_length} is not divisible by 2 x context_parallel_size={2 * cp_size} "
            "(the load-balanced layout cuts each sequence into 2*cp chunks)"
        )


def zigzag_chunks(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two chunk indices rank ``cp_rank`` keeps: ``(cp_rank, 2 cp - 1 - cp_rank)``."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def zigzag_indices(seq_length: int, cp_rank: int, cp_size: int, device=None) -> torch.Tensor:
    """The global positions of rank ``cp_rank``'s tokens, ``[2 L]`` int64 in local order."""
    check_divisible(seq_length, cp_size)
    chunk = seq_length // (2 * cp_size)
    first, second = zigzag_chunks(cp_rank, cp_size)
    return torch.cat(
        [
            torch.arange(first * chunk, (first + 1) * chunk, device=device),
            torch.arange(second * chunk, (second + 1) * chunk, device=device),
        ]
    )


def slice_for_cp(tensor: torch.Tensor, dim: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """Rank ``cp_rank``'s part of ``tensor`` along its sequence dimension ``dim`` (chunks ``r`` and
    ``2 cp - 1 - r`` concatenated); the identity for ``cp_size == 1``."""
    if cp_size == 1:
        return tensor
    index = zigzag_indices(tensor.shape[dim], cp_rank, cp_size, device=tensor.device)
    return tensor.index_select(dim, index)


def gathered_to_global(seq_length: int, cp_size: int, device=None) -> torch.Tensor:
    """The order that puts a CP gather back in position order.

    An all-gather or all-to-all over the CP group concatenates every rank's zigzag tokens in rank
    order; ``gathered.index_select(dim, order)`` with the returned ``order [s]`` (int64) is the
    sequence in position order: ``order[p]`` is the gathered index of global position ``p``.
    """
    positions = torch.cat([zigzag_indices(seq_length, r, cp_size) for r in range(cp_size)])
    return torch.argsort(positions).to(device)


def ring_block_kind(cp_rank: int, src_rank: int) -> str:
    """Which queries of ``cp_rank`` see which keys of ``src_rank`` (module docstring): ``"diagonal"``,
    ``"kv_first_half"`` or ``"q_second_half"``."""
    if src_rank == cp_rank:
        return DIAGONAL
    return KV_FIRST_HALF if src_rank < cp_rank else Q_SECOND_HALF


def ring_schedule(cp_rank: int, cp_size: int) -> list[tuple[int, str]]:
    """``[(src_rank, kind)]`` for ring steps ``0 .. cp - 1`` of rank ``cp_rank`` (KV blocks move to the
    next rank each step, so step ``i`` holds rank ``(cp_rank - i) mod cp``'s block)."""
    return [
        ((cp_rank - i) % cp_size, ring_block_kind(cp_rank, (cp_rank - i) % cp_size)) for i in range(cp_size)
    ]
