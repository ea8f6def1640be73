"""``python -m mcore.checkpoint.inspect DIR``: what a checkpoint directory holds.

Prints the tracker, the complete iterations (and saves that did not complete), and for one iteration
(the tracker's, or ``--iteration``): the layout it was saved with, the training state, the model
flags, the files, and every logical tensor with its shape, dtype and how many shards hold it.
``--verify`` reads every file and checks sizes and checksums; ``--json`` prints the metadata instead.

Exit status: 0, or 1 when the directory holds no readable checkpoint or verification fails.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

from mcore.checkpoint.format import (
    FORMAT,
    METADATA,
    TRACKER,
    CheckpointError,
    iter_dir_name,
    list_iterations,
    list_old_dirs,
    list_tmp_dirs,
    no_checkpoint_message,
    read_metadata,
    read_tracker,
)
from mcore.utils.console import configure_console

_MODEL_KEYS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "seq_length",
    "position_embedding_type",
    "normalization",
    "swiglu",
    "untie_embeddings_and_output_weights",
    "num_experts",
    "moe_ffn_hidden_size",
    "moe_router_topk",
)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _verify(iter_dir: Path, meta: dict) -> list[str]:
    from mcore.checkpoint.reader import ShardReader

    reader = ShardReader(iter_dir, meta, verify=True)
    problems, bad_files = [], set()
    for name in sorted(meta.get("files", {})):
        try:
            reader.file(name)
        except CheckpointError as err:
            problems.append(str(err))
            bad_files.add(name)
    for rec in meta.get("records", []):
        if rec["file"] in bad_files:
            continue
        try:
            reader.tensor(rec)
        except CheckpointError as err:
            problems.append(str(err))
    return problems


def describe(root: Path, iteration: int | str | None = None, *, verify: bool = False, out=None) -> int:
    """Print a description of the checkpoint(s) under ``root`` (or of one iteration directory)."""
    out = out or sys.stdout

    def say(line: str = "") -> None:
        print(line, file=out)

    if (root / METADATA).is_file() and iteration is None:  # an iteration directory itself
        iter_dir = root
        say(f"checkpoint directory: {root}")
    else:
        iter_dir = _describe_root(root, iteration, say)
        if iter_dir is None:
            return 1
    from mcore.checkpoint.megatron.detect import read_any_metadata

    meta = read_any_metadata(iter_dir)  # mcore's, or a Megatron-LM torch / torch_dist checkpoint
    if meta.get("format") != FORMAT:
        say(
            f"a Megatron-LM checkpoint ({meta.get('format')}): --load, mcore-export-hf, mcore-export-megatron"
        )
        say("and mcore-generate read it directly (no conversion needed)")
    _describe_iteration(iter_dir, meta, say)
    _describe_tensors(meta, say)
    if verify and meta.get("format") == FORMAT:  # a Megatron checkpoint records no checksums
        return _describe_verification(iter_dir, meta, say)
    return 0


def _describe_root(root: Path, iteration: int | str | None, say) -> Path | None:
    """Say what the checkpoint root holds (tracker, iterations, incomplete or interrupted saves) and
    return the iteration directory to describe: ``iteration``, else the tracker's, else the last
    (None, said, when there is none)."""
    tracker = read_tracker(root)
    iterations = list_iterations(root)
    say(f"checkpoint root: {root}")
    say(f"tracker ({TRACKER}): {tracker if tracker is not None else 'missing'}")
    say(f"complete iterations: {', '.join(map(str, iterations)) or 'none'}")
    for tmp in list_tmp_dirs(root):
        say(f"incomplete save (not loadable): {tmp.name}")
    if tracker is not None and not (root / iter_dir_name(tracker)).is_dir():
        old = list_old_dirs(root, tracker)
        if old:
            say(
                f"interrupted re-save: the tracker names iteration {tracker}, {iter_dir_name(tracker)} is "
                f"missing, and its complete copy is {old[0].name} (loading renames it back into place)"
            )
        else:
            say(f"the tracker names iteration {tracker}, but {iter_dir_name(tracker)} is missing")
    chosen = iteration if iteration is not None else tracker
    if chosen is None:
        chosen = iterations[-1] if iterations else None
    if chosen is None:
        say(f"no checkpoint to describe: {no_checkpoint_message(root, None)}")
        return None
    iter_dir = root / iter_dir_name(chosen)
    if not iter_dir.is_dir() and list_old_dirs(root, chosen):
        iter_dir = list_old_dirs(root, chosen)[0]
    return iter_dir


def _describe_iteration(iter_dir: Path, meta: dict, say) -> None:
    """The iteration's summary: when and at which layout it was saved, its train state, optimizer,
    RNG and scheduler state, model, extras and files."""
    layout = meta["layout"]
    say()
    say(
        f"== {iter_dir.name}: iteration {meta['iteration']} ({meta.get('saved_at', '?')}, torch {meta.get('torch_version', '?')})"
    )
    say(
        f"saved with: tp={layout['tensor_model_parallel_size']} pp={layout['pipeline_model_parallel_size']} "
        f"dp={layout['data_parallel_size']} vp={layout['virtual_pipeline_model_parallel_size']} "
        f"world={layout['world_size']} order={layout.get('parallel_order')} "
        + (
            f"ep={layout['expert_model_parallel_size']} etp={layout.get('expert_tensor_parallel_size')} "
            if layout.get("expert_model_parallel_size", 1) > 1
            or layout.get("expert_tensor_parallel_size", layout["tensor_model_parallel_size"])
            != layout["tensor_model_parallel_size"]
            else ""
        )
        + f"distributed optimizer={'yes' if layout.get('use_distributed_optimizer') else 'no'}"
        + (" (model-only checkpoint)" if meta.get("model_only") else "")
    )
    train = meta.get("train_state") or {}
    if train:
        say("train state: " + " ".join(f"{k}={v}" for k, v in train.items()))
    opt = meta.get("optimizer") or {}
    say(
        f"optimizer: {opt.get('type')} ({'saved' if opt.get('saved') else 'not saved'})"
        + (f", loss scale {opt['grad_scaler'].get('scale')}" if opt.get("grad_scaler") else "")
        + f" | rng: {'saved' if meta.get('rng_saved') else 'not saved'}"
        + (f" | scheduler: {meta['scheduler']}" if meta.get("scheduler") else "")
    )
    model_cfg = (meta.get("run_config") or {}).get("model") or {}
    if model_cfg:
        say("model: " + " ".join(f"{k}={model_cfg[k]}" for k in _MODEL_KEYS if k in model_cfg))
    if meta.get("extra"):
        say("extra: " + " ".join(f"{k}={v}" for k, v in meta["extra"].items()))
    files = meta.get("files") or {}
    say(f"files: {len(files)} + {METADATA}, {_size(sum(f.get('size', 0) for f in files.values()))}")


def _describe_tensors(meta: dict, say) -> None:
    """One line per logical tensor: name, global shape, dtype and its records by kind."""
    tensors: dict[str, dict] = {}
    shards: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for rec in meta.get("records", []):
        if rec["name"] not in tensors or rec["kind"] == "param":
            tensors[rec["name"]] = rec
        shards[rec["name"]][rec["kind"]] += 1
    say(f"tensors: {len(tensors)}")
    width = max((len(n) for n in tensors), default=0)
    for name in sorted(tensors, key=_natural_key):
        rec = tensors[name]
        shape = "[" + ", ".join(map(str, rec["global_shape"])) + "]"
        kinds = ", ".join(
            f"{k} x{n}" for k, n in sorted(shards[name].items(), key=lambda kv: kv[0] != "param")
        )
        experts = (
            f"  experts: {rec['global_shape'][rec['expert_dim']]} on dim {rec['expert_dim']}"
            if rec.get("expert_dim") is not None
            else ""
        )
        say(f"  {name:<{width}}  {shape:<14} {rec['dtype']:<9} {kinds}{experts}")


def _describe_verification(iter_dir: Path, meta: dict, say) -> int:
    """``--verify``: every file's size and checksum; 1 (problems said) or 0."""
    files = meta.get("files", {})
    problems = _verify(iter_dir, meta)
    say()
    if problems:
        say(f"verification FAILED ({len(problems)} problem(s)):")
        for problem in problems:
            say(f"  {problem}")
        return 1
    say(
        f"verification OK: {len(files)} files, {len(meta.get('records', []))} tensors, sizes and checksums match"
    )
    return 0


def _natural_key(name: str):
    return [int(part) if part.isdigit() else part for part in name.split(".")]


def main(argv: list[str] | None = None) -> int:
    configure_console()  # the library's lines (notes, checkpoint progress) on the console
    parser = argparse.ArgumentParser(
        prog="python -m mcore.checkpoint.inspect", description="Describe an mcore checkpoint directory."
    )
    parser.add_argument("dir", type=Path, help="the --save directory, or one iter_XXXXXXX directory")
    parser.add_argument(
        "--iteration", type=int, default=None, help="the iteration to describe (default: latest)"
    )
    parser.add_argument("--verify", action="store_true", help="read every file and check sizes and checksums")
    parser.add_argument("--json", action="store_true", help="print the iteration's metadata.json")
    args = parser.parse_args(argv)
    try:
        if args.json:
            path = args.dir
            if not (path / METADATA).is_file() or args.iteration is not None:
                from mcore.checkpoint.load import resolve_iteration_dir

                path = resolve_iteration_dir(path, args.iteration, recover=False)
                if path is None:
                    raise CheckpointError(no_checkpoint_message(args.dir, None))
            print(json.dumps(read_metadata(path), indent=1))
            return 0
        return describe(args.dir, args.iteration, verify=args.verify)
    except CheckpointError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # ``... | head``
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
