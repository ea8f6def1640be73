"""Which layers each stage holds, model chunks, the selector, and errors raised before any exchange."""

import contextlib

import pytest
import torch

from mcore.config.fields import ConfigError
from mcore.config.parallel import ParallelConfig
from mcore.distributed.groups import ProcessGroups
from mcore.distributed.topology import Topology
from mcore.pipeline import (
    build_model_chunks,
    forward_backward_no_pipelining,
    forward_backward_pipelining_with_interleaving,
    forward_backward_pipelining_without_interleaving,
    get_forward_backward_func,
    stage_layer_ranges,
)


def spans(ranges):
    return [[(r.start, r.stop) for r in chunks] for chunks in ranges]


def test_even_split():
    assert spans(stage_layer_ranges(8, 4)) == [[(0, 2)], [(2, 4)], [(4, 6)], [(6, 8)]]
    assert spans(stage_layer_ranges(8, 1)) == [[(0, 8)]]


def test_virtual_chunks_deal_layers_in_virtual_stage_order():
    # virtual stage s = chunk * p + rank holds the s-th slice
    assert spans(stage_layer_ranges(8, 2, 2)) == [[(0, 2), (4, 6)], [(2, 4), (6, 8)]]
    assert spans(stage_layer_ranges(12, 2, 3)) == [[(0, 2), (4, 6), (8, 10)], [(2, 4), (6, 8), (10, 12)]]


def test_uneven_first_and_last_stages():
    assert spans(stage_layer_ranges(10, 4, first_stage_layers=1, last_stage_layers=3)) == [
        [(0, 1)],
        [(1, 4)],
        [(4, 7)],
        [(7, 10)],
    ]
    assert spans(stage_layer_ranges(7, 3, first_stage_layers=1)) == [[(0, 1)], [(1, 4)], [(4, 7)]]
    assert spans(stage_layer_ranges(5, 2, first_stage_layers=2, last_stage_layers=3)) == [[(0, 2)], [(2, 5)]]
    # uneven with virtual chunks: each stage's layers split evenly over its chunks
    assert spans(stage_layer_ranges(12, 3, 2, first_stage_layers=2, last_stage_layers=6)) == [
        [(0, 1), (6, 7)],
        [(1, 3), (7, 9)],
        [(3, 6), (9, 12)],
    ]


@pytest.mark.parametrize(
    "args,kwargs,message",
    [
        ((10, 4), {}, r"num_layers=10 is not divisible by pipeline_model_parallel_size=4"),
        ((8, 4, 3), {}, r"stage 0 holds 2 layers .* virtual_pipeline_model_parallel_size=3"),
        ((4, 4, 2), {}, r"stage 0 holds 1 layers .* virtual_pipeline_model_parallel_size=2"),
        ((10, 4), {"first_stage_layers": 2}, r"leaves 8 layers, which do not divide evenly .* 3 remaining"),
        ((6, 2), {"first_stage_layers": 2, "last_stage_layers": 3}, r"must add up to num_layers=6"),
        ((6, 1), {"first_stage_layers": 2}, r"need pipeline_model_parallel_size > 1 \(got 1\)"),
        (
            (6, 3),
            {"first_stage_layers": 0},
            r"decoder_first_pipeline_num_layers=0 must be in 1..num_layers=6",
        ),
        (
            (9, 2, 2),
            {"first_stage_layers": 3},
            r"stage 0 holds 3 layers .* virtual_pipeline_model_parallel_size=2",
        ),
    ],
)
def test_bad_layouts_name_the_numbers(args, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        stage_layer_ranges(*args, **kwargs)


def fake_groups(pp_size, pp_rank):
    """Groups of one rank of a pp_size pipeline, without torch.distributed: any exchange would fail."""
    return ProcessGroups(
        topology=Topology.create(pp_size, pp_rank, pp=pp_size), pp_ranks=tuple(range(pp_size))
    )


def test_build_model_chunks_calls_the_provider_per_virtual_stage():
    calls = []

    def provider(**kwargs):
        calls.append(kwargs)
        return torch.nn.Linear(1, 1)

    config = ParallelConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    assert len(build_model_chunks(provider, fake_groups(2, 0), config, 8)) == 2
    assert calls == [
        dict(pre_process=True, post_process=False, layer_offset=0, num_layers=2),
        dict(pre_process=False, post_process=False, layer_offset=4, num_layers=2),
    ]
    calls.clear()
    build_model_chunks(provider, fake_groups(2, 1), config, 8)
    assert calls == [
        dict(pre_process=False, post_process=False, layer_offset=2, num_layers=2),
        dict(pre_process=False, post_process=True, layer_offset=6, num_layers=2),
    ]
    calls.clear()
    per_chunk = ParallelConfig(pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1)
    build_model_chunks(provider, fake_groups(2, 1), per_chunk, 8)
    assert [c["layer_offset"] for c in calls] == [1, 3, 5, 7]
    uneven = ParallelConfig(pipeline_model_parallel_size=2, decoder_first_pipeline_num_layers=3)
    calls.clear()
    build_model_chunks(provider, fake_groups(2, 1), uneven, 8)
    assert calls == [dict(pre_process=False, post_process=True, layer_offset=3, num_layers=5)]
    with pytest.raises(ConfigError, match=r"num_layers=7 is not divisible by pipeline_model_parallel_size=2"):
        build_model_chunks(provider, fake_groups(2, 0), ParallelConfig(pipeline_model_parallel_size=2), 7)


def test_selector():
    assert get_forward_backward_func(1) is forward_backward_no_pipelining
    assert get_forward_backward_func(4) is forward_backward_pipelining_without_interleaving
    assert get_forward_backward_func(4, 2) is forward_backward_pipelining_with_interleaving
    with pytest.raises(
        ConfigError, match=r"virtual_pipeline_model_parallel_size=2 needs pipeline_model_parallel_size > 1"
    ):
        get_forward_backward_func(1, 2)


def schedule_kwargs(**overrides):
    kwargs = dict(
        forward_step_func=lambda it, model: pytest.fail("no forward may run"),
        data_iterator=None,
        model=[torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)],
        num_microbatches=3,
        seq_length=4,
        micro_batch_size=1,
        hidden_size=1,
        groups=fake_groups(2, 0),
    )
    return {**kwargs, **overrides}


def test_bad_schedules_fail_before_any_exchange():
    # torch.distributed is not initialized here: reaching an exchange would raise something else
    with pytest.raises(
        ConfigError, match=r"num_microbatches=3 is not divisible by pipeline_model_parallel_size=2"
    ):
        forward_backward_pipelining_with_interleaving(**schedule_kwargs())
    with pytest.raises(
        ConfigError, match=r"the schedule got 2 model chunk\(s\) but virtual_pipeline_model_parallel_size=1"
    ):
        forward_backward_pipelining_without_interleaving(**schedule_kwargs())
    with pytest.raises(ConfigError, match=r"seq_length=5 is not divisible by tensor_model_parallel_size=2"):
        groups = ProcessGroups(topology=Topology.create(4, 0, tp=2, pp=2), pp_ranks=(0, 2))
        forward_backward_pipelining_with_interleaving(
            **schedule_kwargs(groups=groups, num_microbatches=4, seq_length=5, sequence_parallel=True)
        )


class Quadratic(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(2.0))

    def forward(self, x):
        return self.w * x * x


def test_no_pipelining_scales_losses_and_syncs_once():
    events = []

    @contextlib.contextmanager
    def no_sync():
        events.append("no_sync on")
        yield
        events.append("no_sync off")

    model = Quadratic()
    model.w.register_hook(lambda g: events.append("backward") or g)

    def forward_step(data_iterator, chunk):
        x = next(data_iterator)
        return chunk(x), lambda out: (out, {"loss": out.detach()})

    logs = forward_backward_no_pipelining(
        **schedule_kwargs(
            forward_step_func=forward_step,
            data_iterator=iter([torch.tensor(1.0), torch.tensor(2.0), torch.tensor(3.0)]),
            model=model,
            groups=ProcessGroups.single(),
            grad_scale_func=lambda loss: loss * 8.0,
            no_sync_func=no_sync,
            finalize_grads_func=lambda chunks: events.append(f"finalize {len(chunks)}"),
        )
    )
    assert [float(log["loss"]) for log in logs] == [2.0, 8.0, 18.0]
    # d/dw of 8 * mean(w x^2) = 8 * (1 + 4 + 9) / 3
    assert model.w.grad.item() == pytest.approx(8 * 14 / 3)
    assert events == ["no_sync on", "backward", "backward", "no_sync off", "backward", "finalize 1"]

    model.w.grad = None
    logs = forward_backward_no_pipelining(
        **schedule_kwargs(
            forward_step_func=forward_step,
            data_iterator=iter([torch.tensor(1.0)]),
            model=[model],
            num_microbatches=1,
            groups=ProcessGroups.single(),
            forward_only=True,
        )
    )
    assert len(logs) == 1 and model.w.grad is None


def test_schedules_take_one_args_object_or_megatron_keywords():
    from mcore.pipeline import ForwardBackwardArgs

    def forward_step(data_iterator, chunk):
        x = next(data_iterator)
        return chunk(x), lambda out: (out, {"loss": out.detach()})

    def run(schedule_input):
        model = Quadratic()
        fields = schedule_kwargs(
            forward_step_func=forward_step,
            data_iterator=iter([torch.tensor(1.0), torch.tensor(2.0), torch.tensor(3.0)]),
            model=model,
            groups=ProcessGroups.single(),
        )
        if schedule_input == "args":
            logs = forward_backward_no_pipelining(ForwardBackwardArgs(**fields))
        else:
            logs = forward_backward_no_pipelining(**fields)
        return [float(log["loss"]) for log in logs], model.w.grad.item()

    assert run("args") == run("keywords") == ([2.0, 8.0, 18.0], pytest.approx(14 / 3))
    args = ForwardBackwardArgs(**schedule_kwargs())
    with pytest.raises(TypeError, match="not both"):
        forward_backward_pipelining_without_interleaving(args, forward_only=True)
    with pytest.raises(TypeError, match="num_micro_batches"):
        forward_backward_no_pipelining(**{**schedule_kwargs(), "num_micro_batches": 3})


def test_per_chunk_no_sync_is_left_before_each_chunks_last_backward():
    from mcore.pipeline.schedules import _GradSyncControl

    events = []

    def no_sync_of(chunk):
        @contextlib.contextmanager
        def no_sync():
            events.append(f"on {chunk}")
            yield
            events.append(f"off {chunk}")

        return no_sync

    with _GradSyncControl([no_sync_of(0), no_sync_of(1)], 2) as sync:
        sync.before_backward(1, last_of_chunk=False, last_overall=False)
        sync.before_backward(1, last_of_chunk=True, last_overall=False)
        events.append("last backward of chunk 1")
        sync.before_backward(0, last_of_chunk=True, last_overall=True)
        events.append("last backward of chunk 0")
    assert events == [
        "on 0",
        "on 1",
        "off 1",
        "last backward of chunk 1",
        "off 0",
        "last backward of chunk 0",
    ]
    with pytest.raises(ConfigError, match=r"no_sync_func has 1 entries for 2 model chunk"):
        _GradSyncControl([no_sync_of(0)], 2)
