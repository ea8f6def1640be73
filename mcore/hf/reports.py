"""What a conversion reports: :class:`ExportReport` and :class:`ImportReport` (the command lines print
their :meth:`describe`, :func:`mcore.hf.export.run_conversion`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from mcore.data.config import TokenizerConfig
from mcore.hf.parity import ParityReport
from mcore.models.transformer.model_config import ModelConfig


@dataclass
class ExportReport:
    """What :func:`mcore.hf.export.export_to_hf` wrote and measured."""

    output_dir: str
    architecture: str
    vocab_size: int
    dtype: str
    files: list[str] = field(default_factory=list)
    parity: ParityReport | None = None

    def describe(self) -> str:
        lines = [
            f"exported {self.architecture} ({self.dtype}, vocab {self.vocab_size}) to {self.output_dir}",
            f"  files: {', '.join(self.files)}",
        ]
        lines.append(
            "  " + (self.parity.describe() if self.parity else "parity check skipped (--no-parity-check)")
        )
        return "\n".join(lines)


@dataclass
class ImportReport:
    """What :func:`mcore.hf.importer.import_from_hf` produced."""

    save_dir: str
    architecture: str
    model_config: ModelConfig
    tokenizer_config: TokenizerConfig | None
    vocab_size: int
    padded_vocab_size: int
    flags: list[str] = field(default_factory=list)
    parity: ParityReport | None = None

    def describe(self) -> str:
        lines = [
            f"imported {self.architecture} (vocab {self.vocab_size}, padded {self.padded_vocab_size}) "
            f"into {self.save_dir}"
        ]
        lines.append(
            "  " + (self.parity.describe() if self.parity else "parity check skipped (--no-parity-check)")
        )
        lines.append("  Megatron flags for this model (continue training with --load ... --finetune):")
        lines.append("    " + " ".join(self.flags))
        return "\n".join(lines)
