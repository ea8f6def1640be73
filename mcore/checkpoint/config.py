"""Where and when checkpoints are written and what a load restores (Megatron's flags)."""

from __future__ import annotations

from dataclasses import dataclass

from mcore.config.fields import check, flag


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Checkpoint saving and loading."""

    save: str | None = flag(None, "Directory to save checkpoints to.")
    load: str | None = flag(None, "Directory to load a checkpoint from.")
    save_interval: int | None = flag(None, "Save every this many iterations (and at the end).")
    ckpt_step: int | None = flag(None, "Load this iteration instead of the latest.")
    no_load_optim: bool = flag(False, "Do not load the optimizer state.")
    no_load_rng: bool = flag(False, "Do not load the RNG states.")
    no_save_optim: bool = flag(False, "Do not save the optimizer state.")
    no_save_rng: bool = flag(False, "Do not save the RNG states.")
    finetune: bool = flag(
        False, "Load weights only and start at iteration 0 (implies no optimizer/RNG load)."
    )
    allow_vocab_resize: bool = flag(
        False,
        "Load a checkpoint trained with another vocabulary (tokenizer size or type): the word embedding "
        "and output layer keep the rows of the ids both vocabularies have; the other rows (new ids, "
        "padding) start at zero (weights, fp32 masters, Adam moments); rows beyond the new size are "
        "dropped. Without it such a checkpoint is refused.",
    )
    use_checkpoint_args: bool = flag(
        False,
        "Take the model architecture flags from the --load checkpoint (mcore's or Megatron-LM's), "
        "replacing the command line's.",
    )
    async_save: bool = flag(
        False, "Write checkpoints in the background; the loop waits only for the device-to-host copy."
    )

    def __post_init__(self) -> None:
        if self.save_interval is not None:
            check(self.save_interval >= 1, f"save_interval={self.save_interval} must be >= 1")
