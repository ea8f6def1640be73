"""A SIMULATED ``torch_npu`` for testing the NPU backend and adaptor on machines without an NPU.

THIS IS A TEST DOUBLE. It runs nothing on an Ascend NPU and proves nothing about real kernels'
speed or exact rounding; it checks that mcore calls torch_npu the documented way
(op-plugin's signatures, restated in :mod:`mcore.backends.npu.simulated.ops`) and that the adapted ops give the reference results.
Owners of real NPUs run ``examples/npu_smoke.py`` instead.

What it provides, after :func:`install`:

* ``sys.modules["torch_npu"]`` with the fused ops the backend calls (``npu_rms_norm``,
  ``npu_rotary_mul``, ``npu_swiglu`` (+ ``_backward``), ``npu_fusion_attention`` (+ ``_grad``),
  ``npu_scaled_masked_softmax``, ``npu_apply_adam_w``, ``npu_gelu``), the MoE training ops
  (``npu_grouped_matmul``, ``npu_moe_token_permute_with_routing_map``,
  ``_npu_moe_token_unpermute_with_routing_map`` and their ``_grad`` ops) and ring attention's
  ``npu_ring_attention_update``, computed on the CPU with the real argument names, defaults,
  validation and return arity (:mod:`.ops`, :mod:`.moe_ops`, :mod:`.ring_ops`);
* ``torch.npu`` / ``torch_npu.npu``: the runtime API (device count, set_device, RNG, memory
  statistics, streams, events, compile mode, config), see :mod:`.device`;
* ``torch_npu._C._distributed_c10d.ProcessGroupHCCL.Options`` and a torch.distributed backend
  named ``"hccl"`` that gloo serves (:mod:`.distributed`);
* ``torch_npu.optim.NpuFusedAdamW`` and ``torch_npu.contrib.transfer_to_npu`` (which the adaptor
  must never touch: ``SimulatedNPUState.transfer_to_npu_touched`` records any access).

Simulated "NPU" tensors are CPU tensors: the module sets ``SIMULATED_TENSOR_DEVICE = "cpu"``, and
:class:`mcore.backends.npu.backend.NPUBackend` reads it (real torch_npu has no such attribute, so on
hardware the device type is ``npu``).

Use it in tests only::

    from mcore.backends.npu import simulated

    with simulated.simulated_torch_npu():
        backend = select_backend("npu")            # the NPU backend, on the simulated device

and, for multi-process tests, ``run_distributed(fn, 2, backend="npu", rank_setup=simulated.install)``.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator

import torch
import torch.distributed as dist
from mcore.backends.npu.simulated import moe_ops, ops, ring_ops
from mcore.backends.npu.simulated.device import SimulatedNPUState, build_device_module
from mcore.backends.npu.simulated.distributed import (
    CREATED_GROUPS,
    ProcessGroupHCCL,
    is_hccl_available,
    register_hccl,
)

MODULE_NAME = "torch_npu"
_SUBMODULES = ("npu", "optim", "contrib", "_C", "_C._distributed_c10d", "distributed")


class NpuFusedAdamW(torch.optim.AdamW):
    """``torch_npu.optim.NpuFusedAdamW`` signature; plain AdamW underneath (simulated)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad)


def _module(name: str, doc: str) -> types.ModuleType:
    return types.ModuleType(name, f"SIMULATED {name}: {doc}")


def _build(state: SimulatedNPUState) -> dict[str, types.ModuleType]:
    root = _module(
        MODULE_NAME, "a CPU test double of Ascend's PyTorch plugin (see mcore.backends.npu.simulated)"
    )
    root.__version__ = torch.__version__.split("+")[0] + "+simulated"
    root.SIMULATED = True
    root.SIMULATED_TENSOR_DEVICE = "cpu"
    root._simulation = state
    for module in (ops, moe_ops):
        for name in module.__all__:
            setattr(root, name, getattr(module, name))
    for name in ops.__all__:
        setattr(root, name, getattr(ops, name))
    root.npu_ring_attention_update = ring_ops.npu_ring_attention_update

    npu = build_device_module(state)
    optim = _module(f"{MODULE_NAME}.optim", "optimizers")
    optim.NpuFusedAdamW = NpuFusedAdamW

    contrib = _module(f"{MODULE_NAME}.contrib", "contrib")

    def contrib_getattr(name: str):
        if name == "transfer_to_npu":
            state.transfer_to_npu_touched = True
            return _module(f"{MODULE_NAME}.contrib.transfer_to_npu", "does nothing in the simulation")
        raise AttributeError(name)

    contrib.__getattr__ = contrib_getattr

    c_ext = _module(f"{MODULE_NAME}._C", "C extension")
    c10d = _module(f"{MODULE_NAME}._C._distributed_c10d", "c10d bindings")
    c10d.ProcessGroupHCCL = ProcessGroupHCCL
    c_ext._distributed_c10d = c10d
    distributed = _module(f"{MODULE_NAME}.distributed", "distributed helpers")
    distributed.is_hccl_available = is_hccl_available

    root.npu, root.optim, root.contrib, root._C, root.distributed = npu, optim, contrib, c_ext, distributed
    return {
        MODULE_NAME: root,
        f"{MODULE_NAME}.npu": npu,
        f"{MODULE_NAME}.optim": optim,
        f"{MODULE_NAME}.contrib": contrib,
        f"{MODULE_NAME}._C": c_ext,
        f"{MODULE_NAME}._C._distributed_c10d": c10d,
        f"{MODULE_NAME}.distributed": distributed,
    }


def installed() -> types.ModuleType | None:
    """The simulated module if it is installed in this process, else None."""
    module = sys.modules.get(MODULE_NAME)
    return module if getattr(module, "SIMULATED", False) else None


def install(chip: str = "Ascend910B2", device_count: int = 8) -> types.ModuleType:
    """Install the simulated torch_npu into this process (idempotent); return the module.

    Args:
        chip: what ``torch.npu.get_device_name()`` reports; an ``Ascend910A``/``Ascend910`` chip has
            no bf16 (``is_bf16_supported()`` is False), as on real hardware.
        device_count: what ``torch.npu.device_count()`` reports.

    Raises:
        RuntimeError: a real torch_npu is already imported (the double would shadow it).
    """
    current = sys.modules.get(MODULE_NAME)
    if current is not None and not getattr(current, "SIMULATED", False):
        raise RuntimeError("a real torch_npu is imported in this process; refusing to shadow it")
    if current is not None:
        state = current._simulation
        state.chip, state.device_count = chip, device_count
        return current
    state = SimulatedNPUState(chip=chip, device_count=device_count)
    modules = _build(state)
    sys.modules.update(modules)
    torch.npu = modules[f"{MODULE_NAME}.npu"]
    sys.modules["torch.npu"] = torch.npu
    dist.is_hccl_available = is_hccl_available
    register_hccl()
    return modules[MODULE_NAME]


def uninstall() -> None:
    """Remove the simulated module, ``torch.npu`` and ``dist.is_hccl_available`` (the ``hccl``
    backend name stays registered in torch.distributed, which has no unregister; with the double
    gone nothing selects it)."""
    if installed() is None:
        return
    for name in [MODULE_NAME] + [f"{MODULE_NAME}.{sub}" for sub in _SUBMODULES]:
        sys.modules.pop(name, None)
    if getattr(getattr(torch, "npu", None), "SIMULATED", False):
        del torch.npu
        sys.modules.pop("torch.npu", None)
    if getattr(dist, "is_hccl_available", None) is is_hccl_available:
        del dist.is_hccl_available
    CREATED_GROUPS.clear()


@contextlib.contextmanager
def simulated_torch_npu(chip: str = "Ascend910B2", device_count: int = 8) -> Iterator[types.ModuleType]:
    """Install the double for the duration of a ``with`` block (tests)."""
    was_installed = installed() is not None
    module = install(chip=chip, device_count=device_count)
    try:
        yield module
    finally:
        if not was_installed:
            uninstall()


__all__ = ["CREATED_GROUPS", "install", "installed", "simulated_torch_npu", "uninstall"]
