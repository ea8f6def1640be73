"""``import mcore.adaptors.npu`` and ``--device-backend npu``, against the SIMULATED torch_npu.

The adaptor must activate once and idempotently by either path, apply its patch table (and revert
it), log once, never parse argv or redirect CUDA globally, and without torch_npu fail at import with
one ImportError that says what to install.
"""

from __future__ import annotations

import importlib
import logging
import sys

import pytest
import torch

from mcore.plugins import manager
from mcore.plugins.manager import select_backend

ADAPTOR = "mcore.adaptors.npu"


def _fresh_import():
    """Import the adaptor package as a script would the first time in a process."""
    sys.modules.pop(ADAPTOR, None)
    return importlib.import_module(ADAPTOR)


def _activation_logs(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == ADAPTOR and "NPU support active" in r.getMessage()]


def test_simulated_import_activates_once(simulated_npu, caplog, monkeypatch):
    from mcore.models.transformer.attention import CoreAttention

    core_forward = CoreAttention.forward
    monkeypatch.setattr(sys, "argv", ["train.py", "--not-an-mcore-flag", "--device-backend", "cpu"])
    caplog.set_level(logging.INFO, logger=ADAPTOR)
    adaptor = _fresh_import()
    assert adaptor.is_active()
    assert manager.preferred_backend() == "npu"
    assert CoreAttention.forward is not core_forward
    patches = adaptor.applied_patches()
    assert [row.target for row in patches.applied] == [
        "mcore.models.transformer.attention.CoreAttention.forward",
        "mcore.inference.generation.TextGenerator._from_last_stage",
    ]

    # Again: the module is cached, and activate() itself changes nothing and logs nothing.
    importlib.import_module(ADAPTOR)
    assert adaptor.activate() is patches
    assert CoreAttention.forward is patches.targets[0].installed
    assert len(patches.targets) == len(patches.table)  # every row applies on the (simulated) 910B
    assert len(_activation_logs(caplog)) == 1
    assert "CoreAttention.forward" in _activation_logs(caplog)[0].getMessage()

    # auto now selects the NPU backend; argv was never read (its flags would have said cpu).
    assert select_backend("auto").name == "npu"

    adaptor.deactivate()
    assert CoreAttention.forward is core_forward
    assert manager.preferred_backend() is None


def test_simulated_device_backend_flag_activates_the_same_way(simulated_npu):
    from mcore.adaptors.npu.activation import applied_patches, is_active

    assert not is_active()
    backend = select_backend("npu")  # what --device-backend npu does, no adaptor import
    assert is_active()
    assert manager.preferred_backend() == "npu"
    assert backend.ops.provider("attention") == "npu"
    first = applied_patches()
    select_backend("npu")
    assert applied_patches() is first  # selecting again does not re-apply


def test_simulated_adaptor_registers_the_plugin_without_entry_points(simulated_npu):
    pm = manager.new_plugin_manager(load_entry_points=False)
    manager.reset_plugin_manager(pm)
    from mcore.adaptors.npu import activate

    activate()
    assert "npu" in manager.installed_backends(pm)
    assert select_backend("auto").name == "npu"


def test_simulated_adaptor_does_not_redirect_cuda(simulated_npu):
    cuda_is_available = torch.cuda.is_available
    tensor_cuda = torch.Tensor.cuda
    _fresh_import()
    assert torch.cuda.is_available is cuda_is_available and torch.Tensor.cuda is tensor_cuda
    assert not simulated_npu._simulation.transfer_to_npu_touched
    assert "torch_npu.contrib.transfer_to_npu" not in sys.modules


def test_import_without_torch_npu_gives_one_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # as if torch_npu were not installed
    sys.modules.pop(ADAPTOR, None)
    with pytest.raises(ImportError) as err:
        importlib.import_module(ADAPTOR)
    message = str(err.value)
    assert message.startswith("mcore.adaptors.npu needs torch_npu: torch_npu is not installed")
    assert "pip install 'torch-npu==" in message and "CANN" in message
    assert err.value.__cause__ is None and err.value.__suppress_context__  # one error, not a chain
    assert ADAPTOR not in sys.modules


def test_simulated_sbh_attention_path_matches_the_core_path(simulated_npu):
    """The patched CoreAttention.forward (SBH layout, compressed causal mask, merged explicit mask)
    gives the core forward's output and gradients, and really calls the fused op in SBH."""
    from mcore.adaptors.npu import deactivate

    from mcore.models.transformer.attention import CoreAttention

    config = type("Config", (), {"attention_dropout": 0.0, "kv_channels": 16})()
    module = CoreAttention(config, ctx=None)
    gen = torch.Generator().manual_seed(0)
    s, b, n, g, d = 12, 2, 4, 2, 16
    query, key, value = (torch.randn(s, b, heads, d, generator=gen) for heads in (n, g, g))
    doc = torch.arange(s) >= 5
    document_mask = ~((torch.arange(s)[None, :] <= torch.arange(s)[:, None]) & (doc[None, :] == doc[:, None]))
    document_mask = document_mask[None, None].expand(b, 1, s, s)

    def run(mask):
        leaves = [t.clone().requires_grad_() for t in (query, key, value)]
        out = module(*leaves, mask)
        out.square().sum().backward()
        return out.detach(), [t.grad for t in leaves]

    select_backend("npu")  # activates the adaptor
    layouts = []
    torch_npu = sys.modules["torch_npu"]
    fused = torch_npu.npu_fusion_attention

    def spy(*args, **kwargs):
        layouts.append((args[4], kwargs.get("sparse_mode")))
        return fused(*args, **kwargs)

    torch_npu.npu_fusion_attention = spy
    try:
        patched = [run(None), run(document_mask)]
        assert layouts == [("SBH", 2), ("SBH", 0)]
        deactivate()
        core = [run(None), run(document_mask)]
        assert [layout for layout, _ in layouts[2:]] == ["BNSD", "BNSD"]  # the op table's layout
    finally:
        torch_npu.npu_fusion_attention = fused
    for (out_p, grads_p), (out_c, grads_c) in zip(patched, core):
        torch.testing.assert_close(out_p, out_c, rtol=1e-5, atol=1e-6)
        for gp, gc in zip(grads_p, grads_c):
            torch.testing.assert_close(gp, gc, rtol=1e-5, atol=1e-6)


def test_simulated_sbh_path_steps_aside_for_alibi_and_other_backends(simulated_npu):
    from mcore.models.transformer.attention import CoreAttention

    config = type("Config", (), {"attention_dropout": 0.0, "kv_channels": 8})()
    module = CoreAttention(config, ctx=None)
    q = torch.randn(6, 1, 2, 8)
    select_backend("npu")
    bias = torch.zeros(1, 2, 6, 6)
    out = module(q, q, q, None, bias)  # ALiBi bias: the core forward (op table -> reference)
    assert out.shape == (6, 1, 16)
    select_backend("cpu")  # the patch is still applied but the table is not the NPU's
    assert module(q, q, q).shape == (6, 1, 16)


def test_simulated_smoke_script_passes():
    """examples/npu_smoke.py, the real-hardware check, runs end to end on the simulated torch_npu."""
    import os
    import pathlib
    import subprocess

    script = pathlib.Path(__file__).resolve().parents[2] / "examples" / "npu_smoke.py"
    run = subprocess.run(
        [sys.executable, str(script), "--simulated", "--no-distributed"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "checks passed (SIMULATED)" in run.stdout and "FAIL" not in run.stdout
    assert "backend npu: 8 x Ascend910B2 (SIMULATED" in run.stdout


def test_simulated_pipeline_handoff_moves_fp64_as_exact_int32_bits(simulated_npu):
    """HCCL has no fp64: beam-search scores cross the pipeline as int32 pairs, bit for bit."""
    import types

    from mcore.inference.generation import TextGenerator

    core = TextGenerator._from_last_stage
    select_backend("npu")
    wire = []

    def fake_broadcast(self, tensor, shape, dtype):  # what the core method does, minus the collective
        wire.append((dtype, tuple(shape)))
        return tensor if tensor is not None else torch.zeros(shape, dtype=dtype)

    from mcore.adaptors.npu.impl.generation import fp64_as_int32_pairs

    wrapped = fp64_as_int32_pairs(fake_broadcast)
    last = types.SimpleNamespace(groups=types.SimpleNamespace(pp_size=2))
    scores = torch.tensor([[1 / 3, -float("inf"), 2.0**-40, -7.125]], dtype=torch.float64)
    out = wrapped(last, scores, (1, 4), torch.float64)
    assert wire == [(torch.int32, (1, 8))] and out.dtype == torch.float64
    assert torch.equal(out, scores)
    assert wrapped(last, torch.ones(1, 4, dtype=torch.long), (1, 4), torch.long).dtype == torch.long
    assert wire[-1] == (torch.long, (1, 4))  # other dtypes pass through
    assert TextGenerator._from_last_stage is not core  # the table row installed the wrap
