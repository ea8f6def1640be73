"""The GeLU kernels' fp32 math (``activations._gelu_and_grad``) against float64, under Triton's CPU
interpreter: exact GeLU's ``Phi = sigmoid(t * P(t^2))`` and tanh GeLU's ``t * sigmoid(2u)`` over a
dense sweep of ``t`` in ``[-8, 8]`` (every ``2^-10``) and every bf16 value there.

Bound: ``|got - exact| <= 4 ulp`` of fp32 at ``max(|exact|, 1/2)`` for ``y`` and ``dy/dt``: a few
ulps where the output is at least 1/2, an absolute ``2^-23`` below (GeLU's far negative side, where
torch's own ``0.5 * (1 + erf)`` cancels). The interpreter's ``exp`` and reciprocal are numpy's
(correctly rounded); on the GPU ``ex2.approx``/``rcp.approx`` add their 1-2 ulp
(``benchmarks/kernels/gelu_accuracy.py`` measures that there).

By hand: ``OMP_NUM_THREADS=1 TRITON_INTERPRET=1 python tests/ops/test_gelu_math_interpret.py``.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

HAS_TRITON = importlib.util.find_spec("triton") is not None


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (its CPU interpreter)")
def test_gelu_math_against_float64_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]


def _main() -> int:
    import torch
    import triton

    dense = torch.arange(-8 * 1024, 8 * 1024 + 1, dtype=torch.float64) / 1024
    bf16 = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).double()
    t = torch.cat([dense, bf16[torch.isfinite(bf16) & (bf16.abs() <= 8)]]).float()
    failures = 0
    for tanh in (False, True):
        y, dy = torch.empty_like(t), torch.empty_like(t)
        _eval_kernel[(triton.cdiv(t.numel(), 4096),)](t, y, dy, t.numel(), TANH=tanh, BLOCK=4096)
        x = t.double()
        if tanh:
            k = (2.0 / torch.pi) ** 0.5
            th = torch.tanh(k * (x + 0.044715 * x**3))
            want_y = 0.5 * x * (1.0 + th)
            want_dy = 0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * k * (1.0 + 3 * 0.044715 * x * x)
        else:
            cdf = torch.special.ndtr(x)
            want_y = x * cdf
            want_dy = cdf + x * torch.exp(-0.5 * x * x) / (2.0 * torch.pi) ** 0.5
        for name, got, want in (("y", y, want_y), ("dy", dy, want_dy)):
            scale = want.abs().clamp(min=0.5).float()
            ulp = torch.ldexp(torch.ones_like(scale), torch.frexp(scale)[1] - 24).double()
            err = (got.double() - want).abs() / ulp
            worst = int(err.argmax())
            kind = "tanh" if tanh else "erf"
            print(f"gelu {kind} {name}: max error {err.max().item():.2f} ulp at t = {t[worst].item()!r}")
            if not err.max().item() <= 4.0:
                failures += 1
    return failures


if __name__ == "__main__":  # the interpreter run, a subprocess of the test
    import triton
    import triton.language as tl
    from mcore.backends.cuda.triton_kernels.activations import _gelu_and_grad

    @triton.jit
    def _eval_kernel(X, Y, DY, N, TANH: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < N
        y, dy = _gelu_and_grad(tl.load(X + offs, mask=mask, other=0.0), TANH, True)
        tl.store(Y + offs, y, mask=mask)
        tl.store(DY + offs, dy, mask=mask)

    sys.exit(_main())
