"""BERT through ``mcore-export-hf`` / ``mcore-import-hf``: directories, tokenizer files, logit parity.

:func:`mcore.hf.export.export_to_hf` hands a BERT checkpoint (recognized by its tensors,
:func:`mcore.hf.bert.is_bert_state`) to :func:`export_bert_to_hf`, and
:func:`mcore.hf.importer.import_from_hf` a BERT ``config.json`` to :func:`import_bert_from_hf`, as
:data:`FAMILY` in the table of :mod:`mcore.hf.families` says; both use the shared staging
(:mod:`mcore.hf.staging`) and keep the GPT path's guarantees (staging directory renamed into place only after the parity check,
one :class:`~mcore.hf.errors.ConversionError` naming what cannot be converted).

Parity (:func:`check_bert_parity`): both sides in fp32, eval mode, on a fixed ``2 x 24`` batch whose
second sample ends in 5 padding tokens and (with token types) whose second half is segment B;
compared: the MLM logits at every position (cut to the real vocabulary) and, with the binary head,
the 2-way NSP/SOP logits, with Hugging Face's ``eager`` attention (``MegatronBert*`` has no other).
Tolerance 1e-4.

Tokenizer files: Megatron's ``BertWordPieceLowerCase`` / ``BertWordPieceCase`` (``--vocab-file
vocab.txt``) become ``vocab.txt`` + ``tokenizer_config.json`` naming ``BertTokenizer`` with
``do_lower_case`` and BERT's special tokens, so ``AutoTokenizer`` and ``pipeline("fill-mask")`` work
on the export. The written ``vocab.txt`` is Megatron's vocabulary: the tokens Megatron's
``_BertWordPieceTokenizer`` appends when absent (``[BOS]``, ``[EOS]``, the ``--vocab-extra-ids N``
``<extra_id_*>``) are appended with the same ids, so the model's rows and the tokenizer agree. Import
maps a ``vocab.txt`` back to the WordPiece type (Megatron's tokenizer then appends ``[BOS]``/``[EOS]``
if the file lacks them: ids past the model's vocabulary, which BERT's data never uses).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mcore.checkpoint.run_configs import (
    model_config_from_run_config,
    run_config_groups,
    tokenizer_config_from_run_config,
)
from mcore.config.fields import ConfigError
from mcore.data.tokenizers import Tokenizer
from mcore.distributed.groups import ProcessGroups
from mcore.hf.bert import (
    MASKED_LM,
    BertHeads,
    bert_config_from_hf,
    bert_hf_config_dict,
    bert_hf_to_mcore,
    bert_mcore_to_hf,
    check_bert_exportable,
    is_bert_hf_config,
    is_bert_state,
)
from mcore.hf.errors import ConversionError, ParityError
from mcore.hf.family import HfFamily
from mcore.hf.megatron_flags import megatron_model_flags
from mcore.hf.parity import DEFAULT_TOLERANCE, ParityReport, load_hf_model, parity_tokens
from mcore.hf.reports import ExportReport, ImportReport
from mcore.hf.staging import (
    DEFAULT_MAX_SHARD_BYTES,
    check_import_target,
    check_word_rows,
    dtype_name,
    export_dtype,
    import_dtype,
    move_tokenizer_files,
    prepare_output,
    read_hf_weights,
    staged_import_dir,
    staged_output_dir,
    tokenizer_staging_dir,
    write_json,
    write_safetensors,
)
from mcore.hf.tokenizer import load_tokenizer, tokenizer_info, write_hf_tokenizer
from mcore.models.transformer.model_config import ModelConfig, padded_vocab_size

logger = logging.getLogger(__name__)

WORDPIECE_TYPES = {"BertWordPieceLowerCase": True, "BertWordPieceCase": False}
"""Megatron's BERT tokenizer types and whether they lower-case."""
SPECIAL_TOKENS = {
    "unk_token": "[UNK]",
    "sep_token": "[SEP]",
    "pad_token": "[PAD]",
    "cls_token": "[CLS]",
    "mask_token": "[MASK]",
}
PAD_TAIL = 5
"""Padding tokens at the end of the parity batch's second sample."""


# -- tokenizer files --------------------------------------------------------------------------------


@dataclass(frozen=True)
class WordPieceFiles:
    """A BERT WordPiece tokenizer as the run config records it (``--tokenizer-type``, ``--vocab-file``)."""

    tokenizer_type: str
    vocab_file: str
    vocab_extra_ids: int = 0

    @property
    def lower_case(self) -> bool:
        return WORDPIECE_TYPES[self.tokenizer_type]

    def vocab_lines(self) -> list[str]:
        """The ``vocab.txt`` tokens in id order."""
        try:
            with open(self.vocab_file, encoding="utf-8") as f:
                return [line.rstrip("\n") for line in f]
        except OSError as err:
            raise ConversionError(
                f"--vocab-file {self.vocab_file}: cannot read the run's BERT vocabulary ({err}); point to it "
                "with --tokenizer-type and --vocab-file, or give --vocab-size to export without one"
            ) from None

    def tokens(self) -> list[str]:
        """Megatron's vocabulary in id order (``_BertWordPieceTokenizer``): the ``vocab.txt`` lines, then
        ``[BOS]`` and ``[EOS]`` and ``<extra_id_0..N-1>``, each appended only when absent."""
        tokens = self.vocab_lines()
        present = set(tokens)
        for token in ("[BOS]", "[EOS]", *(f"<extra_id_{i}>" for i in range(self.vocab_extra_ids))):
            if token not in present:
                tokens.append(token)
                present.add(token)
        return tokens


def wordpiece_files(tokenizer: Any) -> WordPieceFiles | None:
    """The WordPiece settings of a tokenizer config (a TokenizerConfig or its dict), else None."""
    if tokenizer is None:
        return None
    get = tokenizer.get if isinstance(tokenizer, Mapping) else lambda k, d=None: getattr(tokenizer, k, d)
    kind = get("tokenizer_type")
    if kind not in WORDPIECE_TYPES:
        return None
    if not get("vocab_file"):
        raise ConversionError(f"--tokenizer-type {kind} needs --vocab-file (the WordPiece vocab.txt)")
    return WordPieceFiles(kind, get("vocab_file"), int(get("vocab_extra_ids", 0) or 0))


def write_wordpiece_tokenizer(files: WordPieceFiles, out_dir: str, model_max_length: int | None) -> list[str]:
    """``vocab.txt`` and the ``BertTokenizer`` ``tokenizer_config.json`` in ``out_dir``."""
    tokens = files.tokens()
    missing = [t for t in SPECIAL_TOKENS.values() if t not in tokens]
    if missing:
        raise ConversionError(f"{files.vocab_file}: the BERT vocabulary lacks {', '.join(missing)}")
    with open(os.path.join(out_dir, "vocab.txt"), "w", encoding="utf-8") as f:
        f.writelines(token + "\n" for token in tokens)
    config: dict[str, Any] = {
        "tokenizer_class": "BertTokenizer",
        "do_lower_case": files.lower_case,
        "tokenize_chinese_chars": True,
        "strip_accents": None,
        "model_max_length": model_max_length or 512,
        **SPECIAL_TOKENS,
    }
    config["bos_token"], config["eos_token"] = "[BOS]", "[EOS]"
    if files.vocab_extra_ids:
        config["additional_special_tokens"] = [f"<extra_id_{i}>" for i in range(files.vocab_extra_ids)]
    write_json(os.path.join(out_dir, "tokenizer_config.json"), config)
    return ["vocab.txt", "tokenizer_config.json"]


def import_wordpiece_tokenizer(hf_dir: str, dest_dir: str) -> WordPieceFiles | None:
    """Copy ``hf_dir/vocab.txt`` into ``dest_dir``; None when the directory has none."""
    source = os.path.join(hf_dir, "vocab.txt")
    if not os.path.isfile(source):
        return None
    lower = True  # BertTokenizer's default
    config_path = os.path.join(hf_dir, "tokenizer_config.json")
    if os.path.isfile(config_path):
        try:
            with open(config_path, encoding="utf-8") as f:
                lower = bool(json.load(f).get("do_lower_case", True))
        except (OSError, ValueError) as err:
            raise ConversionError(f"{config_path}: cannot read: {err}") from None
    os.makedirs(dest_dir, exist_ok=True)
    shutil.copyfile(source, os.path.join(dest_dir, "vocab.txt"))
    kind = "BertWordPieceLowerCase" if lower else "BertWordPieceCase"
    return WordPieceFiles(kind, os.path.join(dest_dir, "vocab.txt"))


# -- parity ---------------------------------------------------------------------------------------------


def parity_batch(vocab_size: int, max_positions: int, heads: BertHeads) -> dict[str, torch.Tensor]:
    """The fixed parity batch: ids, padding mask (sample 1 ends in padding) and token types."""
    ids = parity_tokens(vocab_size, max_positions)
    b, s = ids.shape
    padding = torch.ones(b, s, dtype=torch.long)
    padding[1, max(1, s - PAD_TAIL) :] = 0
    types = None
    if heads.num_tokentypes >= 2:
        types = torch.zeros(b, s, dtype=torch.long)
        types[:, s // 2 :] = 1
    return {"input_ids": ids, "attention_mask": padding, "token_type_ids": types}


@torch.no_grad()
def mcore_bert_logits(
    cfg: ModelConfig, heads: BertHeads, state: Mapping[str, torch.Tensor], vocab_size: int, batch
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 ``(MLM logits [b, s, V], binary logits [b, 2] or None)`` of the mcore BERT (TP=1, CPU)."""
    from mcore.inference.loading import load_logical_state
    from mcore.models.bert.bert_model import BertModel

    padded = padded_vocab_size(vocab_size, cfg.make_vocab_size_divisible_by, 1)
    model = BertModel(
        cfg,
        ProcessGroups.single(),
        padded,
        add_binary_head=heads.add_binary_head,
        num_tokentypes=heads.num_tokentypes,
        device=torch.device("cpu"),
    )
    load_logical_state(model, {k: v.float() for k, v in state.items()}, vocab_size)
    model.eval()
    logits, binary = model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
    return logits[..., :vocab_size].float(), None if binary is None else binary.float()


@torch.no_grad()
def hf_bert_logits(
    hf_dir: str, heads: BertHeads, batch, attn_implementation: str, round_to: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 ``(MLM logits, binary logits or None)`` of the ``MegatronBert*`` model in ``hf_dir``."""
    auto = "AutoModelForPreTraining" if heads.add_binary_head else "AutoModelForMaskedLM"
    model = load_hf_model(auto, hf_dir, round_to=round_to, attn_implementation=attn_implementation)
    out = model(**batch)
    if heads.add_binary_head:
        return out.prediction_logits.float(), out.seq_relationship_logits.float()
    return out.logits.float(), None


def check_bert_parity(
    cfg: ModelConfig,
    heads: BertHeads,
    state: Mapping[str, torch.Tensor],
    vocab_size: int,
    hf_dir: str,
    *,
    tolerance: float = DEFAULT_TOLERANCE,
    attn_implementations: Sequence[str] = ("eager",),  # MegatronBert has no sdpa path (transformers 5)
    round_to: torch.dtype | None = None,
    raise_on_failure: bool = True,
) -> ParityReport:
    """MLM (and NSP/SOP) logits of the mcore BERT and of ``hf_dir`` on the same batch (module docstring).

    Raises:
        ParityError: the largest difference exceeds ``tolerance`` or an MLM argmax differs.
    """
    batch = parity_batch(vocab_size, cfg.max_position_embeddings, heads)
    ours, our_binary = mcore_bert_logits(cfg, heads, state, vocab_size, batch)
    report = ParityReport(0.0, tolerance=tolerance, batch_shape=tuple(batch["input_ids"].shape))
    if round_to is not None:
        report.weights_dtype = str(round_to).removeprefix("torch.")
    for impl in attn_implementations:
        theirs, their_binary = hf_bert_logits(hf_dir, heads, batch, impl, round_to)
        if theirs.shape != ours.shape:
            raise ConversionError(
                f"{hf_dir}: Hugging Face MLM logits have shape {tuple(theirs.shape)}, mcore {tuple(ours.shape)}"
            )
        diffs = {f"{impl} mlm": float((theirs - ours).abs().max())}
        if our_binary is not None:
            diffs[f"{impl} nsp"] = float((their_binary - our_binary).abs().max())
        report.per_implementation.update(diffs)
        report.max_abs_diff = max(report.max_abs_diff, *diffs.values())
        chosen = ours.gather(-1, theirs.argmax(-1, keepdim=True)).squeeze(-1)
        report.argmax_equal &= bool(((ours.max(-1).values - chosen) <= tolerance).all())
    if raise_on_failure and not report.ok:
        raise ParityError("parity check FAILED: " + report.describe())
    return report


# -- export ----------------------------------------------------------------------------------------------


def export_bert_to_hf(
    state: Mapping[str, torch.Tensor],
    run_config,
    output_dir: str,
    *,
    vocab_size: int | None = None,
    tokenizer_config=None,
    fallback_vocab_size: int | None = None,
    dtype: str | torch.dtype | None = None,
    check_parity: bool = True,
    tolerance: float = DEFAULT_TOLERANCE,
    max_shard_bytes: int | None = None,
    overwrite: bool = False,
    replace_foreign: bool = False,
) -> ExportReport:
    """:func:`mcore.hf.export.export_to_hf` for a BERT checkpoint (same arguments and report)."""
    cfg = model_config_from_run_config(run_config)
    check_bert_exportable(cfg)
    prepare_output(output_dir, overwrite, replace_foreign=replace_foreign)
    files, generic_tokenizer, size = _export_tokenizer(
        run_config, tokenizer_config, vocab_size, fallback_vocab_size
    )
    vocab_size = vocab_size or size or fallback_vocab_size
    if vocab_size is None:
        raise ConversionError("the real vocabulary size is unknown: give --vocab-size")
    if size is not None and vocab_size < size:
        raise ConversionError(
            f"--vocab-size {vocab_size} is smaller than the tokenizer's vocabulary ({size})"
        )
    pad_id = None
    if files is not None:
        pad_id = files.tokens().index(SPECIAL_TOKENS["pad_token"]) if "[PAD]" in files.tokens() else None
    dtype = export_dtype(dtype, state)
    hf_state, heads = bert_mcore_to_hf(state, cfg, vocab_size)
    tensors = {k: v.to(dtype) for k, v in hf_state.items()}
    config = bert_hf_config_dict(cfg, vocab_size, heads, pad_token_id=pad_id, dtype=dtype_name(dtype))

    output_dir = os.path.abspath(output_dir)
    with staged_output_dir(output_dir) as staging:
        write_json(os.path.join(staging, "config.json"), config)
        written = ["config.json"]
        written += write_safetensors(tensors, staging, max_shard_bytes or DEFAULT_MAX_SHARD_BYTES)
        if files is not None:
            written += write_wordpiece_tokenizer(files, staging, cfg.max_position_embeddings)
        elif generic_tokenizer is not None:
            written += write_hf_tokenizer(generic_tokenizer, staging, cfg.max_position_embeddings)
        report = ExportReport(output_dir, heads.architecture, vocab_size, dtype_name(dtype), written)
        if check_parity:
            rounded = {k: v.to(dtype) for k, v in state.items()}
            report.parity = check_bert_parity(cfg, heads, rounded, vocab_size, staging, tolerance=tolerance)
    return report


def _export_tokenizer(
    run_config, tokenizer_config, vocab_size: int | None, fallback_vocab_size: int | None
) -> tuple[WordPieceFiles | None, Tokenizer | None, int | None]:
    """``(WordPiece files, another tokenizer, its vocabulary size)`` of the run (or of
    ``tokenizer_config``): the WordPiece files for Megatron's BERT tokenizers, else the GPT path's
    tokenizer (HuggingFaceTokenizer, NullTokenizer, none). Unreadable files are an error unless a
    vocabulary size is given (the export then has no tokenizer files)."""
    files = wordpiece_files(tokenizer_config or run_config_groups(run_config).get("tokenizer"))
    if files is not None:
        try:
            return files, None, len(files.tokens())
        except ConversionError as err:
            if vocab_size is None and fallback_vocab_size is None:
                raise
            logger.warning(f"warning: {err}; exporting without tokenizer files")
            return None, None, None
    generic_tokenizer = None
    try:
        generic_tokenizer = load_tokenizer(tokenizer_config or tokenizer_config_from_run_config(run_config))
    except ConversionError:
        if vocab_size is None and fallback_vocab_size is None:
            raise
    size = tokenizer_info(generic_tokenizer, vocab_size or fallback_vocab_size).vocab_size
    return None, generic_tokenizer, size


# -- import ----------------------------------------------------------------------------------------------


def import_bert_from_hf(
    hf_dir: str,
    save_dir: str,
    hf: Mapping[str, Any],
    *,
    make_vocab_size_divisible_by: int = 128,
    dtype: str | torch.dtype | None = None,
    use_tokenizer: bool = True,
    check_parity: bool = True,
    tolerance: float = DEFAULT_TOLERANCE,
    check_layout=None,
) -> ImportReport:
    """:func:`mcore.hf.importer.import_from_hf` for a ``MegatronBert*`` directory (same report)."""
    where = os.path.join(hf_dir, "config.json")
    try:
        cfg, heads = bert_config_from_hf(hf, where, make_vocab_size_divisible_by=make_vocab_size_divisible_by)
    except (ConfigError, KeyError, TypeError) as err:
        raise ConversionError(f"{where}: not a valid MegatronBert config: {err}") from None
    if check_layout is not None:
        check_layout(cfg)
    vocab_size = check_import_target(hf, where, save_dir)
    staging = tokenizer_staging_dir(save_dir)
    try:
        files = _stage_wordpiece(hf_dir, staging, vocab_size) if use_tokenizer else None
        hf_state = read_hf_weights(hf_dir)
        check_word_rows(hf_state, "bert.embeddings.word_embeddings.weight", vocab_size, hf_dir)
        dtype = import_dtype(dtype)
        padded = padded_vocab_size(vocab_size, make_vocab_size_divisible_by, 1)
        state = bert_hf_to_mcore(hf_state, cfg, heads, padded)
        if dtype is not None:
            state = {k: v.to(dtype) for k, v in state.items()}
        report = ImportReport(os.path.abspath(save_dir), heads.architecture, cfg, None, vocab_size, padded)
        if check_parity:
            rounded = dtype if dtype not in (None, torch.float32) else None
            report.parity = check_bert_parity(
                cfg, heads, state, vocab_size, hf_dir, tolerance=tolerance, round_to=rounded
            )
        files = _save_bert_checkpoint(save_dir, staging, state, cfg, heads, files, vocab_size, hf_dir)
        report.tokenizer_config = files
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    report.flags = _import_flags(cfg, heads, files, vocab_size, report.save_dir)
    return report


def _stage_wordpiece(hf_dir: str, staging: str, vocab_size: int) -> WordPieceFiles | None:
    """``hf_dir``'s ``vocab.txt`` copied into ``staging`` (None: it has none), checked against the model."""
    files = import_wordpiece_tokenizer(hf_dir, staging)
    if files is None:
        logger.warning(f"warning: {hf_dir} has no vocab.txt; the checkpoint records no tokenizer")
    elif len(files.vocab_lines()) > vocab_size:
        raise ConversionError(
            f"{hf_dir}: vocab.txt has {len(files.vocab_lines())} tokens but config.json says vocab_size="
            f"{vocab_size}; the tokenizer does not belong to this model (use --no-tokenizer)"
        )
    return files


def _save_bert_checkpoint(
    save_dir: str,
    staging: str,
    state: Mapping[str, torch.Tensor],
    cfg: ModelConfig,
    heads: BertHeads,
    files: WordPieceFiles | None,
    vocab_size: int,
    hf_dir: str,
) -> WordPieceFiles | None:
    """Commit: the ``vocab.txt`` next to the checkpoint, then the checkpoint; return the moved files."""
    from mcore import checkpoint

    tokenizer_group: dict[str, Any] = {"tokenizer_type": "NullTokenizer", "vocab_size": vocab_size - 1}
    tokens = len(files.tokens()) if files is not None else vocab_size  # read while the files are staged
    with staged_import_dir(save_dir) as out:  # the whole --save appears at once, or not at all
        if files is not None:
            final = move_tokenizer_files(staging, out, save_dir)
            files = dataclasses.replace(files, vocab_file=os.path.join(final, "vocab.txt"))
            tokenizer_group = {"tokenizer_type": files.tokenizer_type, "vocab_file": files.vocab_file}
        run_config = {
            "model": dataclasses.asdict(cfg),
            "tokenizer": tokenizer_group,
            "parallel": {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1},
        }
        checkpoint.save_logical_model_checkpoint(
            out,
            state,
            run_config,
            metadata={
                "tokenizer_vocab_size": tokens,
                "bert_binary_head": heads.add_binary_head,
                "imported_from": os.path.abspath(hf_dir),
            },
        )
    return files


def _import_flags(
    cfg: ModelConfig, heads: BertHeads, files: WordPieceFiles | None, vocab_size: int, save_dir: str
) -> list[str]:
    """Megatron flags for training the imported BERT: model, heads, tokenizer, ``--load ... --finetune``."""
    flags = megatron_model_flags(cfg)
    if heads.architecture == MASKED_LM and "--bert-no-binary-head" not in flags:
        flags.append("--bert-no-binary-head")
    if files is not None:
        flags += ["--tokenizer-type", files.tokenizer_type, "--vocab-file", files.vocab_file]
    else:
        flags += ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab_size - 1)]
    return [*flags, "--load", save_dir, "--finetune"]


FAMILY = HfFamily(
    name="bert",
    is_state=is_bert_state,
    is_hf_config=is_bert_hf_config,
    export_to_hf=export_bert_to_hf,
    import_from_hf=import_bert_from_hf,
)
"""Megatron's BERT in the table of :mod:`mcore.hf.families`: its own export and import."""
