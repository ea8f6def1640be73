"""Shared pytest set-up: one thread per process (CI has 2 cores) and a clean backend per test."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _reset_backend():
    """Tests that select a backend or register plugins must not leak them into the next test."""
    from mcore.backend import set_current_backend
    from mcore.plugins import manager

    saved_manager, saved_pref = manager._state.manager, manager._state.preferred
    previous = set_current_backend(None)
    set_current_backend(previous)
    yield
    set_current_backend(previous)
    manager._state.manager, manager._state.preferred = saved_manager, saved_pref


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "interpreter_child(*args, timeout=600): the test runs its module under Triton's interpreter "
        "with these arguments (mcore.testing.interpreter); the child starts in the background after collection",
    )


def pytest_collection_modifyitems(session, config, items):
    """Start the Triton-interpreter children of the selected tests now, one at a time at the lowest
    priority (``mcore.testing.interpreter.BackgroundChildren``): the tests later take their results."""
    from mcore.testing.interpreter import BACKGROUND, DEFAULT_TIMEOUT, HAS_TRITON

    if not HAS_TRITON or os.environ.get("MCORE_TEST_BACKEND"):
        return  # skipped without Triton; on a GPU machine the children run in the foreground
    runs = []
    for item in items:
        marker = item.get_closest_marker("interpreter_child")
        if marker is not None:
            runs.append((str(item.path), tuple(marker.args), marker.kwargs.get("timeout", DEFAULT_TIMEOUT)))
    BACKGROUND.start(runs)


def pytest_sessionfinish(session, exitstatus):
    from mcore.testing.interpreter import BACKGROUND

    BACKGROUND.stop()
