"""SIMULATED torch_npu fused ops: the documented CANN op signatures, computed on the CPU.

Every function mirrors one ``torch_npu.npu_*`` op of op-plugin's ``op_plugin_functions.yaml``
(argument names, spellings such as ``pre_tockens``/``epsilon``, defaults, keyword-only markers,
return arity) and implements the math the CANN op documentation gives, so the
NPU backend's adapters can be checked on a machine without an NPU. The checks the real kernels make
(dtype allow-lists without fp64, layouts, GQA divisibility, the compressed 2048x2048 causal mask of
sparse modes 2/3/4, no ``padding_mask``) raise here too, so an adapter bug fails in CI, not on the
cluster. Nothing here is fast, and nothing here was run against real hardware.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_TOCKENS = 2147483647
COMPRESSED_MASK_SIZE = 2048
FA_LAYOUTS = ("BSH", "SBH", "BSND", "BNSD", "TND")


def _check_dtype(op: str, name: str, t: torch.Tensor, allowed=FLOAT_DTYPES) -> None:
    if t.dtype not in allowed:
        raise TypeError(
            f"{op}: {name} has dtype {t.dtype}, which the NPU kernel does not support "
            f"(supported: {', '.join(str(d) for d in allowed)})"
        )


# --- RMSNorm ------------------------------------------------------------------------------------


def npu_rms_norm(self: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-06):
    """``(y, rstd)``: ``rstd = 1/sqrt(mean(x^2 over gamma's dims) + eps)`` in fp32, ``y = x*rstd*gamma``."""
    _check_dtype("npu_rms_norm", "self", self)
    _check_dtype("npu_rms_norm", "gamma", gamma)
    if not 2 <= self.dim() <= 8:
        raise RuntimeError(f"npu_rms_norm: self must have 2 to 8 dims, got {self.dim()}")
    if tuple(self.shape[self.dim() - gamma.dim() :]) != tuple(gamma.shape):
        raise RuntimeError(
            f"npu_rms_norm: gamma shape {tuple(gamma.shape)} must equal the trailing dims of "
            f"self {tuple(self.shape)}"
        )
    dims = tuple(range(self.dim() - gamma.dim(), self.dim()))
    x32 = self.float()
    rstd = torch.rsqrt(x32.pow(2).mean(dim=dims, keepdim=True) + epsilon)
    y = (x32 * rstd * gamma.float()).to(self.dtype)
    return y, rstd


# --- rotary -------------------------------------------------------------------------------------

# Which of the three leading dims of cos/sin may be full (1) or must be broadcast (0), per the
# jit_compile=False "half" table: BNSD -> 11SD/B1SD/BNSD, BSND -> 1S1D/BS1D/BSND, SBND -> S11D/SB1D/SBND.
_ROTARY_HALF_PATTERNS = {(0, 0, 1), (1, 0, 1), (1, 1, 1), (0, 1, 0), (1, 1, 0), (1, 0, 0)}
_ROTARY_INTERLEAVE_PATTERNS = {(0, 0, 1), (0, 1, 0), (1, 0, 0)}


def npu_rotary_mul(
    input: torch.Tensor,  # noqa: A002 - the real op's parameter name
    r1: torch.Tensor,
    r2: torch.Tensor,
    rotary_mode: str = "half",
    rotate: torch.Tensor | None = None,
) -> torch.Tensor:
    """``r1*x + r2*rot(x)`` with ``r1 = cos``, ``r2 = sin``; ``rot`` = rotate-half or interleave."""
    for name, t in (("input", input), ("r1", r1), ("r2", r2)):
        _check_dtype("npu_rotary_mul", name, t)
    if input.dim() != 4:
        raise RuntimeError(f"npu_rotary_mul: input must be 4-D (BNSD, BSND or SBND), got {input.dim()}-D")
    d = input.shape[-1]
    if d % 2 or d >= 896:
        raise RuntimeError(f"npu_rotary_mul: the last dim must be even and < 896, got {d}")
    if r1.shape != r2.shape or r1.dim() != 4 or r1.shape[-1] != d:
        raise RuntimeError(
            f"npu_rotary_mul: r1 {tuple(r1.shape)} and r2 {tuple(r2.shape)} must be equal 4-D shapes "
            f"ending in {d}"
        )
    if r1.dtype != input.dtype or r2.dtype != input.dtype:
        raise TypeError("npu_rotary_mul: r1 and r2 must have the dtype of input")
    pattern = []
    for size, full in zip(r1.shape[:3], input.shape[:3]):
        if size not in (1, full):
            raise RuntimeError(
                f"npu_rotary_mul: r1 {tuple(r1.shape)} does not broadcast to {tuple(input.shape)}"
            )
        pattern.append(int(size == full and full != 1))
    allowed = _ROTARY_HALF_PATTERNS if rotary_mode == "half" else _ROTARY_INTERLEAVE_PATTERNS
    if rotary_mode not in ("half", "interleave"):
        raise RuntimeError(f"npu_rotary_mul: rotary_mode must be 'half' or 'interleave', got {rotary_mode!r}")
    if tuple(pattern) not in allowed and any(pattern):
        raise RuntimeError(
            f"npu_rotary_mul: cos/sin shape {tuple(r1.shape)} is not a supported broadcast of "
            f"{tuple(input.shape)} in {rotary_mode} mode"
        )
    if rotate is not None:
        rot = input @ rotate
    elif rotary_mode == "half":
        x1, x2 = input.chunk(2, dim=-1)
        rot = torch.cat((-x2, x1), dim=-1)
    else:
        x1, x2 = input[..., 0::2], input[..., 1::2]
        rot = torch.stack((-x2, x1), dim=-1).flatten(-2)
    return r1 * input + r2 * rot


# --- SwiGLU -------------------------------------------------------------------------------------


def npu_swiglu(self: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``silu(a) * b`` for ``a, b = chunk(x, 2, dim)``: the first half is activated."""
    _check_dtype("npu_swiglu", "self", self)
    if self.shape[dim] % 2:
        raise RuntimeError(f"npu_swiglu: size {self.shape[dim]} along dim {dim} must be even")
    a, b = self.chunk(2, dim=dim)
    return (F.silu(a.float()) * b.float()).to(self.dtype)


def npu_swiglu_backward(grad_output: torch.Tensor, self: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The gradient of :func:`npu_swiglu` w.r.t. ``self``: ``[dy b silu'(a), dy silu(a)]`` along ``dim``
    (``grad_output`` has ``self``'s shape with ``dim`` halved and ``self``'s dtype)."""
    _check_dtype("npu_swiglu_backward", "self", self)
    _check_dtype("npu_swiglu_backward", "grad_output", grad_output)
    if grad_output.dtype != self.dtype:
        raise TypeError(
            f"npu_swiglu_backward: grad_output has dtype {grad_output.dtype}, self {self.dtype} (must match)"
        )
    if self.shape[dim] % 2:
        raise RuntimeError(f"npu_swiglu_backward: size {self.shape[dim]} along dim {dim} must be even")
    half = list(self.shape)
    half[dim] //= 2
    if list(grad_output.shape) != half:
        raise RuntimeError(
            f"npu_swiglu_backward: grad_output {tuple(grad_output.shape)} must be self {tuple(self.shape)} "
            f"halved along dim {dim}: {tuple(half)}"
        )
    a, b = (t.float() for t in self.chunk(2, dim=dim))
    dy = grad_output.float()
    sig = torch.sigmoid(a)
    da = dy * b * sig * (1 + a * (1 - sig))
    return torch.cat((da, dy * a * sig), dim=dim).to(self.dtype)


# --- scaled masked softmax -----------------------------------------------------------------------


def npu_scaled_masked_softmax(
    x: torch.Tensor, mask: torch.Tensor, scale: float = 1, fixed_triu_mask: bool = False
) -> torch.Tensor:
    """``softmax(masked_fill(x*scale, mask, -10000))`` in fp32 (mask True = masked; -10000, not -inf)."""
    _check_dtype("npu_scaled_masked_softmax", "x", x)
    if x.dim() != 4:
        raise RuntimeError(f"npu_scaled_masked_softmax: x must be 4-D, got {x.dim()}-D")
    for size in x.shape[-2:]:
        if not (32 <= size <= 4096 and size % 32 == 0):
            raise RuntimeError(
                f"npu_scaled_masked_softmax: the last two dims {tuple(x.shape[-2:])} must be in "
                "[32, 4096] and divisible by 32"
            )
    if mask.dtype not in (torch.bool, torch.uint8):
        raise TypeError(f"npu_scaled_masked_softmax: mask must be bool or uint8, got {mask.dtype}")
    sq, sk = x.shape[-2:]
    m = torch.ones(sq, sk, dtype=torch.bool).triu(1) if fixed_triu_mask else mask.bool()
    y = (x.float() * scale).masked_fill(m, -10000.0)
    return torch.softmax(y, dim=-1).to(x.dtype)


# --- fusion attention ---------------------------------------------------------------------------


def _compressed_causal_mask() -> torch.Tensor:
    return torch.ones(COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE, dtype=torch.bool).triu(1)


def _check_compressed(mask: torch.Tensor | None, sparse_mode: int) -> None:
    if mask is None:
        return
    if tuple(mask.shape) != (COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE):
        raise RuntimeError(
            f"npu_fusion_attention: sparse_mode={sparse_mode} needs the compressed "
            f"{COMPRESSED_MASK_SIZE}x{COMPRESSED_MASK_SIZE} triu(ones, 1) mask, got {tuple(mask.shape)}"
        )
    if not torch.equal(mask.bool(), _compressed_causal_mask()):
        raise RuntimeError(
            f"npu_fusion_attention: sparse_mode={sparse_mode}: the compressed mask must be "
            "triu(ones(2048, 2048), diagonal=1) with True = masked"
        )


def _band(sq: int, sk: int, pre: int, nxt: int, shift: int = 0) -> torch.Tensor:
    """True where key j is outside ``-pre <= j - i - shift <= nxt`` (masked)."""
    i = torch.arange(sq).unsqueeze(1)
    j = torch.arange(sk).unsqueeze(0)
    rel = j - i - shift
    return (rel > nxt) | (rel < -pre)


def _block_mask(
    sq: int, sk: int, atten_mask: torch.Tensor | None, sparse_mode: int, pre: int, nxt: int
) -> torch.Tensor | None:
    """The mask (True = masked) the op applies to one [.., sq, sk] block, per sparse_mode."""
    if atten_mask is None:
        return None  # documented: without a mask, sparse_mode and the band are ignored
    if sparse_mode == 0:
        return atten_mask.bool() | _band(sq, sk, pre, nxt)
    if sparse_mode == 1:
        return atten_mask.bool()
    if sparse_mode == 2:
        return _band(sq, sk, MAX_TOCKENS, 0)
    if sparse_mode == 3:
        return _band(sq, sk, MAX_TOCKENS, 0, shift=sk - sq)
    if sparse_mode == 4:
        band = _band(sq, sk, pre, nxt, shift=sk - sq)
        if band.all():
            raise RuntimeError("npu_fusion_attention: sparse_mode=4 with an empty band")
        return band
    raise NotImplementedError(f"simulated npu_fusion_attention does not implement sparse_mode={sparse_mode}")


def _attend(q, k, v, mask, scale: float, keep_prob: float):
    """q [B,N,Sq,D], k/v [B,N,Sk,D] (heads already repeated); mask broadcastable, True = masked."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(mask, float("-inf"))
    m = s.detach().amax(dim=-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # fully masked rows: output 0
    p = torch.exp(s - m)
    row_sum = p.sum(dim=-1, keepdim=True)
    probs = p / row_sum.clamp_min(torch.finfo(torch.float32).tiny)
    if keep_prob < 1.0:
        probs = probs * torch.bernoulli(torch.full_like(probs, keep_prob)) / keep_prob
    out = torch.matmul(probs, v.float())
    return out, m.squeeze(-1), row_sum.squeeze(-1)


def _to_bnsd(t: torch.Tensor, layout: str, heads: int) -> torch.Tensor:
    if layout == "BNSD":
        return t
    if layout == "BSND":
        return t.transpose(1, 2)
    if layout == "BSH":
        b, s, h = t.shape
        return t.view(b, s, heads, h // heads).transpose(1, 2)
    if layout == "SBH":
        s, b, h = t.shape
        return t.view(s, b, heads, h // heads).permute(1, 2, 0, 3)
    raise AssertionError(layout)


def _from_bnsd(t: torch.Tensor, layout: str) -> torch.Tensor:
    b, n, s, d = t.shape
    if layout == "BNSD":
        return t
    if layout == "BSND":
        return t.transpose(1, 2)
    if layout == "BSH":
        return t.transpose(1, 2).reshape(b, s, n * d)
    if layout == "SBH":
        return t.permute(2, 0, 1, 3).reshape(s, b, n * d)
    raise AssertionError(layout)


def _heads(t: torch.Tensor, layout: str, head_dim: int | None = None, heads: int | None = None):
    """(heads, head_dim) of a tensor in ``layout``. BSH/SBH carry H = N*D: give D (or N) to split it."""
    if layout in ("BSH", "SBH"):
        if head_dim is not None:
            return t.shape[-1] // head_dim, head_dim
        return heads, t.shape[-1] // heads
    if layout == "BNSD":
        return t.shape[1], t.shape[3]
    return t.shape[-2], t.shape[-1]  # BSND, TND


def _seq_len(t: torch.Tensor, layout: str) -> int:
    """The sequence length of a (non-TND) tensor in ``layout``."""
    return {"BNSD": t.shape[2], "BSND": t.shape[1], "BSH": t.shape[1], "SBH": t.shape[0]}[layout]


def _check_cumulative(name: str, lengths, total: int) -> list[int]:
    if lengths is None:
        raise RuntimeError(f"npu_fusion_attention: input_layout 'TND' needs {name}")
    if isinstance(lengths, torch.Tensor) or not all(isinstance(x, int) for x in lengths):
        raise TypeError(f"npu_fusion_attention: {name} must be a Python list of ints (call .tolist())")
    if any(b < a for a, b in zip([0, *lengths], lengths)) or lengths[-1] != total:
        raise RuntimeError(
            f"npu_fusion_attention: {name}={list(lengths)} must be cumulative end offsets ending at T={total}"
        )
    return list(lengths)


def npu_fusion_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    head_num: int,
    input_layout: str,
    pse: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None,
    atten_mask: torch.Tensor | None = None,
    scale: float = 1.0,
    keep_prob: float = 1.0,
    pre_tockens: int = MAX_TOCKENS,
    next_tockens: int = MAX_TOCKENS,
    inner_precise: int = 0,
    prefix: Sequence[int] | None = None,
    actual_seq_qlen: Sequence[int] | None = None,
    actual_seq_kvlen: Sequence[int] | None = None,
    sparse_mode: int = 0,
    gen_mask_parallel: bool = True,
    sync: bool = False,
    softmax_layout: str = "",
):
    """FlashAttention: returns ``(out, softmax_max, softmax_sum, softmax_out, seed, offset, numels)``.
    The parameters are the real op's (torch_npu 2.13's ``_op_plugin_docs.py``; ``sink``, ``dropout_mask``,
    ``seed`` and ``offset`` belong to ``npu_fusion_attention_v2`` only: tests/npu/test_npu_api_docs.py).

    ``head_num`` is the number of *query* heads; K/V may carry fewer (GQA, ``Nq % Nkv == 0``).
    ``atten_mask`` is bool/uint8 with True = masked; ``scale`` multiplies QK^T (default 1.0, so the
    caller passes 1/sqrt(d)). softmax_max/sum are ``[B, N, Sq, 8]`` fp32 (``[T, N, 8]`` for TND).
    """
    _check_fusion_arguments(
        query, key, value, input_layout, pse, padding_mask, atten_mask, keep_prob, prefix, sparse_mode,
        softmax_layout, None, None,
    )  # fmt: skip
    nq, group = _fusion_heads(query, key, value, head_num, input_layout)
    if input_layout == "TND":
        return _fusion_attention_tnd(
            query, key, value, nq, group, atten_mask, scale, keep_prob, pre_tockens, next_tockens,
            actual_seq_qlen, actual_seq_kvlen, sparse_mode, 0, 0,
        )  # fmt: skip
    q = _to_bnsd(query, input_layout, nq)
    k = _to_bnsd(key, input_layout, nq // group).repeat_interleave(group, dim=1)
    v = _to_bnsd(value, input_layout, nq // group).repeat_interleave(group, dim=1)
    b, _, sq, _ = q.shape
    sk = k.shape[2]
    if atten_mask is not None and sparse_mode in (0, 1):
        _check_mask_shape(atten_mask, b, nq, sq, sk)
    mask = _block_mask(sq, sk, atten_mask, sparse_mode, pre_tockens, next_tockens)
    out, m, row_sum = _attend(q, k, v, mask, scale, keep_prob)
    out = _from_bnsd(out.to(query.dtype), input_layout)
    softmax_max = m.unsqueeze(-1).expand(*m.shape, 8).contiguous().detach()
    softmax_sum = row_sum.unsqueeze(-1).expand(*row_sum.shape, 8).contiguous().detach()
    return out, softmax_max, softmax_sum, torch.empty(0, dtype=query.dtype), 0, 0, 0


def _check_fusion_arguments(
    query, key, value, input_layout, pse, padding_mask, atten_mask, keep_prob, prefix, sparse_mode,
    softmax_layout, sink, dropout_mask,
) -> None:  # fmt: skip
    """:func:`npu_fusion_attention`'s checks of everything but the shapes: layout, dtypes, the
    unsupported and unsimulated arguments, ``keep_prob``, ``sparse_mode`` and its mask."""
    op = "npu_fusion_attention"
    if input_layout not in FA_LAYOUTS:
        raise RuntimeError(f"{op}: input_layout must be one of {FA_LAYOUTS}, got {input_layout!r}")
    for name, t in (("query", query), ("key", key), ("value", value)):
        _check_dtype(op, name, t)
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(f"{op}: query, key and value must share one dtype")
    if padding_mask is not None:
        raise RuntimeError(f"{op}: padding_mask is not supported; pass None")
    if pse is not None or sink is not None or dropout_mask is not None or prefix is not None:
        raise NotImplementedError(f"simulated {op}: pse, sink, dropout_mask and prefix are not simulated")
    if not 0.0 < keep_prob <= 1.0:
        raise RuntimeError(f"{op}: keep_prob must be in (0, 1], got {keep_prob}")
    if not 0 <= sparse_mode <= 8:
        raise RuntimeError(f"{op}: sparse_mode must be in 0..8, got {sparse_mode}")
    if softmax_layout not in ("", "TND") or (softmax_layout == "TND" and input_layout != "TND"):
        raise RuntimeError(f"{op}: softmax_layout {softmax_layout!r} is only allowed as 'TND' with TND input")
    if atten_mask is not None and atten_mask.dtype not in (torch.bool, torch.uint8):
        raise TypeError(f"{op}: atten_mask must be bool or uint8 (True = masked), got {atten_mask.dtype}")
    if sparse_mode in (2, 3, 4, 7, 8):
        _check_compressed(atten_mask, sparse_mode)


def _fusion_heads(query, key, value, head_num: int, input_layout: str) -> tuple[int, int]:
    """``(query heads, query heads per key/value head)`` of :func:`npu_fusion_attention`'s inputs, after
    the op's checks of their ranks, head dims (``Dq == Dk >= Dv``, at most 768) and GQA grouping."""
    op = "npu_fusion_attention"
    if input_layout in ("BSH", "SBH"):
        if query.dim() != 3 or query.shape[-1] % head_num:
            raise RuntimeError(f"{op}: {input_layout} query {tuple(query.shape)} with head_num={head_num}")
        head_dim = query.shape[-1] // head_num
    else:
        expected = 3 if input_layout == "TND" else 4
        if query.dim() != expected:
            raise RuntimeError(f"{op}: {input_layout} needs {expected}-D tensors, got {query.dim()}-D query")
        head_dim = None
    nq, dq = _heads(query, input_layout, head_dim=head_dim)
    nk, dk = _heads(key, input_layout, head_dim=head_dim)
    nv, dv = _heads(value, input_layout, heads=nk)
    if nq != head_num:
        raise RuntimeError(f"{op}: head_num={head_num} but query has {nq} heads in {input_layout}")
    if dq != dk or dk < dv or not 1 <= dq <= 768:
        raise RuntimeError(f"{op}: head dims q={dq}, k={dk}, v={dv} must satisfy Dq == Dk >= Dv, D <= 768")
    if nk != nv or nq % nk:
        raise RuntimeError(f"{op}: query heads {nq} must be a multiple of key/value heads {nk} (GQA)")
    if nq != nk and nq > 256:
        raise RuntimeError(f"{op}: GQA needs head_num <= 256, got {nq}")
    return nq, nq // nk


def _check_mask_shape(atten_mask: torch.Tensor, b: int, nq: int, sq: int, sk: int) -> None:
    """An explicit (sparse mode 0/1) ``atten_mask`` is BNSS, B1SS, 11SS or SS."""
    shape = tuple(atten_mask.shape)
    ok = shape == (sq, sk) or (
        len(shape) == 4 and shape[2:] == (sq, sk) and shape[0] in (1, b) and shape[1] in (1, nq)
    )
    if not ok:
        raise RuntimeError(
            f"npu_fusion_attention: atten_mask {shape} must be BNSS, B1SS, 11SS or SS for B={b}, N={nq}, "
            f"Sq={sq}, Skv={sk}"
        )


def _fusion_attention_tnd(
    query,
    key,
    value,
    nq,
    group,
    atten_mask,
    scale,
    keep_prob,
    pre,
    nxt,
    qlen,
    kvlen,
    sparse_mode,
    seed,
    offset,
):
    cum_q = _check_cumulative("actual_seq_qlen", qlen, query.shape[0])
    cum_k = _check_cumulative("actual_seq_kvlen", kvlen, key.shape[0])
    if len(cum_q) != len(cum_k):
        raise RuntimeError("npu_fusion_attention: actual_seq_qlen and actual_seq_kvlen differ in length")
    if atten_mask is not None and sparse_mode in (0, 1) and atten_mask.dim() != 2:
        raise RuntimeError("npu_fusion_attention: TND accepts only an SS (maxSq x maxSkv) atten_mask")
    outs, maxes, sums = [], [], []
    for (q0, q1), (k0, k1) in zip(zip([0, *cum_q], cum_q), zip([0, *cum_k], cum_k)):
        if q1 == q0:
            continue
        q = query[q0:q1].transpose(0, 1).unsqueeze(0)
        k = key[k0:k1].transpose(0, 1).unsqueeze(0).repeat_interleave(group, dim=1)
        v = value[k0:k1].transpose(0, 1).unsqueeze(0).repeat_interleave(group, dim=1)
        sq, sk = q1 - q0, k1 - k0
        block_mask = atten_mask[:sq, :sk] if atten_mask is not None and sparse_mode in (0, 1) else atten_mask
        mask = _block_mask(sq, sk, block_mask, sparse_mode, pre, nxt)
        if mask is not None and mask.all(dim=-1).any():
            raise RuntimeError("npu_fusion_attention: TND does not allow fully masked rows (padding)")
        out, m, row_sum = _attend(q, k, v, mask, scale, keep_prob)
        outs.append(out[0].transpose(0, 1))
        maxes.append(m[0].transpose(0, 1))
        sums.append(row_sum[0].transpose(0, 1))
    out = torch.cat(outs).to(query.dtype)
    softmax_max = torch.cat(maxes).unsqueeze(-1).expand(-1, -1, 8).contiguous().detach()
    softmax_sum = torch.cat(sums).unsqueeze(-1).expand(-1, -1, 8).contiguous().detach()
    return out, softmax_max, softmax_sum, torch.empty(0, dtype=query.dtype), seed, offset, 0


def npu_fusion_attention_grad(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dy: torch.Tensor,
    head_num: int,
    input_layout: str,
    *,
    pse: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None,
    atten_mask: torch.Tensor | None = None,
    softmax_max: torch.Tensor | None = None,
    softmax_sum: torch.Tensor | None = None,
    softmax_in: torch.Tensor | None = None,
    attention_in: torch.Tensor | None = None,
    scale_value: float = 1.0,
    keep_prob: float = 1.0,
    pre_tockens: int = MAX_TOCKENS,
    next_tockens: int = MAX_TOCKENS,
    inner_precise: int = 0,
    seed: int = 0,
    offset: int = 0,
    numels: int = 0,
    prefix: Sequence[int] | None = None,
    actual_seq_qlen: Sequence[int] | None = None,
    actual_seq_kvlen: Sequence[int] | None = None,
    sparse_mode: int = 0,
    gen_mask_parallel: bool = True,
    sync: bool = False,
    softmax_layout: str = "",
    sink: torch.Tensor | None = None,
):
    """``(dq, dk, dv, dpse, dsink)`` of :func:`npu_fusion_attention` (keep_prob must be 1). Given the
    forward's ``softmax_max``, ``softmax_sum`` and ``attention_in`` (as the real kernel takes them; ring
    attention passes the merged ones), from those (:func:`.ring_ops.fusion_attention_grad_from_stats`);
    without them (or in TND), through autograd of a recomputed forward."""
    if keep_prob != 1.0:
        raise NotImplementedError("simulated npu_fusion_attention_grad cannot replay the Philox dropout mask")
    if sink is not None:
        raise NotImplementedError("simulated npu_fusion_attention_grad: sink is not simulated")
    stats = (softmax_max, softmax_sum, attention_in)
    if input_layout != "TND" and all(t is not None for t in stats):
        from mcore.backends.npu.simulated.ring_ops import fusion_attention_grad_from_stats

        _check_fusion_arguments(
            query, key, value, input_layout, pse, padding_mask, atten_mask, keep_prob, prefix, sparse_mode,
            softmax_layout, sink, None,
        )  # fmt: skip
        nq, _ = _fusion_heads(query, key, value, head_num, input_layout)
        sq, sk = _seq_len(query, input_layout), _seq_len(key, input_layout)
        if atten_mask is not None and sparse_mode in (0, 1):
            batch = query.shape[1] if input_layout == "SBH" else query.shape[0]
            _check_mask_shape(atten_mask, batch, nq, sq, sk)
        mask = _block_mask(sq, sk, atten_mask, sparse_mode, pre_tockens, next_tockens)
        grads = fusion_attention_grad_from_stats(
            query, key, value, dy, nq, input_layout, mask, scale_value, softmax_max, softmax_sum, attention_in
        )
        empty = torch.empty(0, dtype=query.dtype)
        return (*grads, empty, empty)
    with torch.enable_grad():
        q, k, v = (t.detach().requires_grad_() for t in (query, key, value))
        out = npu_fusion_attention(
            q, k, v, head_num, input_layout, pse=pse, padding_mask=padding_mask, atten_mask=atten_mask,
            scale=scale_value, pre_tockens=pre_tockens, next_tockens=next_tockens, prefix=prefix,
            actual_seq_qlen=actual_seq_qlen, actual_seq_kvlen=actual_seq_kvlen, sparse_mode=sparse_mode,
            softmax_layout=softmax_layout,
        )[0]  # fmt: skip
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), dy)
    empty = torch.empty(0, dtype=query.dtype)
    return dq, dk, dv, empty, empty


# --- AdamW --------------------------------------------------------------------------------------


@torch.no_grad()
def npu_apply_adam_w(
    beta1_power,
    beta2_power,
    lr,
    weight_decay,
    beta1,
    beta2,
    epsilon,
    grad: torch.Tensor,
    max_grad_norm: torch.Tensor | None,
    amsgrad: bool | None,
    maximize: bool | None,
    *,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
):
    """In-place AdamW on ``out=(var, m, v)``; ``beta*_power`` are ``beta ** (t - 1)`` (t = this step)."""
    var, m, v = out
    for name, t in (("grad", grad), ("var", var), ("m", m), ("v", v)):
        _check_dtype("npu_apply_adam_w", name, t)
    if amsgrad:
        raise NotImplementedError("simulated npu_apply_adam_w does not implement amsgrad")
    g = -grad if maximize else grad
    m.mul_(beta1).add_(g, alpha=1.0 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    bias1 = 1.0 - beta1_power * beta1
    bias2 = 1.0 - beta2_power * beta2
    if weight_decay:
        var.mul_(1.0 - lr * weight_decay)
    denom = (v / bias2).sqrt_().add_(epsilon)
    var.addcdiv_(m, denom, value=-lr / bias1)
    return var, m, v


def npu_gelu(self: torch.Tensor, *, approximate: str = "none") -> torch.Tensor:
    _check_dtype("npu_gelu", "self", self)
    return F.gelu(self, approximate=approximate)


__all__ = [
    "npu_apply_adam_w",
    "npu_fusion_attention",
    "npu_fusion_attention_grad",
    "npu_gelu",
    "npu_rms_norm",
    "npu_rotary_mul",
    "npu_scaled_masked_softmax",
    "npu_swiglu",
    "npu_swiglu_backward",
]
