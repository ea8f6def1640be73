"""Loss scaling, bf16 and optimizer-state resharding with data parallelism (real processes, gloo)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "ddp"))  # ddp_toy, here and in the spawned ranks
from ddp_toy import build, train, weights  # noqa: E402

from mcore.config.parallel import ParallelConfig  # noqa: E402
from mcore.distributed.groups import ProcessGroups, initialize_parallel  # noqa: E402
from mcore.testing.distributed import run_distributed  # noqa: E402
from mcore.testing.distributed import test_backend_name as backend_under_test  # noqa: E402


def _fp16_overflow():
    groups = initialize_parallel(ParallelConfig())
    out = {}
    for distopt in (False, True):
        model, optimizer = build(groups, distopt=distopt, fp16=True, hysteresis=1, initial_loss_scale=2.0**12)
        snapshots = []
        # an inf in one gradient on data-parallel rank 1 only, at step 2
        history = train(model, optimizer, groups, 5, inject_inf_at=(2, 1), snapshots=snapshots)
        out[distopt] = (history, snapshots, optimizer.loss_scale)
    return out


def test_fp16_overflow_on_one_rank_skips_that_step_everywhere():
    for rank_result in run_distributed(_fp16_overflow, 2):
        for distopt, (history, snapshots, final_scale) in rank_result.items():
            assert [ok for _, ok, _, _ in history] == [True, True, False, True, True], distopt
            assert history[2][2] is None  # no grad norm for a skipped step
            for key in snapshots[1]:
                assert torch.equal(snapshots[2][key], snapshots[1][key])  # nothing moved
                assert not torch.equal(snapshots[3][key], snapshots[2][key]) or key == "frozen"
            scales = [scale for _, _, _, scale in history]
            assert scales == [2.0**12] * 3 + [2.0**11] * 2 and final_scale == 2.0**11
            assert history[4][0] < history[0][0]  # training went on


def _bf16(distopt):
    groups = initialize_parallel(ParallelConfig())
    model, optimizer = build(groups, distopt=distopt, bf16=True, overlap=True, bucket=50)
    history = train(model, optimizer, groups, 4)
    masters = {e.key: (e.start, e.end, e.main.cpu()) for e in optimizer.main_params}
    return history, weights(model), masters


def test_bf16_distributed_optimizer_matches_one_process():
    ref_model, ref_opt = build(ProcessGroups.single(), bf16=True)
    ref_history = train(ref_model, ref_opt, ProcessGroups.single(), 4)
    ref_masters = {e.key: e.main for e in ref_opt.main_params}
    results = run_distributed(_bf16, 2, True)
    # the reference runs here, on the host: ranks on an accelerator compute bf16 matmuls differently
    tol = 1e-4 if backend_under_test() == "cpu" else 1e-2
    for history, final, masters in results:
        for (loss, ok, _, _), (ref_loss, _, _, _) in zip(history, ref_history):
            assert ok and loss == pytest.approx(ref_loss, rel=1e-2)
        for key, (start, end, main) in masters.items():  # fp32 masters: each rank its own piece
            torch.testing.assert_close(main, ref_masters[key][start:end], rtol=tol, atol=tol / 10)
        for key, value in final.items():
            torch.testing.assert_close(value, results[0][1][key], rtol=0, atol=0)  # params all-gathered
    pieces = sum(end - start for _, _, masters in results for start, end, _ in masters.values())
    assert pieces == sum(e.main.numel() for e in ref_opt.main_params)  # the shards tile the model


def _reshard():
    groups = initialize_parallel(ParallelConfig())
    replicated, opt_a = build(groups)
    train(replicated, opt_a, groups, 2)
    saved_model, saved_opt = weights(replicated), opt_a.state_dict()
    train(replicated, opt_a, groups, 2, start_step=2)

    # replicated state -> this rank's shards of the distributed optimizer
    sharded, opt_b = build(groups, distopt=True, overlap=True, bucket=50)
    sharded.load_state_dict(saved_model)
    opt_b.load_state_dict(saved_opt)
    train(sharded, opt_b, groups, 2, start_step=2)

    # the same layout, from the sharded state itself
    state_b = opt_b.state_dict()
    again, opt_c = build(groups, distopt=True, overlap=True, bucket=50)
    again.load_state_dict(weights(sharded))
    opt_c.load_state_dict(state_b)
    round_trip = all(
        torch.equal(state_b["state"][k]["exp_avg"], v["exp_avg"]) and state_b["state"][k]["step"] == v["step"]
        for k, v in opt_c.state_dict()["state"].items()
    )

    # the gathered (data-parallel-unsharded) state: every parameter whole, like the replicated one
    gathered, replicated_state = opt_b.gathered_state_dict(), opt_a.state_dict()
    back, opt_d = build(groups)
    back.load_state_dict(weights(sharded))
    opt_d.load_state_dict(gathered)
    return (
        weights(replicated),
        weights(sharded),
        round_trip,
        _cpu(gathered["state"]),
        _cpu(replicated_state["state"]),
    )


def _cpu(state):
    return {
        k: {n: v.cpu() if isinstance(v, torch.Tensor) else v for n, v in item.items()}
        for k, item in state.items()
    }


def test_optimizer_state_reshards_between_replicated_and_distributed():
    for replicated, sharded, round_trip, gathered, reference in run_distributed(_reshard, 2):
        assert round_trip
        for key, value in replicated.items():
            torch.testing.assert_close(sharded[key], value, rtol=1e-5, atol=1e-6)
        assert sorted(gathered) == sorted(reference)
        for key, item in gathered.items():
            assert item["range"] == reference[key]["range"] and item["step"] == reference[key]["step"] == 4
            for name in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(item[name], reference[key][name], rtol=1e-4, atol=1e-9)
