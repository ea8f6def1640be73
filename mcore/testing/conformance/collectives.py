"""The collectives check: all-reduce, all-gather, reduce-scatter, broadcast and point-to-point on the
backend's ``dist_backend``, run in every rank of a 2-process job."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from mcore.backend import current_backend
from mcore.testing.conformance.compare import ConformanceError
from mcore.testing.distributed import run_distributed

# torch >= 2.12 renamed the single-tensor collectives (as mcore.tensor_parallel.mappings does).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def collectives_rank() -> dict[str, list]:
    """All-reduce, all-gather, reduce-scatter, broadcast and a point-to-point ring on the current backend."""
    backend = current_backend()
    rank, world = dist.get_rank(), dist.get_world_size()
    device = backend.device(rank)
    out: dict[str, list] = {"dist_backend": [dist.get_backend()]}
    t = torch.full((4,), float(rank + 1), device=device)
    dist.all_reduce(t)
    out["all_reduce"] = t.cpu().tolist()
    m = torch.tensor([float(rank)], device=device)
    dist.all_reduce(m, op=dist.ReduceOp.MAX)
    out["all_reduce_max"] = m.cpu().tolist()
    gathered = torch.empty(2 * world, device=device)
    _all_gather_single(gathered, torch.full((2,), float(rank), device=device))
    out["all_gather"] = gathered.cpu().tolist()
    scattered = torch.empty(2, device=device)
    _reduce_scatter_single(scattered, torch.arange(2.0 * world, device=device) + rank)
    out["reduce_scatter"] = scattered.cpu().tolist()
    b = torch.full((3,), float(rank + 10), device=device)
    dist.broadcast(b, src=0)
    out["broadcast"] = b.cpu().tolist()
    send = torch.full((2,), float(rank), device=device)
    recv = torch.empty(2, device=device)
    ops = [
        dist.P2POp(dist.isend, send, (rank + 1) % world),
        dist.P2POp(dist.irecv, recv, (rank - 1) % world),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    out["p2p"] = recv.cpu().tolist()
    backend.synchronize()
    return out


def expected_collectives(world: int, dist_backend: str) -> list[dict[str, list]]:
    total = float(sum(range(1, world + 1)))
    results = []
    for rank in range(world):
        results.append(
            {
                "dist_backend": [dist_backend],
                "all_reduce": [total] * 4,
                "all_reduce_max": [float(world - 1)],
                "all_gather": [float(r) for r in range(world) for _ in range(2)],
                "reduce_scatter": [float(sum(2 * rank + i + r for r in range(world))) for i in range(2)],
                "broadcast": [10.0] * 3,
                "p2p": [float((rank - 1) % world)] * 2,
            }
        )
    return results


def check_collectives(backend_name: str, rank_setup: Callable | None = None, world: int = 2) -> None:
    """Run :func:`collectives_rank` on ``world`` processes of ``backend_name`` and check every result."""
    results = run_distributed(collectives_rank, world, backend=backend_name, rank_setup=rank_setup)
    dist_backend = results[0]["dist_backend"][0]
    for rank, (got, want) in enumerate(zip(results, expected_collectives(world, dist_backend))):
        for key, value in want.items():
            if got[key] != value:
                raise ConformanceError(f"rank {rank}: {key} gave {got[key]}, expected {value}")
