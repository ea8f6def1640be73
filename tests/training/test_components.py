"""The training loop's components: the checkpointer's save decisions, the exit-reason agreement, and a
run built once by ``build_training`` that the throughput benchmark's way (``Trainer.from_context``,
synthetic steps) trains."""

import types

import pytest
import torch

from mcore.distributed.groups import initialize_parallel
from mcore.testing.distributed import test_backend_name as backend_name
from mcore.training.checkpointer import Checkpointer
from mcore.training.context import TrainContext, TrainState
from mcore.training.gpt import forward_step, model_provider
from mcore.training.pretrain import build_training, check_run_config, setup_backend
from mcore.training.run_config import parse_run_config
from mcore.training.signals import ExitFlags, exit_reason
from mcore.training.trainer import Trainer


class _Recording(Checkpointer):
    def save(self, state):
        self.saves.append(state.iteration)
        self.last_saved = state.iteration
        return 0.0

    def finalize(self, blocking):
        self.finalizes.append(blocking)


def _checkpointer(save="/ckpt", save_interval=None, async_save=False):
    checkpoint = types.SimpleNamespace(save=save, save_interval=save_interval, async_save=async_save)
    flushes = []
    ckpt = _Recording(types.SimpleNamespace(checkpoint=checkpoint), None, None, None, None,
                      before_save=lambda: flushes.append(1))  # fmt: skip
    ckpt.saves, ckpt.finalizes = [], []
    return ckpt, flushes


def test_checkpointer_saves_at_intervals_and_once_at_the_end():
    ckpt, flushes = _checkpointer(save_interval=2)
    state = TrainState()
    for it in range(1, 6):
        state.iteration = it
        assert ckpt.maybe_save(state) == (it % 2 == 0)
    assert ckpt.saves == [2, 4] and len(flushes) == 2 and ckpt.finalizes == [False] * 5
    assert ckpt.maybe_save(state, final=True)  # iteration 5 was not saved yet
    assert ckpt.saves == [2, 4, 5] and ckpt.saved_dir(5) == "/ckpt" and ckpt.saved_dir(4) is None
    state.iteration = 6
    assert ckpt.maybe_save(state) and not ckpt.maybe_save(state, final=True)  # just saved: not again
    assert ckpt.saves == [2, 4, 5, 6]


def test_checkpointer_without_save_dir_or_steps_saves_nothing():
    ckpt, _ = _checkpointer(save=None, save_interval=1)
    state = TrainState(iteration=3)
    assert not ckpt.maybe_save(state) and not ckpt.maybe_save(state, final=True)
    assert ckpt.saves == [] and ckpt.finalizes == [] and ckpt.saved_dir(3) is None
    ckpt, _ = _checkpointer(save_interval=None)
    assert not ckpt.maybe_save(TrainState(iteration=0), final=True)  # no step taken: nothing to save
    assert not ckpt.maybe_save(TrainState(iteration=7))  # no --save-interval
    assert ckpt.maybe_save(TrainState(iteration=7), final=True) and ckpt.saves == [7]


def test_exit_reason_signal_beats_interval_and_duration_comes_one_iteration_late():
    t = types.SimpleNamespace(exit_signal_handler=True, exit_duration_in_mins=None, exit_interval=3)
    handler = types.SimpleNamespace(signaled=False)
    flags = ExitFlags(t, handler, torch.device("cpu"), start_time=0.0)
    assert exit_reason(t, 1, flags) is None
    assert exit_reason(t, 3, flags) == "exit-interval"
    handler.signaled = True
    assert exit_reason(t, 4, flags) is None  # seen now, agreed on at the next poll
    assert exit_reason(t, 6, flags) == "signal"
    t = types.SimpleNamespace(exit_signal_handler=False, exit_duration_in_mins=0.0, exit_interval=None)
    flags = ExitFlags(t, handler, torch.device("cpu"), start_time=0.0)
    assert [exit_reason(t, i, flags) for i in (1, 2)] == [None, "exit-duration"]


@pytest.fixture
def built():
    argv = ["--device-backend", backend_name(), "--num-layers", "2", "--hidden-size", "32",
            "--num-attention-heads", "4", "--seq-length", "16", "--max-position-embeddings", "16",
            "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3", "--lr", "1e-3",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--mock-data", "--eval-iters", "0",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--num-workers", "0"]  # fmt: skip
    cfg = parse_run_config(argv)
    backend = setup_backend(cfg)
    cfg = check_run_config(cfg, backend, 1)
    groups = initialize_parallel(cfg.parallel, backend)
    return cfg, groups, backend


def test_build_training_without_data_trains_synthetic_steps(built, capsys):
    """The throughput benchmark's use: one build, no data, no console lines, steps fed by the caller."""
    cfg, groups, backend = built
    ctx = build_training(cfg, groups, backend, model_provider, None, vocab_size=100, verbose=False)
    assert isinstance(ctx, TrainContext) and capsys.readouterr().out == ""
    assert ctx.padded_vocab_size == 128 and ctx.tokenizer_vocab_size == 101
    assert ctx.train_iter is None and not ctx.has_valid and ctx.state == TrainState()
    trainer = Trainer.from_context(ctx, forward_step)
    tokens = torch.randint(0, 100, (2, 17), generator=torch.Generator().manual_seed(0))
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(2, 16),
             "position_ids": torch.arange(16).expand(2, 16)}  # fmt: skip
    losses = [trainer.reduce_logs([trainer.train_step(iter([batch] * 2))[0]])[0]["lm loss"] for _ in range(3)]
    assert losses[2] < losses[0]
    assert trainer.steps_run == 3 and ctx.scheduler.num_steps == 12  # 3 steps of 4 samples


def test_build_training_with_data_is_what_the_trainer_trains(built):
    cfg, groups, backend = built
    ctx = build_training(cfg, groups, backend, model_provider)
    assert ctx.train_iter is not None and ctx.padded_vocab_size == 128
    result = Trainer.from_context(ctx, forward_step).train()
    assert result.exit_reason == "finished" and result.state.iteration == 3 and len(result.train_losses) == 3
    assert result.state is ctx.state
