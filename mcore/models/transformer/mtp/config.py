"""Multi-token prediction flags (Megatron-LM's ``--mtp-num-layers``, ``--mtp-loss-scaling-factor``)."""

from __future__ import annotations

from dataclasses import dataclass

from mcore.config.fields import check, flag


@dataclass(frozen=True, kw_only=True)
class MTPFlags:
    """Multi-token prediction flags (Megatron's names; see docs/deepseek.md)."""

    mtp_num_layers: int | None = flag(
        None, "Multi-token prediction depth: extra modules predicting tokens 2..D+1 ahead (None: off)."
    )
    mtp_loss_scaling_factor: float = flag(
        0.1, "Weight of the MTP loss: the mean over the depths of their losses times this, added to the loss."
    )


def check_mtp(config) -> None:
    """MTP's checks on the model config; errors name the flags and values."""
    d = config.mtp_num_layers
    if d is None or d == 0:
        return
    check(
        isinstance(d, int) and d >= 1, f"mtp_num_layers={d!r} (--mtp-num-layers) must be a positive integer"
    )
    check(
        config.position_embedding_type != "learned_absolute",
        f"mtp_num_layers={d} (--mtp-num-layers) does not take learned_absolute positions (as Megatron); "
        "use --position-embedding-type rope or none",
    )
    check(
        config.mtp_loss_scaling_factor >= 0,
        f"mtp_loss_scaling_factor={config.mtp_loss_scaling_factor} (--mtp-loss-scaling-factor) must be >= 0",
    )


def refuse_mla_mtp(config, family: str) -> None:
    """BERT and T5 have no multi-latent attention and no shared output layer for MTP: one error naming the flags."""
    flags = []
    if getattr(config, "multi_latent_attention", False):
        flags.append("--multi-latent-attention")
    if getattr(config, "mtp_num_layers", None):
        flags.append(
            f"--mtp-num-layers {config.mtp_num_layers} (MTP needs a GPT model's shared embedding and output layer)"
        )
    check(
        not flags, f"{family} does not support {', '.join(flags)}; these are GPT-family (DeepSeek) features"
    )
