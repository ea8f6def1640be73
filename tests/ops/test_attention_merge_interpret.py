"""The CUDA backend's Triton ``attention_merge`` (``backends/cuda/triton_kernels/attention_merge.py``)
under Triton's CPU interpreter, against the reference: a transposed (FlashAttention-like) ``out``,
strided log-sum-exps, rows -inf on one side or both, bf16 and fp32, a head dim not a power of two.

By hand: ``OMP_NUM_THREADS=1 TRITON_INTERPRET=1 python tests/ops/test_attention_merge_interpret.py``.
"""

from __future__ import annotations

import sys

from mcore.testing.interpreter import interpreter_child, needs_triton, run_under_interpreter


@needs_triton
@interpreter_child(timeout=300)
def test_attention_merge_kernel_under_the_interpreter():
    run_under_interpreter(__file__, timeout=300)


def _main() -> int:
    import torch
    from mcore.backends.cuda import attention_lse

    from mcore.ops import reference

    gen = torch.Generator().manual_seed(0)
    failures = 0
    for dtype, d in ((torch.bfloat16, 48), (torch.float32, 32)):
        b, n, s = 2, 3, 37
        out_a = torch.randn(b, s, n, d, generator=gen).to(dtype).transpose(1, 2)  # [b, n, s, d] view
        out_b = torch.randn(b, n, s, d, generator=gen).to(dtype)
        lse_a = torch.randn(b, s, n, generator=gen).mul(6).transpose(1, 2)
        lse_b = torch.randn(b, n, s, generator=gen).mul(6)
        lse_a[:, :, :5] = float("-inf")
        lse_b[:, :, 3:8] = float("-inf")
        out_a[:, :, :5] = 0
        out_b[:, :, 3:8] = 0
        assert attention_lse._merge_fits(out_a, lse_a, out_b, lse_b)
        got = attention_lse.attention_merge(out_a, lse_a, out_b, lse_b)
        want = reference.attention_merge(out_a, lse_a, out_b, lse_b)
        for name, g, w in zip(("out", "lse"), got, want):
            tol = 1e-5 if g.dtype == torch.float32 else 2**-7  # a bf16 out: one rounding of the same value
            ok = g.dtype == w.dtype and torch.allclose(g.float(), w.float(), rtol=tol, atol=tol)
            ok = ok and torch.equal(torch.isneginf(g), torch.isneginf(w))
            print(f"attention_merge {dtype} d={d} {name}: {'ok' if ok else 'MISMATCH'}")
            failures += not ok
    return failures


if __name__ == "__main__":  # the interpreter run, a subprocess of the test
    sys.exit(_main())
