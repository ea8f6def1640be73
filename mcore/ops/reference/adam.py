"""The optimizer step: Adam/AdamW per tensor, over whole flat buffers, and over flat buffers with the
FP8 copies of the FP8 weights (kernels: ``backends/cuda/triton_kernels/adam.py``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mcore.ops.flat import (
    FlatFp8Weights,
    FlatSegments,
    bias_corrections,
    join_master,
    split_at_fp8_pieces,
    split_master,
)
from mcore.ops.reference.fp8 import fp8_amax, fp8_quantize


def _update_moments_(m, v, g, beta1: float, beta2: float, bias2, eps: float) -> torch.Tensor:
    """Adam's moments in place (``m = b1 m + (1-b1) g``, ``v = b2 v + (1-b2) g^2``) and the step's
    denominator ``sqrt(v / (1-b2^t)) + eps``: the arithmetic both steps share, so they agree bit for bit."""
    m.mul_(beta1).add_(g, alpha=1.0 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    return (v / bias2).sqrt_().add_(eps)


def _read_master(params, masters, remainders, state: slice, buffer: slice) -> torch.Tensor:
    """The fp32 master of one segment: from ``masters``, joined from the bf16 parameter and its
    remainder, or the (fp32) parameters themselves."""
    if masters is not None:
        return masters[state]
    if remainders is not None:
        return join_master(params[buffer], remainders[state])
    return params[buffer].float()


def _write_master(p, params, masters, remainders, state: slice, buffer: slice) -> None:
    """Store the updated master ``p`` of one segment where :func:`_read_master` read it, and the
    model parameter rounded from it."""
    if masters is not None:
        masters[state].copy_(p)
        params[buffer].copy_(p)
    elif remainders is not None:
        hi, rem = split_master(p)
        params[buffer].copy_(hi)
        remainders[state].copy_(rem)
    else:
        params[buffer].copy_(p)


@torch.no_grad()
def adam_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled_weight_decay: bool = True,
) -> None:
    """One Adam/AdamW step, in place on fp32 ``params`` and moment buffers (``step`` counts from 1).

    ``m = b1 m + (1-b1) g``; ``v = b2 v + (1-b2) g^2``;
    ``p -= lr * (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps)``; weight decay is decoupled
    (``p *= 1 - lr*wd``, AdamW) or added to the gradient (``g += wd p``, Adam) as PyTorch does.
    """
    bias1 = 1.0 - beta1**step
    bias2 = 1.0 - beta2**step
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
        if weight_decay != 0.0:
            if decoupled_weight_decay:
                p.mul_(1.0 - lr * weight_decay)
            else:
                g = g.add(p, alpha=weight_decay)
        denom = _update_moments_(m, v, g, beta1, beta2, bias2, eps)
        p.addcdiv_(m, denom, value=-lr / bias1)


@torch.no_grad()
def adam_step_flat(
    grads: torch.Tensor,
    params: torch.Tensor,
    masters: torch.Tensor | None,
    remainders: torch.Tensor | None,
    exp_avgs: torch.Tensor,
    exp_avg_sqs: torch.Tensor,
    segments: FlatSegments,
    *,
    step: int | torch.Tensor,
    lrs: Sequence[float],
    weight_decays: Sequence[float],
    beta1: float,
    beta2: float,
    eps: float,
    grad_scale: torch.Tensor | None = None,
    skip: torch.Tensor | None = None,
) -> None:
    """One AdamW step over whole flat buffers (index spaces in :mod:`mcore.ops.flat`).

    Tensors (all 1-D, contiguous):

    * ``grads [N]``: the gradient buffer (fp32, bf16 or fp16), read only;
    * ``params [N]``: the model-parameter buffer; written with the rounded master;
    * ``masters [n]`` fp32, or ``remainders [n]`` int16 (the master is ``join_master(param,
      remainder)``), or neither (fp32 parameters: ``params`` holds the masters);
    * ``exp_avgs``, ``exp_avg_sqs [n]``: the moments, fp32 or bf16 (computed in fp32, stored rounded).

    Per element of each segment (group ``k``), with ``c = grad_scale`` (the clipping coefficient, a
    0-d fp32 device tensor, default 1)::

        g = c * grad;   p = master * (1 - lr_k * wd_k)
        m = b1 m + (1 - b1) g;   v = b2 v + (1 - b2) g^2
        p = p - lr_k / (1 - b1^t) * m / (sqrt(v / (1 - b2^t)) + eps)

    the arithmetic of :func:`adam_step`, so fp32 state gives the same bits. ``skip`` (a 0-d bool
    device tensor) true leaves everything untouched: the decision (a non-finite gradient norm, say)
    stays on the device and the host never waits for it. ``t = step`` is a host int or a 0-d integer
    device tensor counting the updates applied, this one included (the optimizer's counter, which a
    skipped step does not advance); see :func:`mcore.ops.flat.bias_corrections`.
    """
    bias1, bias2 = bias_corrections(step, beta1, beta2)
    on_device = isinstance(step, torch.Tensor)
    for seg in segments.segments:
        state = slice(seg.state_start, seg.state_start + seg.length)
        buffer = slice(seg.buffer_start, seg.buffer_start + seg.length)
        lr, wd = lrs[seg.group], weight_decays[seg.group]
        g = grads[buffer].float()
        if grad_scale is not None:
            g = g * grad_scale
        p0 = _read_master(params, masters, remainders, state, buffer)
        m0, v0 = exp_avgs[state].float(), exp_avg_sqs[state].float()
        p, m, v = p0.clone(), m0.clone(), v0.clone()
        if wd != 0.0:
            p.mul_(1.0 - lr * wd)
        denom = _update_moments_(m, v, g, beta1, beta2, bias2, eps)
        if on_device:  # value * m / denom, as addcdiv computes it, with the factor read on the device
            p.addcdiv_(m * (-lr / bias1).to(torch.float32), denom)
        else:
            p.addcdiv_(m, denom, value=-lr / bias1)
        if skip is not None:  # select, not branch: the host never reads the device flag
            p, m, v = torch.where(skip, p0, p), torch.where(skip, m0, m), torch.where(skip, v0, v)
        exp_avgs[state].copy_(m)
        exp_avg_sqs[state].copy_(v)
        _write_master(p, params, masters, remainders, state, buffer)


def adam_step_flat_fp8(
    grads: torch.Tensor,
    params: torch.Tensor,
    masters: torch.Tensor | None,
    remainders: torch.Tensor | None,
    exp_avgs: torch.Tensor,
    exp_avg_sqs: torch.Tensor,
    segments: FlatSegments,
    fp8: FlatFp8Weights,
    *,
    step: int | torch.Tensor,
    lrs: Sequence[float],
    weight_decays: Sequence[float],
    beta1: float,
    beta2: float,
    eps: float,
    grad_scale: torch.Tensor | None = None,
    skip: torch.Tensor | None = None,
) -> None:
    """:func:`adam_step_flat`, then the FP8 copies of the updated FP8 weights' pieces
    (``--fp8-param-gather`` with the delayed recipe: the scale is known before the step).

    Tensors: those of :func:`adam_step_flat`, and ``fp8`` (:class:`mcore.ops.flat.FlatFp8Weights`):
    ``data [N]`` float8 (e4m3) in the buffer space, ``scales [W]`` fp32, ``amax [W]`` fp32 (written),
    ``ranges``: ``(start, end, i)`` per piece of FP8 weight ``i`` this rank updates (each inside the
    segments). After the step, with ``p = params[start:end]`` (the parameters as written, in their own
    dtype)::

        data[start:end] = saturate(p * scales[i])  in fp8, round to nearest even   (fp8_quantize)
        amax[i]         = max |p|   over weight i's pieces; 0 for a weight with no piece

    ``skip`` true leaves the parameters and the state untouched, and the FP8 bytes and the amax are
    still written from those unchanged parameters: the same as quantizing after a skipped step. Every
    other byte of ``data`` is left as it is. A kernel may return ``inf`` instead of NaN for a piece
    holding a NaN (both non-finite, both kept out of the delayed recipe's scales).
    """
    key = ("fp8-pieces-checked", fp8.ranges)
    if key not in segments.cache:  # a piece outside the segments would never be written by a kernel
        split_at_fp8_pieces(segments, fp8.ranges)
        segments.cache[key] = True
    adam_step_flat(
        grads, params, masters, remainders, exp_avgs, exp_avg_sqs, segments, step=step, lrs=lrs,
        weight_decays=weight_decays, beta1=beta1, beta2=beta2, eps=eps, grad_scale=grad_scale, skip=skip,
    )  # fmt: skip
    fp8.amax.zero_()
    for start, end, index in fp8.ranges:
        if end <= start:
            continue
        piece = params[start:end]
        fp8.data[start:end] = fp8_quantize(piece, fp8.scales[index], fp8.data.dtype)
        fp8.amax[index] = torch.maximum(fp8.amax[index], fp8_amax(piece))
