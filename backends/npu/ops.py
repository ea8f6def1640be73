"""CANN fused ops behind mcore's op table: each adapter turns mcore's op contract into torch_npu's.

mcore's contract is :mod:`mcore.ops.reference` (layouts, mask polarity, scale, GQA). torch_npu's is its
op-plugin signatures (``op_plugin_functions.yaml``) and the CANN op documentation; the simulated
ops (:mod:`mcore.backends.npu.simulated.ops`) restate both. The differences each adapter bridges:

========================  ===========================================================================
op                        conversion
========================  ===========================================================================
``rms_norm``              ``npu_rms_norm(x, w, epsilon=eps)[0]`` (the op returns ``(y, rstd)``). The
                          NPU multiplies by the weight in fp32 before rounding, the reference after:
                          equal in fp32, one rounding apart in bf16/fp16.
``rotary_embedding``      mcore passes angles, the op wants ``r1 = cos``, ``r2 = sin`` in x's dtype;
                          both are computed once per ``freqs`` tensor and reused by every layer. Only
                          the first ``rot_dim`` channels rotate (``--rotary-percent``); the rest are
                          concatenated back, as MindSpeed does. ``rotary_mode="half"`` is mcore's
                          rotate-half convention.
``swiglu``                ``npu_swiglu(x, dim=-1)``: same gate-first convention, no conversion.
``weighted_swiglu``       ``npu_swiglu(x, dim=-1)`` times the row weights (fp32, rounded to ``x``'s
                          dtype), in an autograd.Function that keeps ``x`` and the weights; backward
                          recomputes ``npu_swiglu`` for the weights' gradient and gets ``dx`` from
                          ``npu_swiglu_backward(dy * w, x, dim=-1)``. 2-D ``[N > 0, 2F]`` with fp32
                          weights only (else the reference).
``attention``             ``npu_fusion_attention`` with layout ``"BNSD"`` (mcore's ``[b, n, s, d]``,
                          so no transpose), ``head_num`` = query heads (K/V keep their ``g`` heads:
                          the op does GQA itself), an explicit ``scale`` (the op's default is 1.0, not
                          1/sqrt(d)) and ``keep_prob = 1 - dropout_p``. Masks: both sides use
                          True = masked, so nothing is inverted. Pure causal attention sends the
                          compressed 2048x2048 ``triu`` mask with ``sparse_mode=2`` (sq == sk) or
                          ``3`` (sq < sk: mcore aligns the causal triangle at the end, the op's
                          "rightDownCausal"); an explicit mask is expanded to B1SS/BNSS, merged with
                          the causal triangle, and sent with ``sparse_mode=0`` and
                          ``next_tockens = sk - sq`` so the band agrees with the mask.
``adam_step``             ``npu_apply_adam_w`` per parameter, ``beta_power = beta ** (step - 1)``;
                          Adam with L2 decay (not decoupled) folds ``wd * p`` into the gradient.
``adam_step_flat``        ``npu_apply_adam_w`` per flat segment for fp32 masters and moments; the
                          precision-aware storage (int16 remainders, bf16 moments) runs the reference.
========================  ===========================================================================

The MoE ops (``grouped_gemm`` on ``npu_grouped_matmul``, ``moe_permute``/``moe_unpermute`` on the
routing-map permute kernels; the router stays the reference) are in :mod:`.moe_ops`, with their table.

Inputs outside what the kernels are documented for (other dtypes, an additive bias/ALiBi, whose
placement inside the op is unverified, more queries than keys under a causal mask, head dims over 768)
go to the reference op, so the table is always correct and fast where it can be.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence
from types import ModuleType

import torch

from mcore.ops import reference

from .cp_ops import BUILDERS as CP_BUILDERS
from .fusion_masks import FLOAT_DTYPES, MAX_TOCKENS, compressed_causal_mask
from .moe_ops import MOE_BUILDERS

PROVIDER = "npu"
"""The provider name the NPU plugin registers its ops under (``table.provider(op)``)."""

# cos/sin broadcast patterns npu_rotary_mul accepts in "half" mode (1 = full leading dim, 0 = size 1):
# BNSD -> 11SD, B1SD, BNSD; BSND -> 1S1D, BS1D, BSND; SBND -> S11D, SB1D, SBND (npu_fusion_attention's mask shapes).
_ROTARY_PATTERNS = {(0, 0, 1), (1, 0, 1), (1, 1, 1), (0, 1, 0), (1, 1, 0), (1, 0, 0)}


class _CosSinCache:
    """cos/sin of the last ``freqs`` tensor seen (every layer rotates q and k with the same one)."""

    def __init__(self) -> None:
        self._freqs: weakref.ref | None = None
        self._key: tuple = ()
        self._value: tuple[torch.Tensor, torch.Tensor] | None = None

    def get(self, freqs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        key = (freqs._version, dtype)
        if (
            self._freqs is not None
            and self._freqs() is freqs
            and self._key == key
            and self._value is not None
            and not freqs.requires_grad
        ):
            return self._value
        angles = freqs.float()
        value = (angles.cos().to(dtype), angles.sin().to(dtype))
        if not freqs.requires_grad:  # a cached graph would be freed by the first backward
            self._freqs, self._key, self._value = weakref.ref(freqs), key, value
        return value


def fusion_attention_mask(
    mask: torch.Tensor, b: int, n: int, sq: int, sk: int, causal: bool
) -> torch.Tensor | None:
    """mcore's broadcastable bool mask (True = masked), merged with the causal triangle if ``causal``,
    as the op's BNSS/B1SS/11SS ``atten_mask``; None when the mask's shape cannot be expressed so."""
    m = mask if mask.dtype == torch.bool else mask.bool()
    while m.dim() < 4:
        m = m.unsqueeze(0)
    if m.dim() != 4 or m.shape[0] not in (1, b) or m.shape[1] not in (1, n):
        return None
    if m.shape[2] not in (1, sq) or m.shape[3] not in (1, sk):
        return None
    m = m.expand(m.shape[0], m.shape[1], sq, sk)
    if causal:
        future = torch.ones(sq, sk, dtype=torch.bool, device=m.device).triu(sk - sq + 1)
        m = m | future
    return m.contiguous()


def _rms_norm_ops(torch_npu: ModuleType) -> dict[str, Callable]:
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """Reference ``rms_norm`` through ``npu_rms_norm`` (mixed dtypes and 1-D go to the reference)."""
        if (
            x.dtype not in FLOAT_DTYPES
            or weight.dtype != x.dtype
            or weight.dim() != 1
            or not 2 <= x.dim() <= 8
        ):
            return reference.rms_norm(x, weight, eps)
        return torch_npu.npu_rms_norm(x, weight, epsilon=eps)[0]

    return {"rms_norm": rms_norm}


def _rotary_serves(x: torch.Tensor, freqs: torch.Tensor) -> bool:
    """Whether ``npu_rotary_mul`` takes ``x`` and the cos/sin of ``freqs`` as they are (rotate-half,
    4-D SBND/BSND/BNSD, an even rotary dim under 896, a broadcast pattern the op accepts)."""
    rot_dim = freqs.shape[-1]
    if (
        x.dim() != 4
        or freqs.dim() != 4
        or x.dtype not in FLOAT_DTYPES
        or rot_dim % 2
        or rot_dim >= 896
        or rot_dim > x.shape[-1]
        or any(f not in (1, s) for f, s in zip(freqs.shape[:3], x.shape[:3]))
    ):
        return False
    pattern = tuple(int(f == s and s != 1) for f, s in zip(freqs.shape[:3], x.shape[:3]))
    return not any(pattern) or pattern in _ROTARY_PATTERNS


def _rotary_ops(torch_npu: ModuleType) -> dict[str, Callable]:
    cache = _CosSinCache()

    def rotary_embedding(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        """Reference ``rotary_embedding`` through ``npu_rotary_mul`` (rotate-half, 4-D SBND/BSND/BNSD)."""
        if not _rotary_serves(x, freqs):
            return reference.rotary_embedding(x, freqs)
        rot_dim = freqs.shape[-1]
        cos, sin = cache.get(freqs, x.dtype)
        if rot_dim == x.shape[-1]:  # q/k arrive as views of the fused QKV output
            return torch_npu.npu_rotary_mul(x.contiguous(), cos, sin, rotary_mode="half")
        rotated = torch_npu.npu_rotary_mul(x[..., :rot_dim].contiguous(), cos, sin, rotary_mode="half")
        return torch.cat((rotated, x[..., rot_dim:]), dim=-1)

    return {"rotary_embedding": rotary_embedding}


def _swiglu_ops(torch_npu: ModuleType) -> dict[str, Callable]:
    def swiglu(x: torch.Tensor) -> torch.Tensor:
        """Reference ``swiglu`` (gate first) through ``npu_swiglu``."""
        if x.dtype not in FLOAT_DTYPES or x.shape[-1] % 2 or not 1 <= x.dim() <= 8:
            return reference.swiglu(x)
        return torch_npu.npu_swiglu(x, dim=-1)

    class WeightedSwiGLU(torch.autograd.Function):
        """``(npu_swiglu(x).float() * w[:, None]).to(x.dtype)``, keeping ``x`` and ``w`` only."""

        @staticmethod
        def forward(ctx, x, weights):
            ctx.save_for_backward(x, weights)
            return (torch_npu.npu_swiglu(x, dim=-1).float() * weights[:, None]).to(x.dtype)

        @staticmethod
        def backward(ctx, dy):
            x, weights = ctx.saved_tensors
            dy32 = dy.float()
            dx = dw = None
            if ctx.needs_input_grad[0]:
                ds = (dy32 * weights[:, None]).to(x.dtype).contiguous()
                dx = torch_npu.npu_swiglu_backward(ds, x, dim=-1)
            if ctx.needs_input_grad[1]:
                dw = (dy32 * torch_npu.npu_swiglu(x, dim=-1).float()).sum(-1)
            return dx, dw

    def weighted_swiglu(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Reference ``weighted_swiglu`` through ``npu_swiglu`` and ``npu_swiglu_backward``."""
        if (
            x.dtype not in FLOAT_DTYPES
            or x.dim() != 2
            or x.shape[0] == 0
            or x.shape[1] % 2
            or weights.dtype != torch.float32
            or weights.shape != (x.shape[0],)
        ):
            return reference.weighted_swiglu(x, weights)
        return WeightedSwiGLU.apply(x.contiguous(), weights.contiguous())

    ops = {"swiglu": swiglu}
    if hasattr(torch_npu, "npu_swiglu_backward"):  # its documented gradient op (torch_npu-api 3.3)
        ops["weighted_swiglu"] = weighted_swiglu
    return ops


def _attention_serves(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias, causal: bool) -> bool:
    """Whether ``npu_fusion_attention`` is documented for these inputs: no additive bias, 4-D, one
    float dtype, equal head dims up to 768, whole query groups, and a key for every causal row (more
    queries than keys leave rows with no visible key: implementation-defined on the NPU)."""
    if (
        bias is not None
        or q.dim() != 4
        or not (q.dtype == k.dtype == v.dtype)
        or q.dtype not in FLOAT_DTYPES
        or q.shape[-1] != k.shape[-1]
        or q.shape[-1] > 768
        or q.shape[1] % k.shape[1]
    ):
        return False
    return not (causal and q.shape[2] > k.shape[2])


def _fusion_attention_kwargs(
    q: torch.Tensor, sk: int, causal: bool, mask: torch.Tensor | None, dropout_p: float, scale: float | None
) -> dict | None:
    """``npu_fusion_attention``'s keyword arguments for mcore's ``attention`` call on ``q [b, n, sq, d]``
    and ``sk`` keys: the explicit scale, ``keep_prob``, and the mask as a sparse mode (none; the
    compressed causal mask; or an explicit mask merged with the causal band). None when the mask's
    shape cannot be expressed."""
    b, n, sq, d = q.shape
    kwargs = {
        "scale": 1.0 / math.sqrt(d) if scale is None else scale,
        "keep_prob": 1.0 - dropout_p,
    }
    if mask is None and not causal:
        pass  # no atten_mask: the op attends to everything
    elif mask is None:
        kwargs["atten_mask"] = compressed_causal_mask(q.device)
        kwargs["sparse_mode"] = 2 if sq == sk else 3
    else:
        full = fusion_attention_mask(mask, b, n, sq, sk, causal)
        if full is None:
            return None
        kwargs.update(atten_mask=full, sparse_mode=0, pre_tockens=MAX_TOCKENS)
        kwargs["next_tockens"] = sk - sq if causal else MAX_TOCKENS
    return kwargs


def _attention_ops(torch_npu: ModuleType) -> dict[str, Callable]:
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
        """Reference ``attention`` ([b, n, s, d], GQA, True = masked) through ``npu_fusion_attention``."""
        kwargs = None
        if _attention_serves(q, k, v, bias, causal):
            kwargs = _fusion_attention_kwargs(q, k.shape[2], causal, mask, dropout_p, scale)
        if kwargs is None:
            return reference.attention(
                q, k, v, causal=causal, mask=mask, bias=bias, dropout_p=dropout_p, scale=scale
            )
        n, g = q.shape[1], k.shape[1]
        if n != g and n > 256:  # the op's GQA limit: give it one K/V head per query head
            k = k.repeat_interleave(n // g, dim=1)
            v = v.repeat_interleave(n // g, dim=1)
        return torch_npu.npu_fusion_attention(q, k, v, n, "BNSD", **kwargs)[0]

    return {"attention": attention}


def _adam_ops(torch_npu: ModuleType) -> dict[str, Callable]:
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
        """Reference ``adam_step`` through ``npu_apply_adam_w`` (one call per parameter)."""
        beta1_power, beta2_power = beta1 ** (step - 1), beta2 ** (step - 1)
        for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
            wd = weight_decay
            if wd and not decoupled_weight_decay:
                g, wd = g.add(p, alpha=wd), 0.0
            torch_npu.npu_apply_adam_w(
                beta1_power, beta2_power, lr, wd, beta1, beta2, eps, g, None, False, False, out=(p, m, v)
            )

    @torch.no_grad()
    def adam_step_flat(
        grads, params, masters, remainders, exp_avgs, exp_avg_sqs, segments, *, step, lrs,
        weight_decays, beta1, beta2, eps, grad_scale=None, skip=None,
    ) -> None:  # fmt: skip
        """Reference ``adam_step_flat`` through ``npu_apply_adam_w``, one call per segment.

        Served for fp32 masters and moments (fp32 parameters, or fp32 masters beside bf16/fp16
        ones); the precision-aware storage (remainders, bf16 moments) runs the reference. The
        kernel has no device-side skip, so a ``skip`` flag (and a device ``step`` counter) is read
        on the host here (one sync).
        """
        fp32_state = remainders is None and exp_avgs.dtype == exp_avg_sqs.dtype == torch.float32
        if not fp32_state or (masters is None and params.dtype != torch.float32):
            reference.adam_step_flat(
                grads, params, masters, remainders, exp_avgs, exp_avg_sqs, segments, step=step,
                lrs=lrs, weight_decays=weight_decays, beta1=beta1, beta2=beta2, eps=eps,
                grad_scale=grad_scale, skip=skip,
            )  # fmt: skip
            return
        if skip is not None and bool(skip):
            return
        if isinstance(step, torch.Tensor):  # the optimizer's device counter (read with the skip)
            step = int(step)
        beta1_power, beta2_power = beta1 ** (step - 1), beta2 ** (step - 1)
        for seg in segments.segments:
            state = slice(seg.state_start, seg.state_start + seg.length)
            buffer = slice(seg.buffer_start, seg.buffer_start + seg.length)
            g = grads[buffer].float()
            if grad_scale is not None:
                g = g * grad_scale
            p = masters[state] if masters is not None else params[buffer]
            torch_npu.npu_apply_adam_w(
                beta1_power, beta2_power, lrs[seg.group], weight_decays[seg.group], beta1, beta2,
                eps, g, None, False, False, out=(p, exp_avgs[state], exp_avg_sqs[state]),
            )  # fmt: skip
            if masters is not None:
                params[buffer].copy_(p)

    return {"adam_step": adam_step, "adam_step_flat": adam_step_flat}


_BUILDERS: tuple[tuple[str, Callable[[ModuleType], dict[str, Callable]]], ...] = (
    ("npu_rms_norm", _rms_norm_ops),
    ("npu_rotary_mul", _rotary_ops),
    ("npu_swiglu", _swiglu_ops),
    ("npu_fusion_attention", _attention_ops),
    ("npu_apply_adam_w", _adam_ops),
    *MOE_BUILDERS,
)
"""The torch_npu kernel each group of adapters needs, and the function that binds them to it."""


def build_npu_ops(torch_npu: ModuleType) -> dict[str, Callable]:
    """The op-table overrides torch_npu can serve, bound to ``torch_npu`` (real or simulated): the
    adapters of every kernel it has (:data:`_BUILDERS`)."""
    ops: dict[str, Callable] = {}
    for kernel, build in (*_BUILDERS, *CP_BUILDERS):
        if hasattr(torch_npu, kernel):
            ops.update(build(torch_npu))
    return ops
