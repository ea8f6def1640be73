"""``--exit-signal-handler``: turn SIGTERM (a scheduler's preemption notice) into a clean save-and-exit.

The handler only records the signal (:attr:`SignalHandler.signaled`). The training loop agrees on it
over the world without waiting for the device (:class:`ExitFlags`: an all-reduce on the device after
each iteration, read one iteration later), so every rank stops after the same iteration, saves, and
exits 0. :meth:`SignalHandler.received` is the same agreement at once (it waits for the device).
:func:`exit_reason` is the loop's one question after each iteration: stop now, and why.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from mcore.utils.async_host import HostValue, stage_to_host


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


class ExitFlags:
    """``--exit-signal-handler`` and ``--exit-duration-in-mins`` without waiting for the device.

    Every rank must stop after the same iteration, so the ranks agree on the flags with an all-reduce
    (MAX). After each iteration :meth:`poll` launches that all-reduce on the device and stages its
    result to the host (:func:`stage_to_host`); the next :meth:`poll`, one iteration later, reads it
    (the device is past it by then, so the read hardly waits). Every rank reads the same iteration's
    agreed flags, so all stop together: one iteration after the signal or the deadline was seen.
    """

    def __init__(self, t, handler, device: torch.device, start_time: float):
        self.t, self.handler, self.device, self.start_time = t, handler, device, start_time
        self.active = bool(t.exit_signal_handler) or t.exit_duration_in_mins is not None
        self._staged: HostValue | None = None

    def poll(self) -> str | None:
        """The reason to stop that the ranks agreed on after the previous iteration (or None); then
        start the agreement on this iteration's flags. A collective when active: every rank calls it
        after every iteration."""
        if not self.active:
            return None
        reason = None
        if self._staged is not None:
            signal_seen, deadline_passed = self._staged.tolist()
            if signal_seen > 0:
                reason = "signal"
            elif deadline_passed > 0:
                reason = "exit-duration"
        flags = torch.zeros(2, device=self.device)  # filled on the device: no host-to-device copy
        if self.t.exit_signal_handler and self.handler.signaled:
            flags[0].fill_(1.0)
        minutes = (time.time() - self.start_time) / 60.0
        if self.t.exit_duration_in_mins is not None and minutes > self.t.exit_duration_in_mins:
            flags[1].fill_(1.0)
        if dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        self._staged = stage_to_host(flags)
        return reason


def exit_reason(t, iteration: int, exit_flags: ExitFlags) -> str | None:
    """Why the loop stops after ``iteration`` (``signal``, ``exit-interval``, ``exit-duration``) or
    None; a collective (:meth:`ExitFlags.poll`): every rank calls it after every iteration."""
    agreed = exit_flags.poll()
    if agreed == "signal":
        return agreed
    if t.exit_interval and iteration % t.exit_interval == 0:
        return "exit-interval"
    return agreed
