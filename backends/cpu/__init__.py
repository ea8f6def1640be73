"""The CPU backend plugin: registers the core's default backend (:class:`mcore.backend.CPUBackend`:
gloo for torch.distributed, the reference ops, always available) through the ``mcore.backends``
entry point, as every backend is found.

It is the test default: the whole suite, multi-process TP/PP/DP included, runs on it.
"""

from __future__ import annotations

from mcore.backend import CPUBackend
from mcore.plugins import hookimpl

MCORE_PLUGIN_API_VERSION = "1.2"


@hookimpl
def mcore_backends():
    return [CPUBackend()]


__all__ = ["MCORE_PLUGIN_API_VERSION", "CPUBackend"]
