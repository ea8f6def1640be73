"""Learning-rate schedules against their closed forms; batch-size rampup; FLOP formula."""

import math

import pytest

from mcore.config.fields import ConfigError
from mcore.training.flops import gpt_flops
from mcore.training.lr_scheduler import LRScheduler, SchedulerConfig
from mcore.training.microbatches import MicroBatchCalculator


class _Opt:
    def __init__(self):
        self.param_groups = [{"lr": None}, {"lr": None, "lr_mult": 0.5}]


def _sched(style, **kw):
    args = dict(max_lr=1.0, min_lr=0.1, warmup_steps=10, decay_steps=110, decay_style=style)
    args.update(kw)
    return LRScheduler(_Opt(), **args)


def test_warmup_is_linear_from_init():
    s = _sched("cosine", init_lr=0.2)
    for t in (0, 3, 10):
        assert s.get_lr(t) == pytest.approx(0.2 + 0.8 * t / 10)


@pytest.mark.parametrize("t", [10, 35, 60, 85, 110])
def test_linear_and_cosine_closed_forms(t):
    r = (t - 10) / 100
    assert _sched("linear").get_lr(t) == pytest.approx(0.1 + (1 - r) * 0.9)
    assert _sched("cosine").get_lr(t) == pytest.approx(0.1 + 0.5 * (math.cos(math.pi * r) + 1) * 0.9)


def test_after_decay_is_min_and_constant_is_max():
    assert _sched("linear").get_lr(500) == pytest.approx(0.1)
    assert _sched("constant").get_lr(500) == pytest.approx(1.0)


def test_inverse_square_root():
    s = _sched("inverse-square-root")
    assert s.get_lr(40) == pytest.approx(max(0.1, math.sqrt(10) / math.sqrt(40)))
    assert s.get_lr(100000) == pytest.approx(0.1)


@pytest.mark.parametrize("style", ["linear", "cosine", "exponential", "minus_sqrt"])
def test_wsd_holds_then_anneals(style):
    s = _sched("WSD", wsd_decay_steps=20, wsd_decay_style=style)
    assert s.get_lr(50) == pytest.approx(1.0) and s.get_lr(90) == pytest.approx(1.0)
    r = 0.5
    coeff = {
        "linear": 1 - r,
        "cosine": 0.5 * (math.cos(math.pi * r) + 1),
        "exponential": 2 * 0.5**r - 1,
        "minus_sqrt": 1 - math.sqrt(r),
    }[style]
    assert s.get_lr(100) == pytest.approx(0.1 + coeff * 0.9)
    assert s.get_lr(110) == pytest.approx(0.1, abs=1e-12)


def test_step_sets_groups_with_multiplier():
    s = _sched("constant")
    s.step(20)
    assert [g["lr"] for g in s.optimizer.param_groups] == [1.0, 0.5]
    state = s.state_dict()
    t = _sched("constant")
    t.load_state_dict(state)
    assert t.num_steps == 20


def test_from_config_converts_iterations_to_samples():
    cfg = SchedulerConfig(lr=1.0, min_lr=0.0, lr_decay_style="linear", lr_warmup_iters=2)
    s = LRScheduler.from_config(_Opt(), cfg, global_batch_size=8, train_iters=10, train_samples=None)
    assert (s.warmup_steps, s.decay_steps) == (16, 80)
    cfg = SchedulerConfig(lr=1.0, lr_warmup_fraction=0.1)
    s = LRScheduler.from_config(_Opt(), cfg, global_batch_size=8, train_iters=10, train_samples=None)
    assert s.warmup_steps == 8


def test_bad_schedules_are_named():
    with pytest.raises(ConfigError, match="min_lr=2.0 is above lr=1.0"):
        SchedulerConfig(lr=1.0, min_lr=2.0)
    with pytest.raises(ConfigError, match="WSD needs"):
        _sched("WSD")
    with pytest.raises(ConfigError, match="--lr is required"):
        LRScheduler.from_config(
            _Opt(), SchedulerConfig(), global_batch_size=1, train_iters=1, train_samples=None
        )


def test_microbatches_and_rampup():
    calc = MicroBatchCalculator(global_batch_size=32, micro_batch_size=2, data_parallel_size=2)
    assert calc.num_microbatches == 8
    calc = MicroBatchCalculator(
        global_batch_size=32, micro_batch_size=2, data_parallel_size=2, rampup_batch_size=(8, 8, 300)
    )
    seen = []
    for consumed in (0, 99, 100, 199, 200, 299, 300, 10000):
        calc.update(consumed)
        seen.append(calc.current_global_batch_size)
    assert seen == [8, 8, 16, 16, 24, 24, 32, 32]
    with pytest.raises(
        ConfigError,
        match="global_batch_size=30 is not divisible by micro_batch_size=2 x data_parallel_size=4",
    ):
        MicroBatchCalculator(global_batch_size=30, micro_batch_size=2, data_parallel_size=4)


def test_flops_formula_matches_megatron():
    B, s, L, h, V = 4, 2048, 24, 2048, 50304
    expected = 72 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))
    assert gpt_flops(
        batch_size=B, seq_length=s, num_layers=L, hidden_size=h, vocab_size=V, num_attention_heads=16
    ) == pytest.approx(expected)
