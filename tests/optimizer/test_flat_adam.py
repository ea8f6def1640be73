"""The one-pass Adam over flat buffers and the precision-aware optimizer state.

* the exact fp32 master split (bf16 parameter + int16 remainder) round-trips every bit pattern class;
* the flat reference op gives the per-tensor reference's bits on fp32 state;
* the flat optimizer path equals the per-parameter path (same masters, bit for bit without clipping);
* remainder-stored masters track fp32 masters; bf16 gradients and moments still train;
* a non-finite gradient skips the update on the device, with no host read;
* state dicts round-trip and load across precisions; DP=2 with the distributed optimizer matches DP=1;
* memory: 10 bytes/param with every precision-aware option on.
"""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

from mcore.backend import current_backend
from mcore.config.fields import ConfigError
from mcore.distributed.ddp import DDPConfig, DistributedDataParallel
from mcore.distributed.groups import ProcessGroups
from mcore.ops import reference
from mcore.ops.flat import FlatSegments, join_master, split_master
from mcore.optimizer import OptimizerConfig, PrecisionConfig, build_optimizer

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "ddp"))  # also in spawned ranks
from ddp_toy import build, make_model, train  # noqa: E402

from mcore.config.parallel import ParallelConfig  # noqa: E402
from mcore.distributed.groups import initialize_parallel  # noqa: E402
from mcore.testing.distributed import run_distributed  # noqa: E402

PRECISION_AWARE = dict(
    use_precision_aware_optimizer=True,
    main_grads_dtype="bf16",
    exp_avg_dtype="bf16",
    exp_avg_sq_dtype="bf16",
)
REMAINDERS_ONLY = dict(use_precision_aware_optimizer=True)  # fp32 grads and moments, remainder masters


def _build(
    groups=None, *, precision_aware=None, contiguous=True, clip_grad=0.5, distopt=False, hidden=16, ddp=None
):
    groups = groups or ProcessGroups.single()
    opt_cfg = OptimizerConfig(
        weight_decay=0.1, clip_grad=clip_grad, use_distributed_optimizer=distopt, **(precision_aware or {})
    )
    prec = PrecisionConfig(bf16=True)
    ddp_cfg = DDPConfig(**(ddp or {})).with_training(opt_cfg, prec)
    if not contiguous:  # the per-parameter path: parameters outside a flat buffer
        ddp_cfg = DDPConfig(grad_reduce_in_fp32=True)
    model = DistributedDataParallel(make_model(hidden, dtype=torch.bfloat16), ddp_cfg, groups)
    return model, build_optimizer(opt_cfg, prec, [model], groups, lr=0.01)


def _masters(optimizer) -> torch.Tensor:
    return torch.cat([optimizer.master_of(e).detach().float().clone() for e in optimizer.main_params])


def test_split_join_is_exact_for_every_kind_of_value():
    values = torch.cat(
        [
            torch.randn(10000) * 10.0 ** torch.randint(-30, 30, (10000,)),
            torch.tensor([0.0, -0.0, 1.0, -1.0, float("inf"), -float("inf"), 1e-40, -1e-40, 3.4e38]),
            # exact ties of the bf16 rounding: low half 0x8000
            (torch.randint(0, 2**15, (100,), dtype=torch.int32) << 16 | 0x8000).view(torch.float32),
        ]
    )
    param, remainder = split_master(values)
    assert param.dtype == torch.bfloat16 and remainder.dtype == torch.int16
    assert torch.equal(join_master(param, remainder).view(torch.int32), values.view(torch.int32))
    # the parameter is the master rounded to bf16: within half a bf16 ulp
    finite = torch.isfinite(values) & (values.abs() < 1e38) & (values.abs() > 1e-37)  # normal numbers
    err = (param.float() - values)[finite].abs()
    assert bool((err <= values[finite].abs() * 2.0**-8).all())


def test_flat_reference_equals_per_tensor_adam_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    n = 1000
    grads = torch.randn(n, generator=gen)
    params = torch.randn(n, generator=gen)
    m, v = torch.randn(n, generator=gen) * 0.1, torch.rand(n, generator=gen) * 0.01
    segments = FlatSegments.from_runs([(0, 0, 300, 0), (300, 300, 200, 1), (500, 500, 500, 0)])
    flat = [t.clone() for t in (grads, params, m, v)]
    kw = dict(step=4, beta1=0.9, beta2=0.95, eps=1e-8)
    reference.adam_step_flat(
        flat[0],
        flat[1],
        None,
        None,
        flat[2],
        flat[3],
        segments,
        lrs=[0.01, 0.02],
        weight_decays=[0.1, 0.0],
        **kw,
    )
    for seg, lr, wd in (
        (slice(0, 300), 0.01, 0.1),
        (slice(300, 500), 0.02, 0.0),
        (slice(500, 1000), 0.01, 0.1),
    ):
        reference.adam_step([params[seg]], [grads[seg]], [m[seg]], [v[seg]], lr=lr, weight_decay=wd, **kw)
    for ours, theirs in zip(flat[1:], (params, m, v)):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("clip_grad", [0.0, 0.5])
def test_flat_path_equals_per_parameter_path(clip_grad):
    flat_model, flat_opt = _build(clip_grad=clip_grad)
    ref_model, ref_opt = _build(contiguous=False, clip_grad=clip_grad)
    assert flat_opt.flat and not ref_opt.flat
    groups = ProcessGroups.single()
    a = train(flat_model, flat_opt, groups, 5)
    b = train(ref_model, ref_opt, groups, 5)
    # Bit for bit when one arithmetic serves both paths (the reference ops); a kernel backend's
    # one-pass kernel and its per-tensor fused Adam round differently (sqrt(v/b2) vs sqrt(v)/sqrt(b2)).
    ops = current_backend().ops
    same_arithmetic = {ops.provider("adam_step_flat"), ops.provider("adam_step")} == {"reference"}
    if clip_grad == 0.0 and same_arithmetic:
        assert torch.equal(_masters(flat_opt), _masters(ref_opt))
        assert [h[0] for h in a] == [h[0] for h in b]
        for p, q in zip(flat_model.parameters(), ref_model.parameters()):
            torch.testing.assert_close(p, q, rtol=0.0, atol=0.0)
    else:  # the clipping coefficient is computed on the device in fp32 instead of on the host
        torch.testing.assert_close(_masters(flat_opt), _masters(ref_opt), rtol=1e-5, atol=1e-6)
        if clip_grad > 0.0:  # without clipping neither path computes a norm
            torch.testing.assert_close(float(a[-1][2]), b[-1][2], rtol=1e-5, atol=0.0)
        else:
            assert a[-1][2] is None and b[-1][2] is None


@pytest.mark.parametrize("precision_aware", [None, PRECISION_AWARE], ids=["fp32-grads", "bf16-grads"])
def test_one_rank_clipping_norm_is_the_nan_checks_bucket_norms(monkeypatch, precision_aware):
    """On one rank DDP's NaN check has already read every gradient: the clipping norm is the sum of
    its buckets' squared norms (no second read of the gradients), and equals the norm read again."""
    several_buckets = dict(ddp_bucket_size=100)
    reused_model, reused_opt = _build(precision_aware=precision_aware, ddp=several_buckets)
    read_model, read_opt = _build(
        precision_aware=precision_aware, ddp=dict(several_buckets, check_for_nan_in_loss_and_grad=False)
    )
    assert len(reused_model.buckets) >= 2
    reads = []
    foreach_norm = torch._foreach_norm
    monkeypatch.setattr(torch, "_foreach_norm", lambda *a, **k: reads.append(1) or foreach_norm(*a, **k))
    groups = ProcessGroups.single()
    reused = train(reused_model, reused_opt, groups, 4)
    assert reads == []
    read = train(read_model, read_opt, groups, 4)
    assert reads
    for (loss_a, _, norm_a, _), (loss_b, _, norm_b, _) in zip(reused, read):
        torch.testing.assert_close(float(norm_a), float(norm_b), rtol=1e-5, atol=0.0)
        torch.testing.assert_close(loss_a, loss_b, rtol=1e-5, atol=0.0)
    torch.testing.assert_close(_masters(reused_opt), _masters(read_opt), rtol=1e-5, atol=1e-7)


def test_clipping_norm_reads_the_gradients_when_a_piece_does_not_count():
    """A parameter outside the norm (a tensor-parallel duplicate on rank > 0) means the bucket norms
    are not the clipping norm: the optimizer reads the gradients that count."""
    model, optimizer = _build(precision_aware=PRECISION_AWARE)
    flat = optimizer.flat_states[0]
    assert flat._norm_is_whole_buffer
    first = next(iter(flat.pieces))
    piece = flat.pieces[first]
    flat.pieces[first] = type(piece)(piece.buffer_start, piece.state_start, piece.length, piece.group, False)
    counted = [p for p in flat.pieces.values() if p.counts_in_norm]
    flat._norm_views = flat._merged_grad_views(counted)
    flat._norm_is_whole_buffer = False
    for bucket in flat.buffer.buckets:
        bucket.local_norm_sq = torch.full((), 1e6)
    expected = sum(float(v.float().square().sum()) for v in flat._norm_views)
    got = flat.grad_norm_squared(reuse_bucket_norms=True)
    torch.testing.assert_close(float(got), expected, rtol=1e-6, atol=1e-12)


def test_remainder_masters_track_fp32_masters():
    groups = ProcessGroups.single()
    rem_model, rem_opt = _build(precision_aware=REMAINDERS_ONLY)
    ref_model, ref_opt = _build()
    flat = rem_opt.flat_states[0]
    assert flat.remainders is not None and flat.masters is None
    train(rem_model, rem_opt, groups, 6)
    train(ref_model, ref_opt, groups, 6)
    torch.testing.assert_close(_masters(rem_opt), _masters(ref_opt), rtol=1e-3, atol=1e-4)
    # the masters are not the bf16 parameters: the remainders hold real information
    params = torch.cat([e.model_view().float() for e in rem_opt.main_params])
    assert not torch.equal(params, _masters(rem_opt))
    # and the parameters are the masters rounded to bf16
    hi, _ = split_master(_masters(rem_opt))
    assert torch.equal(params, hi.float())


def test_bf16_gradients_and_moments_train_like_fp32():
    groups = ProcessGroups.single()
    model, optimizer = _build(precision_aware=PRECISION_AWARE)
    flat = optimizer.flat_states[0]
    assert flat.buffer.grad_data.dtype == torch.bfloat16
    assert flat.exp_avg.dtype == torch.bfloat16 and flat.exp_avg_sq.dtype == torch.bfloat16
    ref_model, ref_opt = _build()
    ours = [h[0] for h in train(model, optimizer, groups, 12)]
    theirs = [h[0] for h in train(ref_model, ref_opt, groups, 12)]
    assert ours[-1] < 0.8 * ours[0]
    for a, b in zip(ours, theirs):
        assert abs(a - b) <= 0.03 * abs(b)


def test_nonfinite_gradient_skips_the_update_on_the_device():
    model, optimizer = _build(precision_aware=PRECISION_AWARE)
    groups = ProcessGroups.single()
    train(model, optimizer, groups, 2)
    before = (
        _masters(optimizer),
        [t.clone() for f in optimizer.flat_states for t in (f.exp_avg, f.exp_avg_sq)],
    )
    history = train(model, optimizer, groups, 1, inject_inf_at=(2, 0), start_step=2)
    ok, norm = history[0][1], history[0][2]
    assert optimizer.skips_nonfinite_on_device and ok
    assert not math.isfinite(norm)  # train() reads the lazy device norm
    assert torch.equal(_masters(optimizer), before[0])
    after = [t for f in optimizer.flat_states for t in (f.exp_avg, f.exp_avg_sq)]
    assert all(torch.equal(a, b) for a, b in zip(after, before[1]))
    history = train(model, optimizer, groups, 1, start_step=3)  # and the next step updates again
    assert math.isfinite(history[0][2]) and not torch.equal(_masters(optimizer), before[0])


def test_state_dict_round_trips_and_loads_across_precisions():
    groups = ProcessGroups.single()
    model, optimizer = _build(precision_aware=PRECISION_AWARE)
    train(model, optimizer, groups, 3)
    state = optimizer.state_dict()
    masters = _masters(optimizer)
    item = next(iter(state["state"].values()))
    assert item["main_param"].dtype == torch.float32 and item["exp_avg"].dtype == torch.bfloat16

    for precision_aware in (PRECISION_AWARE, None):  # the same, and fp32 moments with fp32 masters
        fresh_model, fresh = _build(precision_aware=precision_aware)
        fresh_model.load_state_dict(model.state_dict())
        fresh.load_state_dict(state)
        assert torch.equal(_masters(fresh), masters)
        for e, f in zip(optimizer.main_params, fresh.main_params):
            assert torch.equal(e.state["exp_avg"].float(), f.state["exp_avg"].float())
        for p, q in zip(model.parameters(), fresh_model.parameters()):
            if precision_aware is not None:
                assert torch.equal(p, q)
            else:  # the rounding of the same master: ties go to even here, away from zero there
                torch.testing.assert_close(p.float(), q.float(), rtol=2.0**-7, atol=0.0)


def test_memory_is_ten_bytes_per_parameter_with_every_precision_aware_option():
    model, optimizer = _build(precision_aware=PRECISION_AWARE, hidden=64)
    report = optimizer.memory_report()
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert report["params"] == 2 * sum(p.numel() for p in model.parameters())
    assert report["grads"] == 2 * numel
    assert report["optimizer_state"] == 6 * numel  # bf16 m, bf16 v, int16 remainder
    _, fp32 = _build(hidden=64)
    assert fp32.memory_report()["optimizer_state"] == 12 * numel


BF16_MASTERS = dict(PRECISION_AWARE, main_params_dtype="bf16")
"""``--main-params-dtype bf16``: no masters, bf16 moments and gradients: the plain reference's 8 bytes."""


def test_bf16_main_params_step_like_torch_fused_adamw_on_bf16_parameters():
    """``--main-params-dtype bf16`` keeps no master (8 bytes/param) and its step is torch's fused AdamW
    on the bf16 parameters with bf16 state (each element computed in fp32, rounded once): the first
    step's moments bit for bit, the parameters at every step equal but for a few elements one bf16
    ulp apart. Those are rounding ties: the exact update lies within fp32 rounding of the midpoint of
    two bf16 values, and torch's kernel orders the arithmetic differently (``sqrt(v) / sqrt(1 - b2^t)``
    where mcore takes ``sqrt(v / (1 - b2^t))``; the first moment as a lerp), so its fp32 result can
    fall on the other side."""
    groups = ProcessGroups.single()
    model, optimizer = _build(precision_aware=BF16_MASTERS, clip_grad=0.0, hidden=32)
    flat = optimizer.flat_states[0]
    assert flat.masters is None and flat.remainders is None
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert optimizer.memory_report()["optimizer_state"] == 4 * numel  # bf16 m and v, nothing else
    params = [p for p in model.parameters() if p.requires_grad]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in params]
    torch_opt = torch.optim.AdamW(
        [
            {"params": [q for q in theirs if q.dim() > 1], "weight_decay": 0.1},
            {"params": [q for q in theirs if q.dim() <= 1], "weight_decay": 0.0},
        ],
        lr=0.01, betas=(0.9, 0.999), eps=1e-8, fused=True,
    )  # fmt: skip
    for step in range(3):
        before = torch.cat([p.detach().view(-1).float() for p in params])
        train(model, optimizer, groups, 1, start_step=step)
        for p, q in zip(params, theirs):
            q.grad = p.main_grad.detach().view_as(q).clone()
        torch_opt.step()
        ours = torch.cat([p.detach().view(-1) for p in params])
        want = torch.cat([q.detach().view(-1) for q in theirs])
        assert ours.dtype == want.dtype == torch.bfloat16
        assert not torch.equal(ours.float(), before)  # the step moved the weights
        assert (ours != want).sum() <= max(2, numel // 1000)
        torch.testing.assert_close(ours.float(), want.float(), rtol=2.0**-7, atol=0.0)  # one ulp
        if step == 0:
            for e, q in zip(optimizer.main_params, theirs):
                state = torch_opt.state[q]
                assert torch.equal(e.state["exp_avg"], state["exp_avg"].view(-1)[e.start : e.end])
                assert torch.equal(e.state["exp_avg_sq"], state["exp_avg_sq"].view(-1)[e.start : e.end])
        for p, q in zip(params, theirs):  # the next step starts from the same weights
            q.data.copy_(p.detach())
    state = optimizer.state_dict()  # a checkpoint holds the bf16 parameters as fp32 masters, exactly
    item = next(iter(state["state"].values()))
    assert item["main_param"].dtype == torch.float32
    fresh_model, fresh = _build(precision_aware=PRECISION_AWARE, clip_grad=0.0, hidden=32)
    fresh_model.load_state_dict(model.state_dict())
    fresh.load_state_dict(state)
    assert torch.equal(_masters(fresh), _masters(optimizer))


def test_bf16_main_params_need_the_flat_path():
    with pytest.raises(ConfigError, match="--main-params-dtype bf16 needs the one-pass optimizer"):
        _build(precision_aware=BF16_MASTERS, contiguous=False)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(exp_avg_dtype="bf16"), "--exp-avg-dtype bf16 needs --use-precision-aware-optimizer"),
        (dict(main_grads_dtype="bf16"), "--main-grads-dtype bf16 needs --use-precision-aware-optimizer"),
        (
            dict(use_precision_aware_optimizer=True, exp_avg_sq_dtype="fp8"),
            "--exp-avg-sq-dtype fp8 is not supported",
        ),
        (dict(use_precision_aware_optimizer=True, main_params_dtype="fp16"), "--main-params-dtype fp16"),
        (dict(use_precision_aware_optimizer=True, optimizer="sgd"), "needs --optimizer adam"),
    ],
)
def test_config_errors_name_the_flag(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        OptimizerConfig(**kwargs)


def test_precision_aware_needs_bf16():
    opt_cfg = OptimizerConfig(use_precision_aware_optimizer=True)
    with pytest.raises(ConfigError, match="--use-precision-aware-optimizer needs --bf16"):
        DDPConfig().with_training(opt_cfg, PrecisionConfig(fp16=True))


def _dp_run(groups, precision_aware):
    opts = dict(precision_aware or {})
    model, optimizer = build(groups, bf16=True, distopt=groups.dp_size > 1, optimizer_options=opts)
    history = train(model, optimizer, groups, 4)
    return [h[0] for h in history], _masters_by_key(optimizer)


def _masters_by_key(optimizer):
    return {e.key: (e.start, optimizer.master_of(e).float().cpu().clone()) for e in optimizer.main_params}


def _distributed_run(precision_aware):
    groups = initialize_parallel(ParallelConfig())
    return _dp_run(groups, precision_aware)


def test_dp2_distributed_optimizer_matches_dp1_with_remainders():
    ref_losses, ref_masters = _dp_run(ProcessGroups.single(), REMAINDERS_ONLY)
    results = run_distributed(_distributed_run, 2, REMAINDERS_ONLY)
    for losses, masters in results:
        torch.testing.assert_close(losses, ref_losses, rtol=2e-2, atol=0.0)
        for key, (start, value) in masters.items():
            ref = ref_masters[key][1][start : start + value.numel()]
            torch.testing.assert_close(value, ref, rtol=2e-2, atol=2e-3)


def _steps_of(optimizer) -> set[int]:
    return {item["step"] for item in optimizer.state_dict()["state"].values()}


@pytest.mark.parametrize("precision_aware", [None, PRECISION_AWARE], ids=["fp32-state", "precision-aware"])
def test_a_step_skipped_on_the_device_does_not_advance_adam_t(precision_aware):
    """Steps 0..4 with an inf gradient at step 2 (skipped on the device) train exactly like steps 0, 1,
    3, 4 without it: Adam's t, hence the bias correction, counts applied updates only. The
    per-parameter path (which returns before its update) gives the same masters."""
    groups = ProcessGroups.single()
    skipped_model, skipped = _build(precision_aware=precision_aware, clip_grad=0.0)
    history = train(skipped_model, skipped, groups, 5, inject_inf_at=(2, 0))
    assert skipped.skips_nonfinite_on_device and all(h[1] for h in history)  # no host read
    clean_model, clean = _build(precision_aware=precision_aware, clip_grad=0.0)
    train(clean_model, clean, groups, 2)
    train(clean_model, clean, groups, 2, start_step=3)
    assert torch.equal(_masters(skipped), _masters(clean))
    for p, q in zip(skipped_model.parameters(), clean_model.parameters()):
        assert torch.equal(p, q)
    assert _steps_of(skipped) == _steps_of(clean) == {4}

    ops = current_backend().ops
    if precision_aware is None and {ops.provider("adam_step_flat"), ops.provider("adam_step")} == {
        "reference"
    }:
        ref_model, ref = _build(contiguous=False, clip_grad=0.0)
        assert not ref.flat
        train(ref_model, ref, groups, 2)
        train(ref_model, ref, groups, 2, start_step=3)
        assert torch.equal(_masters(skipped), _masters(ref))
        assert _steps_of(ref) == {4}


def test_the_step_counter_survives_a_state_dict_round_trip():
    groups = ProcessGroups.single()
    model, optimizer = _build(clip_grad=0.0)
    train(model, optimizer, groups, 3, inject_inf_at=(1, 0))
    state = optimizer.state_dict()
    fresh_model, fresh = _build(clip_grad=0.0)
    fresh_model.load_state_dict(model.state_dict())
    fresh.load_state_dict(state)
    assert _steps_of(fresh) == {2}
    train(model, optimizer, groups, 2, start_step=3)
    train(fresh_model, fresh, groups, 2, start_step=3)
    assert torch.equal(_masters(fresh), _masters(optimizer))


@pytest.mark.parametrize("step", [1, 2, 3, 10, 1000])
def test_flat_reference_with_a_device_step_equals_the_host_step(step):
    """``step`` as a 0-d device tensor (the optimizer's counter) gives the host int's bits."""
    gen = torch.Generator().manual_seed(step)
    n = 1000
    tensors = [torch.randn(n, generator=gen), torch.randn(n, generator=gen)]
    tensors += [torch.randn(n, generator=gen) * 0.1, torch.rand(n, generator=gen) * 0.01]
    segments = FlatSegments.from_runs([(0, 0, 400, 0), (400, 400, 600, 1)])
    kw = dict(lrs=[0.01, 0.02], weight_decays=[0.1, 0.0], beta1=0.9, beta2=0.95, eps=1e-8)
    host = [t.clone() for t in tensors]
    device = [t.clone() for t in tensors]
    reference.adam_step_flat(host[0], host[1], None, None, host[2], host[3], segments, step=step, **kw)
    reference.adam_step_flat(
        device[0], device[1], None, None, device[2], device[3], segments, step=torch.tensor(step), **kw
    )
    for a, b in zip(host, device):
        assert torch.equal(a, b)


def test_static_loss_scale_with_bf16_is_unscaled_on_the_flat_path():
    """bf16 with ``--loss-scale``: the one-pass step divides the gradients by the scale (the norm it
    reports and clips with is the unscaled one), as the per-parameter path does."""
    groups = ProcessGroups.single()
    scaled_model, scaled = build(groups, bf16=True, loss_scale=1024.0, clip_grad=0.5)
    plain_model, plain = build(groups, bf16=True, clip_grad=0.5)
    assert scaled.flat and plain.flat
    a = train(scaled_model, scaled, groups, 4)
    b = train(plain_model, plain, groups, 4)
    for (_, _, norm_a, _), (_, _, norm_b, _) in zip(a, b):
        torch.testing.assert_close(norm_a, norm_b, rtol=1e-3, atol=0.0)
    torch.testing.assert_close(_masters(scaled), _masters(plain), rtol=1e-4, atol=1e-6)


def test_fp16_overflow_skip_leaves_adam_t_and_weights_as_without_the_step():
    """fp16 (the per-parameter path, a static loss scale so later steps scale alike): an overflowing
    step is skipped and training continues exactly as if the step had not been there."""
    groups = ProcessGroups.single()
    skipped_model, skipped = build(groups, fp16=True, loss_scale=64.0, clip_grad=0.0)
    history = train(skipped_model, skipped, groups, 5, inject_inf_at=(2, 0))
    assert [h[1] for h in history] == [True, True, False, True, True]
    clean_model, clean = build(groups, fp16=True, loss_scale=64.0, clip_grad=0.0)
    train(clean_model, clean, groups, 2)
    train(clean_model, clean, groups, 2, start_step=3)
    assert torch.equal(_masters(skipped), _masters(clean))
    assert _steps_of(skipped) == _steps_of(clean) == {4}
