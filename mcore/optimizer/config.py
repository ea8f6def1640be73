"""Optimizer and mixed-precision settings, with Megatron-LM's flags.

The learning rate and its schedule (``--lr``, ``--min-lr``, ``--lr-decay-style``, weight-decay
increments) belong to the scheduler's config: the scheduler writes ``param_group["lr"]`` and
``param_group["weight_decay"]`` into :attr:`mcore.optimizer.MegatronOptimizer.param_groups` before
every step, as it would for a ``torch.optim`` optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mcore.config.fields import ConfigError, check, flag

_MOMENT_DTYPES = ("fp32", "fp16", "bf16", "fp8")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """Optimizer: Adam (AdamW, as in Megatron) or SGD, clipping, and the distributed optimizer."""

    optimizer: str = flag(
        "adam", "Optimizer: adam (AdamW: decoupled weight decay) or sgd.", choices=("adam", "sgd")
    )
    weight_decay: float = flag(0.01, "Weight decay (not applied to biases and other 1-D parameters).")
    adam_beta1: float = flag(0.9, "Adam beta1: decay of the first-moment estimate.")
    adam_beta2: float = flag(0.999, "Adam beta2: decay of the second-moment estimate.")
    adam_eps: float = flag(1e-8, "Adam epsilon added to the denominator.")
    sgd_momentum: float = flag(0.9, "SGD momentum.")
    clip_grad: float = flag(1.0, "Clip gradients to this global L2 norm (0 turns clipping off).")
    use_distributed_optimizer: bool = flag(
        False, "Shard fp32 master weights and optimizer state over data-parallel ranks (ZeRO-1)."
    )
    overlap_param_gather: bool = flag(
        False, "Overlap the all-gather of updated parameters with the next forward (distributed optimizer)."
    )
    decoupled_weight_decay: bool = flag(
        True, "Adam applies weight decay decoupled from the gradient (AdamW), as Megatron does.", cli=False
    )
    use_precision_aware_optimizer: bool = flag(
        False,
        "Keep optimizer state in the precisions below: bf16 gradients, bf16 Adam moments, and fp32 "
        "masters stored exactly as the bf16 parameters plus 16-bit remainders (10 instead of 18 "
        "bytes/param with --bf16).",
    )
    main_grads_dtype: str = flag(
        "fp32",
        "dtype of the gradient buffers (accumulation and data-parallel reduction) with "
        "--use-precision-aware-optimizer.",
        choices=("fp32", "bf16"),
    )
    main_params_dtype: str = flag(
        "fp32",
        "dtype of the master weights with --use-precision-aware-optimizer (fp32: exact, held as bf16 "
        "parameter + 16-bit remainder; bf16, mcore's: no masters, the bf16 parameters are updated in "
        "place, each step computed in fp32 and rounded once, as torch's fused AdamW on bf16 "
        "parameters: 2 bytes/param less, and updates below half a bf16 ulp of a weight are lost).",
        choices=("fp32", "fp16", "bf16"),
    )
    exp_avg_dtype: str = flag(
        "fp32", "dtype of Adam's first moment with --use-precision-aware-optimizer.", choices=_MOMENT_DTYPES
    )
    exp_avg_sq_dtype: str = flag(
        "fp32", "dtype of Adam's second moment with --use-precision-aware-optimizer.", choices=_MOMENT_DTYPES
    )

    def __post_init__(self) -> None:
        for name in ("adam_beta1", "adam_beta2"):
            value = getattr(self, name)
            check(0.0 <= value < 1.0, f"{name}={value} must be in [0, 1)")
        check(self.adam_eps > 0.0, f"adam_eps={self.adam_eps} must be > 0")
        check(self.weight_decay >= 0.0, f"weight_decay={self.weight_decay} must be >= 0")
        check(0.0 <= self.sgd_momentum < 1.0, f"sgd_momentum={self.sgd_momentum} must be in [0, 1)")
        check(self.clip_grad >= 0.0, f"clip_grad={self.clip_grad} must be >= 0 (0 turns clipping off)")
        check(
            not self.overlap_param_gather or self.use_distributed_optimizer,
            "--overlap-param-gather needs --use-distributed-optimizer "
            f"(got use_distributed_optimizer={self.use_distributed_optimizer})",
        )
        self._check_precision_aware()

    def _check_precision_aware(self) -> None:
        dtypes = {
            "main_grads_dtype": self.main_grads_dtype,
            "main_params_dtype": self.main_params_dtype,
            "exp_avg_dtype": self.exp_avg_dtype,
            "exp_avg_sq_dtype": self.exp_avg_sq_dtype,
        }
        if not self.use_precision_aware_optimizer:
            for name, value in dtypes.items():
                check(
                    value == "fp32",
                    f"--{name.replace('_', '-')} {value} needs --use-precision-aware-optimizer",
                )
            return
        check(
            self.optimizer == "adam",
            f"--use-precision-aware-optimizer needs --optimizer adam (got {self.optimizer})",
        )
        check(
            self.main_params_dtype != "fp16",
            "--main-params-dtype fp16 is not supported: fp32 masters already cost only 2 bytes/param "
            "beyond the bf16 parameters (stored as 16-bit remainders) and lose nothing; "
            "--main-params-dtype bf16 keeps no master at all",
        )
        for name in ("exp_avg_dtype", "exp_avg_sq_dtype"):
            value = dtypes[name]
            check(
                value in _DTYPES,
                f"--{name.replace('_', '-')} {value} is not supported (choose fp32 or bf16)",
            )

    def moment_dtypes(self) -> tuple[torch.dtype, torch.dtype]:
        """dtypes of Adam's first and second moments."""
        return _DTYPES[self.exp_avg_dtype], _DTYPES[self.exp_avg_sq_dtype]

    def uses_flat_adam(self, precision: PrecisionConfig) -> bool:
        """Whether the optimizer takes the one-pass path over flat buffers (``adam_step_flat``).

        AdamW without a loss scaler: bf16 or fp32 parameters. fp16 keeps the per-parameter path,
        whose overflow check and loss-scale update need the host.
        """
        return self.optimizer == "adam" and self.decoupled_weight_decay and not precision.fp16

    def params_are_masters(self, precision: PrecisionConfig) -> bool:
        """``--main-params-dtype bf16``: the bf16 parameters are the masters (no fp32 copy, no
        remainder; the flat step rounds its fp32 result into them)."""
        return self.use_precision_aware_optimizer and precision.bf16 and self.main_params_dtype == "bf16"

    def stores_param_remainders(self, precision: PrecisionConfig) -> bool:
        """fp32 masters held as bf16 parameter + int16 remainder (precision-aware, bf16)."""
        return self.use_precision_aware_optimizer and precision.bf16 and self.main_params_dtype == "fp32"


@dataclass(frozen=True, kw_only=True)
class PrecisionConfig:
    """Mixed precision: bf16 or fp16 parameters with fp32 master weights, and fp16 loss scaling."""

    fp16: bool = flag(False, "Train with fp16 parameters, fp32 master weights and loss scaling.")
    bf16: bool = flag(False, "Train with bf16 parameters and fp32 master weights.")
    loss_scale: float | None = flag(
        None, "Static loss scale (a power of 2 helps); without it, fp16 uses dynamic loss scaling."
    )
    initial_loss_scale: float = flag(2.0**32, "Initial dynamic loss scale.")
    min_loss_scale: float = flag(1.0, "Minimum dynamic loss scale.")
    loss_scale_window: int = flag(1000, "Steps without overflow before the dynamic loss scale doubles.")
    hysteresis: int = flag(2, "Overflowing steps tolerated before the dynamic loss scale halves.")
    accumulate_allreduce_grads_in_fp32: bool = flag(
        False, "Accumulate and all-reduce gradients in fp32 (always on with --bf16, as in Megatron)."
    )

    def __post_init__(self) -> None:
        if self.fp16 and self.bf16:
            raise ConfigError("--fp16 and --bf16 are mutually exclusive (got fp16=True and bf16=True)")
        if self.loss_scale is not None:
            check(self.loss_scale > 0.0, f"loss_scale={self.loss_scale} must be > 0")
            # Gradients are unscaled by 1/scale in fp32: below the smallest normal fp32 (2^-126) the
            # inverse can overflow to inf and every step would be skipped or turn NaN, never named.
            check(
                self.loss_scale >= 2.0**-126,
                f"--loss-scale {self.loss_scale} is below 2^-126 (1.18e-38): its inverse does not fit in fp32",
            )
            check(
                self.fp16 or self.bf16,
                f"--loss-scale {self.loss_scale} needs --fp16 or --bf16 (fp32 training is not loss-scaled)",
            )
        check(self.initial_loss_scale > 0.0, f"initial_loss_scale={self.initial_loss_scale} must be > 0")
        check(self.min_loss_scale > 0.0, f"min_loss_scale={self.min_loss_scale} must be > 0")
        check(
            self.min_loss_scale <= self.initial_loss_scale,
            f"min_loss_scale={self.min_loss_scale} must be <= initial_loss_scale={self.initial_loss_scale}",
        )
        check(self.loss_scale_window >= 1, f"loss_scale_window={self.loss_scale_window} must be >= 1")
        check(self.hysteresis >= 1, f"hysteresis={self.hysteresis} must be >= 1")

    @property
    def params_dtype(self) -> torch.dtype:
        """The dtype of model parameters: bf16, fp16 or fp32."""
        if self.bf16:
            return torch.bfloat16
        if self.fp16:
            return torch.float16
        return torch.float32

    def check_with(self, optimizer: OptimizerConfig) -> None:
        """Cross-checks with the optimizer's precision-aware settings."""
        if optimizer.use_precision_aware_optimizer:
            check(
                self.bf16,
                "--use-precision-aware-optimizer needs --bf16 (its bf16 gradients and remainder-stored "
                f"masters assume bf16 parameters; got fp16={self.fp16}, bf16={self.bf16})",
            )
            check(
                not (optimizer.main_grads_dtype == "bf16" and self.accumulate_allreduce_grads_in_fp32),
                "--main-grads-dtype bf16 contradicts --accumulate-allreduce-grads-in-fp32",
            )

    @property
    def grads_in_fp32(self) -> bool:
        """Whether gradients accumulate and reduce in fp32 (bf16 forces it, as Megatron does)."""
        return self.accumulate_allreduce_grads_in_fp32 or self.bf16 or not self.fp16

    @property
    def dynamic_loss_scale(self) -> bool:
        """fp16 without ``--loss-scale`` scales the loss dynamically."""
        return self.fp16 and self.loss_scale is None
