"""``--exit-signal-handler``: turn SIGTERM (a scheduler's preemption notice) into a clean save-and-exit.

The handler only records the signal (:attr:`SignalHandler.signaled`). The training loop agrees on it
over the world without waiting for the device (``_ExitFlags`` in :mod:`mcore.training.pretrain`: an
all-reduce on the device after each iteration, read one iteration later), so every rank stops after the
same iteration, saves, and exits 0. :meth:`SignalHandler.received` is the same agreement at once (it
waits for the device).
"""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist


class SignalHandler:
    def __init__(self, sig: int = signal.SIGTERM):
        self.sig = sig
        self._received = False
        self._previous = None

    def __enter__(self) -> SignalHandler:
        self._previous = signal.getsignal(self.sig)
        signal.signal(self.sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        signal.signal(self.sig, self._previous)

    def _handle(self, signum, frame) -> None:
        self._received = True

    @property
    def signaled(self) -> bool:
        """Whether this process got the signal (no communication)."""
        return self._received

    def received(self, device: torch.device) -> bool:
        """Whether any rank got the signal (a collective: every rank must call it each step)."""
        flag = torch.tensor([1.0 if self._received else 0.0], device=device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item() > 0)
