"""The backend conformance kit: what every device-backend plugin must pass, runnable in its own CI.

Subclass :class:`BackendConformance` in a test module of your plugin and name your backend::

    from mcore.testing.conformance import BackendConformance

    class TestMyChipConformance(BackendConformance):
        backend_name = "mychip"

``pytest`` then runs, against ``select_backend("mychip")``:

* **ops**: every op of the table (:data:`OP_CASES`: norms, rotary with partial/position-id angles,
  activations, attention with causal/padding/explicit masks, GQA/MQA, a KV-cache
  shape, cross-entropy, the Adam step) on the backend's device, against the pure-PyTorch
  references computed in fp32 on the CPU from the same inputs, forward and input gradients, in
  fp32 and in each of bf16/fp16 the backend claims (:data:`TOLERANCES` per dtype);
* **interface**: the :class:`~mcore.backend.DeviceBackend` attributes and methods, device placement,
  and the optional interfaces behind the capabilities it claims (``compile_layers``:
  ``compile_layer``; ``device_graphs``: ``graph``, ``graph_pool``, ``side_stream``);
* **RNG**: save/restore of the device RNG state and the tensor-parallel RNG tracker's streams;
* **memory statistics**: the keys, types and invariants of ``memory_stats()``;
* **collectives**: a 2-process run on the backend's ``dist_backend`` (all-reduce, all-gather,
  reduce-scatter, broadcast, point-to-point), through :func:`mcore.testing.distributed.run_distributed`;
* **training**: 2 steps of ``pretrain`` with tensor parallelism 2 (and sequence parallelism) of a tiny
  GPT on mock data, whose losses must equal the CPU backend's within ``training_rtol``.

The checks are plain functions too (``check_op``, ``check_rng``, ...), so a smoke script on real
hardware can call them without pytest's class machinery. A test that needs a set-up in each
spawned process (a simulated device module, say) sets :attr:`BackendConformance.rank_setup` to a
module-level function.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist

from mcore.backend import BackendBase, DeviceBackend, current_backend
from mcore.ops import reference
from mcore.ops.registry import OP_NAMES
from mcore.testing.distributed import run_distributed

# torch >= 2.12 renamed the single-tensor collectives (as mcore.tensor_parallel.mappings does).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_CAPABILITY = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}

TOLERANCES: dict[str, dict[torch.dtype, tuple[float, float]]] = {
    # (rtol, atol) against an fp32 reference computed from the same (rounded) inputs.
    "elementwise": {
        torch.float32: (1e-4, 1e-5),
        torch.float16: (2e-3, 2e-3),
        torch.bfloat16: (1.6e-2, 1.6e-2),
    },
    "reduction": {
        torch.float32: (1e-4, 1e-4),
        torch.float16: (1e-2, 1e-2),
        torch.bfloat16: (3e-2, 3e-2),
    },
}
"""fp32 follows the vendor op tests' usual 1e-4; half precisions allow about one rounding of the
output (elementwise) or of accumulated values (reductions, attention, gradients)."""


class ConformanceError(AssertionError):
    """A backend does not behave as the op table or the DeviceBackend protocol says."""


# --- op cases ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OpCase:
    """One call of one op: how to make its inputs, which of them get gradients, how close to be."""

    name: str
    op: str
    make: Callable[[torch.dtype, torch.Generator], tuple[list, dict]]
    grad_args: tuple[int, ...] = ()
    kind: str = "elementwise"
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
    capability: str | None = None
    """A capability the backend must claim for this case to apply (``fp8``); skipped otherwise."""


def _randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def rotary_freqs(seq: int, rot_dim: int, positions: torch.Tensor | None = None) -> torch.Tensor:
    """RoPE angles ``[s, 1, 1, r]`` (or ``[s, b, 1, r]`` from ``positions [b, s]``), rotate-half layout."""
    inv = 1.0 / (10000.0 ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))
    pos = torch.arange(seq, dtype=torch.float32)[:, None] if positions is None else positions.t().float()
    angles = pos[..., None] * inv
    return torch.cat((angles, angles), dim=-1)[:, :, None, :]


def _padding_mask(gen: torch.Generator, b: int, sk: int) -> torch.Tensor:
    """``[b, 1, 1, sk]``: a few trailing keys masked per batch, never all of them."""
    lengths = torch.randint(sk // 2, sk + 1, (b,), generator=gen)
    return (torch.arange(sk)[None, :] >= lengths[:, None])[:, None, None, :]


def _document_mask(b: int, s: int) -> torch.Tensor:
    """``[b, 1, s, s]`` causal masks that also block attention across two documents per sample."""
    doc = (torch.arange(s) >= s // 3).long()
    allowed = (torch.arange(s)[None, :] <= torch.arange(s)[:, None]) & (doc[None, :] == doc[:, None])
    return (~allowed)[None, None].expand(b, 1, s, s).contiguous()


def _attention_case(
    name: str, b=2, n=4, g=4, sq=16, sk=16, d=32, causal=True, mask=None, scale=None
) -> OpCase:
    def make(dtype, gen):
        q = _randn(gen, b, n, sq, d, dtype=dtype)
        k = _randn(gen, b, g, sk, d, dtype=dtype)
        v = _randn(gen, b, g, sk, d, dtype=dtype)
        kwargs: dict[str, Any] = {"causal": causal}
        if mask == "padding":
            kwargs["mask"] = _padding_mask(gen, b, sk)
        elif mask == "document":
            kwargs["mask"] = _document_mask(b, sq)
        if scale is not None:
            kwargs["scale"] = scale
        return [q, k, v], kwargs

    return OpCase(name, "attention", make, grad_args=(0, 1, 2), kind="reduction")


def _adam_make(dtype, gen):
    params = [_randn(gen, 8, 16), _randn(gen, 16)]
    grads = [_randn(gen, *p.shape) for p in params]
    exp_avgs = [_randn(gen, *p.shape, scale=0.1) for p in params]
    exp_avg_sqs = [_randn(gen, *p.shape).abs() * 0.01 for p in params]
    hyper = dict(step=3, lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    return [params, grads, exp_avgs, exp_avg_sqs], hyper


def _adam_l2_make(dtype, gen):
    args, hyper = _adam_make(dtype, gen)
    return args, {**hyper, "step": 1, "decoupled_weight_decay": False}


def _adam_flat_make(mode: str, device_step: bool = False):
    """Flat buffers of 1500 elements, three segments (two groups, one gap), in one of three storages;
    ``device_step``: the step as a 0-d integer tensor on the device (the optimizer's counter)."""

    def make(dtype, gen):
        from mcore.ops.flat import FlatSegments, split_master

        n_buffer, n_state = 1500, 1400
        state_index = torch.cat([torch.arange(0, 900), torch.arange(1000, 1500)])
        segments = FlatSegments.from_runs([(0, 0, 600, 0), (600, 600, 300, 1), (900, 1000, 500, 0)])
        masters = _randn(gen, n_buffer)
        grads = _randn(gen, n_buffer)
        exp_avgs = _randn(gen, n_state, scale=0.1)
        exp_avg_sqs = _randn(gen, n_state).abs() * 0.01
        if mode == "fp32":
            tensors = [grads, masters, None, None, exp_avgs, exp_avg_sqs]
        elif mode == "masters":
            tensors = [
                grads,
                masters.to(torch.bfloat16),
                masters[state_index].clone(),
                None,
                exp_avgs,
                exp_avg_sqs,
            ]
        else:  # precision-aware: bf16 grads and moments, remainders
            params, remainders = split_master(masters)
            tensors = [
                grads.to(torch.bfloat16),
                params,
                None,
                remainders[state_index].clone(),
                exp_avgs.to(torch.bfloat16),
                exp_avg_sqs.to(torch.bfloat16),
            ]
        hyper = dict(
            step=torch.tensor(3) if device_step else 3, lrs=[1e-2, 2e-2], weight_decays=[0.1, 0.0],
            beta1=0.9, beta2=0.95, eps=1e-8, grad_scale=torch.tensor(0.5), skip=torch.tensor(False),
        )  # fmt: skip
        return [*tensors, segments], hyper

    return make


def _adam_flat_fp8_make(mode: str):
    """:func:`_adam_flat_make`'s buffers with the FP8 copies of three FP8 weights (W=4, weight 2 has no
    piece here): pieces that start and end inside aligned blocks, non-FP8 parameters between them, one
    piece across two segments (a group change), a scale that saturates."""
    base = _adam_flat_make(mode)

    def make(dtype, gen):
        from mcore.ops.flat import FlatFp8Weights

        args, hyper = base(dtype, gen)
        n_buffer = args[1].numel()
        data = torch.full((n_buffer,), 0x5A, dtype=torch.uint8).view(torch.float8_e4m3fn)  # a sentinel
        ranges = ((37, 410, 0), (560, 899, 3), (1003, 1497, 1))
        scales = torch.tensor([96.0, 200.0, 5.0, 0.75])  # saturates for the larger |p| of weight 1
        fp8 = FlatFp8Weights(data, ranges, scales, torch.full((4,), 7.0))
        return [*args, fp8], hyper

    return make


def _accumulate_weight_grad_make(dtype, gen):
    """An fp32 gradient buffer ``[24, 40]`` (the mixed case for half dtypes) += ``dY^T X`` over 64 tokens."""
    main_grad = _randn(gen, 24, 40)
    return [main_grad, _randn(gen, 64, 24, dtype=dtype), _randn(gen, 64, 40, dtype=dtype)], {}


def _fp8_quantize_make(dtype, gen):
    """``[40, 48]`` with a few values past the e4m3 range after scaling (they saturate)."""
    x = _randn(gen, 40, 48, scale=3.0, dtype=dtype)
    x[0, :2] = 1e4
    return [x, torch.tensor(20.0), torch.float8_e4m3fn], {}


_FP8_FLAT_RUNS = ((5, 37, 0), (37, 37, 2), (40, 203, 1), (203, 210, 2), (250, 1499, 4))
"""``(start, end, weight)`` runs of a 1536-element buffer for the flat FP8 maps: starts and ends inside
16-element blocks, an empty run, weight 3 without a run, a long run."""


def _fp8_quantize_flat_make(dtype, gen):
    """Flat parameters (``dtype``) quantized over :data:`_FP8_FLAT_RUNS` into a sentinel-filled e4m3
    buffer; weight 2's scale saturates."""
    from mcore.ops.flat import FlatFp8Weights

    params = _randn(gen, 1536, scale=3.0, dtype=dtype)
    data = torch.full((1536,), 0x5A, dtype=torch.uint8).view(torch.float8_e4m3fn)
    scales = torch.tensor([40.0, 96.0, 2000.0, 1.0, 0.5])
    return [params, FlatFp8Weights(data, _FP8_FLAT_RUNS, scales, torch.zeros(5))], {}


def _fp8_dequantize_flat_make(dtype, gen):
    """Random e4m3 bytes (no NaN) dequantized over :data:`_FP8_FLAT_RUNS` into flat parameters
    (``dtype``) with a strided ``scale_inv`` (``[W, 4][:, 0]``, as ``--fp8-param-gather`` keeps it)."""
    params = _randn(gen, 1536, scale=7.0, dtype=dtype)
    data = torch.randint(0, 256, (1536,), generator=gen, dtype=torch.uint8)
    data[(data & 0x7F) == 0x7F] = 0x11
    scale_inv = torch.ones(5, 4)
    scale_inv[:, 0] = torch.tensor([0.5, 1 / 96, 3e-3, 1.0, 1.03125])
    return [params, data.view(torch.float8_e4m3fn), scale_inv[:, 0], _FP8_FLAT_RUNS], {}


def _fp8_amax_make(dtype, gen):
    return [_randn(gen, 40, 48, scale=3.0, dtype=dtype)], {}


def _fp8_cast_make(from_amax: bool):
    """The cast and its transpose with the scale formed from an amax below the tensor's (the largest
    values saturate), or with a given scale and the amax recorded in place (the delayed recipe)."""

    def make(dtype, gen):
        (x, scale, fp8_dtype), _ = _fp8_quantize_make(dtype, gen)
        if from_amax:
            return [x, torch.float8_e5m2], {"amax": torch.tensor(300.0), "margin": 1, "columnwise": True}
        return [x, fp8_dtype], {"scale": scale, "columnwise": True, "amax_record": torch.zeros(1)}

    return make


def _fp8_cast_packed_make(dbias: bool):
    """A fused QKV projection's output gradient as its three parts (2 groups of ``[q 128 | k 64 | v
    64]`` columns, so that 64-wide column bands fit), a given scale, the amax recorded."""

    def make(dtype, gen):
        parts = [_randn(gen, 40, 2 * w, scale=3.0, dtype=dtype) for w in (128, 64, 64)]
        parts[1][0, :2] = 1e4  # saturates
        return [parts, 2, torch.float8_e5m2], {
            "dbias": dbias, "scale": torch.tensor(20.0), "columnwise": True, "amax_record": torch.zeros(1)
        }  # fmt: skip

    return make


def _fp8_operand(gen, rows: int, k: int, fp8_dtype=torch.float8_e4m3fn) -> torch.Tensor:
    return (torch.randn(rows, k, generator=gen) * 64).to(fp8_dtype)


def _fp8_transpose_make(dtype, gen):
    """An FP8 ``[40, 72]`` (e4m3 for the fp32 pass, e5m2 for bf16): no side a multiple of a tile."""
    fp8_dtype = torch.float8_e4m3fn if dtype == torch.float32 else torch.float8_e5m2
    return [_fp8_operand(gen, 40, 72, fp8_dtype)], {}


def _scaled_linear_make(which: str):
    """FP8 NT operands (K = 32, outputs 48 x 64; the gradient operand e5m2 as in the hybrid format)
    with per-tensor scale inverses; bf16/fp32 outputs."""

    def make(dtype, gen):
        sa, sb = torch.tensor(0.0123), torch.tensor(0.0071)
        if which == "forward":
            a, b = _fp8_operand(gen, 48, 32), _fp8_operand(gen, 64, 32)
            return [a, b, sa, sb, _randn(gen, 64, dtype=dtype), dtype], {}
        a, b = _fp8_operand(gen, 48, 32, torch.float8_e5m2), _fp8_operand(gen, 64, 32)
        if which == "dgrad":
            return [a, b, sa, sb, dtype], {}
        if which == "wgrad_overwrite":  # a step's first gradient: written over a stale main_grad
            return [a, b, sa, sb, dtype, _randn(gen, 48, 64)], {"accumulate": False}
        return [a, b, sa, sb, dtype, _randn(gen, 48, 64)], {}  # wgrad accumulated into a main_grad

    return make


def _act_fp8_make(kind: str, backward: bool, bias: bool = True):
    """fc1's output ``h [40, 48]`` (SwiGLU ``[40, 96]``) with a bias, a few values past the FP8 range
    after scaling (they saturate); the activation or its backward (fc2's input gradient ``[40, 48]``)
    quantized to e4m3 (forward) or e5m2 (backward) with a given scale, the amax recorded in place."""

    def make(dtype, gen):
        width = 96 if kind == "swiglu" else 48
        h = _randn(gen, 40, width, scale=2.0, dtype=dtype)
        h[0, :2] = 300.0
        b = _randn(gen, width, dtype=dtype) if bias else None
        kwargs = {"amax_record": torch.zeros(1)}
        if not backward:
            return [h, b, kind, torch.float8_e4m3fn, torch.tensor(40.0)], kwargs
        dy = _randn(gen, 40, 48, dtype=dtype)
        return [dy, h, b, kind, torch.float8_e5m2, torch.tensor(3000.0)], kwargs

    return make


def _ce_rows_make(smoothing: bool = False, grad: bool = False):
    """Inputs of the in-place cross-entropy's two ops: 37 rows of one rank's 96-wide vocabulary
    slice (of 4 * 96), every fourth label outside it."""

    def make(dtype, gen):
        rows, width = 37, 96
        logits = _randn(gen, rows, width, dtype=dtype, scale=3.0)
        local_labels = torch.randint(0, width, (rows,), generator=gen)
        outside = torch.arange(rows) % 4 == 1
        local_labels = local_labels.masked_fill(outside, 0)
        if not grad:
            return [logits, local_labels, outside, smoothing], {}
        # the global log-sum-exp: this slice's plus the other ranks' share
        log_z = torch.logsumexp(logits.float(), dim=-1) + torch.rand(rows, generator=gen) * 2
        dloss = torch.rand(rows, generator=gen) + 0.5
        return [logits, local_labels, outside, log_z, dloss, 0.1 if smoothing else 0.0, 4 * width], {}

    return make


def _layer_norm_make(dtype, gen):
    """``x [3, 5, 64]``, weight and bias ``[64]``."""
    x = _randn(gen, 3, 5, 64, dtype=dtype)
    return [x, _randn(gen, 64, dtype=dtype), _randn(gen, 64, dtype=dtype)], {"eps": 1e-5}


def _rms_norm_make(dtype, gen):
    """``x [3, 5, 64]``, a weight near one ``[64]``."""
    x = _randn(gen, 3, 5, 64, dtype=dtype)
    return [x, (1 + _randn(gen, 64, scale=0.1)).to(dtype)], {"eps": 1e-6}


def _norm_fp8_make(kind: str, fp8_dtype: torch.dtype, rowwise: bool):
    """``x [37, 64]`` (rows not a multiple of a kernel's row block) normalised into FP8 with a scale
    at which the largest outputs saturate (e4m3), the amax recorded into a slot already holding 1."""

    def make(dtype, gen):
        args, _ = (_layer_norm_make if kind == "LayerNorm" else _rms_norm_make)(dtype, gen)
        x, weight, bias = args[0].reshape(15, 64), args[1], (args[2] if kind == "LayerNorm" else None)
        x = torch.cat([x, _randn(gen, 22, 64, dtype=dtype, scale=3.0)])
        scale = torch.tensor(96.0 if fp8_dtype == torch.float8_e4m3fn else 1000.0)
        kwargs = {"amax_record": torch.ones(1), "rowwise": rowwise, "columnwise": True}
        return [x, weight, bias, 1e-5, kind, fp8_dtype, scale], kwargs

    return make


def _norm_backward_make(kind: str, residual: bool):
    """The norm's backward on ``[37, 64]`` rows from the statistics :func:`reference.norm_fp8_forward`
    saves, with the residual stream's gradient or without."""

    def make(dtype, gen):
        x, weight, bias, eps, kind_, fp8_dtype, scale = _norm_fp8_make(kind, torch.float8_e4m3fn, True)(
            dtype, gen
        )[0]
        *_, mean, rstd = reference.norm_fp8_forward(x, weight, bias, eps, kind_, fp8_dtype, scale)
        dy = _randn(
            gen,
            *x.shape,
            dtype=x.dtype if kind == "LayerNorm" else torch.promote_types(x.dtype, weight.dtype),
        )
        kwargs = {"residual_grad": _randn(gen, *x.shape, dtype=dtype)} if residual else {}
        return [dy, x, weight, bias, eps, kind, mean, rstd], kwargs

    return make


def _fp8_step_close(got: torch.Tensor, want: torch.Tensor, what: str, max_fraction: float = 0.01) -> None:
    """FP8 tensors of a normalised output against the reference's: the inputs to the cast may differ
    by a rounding (the statistics' summation order), so each value is within one step of the FP8
    grid of the reference's and at most ``max_fraction`` of them differ at all."""
    if got.dtype != want.dtype or got.shape != want.shape:
        raise ConformanceError(
            f"{what}: {got.dtype} {tuple(got.shape)}, reference {want.dtype} {tuple(want.shape)}"
        )
    a, b = got.detach().cpu().float(), want.float()
    info = torch.finfo(want.dtype)
    mantissa = 3 if want.dtype == torch.float8_e4m3fn else 2
    step = torch.exp2(torch.floor(torch.log2(b.abs().clamp_min(info.smallest_normal))) - mantissa)
    differ = (a != b) & ~(a.isnan() & b.isnan())
    if ((a - b).abs() > step).any() or differ.float().mean() > max_fraction:
        raise ConformanceError(
            f"{what}: {int(differ.sum())} of {b.numel()} FP8 values differ, largest by "
            f"{(a - b).abs().max().item():.3g} (one step of the grid allowed, in at most {max_fraction:.0%})"
        )


def _check_norm_fp8_forward(fn, ref_fn, args, kwargs, device, dtype, what) -> None:
    """``(q, qT, scale_inv, mean, rstd)`` and the recorded amax against the reference on the same inputs."""
    to_device = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    ours = fn(*[a.to(device) if isinstance(a, torch.Tensor) else a for a in args], **to_device)
    expected = ref_fn(*args, **kwargs)
    for name, got, want in zip(("q", "qT", "scale_inv", "mean", "rstd"), ours, expected, strict=True):
        if (got is None) != (want is None):
            raise ConformanceError(f"{what}: {name} is {got!r}, the reference's {want!r}")
        if want is None:
            continue
        if name in ("q", "qT"):
            _fp8_step_close(got, want, f"{what}: {name}")
        elif name == "scale_inv":
            if not torch.equal(got.cpu(), want):
                raise ConformanceError(f"{what}: scale_inv {got.item()!r}, reference {want.item()!r}")
        else:  # fp32 statistics of the same inputs
            assert_close(got, want, torch.float32, "reduction", f"{what}: {name}")
    # the amax of the norm's output (rounded to its dtype): one rounding of that dtype apart
    assert_close(
        to_device["amax_record"], kwargs["amax_record"], dtype, "elementwise", f"{what}: amax_record"
    )


OP_CASES: tuple[OpCase, ...] = (
    # the *_with_residual variants return (norm(x), x): the same inputs, gradients through both
    *(
        OpCase(op, op, _layer_norm_make, grad_args=(0, 1, 2), kind="reduction")
        for op in ("layer_norm", "layer_norm_with_residual")
    ),
    *(
        OpCase(op, op, _rms_norm_make, grad_args=(0, 1), kind="reduction")
        for op in ("rms_norm", "rms_norm_with_residual")
    ),
    OpCase(
        "rotary_embedding",
        "rotary_embedding",
        lambda dt, g: ([_randn(g, 6, 2, 4, 32, dtype=dt), rotary_freqs(6, 32)], {}),
        grad_args=(0,),
    ),
    OpCase(
        "rotary_embedding_partial",
        "rotary_embedding",
        lambda dt, g: ([_randn(g, 6, 2, 4, 32, dtype=dt), rotary_freqs(6, 16)], {}),
        grad_args=(0,),
    ),
    OpCase(
        "rotary_embedding_position_ids",
        "rotary_embedding",
        lambda dt, g: (
            [
                _randn(g, 6, 2, 4, 32, dtype=dt),
                rotary_freqs(6, 32, torch.tensor([[0, 1, 2, 0, 1, 2], [5, 6, 7, 8, 9, 10]])),
            ],
            {},
        ),
        grad_args=(0,),
    ),
    OpCase(
        "bias_gelu",
        "bias_gelu",
        lambda dt, g: ([_randn(g, 4, 8, 64, dtype=dt), _randn(g, 64, dtype=dt)], {"approximate": "none"}),
        grad_args=(0, 1),
    ),
    OpCase(
        "bias_gelu_tanh",
        "bias_gelu",
        lambda dt, g: ([_randn(g, 4, 8, 64, dtype=dt), None], {"approximate": "tanh"}),
        grad_args=(0,),
    ),
    OpCase("swiglu", "swiglu", lambda dt, g: ([_randn(g, 4, 8, 128, dtype=dt)], {}), grad_args=(0,)),
    OpCase(
        "bias_dropout_add",
        "bias_dropout_add",
        lambda dt, g: (
            [_randn(g, 4, 2, 64, dtype=dt), _randn(g, 64, dtype=dt), _randn(g, 4, 2, 64, dtype=dt)],
            {"p": 0.0, "training": True},
        ),
        grad_args=(0, 1, 2),
    ),
    _attention_case("attention_causal"),
    _attention_case("attention_gqa", n=8, g=2),
    _attention_case("attention_mqa", n=4, g=1),
    _attention_case("attention_full", causal=False),
    _attention_case("attention_padding", causal=False, mask="padding"),
    _attention_case("attention_causal_padding", mask="padding"),
    _attention_case("attention_document_mask", g=2, mask="document"),
    _attention_case("attention_kv_cache", sq=4, sk=16),
    _attention_case("attention_scale", scale=0.3, d=64),
    OpCase(
        "cross_entropy",
        "cross_entropy",
        lambda dt, g: (
            [_randn(g, 4, 8, 96, dtype=dt, scale=3.0), torch.randint(0, 96, (4, 8), generator=g)],
            {},
        ),
        grad_args=(0,),
        kind="reduction",
    ),
    OpCase(
        "cross_entropy_local_stats",
        "cross_entropy_local_stats",
        _ce_rows_make(smoothing=False),
        kind="reduction",
    ),
    OpCase(
        "cross_entropy_local_stats_smoothing",
        "cross_entropy_local_stats",
        _ce_rows_make(smoothing=True),
        kind="reduction",
    ),
    OpCase("cross_entropy_grad_inplace", "cross_entropy_grad_inplace_", _ce_rows_make(grad=True)),
    OpCase(
        "cross_entropy_grad_inplace_smoothing",
        "cross_entropy_grad_inplace_",
        _ce_rows_make(smoothing=True, grad=True),
    ),
    OpCase("adam_step", "adam_step", _adam_make, dtypes=(torch.float32,), kind="reduction"),
    OpCase("adam_step_l2", "adam_step", _adam_l2_make, dtypes=(torch.float32,), kind="reduction"),
    OpCase(
        "adam_flat_fp32", "adam_step_flat", _adam_flat_make("fp32"), dtypes=(torch.float32,), kind="reduction"
    ),
    OpCase(
        "adam_flat_masters",
        "adam_step_flat",
        _adam_flat_make("masters"),
        dtypes=(torch.float32,),
        kind="reduction",
    ),
    OpCase(
        "adam_flat_precision_aware",
        "adam_step_flat",
        _adam_flat_make("remainders"),
        dtypes=(torch.float32,),
        kind="reduction",
    ),
    OpCase(
        "adam_flat_device_step",
        "adam_step_flat",
        _adam_flat_make("masters", device_step=True),
        dtypes=(torch.float32,),
        kind="reduction",
    ),
    *(
        OpCase(
            f"adam_flat_fp8_{mode}",
            "adam_step_flat_fp8",
            _adam_flat_fp8_make(mode),
            dtypes=(torch.float32,),
            kind="reduction",
        )
        for mode in ("masters", "remainders")
    ),
    OpCase(
        "accumulate_weight_grad", "accumulate_weight_grad", _accumulate_weight_grad_make, kind="reduction"
    ),
    OpCase(
        "fp8_quantize",
        "fp8_quantize",
        _fp8_quantize_make,
        dtypes=(torch.float32, torch.bfloat16),
        capability="fp8",
    ),
    OpCase(
        "fp8_quantize_flat",
        "fp8_quantize_flat",
        _fp8_quantize_flat_make,
        dtypes=(torch.float32, torch.bfloat16),
        capability="fp8",
    ),
    OpCase(
        "fp8_dequantize_flat",
        "fp8_dequantize_flat",
        _fp8_dequantize_flat_make,
        dtypes=(torch.float32, torch.bfloat16),
        capability="fp8",
    ),
    OpCase("fp8_amax", "fp8_amax", _fp8_amax_make, dtypes=(torch.float32, torch.bfloat16), capability="fp8"),
    *(
        OpCase(
            f"fp8_cast_{how}",
            "fp8_cast",
            _fp8_cast_make(from_amax=how == "from_amax"),
            dtypes=(torch.float32, torch.bfloat16),
            capability="fp8",
        )
        for how in ("from_amax", "scale_recording_amax")
    ),
    *(
        OpCase(
            f"fp8_cast_dbias_{how}",
            "fp8_cast_dbias",
            _fp8_cast_make(from_amax=how == "from_amax"),
            dtypes=(torch.float32, torch.bfloat16),
            capability="fp8",
        )
        for how in ("from_amax", "scale_recording_amax")
    ),
    *(
        OpCase(
            f"fp8_cast_packed{'_dbias' if dbias else ''}",
            "fp8_cast_packed",
            _fp8_cast_packed_make(dbias),
            dtypes=(torch.float32, torch.bfloat16),
            capability="fp8",
        )
        for dbias in (True, False)
    ),
    OpCase(
        "fp8_transpose",
        "fp8_transpose",
        _fp8_transpose_make,
        dtypes=(torch.float32, torch.bfloat16),
        capability="fp8",
    ),
    *(
        OpCase(
            f"{op}_{kind}{'' if bias else '_no_bias'}",
            op,
            _act_fp8_make(kind, op == "act_fp8_backward", bias),
            dtypes=(torch.float32, torch.bfloat16),
            kind="reduction",
            capability="fp8",
        )
        for op in ("act_fp8_forward", "act_fp8_backward")
        for kind, bias in (("gelu", True), ("gelu_tanh", False), ("swiglu", True))
    ),
    *(
        OpCase(
            f"scaled_linear_{which}",
            f"scaled_linear_{which.removesuffix('_overwrite')}",
            _scaled_linear_make(which),
            dtypes=(torch.float32, torch.bfloat16),
            kind="reduction",
            capability="fp8",
        )
        for which in ("forward", "dgrad", "wgrad", "wgrad_overwrite")
    ),
    *(
        OpCase(
            f"norm_fp8_forward_{name}",
            "norm_fp8_forward",
            _norm_fp8_make(kind, fp8_dtype, rowwise),
            dtypes=(torch.float32, torch.bfloat16),
            capability="fp8",
        )
        for name, kind, fp8_dtype, rowwise in (
            ("layer_norm_e4m3", "LayerNorm", torch.float8_e4m3fn, True),
            ("rms_norm_e5m2_columnwise", "RMSNorm", torch.float8_e5m2, False),
        )
    ),
    *(
        OpCase(
            f"norm_backward_{name}", "norm_backward", _norm_backward_make(kind, residual), kind="reduction"
        )
        for name, kind, residual in (
            ("layer_norm_residual", "LayerNorm", True),
            ("rms_norm", "RMSNorm", False),
        )
    ),
)
"""Every op of :data:`mcore.ops.registry.OP_NAMES` appears at least once."""


def _map(obj, fn):
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, list | tuple):
        return type(obj)(_map(o, fn) for o in obj)
    return obj


def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, kind: str, what: str
) -> None:
    """``actual`` (any device/dtype) against the fp32 CPU ``expected`` within :data:`TOLERANCES`."""
    rtol, atol = TOLERANCES[kind][dtype]
    actual = actual.detach().to("cpu", torch.float32)
    expected = expected.detach().to("cpu", torch.float32)
    if actual.shape != expected.shape:
        raise ConformanceError(f"{what}: shape {tuple(actual.shape)}, reference {tuple(expected.shape)}")
    if not torch.isfinite(actual).all() and torch.isfinite(expected).all():
        raise ConformanceError(f"{what}: non-finite values where the reference is finite")
    if not torch.allclose(actual, expected, rtol=rtol, atol=atol):
        err = (actual - expected).abs()
        worst = int(err.argmax())
        raise ConformanceError(
            f"{what} ({dtype}): max abs error {err.max().item():.3g} at flat index {worst} "
            f"(got {actual.flatten()[worst].item():.6g}, reference {expected.flatten()[worst].item():.6g}); "
            f"allowed rtol={rtol}, atol={atol}"
        )


def check_op(backend: DeviceBackend, case: OpCase, dtype: torch.dtype, seed: int = 0) -> None:
    """Run ``case`` through ``backend.ops`` on its device and through the reference in fp32 on the CPU."""
    gen = torch.Generator().manual_seed(seed)
    args, kwargs = case.make(dtype, gen)
    device = backend.device(0)
    fn, ref_fn = backend.ops[case.op], reference.REFERENCE_OPS[case.op]
    what = f"op {case.op} [{case.name}] served by {backend.ops.provider(case.op)!r}"

    if case.op == "adam_step":  # in place, no autograd: compare the updated tensors
        ours = _map(args, lambda t: t.to(device))
        ref = _map(args, lambda t: t.float().clone())
        fn(*ours, **kwargs)
        ref_fn(*ref, **kwargs)
        for group, (got_list, want_list) in zip(
            ("params", "grads", "exp_avgs", "exp_avg_sqs"), zip(ours, ref)
        ):
            for i, (got, want) in enumerate(zip(got_list, want_list)):
                assert_close(got, want, dtype, case.kind, f"{what}: {group}[{i}]")
        return

    if case.op == "accumulate_weight_grad":  # in place: compare the accumulated buffer
        ours = [t.to(device) for t in args]
        ref = [t.float().clone() for t in args]
        fn(*ours, **kwargs)
        ref_fn(*ref, **kwargs)
        assert_close(ours[0], ref[0], dtype, case.kind, f"{what}: main_grad")
        return

    if case.op == "adam_step_flat_fp8":  # the flat step's buffers, then the FP8 copies of ours
        _check_adam_flat_fp8(fn, ref_fn, args, kwargs, device, dtype, case, what)
        return

    if case.op == "adam_step_flat":  # in place over flat buffers: compare every updated buffer
        names = ("grads", "params", "masters", "remainders", "exp_avgs", "exp_avg_sqs")
        ours = [t.to(device) if isinstance(t, torch.Tensor) else t for t in args]
        ref = [t.clone() if isinstance(t, torch.Tensor) else t for t in args]
        fn(*ours, **{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})
        ref_fn(*ref, **kwargs)
        for name, got, want in zip(names, ours, ref):
            if got is None:
                continue
            if name == "remainders":  # compare the masters they encode, not their low bits
                from mcore.ops.flat import join_master

                to_buffer = torch.zeros(want.numel(), dtype=torch.long)
                for seg in args[6].segments:
                    to_buffer[seg.state_start : seg.state_start + seg.length] = torch.arange(
                        seg.buffer_start, seg.buffer_start + seg.length
                    )
                got = join_master(ours[1].cpu()[to_buffer], got.cpu())
                want = join_master(ref[1][to_buffer], want)
            # bf16 storage: one rounding of the same fp32 value (bf16 bounds)
            bound_dtype = torch.bfloat16 if want.dtype == torch.bfloat16 else dtype
            assert_close(got.float(), want.float(), bound_dtype, case.kind, f"{what}: {name}")
        return

    if case.op in FP8_PRODUCERS:  # FP8 operands computed from a higher-precision result
        _check_fp8_producer(backend, case, dtype, args, kwargs, what)
        return

    if case.op in ("fp8_quantize_flat", "fp8_dequantize_flat"):  # in place: exactly the reference's bits
        _check_fp8_flat(fn, ref_fn, args, device, case, what)
        return

    if case.op.startswith("fp8_"):  # the casts and the amax: exactly the reference's bytes

        def to_device(a):
            if isinstance(a, list):  # fp8_cast_packed's parts
                return [t.to(device) for t in a]
            return a.to(device) if isinstance(a, torch.Tensor) else a

        on_device = {k: to_device(v) for k, v in kwargs.items()}
        ours = fn(*[to_device(a) for a in args], **on_device)
        expected = ref_fn(*args, **kwargs)
        if "amax_record" in kwargs:  # updated in place: compared as one more result
            ours, expected = (*ours, on_device["amax_record"]), (*expected, kwargs["amax_record"])
        ours, expected = (t if isinstance(t, tuple) else (t,) for t in (ours, expected))
        if case.op in ("fp8_cast_dbias", "fp8_cast_packed") and expected[3] is not None:
            # the bias gradient is a sum: the reduction bounds, not bytes
            if ours[3] is None:
                raise ConformanceError(f"{what}: no dbias returned")
            assert_close(ours[3], expected[3], dtype, "reduction", f"{what}: dbias")
            ours, expected = ours[:3] + ours[4:], expected[:3] + expected[4:]
        for got, want in zip(ours, expected, strict=True):
            if (got is None) != (want is None):
                raise ConformanceError(f"{what}: a result is {got!r}, the reference's {want!r}")
            if want is not None and not torch.equal(
                got.cpu().reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)
            ):
                raise ConformanceError(f"{what}: the FP8 bytes differ from the reference's")
        return

    if case.op == "norm_fp8_forward":
        _check_norm_fp8_forward(fn, ref_fn, args, kwargs, device, dtype, what)
        return

    if case.op.startswith("scaled_linear_"):  # FP8 operands: compare the (dtype) result / main_grad
        ours = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
        ref = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        assert_close(fn(*ours, **kwargs).float(), ref_fn(*ref, **kwargs).float(), dtype, case.kind, what)
        return

    def leaf(t: torch.Tensor, index: int, to_device: bool) -> torch.Tensor:
        t = t.to(device) if to_device else t.float() if t.is_floating_point() else t
        t = t.detach().clone()
        return t.requires_grad_() if index in case.grad_args else t

    ours = [leaf(a, i, True) if isinstance(a, torch.Tensor) else a for i, a in enumerate(args)]
    ref = [leaf(a, i, False) if isinstance(a, torch.Tensor) else a for i, a in enumerate(args)]
    our_kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    out = fn(*ours, **our_kwargs)
    expected = ref_fn(*ref, **kwargs)
    if isinstance(expected, tuple):  # several results (cross_entropy_local_stats, the *_with_residual norms)
        if not isinstance(out, tuple) or len(out) != len(expected):
            raise ConformanceError(f"{what}: {type(out).__name__} result, reference {len(expected)}-tuple")
        for i, (got, want) in enumerate(zip(out, expected)):
            if (got is None) != (want is None):
                raise ConformanceError(f"{what}: result {i} is {got!r}, reference {want!r}")
            if want is not None:
                assert_close(got, want, dtype, case.kind, f"{what}: result {i}")
        _check_grads(case, what, out, expected, ours, ref, dtype, device, gen)
        return
    if out.device.type != torch.device(backend.device_type).type:
        raise ConformanceError(f"{what}: result on {out.device}, not on the backend's {backend.device_type}")
    if out.dtype != expected.dtype and dtype == torch.float32:
        raise ConformanceError(f"{what}: result dtype {out.dtype}, reference {expected.dtype}")
    assert_close(out, expected, dtype, case.kind, f"{what}: output")
    _check_grads(case, what, (out,), (expected,), ours, ref, dtype, device, gen)


FP8_PRODUCERS = ("act_fp8_forward", "act_fp8_backward")
"""Ops that compute a value (an activation, its gradient) and return it quantized: ``(q, qT, scale_inv,
*others)``. The backend may compute the value with other (correctly rounded) math than the reference,
so its FP8 bytes are compared within one step of the FP8 grid, not byte for byte."""


def _check_adam_flat_fp8(fn, ref_fn, args, kwargs, device, dtype, case, what) -> None:
    """``adam_step_flat_fp8``: the flat step's buffers within the flat step's bounds of the reference;
    the FP8 bytes of each piece exactly ``fp8_quantize`` of the parameters the backend wrote (its
    rounding of the step may differ from the reference's within those bounds), the amax exactly their
    ``max |p|`` (0 for a weight without a piece), and every other FP8 byte untouched."""
    from mcore.ops.flat import FlatFp8Weights

    fp8 = args[7]
    ours_fp8 = FlatFp8Weights(fp8.data.to(device), fp8.ranges, fp8.scales.to(device), fp8.amax.to(device))
    ref_fp8 = FlatFp8Weights(fp8.data.clone(), fp8.ranges, fp8.scales.clone(), fp8.amax.clone())
    ours = [t.to(device) if isinstance(t, torch.Tensor) else t for t in args[:7]]
    ref = [t.clone() if isinstance(t, torch.Tensor) else t for t in args[:7]]
    fn(*ours, ours_fp8, **{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})
    ref_fn(*ref, ref_fp8, **kwargs)
    for i, name in ((1, "params"), (2, "masters"), (4, "exp_avgs"), (5, "exp_avg_sqs")):
        if ours[i] is None:
            continue
        bound_dtype = torch.bfloat16 if ref[i].dtype == torch.bfloat16 else dtype
        assert_close(ours[i].float(), ref[i].float(), bound_dtype, case.kind, f"{what}: {name}")
    params = ours[1].cpu()
    want_data = fp8.data.view(torch.uint8).clone()
    want_amax = torch.zeros_like(fp8.amax)
    for start, end, index in fp8.ranges:
        piece = params[start:end]
        q = reference.fp8_quantize(piece, fp8.scales[index], fp8.data.dtype)
        want_data[start:end] = q.view(torch.uint8)
        want_amax[index] = torch.maximum(want_amax[index], reference.fp8_amax(piece))
    got_data = ours_fp8.data.cpu().view(torch.uint8)
    if not torch.equal(got_data, want_data):
        bad = (got_data != want_data).nonzero().flatten()
        raise ConformanceError(
            f"{what}: FP8 bytes differ at {bad.numel()} buffer indices, first {bad[:8].tolist()}"
        )
    if not torch.equal(ours_fp8.amax.cpu(), want_amax):
        raise ConformanceError(f"{what}: amax {ours_fp8.amax.cpu().tolist()}, expected {want_amax.tolist()}")


def _check_fp8_flat(fn, ref_fn, args, device, case, what) -> None:
    """``fp8_quantize_flat``: every byte of the FP8 buffer the reference's (the runs' bytes, the
    sentinel elsewhere); ``fp8_dequantize_flat``: every parameter the reference's, bit for bit."""
    from mcore.ops.flat import FlatFp8Weights

    if case.op == "fp8_quantize_flat":
        params, fp8 = args
        ours = FlatFp8Weights(
            fp8.data.to(device, copy=True), fp8.ranges, fp8.scales.to(device), fp8.amax.to(device)
        )
        fn(params.to(device), ours)
        ref = FlatFp8Weights(fp8.data.clone(), fp8.ranges, fp8.scales, fp8.amax)
        ref_fn(params, ref)
        got, want = ours.data.cpu().view(torch.uint8), ref.data.view(torch.uint8)
    else:
        params, data, scale_inv, runs = args
        ours, ref = params.to(device, copy=True), params.clone()
        strided = torch.empty_strided(scale_inv.shape, scale_inv.stride(), device=device)  # as given
        strided.copy_(scale_inv)
        fn(ours, data.to(device), strided, runs)
        ref_fn(ref, data, scale_inv, runs)
        bits = torch.int16 if params.element_size() == 2 else torch.int32
        got, want = ours.cpu().view(bits), ref.view(bits)
    if not torch.equal(got, want):
        bad = (got != want).nonzero().flatten()
        raise ConformanceError(
            f"{what}: {bad.numel()} elements differ from the reference's, first {bad[:8].tolist()}"
        )


def _fp8_grid_step(x: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``fp8_dtype``'s values at ``|x|`` (its subnormal spacing below the normal range)."""
    mantissa, min_exp = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14)}[fp8_dtype]
    _, exp = torch.frexp(x.abs())  # |x| = m 2^exp, m in [0.5, 1)
    return torch.ldexp(torch.ones_like(x), (exp - 1).clamp_min(min_exp) - mantissa)


def fp8_values_off(
    got: torch.Tensor, want: torch.Tensor, scale_inv: torch.Tensor, rtol: float, atol: float
) -> torch.Tensor:
    """Where the FP8 tensor ``got`` is not close to ``want`` (both quantized with ``scale_inv``): the
    dequantized values may differ by the tolerance ``(rtol, atol)`` of the value before quantization
    plus one step of the FP8 grid (a value near a rounding boundary may round either way)."""
    q_got, q_want = got.cpu().double(), want.cpu().double()
    s = scale_inv.cpu().double()
    step = _fp8_grid_step(torch.maximum(q_got.abs(), q_want.abs()), want.dtype)
    bound = step * s + atol + rtol * (q_want * s).abs()
    return ((q_got - q_want).abs() * s > bound) | (q_got.isnan() != q_want.isnan())


def _check_fp8_producer(backend, case: OpCase, dtype, args, kwargs, what: str) -> None:
    """The FP8 results close to the reference's (:func:`fp8_values_off` with ``case.kind``'s
    tolerance; the scale inverse must be the same bits), the other results and the recorded amax
    as ``case.kind``."""
    device = backend.device(0)
    on_device = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    ours = backend.ops[case.op](
        *[a.to(device) if isinstance(a, torch.Tensor) else a for a in args], **on_device
    )
    expected = reference.REFERENCE_OPS[case.op](*args, **kwargs)
    if len(ours) != len(expected):
        raise ConformanceError(f"{what}: {len(ours)} results, the reference {len(expected)}")
    if "amax_record" in kwargs:  # updated in place: compared as one more result
        ours, expected = (*ours, on_device["amax_record"]), (*expected, kwargs["amax_record"])
    scale_inv = expected[2]
    if not torch.equal(ours[2].cpu().reshape(-1), scale_inv.reshape(-1)):
        raise ConformanceError(f"{what}: scale_inv {ours[2].item()}, the reference's {scale_inv.item()}")
    rtol, atol = TOLERANCES[case.kind][dtype]
    for i, (got, want) in enumerate(zip(ours, expected)):
        if (got is None) != (want is None):
            raise ConformanceError(f"{what}: result {i} is {got!r}, the reference's {want!r}")
        if want is None or i == 2:
            continue
        if want.dtype != got.dtype or want.shape != got.shape:
            raise ConformanceError(
                f"{what}: result {i} is {got.dtype} {tuple(got.shape)}, the reference's "
                f"{want.dtype} {tuple(want.shape)}"
            )
        if want.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            off = fp8_values_off(got, want, scale_inv, rtol, atol)
            if off.any():
                worst = int(off.flatten().nonzero()[0])
                raise ConformanceError(
                    f"{what} ({dtype}): result {i}: {int(off.sum())} FP8 values off the reference's by more "
                    f"than one FP8 step plus rtol={rtol}, atol={atol} (first at flat index {worst}: "
                    f"{got.flatten()[worst].item():.6g} * scale_inv, reference {want.flatten()[worst].item():.6g})"
                )
        else:
            assert_close(got, want, dtype, case.kind, f"{what}: result {i}")


def _check_grads(case: OpCase, what: str, outs, expected, ours, ref, dtype, device, gen) -> None:
    """Backpropagate one random cotangent per result through both; compare ``case.grad_args``' grads."""
    if not case.grad_args:
        return
    cotangents = [torch.randn(want.shape, generator=gen) for want in expected]
    sum((got.float() * c.to(device)).sum() for got, c in zip(outs, cotangents)).backward()
    sum((want.float() * c).sum() for want, c in zip(expected, cotangents)).backward()
    for i in case.grad_args:
        if ours[i].grad is None:
            raise ConformanceError(f"{what}: no gradient for argument {i}")
        assert_close(ours[i].grad, ref[i].grad, dtype, "reduction", f"{what}: gradient of argument {i}")


# --- interface, RNG, memory ---------------------------------------------------------------------


def check_interface(backend: DeviceBackend) -> None:
    """The protocol's attributes and methods, and the device placement of new tensors."""
    if not isinstance(backend, DeviceBackend):
        raise ConformanceError(f"{backend!r} does not satisfy mcore.backend.DeviceBackend")
    for attr, kind in (("name", str), ("device_type", str), ("dist_backend", str), ("priority", int)):
        if not isinstance(getattr(backend, attr), kind):
            raise ConformanceError(f"{backend.name}.{attr} must be a {kind.__name__}")
    ok, why = backend.is_available()
    if not (ok is True and isinstance(why, str) and why):
        raise ConformanceError(f"is_available() must return (True, reason) here, got {(ok, why)!r}")
    device = backend.device(0)
    if not isinstance(device, torch.device) or device.type != torch.device(backend.device_type).type:
        raise ConformanceError(f"device(0) = {device!r} does not have device_type {backend.device_type!r}")
    backend.set_device(0)
    backend.synchronize()
    caps = backend.capabilities()
    if not isinstance(caps, frozenset) or not all(isinstance(c, str) for c in caps):
        raise ConformanceError(f"capabilities() must be a frozenset of str, got {caps!r}")
    missing = [name for name in OP_NAMES if not callable(getattr(backend.ops, name, None))]
    if missing:
        raise ConformanceError(f"op table lacks {missing}")
    for dtype in (torch.bfloat16, torch.float16):
        peak = backend.peak_flops(dtype)
        if peak is not None and not (isinstance(peak, float) and peak > 0):
            raise ConformanceError(f"peak_flops({dtype}) must be None or a positive float, got {peak!r}")
    if torch.ones(2, device=device).device.type != device.type:
        raise ConformanceError(f"tensors created on {device} land elsewhere")
    check_optional_interfaces(backend)


OPTIONAL_INTERFACES: dict[str, tuple[str, ...]] = {
    "compile_layers": ("compile_layer",),
    "device_graphs": ("graph", "graph_pool", "side_stream"),
}
"""Capability -> the methods a backend claiming it implements (:class:`mcore.backend.LayerCompiler`,
:class:`mcore.backend.DeviceGraphs`)."""

_DEFAULTS_THAT_REFUSE = ("compile_layer", "graph")
"""Methods whose :class:`~mcore.backend.BackendBase` default raises: a claim needs an override."""


def check_optional_interfaces(backend: DeviceBackend) -> None:
    """A claimed capability comes with its methods; the per-backend set-up methods, where present,
    are callable (:class:`mcore.backend.BackendHooks`)."""
    caps = backend.capabilities()
    for capability, methods in OPTIONAL_INTERFACES.items():
        if capability not in caps:
            continue
        for method in methods:
            impl = getattr(type(backend), method, None)
            if not callable(getattr(backend, method, None)) or (
                method in _DEFAULTS_THAT_REFUSE and impl is getattr(BackendBase, method)
            ):
                raise ConformanceError(
                    f"{backend.name} claims capability {capability!r} but does not implement {method}()"
                )
    for method in ("register_ops", "on_activate", "configure", "process_group_options", "on_shutdown"):
        if hasattr(backend, method) and not callable(getattr(backend, method)):
            raise ConformanceError(f"{backend.name}.{method} must be a method (mcore.backend.BackendHooks)")


def check_rng(backend: DeviceBackend) -> None:
    """Device RNG: state round-trip, seeding, and the TP tracker's streams on top of it."""
    from mcore.tensor_parallel.random import RNGStatesTracker

    device = backend.device(0)
    backend.manual_seed(1234)
    state = backend.get_rng_state()
    if not (isinstance(state, torch.Tensor) and state.device.type == "cpu" and state.dtype == torch.uint8):
        raise ConformanceError("get_rng_state() must return a CPU uint8 tensor (a ByteTensor)")
    first = torch.rand(64, device=device)
    backend.set_rng_state(state)
    if not torch.equal(torch.rand(64, device=device), first):
        raise ConformanceError("set_rng_state(get_rng_state()) does not replay the same random numbers")
    backend.manual_seed(1234)
    if not torch.equal(torch.rand(64, device=device), first):
        raise ConformanceError("manual_seed(s) does not reproduce the stream of seed s")
    backend.manual_seed(4321)
    if torch.equal(torch.rand(64, device=device), first):
        raise ConformanceError("manual_seed with another seed gave the same random numbers")

    tracker = RNGStatesTracker(backend)
    backend.manual_seed(7)
    tracker.add("stream", 99)
    before = backend.get_rng_state()
    with tracker.fork("stream"):
        inside = torch.rand(16, device=device)
    if not torch.equal(backend.get_rng_state(), before):
        raise ConformanceError("the RNG tracker's fork() did not restore the default stream")
    with tracker.fork("stream"):
        again = torch.rand(16, device=device)
    if torch.equal(inside, again):
        raise ConformanceError("a tracker stream did not advance between forks")
    backend.manual_seed(99)
    if not torch.equal(torch.rand(16, device=device), inside):
        raise ConformanceError("a tracker stream seeded with s must draw what manual_seed(s) draws")


def check_memory_stats(backend: DeviceBackend) -> None:
    """``memory_stats()`` keys and invariants; ``reset_peak_memory_stats()`` works."""
    keep = torch.empty(1 << 20, device=backend.device(0))
    stats = backend.memory_stats()
    required = {"allocated", "reserved", "peak_allocated"}
    if not required <= set(stats):
        raise ConformanceError(f"memory_stats() lacks {sorted(required - set(stats))}")
    for key in required:
        if not (isinstance(stats[key], int) and stats[key] >= 0):
            raise ConformanceError(f"memory_stats()[{key!r}] must be a non-negative int, got {stats[key]!r}")
    if stats["peak_allocated"] < stats["allocated"]:
        raise ConformanceError(f"peak_allocated {stats['peak_allocated']} < allocated {stats['allocated']}")
    if stats["allocated"] and stats["reserved"] < stats["allocated"]:
        raise ConformanceError(f"reserved {stats['reserved']} < allocated {stats['allocated']}")
    backend.reset_peak_memory_stats()
    after = backend.memory_stats()
    if after["peak_allocated"] < after["allocated"]:
        raise ConformanceError("after reset_peak_memory_stats(), peak_allocated < allocated")
    del keep


# --- collectives (run in every rank of a 2-process job) --------------------------------------------


def collectives_rank() -> dict[str, list]:
    """All-reduce, all-gather, reduce-scatter, broadcast and a point-to-point ring on the current backend."""
    backend = current_backend()
    rank, world = dist.get_rank(), dist.get_world_size()
    device = backend.device(rank)
    out: dict[str, list] = {"dist_backend": [dist.get_backend()]}
    t = torch.full((4,), float(rank + 1), device=device)
    dist.all_reduce(t)
    out["all_reduce"] = t.cpu().tolist()
    m = torch.tensor([float(rank)], device=device)
    dist.all_reduce(m, op=dist.ReduceOp.MAX)
    out["all_reduce_max"] = m.cpu().tolist()
    gathered = torch.empty(2 * world, device=device)
    _all_gather_single(gathered, torch.full((2,), float(rank), device=device))
    out["all_gather"] = gathered.cpu().tolist()
    scattered = torch.empty(2, device=device)
    _reduce_scatter_single(scattered, torch.arange(2.0 * world, device=device) + rank)
    out["reduce_scatter"] = scattered.cpu().tolist()
    b = torch.full((3,), float(rank + 10), device=device)
    dist.broadcast(b, src=0)
    out["broadcast"] = b.cpu().tolist()
    send = torch.full((2,), float(rank), device=device)
    recv = torch.empty(2, device=device)
    ops = [
        dist.P2POp(dist.isend, send, (rank + 1) % world),
        dist.P2POp(dist.irecv, recv, (rank - 1) % world),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    out["p2p"] = recv.cpu().tolist()
    backend.synchronize()
    return out


def expected_collectives(world: int, dist_backend: str) -> list[dict[str, list]]:
    total = float(sum(range(1, world + 1)))
    results = []
    for rank in range(world):
        results.append(
            {
                "dist_backend": [dist_backend],
                "all_reduce": [total] * 4,
                "all_reduce_max": [float(world - 1)],
                "all_gather": [float(r) for r in range(world) for _ in range(2)],
                "reduce_scatter": [float(sum(2 * rank + i + r for r in range(world))) for i in range(2)],
                "broadcast": [10.0] * 3,
                "p2p": [float((rank - 1) % world)] * 2,
            }
        )
    return results


def check_collectives(backend_name: str, rank_setup: Callable | None = None, world: int = 2) -> None:
    """Run :func:`collectives_rank` on ``world`` processes of ``backend_name`` and check every result."""
    results = run_distributed(collectives_rank, world, backend=backend_name, rank_setup=rank_setup)
    dist_backend = results[0]["dist_backend"][0]
    for rank, (got, want) in enumerate(zip(results, expected_collectives(world, dist_backend))):
        for key, value in want.items():
            if got[key] != value:
                raise ConformanceError(f"rank {rank}: {key} gave {got[key]}, expected {value}")


# --- a tiny training run -------------------------------------------------------------------------

TRAINING_ARGV: tuple[str, ...] = (
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--group-query-attention", "--num-query-groups", "2", "--position-embedding-type", "rope",
    "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
    "--seq-length", "32", "--max-position-embeddings", "32",
    "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2",
    "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "0", "--seed", "1234",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
    "--attention-dropout", "0", "--hidden-dropout", "0", "--num-workers", "0",
    "--eval-iters", "0", "--log-interval", "1000",
)  # fmt: skip
"""A Llama-style GPT small enough for CI (RoPE, RMSNorm, SwiGLU, GQA), no dropout (the kernels' random
streams differ between backends), 2 steps. :func:`training_losses` adds the backend and the layout."""


def training_rank(argv: Sequence[str]) -> list[float]:
    """``pretrain`` with ``argv`` in this rank; the per-iteration losses."""
    from mcore.training.gpt import forward_step, model_provider
    from mcore.training.pretrain import gpt_datasets_provider, pretrain

    result = pretrain(model_provider, forward_step, gpt_datasets_provider, argv=list(argv))
    return [float(x) for x in result.train_losses]


def training_losses(
    backend_name: str,
    world: int = 2,
    extra_argv: Sequence[str] = ("--tensor-model-parallel-size", "2", "--sequence-parallel"),
    rank_setup: Callable | None = None,
    base_argv: Sequence[str] = TRAINING_ARGV,
) -> list[float]:
    """The losses (from the last rank, where they are computed) of a short ``pretrain`` run."""
    argv = [*base_argv, *extra_argv, "--device-backend", backend_name]
    results = run_distributed(training_rank, world, argv, backend=backend_name, rank_setup=rank_setup)
    return results[-1]


_REFERENCE_LOSSES: dict[tuple, list[float]] = {}


def reference_training_losses(
    reference_backend: str = "cpu",
    world: int = 2,
    extra_argv: Sequence[str] = ("--tensor-model-parallel-size", "2", "--sequence-parallel"),
    base_argv: Sequence[str] = TRAINING_ARGV,
) -> list[float]:
    """:func:`training_losses` of the reference backend, computed once per process and argument set."""
    key = (reference_backend, world, tuple(extra_argv), tuple(base_argv))
    if key not in _REFERENCE_LOSSES:
        _REFERENCE_LOSSES[key] = training_losses(reference_backend, world, extra_argv, base_argv=base_argv)
    return list(_REFERENCE_LOSSES[key])


def compare_losses(ours: Sequence[float], theirs: Sequence[float], rtol: float, what: str) -> None:
    """Step-by-step relative comparison of two loss curves (raises :class:`ConformanceError`)."""
    if len(ours) != len(theirs) or not ours or not all(math.isfinite(x) for x in ours):
        raise ConformanceError(f"{what}: losses {list(ours)}, reference {list(theirs)}")
    for step, (a, b) in enumerate(zip(ours, theirs), 1):
        if abs(a - b) > rtol * abs(b):
            raise ConformanceError(
                f"{what}, step {step}: loss {a:.7g} vs reference {b:.7g} "
                f"(relative difference {abs(a - b) / abs(b):.2g} > {rtol})"
            )


def check_training(
    backend_name: str, rank_setup: Callable | None = None, rtol: float = 1e-4, reference_backend: str = "cpu"
) -> tuple[list[float], list[float]]:
    """2 steps at TP=2 with sequence parallelism on ``backend_name`` reproduce ``reference_backend``'s losses."""
    ours = training_losses(backend_name, rank_setup=rank_setup)
    theirs = reference_training_losses(reference_backend)
    compare_losses(ours, theirs, rtol, f"TP=2 training on {backend_name} against {reference_backend}")
    return ours, theirs


# --- the pytest suite ----------------------------------------------------------------------------


class BackendConformance:
    """Subclass as ``Test<Name>Conformance`` with ``backend_name`` set; pytest collects the checks.

    Attributes to override:
        backend_name: the backend to test (``select_backend`` name).
        rank_setup: a module-level function run in each spawned rank before the backend is
            selected (None for installed plugins); assign the function itself (it is read from the
            class, so it is not bound as a method).
        training_rtol: relative loss tolerance of the TP=2 training check against the CPU backend
            (raise it for a backend whose fp32 matmuls are not IEEE fp32, e.g. TF32).
        run_training: set False to skip the training check (it takes a few seconds).
    """

    backend_name: str = ""
    rank_setup: Callable | None = None
    training_rtol: float = 1e-4
    run_training: bool = True

    @pytest.fixture
    def backend(self):
        from mcore.backend import set_current_backend
        from mcore.plugins.manager import select_backend

        if not self.backend_name:
            pytest.fail("set backend_name on the BackendConformance subclass")
        previous = set_current_backend(None)
        set_current_backend(previous)
        selected = select_backend(self.backend_name)
        try:
            yield selected
        finally:
            set_current_backend(previous)

    @pytest.mark.parametrize(
        ("case", "dtype_name"),
        # Only the dtypes each op is specified for (e.g. the Adam step updates fp32 masters only).
        [(c, d) for c in OP_CASES for d in DTYPES if DTYPES[d] in c.dtypes],
        ids=[f"{c.name}-{d}" for c in OP_CASES for d in DTYPES if DTYPES[d] in c.dtypes],
    )
    def test_op_matches_reference(self, backend, case: OpCase, dtype_name: str):
        dtype = DTYPES[dtype_name]
        if _CAPABILITY[dtype] not in backend.capabilities() and dtype != torch.float32:
            pytest.skip(f"backend {backend.name!r} does not claim {_CAPABILITY[dtype]}")
        if case.capability is not None and case.capability not in backend.capabilities():
            pytest.skip(f"backend {backend.name!r} does not claim {case.capability}")
        check_op(backend, case, dtype)

    def test_every_op_is_covered(self):
        assert {case.op for case in OP_CASES} == set(OP_NAMES)

    def test_interface(self, backend):
        check_interface(backend)

    def test_rng_save_restore(self, backend):
        check_rng(backend)

    def test_memory_stats(self, backend):
        check_memory_stats(backend)

    def test_two_process_collectives(self):
        check_collectives(self.backend_name, rank_setup=type(self).rank_setup)

    def test_tp2_training_two_steps(self):
        if not self.run_training:
            pytest.skip(f"{type(self).__name__} sets run_training = False (its training runs elsewhere)")
        check_training(self.backend_name, rank_setup=type(self).rank_setup, rtol=self.training_rtol)


__all__ = [
    "OP_CASES",
    "TOLERANCES",
    "BackendConformance",
    "ConformanceError",
    "OpCase",
    "assert_close",
    "check_collectives",
    "check_interface",
    "check_memory_stats",
    "check_op",
    "check_optional_interfaces",
    "check_rng",
    "check_training",
    "collectives_rank",
    "compare_losses",
    "reference_training_losses",
    "training_losses",
]
