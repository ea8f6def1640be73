"""Pretraining data loader: a sampler, background workers, optional pinned memory.

Batch contract (what the training loop's forward step receives)
----------------------------------------------------------------
A batch is a ``dict[str, torch.Tensor]`` on the CPU (pinned if asked), ``b = micro_batch_size``,
``s = seq_length``:

==================  ==================  =============================================================
key                 shape / dtype       meaning
==================  ==================  =============================================================
``tokens``          [b, s] int64        input ids
``labels``          [b, s] int64        next-token targets (``tokens`` shifted left by one)
``loss_mask``       [b, s] float32      1 where the label counts; 0 on EOD inputs with
                                        ``--eod-mask-loss`` and on padding
``position_ids``    [b, s] int64        0..s-1, restarting after each EOD with ``--reset-position-ids``
``attention_mask``  [b, 1, s, s] bool   **only with** ``--reset-attention-mask``: True = masked out
                                        (Megatron's convention): causal and no attention across
                                        documents. Absent otherwise: the model builds its causal mask.
==================  ==================  =============================================================

BERT batches carry Megatron's BERT keys instead (``text``, ``types``, ``labels``, ``is_random``,
``padding_mask``, ``loss_mask``, ``truncated``; documented in :mod:`mcore.data.bert_dataset`).

Sampling: the samplers of :mod:`mcore.data.samplers` (``--dataloader-type single`` and ``cyclic``).

Which ranks load: only ranks whose model chunk consumes the data need a loader (in Megatron, tensor-
parallel rank 0 of the first and last pipeline stages, which then broadcast within their TP group);
the others pass ``dataset=None`` and get None. ``num_workers > 0`` prepares batches in background
processes (persistent across epochs of iteration) so the device never waits on the CPU.

Random state: a loader never touches the process's global generators. ``torch.utils.data.DataLoader``
draws its workers' base seed each time an iterator is created, from the loader's ``generator`` or,
without one, from torch's *default* CPU generator, the one CPU dropout draws from; the training loop
creates iterators at its first step and again whenever validation wraps around, so a resumed run would
draw at other points than an uninterrupted one and its dropout masks would differ. Each loader here
has its own generator, seeded from ``(seed, split, consumed_samples, data_parallel_rank)``, so workers
get deterministic seeds and resuming stays exact (the datasets index deterministically and draw no
random numbers themselves).

Signals: the workers ignore SIGTERM from anyone but their parent (:func:`worker_init`). Launchers
signal whole process groups (torchrun's agent ``killpg``-s each rank, Slurm signals every process of
the step); a worker killed by it would make the training process fail with ``DataLoader worker ...
killed by signal`` before ``--exit-signal-handler`` could save. The training process owns shutdown:
it finishes the step, saves and stops its workers.
"""

from __future__ import annotations

import os
import signal
import threading
import zlib
from collections.abc import Sequence

import torch

from mcore.data.samplers import CyclicPretrainingSampler, PretrainingSampler

BATCH_KEYS = (
    "tokens",
    "labels",
    "loss_mask",
    "position_ids",
    "attention_mask",
    # BERT (mcore.data.bert_dataset: Megatron's BERTMaskedWordPieceDataset keys)
    "text",
    "types",
    "is_random",
    "padding_mask",
    "truncated",
    # T5 (mcore.data.t5_dataset: Megatron's T5MaskedWordPieceDataset keys)
    "text_enc",
    "text_dec",
    "enc_mask",
    "dec_mask",
)


def collate_batch(samples: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack per-sample dicts (tensors, numpy arrays or numbers) into a batch: the GPT contract's keys
    first, then any other key in the samples' order (BERT's ``text``, ``types``, ``is_random``,
    ``padding_mask``, ... pass through to its forward step)."""
    first = samples[0]
    keys = [k for k in BATCH_KEYS if k in first] + [k for k in first if k not in BATCH_KEYS]
    return {k: torch.stack([torch.as_tensor(s[k]) for s in samples]) for k in keys}


def loader_seed(seed: int, split: str, consumed_samples: int, data_parallel_rank: int) -> int:
    """The seed of one loader's own generator (a 63-bit function of its arguments)."""
    key = f"{seed}/{split}/{consumed_samples}/{data_parallel_rank}".encode()
    return (zlib.crc32(key) << 31 | zlib.adler32(key)) & 0x7FFF_FFFF_FFFF_FFFF


def _ignore_sigterm_unless_from(parent: int) -> None:
    """Block SIGTERM in this process and serve it from a thread: exit when ``parent`` sent it (the
    DataLoader's own shutdown, as torch's worker handler does), ignore it otherwise."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    def serve() -> None:
        while True:
            info = signal.sigwaitinfo({signal.SIGTERM})
            if info.si_pid == parent or os.getppid() != parent:
                os._exit(0)

    threading.Thread(target=serve, name="mcore-sigterm", daemon=True).start()


def worker_init(worker_id: int) -> None:
    """``worker_init_fn`` of every pretraining loader: SIGTERM from a launcher does not end a worker.

    The worker's threads are started after this (the queue feeder), so they inherit the blocked
    SIGTERM; only the serving thread takes it. Where ``sigwaitinfo`` is missing (not Linux) SIGTERM is
    simply ignored: the worker still ends when its parent closes the loader or exits.
    """
    del worker_id
    if hasattr(signal, "sigwaitinfo") and hasattr(signal, "pthread_sigmask"):
        _ignore_sigterm_unless_from(os.getppid())
    else:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def build_pretraining_data_loader(
    dataset: torch.utils.data.Dataset | None,
    consumed_samples: int,
    micro_batch_size: int,
    data_parallel_rank: int,
    data_parallel_size: int,
    num_workers: int,
    pin_memory: bool,
    *,
    dataloader_type: str = "single",
    seed: int = 0,
    split: str = "train",
) -> torch.utils.data.DataLoader | None:
    """A DataLoader over ``dataset`` resuming after ``consumed_samples`` (None when ``dataset`` is None).

    Args:
        dataset: a GPT/Blended/Mock dataset, or None on ranks that take no data.
        consumed_samples: global samples already trained on (from the checkpoint; 0 for a new run).
        micro_batch_size: samples per micro-batch per rank.
        data_parallel_rank: this rank's index in its data-parallel group.
        data_parallel_size: data-parallel group size.
        num_workers: background worker processes (0: load in the training process).
        pin_memory: page-lock batches for faster host-to-device copies (pass the backend's answer).
        dataloader_type: ``single`` (:class:`PretrainingSampler`) or ``cyclic``
            (:class:`~mcore.data.samplers.CyclicPretrainingSampler`, shuffled per epoch by ``seed``).
        seed, split: with ``consumed_samples`` and the rank, the seed of the loader's own generator
            (see the module docstring: no draw from the global generators).
    """
    if dataset is None:
        return None
    if dataloader_type == "cyclic":
        sampler = CyclicPretrainingSampler(
            len(dataset), consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size, seed
        )
    else:
        sampler = PretrainingSampler(
            total_samples=len(dataset),
            consumed_samples=consumed_samples,
            micro_batch_size=micro_batch_size,
            data_parallel_rank=data_parallel_rank,
            data_parallel_size=data_parallel_size,
        )
    return torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        pin_memory=pin_memory,
        collate_fn=collate_batch,
        persistent_workers=num_workers > 0,
        generator=torch.Generator().manual_seed(
            loader_seed(seed, split, consumed_samples, data_parallel_rank)
        ),
        worker_init_fn=worker_init if num_workers > 0 else None,
    )
