"""Logit parity between an mcore model and its Hugging Face twin.

Both sides run in fp32 on the CPU in eval mode, on the same fixed-seed batch of ``2 x 24`` token ids
from ``[0, V)`` (shorter if the model has fewer positions), with no padding and default positions.
The Hugging Face model is loaded from the directory with ``from_pretrained`` (so what is checked is
what was written), once per attention implementation (``eager`` and ``sdpa``); its load report must
list no missing, unexpected or mismatched keys. The mcore logits are cut to the real vocabulary.

Half-precision weights (``mcore-import-hf --dtype bfloat16|float16``): the check is of the conversion,
not of the rounding the user asked for, so the Hugging Face weights are rounded to the same dtype
(``round_to``) and both sides still compute in fp32; the fp32 tolerance (1e-4) then applies. Comparing
rounded against unrounded weights instead would measure bf16's own rounding (about 1e-2 on the logits
of a toy model), which no fixed tolerance separates from a wrong mapping.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from mcore.distributed.groups import ProcessGroups
from mcore.hf.errors import ConversionError, ParityError
from mcore.inference.loading import build_model_chunk
from mcore.models.transformer.model_config import ModelConfig

DEFAULT_TOLERANCE = 1e-4
"""Largest allowed ``|logit difference|`` in fp32 (toy models differ by 2e-6 .. 6e-6)."""


@dataclass
class ParityReport:
    """The outcome of one parity check."""

    max_abs_diff: float
    """Largest ``|mcore - HF|`` logit over the batch, the vocabulary and every attention implementation."""
    per_implementation: dict[str, float] = field(default_factory=dict)
    argmax_equal: bool = True
    """Hugging Face's most likely token is mcore's (within the tolerance) at every position."""
    tolerance: float = DEFAULT_TOLERANCE
    batch_shape: tuple[int, int] = (0, 0)
    weights_dtype: str | None = None
    """The dtype both sides' weights were rounded to (None: as stored)."""

    @property
    def ok(self) -> bool:
        return self.max_abs_diff <= self.tolerance and self.argmax_equal

    def describe(self) -> str:
        parts = ", ".join(f"{k} {v:.3g}" for k, v in self.per_implementation.items())
        return (
            f"logit parity on a {self.batch_shape[0]}x{self.batch_shape[1]} batch: max |diff| "
            f"{self.max_abs_diff:.3g} ({parts}); argmax {'equal' if self.argmax_equal else 'DIFFERS'}; "
            f"tolerance {self.tolerance:g}"
            + (
                f" (both sides' weights rounded to {self.weights_dtype}, computed in fp32)"
                if self.weights_dtype
                else ""
            )
        )


def parity_tokens(vocab_size: int, max_positions: int | None, batch: int = 2, seq: int = 24, seed: int = 0):
    """The fixed test batch ``[batch, seq]`` of ids in ``[0, vocab_size)``."""
    if max_positions is not None:
        seq = min(seq, max_positions)
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, seq), generator=generator)


@torch.no_grad()
def mcore_logits(
    cfg: ModelConfig, state: Mapping[str, torch.Tensor], vocab_size: int, tokens: torch.Tensor
) -> torch.Tensor:
    """fp32 logits ``[b, s, V]`` of the mcore model built (TP=1, CPU) from a logical state."""
    fp32 = {k: v.float() for k, v in state.items()}
    model = build_model_chunk(cfg, ProcessGroups.single(), vocab_size, fp32, device=torch.device("cpu"))
    logits = model(tokens)[..., :vocab_size].float()
    del model
    return logits


def load_hf_model(
    class_name: str, hf_dir: str, *, round_to: torch.dtype | None = None, quiet: bool = False, **kwargs
) -> torch.nn.Module:
    """``transformers.<class_name>.from_pretrained(hf_dir, **kwargs)`` in fp32 and eval mode, its load
    report checked clean (no missing, unexpected or mismatched weights), its weights then rounded to
    ``round_to`` when given (the same rounding as the mcore side). ``quiet``: transformers' warnings off
    while loading.

    Raises:
        ConversionError: transformers is missing, or the weights did not load cleanly.
    """
    try:
        import transformers
        from transformers.utils import logging as hf_logging
    except ImportError:
        raise ConversionError(
            "the parity check needs the 'transformers' package (pip install 'mcore-train[hf]')"
        ) from None
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    verbosity = hf_logging.get_verbosity()
    if quiet:
        hf_logging.set_verbosity_error()
    try:
        # transformers 5 calls it ``dtype``, 4.x ``torch_dtype``.
        dtype_arg = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
        model, info = getattr(transformers, class_name).from_pretrained(
            hf_dir, output_loading_info=True, **kwargs, **{dtype_arg: torch.float32}
        )
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    problems = {k: v for k, v in info.items() if k != "error_msgs" and v}
    mtp = _mtp_layers(model.config)  # DeepSeek-V3's MTP layers: in the files, not in transformers' model
    if mtp and problems.get("unexpected_keys"):
        problems["unexpected_keys"] = {k for k in problems["unexpected_keys"] if not k.startswith(mtp)}
        problems = {k: v for k, v in problems.items() if v}
    if info.get("error_msgs"):
        problems["error_msgs"] = info["error_msgs"]
    if problems:
        raise ConversionError(f"{hf_dir}: transformers did not load the weights cleanly: {problems}")
    model.eval()
    if round_to is not None:
        with torch.no_grad():
            for param in model.parameters():
                param.copy_(param.to(round_to).float())
    return model


@torch.no_grad()
def hf_logits(
    hf_dir: str, tokens: torch.Tensor, attn_implementation: str = "eager", round_to: torch.dtype | None = None
) -> torch.Tensor:
    """fp32 logits of the Hugging Face model saved in ``hf_dir`` (its load report must be clean), with
    its weights first rounded to ``round_to`` when given."""
    model = load_hf_model(
        "AutoModelForCausalLM", hf_dir, round_to=round_to, attn_implementation=attn_implementation
    )
    return model(tokens).logits.float()


def check_logit_parity(
    cfg: ModelConfig,
    state: Mapping[str, torch.Tensor],
    vocab_size: int,
    hf_dir: str,
    *,
    tolerance: float = DEFAULT_TOLERANCE,
    attn_implementations: Sequence[str] = ("eager", "sdpa"),
    raise_on_failure: bool = True,
    round_to: torch.dtype | None = None,
) -> ParityReport:
    """Run the same batch through the mcore model (``cfg`` + logical ``state``) and ``hf_dir``.

    ``round_to``: the dtype ``state`` was rounded to (the Hugging Face weights get the same rounding).

    Raises:
        ParityError: the largest difference exceeds ``tolerance`` or the argmax differs (with
            ``raise_on_failure``); the message carries the report.
    """
    max_positions = cfg.max_position_embeddings if cfg.position_embedding_type == "learned_absolute" else None
    tokens = parity_tokens(vocab_size, max_positions)
    reference = mcore_logits(cfg, state, vocab_size, tokens)
    report = ParityReport(0.0, tolerance=tolerance, batch_shape=tuple(tokens.shape))
    if round_to is not None:
        report.weights_dtype = str(round_to).removeprefix("torch.")
    for impl in attn_implementations:
        theirs = hf_logits(hf_dir, tokens, impl, round_to=round_to)
        if theirs.shape != reference.shape:
            raise ConversionError(
                f"{hf_dir}: Hugging Face logits have shape {tuple(theirs.shape)}, mcore {tuple(reference.shape)}"
            )
        diff = float((theirs - reference).abs().max())
        report.per_implementation[impl] = diff
        report.max_abs_diff = max(report.max_abs_diff, diff)
        # Their choice must be ours up to the tolerance (a near-tie may flip the exact argmax).
        chosen = reference.gather(-1, theirs.argmax(-1, keepdim=True)).squeeze(-1)
        report.argmax_equal &= bool(((reference.max(-1).values - chosen) <= tolerance).all())
    if raise_on_failure and not report.ok:
        raise ParityError("parity check FAILED: " + report.describe())
    return report


def _mtp_layers(config) -> tuple[str, ...]:
    """The prefixes of the multi-token-prediction layers a DeepseekV3 checkpoint carries past its
    ``num_hidden_layers`` (``num_nextn_predict_layers``; the import's ``--mtp-num-layers``)."""
    if getattr(config, "model_type", None) != "deepseek_v3":
        return ()
    layers, depths = config.num_hidden_layers, getattr(config, "num_nextn_predict_layers", 0) or 0
    return tuple(f"model.layers.{layers + k}." for k in range(depths))
