"""SwiGLU in Triton, plain and weighted per row (the MoE experts' activation with each row's routing
probability), on fused ``[M, 2F]`` rows (gate first).

Rounding follows :mod:`mcore.ops.reference`: ``silu(gate)`` is rounded to the input dtype before the
product, and the product before the weighting. The weighted form's backward recomputes the product
and finishes each row's weight gradient in the same pass as the input gradient.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import next_pow2, rows_2d
from ._common import tile_config as _tile_config

# --- SwiGLU ---------------------------------------------------------------------------------------


@triton.jit
def _swiglu_fwd_kernel(X, Y, M, F, stride_x, stride_y, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < F)[None, :]
    rows64 = rows.to(tl.int64)
    xrow = X + rows64[:, None] * stride_x + cols[None, :]
    g = tl.load(xrow, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(xrow + F, mask=mask, other=0.0).to(tl.float32)
    a = (g * tl.sigmoid(g)).to(X.dtype.element_ty).to(tl.float32)
    tl.store(Y + rows64[:, None] * stride_y + cols[None, :], (a * u).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(
    DY, X, DX, M, F, stride_dy, stride_x, stride_dx, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < F)[None, :]
    rows64 = rows.to(tl.int64)
    xrow = X + rows64[:, None] * stride_x + cols[None, :]
    g = tl.load(xrow, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(xrow + F, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    a = g * sig
    dg = dy * u * sig * (1.0 + g * (1.0 - sig))
    du = dy * a.to(X.dtype.element_ty).to(tl.float32)
    dxrow = DX + rows64[:, None] * stride_dx + cols[None, :]
    tl.store(dxrow, dg.to(DX.dtype.element_ty), mask=mask)
    tl.store(dxrow + F, du.to(DX.dtype.element_ty), mask=mask)


def swiglu_fwd(x2: torch.Tensor, config=None) -> torch.Tensor:
    m, f = x2.shape[0], x2.shape[1] // 2
    y = torch.empty((m, f), dtype=x2.dtype, device=x2.device)
    cfg = _tile_config(f, config)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(f, cfg["BLOCK_N"]))
    _swiglu_fwd_kernel[grid](x2, y, m, f, x2.stride(0), y.stride(0), **cfg)
    return y


def swiglu_bwd(dy2: torch.Tensor, x2: torch.Tensor, config=None) -> torch.Tensor:
    m, f = dy2.shape
    dx = torch.empty((m, 2 * f), dtype=x2.dtype, device=x2.device)
    cfg = _tile_config(f, config)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(f, cfg["BLOCK_N"]))
    _swiglu_bwd_kernel[grid](dy2, x2, dx, m, f, dy2.stride(0), x2.stride(0), dx.stride(0), **cfg)
    return dx


class SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x2 = rows_2d(x)
        ctx.save_for_backward(x2)
        ctx.x_shape = x.shape
        y = swiglu_fwd(x2)
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        (x2,) = ctx.saved_tensors
        return swiglu_bwd(rows_2d(dy), x2).view(ctx.x_shape)


def swiglu(x: torch.Tensor) -> torch.Tensor:
    return SwiGLUFunction.apply(x)


# --- weighted SwiGLU (the MoE experts' activation with each row's routing probability) ------------


@triton.jit
def _weighted_swiglu_fwd_kernel(
    X, W, Y, M, F, stride_x, stride_y, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    mask = row_ok[:, None] & (cols < F)[None, :]
    rows64 = rows.to(tl.int64)
    xrow = X + rows64[:, None] * stride_x + cols[None, :]
    g = tl.load(xrow, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(xrow + F, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + rows64, mask=row_ok, other=0.0).to(tl.float32)
    a = (g * tl.sigmoid(g)).to(X.dtype.element_ty).to(tl.float32)
    s = (a * u).to(X.dtype.element_ty).to(tl.float32)  # swiglu(x) in x's dtype, as the reference
    tl.store(
        Y + rows64[:, None] * stride_y + cols[None, :], (s * w[:, None]).to(Y.dtype.element_ty), mask=mask
    )


@triton.jit
def _weighted_swiglu_bwd_kernel(
    DY, X, W, DX, DW, M, F, stride_dy, stride_x, stride_dx, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):
    """One program: ``BLOCK_M`` rows, the whole row in ``BLOCK_N`` column blocks, so ``dw`` (a sum over
    the row) is finished in the same pass that writes ``dx``."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    rows64 = rows.to(tl.int64)
    w = tl.load(W + rows64, mask=row_ok, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start in range(0, F, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        mask = row_ok[:, None] & (cols < F)[None, :]
        xrow = X + rows64[:, None] * stride_x + cols[None, :]
        g = tl.load(xrow, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(xrow + F, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(g)
        a = (g * sig).to(X.dtype.element_ty).to(tl.float32)
        s = (a * u).to(X.dtype.element_ty).to(tl.float32)
        dw += tl.sum(dy * s, axis=1)
        ds = (dy * w[:, None]).to(X.dtype.element_ty).to(tl.float32)  # swiglu's output gradient, rounded
        dg = ds * u * sig * (1.0 + g * (1.0 - sig))
        dxrow = DX + rows64[:, None] * stride_dx + cols[None, :]
        tl.store(dxrow, dg.to(DX.dtype.element_ty), mask=mask)
        tl.store(dxrow + F, (ds * a).to(DX.dtype.element_ty), mask=mask)
    tl.store(DW + rows64, dw, mask=row_ok)


def _weighted_bwd_config(f: int, config: dict | None) -> dict:
    block_n = min(next_pow2(f), 1024)
    cfg = {"BLOCK_N": block_n, "BLOCK_M": max(1, min(16, 4096 // block_n)), "num_warps": 8}
    cfg.update(config or {})
    return cfg


def weighted_swiglu_fwd(x2: torch.Tensor, weights: torch.Tensor, config=None) -> torch.Tensor:
    m, f = x2.shape[0], x2.shape[1] // 2
    y = torch.empty((m, f), dtype=x2.dtype, device=x2.device)
    cfg = _tile_config(f, config)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(f, cfg["BLOCK_N"]))
    _weighted_swiglu_fwd_kernel[grid](x2, weights, y, m, f, x2.stride(0), y.stride(0), **cfg)
    return y


def weighted_swiglu_bwd(dy2: torch.Tensor, x2: torch.Tensor, weights: torch.Tensor, config=None):
    """``(dx [M, 2F] in x's dtype, dw [M] fp32)``."""
    m, f = dy2.shape
    dx = torch.empty((m, 2 * f), dtype=x2.dtype, device=x2.device)
    dw = torch.empty(m, dtype=torch.float32, device=x2.device)
    cfg = _weighted_bwd_config(f, config)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]),)
    _weighted_swiglu_bwd_kernel[grid](
        dy2, x2, weights, dx, dw, m, f, dy2.stride(0), x2.stride(0), dx.stride(0), **cfg
    )
    return dx, dw


class WeightedSwiGLUFunction(torch.autograd.Function):
    """``weighted_swiglu``: saves ``x`` and the weights only (``swiglu(x)`` is recomputed in backward)."""

    @staticmethod
    def forward(ctx, x, weights):
        x2, w = rows_2d(x), weights.contiguous()
        ctx.save_for_backward(x2, w)
        return weighted_swiglu_fwd(x2, w)

    @staticmethod
    def backward(ctx, dy):
        x2, w = ctx.saved_tensors
        dx, dw = weighted_swiglu_bwd(rows_2d(dy), x2, w)
        return dx, dw if ctx.needs_input_grad[1] else None


def weighted_swiglu(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return WeightedSwiGLUFunction.apply(x, weights)
