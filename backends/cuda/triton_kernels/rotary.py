"""Fused rotary position embedding (rotate-half convention, partial rotary) in Triton.

``x [..., d]`` is viewed as ``[outer, inner, d]`` where the angles ``freqs`` depend on the ``outer``
index only (mcore: ``x [s, b, n, d]`` with ``freqs [s, 1, 1, r]`` gives ``outer = s``,
``inner = b * n``). A program takes one ``outer`` index and a block of ``inner`` rows: it computes
``cos``/``sin`` of its ``r`` angles once, in fp32, and applies them to every row of the block, so
the only traffic is ``x`` in and ``y`` out. ``x`` may be a strided view (the q/k slices of a fused
QKV projection) as long as its channels are contiguous. Channels past ``r`` are copied unchanged.

The backward is the same kernel with the rotation reversed (the transpose of the forward's map).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._common import GridLaunch, cached_launch, next_pow2, use_autotune


@triton.jit
def _rotary_kernel(
    X,
    F,
    Y,
    INNER,
    HALF,
    PASS,
    stride_xo,
    stride_xi,
    stride_fo,
    stride_yo,
    stride_yi,
    BACKWARD: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    pid = tl.program_id(0)
    n_ib = tl.cdiv(INNER, BLOCK_I)
    o = (pid // n_ib).to(tl.int64)
    inner = (pid % n_ib) * BLOCK_I + tl.arange(0, BLOCK_I)
    imask = inner < INNER
    h = tl.arange(0, BLOCK_H)
    hmask = h < HALF
    f1 = tl.load(F + o * stride_fo + h, mask=hmask, other=0.0).to(tl.float32)
    f2 = tl.load(F + o * stride_fo + HALF + h, mask=hmask, other=0.0).to(tl.float32)
    c1 = tl.cos(f1)[None, :]
    s1 = tl.sin(f1)[None, :]
    c2 = tl.cos(f2)[None, :]
    s2 = tl.sin(f2)[None, :]
    inner64 = inner.to(tl.int64)
    xrow = X + o * stride_xo + inner64[:, None] * stride_xi
    yrow = Y + o * stride_yo + inner64[:, None] * stride_yi
    mask = imask[:, None] & hmask[None, :]
    x1 = tl.load(xrow + h[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(xrow + HALF + h[None, :], mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    tl.store(yrow + h[None, :], y1.to(Y.dtype.element_ty), mask=mask)
    tl.store(yrow + HALF + h[None, :], y2.to(Y.dtype.element_ty), mask=mask)
    if BLOCK_P > 0:
        p = tl.arange(0, BLOCK_P)
        pmask = imask[:, None] & (p < PASS)[None, :]
        xp = tl.load(xrow + 2 * HALF + p[None, :], mask=pmask, other=0.0)
        tl.store(yrow + 2 * HALF + p[None, :], xp.to(Y.dtype.element_ty), mask=pmask)


def split_dims(x_shape: torch.Size, freqs_shape: torch.Size) -> int | None:
    """The number ``k`` of leading dims of ``x`` that index the angles, or None if unsupported.

    ``freqs`` (right-aligned against ``x[..., :r]``) must be 1 on every dim from ``k`` to the last
    but one, and equal to ``x`` or 1 on the dims before ``k``.
    """
    nd = len(x_shape)
    if len(freqs_shape) > nd:
        return None
    f = (1,) * (nd - len(freqs_shape)) + tuple(freqs_shape)
    k = nd - 1
    while k > 0 and f[k - 1] == 1:
        k -= 1
    if any(f[i] not in (1, x_shape[i]) for i in range(k)):
        return None
    return k


def _as_3d(t: torch.Tensor, outer: int, inner: int) -> torch.Tensor:
    if t.stride(-1) != 1:
        t = t.contiguous()
    try:
        return t.view(outer, inner, t.shape[-1])
    except RuntimeError:
        return t.reshape(outer, inner, t.shape[-1])


_CONFIGS = [
    {"BLOCK_I": bi, "num_warps": w} for bi, w in ((8, 1), (16, 1), (16, 2), (32, 2), (32, 4), (64, 4))
]


def _default(inner: int, half_block: int) -> dict:
    # Measured on H100 (benchmarks/kernels --sweep, d = 128): 16 rows of a position, 2 warps.
    return {"BLOCK_I": max(1, min(next_pow2(inner), 2048 // (2 * half_block))), "num_warps": 2}


def rotary_apply(x: torch.Tensor, freqs2: torch.Tensor, k: int, backward: bool, config=None) -> torch.Tensor:
    """``x [..., d]`` rotated by ``freqs2 [outer, r]``; ``k`` leading dims of ``x`` index ``outer``."""
    shape = x.shape
    d, r = shape[-1], freqs2.shape[-1]
    outer = math.prod(shape[:k])
    inner = math.prod(shape[k:-1])
    x3 = _as_3d(x, outer, inner)
    y = torch.empty(shape, dtype=x.dtype, device=x.device)
    y3 = y.view(outer, inner, d)
    half_block = next_pow2(r // 2)
    passthrough = d - r

    def build():
        configs = [
            c for c in _CONFIGS if c["BLOCK_I"] <= next_pow2(inner) and c["BLOCK_I"] * half_block <= 8192
        ]
        return GridLaunch(
            _rotary_kernel, "rotary", outer * inner, configs, _default(inner, half_block),
            key=["INNER", "HALF", "PASS"], grid=lambda cfg: (outer * triton.cdiv(inner, cfg["BLOCK_I"]),),
            parts=lambda cfg: 0, config=config,
        )  # fmt: skip

    if config is None:  # the training path: built once per shape (the sweep passes explicit configs)
        launch = cached_launch(("rotary", outer, inner, half_block, use_autotune(outer * inner)), build)
    else:
        launch = build()
    launch(
        x3, freqs2, y3, inner, r // 2, passthrough,
        x3.stride(0), x3.stride(1), freqs2.stride(0), y3.stride(0), y3.stride(1),
        BACKWARD=backward, BLOCK_H=half_block, BLOCK_P=next_pow2(passthrough) if passthrough > 0 else 0,
    )  # fmt: skip
    return y


def prepare_freqs(x_shape: torch.Size, freqs: torch.Tensor, k: int) -> torch.Tensor:
    """``freqs`` as a ``[outer, r]`` tensor with unit stride on ``r`` (small: no inner dims)."""
    r = freqs.shape[-1]
    nd = len(x_shape)
    f = freqs.reshape((1,) * (nd - freqs.dim()) + tuple(freqs.shape))
    f = f.reshape(*f.shape[:k], r).expand(*x_shape[:k], r).reshape(-1, r)
    return f if f.stride(-1) == 1 else f.contiguous()


class RotaryFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, freqs, k):
        freqs2 = prepare_freqs(x.shape, freqs, k)
        ctx.save_for_backward(freqs2)
        ctx.k = k
        return rotary_apply(x, freqs2, k, backward=False)

    @staticmethod
    def backward(ctx, dy):
        (freqs2,) = ctx.saved_tensors
        return rotary_apply(dy, freqs2, ctx.k, backward=True), None, None


def rotary_embedding(x: torch.Tensor, freqs: torch.Tensor, k: int) -> torch.Tensor:
    return RotaryFunction.apply(x, freqs, k)
