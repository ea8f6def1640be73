"""NPU backend settings: HCCL environment defaults and per-group options, capability checks
(``NPUBackend.configure``). The tests that need torch_npu use the SIMULATED one (names say so)."""

from __future__ import annotations

import pytest
from mcore.backends.npu import simulated
from mcore.backends.npu.backend import NPUBackend
from mcore.backends.npu.hccl import (
    HCCLSettings,
    activation_buffer_mb,
    hccl_env_defaults,
    parse_group_buffer,
    process_group_options,
)

from mcore.config.fields import ConfigError
from mcore.config.parallel import ParallelConfig

HCCL_VARS = ("HCCL_CONNECT_TIMEOUT", "HCCL_EXEC_TIMEOUT", "HCCL_EVENT_TIMEOUT", "HCCL_OP_EXPANSION_MODE")


def test_hccl_env_defaults_follow_the_run_timeout():
    assert hccl_env_defaults(10, {}) == {"HCCL_CONNECT_TIMEOUT": "600"}  # Megatron's default 10 minutes
    assert hccl_env_defaults(1, {}) == {"HCCL_CONNECT_TIMEOUT": "120"}  # CANN's minimum
    assert hccl_env_defaults(60, {}) == {
        "HCCL_CONNECT_TIMEOUT": "3600",
        "HCCL_EXEC_TIMEOUT": "3600",  # longer than HCCL's 1836 s: the device must not abort first
        "HCCL_EVENT_TIMEOUT": "3632",
    }
    assert hccl_env_defaults(600, {})["HCCL_CONNECT_TIMEOUT"] == "7200"  # CANN's maximum


def test_hccl_env_defaults_never_override_the_user():
    user = {"HCCL_CONNECT_TIMEOUT": "1800", "HCCL_EXEC_TIMEOUT": "1800"}
    assert hccl_env_defaults(60, user) == {}
    assert "HCCL_EXEC_TIMEOUT" not in hccl_env_defaults(60, {"HCCL_OP_EXPANSION_MODE": "AIV"})
    with pytest.raises(ValueError, match=r"HCCL_CONNECT_TIMEOUT=30 must be an integer in \[120, 7200\]"):
        hccl_env_defaults(10, {"HCCL_CONNECT_TIMEOUT": "30"})
    with pytest.raises(ValueError, match="HCCL_EVENT_TIMEOUT=100 must be greater than HCCL_EXEC_TIMEOUT=200"):
        hccl_env_defaults(10, {"HCCL_EXEC_TIMEOUT": "200", "HCCL_EVENT_TIMEOUT": "100"})


def test_group_buffer_spec_and_adaptive_sizes():
    assert parse_group_buffer("dp:200; tp:300;pp:50") == {"dp": 200, "tp": 300, "pp": 50}
    with pytest.raises(ValueError, match="bad entry 'xp:1'"):
        parse_group_buffer("xp:1")
    with pytest.raises(ValueError, match="at least 1 MB"):
        parse_group_buffer("tp:0")
    assert activation_buffer_mb(1, 4096, 4096, 2) == 32  # the reference's mbs*seq*hidden*bytes / 2^20
    settings = HCCLSettings()
    model = type("Model", (), {"seq_length": 4096, "hidden_size": 8192})()
    training = type("Training", (), {"micro_batch_size": 2})()
    precision = type("Precision", (), {"bf16": True, "fp16": False})()
    settings.configure({"model": model, "training": training, "precision": precision})
    assert settings.buffer_mb("tp", {}) == settings.buffer_mb("pp", {}) == 128
    assert settings.buffer_mb("dp", {}) is None  # gradient buckets: HCCL's default
    assert settings.buffer_mb("tp", {"MCORE_HCCL_GROUP_BUFFER": "tp:300"}) == 300  # the user wins


def test_simulated_process_group_options_carry_hccl_config(simulated_npu, monkeypatch):
    monkeypatch.setenv("MCORE_HCCL_GROUP_BUFFER", "dp:256")
    options = process_group_options(simulated_npu, "dp", HCCLSettings())
    assert isinstance(options, simulated_npu._C._distributed_c10d.ProcessGroupHCCL.Options)
    assert options.hccl_config == {"hccl_buffer_size": 256}
    assert process_group_options(simulated_npu, "tp", HCCLSettings()) is None  # HCCL's defaults
    simulated.distributed.check_options(options)  # what torch_npu's creator accepts


def _clear_hccl_env(monkeypatch):
    for var in HCCL_VARS:  # set-then-delete makes monkeypatch remove what the hook sets
        monkeypatch.setenv(var, "0")
        monkeypatch.delenv(var)


def test_simulated_configure_sets_hccl_env_before_process_groups(simulated_npu, monkeypatch):
    import os

    _clear_hccl_env(monkeypatch)
    NPUBackend().configure({"parallel": ParallelConfig(distributed_timeout_minutes=45)})
    assert os.environ["HCCL_CONNECT_TIMEOUT"] == "2700"
    assert os.environ["HCCL_EXEC_TIMEOUT"] == "2700" and os.environ["HCCL_EVENT_TIMEOUT"] == "2732"
    monkeypatch.setenv("HCCL_CONNECT_TIMEOUT", "99999")
    with pytest.raises(ConfigError, match="HCCL_CONNECT_TIMEOUT=99999"):
        NPUBackend().configure({"parallel": ParallelConfig()})


def test_simulated_910a_has_no_bf16_and_configure_refuses_it(monkeypatch):
    _clear_hccl_env(monkeypatch)
    precision = type("Precision", (), {"bf16": True, "fp16": False})()
    with simulated.simulated_torch_npu(chip="Ascend910A"):
        backend = NPUBackend()
        assert "bf16" not in backend.capabilities() and "fp16" in backend.capabilities()
        with pytest.raises(ConfigError, match="no bf16.*use --fp16"):
            backend.configure({"precision": precision})
    with simulated.simulated_torch_npu(chip="Ascend910B3"):
        NPUBackend().configure({"precision": precision})


def test_simulated_npu_backend_runtime_calls_go_through_torch_npu(simulated_npu):
    backend = NPUBackend()
    state = simulated_npu._simulation
    backend.set_device(3)
    assert state.current_device == 3
    backend.synchronize()
    assert state.synchronize_calls == 1
    assert backend.device_type == "cpu" and backend.device(5).type == "cpu"  # simulated tensors live on CPU
    assert backend.peak_flops(__import__("torch").bfloat16) is None  # no verified 910B figure
    assert set(backend.memory_stats()) == {"allocated", "reserved", "peak_allocated"}


def test_npu_backend_without_torch_npu(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "torch_npu", None)
    backend = NPUBackend()
    ok, why = backend.is_available()
    assert not ok and "torch_npu is not installed" in why
    assert backend.capabilities() == frozenset() and backend.device_type == "npu"
