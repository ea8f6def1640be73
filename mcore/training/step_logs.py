"""The logged values of the steps: averaged over the micro-batches on the device, and over the
data-parallel ranks when read (one collective and one wait for the device for several steps)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from mcore.distributed.groups import ProcessGroups


def average_logs(logs: list[dict], device) -> dict[str, torch.Tensor]:
    """Mean of each logged value over this rank's micro-batches (on the last stage), as 0-d device
    tensors: nothing is read on the host, and the data-parallel average is :func:`reduce_logs`'s."""
    if not logs:
        return {}
    keys = sorted(logs[0])
    values = torch.stack([torch.stack([log[k].detach().float().reshape(()) for k in keys]) for log in logs])
    mean = values.mean(0).to(device)
    return dict(zip(keys, mean.unbind()))


def reduce_logs(steps: Sequence[dict[str, torch.Tensor]], groups: ProcessGroups) -> list[dict[str, float]]:
    """The floats of the logs of several steps (from :meth:`~mcore.training.trainer.Trainer.train_step`),
    each averaged over the data-parallel ranks: one collective and one wait for the device for all of them.

    A collective over ``groups.dp`` on the last pipeline stage: every data-parallel rank there calls
    it with the same steps (elsewhere the logs are empty and nothing is communicated).
    """
    out: list[dict[str, float]] = [{} for _ in steps]
    by_keys: dict[tuple[str, ...], list[int]] = {}
    for i, logs in enumerate(steps):
        if logs:
            by_keys.setdefault(tuple(logs), []).append(i)
    for keys, indices in by_keys.items():
        values = torch.stack([torch.stack([steps[i][k] for k in keys]) for i in indices])
        if groups.dp is not None and groups.dp_size > 1:
            dist.all_reduce(values, group=groups.dp)
            values /= groups.dp_size
        for i, row in zip(indices, values.tolist()):
            out[i] = {k: float(v) for k, v in zip(keys, row)}
    return out
