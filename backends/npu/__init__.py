"""The NPU backend plugin: Ascend NPUs through torch_npu, HCCL, and CANN fused ops.

Registered through the ``mcore.backends`` entry point like any third-party plugin. Its one hook,
``mcore_backends``, supplies the :class:`~mcore.backends.npu.backend.NPUBackend` (unavailable, with
the reason, where torch_npu or a device is missing). What the NPU does once it is selected is in
methods of that object (:class:`mcore.backend.BackendHooks`), which mcore calls for it alone:

* ``register_ops``: the CANN fused ops of :mod:`mcore.backends.npu.ops` (RMSNorm, rotary, SwiGLU,
  fused attention, AdamW);
* ``on_activate``: when the NPU backend becomes current (``--device-backend npu``, or ``auto`` on an
  NPU machine), activates the NPU adaptor exactly as ``import mcore.adaptors.npu`` does, so both
  paths give the same process (see :func:`mcore.adaptors.npu.activate`);
* ``configure`` (before process groups exist): refuses bf16 on chips without it (910A), sets the
  HCCL timeouts a user would otherwise have to know from ``--distributed-timeout-minutes``
  (:func:`mcore.backends.npu.hccl.hccl_env_defaults`), and sizes HCCL buffers from the model;
* ``process_group_options``: ``ProcessGroupHCCL.Options`` per parallel axis
  (:mod:`mcore.backends.npu.hccl`);
* ``on_shutdown``: forgets per-run state.

Nothing imports torch_npu at import time: this module loads on every machine.
"""

from __future__ import annotations

from mcore.backends.npu.backend import NPUBackend, NPUSupportMissing

from mcore.plugins import hookimpl

MCORE_PLUGIN_API_VERSION = "1.2"


@hookimpl
def mcore_backends():
    return [NPUBackend()]


__all__ = ["MCORE_PLUGIN_API_VERSION", "NPUBackend", "NPUSupportMissing"]
