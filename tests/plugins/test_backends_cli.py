"""``python -m mcore.backends``: backends, availability with reasons, capabilities, op providers."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys


def test_python_m_mcore_backends_lists_backends_and_op_providers():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "mcore.backends"], capture_output=True, text=True, env=env, timeout=120
    )
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert out.startswith("mcore plugin API ")
    assert "backend cpu (available" in out
    assert "op rms_norm" in out and "reference" in out
    # Without torch_npu, the NPU backend is listed as unavailable with what to install.
    if "torch_npu" not in sys.modules:
        assert "backend npu (unavailable: torch_npu is not installed" in out
        assert "pip install" in out
    if any(ep.name == "example" for ep in importlib.metadata.entry_points(group="mcore.backends")):
        example = out[out.index("backend example") :]
        assert (
            "op rms_norm               example" in example
            and "op layer_norm             reference" in example
        )
