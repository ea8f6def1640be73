"""In-process model tests run on the test backend (``MCORE_TEST_BACKEND``, CPU by default)."""

import pytest

from mcore.testing.distributed import test_backend_name


@pytest.fixture
def device():
    """The test backend's device 0, with that backend selected for the test."""
    from mcore.plugins.manager import select_backend

    return select_backend(test_backend_name()).device(0)
