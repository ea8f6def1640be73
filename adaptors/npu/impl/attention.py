"""NPU variant of :meth:`mcore.models.transformer.attention.CoreAttention.forward`: fused attention in SBH layout.

The core hands the op table ``[b, n, s, d]`` tensors: it permutes the ``[s, b, n, d]`` heads it has,
and permutes and copies the ``[b, n, s, d]`` result back to ``[s, b, n*d]``. ``npu_fusion_attention``
reads and writes ``[s, b, n*d]`` directly (layout ``"SBH"``, what MindSpeed feeds it), so on the NPU
the two permutes and the output copy are pure overhead around the fastest kernel of the step. This
forward passes the projections' layout straight through:

* ``q [s, b, n_p*d]``, ``k``/``v [s, b, g_p*d]`` (GQA: ``head_num`` = query heads, the op groups);
* causal without a mask: the cached compressed 2048x2048 ``triu`` mask, ``sparse_mode=2``;
* an explicit mask (``--reset-attention-mask`` documents): merged with the causal triangle into a
  B1SS mask once per forward (every layer reuses it), ``sparse_mode=0``, ``next_tockens=0``;
* ``scale`` explicit (the op's default is 1.0), ``keep_prob = 1 - dropout``, dropout inside the
  TP RNG stream as the core does.

Anything else (an ALiBi bias, a dtype or head count the kernel does not take, the NPU attention op not
serving the table) runs the core's forward unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import weakref
from collections.abc import Callable

import torch
from mcore.backends.npu.fusion_masks import FLOAT_DTYPES, MAX_TOCKENS, compressed_causal_mask
from mcore.backends.npu.ops import PROVIDER, fusion_attention_mask

from mcore.backend import get_ops
from mcore.tensor_parallel.random import get_rng_tracker


class _MergedMaskCache:
    """The merged B1SS mask of the last ``attention_mask`` tensor (all layers of a forward share it)."""

    def __init__(self) -> None:
        self._source: weakref.ref | None = None
        self._key: tuple = ()
        self._mask: torch.Tensor | None = None

    def get(self, mask: torch.Tensor, b: int, n: int, s: int) -> torch.Tensor | None:
        key = (mask._version, b, n, s)
        if self._source is not None and self._source() is mask and self._key == key:
            return self._mask
        merged = fusion_attention_mask(mask, b, n, s, s, causal=True)
        self._source, self._key, self._mask = weakref.ref(mask), key, merged
        return merged


_masks = _MergedMaskCache()


def fused_sbh_core_attention(forward: Callable) -> Callable:
    """WRAP ``CoreAttention.forward``: the SBH fused path where it applies, else ``forward``."""

    @functools.wraps(forward)
    def core_attention_forward(self, query, key, value, attention_mask=None, attention_bias=None):
        torch_npu = sys.modules.get("torch_npu")
        s, b, n, d = query.shape
        g = key.shape[2]
        if (
            torch_npu is None
            or getattr(self, "cp_group", None) is not None  # context parallel: the core's ring/a2a path
            or attention_bias is not None
            or get_ops().provider("attention") != PROVIDER
            or not (query.dtype == key.dtype == value.dtype)
            or query.dtype not in FLOAT_DTYPES
            or key.shape[0] != s
            or d > 768
            or n % g
            or (n != g and n > 256)
        ):
            return forward(self, query, key, value, attention_mask, attention_bias)
        kwargs = {"scale": self.scale}
        if attention_mask is None:
            kwargs.update(atten_mask=compressed_causal_mask(query.device), sparse_mode=2)
        else:
            merged = _masks.get(attention_mask, b, n, s)
            if merged is None:
                return forward(self, query, key, value, attention_mask, attention_bias)
            kwargs.update(atten_mask=merged, sparse_mode=0, pre_tockens=MAX_TOCKENS, next_tockens=0)
        p = self.dropout if self.training else 0.0
        kwargs["keep_prob"] = 1.0 - p
        q = query.reshape(s, b, n * d)
        k = key.reshape(s, b, g * d)
        v = value.reshape(s, b, g * d)
        rng = get_rng_tracker().fork() if p > 0.0 else contextlib.nullcontext()
        with rng:
            return torch_npu.npu_fusion_attention(q, k, v, n, "SBH", **kwargs)[0]

    return core_attention_forward
