"""Import a local Hugging Face GPT-2, Llama, T5 or BERT directory as an mcore checkpoint, checked for parity.

Command::

    python -m mcore.hf.importer --hf-dir HF_DIR --save CKPT_DIR [--make-vocab-size-divisible-by 128]
        [--dtype auto|float32|bfloat16|float16] [--tolerance 1e-4] [--no-parity-check] [--no-tokenizer]

The result is a model-only checkpoint (:func:`mcore.checkpoint.save_logical_model_checkpoint`) that
``--load CKPT_DIR --finetune`` loads at any layout. It is layout-free, so the command takes no
``--tensor-model-parallel-size`` / ``--pipeline-model-parallel-size`` (they are refused with that
reason: give them to the training run that loads it). ``--dtype bfloat16|float16`` rounds the weights;
the parity check then rounds the Hugging Face weights the same way and keeps the fp32 tolerance
(:mod:`mcore.hf.parity`). The tokenizer files are copied to ``CKPT_DIR/tokenizer`` and recorded in the run
config, and the class in the checkpoint's metadata (``hf_architecture``: the export writes the same
class back). The command prints the Megatron flags that build the same model.

The family comes from the table of :mod:`mcore.hf.families`. Refused
(:class:`~mcore.hf.errors.ConversionError`, exit status 2): a directory without ``config.json`` or
weights, an architecture other than ``GPT2LMHeadModel``/``LlamaForCausalLM``/``MistralForCausalLM``/
``Qwen2ForCausalLM``/``Qwen3ForCausalLM``/``T5ForConditionalGeneration``/``MegatronBertForPreTraining``/``MegatronBertForMaskedLM``
(:mod:`mcore.hf.bert_io`; the post-LN ``BertForPreTraining`` is refused with the reason), settings
mcore cannot express (:func:`mcore.hf.gpt2.model_config_from_hf`,
:func:`mcore.hf.llama.model_config_from_hf`: RoPE scaling, a sliding window shorter than the positions,
...), a tokenizer whose size differs from ``vocab_size``,
embedding rows that differ from ``vocab_size``. A failed parity check exits with status 1 and writes
nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shutil
import sys
from collections.abc import Sequence

import torch

from mcore.config.fields import ConfigError
from mcore.data.config import TokenizerConfig
from mcore.data.vocab_identity import tokenizer_identity
from mcore.hf.errors import ConversionError
from mcore.hf.families import family_of_hf
from mcore.hf.family import HfFamily
from mcore.hf.megatron_flags import megatron_model_flags
from mcore.hf.parity import DEFAULT_TOLERANCE
from mcore.hf.reports import ImportReport
from mcore.hf.staging import (
    DTYPES,
    check_import_output,
    check_import_target,
    check_word_rows,
    import_dtype,
    move_tokenizer_files,
    read_hf_config,
    read_hf_weights,
    relocate_tokenizer,
    staged_import_dir,
    tokenizer_staging_dir,
)
from mcore.hf.tokenizer import check_tokenizer_matches, import_hf_tokenizer, load_tokenizer
from mcore.models.transformer.model_config import ModelConfig, check_tensor_parallel, padded_vocab_size
from mcore.pipeline.layout import stage_layer_counts
from mcore.utils.console import configure_console

logger = logging.getLogger(__name__)


def _check_layout(cfg: ModelConfig, tp: int, pp: int) -> None:
    try:
        # the shapes only: training an MoE model at TP > 1 then checks --sequence-parallel
        check_tensor_parallel(cfg, tp, training=False)
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
    mtp_num_layers: int | None = None,
) -> ImportReport:
    """Convert ``hf_dir`` into a model-only mcore checkpoint in ``save_dir`` (see the module docstring).
    ``mtp_num_layers``: import that many of a DeepSeek-V3 checkpoint's multi-token-prediction layers
    (``--mtp-num-layers``; docs/deepseek.md)."""
    tp, pp = tensor_model_parallel_size, pipeline_model_parallel_size
    check_import_output(hf_dir, save_dir)  # before anything is read
    hf = read_hf_config(hf_dir)
    where = os.path.join(hf_dir, "config.json")
    family = family_of_hf(hf, where)
    if mtp_num_layers and family.architecture != "DeepseekV3ForCausalLM":
        raise ConversionError(
            f"--mtp-num-layers {mtp_num_layers}: {family.architecture} checkpoints carry no multi-token-"
            "prediction layers (DeepseekV3ForCausalLM's do)"
        )
    if family.import_from_hf is not None:  # MegatronBert* (BertForPreTraining is refused)
        return family.import_from_hf(
            hf_dir,
            save_dir,
            hf,
            make_vocab_size_divisible_by=make_vocab_size_divisible_by,
            dtype=dtype,
            use_tokenizer=use_tokenizer,
            check_parity=check_parity,
            tolerance=tolerance,
            check_layout=lambda cfg: _check_layout(cfg, tp, pp),
        )
    try:
        mtp = {"mtp_num_layers": mtp_num_layers} if mtp_num_layers else {}
        cfg = family.model_config_from_hf(
            hf, where, make_vocab_size_divisible_by=make_vocab_size_divisible_by, **mtp
        )
    except (ConfigError, KeyError, TypeError) as err:
        raise ConversionError(f"{where}: not a valid {family.architecture} config: {err}") from None
    _check_layout(cfg, tp, pp)
    vocab_size = check_import_target(hf, where, save_dir)
    staging = tokenizer_staging_dir(save_dir)
    try:
        tok_config = _stage_tokenizer(hf_dir, staging, family, vocab_size) if use_tokenizer else None
        hf_state = read_hf_weights(hf_dir)
        dtype = import_dtype(dtype)
        padded = padded_vocab_size(vocab_size, make_vocab_size_divisible_by, tp)
        check_word_rows(hf_state, family.hf_word_key, vocab_size, hf_dir)
        state = family.hf_to_mcore(hf_state, cfg, padded)
        if dtype is not None:
            state = {k: v.to(dtype) for k, v in state.items()}
        report = ImportReport(
            os.path.abspath(save_dir), family.architecture, cfg, tok_config, vocab_size, padded
        )
        if check_parity:
            rounded = dtype if dtype not in (None, torch.float32) else None
            report.parity = family.check_parity(
                cfg, state, vocab_size, hf_dir, tolerance=tolerance, round_to=rounded
            )
        _save_checkpoint(report, state, save_dir, staging, hf_dir, tp, pp)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    report.flags = import_flags(report)
    return report


def _stage_tokenizer(hf_dir: str, staging: str, family: HfFamily, vocab_size: int) -> TokenizerConfig | None:
    """Copy ``hf_dir``'s tokenizer files into ``staging`` and check that its vocabulary is the model's."""
    tok_config = import_hf_tokenizer(hf_dir, staging, family.name)
    if tok_config is None:
        logger.warning(f"warning: {hf_dir} has no tokenizer files; the checkpoint records none")
    else:
        check_tokenizer_matches(load_tokenizer(tok_config), vocab_size, hf_dir)
    return tok_config


def _save_checkpoint(
    report: ImportReport, state, save_dir: str, staging: str, hf_dir: str, tp: int, pp: int
) -> None:
    """Commit: the tokenizer files next to the checkpoint, then the checkpoint (tracker last)."""
    from mcore import checkpoint

    cfg, vocab_size = report.model_config, report.vocab_size
    tok_config = report.tokenizer_config
    null = TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=vocab_size - 1)
    identity = tokenizer_identity(tok_config or null)  # the staged files' contents: compared on resume
    with staged_import_dir(save_dir) as out:  # the whole --save appears at once, or not at all
        if tok_config is not None:
            final = move_tokenizer_files(staging, out, save_dir)
            tok_config = relocate_tokenizer(tok_config, staging, final)
            report.tokenizer_config = tok_config
        run_config = {
            "model": dataclasses.asdict(cfg),
            "tokenizer": dataclasses.asdict(tok_config)
            if tok_config is not None
            else {"tokenizer_type": "NullTokenizer", "vocab_size": vocab_size - 1},
            "parallel": {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp},
        }
        checkpoint.save_logical_model_checkpoint(
            out,
            state,
            run_config,
            metadata={
                "tokenizer_vocab_size": vocab_size,
                "tokenizer_identity": identity,
                "imported_from": os.path.abspath(hf_dir),
                "hf_architecture": report.architecture,
            },
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
        description="Import a local Hugging Face GPT-2, Llama, Mistral, Qwen2/3, Mixtral, Qwen2/3-MoE, OLMoE, BERT or T5 model as an "
        "mcore checkpoint, checking parity.",
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
    parser.add_argument(
        "--mtp-num-layers",
        type=int,
        default=None,
        help="DeepseekV3ForCausalLM: import this many of the checkpoint's multi-token-prediction layers "
        "(model.layers.{num_hidden_layers}.* ...) as mcore's MTP (default: none, with a note).",
    )
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
            mtp_num_layers=args.mtp_num_layers,
        )
    )


if __name__ == "__main__":
    raise SystemExit(main())
