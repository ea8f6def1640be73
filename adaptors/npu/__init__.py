"""NPU support, MindSpeed style: ``import mcore.adaptors.npu`` before pretraining.

Importing this package calls :func:`activate` once (idempotently): it imports torch_npu, registers
the NPU backend plugin, makes ``npu`` what ``--device-backend auto`` selects, and applies the patch
table of :mod:`mcore.adaptors.npu.patches`, logging once what it patched. ``--device-backend npu``
reaches the same :func:`activate` through the backend's ``on_activate`` method, so a
script needs either the import or the flag, not both. No command-line parsing happens at import,
and there is no global CUDA-to-NPU redirect.

Without torch_npu the import raises one :class:`ImportError` saying what to install.
"""

from mcore.adaptors.npu.activation import activate, applied_patches, deactivate, is_active

activate()

__all__ = ["activate", "applied_patches", "deactivate", "is_active"]
