"""The out-of-tree example plugin (examples/third_party_backend): discovered through its entry point,
selectable by name, and conformant (mcore's conformance suite, including a TP=2 training run).

CI installs it as a third party would: ``pip install -e examples/third_party_backend``.
"""

from __future__ import annotations

import importlib.metadata

import pytest

from mcore.plugins.manager import installed_backends, new_plugin_manager, select_backend
from mcore.testing.conformance import BackendConformance

INSTALLED = any(ep.name == "example" for ep in importlib.metadata.entry_points(group="mcore.backends"))
pytestmark = pytest.mark.skipif(
    not INSTALLED, reason="the example plugin is not installed: pip install -e examples/third_party_backend"
)


def test_example_plugin_is_discovered_through_its_entry_point():
    pm = new_plugin_manager()
    assert "example" in {name for name, _ in pm.list_name_plugin()}
    backend = installed_backends(pm)["example"]
    assert backend.priority < installed_backends(pm)["cpu"].priority  # auto never picks it


def test_example_backend_is_selectable_by_name_and_serves_its_own_ops():
    backend = select_backend("example")
    assert backend.name == "example" and backend.dist_backend == "gloo"
    providers = {name: entry.provider for name, entry in backend.ops}
    assert providers["rms_norm"] == providers["swiglu"] == providers["attention"] == "example"
    assert providers["layer_norm"] == "reference"


class TestExamplePluginConformance(BackendConformance):
    backend_name = "example"
