"""The GeLU kernels' fp32 math (``activations._gelu_and_grad``) against float64, under Triton's CPU
interpreter: exact GeLU's ``Phi = sigmoid(t * P(t^2))`` and tanh GeLU's ``t * sigmoid(2u)`` over a
dense sweep of ``t`` in ``[-8, 8]`` (every ``2^-10``) and every bf16 value there.

Bound: ``|got - exact| <= 4 ulp`` of fp32 at ``max(|exact|, 1/2)`` for ``y`` and ``dy/dt``: a few
ulps where the output is at least 1/2, an absolute ``2^-23`` below (GeLU's far negative side, where
torch's own ``0.5 * (1 + erf)`` cancels). The interpreter's ``exp`` and reciprocal are numpy's
(correctly rounded); on the GPU ``ex2.approx``/``rcp.approx`` add their 1-2 ulp
(``benchmarks/kernels/gelu_accuracy.py`` measures that there). The reference and the error measure
are :mod:`mcore.backends.cuda.triton_kernels.gelu_reference`'s, shared with that benchmark.

By hand: ``OMP_NUM_THREADS=1 TRITON_INTERPRET=1 python tests/ops/test_gelu_math_interpret.py``.
"""

from __future__ import annotations

import sys

from mcore.testing.interpreter import interpreter_child, needs_triton, run_under_interpreter


@needs_triton
@interpreter_child(timeout=300)
def test_gelu_math_against_float64_under_the_interpreter():
    run_under_interpreter(__file__, timeout=300)


def _main() -> int:
    import torch
    from mcore.backends.cuda.triton_kernels import gelu_reference as ref

    t = torch.cat([ref.dense_inputs(8, 1024), ref.bf16_values(8)])
    failures = 0
    for tanh in (False, True):
        for name, got, want in zip(("y", "dy"), ref.gelu_fp32(t, tanh), ref.gelu_float64(t, tanh)):
            err = ref.ulp_errors(got, want, floor=0.5)
            worst = int(err.argmax())
            kind = "tanh" if tanh else "erf"
            print(f"gelu {kind} {name}: max error {err.max().item():.2f} ulp at t = {t[worst].item()!r}")
            if not err.max().item() <= 4.0:
                failures += 1
    return failures


if __name__ == "__main__":  # the interpreter run, a subprocess of the test
    sys.exit(_main())
