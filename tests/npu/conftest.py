"""Fixtures for the NPU tests. Everything here runs against the SIMULATED torch_npu (a CPU test
double, :mod:`mcore.backends.npu.simulated`): no Ascend hardware is involved."""

import pytest
from mcore.backends.npu import simulated


@pytest.fixture
def simulated_npu():
    """The simulated torch_npu, installed for one test; the NPU adaptor is deactivated afterwards."""
    with simulated.simulated_torch_npu() as module:
        try:
            yield module
        finally:
            from mcore.adaptors.npu.activation import deactivate

            deactivate()
