"""The per-batch vocabulary check of the token ids, read where the trainer reads the losses.

The model's :class:`~mcore.data.token_ids.TokenIdRange` s (the embedding's input ids, the
last stage's labels) record each micro-batch's ``(min, max)`` id on the device. :meth:`TokenIdCheck.stage`
queues the step's ranges to the host (:func:`~mcore.utils.async_host.stage_to_host`: no wait), and
:meth:`TokenIdCheck.check` reads them when the host has them or waits anyway (the log interval's
read of the losses, a save, the end of training, an evaluation), raising one
:class:`~mcore.data.errors.DataError` that names the id, the padded vocabulary, the iteration and the
data. The open-time sample check (:func:`mcore.data.indexed_dataset.check_token_ids`) catches a
dataset of another tokenizer before training; this one catches the id it did not sample.
"""

from __future__ import annotations

import collections
import os

import numpy as np
import torch

from mcore.data.config import DataConfig
from mcore.data.errors import DataError
from mcore.data.indexed_dataset import IndexedDataset, bin_path
from mcore.data.token_ids import TokenIdRange
from mcore.distributed.ddp import unwrap_model
from mcore.utils.async_host import HostValue, stage_to_host

LOCATE_BUDGET_BYTES = 1 << 30
"""The most ``.bin`` bytes read to say where an offending id is (once, when the error is raised)."""


class TokenIdCheck:
    """Stages the token-id ranges of every step and raises the first one out of range.

    Args:
        model: this rank's model chunks (DDP-wrapped or not); their :class:`TokenIdRange` s are found
            by attribute (``token_id_range``).
        data: the run's data flags, named in the error.
    """

    def __init__(self, model, data: DataConfig | None):
        self.data = data
        found = [
            module.token_id_range
            for chunk in model
            for module in unwrap_model(chunk).modules()
            if isinstance(getattr(module, "token_id_range", None), TokenIdRange)
        ]
        # the input ids first: a bad id of a sample's middle is both an input and a label
        self.ranges: list[TokenIdRange] = sorted(found, key=lambda r: r.role != "input id")
        self._pending: collections.deque[tuple[str, list[TokenIdRange], HostValue]] = collections.deque()

    def stage(self, where: str) -> None:
        """Queue the ranges seen since the last call (one step, or one evaluation) to the host;
        ``where`` names them in the error (``"iteration 12"``)."""
        seen = [(r, t) for r in self.ranges if (t := r.take()) is not None]
        if seen:
            staged = stage_to_host(torch.stack([t for _, t in seen]))
            self._pending.append((where, [r for r, _ in seen], staged))

    def check(self, wait: bool = True) -> None:
        """Raise for the first staged range with an id outside the vocabulary; ``wait=False`` reads
        only what has reached the host already.

        Raises:
            DataError: naming the offending id, the padded vocabulary, where (the iteration) and the
                data (the ``--data-path`` prefixes, and the file and offset of the id when the files
                are small enough to search).
        """
        while self._pending:
            where, ranges, staged = self._pending[0]
            if not wait and not staged.ready():
                return
            self._pending.popleft()
            for r, (low, high) in zip(ranges, staged.tolist()):
                bad = r.out_of_range(low, high)
                if bad is not None:
                    self._pending.clear()
                    raise DataError(out_of_range_message(bad, r, where, self.data))


def data_prefixes(data: DataConfig | None) -> list[str]:
    """The dataset prefixes of the run's data flags (a blend's weights left out)."""
    if data is None:
        return []
    out: list[str] = []
    for paths in (data.data_path, data.train_data_path, data.valid_data_path, data.test_data_path):
        for entry in paths:
            try:
                float(entry)
            except ValueError:
                if entry not in out:
                    out.append(entry)
    return out


def locate_token(prefixes: list[str], token: int, budget: int = LOCATE_BUDGET_BYTES) -> str | None:
    """``"<prefix>.bin: token <i> (byte offset <o>)"`` of the first occurrence of ``token`` in the
    datasets, reading at most ``budget`` bytes of ``.bin`` (None when not found within it)."""
    for prefix in prefixes:
        path = bin_path(prefix)
        try:
            dtype = IndexedDataset(prefix).dtype
            size = os.path.getsize(path)
        except (OSError, DataError):
            continue
        if size > budget:
            return None
        if size == 0:
            continue
        budget -= size
        if not np.can_cast(np.min_scalar_type(token), dtype):
            continue  # an id the file's dtype cannot hold is in no token of it
        tokens = np.memmap(path, dtype=dtype, mode="r")
        hits = np.flatnonzero(tokens == token)
        if hits.size:
            i = int(hits[0])
            return f"{path}: token {i} (byte offset {i * dtype.itemsize})"
    return None


def out_of_range_message(token: int, r: TokenIdRange, where: str, data: DataConfig | None) -> str:
    prefixes = data_prefixes(data)
    if prefixes:
        source = "--data-path " + " ".join(prefixes)
    elif data is not None and data.mock_data:
        source = "--mock-data"
    else:
        source = "the datasets provider's data (no --data-path given)"
    found = locate_token(prefixes, token) if prefixes else None
    at = f"; first found at {found}" if found else ""
    return (
        f"token id {token} ({r.role}) in the batch of {where} is outside the padded vocabulary "
        f"[0, {r.vocab_size}) of the model; data: {source}{at}. The data was tokenized with a larger "
        "vocabulary than --tokenizer-type/--vocab-size give: check the dataset against its tokenizer"
    )
