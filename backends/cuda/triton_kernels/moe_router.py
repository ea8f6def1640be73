"""The router's top-k (the op table's ``moe_topk_routing``) as one Triton kernel each way.

The reference spends about twenty small kernels a layer on it (the score function, ``topk`` and its
sort, gathers, a softmax over the chosen logits, two scatters into ``[T, E]``); on the OLMoE shape
(8192 tokens, 64 experts, top-8) they were ~90 us of a layer's forward and backward on an H200, while
the routing itself reads and writes a few MiB. Here one program routes ``BLOCK_T`` tokens with the
whole row of ``E`` experts in registers (``E`` padded to a power of two, at most :data:`MAX_EXPERTS`).

Forward, per token (fp32; ``l`` the logits row, ``K`` the top-k, ``c`` the choice scores)::

    softmax, pre_softmax:  s = softmax(l) over all E;  c = s;           w = s[chosen]
    softmax:               c = l;                      w = softmax(l[chosen]) over the K chosen
    sigmoid:               s = sigmoid(l); c = s + bias; w = s[chosen], / (sum_K w + 1e-20) if K > 1
    chosen = the K largest c (ties: the lowest expert, as the reference's torch.topk); w *= scale
    probs = w on the chosen experts, 0 elsewhere;  routing_map = chosen

Backward from ``dprobs`` (``g = scale * dprobs`` on the chosen experts), recomputing from ``l`` and the
map::

    softmax:      dl_j = w_j (g_j - sum_K w g)                   (j chosen; 0 elsewhere)
    pre_softmax:  dl_j = s_j (g_j [j chosen] - sum_K s g)        (every j)
    sigmoid:      ds_j = (g_j - sum_K w g) / (S + 1e-20) if K > 1 else g_j, S = sum_K s;  dl_j = ds_j s_j (1 - s_j)

Group-limited routing (DeepSeek's groups) is not served here: the caller falls back to the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_EXPERTS = 512  # a row of experts is kept in registers
BLOCK_T = 16

SOFTMAX, PRE_SOFTMAX, SIGMOID = 0, 1, 2


@triton.jit
def _scores(logits, cmask, KIND: tl.constexpr):
    """``(s, c)``: the score function of every expert and the choice score before the bias."""
    if KIND == 2:
        s = tl.sigmoid(logits)
        return s, s
    if KIND == 1:
        m = tl.max(logits, axis=1)
        e = tl.where(cmask, tl.exp(logits - m[:, None]), 0.0)
        s = e / tl.sum(e, axis=1)[:, None]
        return s, s
    return logits, logits


@triton.jit
def _choose(c, cols, K: tl.constexpr):
    """The ``K`` largest of each row of ``c`` (padding at -inf), the lowest column on ties."""
    chosen = cols[None, :] < 0
    for _ in tl.static_range(K):
        m = tl.max(c, axis=1)
        first = tl.min(tl.where(c == m[:, None], cols[None, :], 2147483647), axis=1)
        hit = cols[None, :] == first[:, None]
        chosen = chosen | hit
        c = tl.where(hit, float("-inf"), c)
    return chosen


@triton.jit
def _weights(logits, s, chosen, K: tl.constexpr, KIND: tl.constexpr):
    """The chosen experts' weights before the scaling factor (0 elsewhere)."""
    if KIND == 0:
        m = tl.max(tl.where(chosen, logits, float("-inf")), axis=1)
        e = tl.where(chosen, tl.exp(logits - m[:, None]), 0.0)
        return e / tl.sum(e, axis=1)[:, None]
    w = tl.where(chosen, s, 0.0)
    if KIND == 2 and K > 1:
        w = w / (tl.sum(w, axis=1)[:, None] + 1e-20)
    return w


@triton.jit
def _load_logits(LOGITS, T, E, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    """This program's ``BLOCK_T`` rows of logits, fp32, padding at -inf; with the column index, the
    column and element masks and the element offsets."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    cmask = (cols < E)[None, :]
    mask = (rows < T)[:, None] & cmask
    offs = rows.to(tl.int64)[:, None] * E + cols[None, :]
    logits = tl.load(LOGITS + offs, mask=mask, other=float("-inf")).to(tl.float32)
    return cols, cmask, mask, offs, logits


@triton.jit
def _router_fwd_kernel(
    LOGITS, BIAS, PROBS, MAP, T, E, scale,
    K: tl.constexpr, KIND: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    cols, cmask, mask, offs, logits = _load_logits(LOGITS, T, E, BLOCK_T, BLOCK_E)
    s, c = _scores(logits, cmask, KIND)
    if HAS_BIAS:
        c = c + tl.load(BIAS + cols, mask=cols < E, other=0.0).to(tl.float32)[None, :]
    c = tl.where(cmask, c, float("-inf"))
    chosen = _choose(c, cols, K) & cmask
    w = _weights(logits, s, chosen, K, KIND) * scale
    tl.store(PROBS + offs, w, mask=mask)
    tl.store(MAP + offs, chosen.to(tl.int8), mask=mask)


@triton.jit
def _router_bwd_kernel(
    LOGITS, MAP, DPROBS, DLOGITS, T, E, scale,
    K: tl.constexpr, KIND: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    cols, cmask, mask, offs, logits = _load_logits(LOGITS, T, E, BLOCK_T, BLOCK_E)
    chosen = (tl.load(MAP + offs, mask=mask, other=0) != 0) & mask
    g = tl.where(chosen, tl.load(DPROBS + offs, mask=mask, other=0.0).to(tl.float32) * scale, 0.0)
    s, _ = _scores(logits, cmask, KIND)
    if KIND == 0:
        w = _weights(logits, s, chosen, K, KIND)
        dl = w * (g - tl.sum(w * g, axis=1)[:, None])
    elif KIND == 1:
        dl = s * (g - tl.sum(s * g, axis=1)[:, None])
    else:
        if K > 1:
            sel = tl.where(chosen, s, 0.0)
            total = tl.sum(sel, axis=1)[:, None] + 1e-20
            ds = (g - tl.sum(g * sel, axis=1)[:, None] / total) / total
        else:
            ds = g
        dl = tl.where(chosen, ds * s * (1.0 - s), 0.0)
    tl.store(DLOGITS + offs, tl.where(mask, dl, 0.0), mask=mask)


def _kind(score_function: str, pre_softmax: bool) -> int:
    if score_function == "sigmoid":
        return SIGMOID
    return PRE_SOFTMAX if pre_softmax else SOFTMAX


def _block_e(num_experts: int) -> int:
    return max(16, triton.next_power_of_2(num_experts))


def router_forward(logits, topk, kind, scale, expert_bias):
    t, e = logits.shape
    probs = torch.empty((t, e), dtype=torch.float32, device=logits.device)
    routing_map = torch.empty((t, e), dtype=torch.bool, device=logits.device)
    if t == 0:
        return probs, routing_map
    bias = expert_bias if expert_bias is not None else probs
    _router_fwd_kernel[(triton.cdiv(t, BLOCK_T),)](
        logits, bias, probs, routing_map.view(torch.int8), t, e, scale,
        K=topk, KIND=kind, HAS_BIAS=expert_bias is not None, BLOCK_T=BLOCK_T, BLOCK_E=_block_e(e),
    )  # fmt: skip
    return probs, routing_map


def router_backward(logits, routing_map, dprobs, topk, kind, scale):
    t, e = logits.shape
    dlogits = torch.empty_like(logits, dtype=torch.float32)
    if t == 0:
        return dlogits
    _router_bwd_kernel[(triton.cdiv(t, BLOCK_T),)](
        logits, routing_map.view(torch.int8), dprobs.contiguous(), dlogits, t, e, scale,
        K=topk, KIND=kind, BLOCK_T=BLOCK_T, BLOCK_E=_block_e(e),
    )  # fmt: skip
    return dlogits


class TopKRouting(torch.autograd.Function):
    """``(probs, routing_map)`` of ``logits [T, E]`` fp32 contiguous; the map has no gradient."""

    @staticmethod
    def forward(ctx, logits, topk, kind, scale, expert_bias):
        probs, routing_map = router_forward(logits, topk, kind, scale, expert_bias)
        ctx.save_for_backward(logits, routing_map)
        ctx.topk, ctx.kind, ctx.scale = topk, kind, scale
        ctx.mark_non_differentiable(routing_map)
        return probs, routing_map

    @staticmethod
    def backward(ctx, dprobs, _dmap):
        logits, routing_map = ctx.saved_tensors
        dlogits = router_backward(logits, routing_map, dprobs, ctx.topk, ctx.kind, ctx.scale)
        return dlogits, None, None, None, None


def topk_routing(logits, topk, score_function, pre_softmax, scaling_factor, expert_bias):
    """See the module doc; the caller checked the arguments and that the kernel serves them."""
    scale = float(scaling_factor) if scaling_factor else 1.0
    bias = None if expert_bias is None else expert_bias.float().contiguous()
    return TopKRouting.apply(logits, topk, _kind(score_function, pre_softmax), scale, bias)
