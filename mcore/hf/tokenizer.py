"""Tokenizer files between a run's ``--tokenizer-*`` settings and a Hugging Face model directory.

Export (:func:`write_hf_tokenizer`):

* ``GPT2BPETokenizer`` (``--vocab-file``/``--merge-file``): ``vocab.json`` and ``merges.txt`` are
  copied, ``tokenizer.json`` is written from the same BPE (so fast and slow HF tokenizers agree), and
  ``tokenizer_config.json`` names ``GPT2Tokenizer`` with ``<|endoftext|>`` as bos/eos/unk;
* ``HuggingFaceTokenizer`` (``--tokenizer-model``): ``tokenizer.json`` and, when present,
  ``tokenizer_config.json`` / ``special_tokens_map.json`` are copied;
* ``NullTokenizer``: no files (the model still exports; its ids are the tokens).

Import (:func:`import_hf_tokenizer`) copies a model directory's tokenizer files next to the
checkpoint and returns the matching :class:`~mcore.data.config.TokenizerConfig`; the vocabulary
size must equal the model's ``vocab_size``.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass

from mcore.data.config import TokenizerConfig
from mcore.data.errors import DataError
from mcore.data.tokenizers import EOD_TOKEN, Tokenizer, build_tokenizer
from mcore.hf.errors import ConversionError
from mcore.hf.staging import write_json

HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
GPT2_FILES = ("vocab.json", "merges.txt")


@dataclass(frozen=True)
class TokenizerInfo:
    """What the model config needs from a tokenizer."""

    vocab_size: int
    eos_token_id: int | None
    bos_token_id: int | None
    pad_token_id: int | None


def load_tokenizer(config: TokenizerConfig | None) -> Tokenizer | None:
    """The run's tokenizer, or None when it names none; unreadable files are a :class:`ConversionError`."""
    if config is None:
        return None
    try:
        return build_tokenizer(config)
    except (DataError, AssertionError) as err:
        raise ConversionError(
            f"cannot load the checkpoint's tokenizer ({config.tokenizer_type}): {err}; point to its files with "
            "--tokenizer-type and --vocab-file/--merge-file or --tokenizer-model, or give --vocab-size to export "
            "without one"
        ) from None


def tokenizer_info(tokenizer: Tokenizer | None, vocab_size: int | None = None) -> TokenizerInfo:
    """Vocabulary size and special ids; ``vocab_size`` overrides (and is needed without a tokenizer)."""
    if tokenizer is None:
        if vocab_size is None:
            raise ConversionError(
                "the checkpoint names no tokenizer, so its real vocabulary size is unknown: give --vocab-size, "
                "or --tokenizer-type with its files (--vocab-file/--merge-file or --tokenizer-model)"
            )
        return TokenizerInfo(vocab_size, None, None, None)
    size = vocab_size if vocab_size is not None else tokenizer.vocab_size
    if size < tokenizer.vocab_size:
        raise ConversionError(
            f"--vocab-size {size} is smaller than the tokenizer's vocabulary ({tokenizer.vocab_size})"
        )
    try:
        eos = tokenizer.eod
    except DataError:
        eos = None
    bos = getattr(tokenizer, "bos", None)
    return TokenizerInfo(size, eos, bos if bos is not None else eos, getattr(tokenizer, "pad", None))


def write_hf_tokenizer(tokenizer: Tokenizer | None, out_dir: str, model_max_length: int | None) -> list[str]:
    """Write the tokenizer files of ``tokenizer`` into ``out_dir``; return the names written."""
    from mcore.data.tokenizers import GPT2BPETokenizer, HuggingFaceTokenizer

    written: list[str] = []
    if isinstance(tokenizer, GPT2BPETokenizer):
        shutil.copyfile(tokenizer.vocab_file, os.path.join(out_dir, "vocab.json"))
        shutil.copyfile(tokenizer.merge_file, os.path.join(out_dir, "merges.txt"))
        tokenizer._tok.save(os.path.join(out_dir, "tokenizer.json"))
        config = {
            "tokenizer_class": "GPT2Tokenizer",
            "bos_token": EOD_TOKEN,
            "eos_token": EOD_TOKEN,
            "unk_token": EOD_TOKEN,
            "add_prefix_space": False,
            "add_bos_token": False,
            "model_max_length": model_max_length or 1024,
        }
        write_json(os.path.join(out_dir, "tokenizer_config.json"), config)
        written += [*GPT2_FILES, "tokenizer.json", "tokenizer_config.json"]
    elif isinstance(tokenizer, HuggingFaceTokenizer):
        folder = os.path.dirname(tokenizer.tokenizer_file)
        shutil.copyfile(tokenizer.tokenizer_file, os.path.join(out_dir, "tokenizer.json"))
        written.append("tokenizer.json")
        for name in HF_TOKENIZER_FILES[1:]:
            if os.path.isfile(os.path.join(folder, name)):
                shutil.copyfile(os.path.join(folder, name), os.path.join(out_dir, name))
                written.append(name)
        if "tokenizer_config.json" not in written:
            config = {"tokenizer_class": "PreTrainedTokenizerFast"}
            for key, token_id in (("eos_token", tokenizer._eos), ("bos_token", tokenizer.bos)):
                if token_id is not None:
                    config[key] = tokenizer._tok.id_to_token(token_id)
            if model_max_length:
                config["model_max_length"] = model_max_length
            write_json(os.path.join(out_dir, "tokenizer_config.json"), config)
            written.append("tokenizer_config.json")
    return written


def import_hf_tokenizer(hf_dir: str, dest_dir: str, family: str) -> TokenizerConfig | None:
    """Copy ``hf_dir``'s tokenizer into ``dest_dir``; return its config (None: the directory has none).

    A GPT-2 directory with ``vocab.json``/``merges.txt`` (and ``<|endoftext|>``) becomes Megatron's
    ``GPT2BPETokenizer``; otherwise ``tokenizer.json`` becomes ``HuggingFaceTokenizer``.
    """
    has = {name for name in (*GPT2_FILES, *HF_TOKENIZER_FILES) if os.path.isfile(os.path.join(hf_dir, name))}
    os.makedirs(dest_dir, exist_ok=True)
    if family == "gpt2" and set(GPT2_FILES) <= has:
        for name in GPT2_FILES:
            shutil.copyfile(os.path.join(hf_dir, name), os.path.join(dest_dir, name))
        try:
            with open(os.path.join(dest_dir, "vocab.json"), encoding="utf-8") as f:
                has_eod = EOD_TOKEN in json.load(f)
        except (OSError, ValueError) as err:
            raise ConversionError(f"{hf_dir}/vocab.json: cannot read: {err}") from None
        if has_eod:
            return TokenizerConfig(
                tokenizer_type="GPT2BPETokenizer",
                vocab_file=os.path.join(dest_dir, "vocab.json"),
                merge_file=os.path.join(dest_dir, "merges.txt"),
            )
    if "tokenizer.json" in has:
        for name in HF_TOKENIZER_FILES:
            if name in has:
                shutil.copyfile(os.path.join(hf_dir, name), os.path.join(dest_dir, name))
        return TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=dest_dir)
    return None


def check_tokenizer_matches(tokenizer: Tokenizer, vocab_size: int, where: str) -> None:
    """The tokenizer must have exactly the model's vocabulary (else ids and embedding rows disagree)."""
    if tokenizer.vocab_size != vocab_size:
        raise ConversionError(
            f"{where}: the tokenizer has {tokenizer.vocab_size} tokens but config.json says "
            f"vocab_size={vocab_size}; the tokenizer files do not belong to this model (use "
            "--no-tokenizer to import the weights alone)"
        )
