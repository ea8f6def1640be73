"""Learning-rate schedule: warmup, then constant / linear / cosine / inverse-square-root / WSD decay.

Megatron counts schedule steps in *samples* (each iteration advances by the global batch size), so a
batch-size rampup does not distort the schedule. With ``--train-iters``, ``--lr-decay-iters`` and
``--lr-warmup-iters`` are converted to samples with the global batch size; with ``--train-samples``
the ``*-samples`` flags are used directly. For step ``t`` (samples), warmup ``W``, decay end ``D``::

    t <= W:      lr = init + (max - init) * t / W
    t >  D:      lr = min
    otherwise:   r = (t - W) / (D - W)
                 linear: c = 1 - r;   cosine: c = (1 + cos(pi r)) / 2
                 lr = min + c * (max - min)
    inverse-square-root: lr = max(min, max * sqrt(max(W, 1)) / sqrt(max(t, 1)))
    WSD: c = 1 until the last ``--lr-wsd-decay-iters`` of the decay, then that tail anneals with
         ``--lr-wsd-decay-style`` (linear | cosine | exponential | minus_sqrt).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mcore.config.fields import ConfigError, check, flag

DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """Learning-rate schedule."""

    lr: float | None = flag(None, "Peak learning rate (after warmup).")
    min_lr: float = flag(0.0, "Learning rate at the end of decay.")
    lr_decay_style: str = flag("linear", "Decay style.", choices=DECAY_STYLES)
    lr_decay_iters: int | None = flag(None, "Iterations to decay over (default: --train-iters).")
    lr_decay_samples: int | None = flag(None, "Samples to decay over (default: --train-samples).")
    lr_warmup_iters: int = flag(0, "Iterations of linear warmup.")
    lr_warmup_samples: int = flag(0, "Samples of linear warmup.")
    lr_warmup_fraction: float | None = flag(None, "Warmup as a fraction of the decay span.")
    lr_warmup_init: float = flag(0.0, "Learning rate at the start of warmup.")
    lr_wsd_decay_style: str = flag("exponential", "Annealing style of WSD's final phase.", choices=WSD_STYLES)
    lr_wsd_decay_iters: int | None = flag(None, "Iterations of WSD's final annealing phase.")
    lr_wsd_decay_samples: int | None = flag(None, "Samples of WSD's final annealing phase.")
    override_opt_param_scheduler: bool = flag(
        False,
        "On resume, take the schedule (lr, min lr, warmup, decay span, decay style) from these flags "
        "even where they differ from the checkpoint's.",
        name="--override-opt_param-scheduler",
    )
    use_checkpoint_opt_param_scheduler: bool = flag(
        False,
        "On resume, take the schedule from the checkpoint and ignore these flags' values.",
        name="--use-checkpoint-opt_param-scheduler",
    )

    def __post_init__(self) -> None:
        if self.lr is not None:
            check(self.lr >= 0.0, f"lr={self.lr} must be >= 0")
            check(self.min_lr <= self.lr, f"min_lr={self.min_lr} is above lr={self.lr}")
        if self.lr_warmup_fraction is not None:
            check(
                0.0 <= self.lr_warmup_fraction <= 1.0,
                f"lr_warmup_fraction={self.lr_warmup_fraction} not in [0, 1]",
            )
            check(
                self.lr_warmup_iters == 0 and self.lr_warmup_samples == 0,
                "give --lr-warmup-fraction or --lr-warmup-iters/--lr-warmup-samples, not both",
            )


class LRScheduler:
    """Sets ``param_group["lr"]`` on an optimizer from the number of samples consumed.

    Args:
        optimizer: anything with ``param_groups`` (list of dicts); a group's ``"lr_mult"`` scales it.
        max_lr, min_lr, init_lr: the schedule's levels.
        warmup_steps, decay_steps: in samples (see the module docstring).
        decay_style: one of :data:`DECAY_STYLES`.
        wsd_decay_steps, wsd_decay_style: WSD's annealing tail.
    """

    def __init__(
        self,
        optimizer,
        *,
        max_lr: float,
        min_lr: float,
        warmup_steps: int,
        decay_steps: int,
        decay_style: str,
        init_lr: float = 0.0,
        wsd_decay_steps: int | None = None,
        wsd_decay_style: str = "exponential",
    ):
        if decay_style not in DECAY_STYLES:
            raise ConfigError(f"lr_decay_style={decay_style!r}; choose one of {', '.join(DECAY_STYLES)}")
        if decay_steps <= 0:
            raise ConfigError(f"the learning-rate decay span is {decay_steps} samples; it must be positive")
        if warmup_steps >= decay_steps and decay_style not in ("constant", "inverse-square-root"):
            raise ConfigError(
                f"warmup ({warmup_steps} samples) must be shorter than the decay span ({decay_steps} samples)"
            )
        if decay_style == "WSD" and wsd_decay_steps is None:
            raise ConfigError("lr_decay_style=WSD needs --lr-wsd-decay-iters or --lr-wsd-decay-samples")
        self.optimizer = optimizer
        self.max_lr, self.min_lr, self.init_lr = max_lr, min_lr, init_lr
        self.warmup_steps, self.decay_steps = warmup_steps, decay_steps
        self.decay_style = decay_style
        self.wsd_decay_steps, self.wsd_decay_style = wsd_decay_steps, wsd_decay_style
        self.num_steps = 0
        self.on_resume = "check"
        """What :meth:`load_state_dict` does with a saved schedule that differs from this one: ``check``
        (refuse, Megatron's default), ``override`` (keep this one) or ``checkpoint`` (take the saved one)."""
        self.step(0)

    @classmethod
    def from_config(
        cls,
        optimizer,
        cfg: SchedulerConfig,
        *,
        global_batch_size: int,
        train_iters: int | None,
        train_samples: int | None,
    ) -> LRScheduler:
        """Convert iteration-based flags to samples, as Megatron does."""
        if cfg.lr is None:
            raise ConfigError("--lr is required")
        if train_iters is not None:
            decay = (cfg.lr_decay_iters or train_iters) * global_batch_size
            warmup = cfg.lr_warmup_iters * global_batch_size
            wsd = None if cfg.lr_wsd_decay_iters is None else cfg.lr_wsd_decay_iters * global_batch_size
        else:
            decay = cfg.lr_decay_samples or train_samples or 0
            warmup = cfg.lr_warmup_samples
            wsd = cfg.lr_wsd_decay_samples
        if cfg.lr_warmup_fraction is not None:
            warmup = int(cfg.lr_warmup_fraction * decay)
        scheduler = cls(
            optimizer,
            max_lr=cfg.lr,
            min_lr=cfg.min_lr,
            warmup_steps=warmup,
            decay_steps=decay,
            decay_style=cfg.lr_decay_style,
            init_lr=cfg.lr_warmup_init,
            wsd_decay_steps=wsd,
            wsd_decay_style=cfg.lr_wsd_decay_style,
        )
        scheduler.on_resume = (
            "override"
            if cfg.override_opt_param_scheduler
            else "checkpoint"
            if cfg.use_checkpoint_opt_param_scheduler
            else "check"
        )
        return scheduler

    def get_lr(self, num_steps: int | None = None) -> float:
        t = self.num_steps if num_steps is None else num_steps
        if self.warmup_steps > 0 and t <= self.warmup_steps:
            return self.init_lr + (self.max_lr - self.init_lr) * t / self.warmup_steps
        if self.decay_style == "constant":
            return self.max_lr
        if self.decay_style == "inverse-square-root":
            return max(self.min_lr, self.max_lr * math.sqrt(max(self.warmup_steps, 1)) / math.sqrt(max(t, 1)))
        if t > self.decay_steps:
            return self.min_lr
        span = self.max_lr - self.min_lr
        if self.decay_style == "WSD":
            anneal_start = self.decay_steps - self.wsd_decay_steps
            if t <= anneal_start:
                return self.max_lr
            r = (t - anneal_start) / self.wsd_decay_steps
            coeff = {
                "linear": 1.0 - r,
                "cosine": 0.5 * (math.cos(math.pi * r) + 1.0),
                "exponential": (2.0 * math.pow(0.5, r)) - 1.0,
                "minus_sqrt": 1.0 - math.sqrt(r),
            }[self.wsd_decay_style]
            return self.min_lr + coeff * span
        r = (t - self.warmup_steps) / (self.decay_steps - self.warmup_steps)
        coeff = 1.0 - r if self.decay_style == "linear" else 0.5 * (math.cos(math.pi * r) + 1.0)
        return self.min_lr + coeff * span

    def step(self, increment: int) -> float:
        """Advance by ``increment`` samples and set every param group's lr."""
        self.num_steps += increment
        lr = self.get_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)
        return lr

    def state_dict(self) -> dict:
        return {
            "num_steps": self.num_steps,
            "max_lr": self.max_lr,
            "min_lr": self.min_lr,
            "warmup_steps": self.warmup_steps,
            "decay_steps": self.decay_steps,
            "decay_style": self.decay_style,
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume the position, and the schedule's shape as Megatron's ``OptimizerParamScheduler`` does.

        A saved value (peak and minimum lr, warmup, decay span, decay style) that differs from this
        schedule's is refused unless ``on_resume`` says which one wins (see :func:`check_resumed_schedule`).
        """
        chosen = check_resumed_schedule(self.state_dict(), state, self.on_resume)
        self.max_lr, self.min_lr = chosen["max_lr"], chosen["min_lr"]
        self.warmup_steps, self.decay_steps = chosen["warmup_steps"], chosen["decay_steps"]
        self.decay_style = chosen["decay_style"]
        self.num_steps = int(state["num_steps"])
        self.step(0)


_SCHEDULE_FLAGS = {
    "max_lr": "--lr",
    "min_lr": "--min-lr",
    "warmup_steps": "--lr-warmup-iters/--lr-warmup-samples/--lr-warmup-fraction",
    "decay_steps": "--lr-decay-iters/--lr-decay-samples (default: --train-iters/--train-samples)",
    "decay_style": "--lr-decay-style",
}


def check_resumed_schedule(current: dict, saved: dict, on_resume: str = "check") -> dict:
    """The schedule a resumed run follows: ``current`` (from the flags) or ``saved`` (the checkpoint's).

    ``on_resume``: ``override`` (``--override-opt_param-scheduler``) keeps the flags' values,
    ``checkpoint`` (``--use-checkpoint-opt_param-scheduler``) takes the saved ones; ``check`` takes
    them when equal and otherwise refuses, as Megatron does, because a silently different schedule
    (most often: a raised ``--train-iters`` that stretches the decay span) changes the learning rate
    of every remaining step.

    Raises:
        ConfigError: naming every differing value, the flags that set it, and the two ways out.
    """
    if on_resume == "override":
        return dict(current)
    chosen = dict(current)
    differ = []
    for key, flags in _SCHEDULE_FLAGS.items():
        if key not in saved:
            continue
        if on_resume == "checkpoint":
            chosen[key] = saved[key]
        elif saved[key] != current[key]:
            unit = " samples" if key.endswith("_steps") else ""
            differ.append(f"{key} {saved[key]}{unit} in the checkpoint, {current[key]}{unit} now ({flags})")
    if differ:
        raise ConfigError(
            "the learning-rate schedule differs from the checkpoint's: "
            + "; ".join(differ)
            + ". Pass --override-opt_param-scheduler to follow the new flags, or "
            "--use-checkpoint-opt_param-scheduler to keep the checkpoint's schedule"
        )
    return chosen
