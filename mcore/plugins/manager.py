"""Finding backend plugins and selecting the device backend.

Plugins are loaded from the entry-point group ``mcore.backends`` (the built-in cpu/cuda/npu
backends register the same way a third party does). A plugin declaring another major API version is
refused with a message naming both versions. ``select_backend(name)`` applies the selection rules:

* ``auto``: the backend preferred by an activated adaptor (``import mcore.adaptors.npu``), else the
  available backend with the highest priority (accelerators above cpu);
* a name: that backend, which must be installed and available.

An unknown or unavailable name raises :class:`BackendSelectionError`, whose message lists every
installed backend and why it is or is not available.

Per-backend behaviour lives in the backend object (:class:`mcore.backend.BackendHooks`: its
``register_ops``, ``on_activate``, ``configure``, ``process_group_options``, ``on_shutdown``
methods). Every plugin manager holds one internal plugin, :class:`BackendMethods`, that calls the
given backend's method first at each of those moments; then the pluggy hooks fire for the plugins
that act on any backend (tracers, profilers) and for plugins written against API 1.0/1.1.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from typing import Any

import pluggy

from mcore.backend import DeviceBackend, set_current_backend
from mcore.ops.reference import REFERENCE_OPS
from mcore.ops.registry import OpRegistry
from mcore.plugins import hookimpl, hookspecs

ENTRY_POINT_GROUP = "mcore.backends"
BACKEND_METHODS = "mcore.backend-methods"
"""The name of the internal plugin that forwards each moment to the backend's own method."""


class PluginError(RuntimeError):
    """A plugin cannot be loaded (wrong API version, import failure, duplicate backend name)."""


class BackendSelectionError(RuntimeError):
    """``--device-backend`` names a backend that is not installed or not available."""


@dataclass
class _State:
    manager: pluggy.PluginManager | None = None
    preferred: str | None = None


_state = _State()


def check_api_version(plugin_name: str, module: Any) -> None:
    """Refuse a plugin built for another major version of the plugin API."""
    declared = getattr(module, "MCORE_PLUGIN_API_VERSION", None)
    if declared is None:
        raise PluginError(
            f"plugin {plugin_name!r} ({getattr(module, '__name__', module)}) does not declare "
            f"MCORE_PLUGIN_API_VERSION; mcore's plugin API is {hookspecs.PLUGIN_API_VERSION}"
        )
    if str(declared).split(".")[0] != hookspecs.PLUGIN_API_VERSION.split(".")[0]:
        raise PluginError(
            f"plugin {plugin_name!r} was built for mcore plugin API {declared}, but this mcore "
            f"provides API {hookspecs.PLUGIN_API_VERSION}; install a version of the plugin "
            f"built for API {hookspecs.PLUGIN_API_VERSION.split('.')[0]}.x"
        )


class BackendMethods:
    """Calls the backend's own :class:`~mcore.backend.BackendHooks` method at each per-backend moment,
    before the broadcast hooks (``tryfirst``). A backend lacking a method gets the default: nothing."""

    @staticmethod
    def _call(backend: Any, method: str, *args: Any) -> Any:
        fn = getattr(backend, method, None)
        return fn(*args) if fn is not None else None

    @hookimpl(tryfirst=True)
    def mcore_register_ops(self, backend, registry):
        self._call(backend, "register_ops", registry)

    @hookimpl(tryfirst=True)
    def mcore_backend_activated(self, backend):
        self._call(backend, "on_activate")

    @hookimpl(tryfirst=True)
    def mcore_configure(self, backend, configs):
        self._call(backend, "configure", configs)

    @hookimpl(tryfirst=True)
    def mcore_process_group_options(self, backend, axis):
        return self._call(backend, "process_group_options", axis)

    @hookimpl(tryfirst=True)
    def mcore_on_shutdown(self, backend):
        self._call(backend, "on_shutdown")


def new_plugin_manager(load_entry_points: bool = True) -> pluggy.PluginManager:
    """A plugin manager with mcore's hookspecs, the backend-method forwarder and (by default) every
    installed plugin registered."""
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    pm.register(BackendMethods(), name=BACKEND_METHODS)
    if load_entry_points:
        entry_points = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
        if not entry_points:
            raise PluginError(
                f"no mcore backend plugin is installed (entry-point group {ENTRY_POINT_GROUP!r} is empty): "
                "mcore is imported from a source folder that was never installed; run "
                "`pip install -e .` in the repository"
            )
        for ep in entry_points:
            if pm.has_plugin(ep.name):
                continue
            try:
                module = ep.load()
            except Exception as err:  # a broken third-party plugin must not hide the others' names
                raise PluginError(f"plugin {ep.name!r} ({ep.value}) failed to import: {err}") from err
            register_plugin(pm, module, ep.name)
    pm.check_pending()
    return pm


def register_plugin(pm: pluggy.PluginManager, plugin: Any, name: str) -> None:
    """Register one plugin after checking its API version (also for plugins registered in code)."""
    check_api_version(name, plugin)
    if not pm.has_plugin(name):
        pm.register(plugin, name=name)
    pm.check_pending()


def plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager, created on first use."""
    if _state.manager is None:
        _state.manager = new_plugin_manager()
    return _state.manager


def reset_plugin_manager(pm: pluggy.PluginManager | None = None) -> None:
    """Replace the process-wide plugin manager (tests) and forget the adaptor preference."""
    _state.manager = pm
    _state.preferred = None


def prefer_backend(name: str | None) -> None:
    """Make ``name`` what ``auto`` selects (called by adaptors such as ``mcore.adaptors.npu``)."""
    _state.preferred = name


def preferred_backend() -> str | None:
    return _state.preferred


def installed_backends(pm: pluggy.PluginManager | None = None) -> dict[str, DeviceBackend]:
    """Every backend the installed plugins supply, by name."""
    pm = pm or plugin_manager()
    backends: dict[str, DeviceBackend] = {}
    for result in pm.hook.mcore_backends():
        for backend in result or []:
            if backend.name in backends:
                raise PluginError(f"two plugins supply a backend named {backend.name!r}")
            backends[backend.name] = backend
    return backends


def describe_backends(backends: dict[str, DeviceBackend]) -> str:
    lines = []
    for name, backend in sorted(backends.items(), key=lambda kv: -kv[1].priority):
        ok, why = backend.is_available()
        lines.append(f"  {name:<10} {'available' if ok else 'unavailable'}: {why}")
    return "\n".join(lines)


def resolve_ops(backend: DeviceBackend, pm: pluggy.PluginManager | None = None) -> None:
    """Build the backend's op table: reference ops, the backend's own replacements
    (``backend.register_ops``), then every plugin's ``mcore_register_ops`` (replacements and wrappers)."""
    pm = pm or plugin_manager()
    registry = OpRegistry(REFERENCE_OPS)
    pm.hook.mcore_register_ops(backend=backend, registry=registry)
    backend.ops = registry.freeze()


def select_backend(
    name: str = "auto", pm: pluggy.PluginManager | None = None, activate: bool = True
) -> DeviceBackend:
    """Apply the selection rules, resolve the op table and (by default) make the backend current."""
    pm = pm or plugin_manager()
    backends = installed_backends(pm)
    if name == "auto":
        preferred = _state.preferred
        if preferred is not None:
            name = preferred
        else:
            available = [b for b in backends.values() if b.is_available()[0]]
            if not available:
                raise BackendSelectionError("no device backend is available:\n" + describe_backends(backends))
            name = max(available, key=lambda b: b.priority).name
    if name not in backends:
        raise BackendSelectionError(
            f"--device-backend {name}: no such backend is installed. Installed backends:\n"
            + describe_backends(backends)
        )
    backend = backends[name]
    ok, why = backend.is_available()
    if not ok:
        raise BackendSelectionError(
            f"--device-backend {name}: backend is installed but unavailable ({why}). Installed backends:\n"
            + describe_backends(backends)
        )
    resolve_ops(backend, pm)
    if activate:
        set_current_backend(backend)
        pm.hook.mcore_backend_activated(backend=backend)
    return backend
