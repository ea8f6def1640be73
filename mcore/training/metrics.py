"""Where training metrics go: the console line, TensorBoard, Weights & Biases and a JSON-lines file.

Only the logging rank (the last pipeline stage of the last data-parallel replica, where the loss
lives) writes. The console line follows Megatron's so people's log parsers keep working::

     iteration       10/     100 | consumed samples:          320 | elapsed time per iteration (ms): 41.2 |
     learning rate: 1.000000E-04 | global batch size:    32 | lm loss: 7.123456E+00 | loss scale: 1.0 |
     grad norm: 1.234 | number of skipped iterations:   0 | number of nan iterations:   0 |
     tokens/s: 12345 | TFLOP/s/device: 12.3 | MFU: 1.2% | mem alloc (GiB): 1.23 |
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any

from mcore.training.config import TrainingConfig


class MetricsWriter:
    """Writes one record per logged iteration to every configured sink."""

    def __init__(self, cfg: TrainingConfig, is_logging_rank: bool, run_config: dict[str, Any] | None = None):
        self.cfg = cfg
        self.enabled = is_logging_rank
        self._tensorboard = None
        self._wandb = None
        self._json = None
        if not self.enabled:
            return
        if cfg.tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as err:  # tensorboard is an optional extra
                raise RuntimeError(
                    f"--tensorboard-dir needs the tensorboard package ({err}); pip install tensorboard"
                ) from err
            self._tensorboard = SummaryWriter(log_dir=cfg.tensorboard_dir, max_queue=1000)
        if cfg.wandb_project:
            try:
                import wandb
            except ImportError as err:
                raise RuntimeError("--wandb-project needs the wandb package; pip install wandb") from err
            self._wandb = wandb.init(
                project=cfg.wandb_project, name=cfg.wandb_exp_name, config=run_config or {}
            )
        if cfg.log_json:
            os.makedirs(os.path.dirname(os.path.abspath(cfg.log_json)), exist_ok=True)
            self._json = open(cfg.log_json, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def scalars(self, iteration: int, values: dict[str, float], prefix: str = "") -> None:
        """Send scalars to TensorBoard / W&B (every ``--tensorboard-log-interval``)."""
        if not self.enabled or iteration % self.cfg.tensorboard_log_interval != 0:
            return
        for key, value in values.items():
            if value is None or (isinstance(value, float) and math.isnan(value)):
                continue
            if self._tensorboard is not None:
                self._tensorboard.add_scalar(prefix + key, value, iteration)
        if self._wandb is not None:
            self._wandb.log({prefix + k: v for k, v in values.items() if v is not None}, step=iteration)

    def record(self, iteration: int, values: dict[str, Any], kind: str = "train") -> None:
        """Append one JSON object (``{"kind", "iteration", "time", ...}``) to ``--log-json``.

        A key with spaces (Megatron's ``"lm loss"``) also appears with underscores (``"lm_loss"``), so
        tools that want identifier-like keys need no quoting; values are full-precision floats."""
        if self._json is not None:
            aliases = {k.replace(" ", "_"): v for k, v in values.items() if " " in k}
            record = {"kind": kind, "iteration": iteration, "time": time.time(), **values, **aliases}
            self._json.write(json.dumps(record) + "\n")
            self._json.flush()

    def close(self) -> None:
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._json is not None:
            self._json.close()
        if self._wandb is not None:
            self._wandb.finish()


def format_train_line(iteration: int, train_iters: int | None, v: dict[str, Any]) -> str:
    """Megatron's console line."""
    parts = [
        f" iteration {iteration:8d}/{train_iters or 0:8d}",
        f"consumed samples: {v['consumed_samples']:12d}",
        f"elapsed time per iteration (ms): {v['iteration_time_ms']:.1f}",
        f"learning rate: {v['learning_rate']:.6E}",
        f"global batch size: {v['global_batch_size']:5d}",
    ]
    for key, value in v.get("losses", {}).items():
        parts.append(f"{key}: {value:.6E}")
    parts.append(f"loss scale: {v['loss_scale']:.1f}")
    if v.get("grad_norm") is not None:
        parts.append(f"grad norm: {v['grad_norm']:.3f}")
    parts.append(f"number of skipped iterations: {v['skipped_iterations']:3d}")
    parts.append(f"number of nan iterations: {v['nan_iterations']:3d}")
    parts.append(f"tokens/s: {v['tokens_per_s']:.0f}")
    if v.get("tflops_per_device") is not None:
        parts.append(f"TFLOP/s/device: {v['tflops_per_device']:.1f}")
    if v.get("mfu") is not None:
        parts.append(f"MFU: {100 * v['mfu']:.1f}%")
    if v.get("mem_allocated_gib"):
        parts.append(f"mem alloc (GiB): {v['mem_allocated_gib']:.2f}")
        parts.append(f"mem peak (GiB): {v['mem_peak_gib']:.2f}")
    return " | ".join(parts) + " |"


class Timer:
    """Wall-clock timer that synchronizes the device first, so queued kernels are counted."""

    def __init__(self, synchronize):
        self._synchronize = synchronize
        self._start: float | None = None
        self.elapsed = 0.0

    def start(self) -> None:
        self._synchronize()
        self._start = time.perf_counter()

    def stop(self) -> float:
        self._synchronize()
        assert self._start is not None, "Timer.stop() without start()"
        delta = time.perf_counter() - self._start
        self.elapsed += delta
        self._start = None
        return delta

    def reset(self) -> float:
        elapsed, self.elapsed = self.elapsed, 0.0
        return elapsed
