"""A hand-built mixture-of-experts toy for the expert-parallel DDP / optimizer tests.

``ToyMoE``: a dense input projection, a dense router (softmax over all ``E`` experts, every expert
used: no routing decisions that round-off could flip), and ``E`` SwiGLU-free two-matrix experts held
as expert-parallel parameters ``fc1 [E/ep, F/etp, H]`` and ``fc2 [E/ep, H, F/etp]`` (marked
``expert_parallel``), combined as Megatron's all-gather dispatcher does: tokens and probabilities
are all-gathered over ``groups.tp_ep`` (etp x ep), each rank applies its experts' slices, and the
partial outputs are reduce-scattered back (summing over experts and over the etp split). Every
layout draws the same logical tensors on the host and keeps its slice, so at any ep/etp the model
computes the single-process function.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parents[1] / "ddp"))
from ddp_toy import IN, OUT  # noqa: E402

from mcore.distributed.ddp import DDPConfig, DistributedDataParallel  # noqa: E402
from mcore.models.transformer.build_context import default_device  # noqa: E402
from mcore.optimizer import OptimizerConfig, PrecisionConfig, build_optimizer  # noqa: E402
from mcore.tensor_parallel.mappings import (  # noqa: E402
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)

E, H, F = 4, 8, 6


class ToyMoE(nn.Module):
    def __init__(self, groups, dtype: torch.dtype, seed: int = 0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)

        def draw(*shape):
            return torch.randn(shape, generator=gen) * 0.5

        w_in, router, w_out = draw(H, IN), draw(E, H), draw(OUT, H)
        fc1, fc2 = draw(E, F, H), draw(E, H, F)
        ep, etp = groups.ep_size, groups.etp_size
        e_loc, f_loc = E // ep, F // etp
        experts = slice(groups.ep_rank * e_loc, (groups.ep_rank + 1) * e_loc)
        cols = slice(groups.etp_rank * f_loc, (groups.etp_rank + 1) * f_loc)
        self.w_in = nn.Parameter(w_in)
        self.router = nn.Parameter(router)
        self.fc1 = nn.Parameter(fc1[experts, cols].contiguous())
        self.fc2 = nn.Parameter(fc2[experts, :, cols].contiguous())
        self.w_out = nn.Parameter(w_out)
        self.fc1.expert_parallel = self.fc2.expert_parallel = True
        self.fc1.tensor_model_parallel = self.fc2.tensor_model_parallel = True  # split over etp
        self.first_expert = groups.ep_rank * e_loc
        self.tp_ep = groups.tp_ep
        self.to(device=default_device(), dtype=dtype)

    def forward(self, x):
        h = torch.tanh(x @ self.w_in.t())
        probs = torch.softmax((h.float() @ self.router.float().t()), dim=-1).to(h.dtype)
        h_all = gather_from_sequence_parallel_region(h, self.tp_ep)
        p_all = gather_from_sequence_parallel_region(probs, self.tp_ep)
        y = torch.zeros_like(h_all)
        for i in range(self.fc1.shape[0]):
            act = torch.nn.functional.gelu(h_all @ self.fc1[i].t())
            y = y + p_all[:, self.first_expert + i : self.first_expert + i + 1] * (act @ self.fc2[i].t())
        y = reduce_scatter_to_sequence_parallel_region(y, self.tp_ep)
        return (h + y) @ self.w_out.t()


def build(groups, *, distopt=False, overlap=False, bucket=None, bf16=False, fp16=False, optimizer="adam"):
    opt_cfg = OptimizerConfig(
        optimizer=optimizer, weight_decay=0.1, clip_grad=0.5, use_distributed_optimizer=distopt
    )
    prec = PrecisionConfig(bf16=bf16, fp16=fp16)
    ddp_cfg = DDPConfig(overlap_grad_reduce=overlap, ddp_bucket_size=bucket).with_training(opt_cfg, prec)
    model = DistributedDataParallel(ToyMoE(groups, prec.params_dtype), ddp_cfg, groups)
    return model, build_optimizer(opt_cfg, prec, [model], groups, lr=0.01)


def logical_weights(model, groups) -> dict[str, torch.Tensor]:
    """The logical (EP=1, ETP=1) weights, all-gathered over the expert grid (every rank gets them)."""
    import torch.distributed as dist

    module = model.module
    out = {k: v.detach().float().cpu().clone() for k, v in module.state_dict().items()}
    if groups.tp_ep is None:
        return out
    for name, dim in (("fc1", 1), ("fc2", 2)):
        local = getattr(module, name).detach().float().contiguous()
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(groups.tp_ep))]
        dist.all_gather(parts, local, group=groups.tp_ep)  # tp_ep rank = etp + etp_size * ep
        etp = groups.etp_size
        blocks = [torch.cat(parts[e * etp : (e + 1) * etp], dim=dim) for e in range(groups.ep_size)]
        out[name] = torch.cat(blocks, dim=0).cpu()
    return out
