"""A resume with smaller batch settings than the checkpoint's run continues from the consumed sample
positions: each split covers what was consumed plus what the rest of the run reads (where the
validation sampler raised ``consumed_samples=... leaves no samples``). Unit test of the counts."""

from __future__ import annotations

from types import SimpleNamespace

from mcore.training.context import TrainState
from mcore.training.pretrain import train_valid_test_num_samples


def _cfg(gbs: int, eval_iters: int, iters: int = 10, eval_interval: int = 2):
    training = SimpleNamespace(
        train_samples=None,
        train_iters=iters,
        global_batch_size=gbs,
        eval_iters=eval_iters,
        eval_interval=eval_interval,
    )
    return SimpleNamespace(training=training)


def test_smaller_global_batch_and_eval_iters_still_cover_the_consumed_samples():
    # The checkpoint's run: gbs 8, 4 eval iterations every 2 iterations; saved at iteration 6.
    state = TrainState(iteration=6, consumed_train_samples=6 * 8, consumed_valid_samples=3 * 4 * 8)
    train, valid, test = train_valid_test_num_samples(_cfg(gbs=2, eval_iters=1), state)
    assert train >= 48 + 4 * 2 and valid >= 96 + (4 // 2 + 1) * 1 * 2 and test == 2
    # Unchanged settings: Megatron's counts exactly (the dataset indices, and so the samples, are the same).
    same = TrainState(iteration=6, consumed_train_samples=48, consumed_valid_samples=3 * 4 * 8)
    assert (
        train_valid_test_num_samples(_cfg(8, 4), same)
        == train_valid_test_num_samples(_cfg(8, 4))
        == (80, 192, 32)
    )
