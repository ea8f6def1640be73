"""The key/value cache that makes each generated token cost one forward step over one position.

:class:`KVCache` is the ``inference_context`` that :meth:`mcore.models.gpt.gpt_model.GPTModel.forward` threads
down to every :class:`~mcore.models.transformer.attention.SelfAttention`: a layer hands it the keys and values of
the positions it just computed and attends over everything cached so far. Buffers are per layer
(global layer number, so one cache serves one pipeline stage), ``[capacity, b, g_p, d]`` in Megatron's
``[s, b, ...]`` layout, allocated on first use with the keys' dtype and device, and grown by doubling
if a step overflows them.
"""

from __future__ import annotations

import torch


class KVCache:
    """Per-layer key/value buffers of one batch of sequences.

    Args:
        capacity: positions to allocate up front (prompt length + new tokens); grows if exceeded.
    """

    def __init__(self, capacity: int = 0):
        self.capacity = capacity
        self._keys: dict[int, torch.Tensor] = {}
        self._values: dict[int, torch.Tensor] = {}
        self._lengths: dict[int, int] = {}

    def update_kv(
        self, layer_number: int, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``key``/``value`` ``[s_new, b, g_p, d]`` for ``layer_number``; return all of them."""
        length = self._lengths.get(layer_number, 0)
        new = key.shape[0]
        keys, values = self._keys.get(layer_number), self._values.get(layer_number)
        if keys is None or length + new > keys.shape[0]:
            size = max(self.capacity, length + new, 2 * (keys.shape[0] if keys is not None else 0))
            grown_k = key.new_empty((size, *key.shape[1:]))
            grown_v = value.new_empty((size, *value.shape[1:]))
            if keys is not None:
                grown_k[:length] = keys[:length]
                grown_v[:length] = values[:length]
            keys, values = grown_k, grown_v
            self._keys[layer_number], self._values[layer_number] = keys, values
        keys[length : length + new] = key
        values[length : length + new] = value
        self._lengths[layer_number] = length + new
        return keys[: length + new], values[: length + new]

    @property
    def length(self) -> int:
        """Positions cached (0 before the first forward)."""
        return max(self._lengths.values(), default=0)

    def reorder(self, index: torch.Tensor) -> None:
        """Keep batch rows ``index`` (beam search: each new beam continues an old one)."""
        for layer, keys in self._keys.items():
            length = self._lengths[layer]
            rows = index.to(keys.device)
            keys[:length] = keys[:length].index_select(1, rows)
            values = self._values[layer]
            values[:length] = values[:length].index_select(1, rows)

    def reset(self) -> None:
        """Forget every cached position (the buffers are freed)."""
        self._keys.clear()
        self._values.clear()
        self._lengths.clear()


class EncoderDecoderCache(KVCache):
    """A decoder's self-attention key/value cache plus its cross-attention keys and values.

    The cross-attention keys and values depend only on the encoder output, so each layer computes
    them on the first decoding step (``cross_kv(layer_number, compute)`` calls ``compute()``) and
    reads them back afterwards (:class:`mcore.models.transformer.cross_attention.CrossAttention`).
    """

    def __init__(self, capacity: int = 0):
        super().__init__(capacity)
        self._cross: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def cross_kv(self, layer_number: int, compute) -> tuple[torch.Tensor, torch.Tensor]:
        """The cross-attention ``(key, value)`` ``[s_e, b, n_p, d]`` of ``layer_number`` (computed once)."""
        if layer_number not in self._cross:
            self._cross[layer_number] = compute()
        return self._cross[layer_number]

    def reorder(self, index: torch.Tensor) -> None:
        super().reorder(index)
        for layer, (key, value) in self._cross.items():
            rows = index.to(key.device)
            self._cross[layer] = (key.index_select(1, rows), value.index_select(1, rows))

    def reset(self) -> None:
        super().reset()
        self._cross.clear()
