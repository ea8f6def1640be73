"""``--exit-signal-handler``: turn SIGTERM (a scheduler's preemption notice) into a clean save-and-exit.

The handler only records the signal (:attr:`SignalHandler.signaled`). The training loop agrees on it
over the world without waiting for the device (``_ExitFlags`` in :mod:`mcore.training.pretrain`: an
all-reduce on the device after each iteration, read one iteration later), so every rank stops after the
same iteration, saves, and exits 0. :meth:`SignalHandler.received` is the same agreement at once (it
waits for the device).
"""

from __future__ import annotations

import signal
from pathlib import Path

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
    def signal_name(self) -> str:
        return signal.Signals(self.sig).name

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


def exit_message(reason: str, iteration: int, saved_dir: str | Path | None, t, handler=None) -> str:
    """The one line a run that stops before ``--train-iters`` prints: why, where, and what was saved.

    ``reason`` is the training loop's exit reason (``signal``, ``exit-interval``, ``exit-duration``);
    ``saved_dir`` the ``--save`` directory when it holds this iteration's checkpoint, else None; ``t``
    the training config (the limit that was reached); ``handler`` the :class:`SignalHandler`.
    """
    if reason == "signal":
        name = handler.signal_name if isinstance(handler, SignalHandler) else "a signal"
        why = f"{name} received (--exit-signal-handler)"
    elif reason == "exit-interval":
        why = f"--exit-interval {t.exit_interval} reached"
    elif reason == "exit-duration":
        why = f"--exit-duration-in-mins {t.exit_duration_in_mins:g} passed"
    else:
        why = reason
    if saved_dir is None:
        return f"exiting: {why} after iteration {iteration}; no checkpoint saved (no --save)"
    return f"exiting: {why}, checkpoint saved at iteration {iteration} in {saved_dir}"
