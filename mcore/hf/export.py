"""Export an mcore checkpoint (any TP/PP layout) to a Hugging Face model directory, checked for parity.

Command::

    python -m mcore.hf.export --load CKPT_DIR --save HF_DIR [--ckpt-step N] [--dtype auto|float32|bfloat16|float16]
        [--vocab-size V] [--tokenizer-type ... --vocab-file ... --merge-file ... | --tokenizer-model ...]
        [--tolerance 1e-4] [--no-parity-check] [--overwrite]

The directory gets ``config.json``, ``generation_config.json``, ``model.safetensors`` (or shards with
``model.safetensors.index.json``) and the tokenizer files of the run's tokenizer
(:mod:`mcore.hf.tokenizer`). The family comes from the table of :mod:`mcore.hf.families`: GPT-2-style
models become ``GPT2LMHeadModel`` (:mod:`mcore.hf.gpt2`), Llama-style models ``LlamaForCausalLM``
(:mod:`mcore.hf.llama`; each module lists what is refused), T5 models ``T5ForConditionalGeneration``
(:mod:`mcore.hf.t5`), BERT models ``MegatronBertForPreTraining`` (``MegatronBertForMaskedLM`` without
the binary head; :mod:`mcore.hf.bert`, :mod:`mcore.hf.bert_io`). The padded vocabulary is cut to the
tokenizer's size.

Everything is written to a temporary sibling directory (:mod:`mcore.hf.staging`); the logit-parity
check (:mod:`mcore.hf.parity`) loads it with ``transformers`` and compares with the mcore model, and
only a passing export is renamed into place. Exit status: 0 on success, 1 when parity fails, 2 for
input that cannot be converted.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from mcore.data.config import TokenizerConfig
from mcore.data.tokenizers import Tokenizer
from mcore.hf.errors import ConversionError, ParityError
from mcore.hf.families import FAMILIES, family_of_state
from mcore.hf.gpt_state import ARCHITECTURES, FAMILY_OF_ARCHITECTURE, hf_family
from mcore.hf.parity import DEFAULT_TOLERANCE
from mcore.hf.reports import ExportReport
from mcore.hf.staging import (
    DEFAULT_MAX_SHARD_BYTES,
    DTYPES,
    REPLACE_FOREIGN_FLAG,
    dtype_name,
    export_dtype,
    prepare_output,
    staged_output_dir,
    write_json,
    write_safetensors,
)
from mcore.hf.tokenizer import TokenizerInfo, load_tokenizer, tokenizer_info, write_hf_tokenizer
from mcore.inference.loading import (
    RunConfigLike,
    model_config_from_run_config,
    tokenizer_config_from_run_config,
)
from mcore.models.transformer.model_config import ModelConfig
from mcore.utils.console import configure_console

logger = logging.getLogger(__name__)


def export_to_hf(
    state: Mapping[str, torch.Tensor],
    run_config: RunConfigLike,
    output_dir: str,
    *,
    vocab_size: int | None = None,
    tokenizer_config: TokenizerConfig | None = None,
    fallback_vocab_size: int | None = None,
    dtype: str | torch.dtype | None = None,
    check_parity: bool = True,
    tolerance: float = DEFAULT_TOLERANCE,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
    architecture: str | None = None,
    replace_foreign: bool = False,
    mtp_num_layers: int | None = None,
) -> ExportReport:
    """Write the Hugging Face directory of a logical model state (see the module docstring).

    Args:
        state: logical name -> whole tensor (:func:`mcore.checkpoint.load_logical_model_state`).
        run_config: the run's configuration (RunConfig or ``{group: {field: value}}``); its
            ``model`` group gives the architecture, its ``tokenizer`` group the tokenizer.
        output_dir: the directory to create (it must be empty or absent unless ``overwrite``).
        vocab_size: the real vocabulary size, overriding the tokenizer's (needed without one).
        tokenizer_config: use this tokenizer instead of the run's (its files may have moved).
        fallback_vocab_size: the vocabulary size to use when the run's tokenizer cannot be loaded
            (the export then has no tokenizer files).
        dtype: weights dtype (default: the checkpoint's).
        check_parity: run the logit-parity check before the directory is put in place.
        tolerance: the largest allowed fp32 logit difference.
        architecture: the GPT-style class to write (``Qwen2ForCausalLM``, ``MistralForCausalLM``, ...;
            default: the one the model config implies, :func:`mcore.hf.gpt_state.hf_family`).
        overwrite: replace an earlier export of this tool in ``output_dir`` (it has the marker file).
        replace_foreign: replace a non-empty ``output_dir`` that is not an earlier export
            (``--overwrite-non-export``); never one that is, holds or lies inside the checkpoint.
        mtp_num_layers: write that many multi-token-prediction depths as DeepseekV3ForCausalLM's extra
            layers (``--mtp-num-layers``; default: none, as the class runs no MTP).
    """
    family = family_of_state(state)  # BERT or T5 by their tensors; else GPT-2 / Llama by the config
    if family is not None and family.export_to_hf is not None:  # BERT: its heads and WordPiece files
        return family.export_to_hf(
            state,
            run_config,
            output_dir,
            vocab_size=vocab_size,
            tokenizer_config=tokenizer_config,
            fallback_vocab_size=fallback_vocab_size,
            dtype=dtype,
            check_parity=check_parity,
            tolerance=tolerance,
            max_shard_bytes=max_shard_bytes,
            overwrite=overwrite,
            replace_foreign=replace_foreign,
        )
    cfg = model_config_from_run_config(run_config)
    family = family or FAMILIES[hf_family(cfg, architecture)]
    family.check_exportable(cfg)
    export_cfg = _mtp_export_config(family, cfg, mtp_num_layers)
    prepare_output(output_dir, overwrite, replace_foreign=replace_foreign)
    tokenizer, info = _export_tokenizer(run_config, tokenizer_config, vocab_size, fallback_vocab_size)
    dtype = export_dtype(dtype, state)
    tensors = {k: v.to(dtype) for k, v in family.mcore_to_hf(state, export_cfg, info.vocab_size).items()}
    config = family.hf_config_dict(
        export_cfg,
        info.vocab_size,
        bos_token_id=info.bos_token_id,
        eos_token_id=info.eos_token_id,
        pad_token_id=info.pad_token_id,
        dtype=dtype_name(dtype),
    )
    output_dir = os.path.abspath(output_dir)
    with staged_output_dir(output_dir) as staging:
        write_json(os.path.join(staging, "config.json"), config)
        write_json(os.path.join(staging, "generation_config.json"), generation_config(config, cfg))
        files = ["config.json", "generation_config.json"]
        files += write_safetensors(tensors, staging, max_shard_bytes)
        files += write_hf_tokenizer(tokenizer, staging, cfg.max_position_embeddings)
        report = ExportReport(output_dir, family.architecture, info.vocab_size, dtype_name(dtype), files)
        if check_parity:
            # The same (possibly rounded) weights on both sides, computed in fp32.
            rounded = {k: v.to(dtype) for k, v in state.items()}
            report.parity = family.check_parity(cfg, rounded, info.vocab_size, staging, tolerance=tolerance)
    return report


def _export_tokenizer(
    run_config: RunConfigLike,
    tokenizer_config: TokenizerConfig | None,
    vocab_size: int | None,
    fallback_vocab_size: int | None,
) -> tuple[Tokenizer | None, TokenizerInfo]:
    """The run's tokenizer (or ``tokenizer_config``'s) and its vocabulary and special ids; None when it
    cannot be loaded and a vocabulary size is given (the export then has no tokenizer files)."""
    try:
        tokenizer = load_tokenizer(tokenizer_config or tokenizer_config_from_run_config(run_config))
    except ConversionError as err:
        if vocab_size is None and fallback_vocab_size is None:
            raise
        logger.warning(f"warning: {err}; exporting without tokenizer files")
        tokenizer, vocab_size = None, vocab_size or fallback_vocab_size
    return tokenizer, tokenizer_info(tokenizer, vocab_size)


def generation_config(config: Mapping[str, Any], cfg: ModelConfig) -> dict[str, Any]:
    """``generation_config.json``: the config's special token ids and a generation length the model can
    hold (without one, transformers' text-generation pipeline asks for 256 new tokens and a learned
    position table shorter than that fails with an IndexError)."""
    token_keys = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")
    generation = {k: config[k] for k in token_keys if config.get(k) is not None}
    max_length = cfg.max_position_embeddings or cfg.seq_length
    if max_length is not None:
        generation["max_length"] = max_length
    return generation


def _mtp_export_config(family, cfg: ModelConfig, depths: int | None) -> ModelConfig:
    """The config the DeepSeek mappings write: ``depths`` MTP layers (``--mtp-num-layers``) or none."""
    if depths and family.architecture != "DeepseekV3ForCausalLM":
        raise ConversionError(
            f"--mtp-num-layers {depths}: {family.architecture} has no multi-token-prediction layers "
            "(DeepseekV3ForCausalLM carries them)"
        )
    if depths and depths > (cfg.mtp_num_layers or 0):
        raise ConversionError(
            f"--mtp-num-layers {depths}: the checkpoint has mtp_num_layers={cfg.mtp_num_layers}"
        )
    if not family.architecture.startswith("Deepseek"):
        return cfg
    return dataclasses.replace(cfg, mtp_num_layers=depths or None)


def export_checkpoint(
    load_dir: str, output_dir: str, *, iteration: int | None = None, **kwargs
) -> ExportReport:
    """:func:`export_to_hf` of the checkpoint in ``load_dir`` (latest iteration, or ``iteration``)."""
    from mcore import checkpoint

    # Before anything is read: never into or around the checkpoint, never over a foreign directory.
    prepare_output(
        output_dir,
        kwargs.get("overwrite", False),
        replace_foreign=kwargs.get("replace_foreign", False),
        load_dir=load_dir,
    )
    if not hasattr(checkpoint, "load_logical_model_state"):
        raise ConversionError(
            "this mcore has no checkpoint reader (mcore.checkpoint.load_logical_model_state)"
        )
    state, metadata = checkpoint.load_logical_model_state(load_dir, iteration)
    run_config = (metadata or {}).get("run_config")
    if not run_config:
        raise ConversionError(
            f"{load_dir}: the checkpoint records no run configuration; cannot tell the model"
        )
    extra = (metadata or {}).get("extra") or {}
    saved_vocab = extra.get("tokenizer_vocab_size") or ((metadata or {}).get("megatron") or {}).get(
        "vocab_size"
    )  # a Megatron checkpoint's args
    if kwargs.get("architecture") is None and extra.get("hf_architecture") in FAMILY_OF_ARCHITECTURE:
        # An imported model goes back to its own class (Qwen2, Mistral: subsets of what Llama holds).
        kwargs["architecture"] = extra["hf_architecture"]
    if kwargs.get("vocab_size") is None and kwargs.get("tokenizer_config") is None and saved_vocab:
        # The run's tokenizer decides; the recorded size lets the export go on if its files moved.
        kwargs["fallback_vocab_size"] = int(saved_vocab)
    return export_to_hf(state, run_config, output_dir, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mcore.hf.export",
        description="Export an mcore checkpoint to a Hugging Face model directory (GPT-2, Llama, Mistral, "
        "Qwen2/3, Mixtral, Qwen2/3-MoE, OLMoE, BERT or T5 v1.1), "
        "checking logit parity.",
    )
    parser.add_argument(
        "--load", required=True, help="mcore checkpoint directory (saved at any TP/PP layout)."
    )
    parser.add_argument(
        "--ckpt-step", type=int, default=None, help="Iteration to export (default: the latest)."
    )
    parser.add_argument("--save", required=True, help="Hugging Face directory to write.")
    parser.add_argument("--dtype", default="auto", choices=["auto", *DTYPES], help="Weights dtype.")
    parser.add_argument(
        "--vocab-size", type=int, default=None, help="Real vocabulary size (default: the tokenizer's)."
    )
    tok = parser.add_argument_group("tokenizer (default: the one the run was trained with)")
    tok.add_argument(
        "--tokenizer-type",
        default=None,
        choices=[
            "GPT2BPETokenizer",
            "HuggingFaceTokenizer",
            "NullTokenizer",
            "BertWordPieceLowerCase",
            "BertWordPieceCase",
        ],
    )
    tok.add_argument("--vocab-file", default=None)
    tok.add_argument("--merge-file", default=None)
    tok.add_argument("--tokenizer-model", default=None)
    tok.add_argument("--tokenizer-vocab-size", type=int, default=None, help="NullTokenizer's --vocab-size.")
    parser.add_argument(
        "--tolerance", type=float, default=DEFAULT_TOLERANCE, help="Largest fp32 logit difference."
    )
    parser.add_argument("--no-parity-check", action="store_true", help="Skip the logit-parity check.")
    parser.add_argument(
        "--overwrite", action="store_true", help="Replace an earlier export of this tool in --save."
    )
    parser.add_argument(
        REPLACE_FOREIGN_FLAG,
        action="store_true",
        help="Replace a non-empty --save that is not an earlier export (never the --load checkpoint).",
    )
    parser.add_argument(
        "--architecture",
        default=None,
        choices=list(ARCHITECTURES.values()),
        help="The class to write (default: the one the checkpoint was imported from, else GPT2LMHeadModel "
        "for learned positions, Qwen3ForCausalLM for RoPE with --qk-layernorm, LlamaForCausalLM for RoPE).",
    )
    parser.add_argument(
        "--mtp-num-layers",
        type=int,
        default=None,
        help="DeepseekV3ForCausalLM: write this many of the model's multi-token-prediction depths as the "
        "Hub's extra layers model.layers.{num_hidden_layers + k}.* (default: none).",
    )
    return parser


def tokenizer_config_from_args(args: argparse.Namespace) -> TokenizerConfig | None:
    if args.tokenizer_type is None:
        return None
    from mcore.config.fields import ConfigError

    try:
        return TokenizerConfig(
            tokenizer_type=args.tokenizer_type,
            vocab_file=args.vocab_file,
            merge_file=args.merge_file,
            tokenizer_model=args.tokenizer_model,
            vocab_size=args.tokenizer_vocab_size,
        )
    except ConfigError as err:
        raise ConversionError(str(err)) from None


def checkpoint_errors() -> tuple[type[BaseException], ...]:
    """The checkpoint reader's error class (missing files, bad metadata), when it is installed."""
    try:
        from mcore.checkpoint.format import CheckpointError
    except ImportError:
        return ()
    return (CheckpointError,)


def run_conversion(convert: Callable[[], Any]) -> int:
    """Run a conversion for a command line (``mcore-export-hf``, ``mcore-import-hf``): print its
    report and return 0, or print one error line and return 1 (the logit-parity check failed) or 2
    (bad input: the checkpoint, the flags, the files)."""
    try:
        report = convert()
    except ParityError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except (ConversionError, OSError, *checkpoint_errors()) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(report.describe())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    configure_console()  # the library's lines (notes, checkpoint progress) on the console
    args = build_parser().parse_args(argv)
    return run_conversion(
        lambda: export_checkpoint(
            args.load,
            args.save,
            iteration=args.ckpt_step,
            vocab_size=args.vocab_size,
            tokenizer_config=tokenizer_config_from_args(args),
            dtype=args.dtype,
            check_parity=not args.no_parity_check,
            tolerance=args.tolerance,
            overwrite=args.overwrite,
            architecture=args.architecture,
            replace_foreign=args.overwrite_non_export,
            mtp_num_layers=args.mtp_num_layers,
        )
    )


if __name__ == "__main__":
    raise SystemExit(main())
