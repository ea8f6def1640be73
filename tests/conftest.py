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
