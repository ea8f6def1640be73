"""FP8: the ``scaled_linear`` op family against a dequantize-matmul-quantize model, the FP8 linear's
numerics and gradients, the delayed recipe's amax history, and the ``--fp8-*`` flags.

The model of an FP8 GEMM used here is written independently of the op table: quantize with
``clamp(x * scale).to(fp8)`` in float64, dequantize, multiply in float64. On the CPU backend (the
reference ops, fp32 sums) results agree to fp32 rounding; ``MCORE_TEST_BACKEND=cuda`` runs the same
checks on ``torch._scaled_mm`` (bf16 outputs: bf16 tolerances).
"""

from __future__ import annotations

import pytest
import torch

from mcore.config.fields import ConfigError
from mcore.fp8.config import Fp8Config, Recipe, check_fp8_backend
from mcore.fp8.linear import Fp8Linear, fp8_linear
from mcore.fp8.scaling import (
    GRAD_OUTPUT,
    INPUT,
    WEIGHT,
    DelayedScaleUpdate,
    Fp8DelayedState,
    scale_from_amax,
    update_fp8_scales,
)
from mcore.plugins.manager import select_backend
from mcore.testing import conformance
from mcore.testing.distributed import test_backend_name as _test_backend_name

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@pytest.fixture(scope="module")
def backend():
    from mcore.backend import set_current_backend

    selected = select_backend(_test_backend_name(), activate=False)
    if "fp8" not in selected.capabilities():
        pytest.skip(f"backend {selected.name!r} has no fp8 capability")
    previous = set_current_backend(selected)
    yield selected
    set_current_backend(previous)


def _model_quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    limit = torch.finfo(dtype).max
    return (x.double() * scale.double()).clamp(-limit, limit).to(dtype)


def _dq(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    return q.double() * scale_inv.double()


def _rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.detach().double().cpu(), expected.detach().double().cpu()
    return ((actual - expected).norm() / expected.norm()).item()


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_quantize_is_the_saturating_cast(backend, dtype):
    dev = backend.device()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(48, 80, generator=gen, dtype=torch.float32) * 3
    x[0, :4] = torch.tensor([1e9, -1e9, 0.0, 1e-12])  # saturate, saturate, zero, underflow
    scale = torch.tensor(37.5)
    want = _model_quantize(x, scale, dtype)
    got = backend.ops.fp8_quantize(x.to(dev), scale.to(dev), dtype).cpu()
    assert got.dtype == dtype and got.is_contiguous()
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert got[0, 0].float() == torch.finfo(dtype).max and got[0, 1].float() == -torch.finfo(dtype).max
    q, qT, scale_inv = backend.ops.fp8_cast(x.to(dev), dtype, scale=scale.to(dev), columnwise=True)
    assert torch.equal(q.cpu().view(torch.uint8), want.view(torch.uint8))
    assert qT.is_contiguous() and torch.equal(qT.cpu().view(torch.uint8), want.t().view(torch.uint8))
    assert scale_inv.item() == scale.reciprocal().item()
    q, qT, _ = backend.ops.fp8_cast(x.to(dev), dtype, scale=scale.to(dev), rowwise=False, columnwise=True)
    assert q is None and torch.equal(qT.cpu().view(torch.uint8), want.t().view(torch.uint8))
    # a transposed view quantizes to the contiguous transpose
    rows = backend.ops.fp8_quantize(x.to(dev).t(), scale.to(dev), dtype).cpu()
    assert rows.is_contiguous() and torch.equal(
        rows.view(torch.uint8), want.t().contiguous().view(torch.uint8)
    )


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("shape", [(48, 80), (130, 272), (1, 16)], ids=["small", "ragged_tiles", "one_row"])
def test_cast_from_amax_forms_the_scale_and_records_amaxes(backend, dtype, shape):
    """``fp8_amax`` then ``fp8_cast(amax=...)``: the current-scaling cast with the scale formed on the
    device (``fp8_max / amax / 2^margin``), byte for byte the independent model; a given scale with
    ``amax_record`` keeps the running max of the amaxes (the delayed recipe's pass-free amax)."""
    dev = backend.device()
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(*shape, generator=gen) * 5).to(torch.bfloat16)
    x[0, 0] = -41.0  # the amax
    amax = backend.ops.fp8_amax(x.to(dev))
    assert amax.dtype == torch.float32 and amax.item() == 41.0
    amax = amax * 0.5  # a smaller (e.g. stale) amax: the largest values saturate
    for margin in (0, 2):
        # fp32, as torch evaluates ``limit / amax``: the reciprocal, then the product
        scale = torch.tensor(20.5).reciprocal() * (torch.finfo(dtype).max / 2**margin)
        want = _model_quantize(x.float(), scale, dtype)
        q, qT, scale_inv = backend.ops.fp8_cast(x.to(dev), dtype, amax=amax, margin=margin, columnwise=True)
        assert torch.equal(q.cpu().view(torch.uint8), want.view(torch.uint8))
        assert torch.equal(qT.cpu().view(torch.uint8), want.t().contiguous().view(torch.uint8))
        assert scale_inv.item() == scale.reciprocal().item()
        limit = torch.finfo(dtype).max
        assert q[0, 0].float().item() == -min(2 * limit / 2**margin, limit)  # saturated without a margin
    # a NaN stays NaN (the NaN check downstream sees it)
    x_nan = x.clone()
    x_nan[-1, -1] = float("nan")
    q, qT, _ = backend.ops.fp8_cast(x_nan.to(dev), dtype, amax=amax, columnwise=True)
    assert torch.isnan(q[-1, -1].float()).item() and torch.isnan(qT[-1, -1].float()).item()
    # a zero or non-finite amax gives the scale 1 (the reference's guard)
    for bad in (0.0, float("inf"), float("nan")):
        _, _, scale_inv = backend.ops.fp8_cast(x.to(dev), dtype, amax=torch.tensor(bad, device=dev))
        assert scale_inv.item() == 1.0
    record = torch.full((3,), 7.0, device=dev)
    slot = record[1:2]
    backend.ops.fp8_cast(x.to(dev), dtype, scale=torch.tensor(2.0, device=dev), amax_record=slot)
    assert record.tolist() == [7.0, 41.0, 7.0]
    backend.ops.fp8_cast((x * 0.01).to(dev), dtype, scale=torch.tensor(2.0, device=dev), amax_record=slot)
    assert record.tolist() == [7.0, 41.0, 7.0]  # a running max


@pytest.mark.parametrize(
    "case", [c for c in conformance.OP_CASES if c.op.startswith("fp8_")], ids=lambda c: c.name
)
def test_fp8_conformance_cases(backend, case):
    """The conformance suite's FP8 cast cases on the selected backend: the same bytes as the reference."""
    for dtype in case.dtypes:
        conformance.check_op(backend, case, dtype)


def _operands(gen, m, n, k, rowwise, a_dtype=E4M3, b_dtype=E4M3):
    a = (torch.randn(m, k, generator=gen) * 100).to(a_dtype)
    b = (torch.randn(n, k, generator=gen) * 100).to(b_dtype)
    if rowwise:
        sa, sb = torch.rand(m, 1, generator=gen) * 1e-2 + 1e-3, torch.rand(n, 1, generator=gen) * 1e-2 + 1e-3
    else:
        sa, sb = torch.tensor(3e-3), torch.tensor(7e-3)
    return a, b, sa, sb


@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
def test_scaled_linear_ops_match_dequantize_matmul(backend, rowwise):
    if rowwise and "fp8_rowwise" not in backend.capabilities():
        pytest.skip(
            f"backend {backend.name!r} lacks the fp8_rowwise capability (a device without per-row FP8 scaling, e.g. pre-Hopper)"
        )
    dev = backend.device()
    gen = torch.Generator().manual_seed(1)
    m, n, k = 64, 48, 32
    tol = 1e-6 if dev.type == "cpu" else 8e-3  # fp32 sums / bf16 outputs
    out_dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16

    x, w, sx, sw = _operands(gen, m, n, k, rowwise)
    bias = torch.randn(n, generator=gen)
    d = [t.to(dev) for t in (x, w, sx, sw)]
    y = backend.ops.scaled_linear_forward(*d, bias.to(dev, out_dtype), out_dtype)
    want = _dq(x, sx) @ _dq(w, sw).t() + bias.to(out_dtype).double()
    assert y.dtype == out_dtype and _rel(y, want) < tol

    dy, wT, sdy, swT = _operands(gen, m, k, n, rowwise, a_dtype=E5M2)
    d = [t.to(dev) for t in (dy, wT, sdy, swT)]
    dx = backend.ops.scaled_linear_dgrad(*d, out_dtype)
    assert _rel(dx, _dq(dy, sdy) @ _dq(wT, swT).t()) < tol

    dyT, xT, sdyT, sxT = _operands(gen, n, k, m, rowwise, a_dtype=E5M2)
    d = [t.to(dev) for t in (dyT, xT, sdyT, sxT)]
    want = _dq(dyT, sdyT) @ _dq(xT, sxT).t()
    assert _rel(backend.ops.scaled_linear_wgrad(*d, out_dtype), want) < tol
    main_grad = torch.randn(n, k, generator=gen)
    acc = main_grad.clone().to(dev)
    out = backend.ops.scaled_linear_wgrad(*d, out_dtype, acc)
    assert out is acc  # in place
    assert _rel(acc, main_grad.double() + want) < max(tol, 1e-6)
    # accumulate=False: the product written over main_grad's (stale) values, equal to adding it to zeros
    for mg_dtype in (torch.float32, torch.bfloat16):
        stale = torch.randn(n, k, generator=gen).to(dev, mg_dtype)
        out = backend.ops.scaled_linear_wgrad(*d, out_dtype, stale, accumulate=False)
        assert out is stale and _rel(stale, want) < max(tol, 1e-6 if mg_dtype == torch.float32 else 8e-3)
        zero = torch.zeros(n, k, dtype=mg_dtype, device=dev)
        assert torch.equal(stale, backend.ops.scaled_linear_wgrad(*d, out_dtype, zero))


def test_scaled_linear_takes_scales_viewed_from_a_table(backend):
    """Per-tensor scale inverses that are views into one fp32 table (as ``--fp8-param-gather`` keeps
    its weights'), at every 4-byte offset: cuBLASLt refuses a scale pointer that is not 16-byte aligned,
    so the CUDA backend must copy such a scale (the GPU run of this test fails without that)."""
    dev = backend.device()
    gen = torch.Generator().manual_seed(3)
    out_dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    x, w, sx, sw = _operands(gen, 64, 48, 32, False)
    x, w = x.to(dev), w.to(dev)
    want = backend.ops.scaled_linear_forward(x, w, sx.to(dev), sw.to(dev), None, out_dtype)
    table = torch.zeros(8, dtype=torch.float32, device=dev)
    for i in range(4):
        table[i] = sw.reshape(())
        got = backend.ops.scaled_linear_forward(x, w, sx.to(dev), table[i], None, out_dtype)
        assert torch.equal(got, want), f"scale at byte offset {4 * i}"
        want_dx = backend.ops.scaled_linear_dgrad(x, w, sw.to(dev), sw.to(dev), out_dtype)
        assert torch.equal(backend.ops.scaled_linear_dgrad(x, w, table[i], table[i], out_dtype), want_dx)


def test_misaligned_gemm_scales_are_copied():
    """The CUDA backend's guard itself (runs on CPU tensors): aligned scales pass through, others are
    copied to fresh (aligned) memory with the same value."""
    from mcore.backends.cuda.fp8.linear import SCALE_ALIGN_BYTES, _aligned_scale

    table = torch.arange(8, dtype=torch.float32)
    assert table.data_ptr() % SCALE_ALIGN_BYTES == 0
    for i in range(8):
        got = _aligned_scale(table[i])
        assert got.data_ptr() % SCALE_ALIGN_BYTES == 0 and got.item() == i
        assert (got.data_ptr() == table[i].data_ptr()) == (i % 4 == 0)


def _fp8_model_linear(x, w, b, dy, recipe: Fp8Config):
    """The FP8 linear written out: current per-tensor (or per-row) scales, quantize, dequantize,
    float64 GEMMs. Returns y, dx, dw, db."""
    fwd, bwd, m = recipe.fwd_dtype, recipe.bwd_dtype, recipe.fp8_margin

    def q(t, dtype, dim=None):
        amax = t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)
        scale = scale_from_amax(amax.float(), dtype, m)
        return _dq(_model_quantize(t, scale, dtype), scale.reciprocal())

    if recipe.recipe is Recipe.ROWWISE:
        y = q(x, fwd, -1) @ q(w, fwd, -1).t()
        dx = q(dy, bwd, -1) @ q(w.t(), fwd, -1).t()
        dw = q(dy.t(), bwd, -1) @ q(x.t(), fwd, -1).t()
    else:
        xq, dyq = q(x, fwd), q(dy, bwd)
        y = xq @ q(w, fwd).t()
        dx = dyq @ q(w, fwd)
        dw = dyq.t() @ xq
    return y + b.double(), dx, dw, dy.double().sum(0)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
def test_fp8_linear_is_the_quantized_model(backend, recipe, fmt):
    if recipe == "rowwise" and "fp8_rowwise" not in backend.capabilities():
        pytest.skip(
            f"backend {backend.name!r} lacks the fp8_rowwise capability (a device without per-row FP8 scaling, e.g. pre-Hopper)"
        )
    dev = backend.device()
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 32, 64, generator=gen).to(dtype)
    w = (torch.randn(48, 64, generator=gen) * 0.05).to(dtype)
    b = torch.randn(48, generator=gen).to(dtype)
    dy = (torch.randn(2, 32, 48, generator=gen) * 1e-3).to(dtype)
    r = Fp8Config(fp8_format=fmt, fp8_recipe=recipe, fp8_margin=1)
    xs, ws, bs = (t.to(dev).requires_grad_() for t in (x, w, b))
    y = fp8_linear(xs, ws, bs, Fp8Linear(r, None, None, "column"))
    y.backward(dy.to(dev))
    want = _fp8_model_linear(x.reshape(-1, 64), w, b, dy.reshape(-1, 48), r)
    tol = 1e-6 if dev.type == "cpu" else 1e-2
    for got, exp, what in zip((y.reshape(-1, 48), xs.grad.reshape(-1, 64), ws.grad, bs.grad), want, "yxwb"):
        assert _rel(got, exp) < tol, what
    # and it is a linear layer: close to the unquantized one (e4m3 keeps 3 mantissa bits)
    exact = x.double() @ w.double().t() + b.double()
    assert 1e-4 < _rel(y, exact) < 0.1


def test_no_fp8_wgrad_keeps_the_weight_gradient_unquantized(backend):
    dev = backend.device()
    gen = torch.Generator().manual_seed(3)
    x, w, dy = torch.randn(64, 32, generator=gen), torch.randn(16, 32, generator=gen), torch.randn(64, 16)
    ws = w.to(dev).requires_grad_()
    y = fp8_linear(
        x.to(dev),
        ws,
        None,
        Fp8Linear(
            Fp8Config(fp8_format="hybrid", fp8_recipe="tensorwise", fp8_wgrad=False), None, None, "row"
        ),
    )
    y.backward(dy.to(dev))
    assert _rel(ws.grad, dy.t() @ x) < (1e-6 if dev.type == "cpu" else 1e-2)


def test_delayed_scaling_uses_the_amax_history(backend):
    """Step 1 runs with scale 1; closing the step puts each role's amax in the history; the next
    step's scales are fp8_max / amax / 2^margin (most_recent) or over the whole history (max)."""
    dev = backend.device()
    for algo in ("most_recent", "max"):
        recipe = Fp8Config(
            fp8_format="hybrid",
            fp8_recipe="delayed",
            fp8_amax_history_len=3,
            fp8_amax_compute_algo=algo,
            fp8_margin=1,
        )
        layer = torch.nn.Module()
        layer.fp8_state = Fp8DelayedState(recipe, device=dev)
        call = Fp8Linear(recipe, layer.fp8_state, None, "column")
        w = torch.randn(16, 32).to(dev).requires_grad_()
        amaxes = []
        for step, mult in enumerate((4.0, 1.0)):
            x = (torch.randn(8, 32) * mult).to(dev)
            dy = torch.randn(8, 16).to(dev) * 1e-2
            before = layer.fp8_state.scale.clone()
            fp8_linear(x, w, None, call).backward(dy)
            amaxes.append(torch.stack([x.abs().max(), w.detach().abs().max(), dy.abs().max()]).cpu())
            if step == 0:
                assert torch.equal(before.cpu(), torch.ones(3))
            update_fp8_scales(layer)
            assert torch.equal(layer.fp8_state.pending_amax.cpu(), torch.zeros(3))
        hist = layer.fp8_state.amax_history.cpu()
        assert torch.equal(hist[0], amaxes[1]) and torch.equal(hist[1], amaxes[0]) and not hist[2].any()
        amax = amaxes[1] if algo == "most_recent" else torch.maximum(*amaxes)
        limits = torch.tensor([448.0, 448.0, 57344.0])
        assert torch.allclose(layer.fp8_state.scale.cpu(), limits / amax / 2, rtol=1e-6)


def test_delayed_scale_update_copies_nothing_from_the_host(monkeypatch):
    """The step boundary must not copy host tensors to the device: on an accelerator such a copy
    (``torch.tensor(list, device=...)``, indexing with a list) waits for the device to drain. The
    states live on the meta device here, so that any op mixing in a host tensor, or a host-to-device
    copy, shows up; two recipes, so that the per-recipe row selection runs too."""
    from torch.utils._python_dispatch import TorchDispatchMode

    recipes = [
        Fp8Config(fp8_format="hybrid", fp8_recipe="delayed", fp8_amax_history_len=4),
        Fp8Config(fp8_format="e4m3", fp8_recipe="delayed", fp8_amax_history_len=4, fp8_margin=1),
    ]
    model = torch.nn.ModuleList(Fp8DelayedState(recipes[i % 2], device="meta") for i in range(5))
    update = DelayedScaleUpdate(model)
    seen = []

    class HostTensors(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            flat = torch.utils._pytree.tree_leaves((args, kwargs or {}))
            devices = {t.device.type for t in flat if isinstance(t, torch.Tensor) and t.dim() > 0}
            seen.append((str(func), devices))
            return func(*args, **(kwargs or {}))

    def from_host(*args, **kwargs):
        raise AssertionError("a tensor built from host data in the step's scale update")

    for name in ("tensor", "as_tensor", "from_numpy"):  # below the dispatcher: the mode cannot see them
        monkeypatch.setattr(torch, name, from_host)
    with HostTensors():
        update()
    monkeypatch.undo()
    assert seen, "the update ran no ops"
    offenders = [(f, d) for f, d in seen if d - {"meta"} or "lift_fresh" in f or "_to_copy" in f]
    assert not offenders, offenders


def test_roles_are_distinct():
    assert len({INPUT, WEIGHT, GRAD_OUTPUT}) == 3


# -- flags ------------------------------------------------------------------------------------------


def _parse(*argv):
    from mcore.training.run_config import parse_run_config

    model = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "8"]
    return parse_run_config([*model, *argv])


def test_megatron_fp8_flags_parse():
    cfg = _parse(
        "--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--fp8-amax-history-len", "16",
        "--fp8-amax-compute-algo", "max", "--fp8-margin", "1", "--no-fp8-wgrad",
        "--first-last-layers-bf16", "--num-layers-at-start-in-bf16", "1", "--num-layers-at-end-in-bf16", "2",
    )  # fmt: skip
    fp8 = cfg.fp8
    assert (fp8.fp8_format, fp8.recipe, fp8.fp8_margin) == ("hybrid", Recipe.DELAYED, 1)
    assert (fp8.fp8_amax_history_len, fp8.fp8_amax_compute_algo, fp8.fp8_wgrad) == (16, "max", False)
    assert fp8.fp8_fused_producers and fp8.fp8_keep_weight_transpose  # the defaults
    assert fp8.bwd_dtype == E5M2 and Fp8Config(fp8_format="e4m3").bwd_dtype == E4M3
    assert [cfg.fp8.layer_in_fp8(i, 4) for i in (1, 2, 3, 4)] == [False, True, False, False]
    assert not _parse().fp8.enabled  # off by default
    assert _parse("--fp8-format", "e4m3").fp8.recipe is Recipe.DELAYED  # Megatron's default recipe


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--fp8-format", "hybrid", "--fp8-recipe", "mxfp8"], "Blackwell"),
        (["--fp8-format", "hybrid", "--fp8-recipe", "blockwise"], "block scaling"),
        (["--fp8-param-gather"], "--fp8-param-gather needs --fp8-format"),
        (["--fp8-format", "hybrid", "--fp8-amax-history-len", "0"], "--fp8-amax-history-len 0"),
        (["--fp8-format", "hybrid", "--fp8-margin", "-1"], "--fp8-margin -1"),
        (["--first-last-layers-bf16"], "needs --fp8-format"),
        (["--fp8-hybrid"], "use --fp8-format hybrid"),
        (["--fp8-interval", "1"], "deprecated"),
        (["--fp8-format", "e5m2"], "invalid choice"),
    ],
)
def test_bad_fp8_flags_get_one_clear_error(argv, message, capsys):
    with pytest.raises(SystemExit) as err:
        _parse(*argv)
    assert err.value.code == 2
    assert message in capsys.readouterr().err


def test_backends_without_fp8_refuse_it():
    recipe = Fp8Config(fp8_format="hybrid", fp8_recipe="tensorwise")
    with pytest.raises(ConfigError, match="backend 'npu' has no 'fp8' capability"):
        check_fp8_backend(recipe, frozenset({"bf16", "fp16"}), "npu")
    with pytest.raises(ConfigError, match="'fp8_rowwise'"):
        check_fp8_backend(Fp8Config(fp8_format="hybrid", fp8_recipe="rowwise"), frozenset({"fp8"}), "cuda")
    with pytest.raises(ConfigError, match="exceed --num-layers 2"):
        Fp8Config(fp8_format="hybrid", first_last_layers_bf16=True, num_layers_at_start_in_bf16=2).check_with(
            2, frozenset({"fp8"}), "cpu"
        )
    check_fp8_backend(None, frozenset(), "npu")  # FP8 off: nothing to refuse


def test_the_simulated_npu_backend_refuses_fp8():
    """SIMULATED torch_npu (no Ascend hardware): the NPU backend has no fp8 capability, so a model
    with --fp8-format is refused with the capability message, before any layer is built."""
    from mcore.backends.npu import simulated
    from mcore.backends.npu.backend import NPUBackend

    from mcore.backend import set_current_backend
    from mcore.distributed.groups import ProcessGroups
    from mcore.models.gpt.gpt_model import GPTModel
    from mcore.models.transformer.model_config import ModelConfig

    with simulated.simulated_torch_npu():
        npu = NPUBackend()
        assert "bf16" in npu.capabilities() and "fp8" not in npu.capabilities()
        previous = set_current_backend(npu)
        try:
            cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8)
            with pytest.raises(ConfigError, match="device backend 'npu' has no 'fp8' capability"):
                GPTModel(cfg, ProcessGroups.single(), 128, device=torch.device("cpu"),
                         fp8=Fp8Config(fp8_format="hybrid"))  # fmt: skip
        finally:
            set_current_backend(previous)
