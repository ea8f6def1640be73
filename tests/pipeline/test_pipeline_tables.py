"""The micro-batch order and lock-step plan of every schedule, checked without processes."""

import itertools

import pytest

from mcore.config.fields import ConfigError
from mcore.pipeline.tables import (
    BACKWARD,
    FORWARD,
    Op,
    check_pipeline_schedule,
    pipeline_timeline,
    schedule_table,
    theoretical_bubble_fraction,
    timeline_bubble_fraction,
)


def names(ops):
    return " ".join(str(op) for op in ops)


def test_no_pipelining_alternates_forward_and_backward():
    assert names(schedule_table(1, 1, 3, 0)) == "F0 B0 F1 B1 F2 B2"
    assert names(schedule_table(1, 1, 3, 0, forward_only=True)) == "F0 F1 F2"


def test_1f1b_warmup_steady_cooldown():
    # rank r: p - r - 1 warm-up forwards, then one forward one backward, then the last backwards
    assert names(schedule_table(4, 1, 6, 0)) == "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5"
    assert names(schedule_table(4, 1, 6, 1)) == "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5"
    assert names(schedule_table(4, 1, 6, 3)) == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5"
    # fewer micro-batches than stages: all forwards, then all backwards
    assert names(schedule_table(4, 1, 2, 0)) == "F0 F1 B0 B1"


def test_interleaved_order_is_megatrons():
    # p=2, v=2, m=4: groups of p micro-batches per chunk; rank 0 warms up (p-1)*2 + (v-1)*p = 4
    assert names(schedule_table(2, 2, 4, 0)) == (
        "F0 F1 F0.1 F1.1 F2 B0.1 F3 B1.1 F2.1 B0 F3.1 B1 B2.1 B3.1 B2 B3"
    )
    assert names(schedule_table(2, 2, 4, 1)) == (
        "F0 F1 F0.1 B0.1 F1.1 B1.1 F2 B0 F3 B1 F2.1 B2.1 F3.1 B3.1 B2 B3"
    )


GRID = [
    (p, v, m)
    for p in (1, 2, 3, 4)
    for v in (1, 2, 3)
    for m in (1, 2, 3, 4, 6, 8, 12)
    if v == 1 or (p > 1 and m % p == 0)
]


@pytest.mark.parametrize("p,v,m", GRID)
def test_every_op_once_in_dependency_order(p, v, m):
    for r in range(p):
        order = schedule_table(p, v, m, r)
        expected = {Op(kind, c, i) for kind in (FORWARD, BACKWARD) for c in range(v) for i in range(m)}
        assert set(order) == expected and len(order) == len(expected)
        position = {(op.kind, op.chunk, op.microbatch): i for i, op in enumerate(order)}
        for c, i in itertools.product(range(v), range(m)):
            assert position[(FORWARD, c, i)] < position[(BACKWARD, c, i)]
            if i:  # each chunk sees its micro-batches in order, forwards and backwards alike
                assert position[(FORWARD, c, i - 1)] < position[(FORWARD, c, i)]
                assert position[(BACKWARD, c, i - 1)] < position[(BACKWARD, c, i)]
        assert [op.kind for op in schedule_table(p, v, m, r, True)] == [FORWARD] * (v * m)


@pytest.mark.parametrize("p,v,m", GRID)
def test_timeline_sends_meet_receives_in_the_same_tick(p, v, m):
    for forward_only in (False, True):
        timeline = pipeline_timeline(p, v, m, forward_only)
        sends = {(t.tick, x) for r in range(p) for t in timeline[r] for x in t.sends}
        recvs = {(t.tick, x) for r in range(p) for t in timeline[r] for x in t.recvs}
        assert sends == recvs
        for r in range(p):
            ops = [t.op for t in timeline[r] if t.op is not None]
            assert tuple(ops) == schedule_table(p, v, m, r, forward_only)
            for t in timeline[r]:
                assert all(x.src == r for x in t.sends) and all(x.dst == r for x in t.recvs)
                # at most one tensor per direction between two ranks per tick: FIFO matching holds
                assert len({x.src for x in t.recvs}) == len(t.recvs)
                assert len(t.sends) <= 1
        # every tensor a rank consumes arrives in an earlier tick
        for r in range(p):
            arrived = {}
            for t in timeline[r]:
                if t.op is not None:
                    stage = t.op.chunk * p + r
                    needs = (t.op.kind == FORWARD and stage > 0) or (
                        t.op.kind == BACKWARD and stage < p * v - 1
                    )
                    if needs:
                        assert arrived[(t.op.kind, t.op.chunk, t.op.microbatch)] < t.tick
                for x in t.recvs:
                    arrived[(x.kind, x.chunk, x.microbatch)] = t.tick


@pytest.mark.parametrize(
    "p,v,m", [(2, 1, 4), (4, 1, 8), (4, 1, 2), (2, 2, 4), (4, 2, 8), (4, 3, 4), (3, 2, 9)]
)
def test_timeline_bubble_matches_theory(p, v, m):
    assert timeline_bubble_fraction(p, v, m) == pytest.approx(theoretical_bubble_fraction(p, v, m))


@pytest.mark.parametrize("p,m", [(4, 8), (4, 2), (3, 5)])
def test_1f1b_keeps_at_most_p_minus_r_microbatches_in_flight(p, m):
    for r in range(p):
        alive, peak = 0, 0
        for op in schedule_table(p, 1, m, r):
            alive += 1 if op.kind == FORWARD else -1
            peak = max(peak, alive)
        assert peak == min(p - r, m)


def test_interleaving_needs_microbatches_divisible_by_stages():
    with pytest.raises(
        ConfigError, match=r"num_microbatches=6 is not divisible by pipeline_model_parallel_size=4"
    ):
        check_pipeline_schedule(4, 2, 6)
    with pytest.raises(
        ConfigError, match=r"num_microbatches=3 is not divisible by pipeline_model_parallel_size=2"
    ):
        schedule_table(2, 2, 3, 0)
    with pytest.raises(
        ConfigError, match=r"virtual_pipeline_model_parallel_size=2 needs pipeline_model_parallel_size > 1"
    ):
        check_pipeline_schedule(1, 2, 4)
    with pytest.raises(ConfigError, match=r"num_microbatches=0"):
        check_pipeline_schedule(2, 1, 0)


def test_theoretical_bubble():
    assert theoretical_bubble_fraction(4, 1, 8) == pytest.approx(3 / 8)
    assert theoretical_bubble_fraction(4, 2, 8) == pytest.approx(3 / 16)
    assert theoretical_bubble_fraction(1, 1, 8) == 0.0
