"""When the training loop saves: ``--save-interval``, the save on an early exit and at the end, and the
commit of ``--async-save`` checkpoints.

:class:`Checkpointer` holds the decisions; :mod:`mcore.checkpoint` does the writing. Every call is a
collective (a save, or the agreement on a finished background write): every rank makes the same calls
after the same iterations.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def load_train_state(cfg, model, optimizer, scheduler, groups, state_cls, tokenizer_vocab_size=None):
    """The progress saved in ``--load`` (and the model, optimizer and scheduler restored in place); a
    fresh ``state_cls()`` without ``--load``."""
    if not cfg.checkpoint.load:
        return state_cls()
    from mcore.checkpoint import load_checkpoint

    return load_checkpoint(
        cfg.checkpoint, model, optimizer, scheduler, groups, state_cls=state_cls, seed=cfg.training.seed,
        run_config=cfg, tokenizer_vocab_size=tokenizer_vocab_size,
    )  # fmt: skip


class Checkpointer:
    """Saves ``state`` with the model, optimizer and scheduler into ``--save`` when the run asks for it.

    Args:
        cfg: the run configuration (:class:`~mcore.training.run_config.RunConfig`).
        model, optimizer, scheduler, groups: what a checkpoint holds, and the process groups.
        metadata: extra entries for the checkpoint (the tokenizer's and the padded vocabulary sizes).
        before_save: called before every save (the trainer reads its pending step results there, so
            the saved state counts every step and no NaN step is saved).
    """

    def __init__(
        self,
        cfg,
        model,
        optimizer,
        scheduler,
        groups,
        metadata: dict[str, Any] | None = None,
        before_save: Callable[[], None] = lambda: None,
    ):
        self.cfg = cfg
        self.model, self.optimizer, self.scheduler, self.groups = model, optimizer, scheduler, groups
        self.metadata = metadata
        self.before_save = before_save
        self.save_dir = cfg.checkpoint.save
        self.last_saved: int | None = None
        """The iteration of the last checkpoint this run saved (None before the first)."""

    def maybe_save(self, state, *, final: bool = False) -> bool:
        """Save if this point of the run asks for it; returns whether it saved.

        After an iteration (``final=False``): at every ``--save-interval`` iteration, then commit a
        finished ``--async-save`` write. When the loop ends (``final=True``: an exit condition, or
        the last iteration): unless this iteration was just saved or no step was ever taken.
        """
        ckpt = self.cfg.checkpoint
        if not self.save_dir:
            return False
        if final:
            due = state.iteration > 0 and self.last_saved != state.iteration
        else:
            due = bool(ckpt.save_interval) and state.iteration % ckpt.save_interval == 0
        if due:
            self.before_save()
            self.save(state)
        if not final:
            self.finalize(blocking=False)
        return due

    def save(self, state) -> float:
        """Save now (collective); returns the seconds the call took."""
        from mcore.checkpoint import save_checkpoint

        start = time.perf_counter()
        save_checkpoint(
            self.cfg.checkpoint, state, self.model, self.optimizer, self.scheduler, self.groups,
            run_config=self.cfg, metadata=self.metadata,
        )  # fmt: skip
        self.last_saved = state.iteration
        return time.perf_counter() - start

    def finalize(self, blocking: bool) -> None:
        """Commit an ``--async-save`` checkpoint whose background write finished (collective);
        ``blocking`` waits for a write still running (at the end of training)."""
        if self.save_dir and self.cfg.checkpoint.async_save:
            from mcore.checkpoint import maybe_finalize_async_save

            maybe_finalize_async_save(blocking=blocking)

    def saved_dir(self, iteration: int) -> str | None:
        """``--save`` when it holds the checkpoint of ``iteration``, else None (for the exit line)."""
        return self.save_dir if self.save_dir and self.last_saved == iteration else None
