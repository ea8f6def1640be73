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

    python benchmarks/kernels/gelu_accuracy.py [--old]
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from mcore.backends.cuda.triton_kernels._common import INTERPRET
from mcore.backends.cuda.triton_kernels.activations import _gelu_and_grad


@triton.jit
def _old_gelu_and_grad(t, TANH: tl.constexpr):
    """The formulation before this change (for the comparison)."""
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


@triton.jit
def _eval_kernel(X, Y, DY, N, TANH: tl.constexpr, OLD: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    t = tl.load(X + offs, mask=mask, other=0.0)
    if OLD:
        y, dy = _old_gelu_and_grad(t, TANH)
    else:
        y, dy = _gelu_and_grad(t, TANH, True)
    tl.store(Y + offs, y, mask=mask)
    tl.store(DY + offs, dy, mask=mask)


def _reference(t: torch.Tensor, tanh: bool):
    t = t.double()
    if tanh:
        k = (2.0 / torch.pi) ** 0.5
        th = torch.tanh(k * (t + 0.044715 * t**3))
        y = 0.5 * t * (1.0 + th)
        dy = 0.5 * (1.0 + th) + 0.5 * t * (1.0 - th * th) * k * (1.0 + 3 * 0.044715 * t * t)
    else:
        cdf = torch.special.ndtr(t)
        y = t * cdf
        dy = cdf + t * torch.exp(-0.5 * t * t) / (2.0 * torch.pi) ** 0.5
    return y, dy


def _ulp_error(got: torch.Tensor, want: torch.Tensor) -> float:
    keep = want.abs() >= 2.0**-4
    w = want[keep]
    ulp = torch.ldexp(torch.ones_like(w), torch.frexp(w.float())[1].to(torch.int32) - 24)
    return ((got[keep].double() - w).abs() / ulp).max().item()


def _inputs(device) -> tuple[torch.Tensor, torch.Tensor]:
    dense = torch.arange(-8 * 4096, 8 * 4096 + 1, dtype=torch.float64) / 4096
    bits = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    bf16 = bits[torch.isfinite(bits) & (bits.abs() <= 16)]
    return dense.float().to(device), bf16.to(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", action="store_true", help="also evaluate the previous formulation")
    args = parser.parse_args()
    device = torch.device("cpu" if INTERPRET else "cuda")
    dense, bf16 = _inputs(device)
    print(
        f"{'kind':10s} {'math':4s} {'out':3s} {'max abs':>9s} {'max ulp':>8s} {'bf16 off':>9s}  ({len(dense)} + {len(bf16)} inputs)"
    )
    for tanh in (False, True):
        for old in (False, True) if args.old else (False,):
            res = {}
            for name, x in (("dense", dense), ("bf16", bf16)):
                y = torch.empty_like(x)
                dy = torch.empty_like(x)
                _eval_kernel[(triton.cdiv(x.numel(), 1024),)](
                    x, y, dy, x.numel(), TANH=tanh, OLD=old, BLOCK=1024
                )
                res[name] = (x.cpu(), y.cpu(), dy.cpu())
            for which in (0, 1):
                errs = []
                for name in ("dense", "bf16"):
                    x, y, dy = res[name]
                    got = (y, dy)[which]
                    want = _reference(x, tanh)[which]
                    errs.append(((got.double() - want).abs().max().item(), _ulp_error(got, want)))
                x, y, dy = res["bf16"]
                got = (y, dy)[which]
                want = _reference(x, tanh)[which]
                off = (got.bfloat16() != want.bfloat16()).sum().item()
                kind = "gelu_tanh" if tanh else "gelu"
                print(
                    f"{kind:10s} {'old' if old else 'new':4s} {'y' if which == 0 else 'dy':3s} "
                    f"{max(e[0] for e in errs):9.2e} {max(e[1] for e in errs):8.2f} {off:9d}"
                )


if __name__ == "__main__":
    main()
