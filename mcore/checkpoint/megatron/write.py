"""``mcore-export-megatron``: write any checkpoint mcore reads as a Megatron-LM checkpoint.

Command::

    mcore-export-megatron --load DIR --save OUT --ckpt-format torch|torch_dist
        [--target-tensor-model-parallel-size T] [--target-pipeline-model-parallel-size P]
        [--ckpt-step N] [--vocab-size V] [--megatron-names mcore|legacy]

``--load`` is an mcore checkpoint at any layout (or a Megatron one: this also reshards Megatron
checkpoints). Output, in Megatron's tree (``OUT/latest_checkpointed_iteration.txt``, ``OUT/iter_N/``):

* ``torch``: ``iter_N/mp_rank_TT[_PPP]/model_optim_rng.pt`` per target (TP, PP) rank with ``args``,
  ``checkpoint_version`` 3.0, ``iteration`` and ``model``: megatron-core GPTModel names of the local layer
  spec (``--megatron-names mcore``, what ``GPTModel.load_state_dict`` takes: stage-local layer numbers,
  ``_extra_state`` entries, the tied output copy on the last stage), or the legacy Megatron-LM nested
  ``language_model`` dict (``--megatron-names legacy``: what transformers'
  ``convert_megatron_gpt2_checkpoint.py`` and Megatron-LM's legacy models read).
* ``torch_dist``: megatron-core's distributed checkpoint: ``metadata.json``, ``common.pt`` (args,
  iteration, checkpoint_version) and the DCP files (written with torch.distributed.checkpoint in this
  process) under megatron-core's sharded keys (stacked layers, Transformer-Engine norm names), which
  megatron-core's ``dist_checkpointing.load`` reads at any TP/PP. The target TP sets only the padded
  vocabulary rows.

Model weights only (no optimizer, no RNG state): load it in Megatron-LM with ``--finetune`` or
``--no-load-optim --no-load-rng``. Written atomically: a temporary directory renamed into place, the
tracker file last. Exit status 0 on success, 2 for input that cannot be converted.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

from mcore.checkpoint.format import (
    CheckpointError,
    fsync_dir,
    iter_dir_name,
    write_tracker,
)
from mcore.checkpoint.megatron.args import args_from_model_config
from mcore.checkpoint.megatron.names import COLUMN, REPLICATED, ROW, SWIGLU, VOCAB, map_layer_param, mtp_split
from mcore.checkpoint.megatron.read_torch import rank_dir_name
from mcore.checkpoint.run_configs import run_config_groups
from mcore.utils.console import configure_console
from mcore.utils.outputs import OutputError, check_output_dir, read_marker, staged_dir, write_marker

LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
"""The dense layer's modules whose ``_extra_state`` torch_dist stores (value None)."""
MTP_LAYER = "transformer_layer."
"""megatron-core 0.16's name of an MTP depth's transformer layer (mcore's ``mtp_model_layer.``)."""

_DIST_LAYER_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias",
}
"""torch_dist stores the norms under the Transformer-Engine names, whatever the spec (formats.md 7.2)."""

_LEGACY_LAYER_NAMES = {
    "input_layernorm": "input_layernorm",
    "self_attention.linear_qkv": "self_attention.query_key_value",
    "self_attention.linear_proj": "self_attention.dense",
    "pre_mlp_layernorm": "post_attention_layernorm",
    "mlp.linear_fc1": "mlp.dense_h_to_4h",
    "mlp.linear_fc2": "mlp.dense_4h_to_h",
}


def split_kind(name: str, swiglu: bool) -> str:
    """The TP split kind of an mcore logical tensor (see :mod:`.names`)."""
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return VOCAB
    if name.startswith("decoder.layers."):
        rest = name.split(".", 3)[3]
        return map_layer_param(rest, swiglu)[1]
    return REPLICATED


def shard(tensor: torch.Tensor, kind: str, tp_rank: int, tp_size: int) -> torch.Tensor:
    """TP rank ``tp_rank``'s piece of a logical tensor (Megatron's layout, formats.md 5.5 and 6.4)."""
    if kind == REPLICATED or tp_size == 1:
        return tensor.clone()
    if kind == SWIGLU:
        gate, up = tensor.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp_size, 0)[tp_rank], up.chunk(tp_size, 0)[tp_rank]]).clone()
    dim = 1 if kind == ROW else 0
    return tensor.chunk(tp_size, dim)[tp_rank].clone()


def fit_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """Cut or zero-pad dim 0 to ``rows`` (the padded vocabulary of the target TP)."""
    if tensor.shape[0] >= rows:
        return tensor[:rows]
    return torch.cat([tensor, tensor.new_zeros(rows - tensor.shape[0], *tensor.shape[1:])])


def check_exportable(cfg, tp: int, pp: int) -> None:
    """Refuse what Megatron cannot hold or the target layout cannot split, naming the value."""
    if cfg.position_embedding_type == "alibi":
        raise CheckpointError("position_embedding_type='alibi': megatron-core's GPTModel has no ALiBi")
    if cfg.multi_latent_attention and tp != 1:
        raise CheckpointError(
            f"--target-tensor-model-parallel-size {tp} with multi_latent_attention=True: multi-latent "
            "attention is written at TP=1 only (megatron-core's local spec splits the down projections over "
            "TP, its Transformer-Engine spec replicates them)"
        )
    if cfg.qk_layernorm_full_width:
        raise CheckpointError(
            "qk_layernorm_full_width=True: megatron-core's --qk-layernorm normalizes each head; the "
            "full-width (OLMoE) q/k norm has no Megatron name"
        )
    n, g, f = cfg.num_attention_heads, cfg.num_query_groups, cfg.ffn_hidden_size
    if n % tp or (g % tp and tp % g) or f % tp:
        raise CheckpointError(
            f"--target-tensor-model-parallel-size {tp} does not divide num_attention_heads={n}, "
            f"num_query_groups={g} (or the reverse) and ffn_hidden_size={f}"
        )
    if cfg.num_layers % pp:
        raise CheckpointError(
            f"--target-pipeline-model-parallel-size {pp} does not divide num_layers={cfg.num_layers}"
        )


GPT_PREFIXES = (
    "embedding.word_embeddings.",
    "embedding.position_embeddings.",
    "decoder.layers.",
    "decoder.final_layernorm.",
    "output_layer.",
    "mtp.layers.",
)
"""The logical tensors of a GPT model: the only family this writer maps to megatron-core's names."""


def check_gpt_state(state: dict[str, torch.Tensor], load: str) -> None:
    """Refuse, by the family's name and before anything is written, a checkpoint that is not a GPT
    model (BERT's heads, T5's encoder): writing only the tensors it knows would silently drop the rest.
    Megatron's BERT and T5 checkpoints are not written (their layouts differ from GPTModel's)."""
    extra = sorted(name for name in state if not name.startswith(GPT_PREFIXES))
    if not extra:
        return
    if any(name.startswith(("lm_head.", "pooler.", "binary_head.", "embedding.tokentype")) for name in extra):
        family = "a BERT model"
    elif any(name.startswith("encoder.") for name in extra):
        family = "a T5 (encoder-decoder) model"
    else:
        family = "a model with tensors GPTModel lacks"
    raise CheckpointError(
        f"--load {load}: the checkpoint is {family} ({extra[0]}, ...); mcore-export-megatron writes GPT "
        "models only (export BERT and T5 to Hugging Face with mcore-export-hf)"
    )


def megatron_rank_states(
    state: dict[str, torch.Tensor], cfg, tp: int, pp: int, names: str = "mcore"
) -> dict[tuple[int, int], dict[str, Any]]:
    """The ``model`` entry of every target (TP, PP) rank's ``model_optim_rng.pt``."""
    per_stage = cfg.num_layers // pp
    tied = cfg.share_embeddings_and_output_weights
    out = {}
    for p in range(pp):
        first, last = p == 0, p == pp - 1
        layers = range(p * per_stage, (p + 1) * per_stage)
        for t in range(tp):
            flat: dict[str, Any] = {}
            if first:
                flat["embedding.word_embeddings.weight"] = shard(
                    state["embedding.word_embeddings.weight"], VOCAB, t, tp
                )
                if "embedding.position_embeddings.weight" in state:
                    flat["embedding.position_embeddings.weight"] = state[
                        "embedding.position_embeddings.weight"
                    ]
            for g in layers:
                _layer_state(
                    state, cfg, f"decoder.layers.{g}.", f"decoder.layers.{g - layers.start}.", t, tp, flat
                )
            if last and cfg.mtp_num_layers:
                if not first:  # MTP's copy of the word embedding on the last stage
                    flat["embedding.word_embeddings.weight"] = shard(
                        state["embedding.word_embeddings.weight"], VOCAB, t, tp
                    )
                _mtp_state(state, cfg, t, tp, flat)
            if last:
                for name in ("decoder.final_layernorm.weight", "decoder.final_layernorm.bias"):
                    if name in state:
                        flat[name] = state[name].clone()
                head = state["embedding.word_embeddings.weight"] if tied else state["output_layer.weight"]
                if not tied or not first:
                    flat["output_layer.weight"] = shard(head, VOCAB, t, tp)
                flat["output_layer._extra_state"] = None
            out[(t, p)] = flat if names == "mcore" else legacy_model_state(flat, tied=tied, first=first)
    return out


def _layer_state(state: dict, cfg, prefix: str, local: str, t: int, tp: int, flat: dict) -> None:
    """The tensors of the layer ``prefix`` (a decoder layer's global name, or an MTP depth's
    ``mtp_model_layer.``) for TP rank ``t`` under ``local`` + suffix, with the ``_extra_state`` entries
    of its linears (value None, as megatron-core's local spec emits them); routed experts as
    megatron-core's SequentialMLP ``mlp.experts.local_experts.N.linear_fcK.weight`` (EP=1: ``N`` is the
    global expert)."""
    modules = []
    for name in sorted(k for k in state if k.startswith(prefix)):
        rest = name[len(prefix) :]
        if rest in _EXPERT_TENSORS:
            fc = rest.split(".")[2]
            kind = ROW if fc == "linear_fc2" else SWIGLU if cfg.swiglu else COLUMN
            for e in range(state[name].shape[0]):
                flat[f"{local}mlp.experts.local_experts.{e}.{fc}.weight"] = shard(state[name][e], kind, t, tp)
                modules.append(f"mlp.experts.local_experts.{e}.{fc}")
            continue
        flat[local + rest] = shard(state[name], map_layer_param(rest, cfg.swiglu)[1], t, tp)
        module = rest.removesuffix(".weight")
        if rest.endswith(".weight") and module.rsplit(".", 1)[-1].startswith("linear_"):
            modules.append(module)
    for module in sorted(set(modules)):
        flat[f"{local}{module}._extra_state"] = None


def _mtp_state(state: dict, cfg, t: int, tp: int, flat: dict) -> None:
    """The MTP depths (the last stage): their own tensors, and each depth's layer under megatron-core
    0.16's ``transformer_layer.`` name."""
    for k in range(cfg.mtp_num_layers or 0):
        prefix = f"mtp.layers.{k}."
        for name in sorted(n for n in state if n.startswith(prefix) and n.count(".") == 4):
            flat[name] = shard(state[name], mtp_split(name[len(prefix) :]), t, tp)
        flat[f"{prefix}eh_proj._extra_state"] = None
        _layer_state(state, cfg, prefix + "mtp_model_layer.", prefix + MTP_LAYER, t, tp, flat)


_EXPERT_TENSORS = ("mlp.experts.linear_fc1.weight", "mlp.experts.linear_fc2.weight")


def legacy_model_state(flat: dict[str, Any], *, tied: bool, first: bool) -> dict[str, Any]:
    """megatron-core names -> Megatron-LM's legacy nested ``language_model`` dict (formats.md 5.3),
    with the pre-2023 norm names (``input_layernorm``, ``post_attention_layernorm``,
    ``final_layernorm``) that transformers' converter matches."""
    lm: dict[str, Any] = {}
    encoder: dict[str, Any] = {}
    final: dict[str, Any] = {}
    out: dict[str, Any] = {"language_model": lm}
    for key, value in flat.items():
        if key.endswith("._extra_state"):
            continue
        if key.startswith("embedding."):
            _, table, param = key.split(".")
            lm.setdefault("embedding", {}).setdefault(table, {})[param] = value
        elif key.startswith("decoder.layers."):
            _, _, index, rest = key.split(".", 3)
            module, param = rest.rsplit(".", 1)
            encoder[f"layers.{index}.{_LEGACY_LAYER_NAMES[module]}.{param}"] = value
        elif key.startswith("decoder.final_layernorm."):
            final["final_layernorm." + key.rsplit(".", 1)[1]] = value
        elif key == "output_layer.weight":
            if tied:
                out["word_embeddings_for_head"] = {"weight": value}
            else:
                lm["output_layer"] = {"weight": value}
    encoder.update(final)  # after the layers: the converter stops at the first non-layer key
    lm["encoder"] = encoder
    return out


def torch_dist_state(state: dict[str, torch.Tensor], cfg) -> dict[str, Any]:
    """megatron-core's sharded keys with global tensors (layers stacked on a leading axis) and the
    ``_extra_state`` byte objects its local spec saves per layer."""
    out: dict[str, Any] = {}
    for name, tensor in state.items():
        if not name.startswith("decoder.layers."):
            out[name] = tensor
    stacked: dict[str, list[torch.Tensor]] = {}
    for g in range(cfg.num_layers):
        prefix = f"decoder.layers.{g}."
        for name in sorted(k for k in state if k.startswith(prefix)):
            rest = name[len(prefix) :]
            stacked.setdefault(_DIST_LAYER_NAMES.get(rest, rest), []).append(state[name])
    for rest, tensors in stacked.items():
        out[f"decoder.layers.{rest}"] = torch.stack(tensors)
    for module in LINEARS:
        for g in range(cfg.num_layers):
            # DCP stores a non-tensor value as its torch.save bytes: megatron-core stores a
            # ShardedObject as the list of its data (formats.md 7.2)
            out[f"decoder.layers.{module}._extra_state/shard_{g}_{cfg.num_layers}"] = [None]
    return out


def _vocab_size(meta: dict, state: dict, given: int | None) -> int:
    if given:
        return given
    found = (meta.get("extra") or {}).get("tokenizer_vocab_size") or (meta.get("megatron") or {}).get(
        "vocab_size"
    )
    return int(found or state["embedding.word_embeddings.weight"].shape[0])


def export_to_megatron(
    load: str,
    save: str,
    ckpt_format: str,
    *,
    tp: int = 1,
    pp: int = 1,
    ckpt_step: int | None = None,
    vocab_size: int | None = None,
    names: str = "mcore",
) -> Path:
    """Write the checkpoint ``load`` as a Megatron-LM checkpoint under ``save`` (see the module
    docstring); returns the iteration directory written.

    Raises:
        CheckpointError: unreadable input, a layout or model Megatron cannot hold, an existing output.
    """
    from mcore.checkpoint.logical import load_logical_model_state
    from mcore.checkpoint.run_configs import model_config_from_run_config
    from mcore.config.fields import ConfigError
    from mcore.models.transformer.model_config import padded_vocab_size

    _check_format_options(ckpt_format, names)
    _check_save(load, save)
    state, meta = load_logical_model_state(load, ckpt_step)
    check_gpt_state(state, load)
    try:
        cfg = model_config_from_run_config(meta.get("run_config") or {})
    except (ConfigError, ValueError, TypeError) as err:
        raise CheckpointError(f"{load}: the checkpoint's model configuration cannot be used: {err}") from None
    check_exportable(cfg, tp, pp)
    _check_model_for_format(cfg, ckpt_format, names)
    vocab = _vocab_size(meta, state, vocab_size)
    padded = padded_vocab_size(vocab, cfg.make_vocab_size_divisible_by, tp)
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if name in state:
            state[name] = fit_rows(state[name], padded)
    iteration = int(meta.get("iteration", 0))
    train = meta.get("train_state") or {}
    dtype = state["embedding.word_embeddings.weight"].dtype
    args = args_from_model_config(
        cfg,
        padded_vocab_size=padded,
        vocab_size=vocab,
        tp=tp,
        pp=pp,
        iteration=iteration,
        fmt=ckpt_format,
        consumed_train_samples=int(train.get("consumed_train_samples", 0)),
        params_dtype=dtype,
        tokenizer=run_config_groups(meta.get("run_config") or {}).get("tokenizer"),
    )
    common = {"args": args, "checkpoint_version": 3.0, "iteration": iteration}

    root = Path(save)
    root.mkdir(parents=True, exist_ok=True)
    if read_marker(root) is None:  # an earlier output of this tool may take more iterations
        write_marker(root, TOOL)
    final = root / iter_dir_name(iteration)
    if final.exists():
        raise CheckpointError(f"--save {save}: {final} exists already (choose another --save)")
    try:  # the output rule's staging (mcore.utils.outputs): a temporary sibling renamed when complete
        with staged_dir(final) as staging:
            tmp = Path(staging)
            if ckpt_format == "torch":
                for (t, p), model_state in megatron_rank_states(state, cfg, tp, pp, names).items():
                    folder = tmp / rank_dir_name(t, p, pp)
                    folder.mkdir()
                    torch.save({**common, "model": model_state}, folder / "model_optim_rng.pt")
            else:
                _write_torch_dist(tmp, torch_dist_state(state, cfg), common)
        fsync_dir(root)
    except (OSError, RuntimeError) as err:  # a full disk (torch.save says RuntimeError): one line
        raise CheckpointError(f"--save {save}: cannot write {final}: {err}") from None
    write_tracker(root, iteration)
    return final


def _check_format_options(ckpt_format: str, names: str) -> None:
    """``--ckpt-format`` and ``--megatron-names`` on their own and together."""
    if ckpt_format not in ("torch", "torch_dist"):
        raise CheckpointError(f"--ckpt-format {ckpt_format!r}: choose torch or torch_dist")
    if names not in ("mcore", "legacy"):
        raise CheckpointError(f"--megatron-names {names!r}: choose mcore or legacy")
    if ckpt_format == "torch_dist" and names != "mcore":
        raise CheckpointError("--megatron-names legacy is for --ckpt-format torch only")


def _check_model_for_format(cfg, ckpt_format: str, names: str) -> None:
    """What the chosen Megatron format cannot hold of this model (QK layernorm in the legacy model;
    experts outside megatron-core's ``torch`` format)."""
    if (cfg.multi_latent_attention or cfg.mtp_num_layers) and (names == "legacy" or ckpt_format != "torch"):
        raise CheckpointError(
            f"multi_latent_attention={cfg.multi_latent_attention}, mtp_num_layers={cfg.mtp_num_layers}: "
            "multi-latent attention and multi-token prediction are written with --ckpt-format torch and "
            "megatron-core names only (torch_dist's MLA/MTP keys are not written; the legacy model has neither)"
        )
    if names == "legacy" and cfg.qk_layernorm:
        raise CheckpointError("--megatron-names legacy: Megatron-LM's legacy model has no QK layernorm")
    if cfg.num_experts and (names == "legacy" or ckpt_format != "torch"):
        raise CheckpointError(
            f"num_experts={cfg.num_experts}: mixture-of-experts models are written with --ckpt-format torch "
            "and megatron-core names only (the legacy model has no experts; torch_dist experts are not written)"
        )


TOOL = "mcore-export-megatron"


def _check_save(load: str, save: str) -> None:
    """The output rule (:mod:`mcore.utils.outputs`): not into or around ``--load``, not into a
    non-empty directory other than an earlier output of this tool (which takes more iterations)."""
    try:
        check_output_dir("--save", save, tool=TOOL, inputs={"--load": load}, overwrite=True)
    except OutputError as err:
        raise CheckpointError(str(err)) from None


def _write_torch_dist(folder: Path, tensors: dict[str, Any], common: dict[str, Any]) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    with warnings.catch_warnings():  # no_dist=True says it: torch's "assuming ... a single process" is noise
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.save(
            tensors,
            storage_writer=dcp.FileSystemWriter(str(folder), thread_count=1),
            planner=DefaultSavePlanner(flatten_state_dict=False),  # keys as given (megatron-core's)
            no_dist=True,
        )
    torch.save(common, folder / "common.pt")
    meta = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
            "common_backend_version": 1}  # fmt: skip
    (folder / "metadata.json").write_text(json.dumps(meta))  # megatron-core writes it last, too


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="mcore-export-megatron", description="Write a checkpoint as a Megatron-LM checkpoint."
    )
    parser.add_argument(
        "--load", required=True, help="Checkpoint directory (mcore's, at any layout, or Megatron's)."
    )
    parser.add_argument("--save", required=True, help="Output directory (Megatron's tree).")
    parser.add_argument("--ckpt-format", required=True, choices=("torch", "torch_dist"))
    parser.add_argument("--target-tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--target-pipeline-model-parallel-size", type=int, default=1)
    parser.add_argument("--ckpt-step", type=int, default=None, help="Iteration to export (default: latest).")
    parser.add_argument("--vocab-size", type=int, default=None, help="Real vocabulary size (default: saved).")
    parser.add_argument(
        "--megatron-names",
        choices=("mcore", "legacy"),
        default="mcore",
        help="torch format: megatron-core GPTModel names, or legacy Megatron-LM names (for "
        "transformers' convert_megatron_gpt2_checkpoint.py).",
    )
    return parser.parse_args(argv)


def main(argv=None) -> int:
    configure_console()  # the library's lines (notes, checkpoint progress) on the console
    args = parse_args(argv)
    for flag in ("target_tensor_model_parallel_size", "target_pipeline_model_parallel_size"):
        if getattr(args, flag) < 1:
            print(f"error: --{flag.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    try:
        out = export_to_megatron(
            args.load,
            args.save,
            args.ckpt_format,
            tp=args.target_tensor_model_parallel_size,
            pp=args.target_pipeline_model_parallel_size,
            ckpt_step=args.ckpt_step,
            vocab_size=args.vocab_size,
            names=args.megatron_names,
        )
    except CheckpointError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote Megatron {args.ckpt_format} checkpoint {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
