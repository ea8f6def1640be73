"""Expert parallelism in DDP, the optimizers and the gradient norm: EP/ETP layouts of a hand-built MoE
toy (tests/moe_parallel/moe_toy.py) give the losses, gradient norms and weights of one process.

Expert gradients are reduced over edp (averaged over dp x cp), the distributed optimizer shards them
over edp, and the norm counts each expert once. One 4-rank launch runs every layout in a row.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "ddp"))
from ddp_toy import train  # noqa: E402
from moe_toy import build, logical_weights  # noqa: E402

from mcore.config.parallel import ParallelConfig  # noqa: E402
from mcore.distributed.groups import ProcessGroups, initialize_parallel  # noqa: E402
from mcore.testing.distributed import run_distributed  # noqa: E402

STEPS = 3
# (ep, etp) -> [(name, build kwargs)]: every optimizer path at ep=2, the others once
LAYOUTS = {
    (2, 1): [
        ("allreduce", dict()),
        ("overlap", dict(overlap=True, bucket=40)),
        ("distopt", dict(distopt=True, bucket=40)),
        ("distopt-overlap", dict(distopt=True, overlap=True, bucket=40)),
        ("sgd", dict(optimizer="sgd")),
        ("fp16", dict(fp16=True, distopt=True)),
        ("bf16", dict(bf16=True, distopt=True)),
    ],
    (4, 1): [("distopt", dict(distopt=True)), ("allreduce", dict())],
    (2, 2): [("allreduce", dict()), ("distopt", dict(distopt=True))],
    (1, 1): [("distopt", dict(distopt=True, bucket=40))],
}
PRECISIONS = {"fp16": dict(fp16=True), "bf16": dict(bf16=True)}


def _run(kwargs, groups):
    from mcore.training.params_norm import params_l2_norm

    model, optimizer = build(groups, **kwargs)
    history = train(model, optimizer, groups, STEPS)
    norm = float(params_l2_norm([model], groups, torch.device("cpu")))  # --log-params-norm: experts once
    return history, logical_weights(model, groups), norm


def _references():
    single = ProcessGroups.single()
    refs = {"fp32": _run(dict(), single), "sgd": _run(dict(optimizer="sgd"), single)}
    for name, kwargs in PRECISIONS.items():
        refs[name] = _run(kwargs, single)
    return refs


def _layouts():
    out = {}
    for (ep, etp), configs in LAYOUTS.items():  # new groups per layout, in the same processes
        groups = initialize_parallel(
            ParallelConfig(expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
        )
        sizes = (groups.ep_size, groups.etp_size, groups.edp_size, groups.dp_size)
        for name, kwargs in configs:
            out[(ep, etp, name)] = (*_run(kwargs, groups), sizes)
    return out


def test_expert_parallel_layouts_match_one_process():
    refs = _references()
    results = run_distributed(_layouts, 4, timeout=600)
    for rank, result in enumerate(results):
        for (ep, etp, name), (history, final, params_norm, sizes) in result.items():
            assert sizes == (ep, etp, 4 // (ep * etp), 4)
            ref_key = name if name in PRECISIONS or name == "sgd" else "fp32"
            ref_history, ref_weights, ref_params_norm = refs[ref_key]
            tol = dict(rel=2e-2, abs=1e-3) if ref_key in PRECISIONS else dict(rel=1e-5, abs=1e-6)
            for (loss, ok, norm, _), (ref_loss, ref_ok, ref_norm, _) in zip(history, ref_history):
                assert ok == ref_ok, (rank, ep, etp, name)
                assert loss == pytest.approx(ref_loss, **tol), (rank, ep, etp, name)
                if ref_norm is not None:
                    assert norm == pytest.approx(ref_norm, **tol), (rank, ep, etp, name)
            assert params_norm == pytest.approx(ref_params_norm, rel=tol["rel"]), (rank, ep, etp, name)
            wtol = dict(rtol=3e-2, atol=3e-2) if ref_key in PRECISIONS else dict(rtol=1e-5, atol=1e-6)
            for key, value in final.items():
                torch.testing.assert_close(
                    value, ref_weights[key], **wtol, msg=f"{rank} {ep} {etp} {name} {key}"
                )
