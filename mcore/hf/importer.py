"""Import a local Hugging Face GPT-2 or Llama directory as an mcore checkpoint, checked for parity.

Command::

    python -m mcore.hf.importer --hf-dir HF_DIR --save CKPT_DIR [--make-vocab-size-divisible-by 128]
        [--dtype auto|float32|bfloat16|float16] [--tolerance 1e-4] [--no-parity-check] [--no-tokenizer]

The result is a model-only checkpoint (:func:`mcore.checkpoint.save_logical_model_checkpoint`) that
``--load CKPT_DIR --finetune`` loads at any layout. It is layout-free, so the command takes no
``--tensor-model-parallel-size`` / ``--pipeline-model-parallel-size`` (they are refused with that
reason: give them to the training run that loads it). ``--dtype bfloat16|float16`` rounds the weights;
the parity check then rounds the Hugging Face weights the same way and keeps the fp32 tolerance
(:mod:`mcore.hf.parity`). The tokenizer files are copied to ``CKPT_DIR/tokenizer`` and recorded in the run
config. The command prints the Megatron flags that build the same model.

Refused (:class:`~mcore.hf.errors.ConversionError`, exit status 2): a directory without
``config.json`` or weights, an architecture other than ``GPT2LMHeadModel``/``LlamaForCausalLM``/
``MegatronBertForPreTraining``/``MegatronBertForMaskedLM`` (:mod:`mcore.hf.bert_io`; the post-LN
``BertForPreTraining`` is refused with the reason),
settings mcore cannot express (:func:`mcore.hf.config.model_config_from_hf`), a tokenizer whose size
differs from ``vocab_size``, embedding rows that differ from ``vocab_size``. A failed parity check
exits with status 1 and writes nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mcore.config.fields import ConfigError
from mcore.data.config import TokenizerConfig
from mcore.hf.bert import is_bert_hf_config
from mcore.hf.config import ARCHITECTURES, family_of_hf_config, megatron_model_flags, model_config_from_hf
from mcore.hf.errors import ConversionError
from mcore.hf.mapping import hf_to_mcore
from mcore.hf.parity import DEFAULT_TOLERANCE, ParityReport, check_logit_parity
from mcore.hf.t5 import (
    T5,
    T5_ARCHITECTURE,
    check_t5_parity,
    is_t5_hf_config,
    t5_hf_to_mcore,
    t5_model_config_from_hf,
)
from mcore.hf.tokenizer import check_tokenizer_matches, import_hf_tokenizer, load_tokenizer
from mcore.models.transformer.model_config import ModelConfig, check_tensor_parallel, padded_vocab_size
from mcore.pipeline.layout import stage_layer_counts
from mcore.utils.console import configure_console

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TOKENIZER_SUBDIR = "tokenizer"


@dataclass
class ImportReport:
    """What :func:`import_from_hf` produced."""

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


def read_hf_config(hf_dir: str) -> dict:
    """``config.json`` of a Hugging Face model directory, or a :class:`ConversionError` saying why not."""
    if not os.path.isdir(hf_dir):
        raise ConversionError(f"{hf_dir}: not a directory")
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise ConversionError(f"{hf_dir}: not a Hugging Face model directory (no config.json)")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as err:
        raise ConversionError(f"{path}: cannot read: {err}") from None
    if not isinstance(config, dict):
        raise ConversionError(f"{path}: expected a JSON object")
    return config


def read_hf_weights(hf_dir: str) -> dict[str, torch.Tensor]:
    """The state dict in ``model.safetensors`` (or its sharded index), else ``pytorch_model.bin``."""
    from safetensors.torch import load_file

    single = os.path.join(hf_dir, "model.safetensors")
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(single):
        return load_file(single)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map", {})
        state: dict[str, torch.Tensor] = {}
        for name in sorted(set(weight_map.values())):
            path = os.path.join(hf_dir, name)
            if not os.path.isfile(path):
                raise ConversionError(f"{index} names {name}, which is missing")
            state.update(load_file(path))
        return state
    binary = os.path.join(hf_dir, "pytorch_model.bin")
    if os.path.isfile(binary):
        return torch.load(binary, map_location="cpu", weights_only=True)
    raise ConversionError(
        f"{hf_dir}: no weights (model.safetensors, model.safetensors.index.json or pytorch_model.bin)"
    )


def _check_layout(cfg: ModelConfig, tp: int, pp: int) -> None:
    try:
        check_tensor_parallel(cfg, tp)
        stage_layer_counts(cfg.num_layers, pp)
    except ConfigError as err:
        raise ConversionError(f"the model does not fit the target layout: {err}") from None


def import_from_hf(
    hf_dir: str,
    save_dir: str,
    *,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    make_vocab_size_divisible_by: int = 128,
    dtype: str | torch.dtype | None = None,
    use_tokenizer: bool = True,
    check_parity: bool = True,
    tolerance: float = DEFAULT_TOLERANCE,
) -> ImportReport:
    """Convert ``hf_dir`` into a model-only mcore checkpoint in ``save_dir`` (see the module docstring)."""
    from mcore import checkpoint

    hf = read_hf_config(hf_dir)
    if is_bert_hf_config(hf):  # MegatronBertForPreTraining / ForMaskedLM (BertForPreTraining is refused)
        from mcore.hf.bert_io import import_bert_from_hf

        return import_bert_from_hf(
            hf_dir,
            save_dir,
            hf,
            make_vocab_size_divisible_by=make_vocab_size_divisible_by,
            dtype=dtype,
            use_tokenizer=use_tokenizer,
            check_parity=check_parity,
            tolerance=tolerance,
            check_layout=lambda cfg: _check_layout(
                cfg, tensor_model_parallel_size, pipeline_model_parallel_size
            ),
        )
    where = os.path.join(hf_dir, "config.json")
    t5 = is_t5_hf_config(hf)  # T5ForConditionalGeneration (mcore.hf.t5) or a GPT family
    family = T5 if t5 else family_of_hf_config(hf, where)
    architecture = T5_ARCHITECTURE if t5 else ARCHITECTURES[family]
    config_from_hf = t5_model_config_from_hf if t5 else model_config_from_hf
    try:
        cfg = config_from_hf(hf, where, make_vocab_size_divisible_by=make_vocab_size_divisible_by)
    except (ConfigError, KeyError, TypeError) as err:
        raise ConversionError(f"{where}: not a valid {architecture} config: {err}") from None
    _check_layout(cfg, tensor_model_parallel_size, pipeline_model_parallel_size)
    vocab_size = check_import_target(hf, where, save_dir)
    staging = tokenizer_staging_dir(save_dir)
    try:
        tok_config = None
        if use_tokenizer:
            tok_config = import_hf_tokenizer(hf_dir, staging, family)
            if tok_config is None:
                logger.warning(f"warning: {hf_dir} has no tokenizer files; the checkpoint records none")
            else:
                check_tokenizer_matches(load_tokenizer(tok_config), vocab_size, hf_dir)

        hf_state = read_hf_weights(hf_dir)
        if isinstance(dtype, str):
            dtype = None if dtype == "auto" else DTYPES[dtype]
        padded = padded_vocab_size(vocab_size, make_vocab_size_divisible_by, tensor_model_parallel_size)
        word_key = {"gpt2": "transformer.wte.weight", T5: "shared.weight"}.get(
            family, "model.embed_tokens.weight"
        )
        if word_key in hf_state and hf_state[word_key].shape[0] != vocab_size:
            raise ConversionError(
                f"{hf_dir}: {word_key} has {hf_state[word_key].shape[0]} rows but vocab_size={vocab_size}"
            )
        state = (t5_hf_to_mcore if t5 else hf_to_mcore)(hf_state, cfg, padded)
        if dtype is not None:
            state = {k: v.to(dtype) for k, v in state.items()}
        report = ImportReport(os.path.abspath(save_dir), architecture, cfg, tok_config, vocab_size, padded)
        if check_parity:
            rounded = dtype if dtype not in (None, torch.float32) else None
            report.parity = (check_t5_parity if t5 else check_logit_parity)(
                cfg, state, vocab_size, hf_dir, tolerance=tolerance, round_to=rounded
            )

        # Commit: tokenizer files next to the checkpoint, then the checkpoint (tracker last).
        os.makedirs(save_dir, exist_ok=True)
        if tok_config is not None:
            final = os.path.join(os.path.abspath(save_dir), TOKENIZER_SUBDIR)
            shutil.move(staging, final)
            tok_config = _relocate(tok_config, staging, final)
            report.tokenizer_config = tok_config
        run_config = {
            "model": dataclasses.asdict(cfg),
            "tokenizer": dataclasses.asdict(tok_config)
            if tok_config is not None
            else {"tokenizer_type": "NullTokenizer", "vocab_size": vocab_size - 1},
            "parallel": {
                "tensor_model_parallel_size": tensor_model_parallel_size,
                "pipeline_model_parallel_size": pipeline_model_parallel_size,
            },
        }
        checkpoint.save_logical_model_checkpoint(
            save_dir,
            state,
            run_config,
            metadata={"tokenizer_vocab_size": vocab_size, "imported_from": os.path.abspath(hf_dir)},
        )
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    report.flags = import_flags(report)
    return report


def check_import_target(hf: Mapping[str, Any], where: str, save_dir: str) -> int:
    """The Hugging Face ``vocab_size`` (``where``: the config.json it came from), after checking that it
    is a positive integer and that ``save_dir`` is empty or absent (an import never overwrites)."""
    vocab_size = hf.get("vocab_size")
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise ConversionError(f"{where}: vocab_size={vocab_size!r} must be a positive integer")
    if os.path.isdir(save_dir) and os.listdir(save_dir):
        raise ConversionError(f"--save {save_dir}: the directory is not empty")
    return vocab_size


def tokenizer_staging_dir(save_dir: str) -> str:
    """A fresh directory beside ``save_dir`` for the tokenizer files, moved under it once the import
    succeeds (the caller removes what is left of it)."""
    parent = os.path.dirname(os.path.abspath(save_dir))
    os.makedirs(parent, exist_ok=True)
    return tempfile.mkdtemp(prefix=".tokenizer-", dir=parent)


def _relocate(config: TokenizerConfig, old: str, new: str) -> TokenizerConfig:
    def move(path: str | None) -> str | None:
        return None if path is None else os.path.join(new, os.path.relpath(path, old))

    return dataclasses.replace(
        config,
        vocab_file=move(config.vocab_file),
        merge_file=move(config.merge_file),
        tokenizer_model=move(config.tokenizer_model),
    )


def import_flags(report: ImportReport) -> list[str]:
    """Megatron flags for training the imported model: model, tokenizer and ``--load ... --finetune``."""
    flags = megatron_model_flags(report.model_config)
    tok = report.tokenizer_config
    if tok is None:
        flags += ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(report.vocab_size - 1)]
    elif tok.tokenizer_type == "GPT2BPETokenizer":
        flags += [
            "--tokenizer-type",
            "GPT2BPETokenizer",
            "--vocab-file",
            tok.vocab_file,
            "--merge-file",
            tok.merge_file,
        ]
    else:
        flags += ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tok.tokenizer_model]
    return [*flags, "--load", report.save_dir, "--finetune"]


_LAYOUT_FLAGS = ("--tensor-model-parallel-size", "--pipeline-model-parallel-size")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mcore.hf.importer",
        description="Import a local Hugging Face GPT-2, Llama or T5 v1.1 model as an mcore checkpoint, checking parity.",
    )
    parser.add_argument(
        "--hf-dir", required=True, help="Local Hugging Face model directory (nothing is downloaded)."
    )
    parser.add_argument("--save", required=True, help="mcore checkpoint directory to write.")
    for layout_flag in _LAYOUT_FLAGS:
        parser.add_argument(layout_flag, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    parser.add_argument(
        "--dtype", default="auto", choices=["auto", *DTYPES], help="Weights dtype (default: as stored)."
    )
    parser.add_argument(
        "--no-tokenizer", action="store_true", help="Import the weights without the tokenizer files."
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        default=DEFAULT_TOLERANCE,
        help="Largest logit difference, in fp32 (with --dtype bfloat16/float16 both sides use the rounded "
        "weights, so the same tolerance applies).",
    )
    parser.add_argument("--no-parity-check", action="store_true", help="Skip the logit-parity check.")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from mcore.hf.export import run_conversion

    configure_console()  # the library's lines (notes, checkpoint progress) on the console
    args = build_parser().parse_args(argv)
    given = [f for f in _LAYOUT_FLAGS if getattr(args, f[2:].replace("-", "_")) is not None]
    if given:
        print(
            f"error: {' and '.join(given)}: the imported checkpoint is layout-free (it loads at any "
            "tensor/pipeline-parallel size); give the sizes to the training run that loads it",
            file=sys.stderr,
        )
        return 2
    return run_conversion(
        lambda: import_from_hf(
            args.hf_dir,
            args.save,
            make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
            dtype=args.dtype,
            use_tokenizer=not args.no_tokenizer,
            check_parity=not args.no_parity_check,
            tolerance=args.tolerance,
        )
    )


if __name__ == "__main__":
    raise SystemExit(main())
