"""The optimizer in one process: Adam/SGD against torch.optim, weight-decay groups, clipping against
torch.nn.utils.clip_grad_norm_, the loss-scaler state machine, and config validation."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mcore.config.fields import ConfigError
from mcore.distributed.ddp import DDPConfig, DistributedDataParallel
from mcore.distributed.groups import ProcessGroups
from mcore.optimizer import (
    ConstantGradScaler,
    DynamicGradScaler,
    LossScaleUnderflowError,
    OptimizerConfig,
    PrecisionConfig,
    build_grad_scaler,
    build_optimizer,
)
from mcore.optimizer.grad_scaler import underflow_error


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.Tanh(), nn.Linear(7, 3))


def _torch_groups(model: nn.Module, weight_decay: float):
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    no_decay = [p for n, p in model.named_parameters() if p.dim() == 1]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _random_grads(model: nn.Module, step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return [torch.randn(p.shape, generator=gen) for p in model.parameters()]


@pytest.mark.parametrize("wrap", [False, True], ids=["plain", "ddp"])
@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_step_matches_torch_optim(kind, wrap):
    ours, theirs = _model(), _model()
    cfg = OptimizerConfig(optimizer=kind, weight_decay=0.1, clip_grad=0.0, sgd_momentum=0.9)
    groups = ProcessGroups.single()
    chunk = DistributedDataParallel(ours, DDPConfig(), groups) if wrap else ours
    optimizer = build_optimizer(cfg, PrecisionConfig(), [chunk], groups, lr=0.01)
    if kind == "adam":
        reference = torch.optim.AdamW(_torch_groups(theirs, 0.1), lr=0.01, betas=(0.9, 0.999), eps=1e-8)
    else:
        reference = torch.optim.SGD(_torch_groups(theirs, 0.1), lr=0.01, momentum=0.9)
    for step in range(6):
        grads = _random_grads(ours, step)
        optimizer.zero_grad()
        for p, q, g in zip(ours.parameters(), theirs.parameters(), grads):
            if wrap:
                p.main_grad.copy_(g)
            else:
                p.grad = g.clone()
            q.grad = g.clone()
        ok, norm, zeros = optimizer.step()
        reference.step()
        assert ok and norm is None and zeros is None
        if step == 3:  # the scheduler's way of changing the learning rate
            for group in optimizer.param_groups:
                group["lr"] = 0.003
            for group in reference.param_groups:
                group["lr"] = 0.003
    for p, q in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_no_weight_decay_on_biases_and_norms():
    model = _model()
    optimizer = build_optimizer(
        OptimizerConfig(weight_decay=0.05), PrecisionConfig(), [model], ProcessGroups.single()
    )
    names = {id(p): n for n, p in model.named_parameters()}
    decay, no_decay = optimizer.param_groups
    assert sorted(names[id(p)] for p in decay["params"]) == ["0.weight", "3.weight"]
    assert sorted(names[id(p)] for p in no_decay["params"]) == ["0.bias", "1.bias", "1.weight", "3.bias"]
    assert (decay["weight_decay"], decay["wd_mult"]) == (0.05, 1.0)
    assert (no_decay["weight_decay"], no_decay["wd_mult"]) == (0.0, 0.0)


def test_clipping_matches_torch_clip_grad_norm():
    ours, theirs = _model(), _model()
    # plain SGD with lr 1: the update is exactly the clipped gradient
    cfg = OptimizerConfig(optimizer="sgd", sgd_momentum=0.0, weight_decay=0.0, clip_grad=0.3)
    optimizer = build_optimizer(cfg, PrecisionConfig(), [ours], ProcessGroups.single(), lr=1.0)
    grads = _random_grads(ours, 0)
    for p, q, g in zip(ours.parameters(), theirs.parameters(), grads):
        p.grad, q.grad = g.clone(), g.clone()
    expected_norm = torch.nn.utils.clip_grad_norm_(list(theirs.parameters()), 0.3)
    ok, norm, _ = optimizer.step()
    assert ok and norm == pytest.approx(expected_norm.item(), rel=1e-6)
    for p, q in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(p, q.detach() - q.grad, rtol=1e-6, atol=1e-7)


def test_bf16_params_keep_fp32_masters():
    model = _model().to(torch.bfloat16)
    prec = PrecisionConfig(bf16=True)
    chunk = DistributedDataParallel(
        model, DDPConfig().with_training(OptimizerConfig(), prec), ProcessGroups.single()
    )
    optimizer = build_optimizer(
        OptimizerConfig(clip_grad=0.0), prec, [chunk], ProcessGroups.single(), lr=1e-4
    )
    assert all(p.main_grad.dtype == torch.float32 for p in model.parameters())  # bf16 forces fp32 grads
    before = [e.main.clone() for e in optimizer.main_params]
    for p in model.parameters():
        p.main_grad.fill_(1.0)
    optimizer.step()
    for entry, old in zip(optimizer.main_params, before):
        assert entry.main.dtype == torch.float32
        assert not torch.equal(entry.main, old)  # a 1e-4 step is below bf16 resolution, not fp32's
        assert torch.equal(entry.model_view(), entry.main.to(torch.bfloat16))
    state = optimizer.state_dict()
    assert all(item["main_param"].dtype == torch.float32 for item in state["state"].values())


def test_state_dict_round_trip():
    model = _model()
    cfg = OptimizerConfig()
    optimizer = build_optimizer(cfg, PrecisionConfig(), [model], ProcessGroups.single(), lr=0.01)
    for step in range(2):
        for p, g in zip(model.parameters(), _random_grads(model, step)):
            p.grad = g
        optimizer.step()
    state = optimizer.state_dict()
    assert state["format"] == "mcore.optimizer/1" and state["state"]["0.weight"]["step"] == 2
    assert state["state"]["0.weight"]["range"] == (0, 35)
    fresh = build_optimizer(cfg, PrecisionConfig(), [model], ProcessGroups.single())
    fresh.load_state_dict(state)
    for a, b in zip(optimizer.main_params, fresh.main_params):
        assert a.state["step"] == b.state["step"]
        assert torch.equal(a.state["exp_avg_sq"], b.state["exp_avg_sq"])
    assert fresh.param_groups[0]["lr"] == 0.01
    with pytest.raises(ValueError, match="--optimizer adam, this run uses --optimizer sgd"):
        build_optimizer(
            OptimizerConfig(optimizer="sgd"), PrecisionConfig(), [model], ProcessGroups.single()
        ).load_state_dict(state)


def test_dynamic_scaler_hysteresis_and_window():
    scaler = DynamicGradScaler(initial_scale=1024.0, min_scale=256.0, window=3, hysteresis=2)
    scaler.update(True)
    assert scaler.scale == 1024.0  # the first overflow is tolerated (hysteresis 2)
    scaler.update(True)
    assert scaler.scale == 512.0
    scaler.update(True)
    assert scaler.scale == 256.0  # hysteresis is only re-armed by growth
    scaler.update(True)
    assert scaler.scale == 256.0  # never below min_scale
    for _ in range(2):
        scaler.update(False)
    assert scaler.scale == 256.0
    scaler.update(False)
    assert scaler.scale == 512.0  # window of 3 clean steps
    scaler.update(True)
    assert scaler.scale == 512.0  # re-armed hysteresis
    restored = DynamicGradScaler(1.0, 1.0, 3, 2)
    restored.load_state_dict(scaler.state_dict())
    assert restored.state_dict() == scaler.state_dict()


def test_build_grad_scaler():
    assert build_grad_scaler(PrecisionConfig()) is None
    assert build_grad_scaler(PrecisionConfig(bf16=True)) is None
    assert isinstance(build_grad_scaler(PrecisionConfig(fp16=True)), DynamicGradScaler)
    static = build_grad_scaler(PrecisionConfig(fp16=True, loss_scale=128.0))
    assert isinstance(static, ConstantGradScaler) and static.scale == 128.0
    assert build_grad_scaler(PrecisionConfig(fp16=True)).scale == 2.0**32


def _fp16_step(loss_scale: float | None, clip_grad: float, steps: int = 1) -> tuple[bool, nn.Module]:
    """``steps`` real fp16 steps (backward of the scaled loss) with a static ``loss_scale``."""
    model = _model().half()
    precision = PrecisionConfig(fp16=True, loss_scale=loss_scale)
    optimizer = build_optimizer(
        OptimizerConfig(clip_grad=clip_grad), precision, [model], ProcessGroups.single(), lr=0.01
    )
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(0)).half()
    for _ in range(steps):
        optimizer.zero_grad()
        optimizer.scale_loss(model(x).float().square().mean()).backward()
        ok, _, _ = optimizer.step()
    return ok, model


@pytest.mark.parametrize("clip_grad", [1.0, 0.0], ids=["clipping", "no-clipping"])
def test_a_static_loss_scale_that_underflows_every_gradient_is_an_error(clip_grad):
    before = [p.detach().clone() for p in _model().half().parameters()]
    # 2**-30: every fp16 gradient of this model underflows to zero (fp16's smallest subnormal is 2**-24)
    with pytest.raises(
        LossScaleUnderflowError, match=r"every gradient is zero at loss scale 9\.31323e-10"
    ) as info:
        _fp16_step(2.0**-30, clip_grad)
    assert "raise --loss-scale 9.31323e-10" in str(info.value) and "dynamic loss scale" in str(info.value)
    assert isinstance(info.value, ConfigError)  # pretrain ends with this one line, exit status 2
    # a usable static scale trains (and the check, without clipping, costs only the first step)
    ok, model = _fp16_step(1024.0, clip_grad, steps=3)
    assert ok and any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_a_dynamic_scale_at_its_floor_that_underflows_names_min_loss_scale():
    scaler = DynamicGradScaler(2.0**-30, 2.0**-30, 1000, 2)
    assert "raise --min-loss-scale 9.31323e-10" in str(underflow_error(scaler))


def test_config_validation_names_values():
    with pytest.raises(ConfigError, match="--fp16 and --bf16 are mutually exclusive"):
        PrecisionConfig(fp16=True, bf16=True)
    with pytest.raises(ConfigError, match="min_loss_scale=8.0 must be <= initial_loss_scale=4.0"):
        PrecisionConfig(fp16=True, initial_loss_scale=4.0, min_loss_scale=8.0)
    with pytest.raises(ConfigError, match="--loss-scale 8.0 needs --fp16 or --bf16"):
        PrecisionConfig(loss_scale=8.0)
    with pytest.raises(ConfigError, match=r"--loss-scale 1e-39 is below 2\^-126"):
        PrecisionConfig(bf16=True, loss_scale=1e-39)
    PrecisionConfig(bf16=True, loss_scale=2.0**-126)  # the smallest normal fp32: its inverse fits
    with pytest.raises(ConfigError, match="adam_beta2=1.0 must be in"):
        OptimizerConfig(adam_beta2=1.0)
    with pytest.raises(ConfigError, match="--overlap-param-gather needs --use-distributed-optimizer"):
        OptimizerConfig(overlap_param_gather=True)
    with pytest.raises(ConfigError, match="ddp_bucket_size=0"):
        DDPConfig(ddp_bucket_size=0)
    assert PrecisionConfig(bf16=True).params_dtype == torch.bfloat16
    assert PrecisionConfig(fp16=True).grads_in_fp32 is False
    assert PrecisionConfig(fp16=True, accumulate_allreduce_grads_in_fp32=True).grads_in_fp32 is True


def test_distributed_optimizer_needs_distributed_ddp():
    model = DistributedDataParallel(_model(), DDPConfig(), ProcessGroups.single())
    with pytest.raises(ConfigError, match="model chunk 0 has use_distributed_optimizer=False"):
        build_optimizer(
            OptimizerConfig(use_distributed_optimizer=True),
            PrecisionConfig(),
            [model],
            ProcessGroups.single(),
        )
