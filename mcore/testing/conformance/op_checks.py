"""How each op case is checked: one checker per kind of op (in place buffers, FP8 bytes, FP8 values
within a step of the grid, results and input gradients through autograd), chosen from the table
:data:`OP_CHECKS`, and :func:`check_op`, which runs a case through the backend and the reference."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mcore.backend import DeviceBackend
from mcore.ops import reference
from mcore.testing.conformance.compare import (
    TOLERANCES,
    ConformanceError,
    assert_close,
    fp8_step_close,
    fp8_values_off,
)
from mcore.testing.conformance.op_cases import OpCase


@dataclass(frozen=True)
class OpRun:
    """One case's inputs and the two implementations they run through."""

    backend: DeviceBackend
    case: OpCase
    dtype: torch.dtype
    gen: torch.Generator
    args: list
    kwargs: dict
    device: torch.device
    fn: Callable
    """The backend's implementation (``backend.ops[case.op]``)."""
    ref_fn: Callable
    """The reference (``reference.REFERENCE_OPS[case.op]``), run in fp32 on the CPU."""
    what: str
    """The case's name in error messages."""

    def unpack(self) -> tuple:
        """``(fn, ref_fn, args, kwargs, device, dtype, case, what)``."""
        return self.fn, self.ref_fn, self.args, self.kwargs, self.device, self.dtype, self.case, self.what


def _map(obj, fn):
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, list | tuple):
        return type(obj)(_map(o, fn) for o in obj)
    return obj


FP8_PRODUCERS = ("act_fp8_forward", "act_fp8_backward")
"""Ops that compute a value (an activation, its gradient) and return it quantized: ``(q, qT, scale_inv,
*others)``. The backend may compute the value with other (correctly rounded) math than the reference,
so its FP8 bytes are compared within one step of the FP8 grid, not byte for byte."""


def _check_adam_step(run: OpRun) -> None:
    """``adam_step``, in place, no autograd: the updated tensors."""
    fn, ref_fn, args, kwargs, device, dtype, case, what = run.unpack()
    ours = _map(args, lambda t: t.to(device))
    ref = _map(args, lambda t: t.float().clone())
    fn(*ours, **kwargs)
    ref_fn(*ref, **kwargs)
    for group, (got_list, want_list) in zip(("params", "grads", "exp_avgs", "exp_avg_sqs"), zip(ours, ref)):
        for i, (got, want) in enumerate(zip(got_list, want_list)):
            assert_close(got, want, dtype, case.kind, f"{what}: {group}[{i}]")


def _check_accumulate_weight_grad(run: OpRun) -> None:
    """``accumulate_weight_grad``, in place: the accumulated buffer."""
    fn, ref_fn, args, kwargs, device, dtype, case, what = run.unpack()
    ours = [t.to(device) for t in args]
    ref = [t.float().clone() for t in args]
    fn(*ours, **kwargs)
    ref_fn(*ref, **kwargs)
    assert_close(ours[0], ref[0], dtype, case.kind, f"{what}: main_grad")


def _check_adam_flat(run: OpRun) -> None:
    """``adam_step_flat``, in place over flat buffers: every updated buffer."""
    fn, ref_fn, args, kwargs, device, dtype, case, what = run.unpack()
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


def _check_adam_flat_fp8(run: OpRun) -> None:
    """``adam_step_flat_fp8``: the flat step's buffers within the flat step's bounds of the reference;
    the FP8 bytes of each piece exactly ``fp8_quantize`` of the parameters the backend wrote (its
    rounding of the step may differ from the reference's within those bounds), the amax exactly their
    ``max |p|`` (0 for a weight without a piece), and every other FP8 byte untouched."""
    fn, ref_fn, args, kwargs, device, dtype, case, what = run.unpack()
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


def _check_fp8_flat(run: OpRun) -> None:
    """``fp8_quantize_flat``: every byte of the FP8 buffer the reference's (the runs' bytes, the
    sentinel elsewhere); ``fp8_dequantize_flat``: every parameter the reference's, bit for bit."""
    fn, ref_fn, args, device, case, what = run.fn, run.ref_fn, run.args, run.device, run.case, run.what
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


def _check_fp8_bytes(run: OpRun) -> None:
    """The casts, the transpose and the amax: exactly the reference's bytes (a bias
    gradient, a sum, within the reduction bounds)."""
    fn, ref_fn, args, kwargs, device, dtype, case, what = run.unpack()

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


def _check_norm_fp8_forward(run: OpRun) -> None:
    """``(q, qT, scale_inv, mean, rstd)`` and the recorded amax against the reference on the same inputs."""
    fn, ref_fn, args, kwargs, device, dtype, _, what = run.unpack()
    to_device = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    ours = fn(*[a.to(device) if isinstance(a, torch.Tensor) else a for a in args], **to_device)
    expected = ref_fn(*args, **kwargs)
    for name, got, want in zip(("q", "qT", "scale_inv", "mean", "rstd"), ours, expected, strict=True):
        if (got is None) != (want is None):
            raise ConformanceError(f"{what}: {name} is {got!r}, the reference's {want!r}")
        if want is None:
            continue
        if name in ("q", "qT"):
            fp8_step_close(got, want, f"{what}: {name}")
        elif name == "scale_inv":
            if not torch.equal(got.cpu(), want):
                raise ConformanceError(f"{what}: scale_inv {got.item()!r}, reference {want.item()!r}")
        else:  # fp32 statistics of the same inputs
            assert_close(got, want, torch.float32, "reduction", f"{what}: {name}")
    # the amax of the norm's output (rounded to its dtype): one rounding of that dtype apart
    assert_close(
        to_device["amax_record"], kwargs["amax_record"], dtype, "elementwise", f"{what}: amax_record"
    )


def _check_fp8_producer(run: OpRun) -> None:
    """The FP8 results close to the reference's (:func:`fp8_values_off` with ``case.kind``'s
    tolerance; the scale inverse must be the same bits), the other results and the recorded amax
    as ``case.kind``."""
    fn, ref_fn, args, kwargs, device, dtype, case, what = run.unpack()
    on_device = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    ours = fn(*[a.to(device) if isinstance(a, torch.Tensor) else a for a in args], **on_device)
    expected = ref_fn(*args, **kwargs)
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


def _check_scaled_linear(run: OpRun) -> None:
    """The ``scaled_linear`` family and the experts' ``scaled_grouped_gemm(_wgrad)``, from FP8 (or int8)
    operands: the (dtype) result or ``main_grad``."""
    fn, ref_fn, args, kwargs, device, dtype, case, what = run.unpack()
    ours = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
    ref = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    assert_close(fn(*ours, **kwargs).float(), ref_fn(*ref, **kwargs).float(), dtype, case.kind, what)


def _check_autograd(run: OpRun) -> None:
    """Every other op: the results (one or a tuple) on the backend's device in its dtype, then the
    input gradients of ``case.grad_args`` (:func:`_check_grads`)."""
    fn, ref_fn, args, kwargs, device, dtype, case, what = run.unpack()
    backend, gen = run.backend, run.gen

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
            if want is not None and not want.is_floating_point():  # indices, masks: exactly
                if not torch.equal(got.cpu(), want):
                    raise ConformanceError(f"{what}: result {i} ({want.dtype}) differs from the reference's")
            elif want is not None:
                assert_close(got, want, dtype, case.kind, f"{what}: result {i}")
        _check_grads(case, what, out, expected, ours, ref, dtype, device, gen)
        return
    if out.device.type != torch.device(backend.device_type).type:
        raise ConformanceError(f"{what}: result on {out.device}, not on the backend's {backend.device_type}")
    if out.dtype != expected.dtype and dtype == torch.float32:
        raise ConformanceError(f"{what}: result dtype {out.dtype}, reference {expected.dtype}")
    assert_close(out, expected, dtype, case.kind, f"{what}: output")
    _check_grads(case, what, (out,), (expected,), ours, ref, dtype, device, gen)


def _check_grads(case: OpCase, what: str, outs, expected, ours, ref, dtype, device, gen) -> None:
    """Backpropagate one random cotangent per result through both; compare ``case.grad_args``' grads."""
    if not case.grad_args:
        return
    # one cotangent per differentiable result (not for None, index or mask results)
    pairs = [(i, want) for i, want in enumerate(expected) if want is not None and want.is_floating_point()]
    cotangents = {i: torch.randn(want.shape, generator=gen) for i, want in pairs}
    sum((outs[i].float() * c.to(device)).sum() for i, c in cotangents.items()).backward()
    sum((expected[i].float() * c).sum() for i, c in cotangents.items()).backward()
    for i in case.grad_args:
        if ours[i].grad is None:
            raise ConformanceError(f"{what}: no gradient for argument {i}")
        assert_close(ours[i].grad, ref[i].grad, dtype, "reduction", f"{what}: gradient of argument {i}")


OP_CHECKS: dict[str, Callable[[OpRun], None]] = {
    "adam_step": _check_adam_step,
    "accumulate_weight_grad": _check_accumulate_weight_grad,
    "adam_step_flat": _check_adam_flat,
    "adam_step_flat_fp8": _check_adam_flat_fp8,
    **dict.fromkeys(FP8_PRODUCERS, _check_fp8_producer),
    **dict.fromkeys(("fp8_quantize_flat", "fp8_dequantize_flat"), _check_fp8_flat),
    **dict.fromkeys(
        ("fp8_quantize", "fp8_amax", "fp8_cast", "fp8_cast_dbias", "fp8_cast_packed", "fp8_transpose"),
        _check_fp8_bytes,
    ),
    "norm_fp8_forward": _check_norm_fp8_forward,
    **dict.fromkeys(
        ("scaled_linear_forward", "scaled_linear_dgrad", "scaled_linear_wgrad"), _check_scaled_linear
    ),
    **dict.fromkeys(("scaled_grouped_gemm", "scaled_grouped_gemm_wgrad"), _check_scaled_linear),
}
"""Op -> its checker; an op not listed is checked by :func:`_check_autograd` (outputs and input
gradients)."""


def check_op(backend: DeviceBackend, case: OpCase, dtype: torch.dtype, seed: int = 0) -> None:
    """Run ``case`` through ``backend.ops`` on its device and through the reference in fp32 on the CPU,
    and compare them with the op's checker (:data:`OP_CHECKS`)."""
    gen = torch.Generator().manual_seed(seed)
    args, kwargs = case.make(dtype, gen)
    device = backend.device(0)
    fn, ref_fn = backend.ops[case.op], reference.REFERENCE_OPS[case.op]
    what = f"op {case.op} [{case.name}] served by {backend.ops.provider(case.op)!r}"
    run = OpRun(backend, case, dtype, gen, args, kwargs, device, fn, ref_fn, what)
    OP_CHECKS.get(case.op, _check_autograd)(run)
