"""Every hook a device-backend plugin can implement, grouped by when it fires.

A plugin is a module (or object) registered under the entry-point group ``mcore.backends``::

    [project.entry-points."mcore.backends"]
    mychip = "mychip_mcore.plugin"

The module declares the plugin API it was written for, ``MCORE_PLUGIN_API_VERSION = "1.2"``;
mcore refuses a plugin whose major version differs from :data:`PLUGIN_API_VERSION`, naming
both versions. Hooks are implemented with :data:`mcore.plugins.hookimpl`. Hooks run at set-up
time only: the training hot path calls the selected :class:`mcore.backend.DeviceBackend` object
and its op table directly, never ``pm.hook``.

Lifecycle: discovery (``mcore_backends``), op registration once a backend is selected
(``mcore_register_ops``), activation of the selected backend (``mcore_backend_activated``),
configuration (``mcore_configure``), process-group creation (``mcore_process_group_options``), and
shutdown (``mcore_on_shutdown``).

Discovery is the one hook every backend plugin needs. What a backend does for itself at the later
moments belongs in methods of its backend object (:class:`mcore.backend.BackendHooks`:
``register_ops``, ``on_activate``, ``configure``, ``process_group_options``, ``on_shutdown``), which
mcore calls for the selected backend only, right before the hook of the same moment. The hooks are
broadcast: every plugin's implementation sees every backend, which is what a plugin serving any
backend wants (a tracer wrapping ops, a profiler); such an implementation reads ``backend`` but must
not assume it is its own.
"""

from __future__ import annotations

from typing import Any

import pluggy

PROJECT = "mcore"
PLUGIN_API_VERSION = "1.2"
"""The plugin API version. A plugin built for another major version is refused.

1.1 added ``mcore_backend_activated``. 1.2 added the backend object's own set-up methods
(:class:`mcore.backend.BackendHooks`), op wrapping and reading (``registry.wrap``, ``registry.current``,
``registry.provider``) and the optional interfaces :class:`mcore.backend.LayerCompiler` and
:class:`mcore.backend.DeviceGraphs`. Plugins declaring 1.0 or 1.1 keep working."""

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

    Fires: whenever a backend's op table is resolved: once when a backend is selected, before any
    model is built (each process selecting one, including each spawned rank), and once per
    available backend in ``python -m mcore.backends``. The backend's own ``register_ops`` method has
    run already, so its replacements are in the registry.
    Args:
        backend: the backend whose table is being built.
        registry: an :class:`mcore.ops.registry.OpRegistry`. ``registry.provider(op)`` and
            ``registry.current(op)`` read what serves an op; ``registry.wrap(op, wrapper,
            provider="<plugin>")`` declares a wrapper that receives that implementation (tracing,
            profiling: any backend); ``registry.override(op, fn, provider="<plugin>")`` replaces it
            (a backend's kernels: do that in the backend's ``register_ops`` instead). An unknown op
            name is an error; two providers replacing the same op is an error naming both.
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

    Fires: once, when :func:`mcore.distributed.groups.destroy_parallel` runs (the end of
    ``pretrain``); a process that never calls it (the conformance kit's spawned ranks) never fires it.
    Returns: nothing. Not firstresult.
    """
