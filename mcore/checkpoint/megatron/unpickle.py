"""Load a Megatron-LM ``model_optim_rng.pt`` without Megatron installed.

The file is a full pickle: ``args`` is an ``argparse.Namespace`` whose fields may hold Megatron classes
(enums such as ``AttnBackend``), the RNG states hold numpy objects. Loading it with ``weights_only=True``
fails on those; loading it with plain pickle needs ``megatron`` importable. This loader is plain pickle
(``weights_only=False``: Megatron's own loader does the same, so only load checkpoints you trust) in
which a class that cannot be imported becomes an inert :class:`Unavailable` placeholder that records
its name, instead of an error.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch


class Unavailable:
    """Stands for an object of a class that could not be imported (its module is not installed)."""

    _qualified_name = "?"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"<unavailable {self._qualified_name}{self.args if self.args else ''}>"

    def __reduce__(self):  # re-pickling (e.g. sending args to other ranks) keeps the placeholder
        return (_placeholder_obj, (self._qualified_name, self.args))


def _placeholder(module: str, name: str) -> type:
    return type(name, (Unavailable,), {"__module__": __name__, "_qualified_name": f"{module}.{name}"})


def _placeholder_obj(qualified: str, args: tuple) -> Unavailable:
    module, _, name = qualified.rpartition(".")
    return _placeholder(module, name)(*args)


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        try:
            return super().find_class(module, name)
        except (ImportError, AttributeError):
            return _placeholder(module, name)


class _PickleModule:
    """What ``torch.load(pickle_module=...)`` needs: ``Unpickler`` and ``load``."""

    Unpickler = _Unpickler
    __name__ = "mcore_megatron_pickle"

    @staticmethod
    def load(file, **kwargs):
        return _Unpickler(file, **kwargs).load()


def load_megatron_file(path: str | Path) -> dict[str, Any]:
    """``torch.load`` of a Megatron ``model_optim_rng.pt`` (or ``common.pt``, ``distrib_optim.pt``) on
    the CPU, memory-mapped where the file allows (torch's zip format): the tensors' bytes are read only
    when used, so indexing a checkpoint (its optimizer state included) does not read it all. A
    mixture-of-experts ``distrib_optim.pt`` (a list: one state per chained optimizer) comes back as
    ``{"chained": [...]}``.

    Raises:
        CheckpointError: the file is missing or cannot be read (named).
    """
    from mcore.checkpoint.format import CheckpointError

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"Megatron checkpoint file {path} is missing")
    try:
        try:
            data = torch.load(
                path, map_location="cpu", weights_only=False, pickle_module=_PickleModule, mmap=True
            )
        except RuntimeError:  # a legacy (non-zip) torch.save file cannot be mapped
            data = torch.load(path, map_location="cpu", weights_only=False, pickle_module=_PickleModule)
    except Exception as err:  # noqa: BLE001 - any failure to unpickle is a damaged file
        raise CheckpointError(f"Megatron checkpoint file {path} cannot be read (corrupted?): {err}") from None
    if isinstance(data, list) and path.name == "distrib_optim.pt":
        # a ChainedOptimizer's (mixture of experts: [dense, experts], None where this rank is not the
        # data-parallel rank 0 of that optimizer's group)
        if all(d is None or isinstance(d, dict) for d in data):
            return {"chained": data}
    if not isinstance(data, dict):
        raise CheckpointError(f"Megatron checkpoint file {path} holds a {type(data).__name__}, not a dict")
    return data
