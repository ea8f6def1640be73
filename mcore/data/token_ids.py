"""The per-micro-batch range of the token ids a module sees, kept on the device: the data check of the
embedding's input ids and the last stage's labels (:class:`TokenIdRange`), read by the trainer's
:class:`~mcore.training.token_id_check.TokenIdCheck`."""

from __future__ import annotations

import torch


class TokenIdRange:
    """The smallest and largest token id a module has seen since the last :meth:`take`, kept on the
    device: the per-batch vocabulary check that never waits for the device.

    A check that raised at once would need the host to read the ids (a wait for the device every
    micro-batch), and one asserted on the device (``torch._assert_async``) aborts the process with the
    accelerator's generic "device-side assert", naming neither the id nor the data. So the module
    records ``(min, max)`` of every micro-batch's ids as a 2-element int64 device tensor, makes the ids
    safe for its lookup, and the trainer stages :meth:`take` to the host once per step and reads it
    where it reads the losses anyway (:class:`mcore.training.token_id_check.TokenIdCheck`), raising one
    ``DataError`` that names the id, the iteration and the data.

    Args:
        vocab_size: the padded vocabulary ``V``: valid ids are ``[0, V)``.
        role: what the ids are, for the message (``"input id"``, ``"label"``).
        ignore_index: an id allowed besides ``[0, V)`` (the loss's ignore index, -100), or None.
    """

    def __init__(self, vocab_size: int, role: str, ignore_index: int | None = None):
        self.vocab_size, self.role, self.ignore_index = vocab_size, role, ignore_index
        self._range: torch.Tensor | None = None

    def observe(self, ids: torch.Tensor) -> torch.Tensor:
        """Record the range of ``ids`` (on the device, no host sync) and return ids safe to use: an id
        outside ``[0, V)`` becomes 0 (or the ignore index), so no lookup or loss kernel indexes out of
        bounds before the trainer reports it."""
        if ids.numel() == 0:
            return ids
        seen = ids
        if self.ignore_index is not None:
            seen = ids.masked_fill(ids == self.ignore_index, 0)
        low, high = torch.aminmax(seen)
        if self._range is not None:
            low, high = torch.minimum(self._range[0], low), torch.maximum(self._range[1], high)
        self._range = torch.stack([low, high])
        bad = (seen < 0) | (seen >= self.vocab_size)
        return ids.masked_fill(bad, 0 if self.ignore_index is None else self.ignore_index)

    def take(self) -> torch.Tensor | None:
        """``[min, max]`` (int64, on the ids' device) of the ids seen since the last call, or None when
        none were; the next call starts afresh."""
        seen, self._range = self._range, None
        return seen

    def out_of_range(self, low: int, high: int) -> int | None:
        """The offending id of a range read on the host (the largest if too large, else the smallest if
        negative), or None when every id was in ``[0, V)``."""
        if high >= self.vocab_size:
            return high
        return low if low < 0 else None
