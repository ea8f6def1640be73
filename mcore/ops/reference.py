"""Pure-PyTorch reference for every op in the table: the definition that fused kernels must match.

Shape legend: ``b`` batch, ``s`` sequence (``sq`` queries, ``sk`` keys), ``n`` attention heads,
``g`` key/value heads (query groups), ``d`` head dim, ``h`` hidden, ``V`` vocabulary.

Precision: reductions (norm statistics, softmax, log-sum-exp) are computed in at least fp32 (fp16/bf16
inputs are promoted to fp32, float64 stays float64 so gradcheck can be strict), and results are
returned in the input dtype, as Megatron's fused kernels do.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from mcore.ops.flat import (
    FlatFp8Weights,
    FlatSegments,
    bias_corrections,
    join_master,
    split_at_fp8_pieces,
    split_master,
)


def _wide(x: torch.Tensor) -> torch.Tensor:
    """``x`` in its compute dtype: at least fp32."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim: ``(x - mean) / sqrt(var + eps) * weight + bias``; stats in fp32."""
    y = F.layer_norm(_wide(x), (x.shape[-1],), _wide(weight), None if bias is None else _wide(bias), eps)
    return y.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim: ``x / sqrt(mean(x^2) + eps) * weight``; the statistic in fp32."""
    xw = _wide(x)
    y = xw * torch.rsqrt(xw.pow(2).mean(-1, keepdim=True) + eps)
    return y.to(x.dtype) * weight


def layer_norm_with_residual(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(layer_norm(x), x)``: a pre-norm layer's norm output and its residual stream.

    One op for both uses of ``x`` lets a backend add the residual's gradient to the norm's input
    gradient inside the norm's backward pass; here autograd adds the two.
    """
    return layer_norm(x, weight, bias, eps), x


def rms_norm_with_residual(
    x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x), x)``: see :func:`layer_norm_with_residual`."""
    return rms_norm(x, weight, eps), x


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotary_embedding(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding, non-interleaved ("rotate half") convention.

    Args:
        x: ``[..., d]`` (mcore passes ``[s, b, n, d]``).
        freqs: angles ``theta_{pos, i}`` of shape broadcastable to ``x[..., :r]`` where ``r`` is the
            rotary dim (``r <= d``, even; ``freqs[..., i] == freqs[..., i + r/2]``). Channels past ``r``
            pass through unchanged (``--rotary-percent`` < 1).

    Returns ``x_rot * cos + rotate_half(x_rot) * sin`` on the first ``r`` channels, where
    ``rotate_half([a, b]) = [-b, a]``; computed in fp32, returned in ``x.dtype``.
    """
    rot_dim = freqs.shape[-1]
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    compute = torch.promote_types(x.dtype, torch.float32)
    cos, sin = freqs.to(compute).cos(), freqs.to(compute).sin()
    out = (_wide(x_rot) * cos + _rotate_half(_wide(x_rot)) * sin).to(x.dtype)
    return torch.cat((out, x_pass), dim=-1) if x_pass.numel() else out


class _BiasGeLU(torch.autograd.Function):
    """``gelu(x + bias)`` that keeps ``x`` and ``bias`` for backward (and recomputes the sum there).

    Keeping the inputs, as the backends' fused kernels do, and not the sum that autograd would keep
    means fc1's output is the activation's only saved tensor: ``--recompute-modules mlp_act``
    recomputes the activation's output from it at no extra memory.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, bias: torch.Tensor, approximate: str) -> torch.Tensor:
        ctx.save_for_backward(x, bias)
        ctx.approximate = approximate
        return F.gelu(x + bias, approximate=approximate)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        x, bias = ctx.saved_tensors
        grad_x = torch.ops.aten.gelu_backward(grad_output, x + bias, approximate=ctx.approximate)
        grad_bias = grad_x.reshape(-1, grad_x.shape[-1]).sum(0).to(bias.dtype)
        return grad_x, grad_bias, None


def bias_gelu(x: torch.Tensor, bias: torch.Tensor | None, approximate: str = "none") -> torch.Tensor:
    """``gelu(x + bias)``; ``approximate="tanh"`` is GPT-2's ``gelu_new``, ``"none"`` the exact erf form."""
    if bias is None:
        return F.gelu(x, approximate=approximate)
    return _BiasGeLU.apply(x, bias, approximate)


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a fused ``[..., 2f]`` input: ``silu(x[..., :f]) * x[..., f:]`` (gate first, then up)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def bias_dropout_add(
    x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, p: float, training: bool
) -> torch.Tensor:
    """``residual + dropout(x + bias)``."""
    if bias is not None:
        x = x + bias
    return residual + F.dropout(x, p=p, training=training)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention with causal/padding masks, an additive bias and grouped KV heads.

    Args:
        q: ``[b, n, sq, d]``.
        k, v: ``[b, g, sk, d]`` with ``n % g == 0``; kv head ``j`` serves query heads
            ``j*n/g .. (j+1)*n/g - 1`` (grouped-query attention; ``g == 1`` is multi-query).
        causal: query ``i`` sees keys ``j <= i + (sk - sq)`` (aligned at the end, so a KV cache works).
        mask: bool, broadcastable to ``[b, n, sq, sk]``, True = masked out (Megatron's convention).
        bias: float, broadcastable to ``[b, n, sq, sk]``, added to the scaled scores (ALiBi).
        dropout_p: attention-probability dropout (uses the current RNG: fork the TP tracker outside).
        scale: score scale, default ``1/sqrt(d)``.

    Returns ``[b, n, sq, d]`` in ``q.dtype``; scores and softmax in fp32.
    """
    n, g = q.shape[1], k.shape[1]
    if n != g:
        k = k.repeat_interleave(n // g, dim=1)
        v = v.repeat_interleave(n // g, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.matmul(_wide(q), _wide(k).transpose(-1, -2)) * scale
    if bias is not None:
        scores = scores + bias.to(scores.dtype)
    sq, sk = q.shape[-2], k.shape[-2]
    fill = torch.finfo(scores.dtype).min
    if causal:
        future = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(sk - sq + 1)
        scores = scores.masked_fill(future, fill)
    if mask is not None:
        scores = scores.masked_fill(mask, fill)
    probs = torch.softmax(scores, dim=-1)
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p)
    return torch.matmul(probs.to(v.dtype), v)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-token cross-entropy in (at least) fp32: ``logits [..., V]``, ``labels [...]`` -> loss ``[...]``."""
    flat = _wide(logits.reshape(-1, logits.shape[-1]))
    loss = F.cross_entropy(flat, labels.reshape(-1), reduction="none", label_smoothing=label_smoothing)
    return loss.view(labels.shape)


_CE_CHUNK_ELEMENTS = 1 << 24
"""Elements of the fp32 temporaries of one row chunk of the two ops below (64 MiB)."""


def _ce_row_chunks(rows: int, width: int):
    step = max(1, _CE_CHUNK_ELEMENTS // max(width, 1))
    for start in range(0, rows, step):
        yield start, min(start + step, rows)


@torch.no_grad()
def cross_entropy_local_stats(
    logits2: torch.Tensor, local_labels: torch.Tensor, outside: torch.Tensor, with_sum: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per-row statistics of one rank's vocabulary slice, for the vocab-parallel cross-entropy.

    The first half of ``--cross-entropy-loss-fusion`` (:mod:`mcore.tensor_parallel.cross_entropy`):
    the caller all-reduces these over the tensor-parallel ranks and keeps only the logits.

    Args:
        logits2: ``[rows, V_local]`` logits ``z`` of this rank's slice, any float dtype, any row stride,
            last dim contiguous. Read only.
        local_labels: ``[rows]`` int64 label ``y - start`` (``start`` the slice's first vocabulary id),
            0 where ``outside``.
        outside: ``[rows]`` bool, True where the label is not in this slice (an ignore index of -100
            is outside every slice).
        with_sum: also return the row sums (label smoothing is on).

    Returns ``(local_log_z, predicted, sum_z)``, each ``[rows]`` in the compute dtype
    (``promote_types(logits2.dtype, float32)``): ``local_log_z = log(sum_j exp(z_j))`` over the slice,
    ``predicted = z[local_label]`` (0 where ``outside``) and ``sum_z = sum_j z_j`` (None unless
    ``with_sum``). Temporaries are fp32 row chunks, never the whole slice.
    """
    rows, width = logits2.shape
    compute = torch.promote_types(logits2.dtype, torch.float32)
    local_log_z = torch.empty(rows, dtype=compute, device=logits2.device)
    predicted = torch.empty_like(local_log_z)
    sum_z = torch.empty_like(local_log_z) if with_sum else None
    for a, b in _ce_row_chunks(rows, width):
        chunk = logits2[a:b]
        top, where = chunk.max(dim=-1)
        log_softmax = torch.log_softmax(chunk, dim=-1, dtype=compute)
        # log-sum-exp = x - log_softmax(x) at any entry; at the max it is exact to rounding
        local_log_z[a:b] = top.to(compute) - log_softmax.gather(-1, where.unsqueeze(-1)).squeeze(-1)
        del log_softmax
        predicted[a:b] = chunk.gather(-1, local_labels[a:b].unsqueeze(-1)).squeeze(-1).to(compute)
        if sum_z is not None:
            sum_z[a:b] = chunk.sum(dim=-1, dtype=compute)
    return local_log_z, predicted.masked_fill_(outside, 0.0), sum_z


@torch.no_grad()
def cross_entropy_grad_inplace_(
    logits2: torch.Tensor,
    local_labels: torch.Tensor,
    outside: torch.Tensor,
    log_z: torch.Tensor,
    dloss: torch.Tensor,
    label_smoothing: float,
    vocab_size: int,
) -> torch.Tensor:
    """Overwrite one rank's logits with their cross-entropy gradient; returns ``logits2``.

    The second half of ``--cross-entropy-loss-fusion``. Per row, with ``e = label_smoothing`` and
    ``V = vocab_size`` (the full vocabulary, all ranks)::

        logits2[j] <- dloss * (exp(z_j - logZ) - (1 - e) [j == local_label and not outside] - e / V)

    i.e. ``d loss / d z`` of ``loss = (1-e) (logZ - z_y) + e (logZ - mean_j z_j)``, where
    ``exp(z_j - logZ)`` is the global softmax restricted to this slice.

    Args:
        logits2: ``[rows, V_local]`` logits (any float dtype, any row stride, last dim contiguous),
            overwritten in place with the gradient (rounded to their dtype).
        local_labels, outside: as for :func:`cross_entropy_local_stats`.
        log_z: ``[rows]`` the global log-sum-exp over the whole vocabulary (compute dtype).
        dloss: ``[rows]`` the upstream gradient of each row's loss (any float dtype, any stride).
        label_smoothing: ``e`` in ``[0, 1)``.
        vocab_size: ``V``.

    Computed in the dtype of ``log_z`` over fp32 row chunks.
    """
    compute = log_z.dtype
    eps = label_smoothing
    upstream = dloss.reshape(-1).to(compute)
    onehot = ((eps - 1.0) * upstream * (~outside).to(compute)).unsqueeze(-1)
    for a, b in _ce_row_chunks(logits2.shape[0], logits2.shape[1]):
        grad = torch.sub(logits2[a:b], log_z[a:b].unsqueeze(-1))  # a new chunk in the compute dtype
        grad.exp_().mul_(upstream[a:b].unsqueeze(-1))
        grad.scatter_add_(-1, local_labels[a:b].unsqueeze(-1), onehot[a:b])
        if eps > 0:
            grad.sub_((eps / vocab_size) * upstream[a:b].unsqueeze(-1))
        logits2[a:b] = grad
    return logits2


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
        m.mul_(beta1).add_(g, alpha=1.0 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        denom = (v / bias2).sqrt_().add_(eps)
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
        if masters is not None:
            p0 = masters[state]
        elif remainders is not None:
            p0 = join_master(params[buffer], remainders[state])
        else:
            p0 = params[buffer].float()
        m0, v0 = exp_avgs[state].float(), exp_avg_sqs[state].float()
        p, m, v = p0.clone(), m0.clone(), v0.clone()
        if wd != 0.0:
            p.mul_(1.0 - lr * wd)
        m.mul_(beta1).add_(g, alpha=1.0 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        denom = (v / bias2).sqrt_().add_(eps)
        if on_device:  # value * m / denom, as addcdiv computes it, with the factor read on the device
            p.addcdiv_(m * (-lr / bias1).to(torch.float32), denom)
        else:
            p.addcdiv_(m, denom, value=-lr / bias1)
        if skip is not None:  # select, not branch: the host never reads the device flag
            p, m, v = torch.where(skip, p0, p), torch.where(skip, m0, m), torch.where(skip, v0, v)
        exp_avgs[state].copy_(m)
        exp_avg_sqs[state].copy_(v)
        if masters is not None:
            masters[state].copy_(p)
            params[buffer].copy_(p)
        elif remainders is not None:
            hi, rem = split_master(p)
            params[buffer].copy_(hi)
            remainders[state].copy_(rem)
        else:
            params[buffer].copy_(p)


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


def accumulate_weight_grad(
    main_grad: torch.Tensor, grad_output_2d: torch.Tensor, input_2d: torch.Tensor
) -> None:
    """``main_grad += grad_output_2d^T input_2d`` in place: a linear layer's weight gradient added to
    its gradient buffer (gradient-accumulation fusion).

    ``main_grad [out, in]``, ``grad_output_2d [T, out]``, ``input_2d [T, in]`` (``T`` tokens). Same
    dtypes: one GEMM with ``beta=1``. An fp32 ``main_grad`` for bf16/fp16 activations: the product
    in the activations' dtype, then added, which is what autograd followed by the DDP hook computes
    (a backend with an in-place mixed-precision GEMM does better: one kernel, no rounding of the
    product, see the CUDA backend).
    """
    if main_grad.dtype == grad_output_2d.dtype == input_2d.dtype:
        main_grad.addmm_(grad_output_2d.t(), input_2d)
    else:
        main_grad.add_(grad_output_2d.t() @ input_2d)


# -- FP8 (``scaled_linear`` family) -----------------------------------------------------------------
#
# Every FP8 GEMM is written "NT": ``out = (a * a_scale_inv) @ (b * b_scale_inv)^T`` with both operands
# ``[rows, K]``, contraction dim last (row-major), which is the layout ``torch._scaled_mm`` takes
# without a copy (``b^T`` is then column-major). A linear ``y = x W^T`` needs:
#
#   forward  y  [M, N] = nt(x_q  [M, K], W_q  [N, K])
#   dgrad    dx [M, K] = nt(dy_q [M, N], W_qT [K, N])
#   wgrad    dW [N, K] = nt(dy_qT [N, M], x_qT [K, M])
#
# ``M`` tokens, ``K`` input and ``N`` output features. Scales follow Transformer Engine's convention:
# ``q = saturate(x * scale)`` stores the tensor, ``x ~= q * scale_inv`` reads it back. A scale is a
# 0-dim fp32 tensor (per-tensor scaling) or ``[rows, 1]`` (per-row scaling: one scale per row of the
# NT operand, i.e. per output element of the GEMM along that side).


def fp8_quantize(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """``saturate(x * scale)`` cast to ``fp8_dtype`` (``torch.float8_e4m3fn`` or ``float8_e5m2``).

    ``x [..., K]`` any float dtype; ``scale`` fp32, 0-dim or broadcastable (``[rows, 1]``). The
    product is formed in fp32 and clamped to the format's finite range (+-448 for e4m3, +-57344 for
    e5m2) before the round-to-nearest-even cast, as Transformer Engine's cast kernels do, so an amax
    that grew since the scale was chosen saturates instead of becoming NaN/inf. The result is
    contiguous (row-major) whatever the strides of ``x``: ``fp8_quantize(w.t(), ...)`` is the
    transposed operand.
    """
    limit = torch.finfo(fp8_dtype).max
    return (x.float() * scale).clamp(-limit, limit).to(fp8_dtype).contiguous()


def fp8_amax(x: torch.Tensor) -> torch.Tensor:
    """``max |x|`` over all elements as a 0-dim fp32 tensor (NaN where ``x`` has one; a backend may
    return inf instead: both give the scale 1 and are kept out of the delayed recipe's scales)."""
    return torch.linalg.vector_norm(x, float("inf")).float()


def fp8_quantize_flat(params: torch.Tensor, fp8: FlatFp8Weights) -> None:
    """The FP8 copies of this rank's pieces of the FP8 weights, in place (``--fp8-param-gather`` with
    the tensorwise recipe: the quantization after the optimizer step, whose scales need the new
    weights' amax first; :mod:`mcore.distributed.fp8_param_gather`).

    ``params [N]`` (bf16, fp16 or fp32) is the flat parameter buffer, ``fp8`` a
    :class:`mcore.ops.flat.FlatFp8Weights` over the same buffer space: ``data [N]`` float8,
    ``scales [W]`` fp32 and ``ranges``, ``(start, end, i)`` per piece of FP8 weight ``i``::

        data[start:end] = saturate(params[start:end] * scales[i])  in fp8, round to nearest even

    exactly :func:`fp8_quantize` of each piece (its bytes). Empty pieces are skipped, every other byte
    of ``data`` is left as it is, and ``fp8.amax`` is neither read nor written (the scales were formed
    from it before). A backend writes every piece in one launch, without reading anything on the host.
    """
    for start, end, index in fp8.ranges:
        if end > start:
            fp8.data[start:end] = fp8_quantize(params[start:end], fp8.scales[index], fp8.data.dtype)


def fp8_dequantize_flat(
    params: torch.Tensor,
    data: torch.Tensor,
    scale_inv: torch.Tensor,
    ranges: Sequence[tuple[int, int, int]],
) -> None:
    """The inverse of :func:`fp8_quantize_flat` into the parameters, in place (``--fp8-param-gather``
    after a bucket's FP8 all-gather: the weights other ranks quantized, as the forward computes with
    them).

    ``params [N]`` (bf16, fp16 or fp32) and ``data [N]`` float8 share the buffer space,
    ``scale_inv [W]`` fp32 (any stride) holds weight ``i``'s ``1 / scale``, ``ranges`` lists
    ``(start, end, i)`` runs of FP8 weight ``i``::

        params[start:end] = (float(data[start:end]) * scale_inv[i])  rounded to params' dtype
                            (fp32 product, round to nearest even)

    Empty runs are skipped and every other element of ``params`` is left as it is.
    """
    for start, end, index in ranges:
        if end > start:
            params[start:end].copy_(data[start:end].float() * scale_inv[index])


def fp8_scale_from_amax(amax: torch.Tensor, fp8_dtype: torch.dtype, margin: int) -> torch.Tensor:
    """Current scaling's ``scale = fp8_max / amax / 2^margin`` in fp32 (1 where ``amax`` is 0 or not
    finite), capped at fp32's largest value: the largest magnitude maps onto the format's largest."""
    amax = amax.float()
    scale = (torch.finfo(fp8_dtype).max / (2.0**margin)) / amax
    ok = (amax > 0) & torch.isfinite(amax)
    scale = torch.where(ok, scale, torch.ones_like(scale))
    return scale.clamp(max=torch.finfo(torch.float32).max)


def fp8_cast(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    *,
    scale: torch.Tensor | None = None,
    amax: torch.Tensor | None = None,
    margin: int = 0,
    rowwise: bool = True,
    columnwise: bool = False,
    amax_record: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """Transformer Engine's per-tensor quantize of a 2-D ``x [M, K]``: ``(q, q^T, scale_inv)``.

    The scale is either given (``scale``, 0-dim fp32: the delayed recipe) or formed from ``amax``
    (0-dim fp32, already reduced over the ranks that share the tensor: current scaling) as
    :func:`fp8_scale_from_amax` with ``margin``; exactly one of the two. ``rowwise`` returns
    ``q = fp8_quantize(x, scale) [M, K]`` (else None), ``columnwise`` the contiguous transpose
    ``q^T [K, M]`` (the NT operand of the other GEMMs; else None), and ``scale_inv = 1 / scale``.
    ``amax_record`` (a one-element fp32 tensor): ``max(amax_record, fp8_amax(x))`` is stored into it
    in place (the delayed recipe's amax, taken during the cast instead of in a pass of its own).
    """
    if (scale is None) == (amax is None):
        raise ValueError("fp8_cast takes exactly one of scale= and amax=")
    if amax is not None:
        scale = fp8_scale_from_amax(amax, fp8_dtype, margin)
    if amax_record is not None:
        torch.maximum(amax_record, fp8_amax(x).reshape(amax_record.shape), out=amax_record)
    q = fp8_quantize(x, scale, fp8_dtype) if rowwise else None
    qT = fp8_quantize(x.t(), scale, fp8_dtype) if columnwise else None
    return q, qT, scale.reciprocal()


def _dequantize(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    return q.float() * scale_inv


def scaled_mm_nt(
    a: torch.Tensor, b: torch.Tensor, a_scale_inv: torch.Tensor, b_scale_inv: torch.Tensor
) -> torch.Tensor:
    """``(a * a_scale_inv) @ (b * b_scale_inv)^T`` in fp32: the emulated FP8 GEMM.

    ``a [M, K]``, ``b [N, K]`` fp8; scale inverses 0-dim or ``[M, 1]`` / ``[N, 1]``. The fp8 values are
    exact in fp32 and so are their products with power-of-two scales; the sums are fp32, like the
    tensor cores' fp32 accumulation (up to summation order).
    """
    return _dequantize(a, a_scale_inv) @ _dequantize(b, b_scale_inv).t()


def scaled_linear_forward(
    x_q: torch.Tensor,
    w_q: torch.Tensor,
    x_scale_inv: torch.Tensor,
    w_scale_inv: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``y = x W^T + bias`` from FP8 operands: ``x_q [M, K]``, ``w_q [N, K]`` -> ``y [M, N]`` in
    ``out_dtype`` (the bias, in any float dtype, added in fp32 before the final rounding)."""
    y = scaled_mm_nt(x_q, w_q, x_scale_inv, w_scale_inv)
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def scaled_linear_dgrad(
    dy_q: torch.Tensor,
    w_qT: torch.Tensor,
    dy_scale_inv: torch.Tensor,
    w_scale_inv: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The input gradient ``dx = dy W``: ``dy_q [M, N]``, ``w_qT [K, N]`` (the weight transposed,
    contraction dim last) -> ``dx [M, K]`` in ``out_dtype``."""
    return scaled_mm_nt(dy_q, w_qT, dy_scale_inv, w_scale_inv).to(out_dtype)


def scaled_linear_wgrad(
    dy_qT: torch.Tensor,
    x_qT: torch.Tensor,
    dy_scale_inv: torch.Tensor,
    x_scale_inv: torch.Tensor,
    out_dtype: torch.dtype,
    main_grad: torch.Tensor | None = None,
    accumulate: bool = True,
) -> torch.Tensor:
    """The weight gradient ``dW = dy^T x``: ``dy_qT [N, M]``, ``x_qT [K, M]`` -> ``dW [N, K]``.

    With ``main_grad`` (gradient-accumulation fusion) the product, rounded to ``main_grad.dtype``, is
    added into it in place (``accumulate=True``) or overwrites it (``accumulate=False``: the first
    gradient of a step into a ``main_grad`` that was not zeroed, see :mod:`mcore.distributed.ddp`), and
    ``main_grad`` is returned; otherwise ``dW`` in ``out_dtype``. The two forms agree bit for bit on a
    zero ``main_grad`` (``0 + x == x``), so a backend may serve the overwrite as a GEMM that writes
    ``main_grad`` directly.
    """
    dw = scaled_mm_nt(dy_qT, x_qT, dy_scale_inv, x_scale_inv)
    if main_grad is None:
        return dw.to(out_dtype)
    if accumulate:
        return main_grad.add_(dw.to(main_grad.dtype))
    return main_grad.copy_(dw.to(main_grad.dtype))


# -- fused producers of FP8 operands (the delayed recipe's fused norm / activation casts) -------------
#
# Each op below equals an unfused composition of the ops above bit for bit: the producer's output is
# rounded to the input dtype exactly as the unfused op writes it, then quantized as ``fp8_cast`` with
# a given ``scale`` quantizes it (and records its amax into ``amax_record``). A backend serves them
# with one kernel that writes the FP8 operand(s) instead of the bf16 tensor: the FP8 linears of
# :mod:`mcore.tensor_parallel.fp8_fused` never materialize the norm's or activation's output.
# ``x [M, K]`` is 2-D; ``q [M, K]`` and ``qT [K, M]`` are returned where ``rowwise``/``columnwise``.


def _norm(x, weight, bias, eps, kind):
    return layer_norm(x, weight, bias, eps) if kind == "LayerNorm" else rms_norm(x, weight, eps)


def norm_fp8_forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    kind: str,
    fp8_dtype: torch.dtype,
    scale: torch.Tensor,
    amax_record: torch.Tensor | None = None,
    rowwise: bool = True,
    columnwise: bool = True,
):
    """``fp8_cast(norm(x), scale=scale, amax_record=...)`` and the norm's statistics, for backward.

    ``kind``: ``"LayerNorm"`` (:func:`layer_norm`, ``bias`` may be None) or ``"RMSNorm"``
    (:func:`rms_norm`, ``bias`` None). Returns ``(q, qT, scale_inv, mean, rstd)``: ``mean [M]``
    (None for RMSNorm) and ``rstd [M] = 1 / sqrt(var + eps)`` (RMSNorm: ``1 / sqrt(mean(x^2) + eps)``)
    in fp32, as :func:`norm_backward` takes them.
    """
    with torch.no_grad():
        xw = _wide(x)
        if kind == "LayerNorm":
            mean = xw.mean(-1)
            rstd = torch.rsqrt((xw - mean[:, None]).pow(2).mean(-1) + eps)
        else:
            mean, rstd = None, torch.rsqrt(xw.pow(2).mean(-1) + eps)
        y = _norm(x, weight, bias, eps, kind)
        q, qT, scale_inv = fp8_cast(
            y, fp8_dtype, scale=scale, rowwise=rowwise, columnwise=columnwise, amax_record=amax_record
        )
    return q, qT, scale_inv, mean.float() if mean is not None else None, rstd.float()


def norm_backward(
    grad_output: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    kind: str,
    mean: torch.Tensor | None,
    rstd: torch.Tensor,
    residual_grad: torch.Tensor | None = None,
):
    """The norm's backward on 2-D ``grad_output, x [M, K]``: ``(dx, dweight, dbias)`` as autograd of
    :func:`layer_norm` / :func:`rms_norm` gives them (``dbias`` None without a bias), with
    ``residual_grad`` (the residual stream's gradient, ``[M, K]``) added to ``dx`` (a pre-norm
    layer's two uses of ``x``). ``mean``/``rstd`` are :func:`norm_fp8_forward`'s statistics; this
    reference recomputes them (a kernel reads them instead of reducing ``x`` again)."""
    with torch.enable_grad():
        xr = x.detach().requires_grad_(True)
        wr = weight.detach().requires_grad_(True)
        br = None if bias is None else bias.detach().requires_grad_(True)
        y = _norm(xr, wr, br, eps, kind)
        inputs = [xr, wr] + ([br] if br is not None else [])
        outputs, output_grads = [y], [grad_output]
        if residual_grad is not None:
            # The residual reaches ``x`` through autograd, as in the unfused layer: it arrives first
            # (its node is the newest) and the norm's contributions are added to it in autograd's
            # order, so dx is bit-identical to the unfused composition's (RMSNorm uses ``x`` twice).
            outputs.append(xr.view_as(xr))
            output_grads.append(residual_grad)
        grads = torch.autograd.grad(outputs, inputs, output_grads)
    return grads[0], grads[1], grads[2] if bias is not None else None


ACTIVATIONS = ("gelu", "gelu_tanh", "swiglu")
"""The activations :func:`act_fp8_forward` fuses: exact GeLU, tanh GeLU, SwiGLU (fc1 ``[gate; up]``)."""


def _activation(h: torch.Tensor, bias: torch.Tensor | None, kind: str) -> torch.Tensor:
    """The MLP's activation as :class:`mcore.models.mlp.MLP` computes it: ``bias_gelu(h, bias)`` or
    ``swiglu(h + bias)``."""
    if kind == "swiglu":
        return swiglu(h if bias is None else h + bias)
    return bias_gelu(h, bias, "tanh" if kind == "gelu_tanh" else "none")


def act_fp8_forward(
    h: torch.Tensor,
    bias: torch.Tensor | None,
    kind: str,
    fp8_dtype: torch.dtype,
    scale: torch.Tensor,
    amax_record: torch.Tensor | None = None,
    rowwise: bool = True,
    columnwise: bool = True,
):
    """``fp8_cast(act(h, bias), scale=scale, amax_record=...)`` -> ``(q, qT, scale_inv)``: fc2's input
    straight from fc1's output ``h [M, F]`` (SwiGLU: ``[M, 2F]`` -> ``[M, F]``); ``kind`` one of
    :data:`ACTIVATIONS`."""
    with torch.no_grad():
        y = _activation(h, bias, kind)
        return fp8_cast(
            y, fp8_dtype, scale=scale, rowwise=rowwise, columnwise=columnwise, amax_record=amax_record
        )


def act_fp8_backward(
    grad_output: torch.Tensor,
    h: torch.Tensor,
    bias: torch.Tensor | None,
    kind: str,
    fp8_dtype: torch.dtype,
    scale: torch.Tensor,
    amax_record: torch.Tensor | None = None,
    rowwise: bool = True,
    columnwise: bool = True,
):
    """The activation's backward, quantized: ``dh = d act(h, bias) / dh`` (autograd of the activation,
    in ``h``'s dtype: fc1's output gradient) as ``fp8_cast(dh, scale=scale, amax_record=...)``, with
    the bias gradient. Returns ``(q, qT, scale_inv, dbias)`` (``dbias`` None without a bias; it is
    summed from the unquantized ``dh``)."""
    with torch.enable_grad():
        hr = h.detach().requires_grad_(True)
        br = None if bias is None else bias.detach().requires_grad_(True)
        y = _activation(hr, br, kind)
        inputs = [hr] + ([br] if br is not None else [])
        grads = torch.autograd.grad(y, inputs, grad_output)
    dh = grads[0]
    q, qT, scale_inv = fp8_cast(
        dh, fp8_dtype, scale=scale, rowwise=rowwise, columnwise=columnwise, amax_record=amax_record
    )
    return q, qT, scale_inv, grads[1] if bias is not None else None


def fp8_cast_dbias(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    *,
    scale: torch.Tensor | None = None,
    amax: torch.Tensor | None = None,
    margin: int = 0,
    rowwise: bool = True,
    columnwise: bool = False,
    amax_record: torch.Tensor | None = None,
):
    """:func:`fp8_cast` of an output gradient ``x [M, N]`` and its bias gradient ``x.sum(0)`` (in
    ``x.dtype``), from one read of ``x``: ``(q, qT, scale_inv, dbias)``."""
    q, qT, scale_inv = fp8_cast(
        x,
        fp8_dtype,
        scale=scale,
        amax=amax,
        margin=margin,
        rowwise=rowwise,
        columnwise=columnwise,
        amax_record=amax_record,
    )
    return q, qT, scale_inv, x.sum(0)


def pack_columns(parts: list[torch.Tensor], groups: int) -> torch.Tensor:
    """The column packing of ``parts`` (each ``[M, groups * w_i]``) into ``x [M, groups * W]``,
    ``W = sum(w_i)``: row ``m`` of ``x`` is, group after group, ``parts[0][m, j w_0 : (j+1) w_0]``, then
    ``parts[1][m, j w_1 : (j+1) w_1]``, ... -- a fused QKV projection's output ``[M, g (r+2) d]``
    (Megatron's per-group ``[q_j | k_j | v_j]``) from its Q ``[M, g r d]``, K and V ``[M, g d]``."""
    m = parts[0].shape[0]
    return torch.cat([p.reshape(m, groups, -1) for p in parts], dim=-1).reshape(m, -1)


def fp8_transpose(q: torch.Tensor) -> torch.Tensor:
    """``q [M, K] -> q^T [K, M]``, contiguous: the bytes of a 2-D FP8 tensor transposed (no rounding).

    The FP8 GEMMs of Hopper take both operands with the contraction dimension contiguous, so a weight
    quantized once as ``W_q [N, K]`` (``--fp8-param-gather``) and an input gathered as FP8 rows
    (sequence parallelism) need their transposes for the input and weight gradients. Copied as
    ``uint8``: copy kernels may not know the FP8 dtypes."""
    return q.view(torch.uint8).t().contiguous().view(q.dtype)


def fp8_cast_packed(
    parts: list[torch.Tensor],
    groups: int,
    fp8_dtype: torch.dtype,
    *,
    dbias: bool,
    scale: torch.Tensor | None = None,
    amax: torch.Tensor | None = None,
    margin: int = 0,
    rowwise: bool = True,
    columnwise: bool = False,
    amax_record: torch.Tensor | None = None,
):
    """:func:`fp8_cast` (``dbias``: :func:`fp8_cast_dbias`) of ``x = pack_columns(parts, groups)``
    without materializing ``x``: ``(q [M, N], q^T [N, M], scale_inv, dbias [N] or None)`` of the
    packed ``x``. The output gradient of a fused QKV projection arrives as the attention's separate
    ``dq``, ``dk``, ``dv``; casting them where they lie saves writing and reading ``x`` (the
    concatenation autograd would otherwise make)."""
    x = pack_columns(parts, groups)
    kwargs = dict(
        scale=scale, amax=amax, margin=margin, rowwise=rowwise, columnwise=columnwise, amax_record=amax_record
    )
    if dbias:
        return fp8_cast_dbias(x, fp8_dtype, **kwargs)
    return (*fp8_cast(x, fp8_dtype, **kwargs), None)


REFERENCE_OPS = {
    "layer_norm": layer_norm,
    "rms_norm": rms_norm,
    "layer_norm_with_residual": layer_norm_with_residual,
    "rms_norm_with_residual": rms_norm_with_residual,
    "rotary_embedding": rotary_embedding,
    "bias_gelu": bias_gelu,
    "swiglu": swiglu,
    "bias_dropout_add": bias_dropout_add,
    "attention": attention,
    "cross_entropy": cross_entropy,
    "cross_entropy_local_stats": cross_entropy_local_stats,
    "cross_entropy_grad_inplace_": cross_entropy_grad_inplace_,
    "adam_step": adam_step,
    "adam_step_flat": adam_step_flat,
    "adam_step_flat_fp8": adam_step_flat_fp8,
    "accumulate_weight_grad": accumulate_weight_grad,
    "fp8_quantize": fp8_quantize,
    "fp8_quantize_flat": fp8_quantize_flat,
    "fp8_dequantize_flat": fp8_dequantize_flat,
    "fp8_amax": fp8_amax,
    "fp8_cast": fp8_cast,
    "fp8_cast_dbias": fp8_cast_dbias,
    "fp8_cast_packed": fp8_cast_packed,
    "fp8_transpose": fp8_transpose,
    "norm_fp8_forward": norm_fp8_forward,
    "norm_backward": norm_backward,
    "act_fp8_forward": act_fp8_forward,
    "act_fp8_backward": act_fp8_backward,
    "scaled_linear_forward": scaled_linear_forward,
    "scaled_linear_dgrad": scaled_linear_dgrad,
    "scaled_linear_wgrad": scaled_linear_wgrad,
}
