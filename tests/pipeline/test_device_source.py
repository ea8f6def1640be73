"""One device per rank, derived once: ``ProcessGroups.device`` from the backend and the LOCAL rank.

The model, the trainer and the pipeline schedule must compute on the device ``initialize_parallel``
made current. A fake backend reports four devices (``cpu:0`` .. ``cpu:3``: distinct device objects,
while the tensors stay CPU tensors) and records every local rank it is asked about. Nodes running
fewer processes than they have devices are simulated with the launcher's variables: two ranks on
two "nodes", each with ``LOCAL_RANK=0`` (a global rank would name ``cpu:1`` on the second node), and
``--local-rank`` overriding ``LOCAL_RANK``.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch
from mcore.backends.cpu import CPUBackend
from torch import nn

import mcore.pipeline.schedules as schedules
from mcore.config.parallel import ParallelConfig
from mcore.distributed.groups import ProcessGroups, initialize_parallel
from mcore.models.gpt.gpt_model import GPTModel
from mcore.models.transformer.model_config import ModelConfig
from mcore.testing.distributed import run_distributed
from mcore.training.pretrain import Trainer

DEVICES = 4


class FourDeviceBackend(CPUBackend):
    """A CPU backend that pretends to have four devices and records the local ranks it is asked about."""

    name = "four-cpus"

    def __init__(self):
        super().__init__()
        self.asked: list[int] = []
        self.current: torch.device | None = None

    def device(self, local_rank: int = 0) -> torch.device:
        self.asked.append(local_rank)
        return torch.device("cpu", local_rank % DEVICES)

    def set_device(self, local_rank: int) -> None:
        self.current = self.device(local_rank)


def _devices_in_use(groups: ProcessGroups, backend: FourDeviceBackend) -> dict[str, torch.device]:
    """The device each consumer uses: the backend's current one, the model's, the trainer's, the
    pipeline schedule's (its stage communicator's)."""
    cfg = ModelConfig(
        num_layers=1, hidden_size=8, num_attention_heads=2, seq_length=4, max_position_embeddings=4
    )
    model = GPTModel(cfg, groups, 16)
    run_cfg = SimpleNamespace(precision=SimpleNamespace(params_dtype=torch.float32))
    trainer = Trainer(run_cfg, groups, backend, [model], None, None, None, None)

    seen = {}
    real = schedules.StageCommunicator

    def spy(groups_, shape, dtype, device, *args, **kwargs):
        seen["schedule"] = device
        return real(groups_, shape, dtype, device, *args, **kwargs)

    schedules.StageCommunicator = spy
    try:
        linear = nn.Linear(2, 2)

        def forward_step(_, chunk):
            return chunk(torch.ones(1, 2)), lambda out: (out.sum(), {"loss": out.sum().detach()})

        # the pipelined schedule (one stage here) is the one that places tensors on a device
        schedules.forward_backward_pipelining_without_interleaving(
            forward_step_func=forward_step,
            data_iterator=None,
            model=[linear],
            num_microbatches=1,
            seq_length=1,
            micro_batch_size=1,
            hidden_size=2,
            groups=groups,
            forward_only=True,
        )
    finally:
        schedules.StageCommunicator = real
    return {
        "groups": groups.device,
        "current": backend.current,
        "model": model.ctx.device,
        "trainer": trainer.device,
        "schedule": seen["schedule"],
    }


def _two_nodes_rank(local_rank_flag):
    os.environ["LOCAL_RANK"] = "0"  # one process on each node: both are local rank 0
    backend = FourDeviceBackend()
    groups = initialize_parallel(ParallelConfig(local_rank=local_rank_flag), backend)
    used = _devices_in_use(groups, backend)
    return groups.rank, {k: str(v) for k, v in used.items()}, sorted(set(backend.asked))


def test_two_nodes_one_process_each_use_local_rank_zero_everywhere():
    for rank, used, asked in run_distributed(_two_nodes_rank, 2, None, timeout=120):
        assert set(used.values()) == {"cpu:0"}, (rank, used)
        assert asked == [0], f"rank {rank} asked the backend for local ranks {asked}"


def test_local_rank_flag_overrides_the_launcher_everywhere():
    for rank, used, asked in run_distributed(_two_nodes_rank, 2, 3, timeout=120):
        assert set(used.values()) == {"cpu:3"}, (rank, used)
        assert asked == [3], f"rank {rank} asked the backend for local ranks {asked}"


def test_single_process_with_local_rank_flag(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    backend = FourDeviceBackend()
    groups = initialize_parallel(ParallelConfig(local_rank=2), backend)
    assert groups.world_size == 1
    used = _devices_in_use(groups, backend)
    assert set(used.values()) == {torch.device("cpu", 2)}, used
    assert set(backend.asked) == {2}
