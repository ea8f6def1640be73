"""``--use-checkpoint-args``: take the model architecture from the checkpoint ``--load`` names.

As Megatron-LM's ``load_args_from_checkpoint``: the architecture flags stored with the checkpoint
(mcore's ``run_config["model"]``, or a Megatron checkpoint's ``args``, :mod:`mcore.checkpoint.megatron.args`)
replace those on the command line, which may then leave them out. Applied to ``argv`` before parsing,
so the usual validation runs on the result.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from mcore.checkpoint.megatron.args import MODEL_FLAGS

FLAG = "--use-checkpoint-args"


def _flag(name: str) -> str:
    """The command-line spelling of a model field (``beta_fast`` is ``--yarn-beta-fast``)."""
    import dataclasses

    from mcore.config.fields import flag_name
    from mcore.models.transformer.model_config import ModelConfig

    fields = {f.name: f for f in dataclasses.fields(ModelConfig)}
    return flag_name(fields[name]) if name in fields else "--" + name.replace("_", "-")


def _value_of(argv: Sequence[str], flag: str) -> str | None:
    for i, token in enumerate(argv):
        if token == flag and i + 1 < len(argv):
            return argv[i + 1]
        if token.startswith(flag + "="):
            return token.split("=", 1)[1]
    return None


def checkpoint_model_flags(load: str, ckpt_step: int | None = None) -> dict:
    """The model flags stored with the checkpoint under ``load`` (any format)."""
    from mcore.checkpoint.format import CheckpointError, no_checkpoint_message
    from mcore.checkpoint.load import resolve_iteration_dir
    from mcore.checkpoint.megatron.detect import read_any_metadata

    path = resolve_iteration_dir(Path(load), ckpt_step)
    if path is None:
        raise CheckpointError(f"{FLAG}: {no_checkpoint_message(load)}")
    model = (read_any_metadata(path).get("run_config") or {}).get("model") or {}
    if not model:
        raise CheckpointError(f"{FLAG}: the checkpoint {path} stores no model configuration")
    return {k: model[k] for k in MODEL_FLAGS if k in model}


def apply_checkpoint_args(argv: Sequence[str]) -> list[str]:
    """``argv`` with the checkpoint's model flags in place of the command line's (unchanged when
    ``--use-checkpoint-args`` is absent).

    Raises:
        CheckpointError: no ``--load``, or a checkpoint without a model configuration.
    """
    argv = list(argv)
    if FLAG not in argv:
        return argv
    from mcore.checkpoint.format import CheckpointError

    load = _value_of(argv, "--load")
    if load is None:
        raise CheckpointError(f"{FLAG} needs --load")
    step = _value_of(argv, "--ckpt-step")
    flags = checkpoint_model_flags(load, int(step) if step is not None else None)
    names = {_flag(k) for k in flags}
    # the command line's own values of these flags go (bool flags take no value)
    bool_flags = {_flag(k) for k in MODEL_FLAGS if k in flags and isinstance(flags[k], bool)}
    kept, skip = [], False
    for token in argv:
        if skip:
            skip = False
            continue
        name = token.split("=", 1)[0]
        if name in names:
            skip = "=" not in token and name not in bool_flags
            continue
        kept.append(token)
    for key, value in flags.items():
        if isinstance(value, bool):
            if value:
                kept.append(_flag(key))
        elif key == "moe_layer_freq" and isinstance(value, (list, tuple)):  # one token: Megatron's list
            kept += [_flag(key), "[" + ",".join(str(v) for v in value) + "]"]
        elif isinstance(value, (list, tuple)):  # nargs flags (--moe-router-load-balancing-type, ...)
            kept += [_flag(key), *(str(v) for v in value)] if value else []
        elif value is not None:
            kept += [_flag(key), str(value)]
    return kept
