"""The NPU device backend: Ascend NPUs through torch_npu, HCCL for torch.distributed.

torch_npu registers itself as the ``npu`` device type and ``torch.npu`` as its device module
(torch_npu's documented runtime API), so RNG, memory statistics and synchronization go through ``torch.npu`` exactly as
the CUDA backend's go through ``torch.cuda``. Nothing here runs at import: torch_npu is imported the
first time the backend is asked whether it is available, so listing backends on a machine without
torch_npu costs nothing and says why the NPU is unavailable.

Under the simulated torch_npu (:mod:`mcore.backends.npu.simulated`, tests only) the module declares
``SIMULATED_TENSOR_DEVICE = "cpu"``: tensors then live on the CPU while every runtime call still goes
through ``torch.npu``.
"""

from __future__ import annotations

import importlib
import logging
import sys
from types import ModuleType
from typing import Any

import torch
from mcore.backends.npu.hccl import HCCLSettings, apply_hccl_env_defaults, process_group_options

from mcore.backend import BackendBase
from mcore.config.fields import ConfigError

log = logging.getLogger("mcore.backends.npu")

INSTALL_HINT = (
    "install torch_npu, Ascend's PyTorch plugin, built for your torch version "
    f"(torch {torch.__version__.split('+')[0]}: pip install 'torch-npu=={torch.__version__.split('+')[0]}.*'), "
    "with a matching CANN toolkit and driver (https://gitcode.com/Ascend/pytorch)"
)


class NPUSupportMissing(ImportError):
    """torch_npu cannot be imported; the message says what to install."""


def import_torch_npu() -> ModuleType:
    """Import torch_npu (or return the already imported module).

    Raises:
        NPUSupportMissing: torch_npu is not installed, or its import failed (for instance on a CUDA
            build of torch, which torch_npu refuses). The message names the cause and what to install.
    """
    module = sys.modules.get("torch_npu")
    if module is not None:
        return module
    try:
        return importlib.import_module("torch_npu")
    except ImportError as err:
        raise NPUSupportMissing(f"torch_npu is not installed ({err}); {INSTALL_HINT}") from None
    except Exception as err:  # torch_npu raises RuntimeError on a torch with another accelerator
        raise NPUSupportMissing(
            f"importing torch_npu failed ({type(err).__name__}: {err}); {INSTALL_HINT}"
        ) from err


def _loaded_torch_npu() -> ModuleType | None:
    try:
        return import_torch_npu()
    except NPUSupportMissing:
        return None


class NPUBackend(BackendBase):
    """Ascend NPU (910B/A2 and A3 are the chips the CANN fused ops are documented for)."""

    name = "npu"
    dist_backend = "hccl"
    priority = 100

    def __init__(self) -> None:
        super().__init__()
        self.hccl = HCCLSettings()
        """What :meth:`configure` learned about the run, for :meth:`process_group_options`."""

    @property
    def device_type(self) -> str:
        module = sys.modules.get("torch_npu")
        return getattr(module, "SIMULATED_TENSOR_DEVICE", "npu") if module is not None else "npu"

    @property
    def simulated(self) -> bool:
        """True under the CPU test double (never on real hardware)."""
        return bool(getattr(sys.modules.get("torch_npu"), "SIMULATED", False))

    def _module(self) -> ModuleType:
        import_torch_npu()  # torch.npu exists once torch_npu is imported
        return torch.npu

    def is_available(self) -> tuple[bool, str]:
        try:
            import_torch_npu()
        except NPUSupportMissing as err:
            return False, str(err)
        npu = torch.npu
        if not npu.is_available():
            return False, (
                "torch_npu is installed but sees no NPU (check the driver, npu-smi info, and "
                "ASCEND_RT_VISIBLE_DEVICES)"
            )
        what = f"{npu.device_count()} x {npu.get_device_name(0)}"
        if self.simulated:
            what += " (SIMULATED torch_npu test double: tensors on the CPU, HCCL served by gloo)"
        return True, what

    def device(self, local_rank: int = 0) -> torch.device:
        if self.device_type != "npu":
            return torch.device(self.device_type)
        return torch.device("npu", local_rank % max(1, self._module().device_count()))

    def set_device(self, local_rank: int) -> None:
        # HCCL needs the device set before init_process_group (torch_npu's distributed notes).
        npu = self._module()
        npu.set_device(local_rank % max(1, npu.device_count()))

    def memory_stats(self) -> dict[str, int]:
        stats = self._module().memory_stats()
        return {
            "allocated": int(stats.get("allocated_bytes.all.current", 0)),
            "reserved": int(stats.get("reserved_bytes.all.current", 0)),
            "peak_allocated": int(stats.get("allocated_bytes.all.peak", 0)),
        }

    def capabilities(self) -> frozenset[str]:
        module = _loaded_torch_npu()
        if module is None:
            return frozenset()
        caps = {"fp16", "fp32"}
        if torch.npu.is_bf16_supported():  # False on 910A
            caps.add("bf16")
        for op, capability in (
            ("npu_rms_norm", "fused_rms_norm"),
            ("npu_rotary_mul", "fused_rotary"),
            ("npu_swiglu", "fused_swiglu"),
            ("npu_fusion_attention", "flash_attention"),
            ("npu_apply_adam_w", "fused_adam"),
        ):
            if hasattr(module, op):
                caps.add(capability)
        return frozenset(caps)

    def peak_flops(self, dtype: torch.dtype) -> float | None:
        # No verified peak figure for Ascend 910B is at hand, so MFU is not reported rather than
        # computed against a guessed number.
        return None

    # --- set-up methods (mcore.backend.BackendHooks), called for this backend when it is selected ---

    def register_ops(self, registry: Any) -> None:
        """The CANN fused ops of :mod:`mcore.backends.npu.ops` that this torch_npu provides."""
        from mcore.backends.npu.ops import PROVIDER, build_npu_ops

        for name, fn in build_npu_ops(import_torch_npu()).items():
            registry.override(name, fn, provider=PROVIDER)

    def on_activate(self) -> None:
        """Activate the NPU adaptor exactly as ``import mcore.adaptors.npu`` does (idempotent), so
        ``--device-backend npu`` and the import give the same process."""
        from mcore.adaptors.npu import (
            activate,
        )  # importing the adaptor activates it; the call is a no-op then

        activate()

    def configure(self, configs: dict[str, Any]) -> None:
        """Refuse bf16 on chips without it (910A); set the HCCL timeouts from
        ``--distributed-timeout-minutes`` (HCCL reads them when the first communicator is created, so
        this runs before process groups exist); size HCCL buffers from the model."""
        precision = configs.get("precision")
        if getattr(precision, "bf16", False) and "bf16" not in self.capabilities():
            raise ConfigError(
                f"--bf16: this NPU ({self._module().get_device_name()}) has no bf16 (Atlas 910A); "
                "use --fp16 instead"
            )
        parallel = configs.get("parallel")
        if parallel is not None:
            try:
                updates = apply_hccl_env_defaults(parallel.distributed_timeout_minutes)
            except ValueError as err:
                raise ConfigError(str(err)) from None
            if updates:
                log.info("HCCL defaults for this run: %s", ", ".join(f"{k}={v}" for k, v in updates.items()))
        self.hccl.configure(configs)

    def process_group_options(self, axis: str) -> Any:
        """``ProcessGroupHCCL.Options`` per parallel axis (:mod:`mcore.backends.npu.hccl`)."""
        return process_group_options(import_torch_npu(), axis, self.hccl)

    def on_shutdown(self) -> None:
        """Forget per-run state."""
        self.hccl.adaptive_mb = {}
