"""Where training metrics go: the console line, TensorBoard, Weights & Biases and a JSON-lines file.

Only the logging rank (the last pipeline stage of the last data-parallel replica, where the loss
lives) writes. The console line follows Megatron's so people's log parsers keep working::

     iteration       10/     100 | consumed samples:          320 | elapsed time per iteration (ms): 41.2 |
     learning rate: 1.000000E-04 | global batch size:    32 | lm loss: 7.123456E+00 | loss scale: 1.0 |
     grad norm: 1.234 | number of skipped iterations:   0 | number of nan iterations:   0 |
     tokens/s: 12345 | TFLOP/s/device: 12.3 | MFU: 1.2% | mem alloc (GiB): 1.23 |

(``params norm`` follows ``grad norm`` with ``--log-params-norm``; ``TFLOP/s/device`` and ``MFU`` are
left out where they would print 0.0, as on the CPU, or where the backend knows no peak.)

TensorBoard gets Megatron's tags (:data:`TENSORBOARD_TAGS`; ``docs/logs.md`` has the
table), each also as ``<tag> vs samples`` with the consumed samples as the step. They are written at
log intervals (``--log-interval``, thinned by ``--tensorboard-log-interval``), with the interval's mean
loss: mcore reads the device only at log intervals, where Megatron writes every iteration's values.
The JSON-lines file (``--log-json``) keeps mcore's own keys (``lm loss``, ``learning_rate``, ...).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from typing import Any

from mcore.training.config import TrainingConfig
from mcore.training.timers import format_timers, timer_scalars
from mcore.utils.async_host import host_floats

logger = logging.getLogger(__name__)


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

    def tagged_scalars(self, iteration: int, consumed_samples: int, values: dict[str, float]) -> None:
        """Megatron's way: each tag at ``iteration``, and ``<tag> vs samples`` at ``consumed_samples``."""
        if not self.enabled or iteration % self.cfg.tensorboard_log_interval != 0:
            return
        values = {k: v for k, v in values.items() if v is not None and not math.isnan(v)}
        if self._tensorboard is not None:
            for tag, value in values.items():
                self._tensorboard.add_scalar(tag, value, iteration)
                self._tensorboard.add_scalar(f"{tag} vs samples", value, consumed_samples)
        if self._wandb is not None:
            self._wandb.log(values, step=iteration)

    def record(self, iteration: int, values: dict[str, Any], kind: str = "train") -> None:
        """Append one JSON object (``{"kind", "iteration", "time", ...}``) to ``--log-json``.

        A key with spaces (Megatron's ``"lm loss"``) also appears with underscores (``"lm_loss"``), so
        tools that want identifier-like keys need no quoting; values are full-precision floats."""
        if self._json is not None:
            aliases = {k.replace(" ", "_"): v for k, v in values.items() if " " in k}
            record = {"kind": kind, "iteration": iteration, "time": time.time(), **values, **aliases}
            self._json.write(json.dumps(record) + "\n")
            self._json.flush()

    def log_step(
        self,
        state,
        train_iters: int | None,
        *,
        seconds_per_iter: float,
        global_batch_size: int,
        seq_length: int,
        learning_rate: float,
        losses: dict[str, float],
        loss_scale,
        grad_norm: float | None,
        params_norm,
        flops_per_sample: float,
        world_size: int,
        peak_flops: float | None,
        memory: dict[str, int],
        times: dict[str, list[float | None]] | None = None,
    ) -> dict[str, Any]:
        """One log interval's output: the console line (and the timer block) on the logging rank, the
        TensorBoard tags, the ``--log-json`` record; returns the values (the JSON record's keys).

        ``state`` is the training state after the interval's last step (its ``iteration``,
        ``consumed_train_samples``, ``skipped_iterations``, ``nan_iterations``); ``losses`` the
        interval's mean losses; ``loss_scale`` and ``params_norm`` may be device tensors (read here);
        ``memory`` the backend's ``memory_stats()``; ``times`` the collected phase timers.
        """
        tflops = flops_per_sample * global_batch_size / seconds_per_iter / world_size
        values = {
            "consumed_samples": state.consumed_train_samples,
            "iteration_time_ms": 1000 * seconds_per_iter,
            "learning_rate": learning_rate,
            "global_batch_size": global_batch_size,
            "losses": losses,
            "loss_scale": host_floats([loss_scale])[0],
            "grad_norm": grad_norm,
            "params_norm": host_floats([params_norm])[0],
            "skipped_iterations": state.skipped_iterations,
            "nan_iterations": state.nan_iterations,
            "tokens_per_s": global_batch_size * seq_length / seconds_per_iter,
            "tflops_per_device": tflops / 1e12,
            "mfu": tflops / peak_flops if peak_flops else None,
            "mem_allocated_gib": memory["allocated"] / 2**30,
            "mem_peak_gib": memory["peak_allocated"] / 2**30,
            "mem_allocated_bytes": memory["allocated"],
            "mem_peak_bytes": memory["peak_allocated"],
        }
        if self.enabled:
            logger.info(format_train_line(state.iteration, train_iters, values))
            if times:
                logger.info(format_timers(times, self.cfg.timing_log_option))
        tags = train_tensorboard_scalars(values, log_timers=self.cfg.log_timers_to_tensorboard)
        if self.cfg.log_timers_to_tensorboard:
            tags.update(timer_scalars(times or {}))
        self.tagged_scalars(state.iteration, state.consumed_train_samples, tags)
        flat = {k: v for k, v in values.items() if k != "losses"}
        flat.update(values["losses"])
        self.record(state.iteration, flat)
        return flat

    def close(self) -> None:
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._json is not None:
            self._json.close()
        if self._wandb is not None:
            self._wandb.finish()


TENSORBOARD_TAGS: dict[str, str] = {
    "learning_rate": "learning-rate",
    "global_batch_size": "batch-size",
    "loss_scale": "loss-scale",
    "grad_norm": "grad-norm",
    "params_norm": "params-norm",
    "tflops_per_device": "throughput",
    "tokens_per_s": "tokens-per-second",
    "mem_allocated_bytes": "mem-allocated-bytes",
    "mem_peak_bytes": "mem-max-allocated-bytes",
}
"""The training line's values (their keys in the JSON log) -> Megatron's TensorBoard tags. Losses keep
their names (``lm loss``); ``tokens-per-second`` is mcore's own. With ``--log-timers-to-tensorboard``,
``iteration-time`` (seconds) and ``<timer>-time`` (ms, the max over ranks) are added."""


def train_tensorboard_scalars(values: dict[str, Any], log_timers: bool = False) -> dict[str, float]:
    """The TensorBoard scalars of one training log line (``values`` as for :func:`format_train_line`)."""
    out = {tag: values.get(key) for key, tag in TENSORBOARD_TAGS.items()}
    if not out.get("throughput"):
        out["throughput"] = None  # no TFLOP/s where it would be 0 (CPU)
    for tag in ("mem-allocated-bytes", "mem-max-allocated-bytes"):
        if not out.get(tag):
            out[tag] = None  # a backend that reports no memory
    out.update(values.get("losses", {}))
    if log_timers:
        out["iteration-time"] = values["iteration_time_ms"] / 1000.0
    return out


def eval_tensorboard_scalars(results: dict[str, float], split: str, ppl: bool) -> dict[str, float]:
    """Megatron's evaluation tags: ``lm loss validation`` (and ``lm loss validation ppl`` with
    ``--log-validation-ppl-to-tensorboard``); the test split is written as ``lm loss test``."""
    out = {}
    for key, value in results.items():
        out[f"{key} {split}"] = value
        if ppl:
            out[f"{key} {split} ppl"] = math.exp(min(20.0, value))
    return out


ARGUMENTS_HEADER = "------------------------ arguments ------------------------"
ARGUMENTS_FOOTER = "-------------------- end of arguments ---------------------"


def format_arguments_block(configs: dict[str, Any], extra: dict[str, Any] | None = None) -> str:
    """Megatron's start-up block: every setting, one per line, sorted by name (case-insensitively)::

        ------------------------ arguments ------------------------
          adam_beta1 ...................................... 0.9
          ...
        -------------------- end of arguments ---------------------

    ``configs``: the config objects by group (``RunConfig.as_dict()``); a name two groups share (they
    hold the same value) is printed once. ``extra``: derived values (``world_size``, ...).
    """
    import dataclasses

    values: dict[str, Any] = {}
    for cfg in configs.values():
        for field in dataclasses.fields(cfg):
            value = getattr(cfg, field.name)
            values.setdefault(field.name, list(value) if isinstance(value, tuple) else value)
    values.update(extra or {})
    lines = [ARGUMENTS_HEADER]
    for name in sorted(values, key=str.lower):
        lines.append(f"  {name} {'.' * (48 - len(name))} {values[name]}")
    lines.append(ARGUMENTS_FOOTER)
    return "\n".join(lines)


def format_parameter_count(tp_rank: int, pp_rank: int, count: int) -> str:
    """Megatron's per-rank parameter line (printed by data-parallel rank 0 of each model-parallel rank)."""
    return (
        f" > number of parameters on (tensor, pipeline) model parallel rank ({tp_rank}, {pp_rank}): {count}"
    )


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
    if v.get("params_norm") is not None:
        parts.append(f"params norm: {v['params_norm']:.3f}")
    parts.append(f"number of skipped iterations: {v['skipped_iterations']:3d}")
    parts.append(f"number of nan iterations: {v['nan_iterations']:3d}")
    parts.append(f"tokens/s: {v['tokens_per_s']:.0f}")
    if v.get("tflops_per_device") is not None and round(v["tflops_per_device"], 1) > 0:
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
