"""The NPU backend plugin: Ascend NPUs through torch_npu, HCCL, and CANN fused ops.

Registered through the ``mcore.backends`` entry point like any third-party plugin. Its hooks:

* ``mcore_backends``: the :class:`~mcore.backends.npu.backend.NPUBackend` (unavailable, with the
  reason, where torch_npu or a device is missing);
* ``mcore_register_ops``: the CANN fused ops of :mod:`mcore.backends.npu.ops` (RMSNorm, rotary,
  SwiGLU, fused attention, fp16 masked softmax, AdamW) for the NPU backend;
* ``mcore_backend_activated``: when the NPU backend becomes current (``--device-backend npu``, or
  ``auto`` on an NPU machine), activates the NPU adaptor exactly as ``import mcore.adaptors.npu``
  does, so both paths give the same process (see :func:`mcore.adaptors.npu.activate`);
* ``mcore_configure`` (before process groups exist): refuses bf16 on chips without it (910A), sets
  the HCCL timeouts a user would otherwise have to know from ``--distributed-timeout-minutes``
  (:func:`mcore.backends.npu.hccl.hccl_env_defaults`), and sizes HCCL buffers from the model;
* ``mcore_process_group_options``: ``ProcessGroupHCCL.Options`` per parallel axis
  (:mod:`mcore.backends.npu.hccl`);
* ``mcore_on_shutdown``: forgets per-run state.

Nothing imports torch_npu at import time: this module loads on every machine.
"""

from __future__ import annotations

import logging
from typing import Any

from mcore.backends.npu.backend import NPUBackend, NPUSupportMissing, import_torch_npu
from mcore.backends.npu.hccl import HCCLSettings, apply_hccl_env_defaults, process_group_options
from mcore.backends.npu.ops import PROVIDER

from mcore.config.fields import ConfigError
from mcore.plugins import hookimpl

MCORE_PLUGIN_API_VERSION = "1.1"

log = logging.getLogger("mcore.backends.npu")
_settings = HCCLSettings()


def _serves(backend: Any) -> bool:
    return isinstance(backend, NPUBackend)


@hookimpl
def mcore_backends():
    return [NPUBackend()]


@hookimpl
def mcore_register_ops(backend, registry):
    if not _serves(backend):
        return
    from mcore.backends.npu.ops import build_npu_ops

    for name, fn in build_npu_ops(import_torch_npu()).items():
        registry.override(name, fn, provider=PROVIDER)


@hookimpl
def mcore_backend_activated(backend):
    if not _serves(backend):
        return
    from mcore.adaptors.npu import activate  # importing the adaptor activates it; the call is a no-op then

    activate()


@hookimpl
def mcore_configure(backend, configs):
    if not _serves(backend):
        return
    precision = configs.get("precision")
    if getattr(precision, "bf16", False) and "bf16" not in backend.capabilities():
        raise ConfigError(
            f"--bf16: this NPU ({backend._module().get_device_name()}) has no bf16 (Atlas 910A); "
            "use --fp16 instead"
        )
    parallel = configs.get("parallel")
    if parallel is not None:
        # HCCL reads its timeouts when the first communicator is created: this hook runs before
        # initialize_parallel, which is what makes it the place (and not a patch).
        try:
            updates = apply_hccl_env_defaults(parallel.distributed_timeout_minutes)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        if updates:
            log.info("HCCL defaults for this run: %s", ", ".join(f"{k}={v}" for k, v in updates.items()))
    _settings.configure(configs)


@hookimpl
def mcore_process_group_options(backend, axis):
    if not _serves(backend):
        return None
    return process_group_options(import_torch_npu(), axis, _settings)


@hookimpl
def mcore_on_shutdown(backend):
    if _serves(backend):
        _settings.adaptive_mb = {}


__all__ = ["MCORE_PLUGIN_API_VERSION", "NPUBackend", "NPUSupportMissing"]
