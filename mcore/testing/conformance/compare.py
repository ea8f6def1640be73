"""How close a backend's results must be to the reference's: the dtypes and tolerances, the
comparisons (values within tolerances, FP8 values within a step of the FP8 grid) and the error they raise."""

from __future__ import annotations

import torch

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


def fp8_step_close(got: torch.Tensor, want: torch.Tensor, what: str, max_fraction: float = 0.01) -> None:
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
