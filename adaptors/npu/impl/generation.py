"""NPU variant of the pipeline-parallel hand-off in :mod:`mcore.inference.generation`: no fp64 on HCCL."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch


def fp64_as_int32_pairs(from_last_stage: Callable) -> Callable:
    """WRAP ``TextGenerator._from_last_stage``: an fp64 tensor crosses the pipeline as int32 bit pairs.

    Beam search keeps its scores in fp64 on the host and broadcasts them from the last pipeline stage.
    HCCL has no fp64 (MindSpeed casts fp64 all-reduces to fp32), and a cast would change
    which beams win compared with one stage. Reinterpreting the 8 bytes as two int32 moves them exactly.
    """

    @functools.wraps(from_last_stage)
    def _from_last_stage(self, tensor, shape, dtype):
        if dtype != torch.float64 or self.groups.pp_size == 1:
            return from_last_stage(self, tensor, shape, dtype)
        wire_shape = (*shape[:-1], 2 * shape[-1])
        bits = None if tensor is None else tensor.detach().cpu().contiguous().view(torch.int32)
        return from_last_stage(self, bits, wire_shape, torch.int32).contiguous().view(torch.float64)

    return _from_last_stage
