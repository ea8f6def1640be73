"""``python -m mcore.<tool>`` from a source checkout that is not installed in editable mode.

The repository keeps ``backends/`` and ``adaptors/`` beside ``mcore/``; an install maps them to
``mcore.backends`` / ``mcore.adaptors``. Run from the repository root with a regular install, the
source ``mcore/`` is imported instead (the current directory comes first on ``sys.path``), and
:mod:`mcore` maps the two sub-packages to the checkout's folders itself. The child process below
simulates that: it drops the editable install's finder for this distribution and imports ``mcore``
from the repository root.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]

SCRIPT = r"""
import runpy, sys
# What an editable install adds; a regular install (or none) has no such finder.
sys.meta_path[:] = [f for f in sys.meta_path if "mcore_train" not in str(getattr(f, "__module__", ""))]
sys.path.insert(0, {repo!r})
import mcore, mcore.backends, mcore.adaptors.patching
assert mcore.__file__.startswith({repo!r}), mcore.__file__
print("backends from", mcore.backends.__file__)
print("adaptors from", mcore.adaptors.patching.__file__)
sys.argv = ["python -m mcore.backends"]
runpy.run_module("mcore.backends", run_name="__main__", alter_sys=True)
"""


def test_python_m_tool_runs_from_the_repository_root_without_an_editable_install():
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(repo=str(REPO))],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"backends from {REPO / 'backends' / '__init__.py'}" in proc.stdout
    assert f"adaptors from {REPO / 'adaptors' / 'patching.py'}" in proc.stdout
    assert "backend cpu (available" in proc.stdout and "op rms_norm" in proc.stdout


def test_the_mapping_serves_only_the_two_sibling_packages():
    import mcore

    finder = mcore._SourceCheckoutFinder(str(REPO))
    assert finder.find_spec("mcore.backends").submodule_search_locations == [str(REPO / "backends")]
    assert finder.find_spec("mcore.adaptors").origin == str(REPO / "adaptors" / "__init__.py")
    for name in ("mcore.tests", "mcore.examples", "mcore.backends.cpu", "backends", "other.backends"):
        assert finder.find_spec(name) is None, name


def test_without_any_install_the_plugin_manager_says_to_install(monkeypatch):
    import importlib.metadata

    from mcore.plugins.manager import PluginError, new_plugin_manager

    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: ())
    with pytest.raises(PluginError, match=r"group 'mcore.backends' is empty.*pip install -e \."):
        new_plugin_manager()
