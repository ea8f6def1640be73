"""Plugin discovery and selection rules: entry points, API versions, op conflicts, error messages."""

from __future__ import annotations

import types

import pytest
import torch
from mcore.backends.npu import simulated

from mcore.backend import BackendBase, current_backend
from mcore.ops.registry import OpConflictError
from mcore.plugins import hookimpl, manager
from mcore.plugins.hookspecs import PLUGIN_API_VERSION
from mcore.plugins.manager import (
    BackendSelectionError,
    PluginError,
    installed_backends,
    new_plugin_manager,
    register_plugin,
    select_backend,
)


class FakeBackend(BackendBase):
    device_type = "cpu"
    dist_backend = "gloo"

    def __init__(self, name: str, priority: int = 1, available: bool = True):
        super().__init__()
        self.name, self.priority, self._available = name, priority, available

    def is_available(self):
        return (True, "fake, always there") if self._available else (False, "fake chip is unplugged")

    def device(self, local_rank: int = 0):
        return torch.device("cpu")

    def get_rng_state(self):
        return torch.get_rng_state()

    def set_rng_state(self, state):
        torch.set_rng_state(state)

    def manual_seed(self, seed):
        torch.manual_seed(seed)


def plugin(*backends, version="1.0", ops=None, provider="fake", serves=None, **hooks):
    """A plugin module object: supplies ``backends`` and overrides ``ops`` for the backend named ``serves``."""
    module = types.ModuleType(f"fake_plugin_{provider}")
    module.MCORE_PLUGIN_API_VERSION = version

    @hookimpl
    def mcore_backends():
        return list(backends)

    module.mcore_backends = mcore_backends
    if ops:

        @hookimpl
        def mcore_register_ops(backend, registry):
            if serves is None or backend.name == serves:
                for name, fn in ops.items():
                    registry.override(name, fn, provider=provider)

        module.mcore_register_ops = mcore_register_ops
    for name, fn in hooks.items():
        setattr(module, name, hookimpl(fn))
    return module


def bare_manager(*plugins):
    pm = new_plugin_manager(load_entry_points=False)
    for i, p in enumerate(plugins):
        register_plugin(pm, p, f"plugin{i}")
    return pm


def test_entry_points_register_the_builtin_backends():
    pm = new_plugin_manager()
    names = {name for name, _ in pm.list_name_plugin()}
    assert {"cpu", "cuda", "npu"} <= names
    assert {"cpu", "cuda", "npu"} <= set(installed_backends(pm))


def test_plugin_for_another_major_api_version_is_refused_naming_both():
    with pytest.raises(PluginError) as err:
        bare_manager(plugin(FakeBackend("future"), version="2.0"))
    message = str(err.value)
    assert "2.0" in message and PLUGIN_API_VERSION in message and "plugin0" in message


def test_plugin_without_a_version_is_refused():
    module = plugin(FakeBackend("x"))
    del module.MCORE_PLUGIN_API_VERSION
    with pytest.raises(PluginError, match="does not declare MCORE_PLUGIN_API_VERSION"):
        bare_manager(module)


def test_same_major_older_minor_is_accepted():
    pm = bare_manager(plugin(FakeBackend("old"), version="1.0"))
    assert "old" in installed_backends(pm)


def test_two_plugins_overriding_one_op_is_an_error_naming_both():
    mine = plugin(FakeBackend("chip"), ops={"rms_norm": lambda x, w, eps: x}, provider="vendor_a")
    theirs = plugin(ops={"rms_norm": lambda x, w, eps: x}, provider="vendor_b")
    with pytest.raises(OpConflictError, match=r"'rms_norm' is overridden by both") as err:
        select_backend("chip", pm=bare_manager(mine, theirs), activate=False)
    assert "'vendor_a'" in str(err.value) and "'vendor_b'" in str(err.value)


def test_overriding_an_unknown_op_is_an_error():
    module = plugin(FakeBackend("chip"), ops={"flash_fft": lambda x: x}, provider="vendor")
    with pytest.raises(OpConflictError, match="unknown op 'flash_fft'"):
        select_backend("chip", pm=bare_manager(module), activate=False)


def test_overrides_apply_only_to_the_backend_they_serve():
    module = plugin(
        FakeBackend("chip"),
        FakeBackend("other"),
        ops={"swiglu": lambda x: x},
        provider="vendor",
        serves="chip",
    )
    pm = bare_manager(module)
    assert select_backend("chip", pm=pm, activate=False).ops.provider("swiglu") == "vendor"
    assert select_backend("other", pm=pm, activate=False).ops.provider("swiglu") == "reference"


def test_unknown_backend_lists_what_is_installed():
    pm = bare_manager(plugin(FakeBackend("alpha"), FakeBackend("beta", available=False)))
    with pytest.raises(BackendSelectionError) as err:
        select_backend("gamma", pm=pm)
    message = str(err.value)
    assert "no such backend" in message and "alpha" in message and "beta" in message
    assert "fake chip is unplugged" in message


def test_unavailable_backend_says_why_and_lists_installed():
    pm = bare_manager(plugin(FakeBackend("alpha"), FakeBackend("beta", available=False)))
    with pytest.raises(BackendSelectionError, match=r"installed but unavailable \(fake chip is unplugged\)"):
        select_backend("beta", pm=pm)


def test_npu_without_torch_npu_is_unavailable_with_what_to_install(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "torch_npu", None)  # as if not installed
    with pytest.raises(BackendSelectionError) as err:
        select_backend("npu", pm=new_plugin_manager())
    message = str(err.value)
    assert "torch_npu is not installed" in message and "pip install" in message
    assert "cpu" in message  # the other installed backends are listed


def test_duplicate_backend_names_are_an_error():
    pm = bare_manager(plugin(FakeBackend("twin")), plugin(FakeBackend("twin"), provider="other"))
    with pytest.raises(PluginError, match="two plugins supply a backend named 'twin'"):
        installed_backends(pm)


def test_auto_prefers_the_adaptor_choice_then_priority():
    pm = bare_manager(plugin(FakeBackend("low", priority=1), FakeBackend("high", priority=5)))
    assert select_backend("auto", pm=pm, activate=False).name == "high"
    manager.prefer_backend("low")
    assert select_backend("auto", pm=pm, activate=False).name == "low"


def test_backend_activated_hook_fires_on_selection_only():
    seen = []
    module = plugin(FakeBackend("chip"), mcore_backend_activated=lambda backend: seen.append(backend.name))
    pm = bare_manager(module)
    select_backend("chip", pm=pm, activate=False)
    assert seen == []
    backend = select_backend("chip", pm=pm)
    assert seen == ["chip"] and current_backend() is backend


def test_misspelled_hook_is_refused():
    module = plugin(FakeBackend("chip"), mcore_backend=lambda: [])  # missing the final "s"
    with pytest.raises(Exception, match="mcore_backend"):
        bare_manager(module)


def test_npu_backend_reports_simulated_device_and_unavailable_without_devices():
    with simulated.simulated_torch_npu(device_count=0):
        backend = installed_backends(new_plugin_manager())["npu"]
        ok, why = backend.is_available()
        assert not ok and "sees no NPU" in why
    with simulated.simulated_torch_npu():
        ok, why = backend.is_available()
        assert ok and "SIMULATED" in why
