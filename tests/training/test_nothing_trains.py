"""A run under which no token contributes to the loss is refused at its first step with one line naming
the flags and the data (mcore/training/nothing_trains.py), not trained with a zero loss to exit 0."""

from __future__ import annotations

from types import SimpleNamespace as NS

import numpy as np
import pytest
import torch

from mcore.data.errors import DataError
from mcore.training.nothing_trains import check_first_step_trains


def _cfg(eod_mask_loss=False, init_std=0.02, **data):
    data = {"mock_data": False, "data_path": ("corpus_text_document",), "train_data_path": (), **data}
    return NS(data=NS(eod_mask_loss=eod_mask_loss, **data), model=NS(seq_length=8, init_method_std=init_std))


def test_only_an_exactly_zero_global_norm_is_refused_and_the_message_names_the_cause():
    for norm in (0.5, torch.tensor(1e-30), None):  # a norm, a tiny one, clipping off (no norm)
        check_first_step_trains(norm, _cfg(eod_mask_loss=True), 1)
    with pytest.raises(
        DataError, match=r"iteration 1: no token .* --eod-mask-loss .* --data-path corpus_text"
    ):
        check_first_step_trains(torch.tensor(0.0), _cfg(eod_mask_loss=True), 1)
    with pytest.raises(
        DataError, match=r"every loss-mask entry of the batch from --mock-data at --seq-length 8"
    ):
        check_first_step_trains(0.0, _cfg(mock_data=True, data_path=()), 3)
    with pytest.raises(DataError, match="--init-method-std 0"):
        check_first_step_trains(0.0, _cfg(init_std=0.0), 1)


def test_gpt_on_only_end_of_document_tokens_with_eod_mask_loss_is_refused(tmp_path, capsys):
    """The command line, in-process: data of empty documents (every token the NullTokenizer's EOD) with
    --eod-mask-loss ends at iteration 1 with exit status 2; without --eod-mask-loss the same data trains."""
    from mcore.data.indexed_dataset import IndexedDatasetBuilder, bin_path, idx_path
    from mcore.training.gpt import forward_step, model_provider
    from mcore.training.pretrain import pretrain

    prefix = str(tmp_path / "empty_docs_text_document")
    with IndexedDatasetBuilder(bin_path(prefix), dtype=np.uint16) as builder:
        for _ in range(40):
            builder.add_item(np.array([63]))  # NullTokenizer(63).eod == 63
            builder.end_document()
        builder.finalize(idx_path(prefix))
    argv = [
        "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
        "--max-position-embeddings", "8", "--micro-batch-size", "2", "--train-iters", "2", "--lr", "1e-3",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "63", "--data-path", prefix, "--split", "100,0,0",
        "--eval-iters", "0", "--num-workers", "0", "--log-interval", "1",
        "--data-cache-path", str(tmp_path / "cache"),
    ]  # fmt: skip
    with pytest.raises(SystemExit) as exit_:
        pretrain(model_provider, forward_step, argv=[*argv, "--eod-mask-loss"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "iteration 1: no token of the global batch contributes to the loss" in err, err[-2000:]
    assert f"--data-path {prefix}" in err and "drop --eod-mask-loss" in err
    result = pretrain(model_provider, forward_step, argv=argv)
    assert result.state.iteration == 2
