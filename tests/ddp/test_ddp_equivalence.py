"""Data parallelism (DP=2, DP=4; replicated and distributed optimizer; overlap on and off) gives the
losses and weights of one process accumulating gradients over the same global batch.

Each distributed run trains several configurations one after the other in the same processes, to
keep the number of process launches (the slow part on a 2-core CI machine) small.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # ddp_toy, here and in the spawned ranks (importlib mode)
from ddp_toy import build, train, weights  # noqa: E402

from mcore.config.parallel import ParallelConfig  # noqa: E402
from mcore.distributed.groups import ProcessGroups, initialize_parallel  # noqa: E402
from mcore.testing.distributed import run_distributed  # noqa: E402

STEPS = 4

# name -> build() keyword arguments. Bucket sizes of 50 elements make several buckets and
# parameters that straddle the distributed optimizer's shard boundaries.
CONFIGS = {
    "allreduce": dict(),
    "allreduce-buckets": dict(bucket=50),
    "allreduce-overlap": dict(overlap=True, bucket=50),
    "distopt": dict(distopt=True),
    "distopt-buckets": dict(distopt=True, bucket=50),
    "distopt-overlap": dict(distopt=True, overlap=True, bucket=50),
    "distopt-overlap-gather": dict(distopt=True, overlap=True, bucket=50, overlap_param_gather=True),
}


def _reference():
    model, optimizer = build(ProcessGroups.single())
    history = train(model, optimizer, ProcessGroups.single(), STEPS)
    return history, weights(model)


def _run_configs(names):
    groups = initialize_parallel(ParallelConfig())
    out = {}
    for name in names:
        model, optimizer = build(groups, **CONFIGS[name])
        history = train(model, optimizer, groups, STEPS)
        out[name] = (history, weights(model), model.started_in_backward, model.gathers_in_flight)
    return out


def _check_against_reference(results, reference):
    ref_history, ref_weights = reference
    for rank_result in results:
        for name, (history, final, _, _) in rank_result.items():
            for (loss, ok, norm, _), (ref_loss, _, ref_norm, _) in zip(history, ref_history):
                assert ok
                assert loss == pytest.approx(ref_loss, rel=1e-6, abs=1e-7), name
                assert norm == pytest.approx(ref_norm, rel=1e-5), name
            for key, value in final.items():
                torch.testing.assert_close(value, ref_weights[key], rtol=1e-5, atol=1e-6, msg=f"{name} {key}")


@pytest.fixture(scope="module")
def reference():
    return _reference()


def test_dp2_matches_gradient_accumulation(reference):
    results = run_distributed(_run_configs, 2, list(CONFIGS))
    _check_against_reference(results, reference)
    # overlapped runs have several buckets, and all but the one holding the unused parameter (the
    # last: buckets follow the reverse order of parameters) were reduced during backward
    for name in ("allreduce-overlap", "distopt-overlap"):
        started = results[0][name][2]
        assert len(started) >= 3 and started[:-1] == [True] * (len(started) - 1) and not started[-1], name
    assert not any(results[0]["allreduce-buckets"][2])
    # overlap on and off give bit-identical weights
    for a, b in (("allreduce-buckets", "allreduce-overlap"), ("distopt-buckets", "distopt-overlap")):
        for key, value in results[0][a][1].items():
            assert torch.equal(value, results[0][b][1][key]), (a, b, key)


def test_dp4_matches_gradient_accumulation(reference):
    results = run_distributed(_run_configs, 4, ["allreduce-overlap", "distopt", "distopt-overlap-gather"])
    _check_against_reference(results, reference)
    # with --overlap-param-gather the step returns with the all-gathers in flight (the next forward
    # waits for each bucket in its modules' pre-hooks); without it they are done
    assert results[0]["distopt-overlap-gather"][3] == len(results[0]["distopt-overlap-gather"][2])
    assert results[0]["distopt"][3] == 0


def _memory(hidden):
    groups = initialize_parallel(ParallelConfig())
    reports = {}
    for distopt in (False, True):
        _, optimizer = build(groups, distopt=distopt, hidden=hidden)
        reports[distopt] = optimizer.memory_report()
    return reports


def test_distributed_optimizer_state_is_one_over_dp():
    results = run_distributed(_memory, 4, 96)
    replicated = results[0][False]["optimizer_state"]
    sharded = [r[True]["optimizer_state"] for r in results]
    assert sum(sharded) == replicated  # every element's moments live on exactly one rank
    for per_rank in sharded:
        assert per_rank == pytest.approx(replicated / 4, rel=0.05)


@pytest.mark.parametrize("name", ["allreduce-overlap", "distopt-overlap-gather"])
def test_trained_model_is_freed_by_the_garbage_collector(name):
    """Nothing outside the model, its optimizer and the caller keeps a DDP model alive.

    The gradient hooks sit on the parameters' C++ side, which the collector cannot traverse; had they
    held DDP strongly, the model, its buffers and its process groups (gloo worker threads) would live
    until interpreter exit, where a worker releasing a finished collective aborts the process.
    """
    import gc
    import weakref

    groups = ProcessGroups.single()
    model, optimizer = build(groups, **CONFIGS[name])
    train(model, optimizer, groups, 2)
    alive = weakref.ref(model)
    del model, optimizer
    gc.collect()
    assert alive() is None


@pytest.mark.parametrize("overlap", [False, True])
def test_small_gradients_are_added_in_batches_before_anything_reads_them(overlap, monkeypatch):
    """Gradients no larger than ``_BATCHED_ADD_MAX_ELEMENTS`` are queued by the hook and added with one
    multi-tensor add at the end of each backward pass (or before a bucket's reduction starts); larger
    ones are added at once. Either way ``main_grad`` equals the sum of the micro-batches' gradients."""
    import copy

    from mcore.distributed import ddp as ddp_module
    from mcore.distributed.ddp import DDPConfig, DistributedDataParallel

    monkeypatch.setattr(ddp_module, "_BATCHED_ADD_MAX_ELEMENTS", 16)  # the 16x16 weight is not small
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    wrapped = DistributedDataParallel(
        copy.deepcopy(plain),
        DDPConfig(overlap_grad_reduce=overlap, ddp_bucket_size=40 if overlap else None),
        ProcessGroups.single(),
    )
    adds = []
    real_foreach_add = torch._foreach_add_
    monkeypatch.setattr(torch, "_foreach_add_", lambda a, b: (adds.append(len(a)), real_foreach_add(a, b)))
    xs = [torch.randn(5, 6) for _ in range(2)]
    for x in xs:
        plain(x).square().sum().backward()
    with wrapped.no_sync():
        wrapped(xs[0]).square().sum().backward()
    assert not wrapped._queued_adds  # flushed when that backward ended
    wrapped(xs[1]).square().sum().backward()
    wrapped.finish_grad_sync()
    assert not wrapped._queued_adds
    small = [p for p in wrapped.module.parameters() if p.numel() <= 16]
    assert sum(adds) == 2 * len(small) and len(adds) < 2 * len(small)  # batched, every small one twice
    for (name, p), ref in zip(wrapped.module.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.main_grad, ref.grad, msg=name)
        assert p.grad is None
