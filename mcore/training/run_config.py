"""All config groups of a pretraining run, parsed from Megatron's command line.

``RunConfig`` bundles one frozen config object per group (``cfg.model``, ``cfg.parallel``,
``cfg.training``, ...). Functions take the part they need; nothing is global. Cross-group rules
(heads divisible by tensor parallel size, batch sizes against the data-parallel size, ...) are
checked once by :func:`validate_run_config`, with messages naming every value.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from mcore.checkpoint.config import CheckpointConfig
from mcore.config.cli import parse_config
from mcore.config.parallel import ParallelConfig
from mcore.data.config import DataConfig, TokenizerConfig
from mcore.distributed.ddp import DDPConfig
from mcore.fp8.config import Fp8Config
from mcore.models.transformer.model_config import ModelConfig
from mcore.optimizer.config import OptimizerConfig, PrecisionConfig
from mcore.training.config import TrainingConfig
from mcore.training.lr_scheduler import SchedulerConfig
from mcore.utils.console import configure_console

logger = logging.getLogger(__name__)

CONFIG_GROUPS: dict[str, type] = {
    "parallel": ParallelConfig,
    "model": ModelConfig,
    "data": DataConfig,
    "tokenizer": TokenizerConfig,
    "training": TrainingConfig,
    "scheduler": SchedulerConfig,
    "optimizer": OptimizerConfig,
    "precision": PrecisionConfig,
    "fp8": Fp8Config,
    "ddp": DDPConfig,
    "checkpoint": CheckpointConfig,
}
"""Every config group of ``pretrain``, in ``--help`` order."""


class RunConfig:
    """One frozen config object per group, by attribute (``cfg.model.num_layers``)."""

    def __init__(self, groups: Mapping[str, Any]):
        object.__setattr__(self, "_groups", dict(groups))

    def __getattr__(self, name: str) -> Any:
        try:
            return self._groups[name]
        except KeyError:
            raise AttributeError(f"no config group {name!r}; groups: {', '.join(self._groups)}") from None

    def __setattr__(self, name, value):
        raise AttributeError("RunConfig is read-only")

    def as_dict(self) -> dict[str, Any]:
        return dict(self._groups)

    def replace(self, **groups: Any) -> RunConfig:
        return RunConfig({**self._groups, **groups})


def parse_run_config(
    argv: Sequence[str] | None = None,
    extra_groups: Mapping[str, type] | None = None,
    prog: str | None = None,
    args_defaults: Mapping[str, Any] | None = None,
) -> RunConfig:
    """Parse Megatron's flags into a :class:`RunConfig` (exit 2 with one message on a mistake).

    ``args_defaults``: a script's own defaults by field name (Megatron's ``args_defaults``)."""
    configure_console()  # the command line's notes and errors, and the run's lines, on the console
    groups = {**CONFIG_GROUPS, **(extra_groups or {})}
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--use-checkpoint-args" in argv:  # the checkpoint's model flags replace the command line's
        from mcore.checkpoint.checkpoint_args import apply_checkpoint_args
        from mcore.checkpoint.format import CheckpointError

        try:
            argv = apply_checkpoint_args(argv)
        except CheckpointError as err:
            logger.error(f"error: {err}")
            raise SystemExit(2) from None
    return RunConfig(parse_config(groups, argv, prog=prog, defaults=args_defaults))
