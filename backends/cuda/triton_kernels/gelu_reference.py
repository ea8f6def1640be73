"""The GeLU kernels' fp32 math (:func:`.activations._gelu_and_grad`) measured against float64.

One reference for the accuracy test (``tests/ops/test_gelu_math_interpret.py``, under Triton's
interpreter) and the benchmark (``benchmarks/kernels/gelu_accuracy.py``, on the GPU):

* :func:`gelu_float64`: ``y = gelu(t)`` and ``dy/dt`` in float64; exact GeLU ``y = t * Phi(t)``,
  ``dy/dt = Phi(t) + t * phi(t)`` (``Phi = torch.special.ndtr``, ``phi`` the normal density); tanh
  GeLU ``y = t/2 * (1 + tanh(u))``, ``u = sqrt(2/pi) * (t + 0.044715 t^3)``, ``dy/dt = (1 +
  tanh(u))/2 + t/2 * (1 - tanh(u)^2) * sqrt(2/pi) * (1 + 3 * 0.044715 t^2)``;
* :func:`gelu_fp32`: a GeLU formulation (a ``@triton.jit`` function ``(t, TANH, NEED_GRAD) -> (y,
  dy)``, by default the kernels' own) evaluated elementwise on a 1-d fp32 tensor by a Triton kernel;
* :func:`ulp_errors`: ``|got - exact|`` in units of the fp32 spacing at ``max(|exact|, floor)``;
* the inputs: :func:`dense_inputs` (every ``2^-k`` step of ``[-limit, limit]``) and
  :func:`bf16_values` (every finite bf16 value there).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .activations import _gelu_and_grad

_SQRT_2_OVER_PI = (2.0 / torch.pi) ** 0.5
_TANH_CUBIC = 0.044715


def gelu_float64(t: torch.Tensor, tanh: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gelu(t), d gelu / dt)`` in float64 (exact GeLU, or tanh GeLU with ``tanh``)."""
    t = t.double()
    if tanh:
        th = torch.tanh(_SQRT_2_OVER_PI * (t + _TANH_CUBIC * t**3))
        y = 0.5 * t * (1.0 + th)
        dy = 0.5 * (1.0 + th) + 0.5 * t * (1.0 - th * th) * _SQRT_2_OVER_PI * (1.0 + 3 * _TANH_CUBIC * t * t)
    else:
        cdf = torch.special.ndtr(t)
        y = t * cdf
        dy = cdf + t * torch.exp(-0.5 * t * t) / (2.0 * torch.pi) ** 0.5
    return y, dy


@triton.jit
def _gelu_eval_kernel(X, Y, DY, N, GELU: tl.constexpr, TANH: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    y, dy = GELU(tl.load(X + offs, mask=mask, other=0.0), TANH, True)
    tl.store(Y + offs, y, mask=mask)
    tl.store(DY + offs, dy, mask=mask)


def gelu_fp32(t: torch.Tensor, tanh: bool, gelu=_gelu_and_grad, block: int = 4096):
    """``(y, dy)`` of ``gelu`` (a ``@triton.jit`` function ``(t, TANH, NEED_GRAD) -> (y, dy)``) on the
    contiguous 1-d fp32 tensor ``t``, on ``t``'s device (the CPU under ``TRITON_INTERPRET=1``)."""
    y, dy = torch.empty_like(t), torch.empty_like(t)
    _gelu_eval_kernel[(triton.cdiv(t.numel(), block),)](
        t, y, dy, t.numel(), GELU=gelu, TANH=tanh, BLOCK=block
    )
    return y, dy


def fp32_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of fp32 values at ``x`` (rounded to fp32), as float64: ``2^(e - 24)`` for
    ``|x|`` in ``[2^(e-1), 2^e)``."""
    exponent = torch.frexp(x.float())[1]
    return torch.ldexp(torch.ones_like(x, dtype=torch.float64), exponent.to(torch.int32) - 24)


def ulp_errors(got: torch.Tensor, exact: torch.Tensor, floor: float = 0.0) -> torch.Tensor:
    """``|got - exact|`` in units of :func:`fp32_ulp` at ``max(|exact|, floor)`` (float64)."""
    exact = exact.double()
    return (got.double() - exact).abs() / fp32_ulp(exact.abs().clamp(min=floor))


def dense_inputs(limit: float, steps_per_unit: int) -> torch.Tensor:
    """Every ``1 / steps_per_unit`` step of ``[-limit, limit]`` (both ends included), as fp32."""
    n = int(limit * steps_per_unit)
    return (torch.arange(-n, n + 1, dtype=torch.float64) / steps_per_unit).float()


def bf16_values(limit: float) -> torch.Tensor:
    """Every finite bf16 value in ``[-limit, limit]`` (both zeros), as fp32, in bit-pattern order."""
    bits = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    return bits[torch.isfinite(bits) & (bits.abs() <= limit)]
