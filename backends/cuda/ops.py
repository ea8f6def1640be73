"""CUDA implementations of table ops. Each matches :mod:`mcore.ops.reference` (tested on the GPU)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F


def attention(q, k, v, *, causal=True, mask=None, bias=None, dropout_p=0.0, scale=None):
    """The reference ``attention`` through ``F.scaled_dot_product_attention`` (flash when it can).

    Layout ``[b, n, s, d]``. torch's boolean mask means *attend* (the opposite of Megatron's), and its
    ``is_causal`` aligns the triangle at the top-left, so when queries and keys differ in length,
    or a mask or bias is given, one additive float mask carries causality, mask and bias together.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    gqa = q.shape[1] != k.shape[1]
    sq, sk = q.shape[-2], k.shape[-2]
    if mask is None and bias is None and (not causal or sq == sk):
        return F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout_p, is_causal=causal, scale=scale, enable_gqa=gqa
        )
    additive = torch.zeros(sq, sk, dtype=q.dtype, device=q.device)
    if bias is not None:
        additive = additive + bias.to(q.dtype)
    neg_inf = torch.finfo(q.dtype).min
    if causal:
        future = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(sk - sq + 1)
        additive = additive.masked_fill(future, neg_inf)
    if mask is not None:
        additive = additive.masked_fill(mask, neg_inf)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=additive, dropout_p=dropout_p, scale=scale, enable_gqa=gqa
    )


@torch.no_grad()
def adam_step(
    params: Sequence[torch.Tensor],
    grads,
    exp_avgs,
    exp_avg_sqs,
    *,
    step,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    decoupled_weight_decay=True,
):
    """The reference ``adam_step`` through torch's fused multi-tensor Adam/AdamW kernel."""
    if not params:
        return
    step_tensor = torch.tensor(float(step), device=params[0].device)
    kernel = torch._fused_adamw_ if decoupled_weight_decay else torch._fused_adam_
    kernel(
        list(params),
        list(grads),
        list(exp_avgs),
        list(exp_avg_sqs),
        [],
        [step_tensor] * len(params),
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        weight_decay=weight_decay,
        eps=eps,
        amsgrad=False,
        maximize=False,
    )


CUDA_OPS = {"attention": attention, "adam_step": adam_step}
