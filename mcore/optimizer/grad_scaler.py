"""Loss scaling for fp16 (and optionally bf16): static, or dynamic with hysteresis and a growth window.

The loss is multiplied by ``scale`` before backward so small fp16 gradients do not flush to zero;
the optimizer divides the gradients by it again. With dynamic scaling (Megatron's rules):

* a step whose gradients overflow (inf/NaN on any rank) is skipped; ``hysteresis`` such steps (counted
  since the last growth) halve the scale, never below ``min_scale``;
* ``window`` consecutive steps without overflow double the scale and re-arm the hysteresis.

The opposite failure, a scale so small that every scaled gradient underflows to zero, is an error
(:class:`LossScaleUnderflowError`): the optimizer would apply zero updates (with weight decay, only
shrink the weights) for as long as the run lasts, and nothing else would say so.
"""

from __future__ import annotations

from typing import Any

from mcore.config.fields import ConfigError


class LossScaleUnderflowError(ConfigError):
    """Every gradient is zero after backward with a loss scale: the scaled gradients underflowed."""


def underflow_error(scaler: ConstantGradScaler | DynamicGradScaler) -> LossScaleUnderflowError:
    """The error for an all-zero global gradient at ``scaler``'s scale, saying what to change."""
    if isinstance(scaler, ConstantGradScaler):
        fix = (
            f"raise --loss-scale {scaler.scale:g} (Megatron's static scales are powers of 2 such as 4096) "
            "or leave it out for the dynamic loss scale"
        )
    else:
        fix = f"raise --min-loss-scale {scaler.min_scale:g}"
    return LossScaleUnderflowError(
        f"every gradient is zero at loss scale {scaler.scale:g}: the scaled gradients underflowed to zero "
        f"and the update would not train the model; {fix}"
    )


class ConstantGradScaler:
    """A fixed loss scale (``--loss-scale``)."""

    def __init__(self, scale: float):
        self.scale = float(scale)

    @property
    def inv_scale(self) -> float:
        return 1.0 / self.scale

    def update(self, found_inf: bool) -> None:
        """A static scale never changes."""

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])


class DynamicGradScaler:
    """The fp16 dynamic loss scale.

    Args:
        initial_scale: the starting scale (``--initial-loss-scale``, 2**32).
        min_scale: the scale never drops below this (``--min-loss-scale``).
        window: overflow-free steps before the scale grows (``--loss-scale-window``).
        hysteresis: overflowing steps tolerated before the scale shrinks (``--hysteresis``).
        growth_factor: multiplier on growth (2).
        backoff_factor: multiplier on overflow (0.5).
    """

    def __init__(
        self,
        initial_scale: float,
        min_scale: float,
        window: int,
        hysteresis: int,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
    ):
        self.scale = float(initial_scale)
        self.min_scale = float(min_scale)
        self.window = int(window)
        self.hysteresis = int(hysteresis)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_tracker = 0
        self.hysteresis_tracker = self.hysteresis

    @property
    def inv_scale(self) -> float:
        return 1.0 / self.scale

    def update(self, found_inf: bool) -> None:
        """Advance the state machine after a step (``found_inf``: the step overflowed and was skipped)."""
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.window:
                self.growth_tracker = 0
                self.hysteresis_tracker = self.hysteresis
                self.scale *= self.growth_factor

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "growth_tracker": self.growth_tracker,
            "hysteresis_tracker": self.hysteresis_tracker,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.hysteresis_tracker = int(state["hysteresis_tracker"])


def build_grad_scaler(precision) -> ConstantGradScaler | DynamicGradScaler | None:
    """The scaler for a :class:`~mcore.optimizer.config.PrecisionConfig` (None for unscaled training)."""
    if precision.loss_scale is not None:
        return ConstantGradScaler(precision.loss_scale)
    if precision.fp16:
        return DynamicGradScaler(
            initial_scale=precision.initial_loss_scale,
            min_scale=precision.min_loss_scale,
            window=precision.loss_scale_window,
            hysteresis=precision.hysteresis,
        )
    return None
