"""mcore's backend conformance suite, run against the NPU backend on the SIMULATED torch_npu.

What this proves: the NPU backend's adapters turn mcore's op contract into the documented torch_npu
calls correctly (layouts, masks, scale, GQA, AdamW powers), its RNG and memory statistics go through
``torch.npu``, and ``hccl`` process groups work (gloo serves them in the simulation). What it does not
prove: anything about real CANN kernels; ``examples/npu_smoke.py`` runs the same checks on hardware.
The TP=2 training check is covered, with PP and the distributed optimizer, by
``test_simulated_npu_training.py``.
"""

import pytest
from mcore.backends.npu import simulated

from mcore.testing.conformance import BackendConformance


class TestSimulatedNPUConformance(BackendConformance):
    backend_name = "npu"
    rank_setup = simulated.install

    @pytest.fixture(autouse=True)
    def _installed(self, simulated_npu):
        yield
