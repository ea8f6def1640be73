"""How many micro-batches make one global batch, with Megatron's batch-size rampup.

``num_microbatches = global_batch_size / (micro_batch_size * data_parallel_size)``. With
``--rampup-batch-size START INCREMENT SAMPLES`` the global batch grows from START by INCREMENT in equal
sample intervals until it reaches ``--global-batch-size`` after SAMPLES samples::

    steps = (global - start) / increment
    interval = SAMPLES / steps
    batch(consumed) = min(global, start + floor(consumed / interval) * increment)
"""

from __future__ import annotations

from mcore.config.fields import ConfigError


class MicroBatchCalculator:
    def __init__(
        self,
        *,
        global_batch_size: int,
        micro_batch_size: int,
        data_parallel_size: int,
        rampup_batch_size: tuple[int, int, int] | None = None,
    ):
        per_step = micro_batch_size * data_parallel_size
        if global_batch_size % per_step != 0:
            raise ConfigError(
                f"global_batch_size={global_batch_size} is not divisible by micro_batch_size={micro_batch_size} "
                f"x data_parallel_size={data_parallel_size} = {per_step}"
            )
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.data_parallel_size = data_parallel_size
        self.rampup = rampup_batch_size
        if rampup_batch_size is not None:
            start, increment, samples = rampup_batch_size
            if start <= 0 or increment <= 0 or samples <= 0:
                raise ConfigError(f"rampup_batch_size={rampup_batch_size}: all three values must be positive")
            if (global_batch_size - start) % increment != 0:
                raise ConfigError(
                    f"rampup: global_batch_size={global_batch_size} minus start={start} is not a "
                    f"multiple of increment={increment}"
                )
            for size in range(start, global_batch_size + 1, increment):
                if size % per_step != 0:
                    raise ConfigError(
                        f"rampup batch size {size} is not divisible by micro_batch_size x "
                        f"data_parallel_size = {per_step}"
                    )
        self.current_global_batch_size = global_batch_size
        self.update(0)

    def update(self, consumed_samples: int) -> None:
        if self.rampup is None:
            self.current_global_batch_size = self.global_batch_size
            return
        start, increment, samples = self.rampup
        steps = (self.global_batch_size - start) // increment
        if steps == 0 or consumed_samples >= samples:
            self.current_global_batch_size = self.global_batch_size
            return
        interval = samples / steps
        self.current_global_batch_size = min(
            self.global_batch_size, start + int(consumed_samples / interval) * increment
        )

    @property
    def num_microbatches(self) -> int:
        return self.current_global_batch_size // (self.micro_batch_size * self.data_parallel_size)
