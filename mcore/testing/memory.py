"""Count the activation bytes autograd keeps for backward (what activation recomputation saves).

``SavedActivations`` installs ``torch.autograd.graph.saved_tensors_hooks`` around a forward and
records the storage behind every tensor an autograd node saves. :meth:`SavedActivations.nbytes`
sums the *current* sizes of the distinct storages, read when called: a storage that an
output-discarding checkpoint freed after it was saved (``--recompute-modules layernorm mlp_act``)
counts as zero, views of one storage count once, and the storages of the tensors given as
``exclude`` (the parameters: weights saved by the linear layers are not activations) not at all.
The hooks return the tensors unchanged, so the forward and its backward run exactly as without them.

Usage (device-agnostic; any backend, any dtype)::

    with SavedActivations(exclude=model.parameters()) as saved:
        loss = model(tokens, labels=labels).mean()
    print(saved.nbytes())            # before backward: what the step keeps
    loss.backward()
    saved.clear()                    # drop the references the counter holds

The counter keeps a reference to every recorded storage until :meth:`clear` (or the object dies),
so call it (or drop the counter) before measuring memory after backward.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class SavedActivations:
    """Context manager recording the storages autograd saves for backward inside it."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self._excluded = {t.untyped_storage()._cdata for t in exclude}
        self._storages: dict[int, tuple[torch.UntypedStorage, tuple[int, ...], torch.dtype]] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key not in self._excluded and key not in self._storages:
            self._storages[key] = (storage, tuple(tensor.shape), tensor.dtype)
        return tensor

    @staticmethod
    def _unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def __enter__(self) -> SavedActivations:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def mark(self) -> int:
        """A position in the record: pass it to :meth:`nbytes` to count only what was saved after it."""
        return len(self._storages)

    def nbytes(self, since: int = 0) -> int:
        """Bytes of the distinct saved storages (first saved after ``since``), at their current size."""
        entries = list(self._storages.values())[since:]
        return sum(storage.nbytes() for storage, _, _ in entries)

    def tensors(self, since: int = 0) -> list[tuple[tuple[int, ...], torch.dtype, int]]:
        """``(shape of the first tensor saved from it, dtype, current bytes)`` per storage, in order."""
        entries = list(self._storages.values())[since:]
        return [(shape, dtype, storage.nbytes()) for storage, shape, dtype in entries]

    def clear(self) -> None:
        """Forget the recorded storages (releases the counter's references)."""
        self._storages.clear()
