"""The process groups an MoE layer uses, read from the job's
:class:`~mcore.distributed.groups.ProcessGroups` (each None in one process, or where the job has
no such group; a None group has size 1).

* ``ep``: expert parallelism (the all-to-all dispatcher's group);
* ``tp_ep``: ETP x EP (the all-gather dispatcher's group);
* ``etp``: expert tensor parallelism (experts' FFN split);
* ``tp_cp``: TP x CP (token counts of ``aux_loss``/``seq_aux_loss``, z-loss averaging);
* ``tp_dp_cp``: TP x DP x CP (``global_aux_loss`` counts, the expert-bias token counts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


@dataclass(frozen=True)
class MoEGroups:
    ep: Any = None
    tp_ep: Any = None
    etp: Any = None
    tp_cp: Any = None
    tp_dp_cp: Any = None

    @classmethod
    def from_process_groups(cls, groups) -> MoEGroups:
        """The MoE groups of ``groups`` (a ProcessGroups, or None for one process)."""
        if groups is None:
            return cls()
        get = lambda name: getattr(groups, name, None)  # noqa: E731
        return cls(
            ep=get("ep"), tp_ep=get("tp_ep"), etp=get("etp"), tp_cp=get("tp_cp"), tp_dp_cp=get("tp_dp_cp")
        )

    @property
    def ep_size(self) -> int:
        return group_size(self.ep)

    @property
    def ep_rank(self) -> int:
        return group_rank(self.ep)

    @property
    def etp_size(self) -> int:
        return group_size(self.etp)

    @property
    def etp_rank(self) -> int:
        return group_rank(self.etp)
