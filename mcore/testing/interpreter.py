"""Running a test module's kernel checks under Triton's CPU interpreter, in a child process.

The CUDA backend's Triton kernels are checked on CPU by running them with ``TRITON_INTERPRET=1``. The
variable must be set before Triton defines a kernel (it is read when ``@triton.jit`` runs), so a test
module that checks kernels re-runs itself, its ``__main__`` block, in a child process with the
variable set and one thread (the CI machine has two cores)::

    @needs_triton
    def test_my_kernels_under_the_interpreter():
        out = run_under_interpreter(__file__)
        assert "my checks: 12" in out
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

HAS_TRITON = importlib.util.find_spec("triton") is not None

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="needs triton (its CPU interpreter)")
"""Skips a test where Triton is not installed (the ``test`` extra installs it, so CI runs them)."""

_TAIL = 6000
"""Characters of the child's stdout and stderr kept in a failure's message (the ends: the error)."""


def run_under_interpreter(script: str, *args: str, timeout: float = 600) -> str:
    """Run ``python script *args`` with ``TRITON_INTERPRET=1`` and ``OMP_NUM_THREADS=1``; return its
    stdout, or fail with the ends of its stdout and stderr when it exits non-zero."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, script, *args], env=env, capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0:
        pytest.fail(
            f"{os.path.basename(script)} {' '.join(args)} under TRITON_INTERPRET=1 exited "
            f"{proc.returncode}:\n{proc.stdout[-_TAIL:]}\n{proc.stderr[-_TAIL:]}",
            pytrace=False,
        )
    return proc.stdout
