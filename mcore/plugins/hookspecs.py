"""Every hook a device-backend plugin can implement, grouped by when it fires.

A plugin is a module (or object) registered under the entry-point group ``mcore.backends``::

    [project.entry-points."mcore.backends"]
    mychip = "mychip_mcore.plugin"

The module declares the plugin API it was written for, ``MCORE_PLUGIN_API_VERSION = "1.0"``;
mcore refuses a plugin whose major version differs from :data:`PLUGIN_API_VERSION`, naming
both versions. Hooks are implemented with :data:`mcore.plugins.hookimpl`. Hooks run at set-up
time only: the training hot path calls the selected :class:`mcore.backend.DeviceBackend` object
and its op table directly, never ``pm.hook``.

Lifecycle: discovery (``mcore_backends``), op registration once a backend is selected
(``mcore_register_ops``), activation of the selected backend (``mcore_backend_activated``),
configuration (``mcore_configure``), process-group creation (``mcore_process_group_options``), and
shutdown (``mcore_on_shutdown``).
"""

from __future__ import annotations

from typing import Any

import pluggy

PROJECT = "mcore"
PLUGIN_API_VERSION = "1.1"
"""The plugin API version. A plugin built for another major version is refused.

1.1 added ``mcore_backend_activated``; plugins declaring 1.0 keep working."""

hookspec = pluggy.HookspecMarker(PROJECT)


# --- discovery ---------------------------------------------------------------------------------


@hookspec
def mcore_backends() -> list[Any]:
    """Return the device backends this plugin supplies (a list of ``DeviceBackend`` objects).

    Fires: once, when the plugin manager first lists backends (``--device-backend`` selection,
    ``python -m mcore.backends``).
    Returns: a list (possibly empty) of backend objects. Constructing one must be cheap and must
    not touch the device: availability is asked later through ``is_available()``.
    Not firstresult: the lists of all plugins are concatenated. Two backends with one name is an error.
    """


# --- selection ---------------------------------------------------------------------------------


@hookspec
def mcore_backend_activated(backend: Any) -> None:
    """A backend became this process's current backend.

    Fires: in :func:`mcore.plugins.manager.select_backend` (``activate=True``), after the backend's
    op table is resolved and it is made current, before process groups or models are built; again
    whenever a later ``select_backend`` call makes a backend current. Listing backends
    (``python -m mcore.backends``) does not fire it.
    Args:
        backend: the backend now current; a plugin acts only for a backend it serves.
    Use: the place where selecting a backend by name (``--device-backend npu``) does what importing
    its adaptor does (``import mcore.adaptors.npu`` applies its patch table). Implementations must
    be idempotent.
    Returns: nothing. Not firstresult.
    """


# --- kernels -----------------------------------------------------------------------------------


@hookspec
def mcore_register_ops(backend: Any, registry: Any) -> None:
    """Override named ops of the op table for the selected backend.

    Fires: once, right after a backend is selected, before any model is built.
    Args:
        backend: the selected ``DeviceBackend``; a plugin overrides ops only for a backend it serves
            (compare ``backend.name`` or ask ``backend.capabilities()``).
        registry: an :class:`mcore.ops.registry.OpRegistry`; call
            ``registry.override(op_name, fn, provider="<plugin>")``. An unknown op name is an error;
            two plugins overriding the same op is an error naming both.
    Returns: nothing. Not firstresult: every plugin is called.
    """


# --- configuration -----------------------------------------------------------------------------


@hookspec
def mcore_configure(backend: Any, configs: dict[str, Any]) -> None:
    """Check the parsed configuration against what the backend can do.

    Fires: once per run, after the command line is parsed and the backend is selected, before the
    process groups are built.
    Args:
        backend: the selected backend.
        configs: the config objects by group name (``"parallel"``, ``"model"``, ...). They are
            frozen; a plugin that cannot run a configuration raises
            :class:`mcore.config.fields.ConfigError` with a message naming the value.
    Use: also the place for process settings that must precede torch.distributed and depend on the
    run's configuration (the NPU plugin sets HCCL's timeouts from ``--distributed-timeout-minutes``).
    Returns: nothing. Not firstresult.
    """


# --- process groups ----------------------------------------------------------------------------


@hookspec(firstresult=True)
def mcore_process_group_options(backend: Any, axis: str) -> Any:
    """Options for ``torch.distributed.new_group(pg_options=...)`` for one parallel axis.

    Fires: while :func:`mcore.distributed.groups.initialize_parallel` builds the groups, once per
    axis (``"world"``, ``"tp"``, ``"pp"``, ``"dp"``, ``"cp"``, ``"mp"``, ``"embedding"``).
    Args:
        backend: the selected backend; answer only for one you serve.
        axis: the axis name.
    Returns: a backend-specific options object (e.g. HCCL/NCCL buffer sizes), or ``None`` for the
    defaults. firstresult: the first non-None answer wins.
    """


# --- shutdown ----------------------------------------------------------------------------------


@hookspec
def mcore_on_shutdown(backend: Any) -> None:
    """Release what the plugin holds (profilers, async workers) before the process exits.

    Fires: once, when :func:`mcore.distributed.groups.destroy_parallel` runs.
    Returns: nothing. Not firstresult.
    """
