"""The CUDA kernels on the row-parallel FP8 linears' bias-gradient path, under Triton's CPU interpreter.

``linear_proj``/``linear_fc2`` give their bias the gradient from their output gradient's cast and the
layer's bias-dropout-add gets the bias detached (``tests/tensor_parallel/test_fp8_bias_grad.py``). Here
the CUDA kernels of that path: the Triton bias-dropout-add with a detached bias, with and without
dropout, returns the same output and input gradient as with the bias attached, computes no bias
gradient (no ``_sum_partials`` launch; without dropout no kernel at all: ``dx`` is ``dy``), and
``fp8_cast_dbias`` on that input gradient (what the linear's backward casts) gives the bias gradient
the bias-dropout-add's kernel summed (fp32, within the summation order of the partial sums). Runs in
a child process with ``TRITON_INTERPRET=1`` (it must be on before Triton defines the kernels).

By hand: ``OMP_NUM_THREADS=1 TRITON_INTERPRET=1 python tests/ops/test_bda_bias_grad_interpret.py``.
"""

from __future__ import annotations

import os
import sys

from mcore.testing.interpreter import interpreter_child, needs_triton, run_under_interpreter


@needs_triton
@interpreter_child()
def test_bda_with_a_detached_bias_and_the_cast_dbias_under_the_interpreter():
    run_under_interpreter(__file__)


def _main() -> int:
    import torch
    from mcore.backends.cuda.fp8 import linear as cuda_fp8
    from mcore.backends.cuda.triton_kernels import activations
    from mcore.backends.cuda.triton_kernels import fp8_cast as cast_kernels

    assert os.environ.get("TRITON_INTERPRET") == "1"
    launches = {"sum_partials": 0, "_bda_bwd_launch": 0, "cast_dbias": 0}
    kernels = ((activations, "sum_partials"), (activations, "_bda_bwd_launch"), (cast_kernels, "cast_dbias"))
    for module, name in kernels:
        original = getattr(module, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            launches[_name] += 1
            return _original(*args, **kwargs)

        setattr(module, name, counted)

    failures = []
    gen = torch.Generator().manual_seed(0)
    m, n = 37, 48  # tokens x hidden, not multiples of the tiles
    for p in (0.1, 0.0):
        x = torch.randn(m, n, generator=gen)
        bias = torch.randn(n, generator=gen)
        residual = torch.randn(m, n, generator=gen)
        grad = torch.randn(m, n, generator=gen)
        outputs = {}
        for attached in (True, False):
            xr = x.clone().requires_grad_(True)
            br = bias.clone().requires_grad_(attached)
            torch.manual_seed(5)  # the kernel's dropout seed
            y = activations.bias_dropout_add(xr, br, residual, p, True)
            before = dict(launches)
            y.backward(grad)
            calls = {k: launches[k] - before[k] for k in launches}
            outputs[attached] = (y.detach(), xr.grad, br.grad, calls)
        (y_old, dx_old, db_old, calls_old), (y_new, dx_new, db_new, calls_new) = outputs[True], outputs[False]
        if not (torch.equal(y_new, y_old) and torch.equal(dx_new, dx_old)):
            failures.append(f"p={p}: the output or the input gradient differs with a detached bias")
        if db_new is not None or calls_new["sum_partials"] != 0:
            failures.append(f"p={p}: a detached bias still got a gradient summed: {calls_new}")
        if calls_old["sum_partials"] != 1:
            failures.append(f"p={p}: the attached bias's gradient was not summed by the kernel: {calls_old}")
        if calls_new["_bda_bwd_launch"] != (1 if p > 0 else 0):  # dropout: dx = mask * dy / (1 - p)
            failures.append(f"p={p}: bda backward kernels launched: {calls_new}")
        # what the linear's backward does with its output gradient dx: cast it and sum its columns
        *_, db_cast = cuda_fp8.fp8_cast_dbias(
            dx_new.contiguous(), torch.float8_e5m2, amax=dx_new.abs().max(), rowwise=True, columnwise=True
        )
        if launches["cast_dbias"] == 0:
            failures.append("fp8_cast_dbias fell back to the reference")
        if not torch.allclose(db_cast.float(), db_old, rtol=1e-5, atol=1e-5):
            failures.append(f"p={p}: cast_dbias's bias gradient {db_cast} differs from bda's {db_old}")
        print(f"p={p}", calls_old, calls_new, (db_cast.float() - db_old).abs().max().item())
    for failure in failures:
        print("FAIL", failure)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(_main())
