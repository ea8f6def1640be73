"""The pytest suite: :class:`BackendConformance`, the class a backend's test module subclasses."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from mcore.ops.registry import OP_NAMES
from mcore.testing.conformance.collectives import check_collectives
from mcore.testing.conformance.compare import _CAPABILITY, DTYPES
from mcore.testing.conformance.interface import check_interface, check_memory_stats, check_rng
from mcore.testing.conformance.op_cases import OP_CASES, OpCase
from mcore.testing.conformance.op_checks import check_op
from mcore.testing.conformance.training import check_training


class BackendConformance:
    """Subclass as ``Test<Name>Conformance`` with ``backend_name`` set; pytest collects the checks.

    Attributes to override:
        backend_name: the backend to test (``select_backend`` name).
        rank_setup: a module-level function run in each spawned rank before the backend is
            selected (None for installed plugins); assign the function itself (it is read from the
            class, so it is not bound as a method).
        training_rtol: relative loss tolerance of the TP=2 training check against the CPU backend
            (raise it for a backend whose fp32 matmuls are not IEEE fp32, e.g. TF32).
        run_training: set False to skip the training check (it takes a few seconds).
    """

    backend_name: str = ""
    rank_setup: Callable | None = None
    training_rtol: float = 1e-4
    run_training: bool = True

    @pytest.fixture
    def backend(self):
        from mcore.backend import set_current_backend
        from mcore.plugins.manager import select_backend

        if not self.backend_name:
            pytest.fail("set backend_name on the BackendConformance subclass")
        previous = set_current_backend(None)
        set_current_backend(previous)
        selected = select_backend(self.backend_name)
        try:
            yield selected
        finally:
            set_current_backend(previous)

    @pytest.mark.parametrize(
        ("case", "dtype_name"),
        # Only the dtypes each op is specified for (e.g. the Adam step updates fp32 masters only).
        [(c, d) for c in OP_CASES for d in DTYPES if DTYPES[d] in c.dtypes],
        ids=[f"{c.name}-{d}" for c in OP_CASES for d in DTYPES if DTYPES[d] in c.dtypes],
    )
    def test_op_matches_reference(self, backend, case: OpCase, dtype_name: str):
        dtype = DTYPES[dtype_name]
        if _CAPABILITY[dtype] not in backend.capabilities() and dtype != torch.float32:
            pytest.skip(f"backend {backend.name!r} does not claim {_CAPABILITY[dtype]}")
        if case.capability is not None and case.capability not in backend.capabilities():
            pytest.skip(f"backend {backend.name!r} does not claim {case.capability}")
        check_op(backend, case, dtype)

    def test_every_op_is_covered(self):
        assert {case.op for case in OP_CASES} == set(OP_NAMES)

    def test_interface(self, backend):
        check_interface(backend)

    def test_rng_save_restore(self, backend):
        check_rng(backend)

    def test_memory_stats(self, backend):
        check_memory_stats(backend)

    def test_two_process_collectives(self):
        check_collectives(self.backend_name, rank_setup=type(self).rank_setup)

    def test_tp2_training_two_steps(self):
        if not self.run_training:
            pytest.skip(f"{type(self).__name__} sets run_training = False (its training runs elsewhere)")
        check_training(self.backend_name, rank_setup=type(self).rank_setup, rtol=self.training_rtol)
