"""``activate()``: what ``import mcore.adaptors.npu`` and ``--device-backend npu`` both do, once.

Two doors, one room:

* ``import mcore.adaptors.npu`` (MindSpeed users' habit, ``import mindspeed.megatron_adaptor``) runs
  :func:`activate` at import.
* ``--device-backend npu`` (or ``auto`` on a machine where the NPU backend wins) selects the NPU
  backend; :func:`mcore.plugins.manager.select_backend` then calls the backend's ``on_activate``, which
  imports this package, which runs the same :func:`activate`.

:func:`activate` imports torch_npu (an :class:`ImportError` saying what to install if it is missing),
registers the NPU plugin if entry points did not, makes ``npu`` the ``auto`` backend, and applies
the patch table of :mod:`mcore.adaptors.npu.patches` once, logging once what it patched. Calling it
again re-asserts the registration and the preference (cheap) and changes nothing else. It parses no
command line and never imports ``torch_npu.contrib.transfer_to_npu``: the core needs no global
CUDA-to-NPU redirect because it never names CUDA.
"""

from __future__ import annotations

import logging
import threading

from mcore.adaptors.patching import PatchSet, apply_patches
from mcore.backends import npu as npu_plugin
from mcore.backends.npu.backend import NPUSupportMissing, import_torch_npu

from mcore.plugins import manager

log = logging.getLogger("mcore.adaptors.npu")
BACKEND_NAME = "npu"

_lock = threading.RLock()
_patches: PatchSet | None = None


def activate() -> PatchSet:
    """Turn on NPU support in this process (idempotent); return the applied :class:`PatchSet`.

    Raises:
        NPUSupportMissing: torch_npu cannot be imported (an ImportError naming what to install).
        PatchError: a patch target moved (the message names the row); nothing was patched then.
    """
    global _patches
    with _lock:
        try:
            torch_npu = import_torch_npu()
        except NPUSupportMissing as err:
            raise NPUSupportMissing(f"mcore.adaptors.npu needs torch_npu: {err}") from None
        pm = manager.plugin_manager()
        if not pm.is_registered(npu_plugin):
            manager.register_plugin(pm, npu_plugin, BACKEND_NAME)
        manager.prefer_backend(BACKEND_NAME)
        if _patches is None or not _patches.active:
            from mcore.adaptors.npu.patches import PATCHES

            _patches = apply_patches(PATCHES, name="mcore.adaptors.npu")
            version = getattr(torch_npu, "__version__", "?")
            log.info(
                "NPU support active (torch_npu %s); 'auto' selects the npu backend; %d of %d patch rows "
                "applied:\n%s",
                version,
                len(_patches.applied),
                len(_patches.table),
                _patches.describe(),
            )
        return _patches


def deactivate() -> None:
    """Revert the patches and drop the ``auto`` preference (tests; a process rarely needs it)."""
    global _patches
    with _lock:
        if _patches is not None:
            _patches.revert()
            _patches = None
        if manager.preferred_backend() == BACKEND_NAME:
            manager.prefer_backend(None)


def is_active() -> bool:
    """True while the patch table is applied."""
    return _patches is not None and _patches.active


def applied_patches() -> PatchSet | None:
    """The applied patch set, or None before :func:`activate`."""
    return _patches
