"""Where a model is built: its tensor-parallel group and coordinates, sequence parallelism, dtype, device.

Every layer of :mod:`mcore.models` takes ``(config: ModelConfig, ctx: BuildContext, ...)``: the
config says *what* to build, the context *how it is split and where it lives*.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mcore.backend import current_backend


@dataclass(frozen=True)
class BuildContext:
    """The parts of the parallel layout and precision a layer needs.

    Attributes:
        tp_group: the tensor-parallel process group (``groups.tp``), None for one process.
        tp_size, tp_rank: size of, and this rank's index in, that group.
        sequence_parallel: activations outside TP regions are split along the sequence.
        params_dtype: dtype of the parameters (fp32, bf16, fp16).
        device: where parameters are created and initialized.
        fp8: the FP8 flags (:class:`mcore.fp8.config.Fp8Config`), None or disabled for none.
        num_layers: the model's total layer count (for ``--first-last-layers-bf16``).
        groups: the job's :class:`~mcore.distributed.groups.ProcessGroups` (None: one process); the
            MoE layers take their expert-parallel groups from it.
    """

    tp_group: Any = None
    tp_size: int = 1
    tp_rank: int = 0
    sequence_parallel: bool = False
    params_dtype: torch.dtype = torch.float32
    device: torch.device | None = None
    fp8: Any = None
    num_layers: int = 0
    groups: Any = None

    def fp8_kwargs(self, layer_number: int) -> dict[str, Any]:
        """``{"fp8": config}`` (the :class:`~mcore.fp8.config.Fp8Config`) for the linears of global layer ``layer_number`` (1-based) when it runs
        in FP8, else ``{}`` (so custom linear classes without an ``fp8`` argument still build)."""
        if self.fp8 is None or not self.fp8.layer_in_fp8(layer_number, self.num_layers):
            return {}
        return {"fp8": self.fp8}


def default_device() -> torch.device:
    """The current device of the selected backend (set by ``initialize_parallel``)."""
    backend = current_backend()
    if backend.device_type == "cpu":
        return torch.device("cpu")
    module = torch.get_device_module(backend.device_type)
    return torch.device(backend.device_type, module.current_device())
