"""The training steps' results, kept on the device and read on the host only when needed."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import torch

from mcore.training.context import TrainState
from mcore.utils.async_host import host_floats


@dataclasses.dataclass
class PendingStep:
    logs: dict[str, torch.Tensor]
    ok: bool
    grad_norm: float | torch.Tensor | None
    global_batch_size: int


class StepStats:
    """The training steps' results, read on the host only when needed.

    :meth:`add` keeps a step's logs (device tensors) and gradient norm (a float, None, or a lazy 0-d
    device tensor) without reading them; :meth:`flush` reads every kept step at once (one
    data-parallel collective, one wait for the device) when a log line, a checkpoint or the end of
    training needs them, and first raises a deferred error (``checks``, in order): NaN
    (:meth:`Trainer.check_nan <mcore.training.trainer.Trainer.check_nan>`), a token id outside the
    vocabulary (:class:`~mcore.training.token_id_check.TokenIdCheck`), all-zero gradients under a
    static loss scale on the flat optimizer path (``MegatronOptimizer.check_deferred_underflow``).
    Per step, in order, it then does what the loop did after each step before: count NaN/inf losses
    (``nan_iterations``), append the ``lm loss`` to ``train_losses``, add the losses to the sums of the
    current log interval; ``grad_norm`` becomes the last step's norm. A lazy norm that is not finite
    means the optimizer skipped that update on the device: the step counts as skipped, its norm as
    None (as the optimizer reports a skipped step's), and the LR schedule takes back the step it was
    advanced by (the host could not know at the time without waiting).

    It receives what it reads (no :class:`~mcore.training.trainer.Trainer`):

    Args:
        state: the run's counters (``skipped_iterations``, ``nan_iterations``), updated per step read.
        scheduler: the LR schedule (a step skipped on the device takes back its advance).
        train_losses: the list each step's ``lm loss`` is appended to.
        reduce_logs: reads several steps' logs as floats averaged over the data-parallel ranks
            (:meth:`Trainer.reduce_logs <mcore.training.trainer.Trainer.reduce_logs>`).
        checks: the deferred checks raised before reading, in order (see above).
    """

    def __init__(
        self,
        state: TrainState,
        scheduler,
        train_losses: list,
        *,
        reduce_logs: Callable[[Sequence[dict[str, torch.Tensor]]], list[dict[str, float]]],
        checks: Sequence[Callable[[], None]] = (),
    ):
        self.state, self.scheduler = state, scheduler
        self.reduce_logs = reduce_logs
        self.checks = list(checks)
        self.train_losses = train_losses
        self.pending: list[PendingStep] = []
        self.interval_losses: dict[str, float] = {}
        self.interval_steps = 0
        """Steps added since the last :meth:`end_interval` (the current log interval's length)."""
        self.grad_norm: float | None = None

    def add(self, logs, ok: bool, grad_norm, global_batch_size: int) -> None:
        self.pending.append(PendingStep(logs, ok, grad_norm, global_batch_size))
        self.interval_steps += 1

    def end_interval(self) -> tuple[dict[str, float], int]:
        """The ending log interval's mean losses and its number of steps (call after :meth:`flush`);
        the next interval starts empty."""
        steps = self.interval_steps
        means = {k: v / steps for k, v in self.interval_losses.items()}
        self.interval_losses, self.interval_steps = {}, 0
        return means, steps

    def flush(self) -> None:
        for check in self.checks:
            check()
        if not self.pending:
            return
        pending, self.pending = self.pending, []
        rows = self.reduce_logs([p.logs for p in pending])
        norms = host_floats([p.grad_norm for p in pending])
        for step, losses, norm in zip(pending, rows, norms):
            if isinstance(step.grad_norm, torch.Tensor) and norm is not None and not math.isfinite(norm):
                norm = None
                if step.ok:
                    self.state.skipped_iterations += 1
                    self.scheduler.step(-step.global_batch_size)
            if any(math.isnan(v) or math.isinf(v) for v in losses.values()):
                self.state.nan_iterations += 1
            if "lm loss" in losses:
                self.train_losses.append(losses["lm loss"])
            for k, v in losses.items():
                self.interval_losses[k] = self.interval_losses.get(k, 0.0) + v
            self.grad_norm = norm
