"""Placeholder until the NPU backend lands (issue 10): supplies no backend yet."""

from mcore.plugins import hookimpl

MCORE_PLUGIN_API_VERSION = "1.0"


@hookimpl
def mcore_backends():
    return []
