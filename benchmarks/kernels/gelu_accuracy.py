"""Accuracy of the GeLU kernels' fp32 math (``activations._gelu_and_grad``) against float64.

Evaluates ``y = gelu(t)`` and ``dy/dt`` in a Triton kernel over a dense sweep of fp32 inputs (every
``2^-12`` step in ``[-8, 8]``, plus every finite bf16 value in ``[-16, 16]``) for exact (erf) and tanh
GeLU, and reports against float64 (``torch.special.ndtr``, ``torch.tanh``):

* ``max abs``: the largest ``|got - exact|``;
* ``max ulp``: the largest error in units of the fp32 spacing at the exact value, over outputs with
  ``|exact| >= 1/16`` (smaller outputs, GeLU's far negative side, are compared by the absolute
  error: there ``0.5 * (1 + erf)`` itself cancels, torch's reference included);
* ``bf16 off``: bf16 inputs whose output, rounded to bf16, is not the correctly rounded float64
  value (a tie-break near a rounding boundary moves it by one bf16 step).

``--old`` also evaluates the previous formulation (libdevice ``erff``; ``tanh`` as
``1 - 2 / (exp(2u) + 1)``) for comparison. Runs on the GPU, or on the CPU under
``TRITON_INTERPRET=1`` (then ``tl.exp`` is numpy's, not the GPU's ``ex2.approx``).

The float64 reference, the evaluation kernel and the ulp measure are
:mod:`mcore.backends.cuda.triton_kernels.gelu_reference`'s, shared with
``tests/ops/test_gelu_math_interpret.py``.

    python benchmarks/kernels/gelu_accuracy.py [--old]
"""

from __future__ import annotations

import argparse

import triton
import triton.language as tl
from mcore.backends.cuda.triton_kernels import gelu_reference as ref
from mcore.backends.cuda.triton_kernels._common import INTERPRET
from mcore.backends.cuda.triton_kernels.activations import _gelu_and_grad


@triton.jit
def _old_gelu_and_grad(t, TANH: tl.constexpr, NEED_GRAD: tl.constexpr):
    """The formulation before this change (for the comparison; always with the gradient)."""
    if TANH:
        u = 0.7978845608028654 * (t + 0.044715 * t * t * t)
        th = 1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0)
        y = 0.5 * t * (1.0 + th)
        dy = 0.5 * (1.0 + th) + 0.5 * t * (1.0 - th * th) * 0.7978845608028654 * (1.0 + 0.134145 * t * t)
    else:
        cdf = 0.5 * (1.0 + tl.erf(t * 0.7071067811865476))
        y = t * cdf
        dy = cdf + t * 0.3989422804014327 * tl.exp(-0.5 * t * t)
    return y, dy


def _ulp_error(got, want) -> float:
    """The largest error in fp32 ulps at the exact value, over outputs with ``|exact| >= 1/16``."""
    keep = want.abs() >= 2.0**-4
    return ref.ulp_errors(got[keep], want[keep]).max().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", action="store_true", help="also evaluate the previous formulation")
    args = parser.parse_args()
    device = "cpu" if INTERPRET else "cuda"
    dense, bf16 = ref.dense_inputs(8, 4096).to(device), ref.bf16_values(16).to(device)
    print(
        f"{'kind':10s} {'math':4s} {'out':3s} {'max abs':>9s} {'max ulp':>8s} {'bf16 off':>9s}  ({len(dense)} + {len(bf16)} inputs)"
    )
    for tanh in (False, True):
        for old in (False, True) if args.old else (False,):
            gelu = _old_gelu_and_grad if old else _gelu_and_grad
            res = {}
            for name, x in (("dense", dense), ("bf16", bf16)):
                y, dy = ref.gelu_fp32(x, tanh, gelu, block=1024)
                res[name] = (x.cpu(), y.cpu(), dy.cpu())
            for which in (0, 1):
                errs = []
                for name in ("dense", "bf16"):
                    x, y, dy = res[name]
                    got = (y, dy)[which]
                    want = ref.gelu_float64(x, tanh)[which]
                    errs.append(((got.double() - want).abs().max().item(), _ulp_error(got, want)))
                x, y, dy = res["bf16"]
                got = (y, dy)[which]
                want = ref.gelu_float64(x, tanh)[which]
                off = (got.bfloat16() != want.bfloat16()).sum().item()
                kind = "gelu_tanh" if tanh else "gelu"
                print(
                    f"{kind:10s} {'old' if old else 'new':4s} {'y' if which == 0 else 'dy':3s} "
                    f"{max(e[0] for e in errs):9.2e} {max(e[1] for e in errs):8.2f} {off:9d}"
                )


if __name__ == "__main__":
    main()
