"""mcore's plugin API (pluggy). Plugins implement the hooks of :mod:`mcore.plugins.hookspecs`."""

import pluggy

from mcore.plugins.hookspecs import PLUGIN_API_VERSION, PROJECT

hookimpl = pluggy.HookimplMarker(PROJECT)
"""Decorator marking a plugin function as the implementation of an ``mcore_*`` hook."""

__all__ = ["PLUGIN_API_VERSION", "hookimpl"]
