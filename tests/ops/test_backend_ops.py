"""Every op of a backend's table against the reference, forward and backward, in fp32/bf16/fp16.

``MCORE_TEST_BACKEND`` (default ``cpu``) picks the backend whose table the first tests check. Each
op runs on inputs in the tested dtype; its output and input gradients are compared with the
reference op run on the same values upcast to float64 (``gold``), by the norm-wise relative error
``||out - gold|| / ||gold||`` against a bound per dtype. On the CPU backend this checks the
reference ops' own precision; on a GPU it checks the backend's kernels.

The tests marked ``needs a CUDA device`` select the cuda backend explicitly (whatever
``MCORE_TEST_BACKEND`` says) and check its fused kernels at training-sized shapes too, the fallbacks,
dropout's RNG behaviour, cross-entropy's memory and ``compile_layer``. On a machine without a CUDA
device they are skipped with that reason.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch

from mcore.ops import reference
from mcore.ops.registry import OP_NAMES
from mcore.testing import conformance

BACKEND = os.environ.get("MCORE_TEST_BACKEND", "cpu")
HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
BOUNDS = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2, torch.float16: 2.5e-3}
"""Norm-wise relative error bounds: about four times one rounding of the output in that dtype."""


# --- cases ----------------------------------------------------------------------------------------


@dataclass
class Case:
    """One call of op ``op``: ``make(gen, dtype, device)`` returns ``(args, kwargs)``.

    Float tensors in ``args`` that ``grad`` names (by position) get gradients compared as well.
    """

    op: str
    id: str
    make: Callable
    grad: tuple[int, ...] = ()
    scale: float = 1.0  # multiplies the dtype's bound (ops whose outputs round more than once)
    dtypes: tuple[str, ...] = ("fp32", "bf16", "fp16")
    big: bool = False  # training-sized: run only on a GPU
    kwargs_grad: dict = field(default_factory=dict)


def _t(gen, *shape, dtype, device, scale=1.0, shift=0.0):
    return (torch.randn(*shape, generator=gen) * scale + shift).to(dtype=dtype, device=device)


def _freqs(s, r, device, base=10000.0):
    inv = 1.0 / (base ** (torch.arange(0, r, 2, dtype=torch.float32) / r))
    ang = torch.outer(torch.arange(s, dtype=torch.float32), inv)
    return torch.cat([ang, ang], dim=-1).to(device)


def _labels(gen, shape, v, device, ignore_every=7):
    labels = torch.randint(0, v, shape, generator=gen)
    flat = labels.view(-1)
    flat[::ignore_every] = -100
    return labels.to(device)


def _cases() -> list[Case]:
    c: list[Case] = []

    def norm_args(m, n, bias=True, wdtype=None):
        def make(gen, dt, dev):
            x = _t(gen, *m, n, dtype=dt, device=dev, scale=2.0, shift=0.5)
            w = _t(gen, n, dtype=wdtype or dt, device=dev, scale=0.3, shift=1.0)
            b = _t(gen, n, dtype=wdtype or dt, device=dev, scale=0.3) if bias else None
            return (x, w, b, 1e-5), {}

        return make

    def rms_args(m, n, wdtype=None):
        def make(gen, dt, dev):
            x = _t(gen, *m, n, dtype=dt, device=dev, scale=2.0)
            w = _t(gen, n, dtype=wdtype or dt, device=dev, scale=0.3, shift=1.0)
            return (x, w, 1e-6), {}

        return make

    c += [
        Case("layer_norm", "3x37x96", norm_args((3, 37), 96), grad=(0, 1, 2)),
        Case("layer_norm", "no_bias_5x1000", norm_args((5,), 1000, bias=False), grad=(0, 1)),
        Case("layer_norm", "fp32_params_4x256", norm_args((4,), 256, wdtype=torch.float32), grad=(0, 1, 2)),
        Case("layer_norm", "8192x2048", norm_args((8192,), 2048), grad=(0, 1, 2), big=True),
        Case("rms_norm", "3x37x96", rms_args((3, 37), 96), grad=(0, 1), scale=1.5),
        Case("rms_norm", "2x5000", rms_args((2,), 5000), grad=(0, 1), scale=1.5),
        Case("rms_norm", "fp32_weight_4x256", rms_args((4,), 256, torch.float32), grad=(0, 1), scale=1.5),
        Case("rms_norm", "8192x2048", rms_args((8192,), 2048), grad=(0, 1), scale=1.5, big=True),
    ]
    # (norm(x), x): the backward sums the residual's gradient into dx
    c += [
        Case("layer_norm_with_residual", "3x37x96", norm_args((3, 37), 96), grad=(0, 1, 2)),
        Case("layer_norm_with_residual", "no_bias_5x1000", norm_args((5,), 1000, bias=False), grad=(0, 1)),
        Case("layer_norm_with_residual", "8192x2048", norm_args((8192,), 2048), grad=(0, 1, 2), big=True),
        Case("rms_norm_with_residual", "3x37x96", rms_args((3, 37), 96), grad=(0, 1), scale=1.5),
        Case(
            "rms_norm_with_residual", "8192x2048", rms_args((8192,), 2048), grad=(0, 1), scale=1.5, big=True
        ),
    ]

    def rotary_args(s, b, n, d, r, freqs_shape="s11r", noncontig=False):
        def make(gen, dt, dev):
            if noncontig:  # q as a slice of a fused [s, b, n, 3d] projection
                x = _t(gen, s, b, n, 3 * d, dtype=dt, device=dev)[..., d : 2 * d]
            else:
                x = _t(gen, s, b, n, d, dtype=dt, device=dev)
            f = _freqs(s, r, dev)
            if freqs_shape == "s11r":
                f = f.view(s, 1, 1, r)
            elif freqs_shape == "sb1r":
                f = (f.view(s, 1, 1, r) + torch.arange(b, device=dev).view(1, b, 1, 1) * 0.1).contiguous()
            elif freqs_shape == "r":
                f = f[3]
            return (x, f), {}

        return make

    c += [
        Case("rotary_embedding", "full", rotary_args(6, 2, 3, 16, 16), grad=(0,)),
        Case("rotary_embedding", "partial", rotary_args(5, 2, 4, 32, 16), grad=(0,)),
        Case("rotary_embedding", "odd_dims", rotary_args(7, 3, 5, 24, 12), grad=(0,)),
        Case(
            "rotary_embedding", "noncontig_qkv_slice", rotary_args(6, 2, 3, 16, 16, noncontig=True), grad=(0,)
        ),
        Case("rotary_embedding", "freqs_per_batch", rotary_args(4, 3, 2, 16, 16, "sb1r"), grad=(0,)),
        Case("rotary_embedding", "freqs_1d", rotary_args(4, 3, 2, 16, 8, "r"), grad=(0,)),
        Case("rotary_embedding", "2048x4x16x128", rotary_args(2048, 4, 16, 128, 128), grad=(0,), big=True),
    ]

    def swiglu_args(m, f):
        return lambda gen, dt, dev: ((_t(gen, *m, 2 * f, dtype=dt, device=dev, scale=2.0),), {})

    c += [
        Case("swiglu", "3x7x300", swiglu_args((3, 7), 300), grad=(0,), scale=1.5),
        Case("swiglu", "4x2048", swiglu_args((4,), 2048), grad=(0,), scale=1.5),
        Case("swiglu", "8192x5632", swiglu_args((8192,), 5632), grad=(0,), scale=1.5, big=True),
    ]

    def weighted_swiglu_args(m, f):
        def make(gen, dt, dev):
            x = _t(gen, m, 2 * f, dtype=dt, device=dev, scale=2.0)
            return (x, torch.rand(m, generator=gen).to(dev)), {}  # fp32 probabilities

        return make

    c += [
        Case("weighted_swiglu", "37x300", weighted_swiglu_args(37, 300), grad=(0, 1), scale=1.5),
        Case("weighted_swiglu", "5x2048", weighted_swiglu_args(5, 2048), grad=(0, 1), scale=1.5),
        Case("weighted_swiglu", "0x64", weighted_swiglu_args(0, 64), grad=(0, 1), scale=1.5),
        Case(
            "weighted_swiglu",
            "16384x1024",
            weighted_swiglu_args(16384, 1024),
            grad=(0, 1),
            scale=1.5,
            big=True,
        ),
    ]

    def gelu_args(m, n, bias, approximate):
        def make(gen, dt, dev):
            x = _t(gen, *m, n, dtype=dt, device=dev, scale=2.0)
            b = _t(gen, n, dtype=dt, device=dev) if bias else None
            return (x, b, approximate), {}

        return make

    for approximate in ("none", "tanh"):
        c += [
            Case(
                "bias_gelu",
                f"{approximate}_5x33x200",
                gelu_args((5, 33), 200, True, approximate),
                grad=(0, 1),
                scale=1.5,
            ),
            Case(
                "bias_gelu", f"{approximate}_nobias_9x77", gelu_args((9,), 77, False, approximate), grad=(0,)
            ),
        ]
    c.append(
        Case(
            "bias_gelu",
            "none_8192x8192",
            gelu_args((8192,), 8192, True, "none"),
            grad=(0, 1),
            scale=1.5,
            big=True,
        )
    )

    def bda_args(m, n, bias, p, training):
        def make(gen, dt, dev):
            x = _t(gen, *m, n, dtype=dt, device=dev)
            b = _t(gen, n, dtype=dt, device=dev) if bias else None
            r = _t(gen, *m, n, dtype=dt, device=dev)
            return (x, b, r, p, training), {}

        return make

    c += [
        Case(
            "bias_dropout_add",
            "eval_bias_4x9x64",
            bda_args((4, 9), 64, True, 0.1, False),
            grad=(0, 1, 2),
            scale=1.5,
        ),
        Case("bias_dropout_add", "p0_train_nobias_3x50", bda_args((3,), 50, False, 0.0, True), grad=(0, 2)),
    ]

    def attn_args(b, n, g, sq, sk, d, causal=True, mask=False, bias=False):
        def make(gen, dt, dev):
            q = _t(gen, b, n, sq, d, dtype=dt, device=dev)
            k = _t(gen, b, g, sk, d, dtype=dt, device=dev)
            v = _t(gen, b, g, sk, d, dtype=dt, device=dev)
            kw = {"causal": causal}
            if mask:
                m = torch.zeros(b, 1, 1, sk, dtype=torch.bool, device=dev)
                m[0, ..., -3:] = True
                kw["mask"] = m
            if bias:
                kw["bias"] = _t(gen, 1, n, sq, sk, dtype=dt, device=dev)
            return (q, k, v), kw

        return make

    c += [
        Case("attention", "causal", attn_args(2, 4, 4, 16, 16, 32), grad=(0, 1, 2), scale=1.5),
        Case(
            "attention", "noncausal", attn_args(2, 4, 4, 16, 16, 32, causal=False), grad=(0, 1, 2), scale=1.5
        ),
        Case("attention", "gqa", attn_args(2, 4, 2, 16, 16, 32), grad=(0, 1, 2), scale=1.5),
        Case(
            "attention", "padding_mask", attn_args(2, 2, 2, 12, 12, 16, mask=True), grad=(0, 1, 2), scale=1.5
        ),
        Case("attention", "bias", attn_args(2, 2, 1, 12, 12, 16, bias=True), grad=(0, 1, 2), scale=1.5),
        Case("attention", "sq_lt_sk", attn_args(1, 2, 2, 5, 13, 16), grad=(0, 1, 2), scale=1.5),
    ]

    def ce_args(m, v, smoothing):
        def make(gen, dt, dev):
            logits = _t(gen, *m, v, dtype=dt, device=dev, scale=3.0)
            return (logits, _labels(gen, m, v, dev), smoothing), {}

        return make

    c += [
        Case("cross_entropy", "3x5x1000", ce_args((3, 5), 1000, 0.0), grad=(0,)),
        Case("cross_entropy", "smooth_7x5003", ce_args((7,), 5003, 0.1), grad=(0,)),
        Case("cross_entropy", "2048x50304", ce_args((2048,), 50304, 0.0), grad=(0,), big=True),
        Case("cross_entropy", "smooth_1024x50304", ce_args((1024,), 50304, 0.1), grad=(0,), big=True),
    ]
    return c


CASES = _cases()
SMALL = [c for c in CASES if not c.big]


def _rel_err(out: torch.Tensor, gold: torch.Tensor) -> float:
    out, gold = out.double(), gold.double()
    if not torch.isfinite(out).all():
        return math.inf
    return ((out - gold).norm() / gold.norm().clamp_min(1e-30)).item()


def check_case(fn: Callable, case: Case, dtype: torch.dtype, device, seed: int = 0) -> dict[str, float]:
    """Run ``fn`` and the float64 reference on one case; assert the bounds; return the errors."""
    gen = torch.Generator().manual_seed(seed)
    args, kwargs = case.make(gen, dtype, device)
    args = list(args)
    for i in case.grad:
        args[i] = args[i].detach().requires_grad_()
    gold_args = [a.detach().double().requires_grad_(a.requires_grad) if _is_float(a) else a for a in args]
    gold_kwargs = {k: (v.double() if _is_float(v) else v) for k, v in kwargs.items()}

    out = fn(*args, **kwargs)
    gold = getattr(reference, case.op)(*gold_args, **gold_kwargs)
    expected = getattr(reference, case.op)(
        *[_meta(a) for a in args], **{k: _meta(v) for k, v in kwargs.items()}
    )
    # ops with several outputs (the norms' ``*_with_residual``) are checked output by output
    outs, golds, expected = (t if isinstance(t, tuple) else (t,) for t in (out, gold, expected))
    assert len(outs) == len(golds)
    bound = BOUNDS[dtype] * case.scale
    errors = {}
    for k, (o, g, e) in enumerate(zip(outs, golds, expected)):
        assert o.shape == g.shape, (k, o.shape, g.shape)
        assert o.dtype == e.dtype, (k, o.dtype, e.dtype)
        errors["out" if len(outs) == 1 else f"out{k}"] = _rel_err(o, g)
    if case.grad:
        dys = [torch.randn(o.shape, generator=gen).to(device=device, dtype=o.dtype) for o in outs]
        grads = torch.autograd.grad(outs, [args[i] for i in case.grad], dys)
        gold_grads = torch.autograd.grad(golds, [gold_args[i] for i in case.grad], [d.double() for d in dys])
        for i, g, gg in zip(case.grad, grads, gold_grads):
            assert g.dtype == args[i].dtype and g.shape == args[i].shape
            errors[f"grad{i}"] = _rel_err(g, gg)
    bad = {k: v for k, v in errors.items() if not v <= bound}
    assert not bad, f"{case.op}[{case.id}] {dtype}: relative errors {bad} exceed {bound:.1e} (all: {errors})"
    return errors


def _is_float(a) -> bool:
    return isinstance(a, torch.Tensor) and a.is_floating_point()


def _meta(a):
    return a.detach().to("meta") if isinstance(a, torch.Tensor) else a


# --- the selected backend's table -----------------------------------------------------------------


@pytest.fixture(scope="module")
def backend():
    from mcore.plugins.manager import select_backend

    return select_backend(BACKEND, activate=False)


def test_every_op_has_cases():
    # the Adam steps, the in-place cross-entropy's two ops (test_cross_entropy_ops.py) and the weight-gradient
    # accumulation (tests/tensor_parallel/test_grad_accumulation_fusion.py) and the FP8 ops
    # (tests/ops/test_scaled_linear.py) have their own tests
    others = {
        "fp8_quantize",
        "fp8_quantize_flat",  # these two: tests/ops/test_fp8_flat*.py, mcore.testing.conformance
        "fp8_dequantize_flat",
        "fp8_amax",
        "fp8_cast",
        "fp8_cast_dbias",
        "fp8_cast_packed",  # tests/ops/test_fp8_cast_interpret.py, mcore.testing.conformance
        "fp8_transpose",  # the same two
        "scaled_linear_forward",
        "scaled_linear_dgrad",
        "scaled_linear_wgrad",
        "adam_step",
        "adam_step_flat",
        "adam_step_flat_fp8",  # test_backend_adam_step_flat_fp8_matches_reference, tests/ops/test_adam_flat_fp8.py
        "cross_entropy_local_stats",
        "cross_entropy_grad_inplace_",
        "accumulate_weight_grad",
        "norm_fp8_forward",  # these two: tests/ops/test_norm_fp8_interpret.py
        "norm_backward",
        "act_fp8_forward",  # tests/ops/test_act_fp8_interpret.py
        "act_fp8_backward",
        "moe_topk_routing",  # the MoE ops: tests/ops/test_moe_reference.py, mcore.testing.conformance
        "moe_permute",
        "moe_unpermute",
        "grouped_gemm",
        "scaled_grouped_gemm",  # the experts' FP8 GEMMs: tests/moe/test_moe_fp8.py, conformance
        "scaled_grouped_gemm_wgrad",
        # context parallelism: mcore.testing.conformance, tests/ops/test_attention_lse*.py
        "attention_with_lse",
        "attention_with_lse_backward",
        "attention_merge",
    }
    assert {c.op for c in CASES} | others == set(OP_NAMES)


def _valid(cases, big_in_bf16_only=False):
    """(case, dtype) pairs each op is defined for; training-sized shapes only in bf16."""
    pairs = [
        (c, d)
        for c in cases
        for d in DTYPES
        if d in c.dtypes and not (big_in_bf16_only and c.big and d != "bf16")
    ]
    return pytest.mark.parametrize(("case", "dtype"), pairs, ids=[f"{c.op}-{c.id}-{d}" for c, d in pairs])


@_valid(SMALL)
def test_backend_op_matches_reference(backend, case, dtype):
    check_case(backend.ops[case.op], case, DTYPES[dtype], backend.device())


def _adam_check(adam_step, device, decoupled: bool):
    gen = torch.Generator().manual_seed(3)
    shapes = [(33, 17), (1000,), (4, 5, 6)]
    params = [torch.randn(*s, generator=gen).to(device) for s in shapes]
    ref_params = [p.clone() for p in params]
    m, v = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    rm, rv = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    hp = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, decoupled_weight_decay=decoupled)
    for step in range(1, 6):
        grads = [torch.randn(*s, generator=gen).to(device) for s in shapes]
        adam_step(params, [g.clone() for g in grads], m, v, step=step, **hp)
        reference.adam_step(ref_params, [g.clone() for g in grads], rm, rv, step=step, **hp)
    for got, want in zip(params + m + v, ref_params + rm + rv):
        assert _rel_err(got, want) < 1e-5


@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
def test_backend_adam_step_matches_reference(backend, decoupled):
    _adam_check(backend.ops.adam_step, backend.device(), decoupled)


# --- the cuda backend's dispatchers without a GPU ------------------------------------------------


def test_cuda_dispatchers_fall_back_to_reference_on_cpu_tensors(monkeypatch):
    """CPU tensors through the cuda op table give the reference's result exactly (no Triton needed)."""
    from mcore.backends.cuda import device as cuda_device
    from mcore.backends.cuda import ops as cuda_ops

    # under TRITON_INTERPRET the dispatchers would run the Triton kernels on CPU tensors: not this test
    monkeypatch.setattr(cuda_device, "INTERPRET", False)
    for case in SMALL:
        if case.op not in cuda_ops.ALL_OPS:
            continue
        gen = torch.Generator().manual_seed(1)
        args, kwargs = case.make(gen, torch.float32, "cpu")
        got = cuda_ops.ALL_OPS[case.op](*args, **kwargs)
        want = getattr(reference, case.op)(*args, **kwargs)
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"{case.op}[{case.id}]")
    _adam_check(cuda_ops.adam_step, "cpu", True)


def test_cuda_backend_declares_capabilities_without_a_device():
    from mcore.backends.cuda import CUDABackend, extensions

    caps = CUDABackend().capabilities()
    assert "compile_layers" in caps
    assert ("fused_rms_norm" in caps) == extensions.triton_available()


def test_importing_the_cuda_backend_imports_no_triton():
    code = (
        "import sys, torch; before = 'triton' in sys.modules; "
        "import mcore, mcore.backends.cuda, mcore.backends.cuda.ops; "
        "from mcore.plugins.manager import installed_backends; installed_backends(); "
        "assert 'mcore.backends.cuda.triton_kernels' not in sys.modules; "
        "assert before or 'triton' not in sys.modules, 'triton imported'"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


# --- the cuda backend on a GPU ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def cuda_backend():
    from mcore.plugins.manager import select_backend

    return select_backend("cuda", activate=False)


def test_cuda_op_table_serves_every_triton_kernel():
    """The CUDA backend's table, built without a GPU: with Triton installed (the test extra), every op
    with a Triton kernel is served by it. One FP8 fused-producer op left to the reference turns the
    whole fused FP8 path off on the GPU (``mcore.fp8.producers``: the pair must be served alike),
    which a GPU run notices only as a slower step."""
    from mcore.backends.cuda import extensions
    from mcore.backends.cuda import ops as cuda_ops

    assert extensions.triton_available(), "the test extra installs Triton"
    table, providers = cuda_ops._build()
    kernels = {
        *cuda_ops._TRITON_OPS,
        "fp8_amax", "fp8_cast", "fp8_cast_dbias", "fp8_cast_packed", "fp8_transpose",
        "norm_fp8_forward", "norm_backward", "act_fp8_forward", "act_fp8_backward",
    }  # fmt: skip
    for op in sorted(kernels):
        assert providers.get(op) == "triton" and op in table, op


@needs_cuda
def test_cuda_op_providers(cuda_backend):
    from mcore.backends.cuda import extensions

    assert cuda_backend.ops.provider("adam_step") in ("cuda:torch-fused", "cuda:apex")
    assert cuda_backend.ops.provider("attention") in ("cuda:torch-sdpa", "cuda:flash-attn")
    expected = "cuda:triton" if extensions.triton_available() else "reference"
    for op in (
        "rms_norm",
        "layer_norm",
        "rms_norm_with_residual",
        "layer_norm_with_residual",
        "rotary_embedding",
        "swiglu",
        "weighted_swiglu",
        "bias_gelu",
        "bias_dropout_add",
        "cross_entropy",
    ):
        assert cuda_backend.ops.provider(op) == expected, op


@needs_cuda
@_valid(CASES, big_in_bf16_only=True)
def test_cuda_op_matches_reference(cuda_backend, case, dtype):
    check_case(cuda_backend.ops[case.op], case, DTYPES[dtype], torch.device("cuda"))


@needs_cuda
@pytest.mark.parametrize(
    "op",
    [
        "rms_norm",
        "layer_norm",
        "rms_norm_with_residual",
        "layer_norm_with_residual",
        "rotary_embedding",
        "swiglu",
        "weighted_swiglu",
        "bias_gelu",
        "bias_dropout_add",
        "cross_entropy",
    ],
)
def test_cuda_ops_run_their_triton_kernels(cuda_backend, op):
    """The dispatcher took the kernel, not the fallback: the autograd node is the kernel's Function."""
    pytest.importorskip("triton")
    case = next(c for c in CASES if c.op == op)
    args, kwargs = case.make(torch.Generator().manual_seed(0), torch.bfloat16, torch.device("cuda"))
    args = [a.requires_grad_() if i == 0 else a for i, a in enumerate(args)]
    out = cuda_backend.ops[op](*args, **kwargs)
    out = out[0] if isinstance(out, tuple) else out
    assert "Function" in type(out.grad_fn).__name__, type(out.grad_fn).__name__


@needs_cuda
def test_cuda_dropout_follows_torch_rng_and_rescales(cuda_backend):
    bda = cuda_backend.ops.bias_dropout_add
    p = 0.3
    gen = torch.Generator().manual_seed(5)
    # 8192 rows: the backward tunes its own tiling, which must regenerate the forward's mask anyway.
    x = torch.randn(8192, 1000, generator=gen).cuda().to(torch.bfloat16).requires_grad_()
    b = torch.randn(1000, generator=gen).cuda().to(torch.bfloat16).requires_grad_()
    r = torch.randn(8192, 1000, generator=gen).cuda().to(torch.bfloat16).requires_grad_()
    torch.manual_seed(1234)
    y1 = bda(x, b, r, p, True)
    torch.manual_seed(1234)
    y2 = bda(x, b, r, p, True)
    y3 = bda(x, b, r, p, True)
    assert torch.equal(y1, y2), "same torch seed, same mask"
    assert not torch.equal(y2, y3), "the generator advances between calls"
    dy = torch.randn_like(y1)
    gx, gb, gr = torch.autograd.grad(y1, (x, b, r), dy)
    assert torch.equal(gr, dy)
    kept = gx != 0  # the backward regenerates the forward's mask from the saved seed
    frac = kept.float().mean().item()
    assert abs(frac - (1 - p)) < 0.005, frac
    scale = 1.0 / (1.0 - p)
    dropped = torch.where(kept, ((x + b).float() * scale).to(torch.bfloat16).float(), 0.0)
    expect_y = (r.float() + dropped).to(torch.bfloat16)
    assert _rel_err(y1, expect_y) < 1e-3
    expect_gx = torch.where(kept, dy.float() * scale, 0.0)
    assert _rel_err(gx, expect_gx) < 1e-2
    assert _rel_err(gb, expect_gx.sum(0)) < 1e-2


@needs_cuda
def test_cuda_cross_entropy_keeps_no_fp32_logits(cuda_backend):
    pytest.importorskip("triton")
    m, v = 4096, 50304
    logits = torch.randn(m, v, device="cuda", dtype=torch.bfloat16).requires_grad_()
    labels = torch.randint(0, v, (m,), device="cuda")
    logits_bytes = logits.numel() * logits.element_size()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = cuda_backend.ops.cross_entropy(logits, labels).mean()
    fwd_peak = torch.cuda.max_memory_allocated() - base
    loss.backward()
    peak = torch.cuda.max_memory_allocated() - base
    assert fwd_peak < 0.01 * logits_bytes, fwd_peak  # forward: per-row loss and lse only
    assert peak < 1.1 * logits_bytes, peak  # backward: the bf16 gradient, no fp32 copy (2x)
    assert logits.grad.dtype == torch.bfloat16


@needs_cuda
def test_cuda_ops_fall_back_for_unsupported_inputs(cuda_backend):
    ops = cuda_backend.ops
    x = torch.randn(4, 8, device="cuda", dtype=torch.float64)
    w = torch.ones(8, device="cuda", dtype=torch.float64)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5))
    wide = torch.randn(2, 20000, device="cuda")
    torch.testing.assert_close(
        ops.rms_norm(wide, torch.ones(20000, device="cuda"), 1e-5),
        reference.rms_norm(wide, torch.ones(20000, device="cuda"), 1e-5),
    )
    xr = torch.randn(3, 2, 4, 8, device="cuda")
    f = torch.randn(3, 1, 4, 8, device="cuda")  # angles per (position, head): a kernel case too
    torch.testing.assert_close(ops.rotary_embedding(xr, f), reference.rotary_embedding(xr, f))
    f.requires_grad_()  # a gradient for the angles: only the reference gives one
    out = ops.rotary_embedding(xr, f)
    torch.testing.assert_close(out, reference.rotary_embedding(xr, f))
    assert out.grad_fn is not None and "Function" not in type(out.grad_fn).__name__


class _Block(torch.nn.Module):
    """A small pre-norm transformer block that calls the op table like mcore's layers."""

    def __init__(self, h=256, heads=4, ffn=512):
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.Parameter(torch.ones(h))
        self.qkv = torch.nn.Linear(h, 3 * h)
        self.proj = torch.nn.Linear(h, h)
        self.norm2 = torch.nn.Parameter(torch.ones(h))
        self.fc1 = torch.nn.Linear(h, 2 * ffn)
        self.fc2 = torch.nn.Linear(ffn, h)

    def forward(self, x, freqs):
        from mcore.backend import get_ops

        ops = get_ops()
        s, b, h = x.shape
        y = ops.rms_norm(x, self.norm1, 1e-5)
        q, k, v = self.qkv(y).view(s, b, self.heads, 3 * h // self.heads).chunk(3, dim=-1)
        q, k = ops.rotary_embedding(q, freqs), ops.rotary_embedding(k, freqs)
        a = ops.attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), causal=True)
        x = ops.bias_dropout_add(self.proj(a.permute(2, 0, 1, 3).reshape(s, b, h)), None, x, 0.0, True)
        y = ops.rms_norm(x, self.norm2, 1e-5)
        return ops.bias_dropout_add(self.fc2(ops.swiglu(self.fc1(y))), None, x, 0.0, True)


@needs_cuda
def test_compile_layer_matches_eager(cuda_backend):
    from mcore.backends.cuda.compile import compile_layer

    from mcore.backend import set_current_backend

    previous = set_current_backend(cuda_backend)
    try:
        torch.manual_seed(0)
        blocks = [_Block().cuda().to(torch.bfloat16) for _ in range(3)]
        eager = [_Block().cuda().to(torch.bfloat16) for _ in range(3)]
        for e, blk in zip(eager, blocks):
            e.load_state_dict(blk.state_dict())
        keys = list(blocks[0].state_dict())
        for blk in blocks:
            assert "compile_layers" in cuda_backend.capabilities()
            cuda_backend.compile_layer(blk)
        assert list(blocks[0].state_dict()) == keys, "compiling renamed the parameters"
        assert compile_layer is not None
        x = torch.randn(64, 2, 256, device="cuda", dtype=torch.bfloat16)
        freqs = _freqs(64, 64, "cuda").view(64, 1, 1, 64)
        xc, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
        yc, ye = xc, xe
        for blk, e in zip(blocks, eager):
            yc, ye = blk(yc, freqs), e(ye, freqs)
        assert _rel_err(yc, ye) < 2e-2
        dy = torch.randn_like(yc)
        yc.backward(dy)
        ye.backward(dy)
        assert _rel_err(xc.grad, xe.grad) < 3e-2
        assert _rel_err(blocks[0].norm1.grad, eager[0].norm1.grad) < 3e-2
    finally:
        set_current_backend(previous)


_FLAT_ADAM_CASES = [c for c in conformance.OP_CASES if c.op == "adam_step_flat"]


@pytest.mark.parametrize("case", _FLAT_ADAM_CASES, ids=[c.name for c in _FLAT_ADAM_CASES])
def test_backend_adam_step_flat_matches_reference(backend, case):
    """fp32 state, fp32 masters beside bf16 parameters, and the precision-aware storage (bf16
    gradients and moments, int16 remainders), with a gap between segments and two groups."""
    conformance.check_op(backend, case, torch.float32)


_FLAT_ADAM_FP8_CASES = [c for c in conformance.OP_CASES if c.op == "adam_step_flat_fp8"]


@pytest.mark.parametrize("case", _FLAT_ADAM_FP8_CASES, ids=[c.name for c in _FLAT_ADAM_FP8_CASES])
def test_backend_adam_step_flat_fp8_matches_reference(backend, case):
    """The flat step writing the FP8 weights' bytes and amax (fp32 masters, and the precision-aware
    storage): the step as the flat step's cases check it, the bytes and the amax exactly those of the
    parameters the backend wrote, every byte outside the FP8 pieces untouched."""
    conformance.check_op(backend, case, torch.float32)
