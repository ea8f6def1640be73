"""Training on the SIMULATED NPU reproduces the CPU backend's losses, with the features MindSpeed adapts.

Each run is ``pretrain`` (2 steps of a Llama-style GPT on mock data, no dropout) on two processes
selected with ``--device-backend npu``: the NPU plugin with the simulated torch_npu, the adaptor
activated through the selection hook (the flag path, no import), HCCL process groups served by gloo.
The losses must equal the CPU backend's (TP=2 with sequence parallelism, fp32, computed once per
test session; mcore's own equivalence tests show every layout gives the same loss). Each rank also
reports which fused kernels ran and which ``hccl_config`` reached its process groups, so the test
fails if the simulation silently fell back to the reference path.
"""

from __future__ import annotations

import pytest
from mcore.backends.npu import simulated

from mcore.testing.conformance import (
    TRAINING_ARGV,
    compare_losses,
    reference_training_losses,
    training_rank,
)
from mcore.testing.distributed import run_distributed

LAYOUTS = {
    "tp2_sequence_parallel": ("--tensor-model-parallel-size", "2", "--sequence-parallel"),
    "pp2": ("--pipeline-model-parallel-size", "2"),
    "dp2_distributed_optimizer": ("--use-distributed-optimizer",),
}


def _instrumented_training_rank(argvs):
    """``pretrain`` on the simulated NPU once per argv (in one launch), counting fused-kernel calls."""
    import torch_npu
    from mcore.adaptors.npu import is_active

    calls: dict[str, int] = {}

    def spy(name, fn):
        def wrapper(*args, **kwargs):
            key = f"{name}:{args[4]}" if name == "npu_fusion_attention" else name
            calls[key] = calls.get(key, 0) + 1
            return fn(*args, **kwargs)

        return wrapper

    for name in ("npu_fusion_attention", "npu_rms_norm", "npu_rotary_mul", "npu_swiglu", "npu_apply_adam_w"):
        setattr(torch_npu, name, spy(name, getattr(torch_npu, name)))
    runs = []
    for argv in argvs:
        calls.clear()
        simulated.CREATED_GROUPS.clear()
        losses = training_rank(argv)
        runs.append((losses, dict(calls), [g["hccl_config"] for g in simulated.CREATED_GROUPS], is_active()))
    return runs


@pytest.fixture(scope="module")
def npu_runs():
    """Every layout, trained on 2 simulated-NPU ranks in one launch (process start-up is most of the cost)."""
    argvs = [[*TRAINING_ARGV, *extra, "--device-backend", "npu"] for extra in LAYOUTS.values()]
    per_rank = run_distributed(
        _instrumented_training_rank, 2, argvs, backend="npu", rank_setup=simulated.install, timeout=300
    )
    return {layout: [runs[i] for runs in per_rank] for i, layout in enumerate(LAYOUTS)}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_simulated_npu_training_matches_cpu(npu_runs, layout):
    results = npu_runs[layout]
    losses = results[-1][0]
    compare_losses(losses, reference_training_losses("cpu"), 1e-5, f"simulated NPU, {layout}")
    assert all(r[3] for r in results), "--device-backend npu did not activate the NPU adaptor"
    # The fused path really ran: attention in SBH (the adaptor's patch), the CANN ops, NPU AdamW.
    for rank, (_, calls, _, _) in enumerate(results):
        for kernel in ("npu_fusion_attention:SBH", "npu_rms_norm", "npu_rotary_mul", "npu_swiglu"):
            assert calls.get(kernel, 0) > 0, f"rank {rank}: {kernel} never ran ({calls})"
        assert calls.get("npu_apply_adam_w", 0) > 0, f"rank {rank}: NPU AdamW never ran"
        assert "npu_fusion_attention:BNSD" not in calls, "the core attention path ran instead of SBH"
    # NPUBackend.configure sized the activation groups' HCCL buffers from the model: [32 x 2 x 64] fp32 < 1 MB.
    sized = [c for rank in results for c in rank[2] if c]
    assert sized and all(c == {"hccl_buffer_size": 1} for c in sized), results[0][2]
