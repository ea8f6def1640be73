"""The training loop's own settings: batch sizes, length of the run, evaluation, exits and logging."""

from __future__ import annotations

from dataclasses import dataclass

from mcore.config.fields import ConfigError, check, flag


@dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    """Batch sizes, run length, evaluation, exit conditions and logging."""

    micro_batch_size: int = flag(1, "Sequences per micro-batch on one data-parallel rank.")
    global_batch_size: int | None = flag(
        None, "Sequences per optimizer step over all data-parallel ranks (default: micro x data-parallel)."
    )
    rampup_batch_size: tuple[int, ...] | None = flag(
        None, "Batch-size rampup: START INCREMENT SAMPLES.", nargs=3
    )
    train_iters: int | None = flag(None, "Optimizer steps to train for.")
    train_samples: int | None = flag(None, "Samples to train for (instead of --train-iters).")
    eval_interval: int = flag(1000, "Evaluate on the validation split every this many iterations.")
    eval_iters: int = flag(100, "Micro-batch groups (global batches) per evaluation.")
    skip_train: bool = flag(False, "Only evaluate.")
    exit_interval: int | None = flag(None, "Exit (after saving) when the iteration is a multiple of this.")
    exit_duration_in_mins: float | None = flag(None, "Exit (after saving) after this many minutes.")
    exit_signal_handler: bool = flag(False, "On SIGTERM, finish the step, save and exit 0.")
    seed: int = flag(1234, "Random seed (weights, dropout, data order).")
    log_interval: int = flag(100, "Print (and write) metrics every this many iterations.")
    tensorboard_dir: str | None = flag(None, "Write TensorBoard scalars here.")
    tensorboard_log_interval: int = flag(1, "Write TensorBoard scalars every this many iterations.")
    wandb_project: str | None = flag(None, "Also log to this Weights & Biases project (when installed).")
    wandb_exp_name: str | None = flag(None, "Weights & Biases run name.")
    log_json: str | None = flag(None, "Append one JSON object per logged iteration to this file.")
    peak_tflops: float | None = flag(
        None, "Peak dense TFLOP/s of one device for MFU (default: the backend's)."
    )
    compile_layers: bool = flag(
        False,
        "Compile each transformer layer with torch.compile (backends with the compile_layers capability).",
    )
    # Megatron's flag names (--cuda-graph-*) on vendor-neutral fields: any backend with the
    # device_graphs capability serves them.
    device_graph_impl: str = flag(
        "none",
        "local: capture each transformer layer's forward and backward as device graphs and replay them "
        "(backends with the device_graphs capability; pipeline size 1).",
        choices=("none", "local"),
        name="--cuda-graph-impl",
    )
    device_graph_warmup_steps: int = flag(
        3,
        "Eager training steps before the layers' device graphs are captured.",
        name="--cuda-graph-warmup-steps",
    )
    log_memory: bool = flag(
        True, "Report per-rank memory of params, grads and optimizer state.", name="--no-log-memory"
    )
    log_params_norm: bool = flag(
        False, "Compute the L2 norm of all parameters at each log interval and log it (params-norm)."
    )
    log_validation_ppl_to_tensorboard: bool = flag(
        False, "Also write the validation perplexity (lm loss validation ppl) to TensorBoard."
    )
    timing_log_level: int = flag(
        0,
        "Phase timers: 0 none (only the time per iteration, no extra device waits); 1 forward-backward "
        "and optimizer; 2 also batch-generator (the data). Levels 1 and 2 wait for the device around "
        "each timed phase, which slows training a little.",
        choices=(0, 1, 2),
    )
    timing_log_option: str = flag(
        "minmax",
        "How the timers are reported across ranks: max, minmax (min and max) or all (every rank).",
        choices=("max", "minmax", "all"),
    )
    log_timers_to_tensorboard: bool = flag(
        False, "Write iteration-time and the phase timers (<name>-time, the max over ranks) to TensorBoard."
    )
    empty_unused_memory_level: int = flag(
        0,
        "Release the device allocator's unused cached memory: 1 after each forward-backward, 2 also "
        "after each optimizer step (slower; reduces fragmentation). 0: never.",
        choices=(0, 1, 2),
    )

    def __post_init__(self) -> None:
        check(self.micro_batch_size >= 1, f"micro_batch_size={self.micro_batch_size} must be >= 1")
        if self.train_iters is not None and self.train_samples is not None:
            raise ConfigError("give --train-iters or --train-samples, not both")
        if self.train_samples is not None and self.rampup_batch_size is not None:
            pass  # Megatron allows it; the sample count bounds the run.
        if self.train_iters is not None and self.rampup_batch_size is not None:
            raise ConfigError("--rampup-batch-size needs --train-samples (as in Megatron-LM)")
        for name in ("eval_interval", "log_interval"):
            check(getattr(self, name) >= 1, f"{name}={getattr(self, name)} must be >= 1")
        check(self.eval_iters >= 0, f"eval_iters={self.eval_iters} must be >= 0")
        check(
            self.device_graph_warmup_steps >= 0,
            f"--cuda-graph-warmup-steps {self.device_graph_warmup_steps} must be >= 0",
        )
